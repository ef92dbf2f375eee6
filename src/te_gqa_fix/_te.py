"""Transformer Engine as te-gqa-fix sees it: its names, module paths and releases, and the
cuDNN it runs.

Every module that names something of TE takes it from here, the names of the
``fused_attn_bwd`` arguments te-gqa-fix reads included (:class:`Args`, :class:`FallbackArgs`;
the wrapper reads a call's arguments by name with :class:`te_gqa_fix.wrapper.Signature`).
TE is imported only by :func:`fused_attn_module`; the rest reads what is already imported,
or nothing.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType
from typing import Any, Dict, NamedTuple, Optional, Tuple

from ._logging import log_once
from .errors import SetupError

__all__ = [
    "CALL_SITES",
    "FUSED_ATTN_MODULE",
    "GPU_VALIDATED",
    "LAYOUTS",
    "MASKS",
    "OFFSET_NAMES",
    "PACKED",
    "SUPPORTED",
    "SYMBOL",
    "TE_PYTORCH",
    "THD_LAYOUTS",
    "THD_MASKS",
    "Args",
    "FallbackArgs",
    "fused_attn_module",
    "missing_symbol",
    "release",
    "te_cudnn_version",
    "te_version",
    "warn_if_unvalidated",
]

# ------------------------------------------------------------------------------ names
_OTHER_LAYOUTS = """sb3hd sbh3d sbhd_sb2hd sbhd_sbh2d sbhd_sbhd_sbhd bs3hd bsh3d bshd_bs2hd bshd_bsh2d
    bshd_bshd_bshd sbhd_bshd_bshd bshd_sbhd_sbhd bhsd_bhsd_bhsd"""
#: TE's ``qkv_layout`` names -> (q's tensor is THD, k's and v's are THD).
LAYOUTS: Dict[str, Tuple[bool, bool]] = {
    **dict.fromkeys(("thd_thd_thd", "thd_t2hd", "thd_th2d", "t3hd", "th3d"), (True, True)),
    **dict.fromkeys(("thd_bshd_bshd", "thd_sbhd_sbhd"), (True, False)),
    **dict.fromkeys(_OTHER_LAYOUTS.split(), (False, False)),
}
#: The layouts with q, k and v all THD.
THD_LAYOUTS: Tuple[str, ...] = tuple(n for n, (q, kv) in LAYOUTS.items() if q and kv)
#: Packed THD layouts -> (index of the first packed tensor of q, k, v; the dim they stack on).
PACKED: Dict[str, Tuple[int, int]] = {
    "thd_t2hd": (1, 1),
    "thd_th2d": (1, 2),
    "t3hd": (0, 1),
    "th3d": (0, 2),
}

#: TE's ``attn_mask_type`` names -> (causal, bottom-right by name). THD masks are per
#: sequence, so the names without ``padding`` behave as their padding twins there.
MASKS: Dict[str, Tuple[bool, bool]] = {
    "padding": (False, False),
    "no_mask": (False, False),
    "padding_causal": (True, False),
    "causal": (True, False),
    "padding_causal_bottom_right": (True, True),
    "causal_bottom_right": (True, True),
}
#: The mask names TE's fused attention takes with THD input.
THD_MASKS: Tuple[str, ...] = tuple(n for n in MASKS if n.startswith("padding"))

#: TE's four offset arguments, in the order of its signature.
OFFSET_NAMES: Tuple[str, str, str, str] = (
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
)

# --------------------------------------------------------------------------- releases
TE_PYTORCH = "transformer_engine.pytorch"
FUSED_ATTN_MODULE = "transformer_engine.pytorch.cpp_extensions.fused_attn"
SYMBOL = "fused_attn_bwd"
#: TE's own callers of ``fused_attn_bwd``, each importing it by name: DotProductAttention's
#: fused backend and the context-parallel paths (P2P, all-gather, A2A).
CALL_SITES: Tuple[str, ...] = (
    "transformer_engine.pytorch.attention.dot_product_attention.backends",
    "transformer_engine.pytorch.attention.dot_product_attention.context_parallel",
)
#: The oldest and newest TE release whose ``fused_attn_bwd`` signature te-gqa-fix reads
#: (both held to TE's own text by CPU fakes).
SUPPORTED: Tuple[Tuple[int, int], Tuple[int, int]] = ((2, 8), (2, 20))
#: The TE releases validated on a GPU (docs/validation.md; a CPU test holds this to the
#: data files).
GPU_VALIDATED: Tuple[Tuple[int, int], ...] = ((2, 20),)

INSTALL_HINT = (
    "te-gqa-fix needs NVIDIA Transformer Engine with its PyTorch extension for this: "
    "pip install 'transformer-engine[pytorch]>=2.8' (or use an NGC PyTorch container, which "
    "ships it); `import te_gqa_fix` itself works without it"
)


def release(version: Optional[str]) -> Tuple[int, ...]:
    """The major and minor release of a version string: ``"2.6.0a0+git"`` -> ``(2, 6)``;
    ``()`` for anything unreadable (which compares below every release)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(version)).release[:2]
    except InvalidVersion:
        return ()


def te_version() -> Optional[str]:
    """The installed TE's version (its distribution's, else the imported package's), or
    None when there is none; never raises."""
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return metadata.version(dist)
        except Exception:  # not installed, or a broken metadata entry
            continue
    version = getattr(sys.modules.get("transformer_engine"), "__version__", None)
    return version if isinstance(version, str) else None


def warn_if_unvalidated() -> None:
    """Log once at WARNING when the installed TE is not a release validated on a GPU (the
    wrapper still reads its signature by name, and passes through what it cannot read)."""
    version = te_version()
    if version is None or release(version) in GPU_VALIDATED:
        return
    validated = ", ".join(".".join(map(str, r)) for r in GPU_VALIDATED)
    oldest, newest = (".".join(map(str, r)) for r in SUPPORTED)
    log_once(
        ("te-release", version),
        logging.WARNING,
        "Transformer Engine %s is not a release te-gqa-fix was validated with on a GPU (%s; "
        "signatures of %s to %s are checked on CPU): the wrapper reads its arguments by name "
        "and passes through what it cannot read; run `te-gqa-fix doctor` on a GPU",
        version,
        validated,
        oldest,
        newest,
    )


def fused_attn_module() -> ModuleType:
    """Import ``transformer_engine.pytorch`` and return the module defining fused_attn_bwd.

    Raises:
        SetupError: TE is missing or broken (an ImportError saying how to install it).
    """
    try:
        importlib.import_module(TE_PYTORCH)
        return importlib.import_module(FUSED_ATTN_MODULE)
    except ImportError as exc:
        raise SetupError(f"{INSTALL_HINT} (import failed: {exc})") from exc


def missing_symbol(module: ModuleType) -> SetupError:
    """The error for a TE module without ``fused_attn_bwd``."""
    return SetupError(
        f"{module.__name__} has no attribute {SYMBOL!r}: this Transformer Engine "
        f"({te_version()}) is not one te-gqa-fix supports (2.8 to 2.20)"
    )


def te_cudnn_version() -> Optional[Tuple[int, int, int]]:
    """The cuDNN Transformer Engine runs, from TE itself; None when TE cannot say. Never
    imports ``transformer_engine.pytorch`` (that import is what picks TE's cuDNN)."""
    if TE_PYTORCH not in sys.modules:
        return None
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        return tuple(int(x) for x in get_cudnn_version())  # type: ignore[return-value]
    except Exception:
        return None


class Args(NamedTuple):
    """The arguments of one ``fused_attn_bwd`` call that every call reads, by TE's names:
    its decision (the call key), the input gate and the post-pass read these alone, so a
    call passed through reads nothing more. :class:`FallbackArgs` adds what the exact
    fallback reads.

    A name the installed release's signature lacks reads as None: ``dqkv_layout`` (TE <
    2.20: as ``qkv_layout`` says), ``bottom_right_diagonal`` (TE < 2.10: by mask name).
    ``dqkv_layout`` also reads None where a call leaves it out: ``qkv_layout`` then names
    the gradients' layout (TE's default, ``sbh3d``, is not THD; with THD inputs it is the
    caller's slip).
    """

    q: Any
    k: Any
    v: Any
    cu_seqlens_q: Any
    cu_seqlens_kv: Any
    cu_seqlens_q_padded: Any
    cu_seqlens_kv_padded: Any
    qkv_layout: Any
    dqkv_layout: Any
    attn_mask_type: Any
    window_size: Any
    bottom_right_diagonal: Any


#: What the exact fallback reads besides :class:`Args` (a name the installed release lacks
#: reads None, as in :class:`Args`: ``o_format``, ``do_format`` before TE 2.20,
#: ``dqkv_dtype`` from it).
_FALLBACK_ONLY = (
    "o", "d_o", "aux_ctx_tensors", "max_seqlen_q", "max_seqlen_kv", "attn_scale", "dropout",
    "fake_dtype", "dqkv_dtype", "o_format", "do_format", "attn_bias_type", "softmax_type",
    "deterministic", "s_quantizer", "dp_quantizer", "dqkv_quantizer",
)  # fmt: skip
#: Every argument of one ``fused_attn_bwd`` call that te-gqa-fix reads, by TE's names:
#: :class:`Args`' and what the exact fallback reads besides (read only where it runs).
FallbackArgs = NamedTuple(  # type: ignore[misc]
    "FallbackArgs", [(name, Any) for name in (*Args._fields, *_FALLBACK_ONLY)]
)
