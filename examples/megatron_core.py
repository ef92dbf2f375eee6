"""Megatron-Core: install te-gqa-fix once at start-up, before the model is built.

Megatron-Core's attention (``TEDotProductAttention``) goes through TE's
``DotProductAttention``, and context parallelism through TE's ``context_parallel.py``;
both call TE's ``fused_attn_bwd`` by a name bound at import. ``te_gqa_fix.install()``
rebinds that name everywhere it is held, so the one call below covers THD packing
(``--sequence-packing`` / ``qkv_format="thd"``) with GQA, with and without context
parallelism. Install it in every rank (it is per process), before the first
forward/backward; installing before the model is built keeps it simple.

No code change at all: launch with ``TE_GQA_FIX_AUTOPATCH=1`` (or ``strict``) in the
environment instead; the start-up hook installed with the package does the same in
every rank (see ``examples/startup_patch.sh``).

This file shows where the call goes in a ``pretrain_gpt.py``-style entry point; run
directly, it only installs the fix and reports the patched sites.
"""

from __future__ import annotations

import logging
import sys
from typing import List


def install_te_gqa_fix() -> List[str]:
    """Patch TE in this process; call it first thing in every rank.

    Returns the patched ``module.attribute`` sites. Raises ImportError when Transformer
    Engine is missing, so a job that expects the fix never runs without it.
    """
    import te_gqa_fix

    sites = te_gqa_fix.install()  # idempotent; imports transformer_engine.pytorch
    logging.getLogger("te_gqa_fix").info("te-gqa-fix installed at %d sites", len(sites))
    return sites


# --- in pretrain_gpt.py (Megatron-LM) -------------------------------------------------
#
#   from megatron.training import pretrain
#   from examples.megatron_core import install_te_gqa_fix     # or inline the two lines
#
#   if __name__ == "__main__":
#       install_te_gqa_fix()                 # before pretrain() builds the model
#       pretrain(
#           train_valid_test_datasets_provider,
#           model_provider,
#           ModelType.encoder_or_decoder,
#           forward_step,
#           args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
#       )
#
# --- or with Megatron-Core directly ----------------------------------------------------
#
#   import te_gqa_fix
#   te_gqa_fix.install()
#   model = GPTModel(config=transformer_config, transformer_layer_spec=
#                    get_gpt_layer_with_transformer_engine_spec(), ...)
#
# --- or no code change -------------------------------------------------------------------
#
#   TE_GQA_FIX_AUTOPATCH=strict torchrun --nproc-per-node 8 pretrain_gpt.py ...
#
# Check the stack first with `te-gqa-fix doctor` (exit 1: affected and not fixed; 4: head
# dim > 128 on cuDNN < 9.18, which no post-pass can repair: use cuDNN 9.18 or newer).


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        sites = install_te_gqa_fix()
    except ImportError as exc:
        print(f"megatron_core example: {exc}")
        return 2
    print("patched:", *sites, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
