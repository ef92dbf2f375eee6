#!/usr/bin/env bash
# Zero-code activation: turn te-gqa-fix on for an unmodified training script under torchrun.
#
# `pip install te-gqa-fix` puts a start-up file (te_gqa_fix_autopatch.pth) in site-packages.
# With TE_GQA_FIX_AUTOPATCH set, every Python process started with this environment (the
# torchrun launcher and each worker it spawns) patches Transformer Engine the moment
# `transformer_engine.pytorch` is imported; TE's own call sites (DotProductAttention, the
# context-parallel paths) then use the fixed fused_attn_bwd. Nothing in train.py changes.
#
#   TE_GQA_FIX_AUTOPATCH=1       on; a failure to patch is logged and training goes on
#   TE_GQA_FIX_AUTOPATCH=strict  on; a failure to patch stops the job at `import transformer_engine`
#
# Usage: examples/startup_patch.sh train.py [training args...]
#        NPROC=8 examples/startup_patch.sh pretrain_gpt.py --context-parallel-size 2 ...
# Exit status 2, with one line on stderr naming it, where something it needs is missing.
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: examples/startup_patch.sh train.py [training args...]" >&2
  exit 2
fi

# 0. What this needs: te-gqa-fix, Transformer Engine, a CUDA GPU, torchrun.
lacking=$(python - <<'PY'
import shutil
lacking = []
try:
    import te_gqa_fix  # noqa: F401
except Exception as exc:
    lacking.append(f"te-gqa-fix ({type(exc).__name__}: {exc})")
try:
    import torch
    if not torch.cuda.is_available():
        lacking.append("a CUDA GPU")
except Exception as exc:
    lacking.append(f"PyTorch ({type(exc).__name__}: {exc})")
try:
    import transformer_engine.pytorch  # noqa: F401
except Exception as exc:
    lacking.append(f"Transformer Engine ({type(exc).__name__}: {exc})")
if shutil.which("torchrun") is None:
    lacking.append("torchrun on the PATH")
print("; ".join(" ".join(x.split()) for x in lacking))
PY
)
if [ -n "$lacking" ]; then
  echo "startup_patch.sh: needs $lacking" >&2
  exit 2
fi

export TE_GQA_FIX_AUTOPATCH=${TE_GQA_FIX_AUTOPATCH:-strict}
# Optional: see the patched call sites in the log (the te_gqa_fix logger, INFO level).
# export TE_GQA_FIX=auto      # default policy: THD + GQA only ("always": MHA too; "off")

# 1. Is this stack affected, and does the hook work here? doctor's exit status: 0 healthy,
#    1 affected and not fixed, 3 cannot check, 4 broken beyond repair; its last line says
#    what to do about it, and is repeated here when it is not 0.
rc=0
report=$(python -m te_gqa_fix doctor) || rc=$?
printf '%s\n' "$report"
if [ "$rc" -ne 0 ]; then
  echo "te-gqa-fix doctor exited with $rc: ${report##*$'\n'}" >&2
fi

# 2. Check that an import of TE in a fresh process gets the fix.
python - <<'PY'
import sys

import transformer_engine.pytorch  # noqa: F401  (the start-up hook patches here)
import te_gqa_fix

if not te_gqa_fix.is_installed():
    sys.exit(
        "startup_patch.sh: the start-up hook did not patch TE (is te-gqa-fix pip-installed? "
        "its start-up file must be in site-packages: te-gqa-fix doctor says where it is)"
    )
print("te-gqa-fix: active in new processes")
PY

# 3. Train. Every worker inherits the variable, so every worker is patched.
exec torchrun --nproc-per-node "${NPROC:-8}" "$@"
