"""The drop-in ``fused_attn_bwd``: call TE unchanged, then zero the rows that must be 0.

TE's signature drifted between releases (2.8 has ``dqkv_dtype``; 2.20 has ``o_format``,
``do_format``, ``dqkv_layout``, ``bottom_right_diagonal``, ``cuda_graph``), and TE's own
call sites mix positional and keyword arguments. So arguments are never read by fixed
position: the wrapper reads them by name through the installed function's
``inspect.signature``, resolved once per original into a name -> position table.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import Counter
from types import ModuleType
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from ._logging import log_once, logger
from .policy import get_policy
from .postpass import zero_dead_rows_from_te
from .validation import check_metadata, shape_of

__all__ = [
    "MARKER",
    "call_counts",
    "fused_attn_bwd",
    "is_wrapper",
    "make_wrapper",
    "parse_layout",
    "reset_call_counts",
    "unwrap",
]

MARKER = "__te_gqa_fix_wrapper__"
_MISSING = object()

_counts: Counter = Counter()


def call_counts() -> Dict[str, int]:
    """How many calls went through any wrapper: ``calls``, ``fixed`` (post-pass ran),
    ``skipped`` (understood, nothing to do: MHA, non-THD, policy off) and ``passthrough``
    (not understood; logged once). Plain Python counters: no device work."""
    return {k: _counts[k] for k in ("calls", "fixed", "skipped", "passthrough")}


def reset_call_counts() -> None:
    _counts.clear()


def is_wrapper(fn: object) -> bool:
    return bool(getattr(fn, MARKER, False))


def unwrap(fn: Callable) -> Callable:
    """Peel off our wrappers (never anyone else's)."""
    while is_wrapper(fn):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn


_THD_LAYOUTS: Dict[str, Tuple[bool, bool]] = {
    # layout -> (dQ is THD, dK/dV are THD)
    "t3hd": (True, True),
    "th3d": (True, True),
    "thd_t2hd": (True, True),
    "thd_th2d": (True, True),
    "thd_thd_thd": (True, True),
    "thd_bshd_bshd": (True, False),
    "thd_sbhd_sbhd": (True, False),
}
_OTHER_LAYOUTS = {
    "sb3hd", "sbh3d", "sbhd_sb2hd", "sbhd_sbh2d", "sbhd_sbhd_sbhd",
    "bs3hd", "bsh3d", "bshd_bs2hd", "bshd_bsh2d", "bshd_bshd_bshd",
    "sbhd_bshd_bshd", "bshd_sbhd_sbhd", "bhsd_bhsd_bhsd",
}  # fmt: skip


def parse_layout(layout: object) -> Optional[Tuple[bool, bool]]:
    """``(dq_is_thd, dkv_is_thd)`` for a TE layout string; None when not understood."""
    if not isinstance(layout, str):
        return None
    if layout in _THD_LAYOUTS:
        return _THD_LAYOUTS[layout]
    if layout in _OTHER_LAYOUTS:
        return (False, False)
    return None


class _Args:
    """Name-based access to one call's arguments, from a signature resolved once."""

    def __init__(self, fn: Callable) -> None:
        sig = inspect.signature(fn)
        self.positions: Dict[str, int] = {}
        self.defaults: Dict[str, Any] = {}
        self.names = set(sig.parameters)
        for i, (name, p) in enumerate(sig.parameters.items()):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"signature has *{name}; cannot bind by name")
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                self.positions[name] = i
            if p.default is not p.empty:
                self.defaults[name] = p.default

    def get(self, args: Sequence, kwargs: Mapping[str, Any], name: str, default: Any = None):
        if name in kwargs:
            return kwargs[name]
        i = self.positions.get(name)
        if i is not None and i < len(args):
            return args[i]
        return self.defaults.get(name, default)

    def given(self, args: Sequence, kwargs: Mapping[str, Any], name: str) -> bool:
        i = self.positions.get(name)
        return name in kwargs or (i is not None and i < len(args))


def _heads(t: object) -> Optional[int]:
    shape = shape_of(t)  # also TE's FP8 storage classes, which have size() but no shape
    return int(shape[-2]) if shape is not None and len(shape) >= 2 else None


class _Plan:
    __slots__ = ("fix_q", "kwargs")

    def __init__(self, fix_q: bool, kwargs: Dict[str, Any]) -> None:
        self.fix_q = fix_q
        self.kwargs = kwargs


def _passthrough(key: object, msg: str, *args: object) -> None:
    _counts["passthrough"] += 1
    log_once(
        ("passthrough", key),
        logging.WARNING,
        "te_gqa_fix: " + msg + "; passed through untouched",
        *args,
    )


def _plan(binder: _Args, args: Sequence, kwargs: Mapping[str, Any]) -> Optional[_Plan]:
    """Decide before the call (metadata only, no sync) whether and how to post-process."""
    policy = get_policy()
    if policy == "off":
        _counts["skipped"] += 1
        return None
    layout_name = "qkv_layout"
    if "dqkv_layout" in binder.names and binder.given(args, kwargs, "dqkv_layout"):
        layout_name = "dqkv_layout"
    layout = binder.get(args, kwargs, layout_name)
    formats = parse_layout(layout)
    if formats is None:
        _passthrough(
            ("layout", layout), "%s=%r is not a layout te-gqa-fix knows", layout_name, layout
        )
        return None
    fix_q, fix_kv = formats
    if not fix_kv:
        _counts["skipped"] += 1
        return None
    q = binder.get(args, kwargs, "q")
    k = binder.get(args, kwargs, "k")
    v = binder.get(args, kwargs, "v")
    h_q, h_kv = _heads(q), _heads(k)
    if policy == "auto" and h_q is not None and h_q == h_kv:
        _counts["skipped"] += 1
        return None
    cu_q = binder.get(args, kwargs, "cu_seqlens_q")
    cu_kv = binder.get(args, kwargs, "cu_seqlens_kv")
    pad_q = binder.get(args, kwargs, "cu_seqlens_q_padded")
    pad_kv = binder.get(args, kwargs, "cu_seqlens_kv_padded")
    check_metadata(
        q if fix_q else None, k, v, cu_q, cu_kv, pad_q, pad_kv, h_q, h_kv, names=("q", "k", "v")
    )
    return _Plan(
        fix_q,
        dict(
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_kv,
            cu_seqlens_q_padded=pad_q,
            cu_seqlens_kv_padded=pad_kv,
            attn_mask_type=binder.get(args, kwargs, "attn_mask_type"),
            window_size=binder.get(args, kwargs, "window_size", (-1, -1)),
            bottom_right_diagonal=binder.get(args, kwargs, "bottom_right_diagonal"),
        ),
    )


def _apply(plan: _Plan, out: object) -> None:
    if not isinstance(out, (list, tuple)) or len(out) < 3:
        _passthrough(
            ("output", type(out).__name__),
            "fused_attn_bwd returned %s, not (dq, dk, dv, ...)",
            type(out).__name__,
        )
        return
    dq, dk, dv = out[0], out[1], out[2]
    zero_dead_rows_from_te(dq if plan.fix_q else None, dk, dv, **plan.kwargs)
    _counts["fixed"] += 1


def make_wrapper(original: Callable) -> Callable:
    """Wrap TE's ``fused_attn_bwd``: same call, same return object, dead rows zeroed.

    Idempotent: wrapping a wrapper returns it unchanged. ``__wrapped__`` is the original.
    """
    if is_wrapper(original):
        return original
    try:
        binder: Optional[_Args] = _Args(original)
    except (TypeError, ValueError) as exc:
        binder = None
        reason = str(exc)

    @functools.wraps(original)
    def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
        _counts["calls"] += 1
        if binder is None:
            _passthrough(
                ("signature", id(original)),
                "cannot read the signature of %r (%s)",
                original,
                reason,
            )
            return original(*args, **kwargs)
        plan = _plan(binder, args, kwargs)
        out = original(*args, **kwargs)
        if plan is not None:
            _apply(plan, out)
        return out

    setattr(fused_attn_bwd, MARKER, True)
    fused_attn_bwd.__wrapped__ = original  # type: ignore[attr-defined]
    return fused_attn_bwd


_wrappers: Dict[int, Callable] = {}
_te_module: Optional[ModuleType] = None


def wrapper_for(original: Callable) -> Callable:
    """The one wrapper of ``original`` (cached, so patch sites and the drop-in share it)."""
    original = unwrap(original)
    cached = _wrappers.get(id(original))
    if cached is not None and cached.__wrapped__ is original:  # type: ignore[attr-defined]
        return cached
    wrapper = make_wrapper(original)
    _wrappers[id(original)] = wrapper
    logger.debug(
        "te_gqa_fix: wrapped %s.%s",
        getattr(original, "__module__", "?"),
        getattr(original, "__qualname__", "?"),
    )
    return wrapper


def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for ``transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_bwd``.

    Takes exactly what the installed TE's function takes (TE 2.8 to 2.20, positional or
    keyword), calls it unchanged and returns what it returned, after zeroing in place
    every dK/dV (and dQ) row whose true gradient is 0 on THD layouts with h_q != h_kv
    (``TE_GQA_FIX=always``: MHA too; ``off``: pure pass-through). No host sync.

    Raises ImportError (with how to install) when Transformer Engine is missing.
    """
    global _te_module
    if _te_module is None:
        from .te_compat import import_fused_attn_module

        _te_module = import_fused_attn_module()
    from .te_compat import find_original

    wrapper = wrapper_for(find_original(_te_module))
    fused_attn_bwd.__wrapped__ = wrapper.__wrapped__  # type: ignore[attr-defined]
    return wrapper(*args, **kwargs)
