#!/usr/bin/env bash
# Issue 10 on the GPU machine whose system cuDNN is 9.14 (repo root, GPU kit staged, the
# te-gqa-fix wheel carried in .whl-mcore/ so that its start-up file is really installed):
# which cuDNN TE runs through the installed hook with TE_GQA_FIX_CUDNN unset and =auto,
# doctor in both, what the route adds to start-up, the head-dim and guard tests without the
# setting, and the whole GPU suite with it. Results: $OUT/route.tgz.
set -uo pipefail
res=${RES:-/tmp/cudnn-route}
out=${OUT:-$(dirname "$res")}
mkdir -p "$res" "$out"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1
python3 -m pip install -q --no-index --no-deps --force-reinstall .whl-mcore/te_gqa_fix-*.whl \
  >"$res/pip.log" 2>&1
echo "install te-gqa-fix wheel: exit $?"
# shellcheck disable=SC1091
GPU_KIT_CUDNN=system source .gpu-kit/env.sh
python3 -c 'import te_gqa_fix.autopatch as a; print("start-up file:", a.find_pth())'
for s in unset auto; do
  (
    [ "$s" = auto ] && export TE_GQA_FIX_CUDNN=auto
    timeout 120 python3 -c '
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
import transformer_engine.pytorch, transformer_engine_torch as tex
r = sys.modules.get("te_gqa_fix.cudnn")
print("TE cuDNN", tex.get_cudnn_version(), "route", r.route_state() if r else None)
print("mapped", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcudnn.so" in l}))'
  ) >"$res/te-cudnn-$s.txt" 2>&1
  echo "TE_GQA_FIX_CUDNN=$s: exit $?: $(grep 'TE cuDNN' "$res/te-cudnn-$s.txt" | cut -c1-200)"
done
timeout 150 python3 -m te_gqa_fix doctor >"$res/doctor-unset.txt" 2>&1
echo "doctor (unset): exit $?"
TE_GQA_FIX_CUDNN=auto timeout 150 python3 -m te_gqa_fix doctor >"$res/doctor-auto.txt" 2>&1
echo "doctor (TE_GQA_FIX_CUDNN=auto): exit $?"
TE_GQA_FIX_CUDNN=auto timeout 150 python3 -m te_gqa_fix doctor --json >"$res/doctor-auto.json" 2>/dev/null
timeout 240 python3 benchmarks/startup_cudnn.py --repeat "${STARTUP_REPEAT:-3}" --out "$res" 2>&1 | tail -4
TE_GQA_FIX_RECORD="$res/records-unset.jsonl" timeout 150 python3 -m pytest tests/gpu/test_head_dim.py \
  -m gpu -q -p no:cacheprovider -rxXs >"$res/pytest-headdim-unset.log" 2>&1
echo "head-dim + guard tests (unset): exit $?"; tail -n 3 "$res/pytest-headdim-unset.log"
TE_GQA_FIX_CUDNN=auto TE_GQA_FIX_RECORD="$res/records-auto.jsonl" timeout "${SUITE_TIMEOUT:-240}" \
  python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rxXs >"$res/pytest-auto.log" 2>&1
echo "GPU suite (TE_GQA_FIX_CUDNN=auto): exit $?"; tail -n 3 "$res/pytest-auto.log"
tar czf "$out/route.tgz" -C "$(dirname "$res")" "$(basename "$res")"
