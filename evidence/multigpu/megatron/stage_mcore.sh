#!/usr/bin/env bash
# Megatron-Core for the GPU machine (no network there), the way ../shared/gpu-kit brings TE.
#
# HERE (your machine, project root):   bash evidence/multigpu/megatron/stage_mcore.sh
#   fills .whl-mcore/ (git-ignored) with
#   * megatron-core 0.19.2 (cp312 manylinux wheel, ~2.4 MB). Nothing else: what
#     megatron.core imports for GPTModel + the TE layer spec + parallel_state + DDP +
#     optimizer + the no-pipelining schedule, outside try/except, is torch, numpy, packaging,
#     typing_extensions and triton, all already on the GPU machine (KINDS.md), plus TE from
#     the GPU kit. (Checked by listing every top-level import of megatron/core/**.py.)
#   * te-gqa-fix built as a wheel from this checkout (~60 kB): a regular `pip install` puts
#     the start-up file te_gqa_fix_autopatch.pth into site-packages, which is what
#     TE_GQA_FIX_AUTOPATCH=1 needs. (`pip install -e .` there would need hatchling, which the
#     GPU machine lacks.) Rebuild after changing src/.
#
# THERE (GPU machine, repo root, carry .whl-mcore): run.sh installs both itself:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore-site \
#     .whl-mcore/megatron_core-*.whl && export PYTHONPATH=/tmp/mcore-site:$PYTHONPATH
#   python3 -m pip install -q --no-index --no-deps .whl-mcore/te_gqa_fix-*.whl
set -euo pipefail
MCORE_VERSION=${MCORE_VERSION:-0.19.2}
root=$(git rev-parse --show-toplevel)
cd "$root"
mkdir -p .whl-mcore
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl-mcore "megatron-core==$MCORE_VERSION"
rm -f .whl-mcore/te_gqa_fix-*.whl
python3 -m pip wheel -q --no-deps -w .whl-mcore .
ls -la .whl-mcore
du -sh .whl-mcore
