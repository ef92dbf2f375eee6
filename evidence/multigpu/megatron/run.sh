#!/usr/bin/env bash
# Issue 11 on the GPU machine (2 GPUs): Megatron-Core training, THD + GQA + CP 2, under
#   a  cuDNN 9.14 (system), fix off        b  cuDNN 9.14, TE_GQA_FIX_AUTOPATCH=1
#   c  cuDNN 9.19 (pip), fix off           d  CP 1 on one GPU (system cuDNN, fix on)
# and the same with --poison (allocator-poisoning trigger) for a, b and c, then
# evidence/multigpu/megatron/check.py. Run from the repo root with the GPU kit staged (TE in
# /tmp/te-site) and .whl-mcore/ carried (evidence/multigpu/megatron/stage_mcore.sh).
# Everything lands in $RES (default /tmp/megatron-results), packed as $OUT/megatron.tgz;
# summary.md is also copied to $OUT. Exit status: check.py's.
# Knobs: STEPS (24), RUNS ("a b c d a_poison b_poison c_poison"), RUN_TIMEOUT (110 s).
set -uo pipefail
res=${RES:-/tmp/megatron-results}
out=${OUT:-$(dirname "$res")}
steps=${STEPS:-24}
runs=${RUNS:-a b c d a_poison b_poison c_poison}
mkdir -p "$res" "$out"
rm -f "$res"/*.json "$res"/*.log
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1

# Megatron-Core (only the wheel: everything it imports is already there, or TE from the kit).
if [ ! -d /tmp/mcore-site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore-site \
    .whl-mcore/megatron_core-*.whl || { echo "megatron-core install failed"; exit 3; }
fi
export PYTHONPATH=/tmp/mcore-site${PYTHONPATH:+:$PYTHONPATH}

# te-gqa-fix installed with its start-up file (the zero-code path under test).
pth_dir() { python3 -c 'import site,sys,os; print(next((d for d in site.getsitepackages()+[site.getusersitepackages()] if os.path.exists(os.path.join(d,"te_gqa_fix_autopatch.pth"))), ""))'; }
if [ -z "$(pth_dir)" ]; then
  if ls .whl-mcore/te_gqa_fix-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps .whl-mcore/te_gqa_fix-*.whl
  else
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
  fi
fi
echo "te_gqa_fix_autopatch.pth in: $(pth_dir)" | tee "$res/preflight.txt"
(
  # shellcheck disable=SC1091
  source .gpu-kit/env.sh
  TE_GQA_FIX_AUTOPATCH=1 timeout 120 python3 -c '
import transformer_engine.pytorch, _te_gqa_fix_autopatch as a, megatron.core as m
print("start-up hook state:", a.state()); print("megatron-core", m.__version__)
assert a.state()["fired"], "start-up hook did not fire"' 2>&1 | tee -a "$res/preflight.txt"
) || echo "PREFLIGHT FAILED (see $res/preflight.txt)"

ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for name in $runs; do
  case ${name%%_*} in
    a) build=system fix=0 nproc=2 ;;
    b) build=system fix=1 nproc=2 ;;
    c) build=pip fix=0 nproc=2 ;;
    d) build=system fix=1 nproc=1 ;;
    *) echo "unknown run $name"; continue ;;
  esac
  extra=()
  [ "${name#*_}" = poison ] && extra=(--poison)
  if [ "$nproc" -gt "$ngpu" ]; then echo "$name: needs $nproc GPUs, $ngpu here: skipped"; continue; fi
  t0=$(date +%s)
  (
    export GPU_KIT_CUDNN=$build TE_GQA_FIX_AUTOPATCH=$fix
    # shellcheck disable=SC1091
    source .gpu-kit/env.sh
    timeout "${RUN_TIMEOUT:-110}" torchrun --standalone --nproc-per-node "$nproc" \
      examples/megatron_core.py --cp "$nproc" --steps "$steps" --out "$res/$name.json" "${extra[@]}" \
      >"$res/$name.log" 2>&1
  )
  rc=$?
  echo "$name (cuDNN $build, fix $fix, $nproc GPU${extra[*]:+, poison}): exit $rc, $(($(date +%s) - t0)) s"
  grep -E "^ *[0-9]+ " "$res/$name.log" | tail -3
  [ "$rc" -ne 0 ] && tail -25 "$res/$name.log"
done

python3 evidence/multigpu/megatron/check.py "$res" >"$res/check.txt" 2>&1
rc=$?
cat "$res/check.txt"
cp "$res/summary.md" "$out/megatron_summary.md" 2>/dev/null
tar czf "$out/megatron.tgz" -C "$(dirname "$res")" "$(basename "$res")"
echo "results in $out/megatron.tgz (check.py exit $rc)"
exit $rc
