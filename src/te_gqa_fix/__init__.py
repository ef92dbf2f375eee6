"""te-gqa-fix: exact dK/dV for Transformer Engine's fused attention backward on THD + GQA.

On Hopper with cuDNN older than 9.18, TE's ``fused_attn_bwd`` (cuDNN backend, THD layout,
h_q > h_kv) sums never-written workspace into the dK/dV rows of sequences that have no
query tokens; context parallelism produces such sequences on every step. This package
zeroes, in place and without a host sync, every row whose true gradient is 0.

Importing it has no side effects and does not import Transformer Engine.

* ``te_gqa_fix.fused_attn_bwd``: drop-in for TE's function.
* ``te_gqa_fix.install()`` / ``uninstall()`` / ``patched()``: reroute TE's own call sites.
* ``te_gqa_fix.zero_dead_rows``: the post-pass on plain tensors, for other kernels.
* ``te_gqa_fix.check_offset_errors()``: raise if a CUDA call saw impossible offsets.
"""

from __future__ import annotations

from .masks import KNOWN_MASK_TYPES, key_interval, key_span
from .offset_errors import OffsetsError, check_offset_errors
from .patch import install, is_installed, patched, uninstall
from .policy import get_policy
from .postpass import DeadRows, dead_row_masks, zero_dead_rows
from .te_compat import get_te_version, is_te_min_version
from .wrapper import call_counts, fused_attn_bwd, make_wrapper, reset_call_counts

__version__ = "0.1.0"

__all__ = [
    "KNOWN_MASK_TYPES",
    "DeadRows",
    "OffsetsError",
    "__version__",
    "call_counts",
    "check_offset_errors",
    "dead_row_masks",
    "fused_attn_bwd",
    "get_policy",
    "get_te_version",
    "install",
    "is_installed",
    "is_te_min_version",
    "key_interval",
    "key_span",
    "make_wrapper",
    "patched",
    "reset_call_counts",
    "uninstall",
    "zero_dead_rows",
]
