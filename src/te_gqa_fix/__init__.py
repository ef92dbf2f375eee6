"""te-gqa-fix: exact gradients from Transformer Engine's fused attention backward on THD + GQA.

Importing it has no side effects and imports neither torch nor TE: the functions resolve on
first use (PEP 562), so ``te_gqa_fix.use_fixed_cudnn()`` can run before torch is imported.
The exceptions are importable at once (standard library only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict

from .errors import (
    CudnnAlreadyLoaded,
    CudnnLoadError,
    CudnnRefused,
    InputError,
    InputTypeError,
    OffsetsError,
    SettingError,
    SetupError,
    TeGqaFixError,
    UnrepairableConfiguration,
)

__version__ = "0.2.0"

#: public function -> the submodule that defines it
_LAZY: Dict[str, str] = {
    "install": "patch",
    "is_installed": "patch",
    "patched": "patch",
    "uninstall": "patch",
    "fused_attn_bwd": "wrapper",
    "call_counts": "wrapper",
    "reset_call_counts": "wrapper",
    "zero_dead_rows": "postpass",
    "dead_row_masks": "postpass",
    "check_offset_errors": "postpass",
    "status": "_status",
    "use_fixed_cudnn": "cudnn_route",
}

__all__ = [
    "CudnnAlreadyLoaded",
    "CudnnLoadError",
    "CudnnRefused",
    "InputError",
    "InputTypeError",
    "OffsetsError",
    "SettingError",
    "SetupError",
    "TeGqaFixError",
    "UnrepairableConfiguration",
    "__version__",
    "call_counts",
    "check_offset_errors",
    "dead_row_masks",
    "fused_attn_bwd",
    "install",
    "is_installed",
    "patched",
    "reset_call_counts",
    "status",
    "uninstall",
    "use_fixed_cudnn",
    "zero_dead_rows",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ._status import status
    from .cudnn_route import use_fixed_cudnn
    from .patch import install, is_installed, patched, uninstall
    from .postpass import check_offset_errors, dead_row_masks, zero_dead_rows
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
