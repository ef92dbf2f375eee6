"""te-gqa-fix: exact gradients from Transformer Engine's fused attention backward on THD + GQA.

Importing it has no side effects and imports neither torch nor TE: names resolve on first
use (PEP 562), so ``te_gqa_fix.use_fixed_cudnn()`` can run before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

__version__ = "0.1.0"

#: public name -> the submodule that defines it
_LAZY: Dict[str, str] = {
    "install": "patch",
    "is_installed": "patch",
    "patched": "patch",
    "uninstall": "patch",
    "zero_dead_rows": "postpass",
    "dead_row_masks": "postpass",
    "get_te_version": "stack.versions",
    "call_counts": "wrapper",
    "fused_attn_bwd": "patch",
    "reset_call_counts": "wrapper",
    "use_fixed_cudnn": "stack.cudnn",
    "check_offset_errors": "postpass.offset_errors",
}

__all__ = [
    "__version__",
    "call_counts",
    "check_offset_errors",
    "dead_row_masks",
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
    from .patch import fused_attn_bwd, install, is_installed, patched, uninstall
    from .postpass import dead_row_masks, zero_dead_rows
    from .postpass.offset_errors import check_offset_errors
    from .stack.cudnn import use_fixed_cudnn
    from .stack.versions import get_te_version
    from .wrapper import call_counts, reset_call_counts


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'te_gqa_fix' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
