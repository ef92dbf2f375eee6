#!/usr/bin/env bash
# Everything docs/validation.md shows, on the GPU machine (repository root, GPU kit staged;
# 2 GPUs for the context-parallel part, 2 GPUs and .whl-mcore/ for Megatron-Core):
#   validation  the GPU tests and doctor on each build (evidence/run_validation.sh)
#   cp          tests/multigpu/cp_check.py under torchrun, each build
#   examples    examples/seed_repro.py, drop_in.py (and context_parallel.py on 2 GPUs)
#   megatron    tests/multigpu/megatron/run.sh
# Knobs: PARTS (default "validation cp examples"), BUILDS (default "system pip route"; add
# cudnn927 once tests/gpu/cudnn_kit.sh has staged cuDNN 9.27),
# CP_ARGS. Raw outputs stay in /tmp between commands on one warm machine, so a run may be
# split over several commands: the last one's data file holds every part.
# Brings back $OUT/validation.jsonl (commit as docs/data/validation.jsonl) and
# $OUT/validation.md (the page it renders to: docs/validation.md).
set -uo pipefail
# shellcheck source=evidence/builds.sh
source evidence/builds.sh
out=${OUT:-/tmp/te-gqa-fix-out}
res=${RES:-/tmp/te-gqa-fix-validation}
extra=/tmp/te-gqa-fix-extra
mres=/tmp/te-gqa-fix-megatron
mkdir -p "$out" "$extra"
parts=" ${PARTS:-validation cp examples} "
builds=${BUILDS:-system pip route}
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[[ $parts == *" validation "* ]] && RES=$res BUILDS=$builds bash evidence/run_validation.sh
for build in $builds; do
  (
    use_build "$build"
    if [ "$ngpu" -ge 2 ] && [[ $parts == *" cp "* ]]; then
      timeout "${CP_TIMEOUT:-200}" torchrun --standalone --nproc-per-node "$ngpu" \
        tests/multigpu/cp_check.py --out "$extra" --tag "$build" ${CP_ARGS:-} >"$extra/cp-$build.log" 2>&1
      echo "cp_check ($build, $ngpu ranks): exit $?"
    fi
    [[ $parts == *" examples "* ]] || exit 0
    for ex in seed_repro drop_in; do
      timeout 120 python3 "examples/$ex.py" >"$extra/$ex-$build.log" 2>&1
      rc=$?; echo "exit $rc" >>"$extra/$ex-$build.log"; echo "examples/$ex.py ($build): exit $rc"
    done
    if [ "$ngpu" -ge 2 ]; then
      timeout 120 torchrun --standalone --nproc-per-node "$ngpu" examples/context_parallel.py \
        >"$extra/context_parallel-$build.log" 2>&1
      rc=$?; echo "exit $rc" >>"$extra/context_parallel-$build.log"
      echo "examples/context_parallel.py ($build): exit $rc"
    fi
  )
done
if [[ $parts == *" megatron "* ]]; then
  RES=$mres OUT=$out bash tests/multigpu/megatron/run.sh
  echo "megatron: exit $?"
fi
command="bash evidence/run_all.sh"  # with the knobs this run was given
for knob in CP_ARGS PYTEST_ARGS PYTEST_TIMEOUT BUILDS PARTS; do
  [ -n "${!knob:-}" ] && command="$knob=${!knob@Q} $command"
done
python3 evidence/validation_report.py collect --tests "$res" --builds "$(echo $builds | tr ' ' ',')" \
  --extra "$extra" --megatron "$mres" --command "${COMMAND:-$command}" \
  -o "$out/validation.jsonl"
python3 evidence/validation_report.py render "$out/validation.jsonl" -o "$out/validation.md"
echo "data file $out/validation.jsonl, page $out/validation.md"
