"""te-gqa-fix: exact dK/dV for Transformer Engine's fused attention backward on THD + GQA.

On Hopper with cuDNN older than 9.18, TE's ``fused_attn_bwd`` (cuDNN backend, THD layout,
h_q > h_kv) sums never-written workspace into the dK/dV rows of sequences that have no
query tokens; context parallelism produces such sequences on every step. This package
zeroes, in place and without a host sync, every row whose true gradient is 0, and where a
fixed cuDNN is installed it makes TE run that one instead.

Importing it has no side effects and imports neither torch nor Transformer Engine: names
are resolved on first use (PEP 562), so ``te_gqa_fix.use_fixed_cudnn()`` can run before
torch is imported, as it must.

* ``te_gqa_fix.fused_attn_bwd``: drop-in for TE's function.
* ``te_gqa_fix.install()`` / ``uninstall()`` / ``patched()``: reroute TE's own call sites.
* ``te_gqa_fix.zero_dead_rows``: the post-pass on plain tensors, for other kernels.
* ``te_gqa_fix.use_fixed_cudnn()``: load a fixed cuDNN (>= 9.18) before torch and TE.
* ``te_gqa_fix.check_offset_errors()``: raise if a CUDA call saw impossible offsets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

__version__ = "0.1.0"

# public name -> submodule that defines it. Everything else is public in its submodule
# (``te_gqa_fix.masks.key_interval``, ``te_gqa_fix.postpass.dead_row_masks``,
# ``te_gqa_fix.wrapper.wrapper_for``, ...), not here.
_LAZY: Dict[str, str] = {
    "install": "patch",
    "is_installed": "patch",
    "patched": "patch",
    "uninstall": "patch",
    "zero_dead_rows": "postpass",
    "get_te_version": "te_compat",
    "call_counts": "wrapper",
    "fused_attn_bwd": "wrapper",
    "reset_call_counts": "wrapper",
    "use_fixed_cudnn": "cudnn",
    "check_offset_errors": "offset_errors",
}

__all__ = [
    "__version__",
    "call_counts",
    "check_offset_errors",
    "fused_attn_bwd",
    "get_te_version",
    "install",
    "is_installed",
    "patched",
    "reset_call_counts",
    "uninstall",
    "use_fixed_cudnn",
    "zero_dead_rows",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .cudnn import use_fixed_cudnn
    from .offset_errors import check_offset_errors
    from .patch import install, is_installed, patched, uninstall
    from .postpass import zero_dead_rows
    from .te_compat import get_te_version
    from .wrapper import call_counts, fused_attn_bwd, reset_call_counts


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'te_gqa_fix' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
