"""Transformer Engine, optional: find it, read its version, import what we patch.

Nothing here imports TE at module import time; every function imports on demand and
turns a missing TE into an ImportError that says how to install it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, Optional

from packaging.version import Version

from ._marker import unwrap

FUSED_ATTN_MODULE = "transformer_engine.pytorch.cpp_extensions.fused_attn"
SYMBOL = "fused_attn_bwd"

INSTALL_HINT = (
    "te-gqa-fix needs NVIDIA Transformer Engine with its PyTorch extension for this: "
    "pip install 'transformer-engine[pytorch]>=2.8' (or use an NGC PyTorch container, which "
    "ships it); `import te_gqa_fix` itself works without it"
)


def get_te_version() -> Optional[Version]:
    """The installed TE version, or None when TE is not installed (no TE import)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - python < 3.8
        return None
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return Version(version(dist))
        except PackageNotFoundError:
            continue
        except Exception:  # a broken metadata entry must not break the caller
            continue
    try:
        te = importlib.import_module("transformer_engine")
    except Exception:
        return None
    raw = getattr(te, "__version__", None)
    try:
        return Version(str(raw)) if raw else None
    except Exception:
        return None


def is_te_min_version(version: str) -> bool:
    """True when TE is installed and at least ``version`` (Megatron-Core's idiom)."""
    current = get_te_version()
    return current is not None and current >= Version(version)


def import_fused_attn_module() -> ModuleType:
    """Import ``transformer_engine.pytorch`` and return the module defining fused_attn_bwd."""
    try:
        importlib.import_module("transformer_engine.pytorch")
        return importlib.import_module(FUSED_ATTN_MODULE)
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc


def find_original(module: Optional[ModuleType] = None) -> Callable:
    """TE's own ``fused_attn_bwd`` (unwrapped if our wrapper is installed there)."""
    module = import_fused_attn_module() if module is None else module
    fn = getattr(module, SYMBOL, None)
    if fn is None:
        raise ImportError(
            f"{module.__name__} has no attribute {SYMBOL!r}: this Transformer Engine "
            f"({get_te_version()}) is not one te-gqa-fix supports (2.8 to 2.20)"
        )
    return unwrap(fn)
