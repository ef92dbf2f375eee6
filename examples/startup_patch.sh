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
set -euo pipefail

export TE_GQA_FIX_AUTOPATCH=${TE_GQA_FIX_AUTOPATCH:-strict}
# Optional: see the patched call sites in the log (the te_gqa_fix logger, INFO level).
# export TE_GQA_FIX=auto      # default policy: THD + GQA only ("always": MHA too; "off")

# 1. Is this stack affected, and does the hook work here? (exit 0 healthy, 1 affected and
#    not fixed, 3 cannot check, 4 broken beyond repair: use cuDNN >= 9.18.)
te-gqa-fix doctor || echo "te-gqa-fix doctor exited with $? (see above)" >&2

# 2. Check that an import of TE in a fresh process gets the fix.
python - <<'PY'
import transformer_engine.pytorch  # noqa: F401  (the start-up hook patches here)
import te_gqa_fix

assert te_gqa_fix.is_installed(), "te-gqa-fix start-up hook did not patch TE"
print("te-gqa-fix: active in new processes")
PY

# 3. Train. Every worker inherits the variable, so every worker is patched.
exec torchrun --nproc-per-node "${NPROC:-8}" "$@"
