"""The post-pass: zero, in place, every dQ/dK/dV row whose true gradient is exactly 0.

Why a post-pass is enough: on the affected cuDNN builds the only damage is on rows that
no query attends (KV rows of sequences without query tokens, padding between sequences,
tail rows after the last sequence); their true gradient is 0 whatever the values, so
writing zeros there is exact. Rows that receive attention are never touched.

The PyTorch implementation here is the CPU path, the fallback on CUDA, and the oracle
for the Triton kernel. It uses only shape-driven device ops (``searchsorted``,
comparisons, ``masked_fill_``): no ``.item()``, no ``.tolist()``, no Python branch on a
tensor value, so it is safe inside CUDA-graph capture and runs on the current stream.
Fills rather than multiplications, so a stale NaN or Inf is cleared too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from ._logging import log_once
from .masks import KeySpan, key_span
from .policy import deep_validation_enabled
from .validation import check_metadata, check_values, shape_of

__all__ = ["DeadRows", "dead_row_masks", "zero_dead_rows", "zero_rows_"]

Impl = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class DeadRows:
    """Boolean masks, True where a row's true gradient is 0 (and so must be zeroed)."""

    q: Optional[torch.Tensor]
    kv: torch.Tensor


def _segments(rows: int, padded: torch.Tensor):
    """Sequence index and in-sequence position of each buffer row.

    Row ``t`` belongs to sequence ``b`` when ``padded[b] <= t < padded[b + 1]``; rows before
    ``padded[0]`` or from ``padded[B]`` on belong to none (``inside`` False).
    """
    nseq = padded.numel() - 1
    t = torch.arange(rows, device=padded.device, dtype=torch.int64)
    seg = torch.searchsorted(padded, t, right=True) - 1
    inside = (seg >= 0) & (seg < nseq)
    seg = seg.clamp(0, max(nseq - 1, 0))
    pos = t - padded[seg]
    return inside, seg, pos


def _key_bounds(lq: torch.Tensor, lk: torch.Tensor, span: KeySpan):
    """Per-sequence attended key interval ``[lo, hi)`` (see :mod:`te_gqa_fix.masks`)."""
    zero = torch.zeros_like(lk)
    if not span.exact:
        return zero, torch.where(lq > 0, lk, zero)
    los, his = [], []
    for use, s in ((span.top_left, zero), (span.bottom_right, lk - lq)):
        if not use:
            continue
        lo = zero if span.window_left < 0 else (s - span.window_left).clamp(min=0)
        hi = lk if span.window_right < 0 else torch.minimum(lk, lq + s + span.window_right)
        nonempty = hi > lo
        # An empty interval must not widen the union of the two alignments.
        los.append(torch.where(nonempty, lo, lk))
        his.append(torch.where(nonempty, hi, zero))
    lo, hi = los[0], his[0]
    for extra_lo, extra_hi in zip(los[1:], his[1:]):
        lo, hi = torch.minimum(lo, extra_lo), torch.maximum(hi, extra_hi)
    hi = torch.where(lq > 0, hi, zero)
    return lo, hi


def dead_row_masks(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    *,
    rows_q: Optional[int],
    rows_kv: int,
    attn_mask_type: Optional[str] = "padding_causal",
    window_size: Optional[Sequence[int]] = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
) -> DeadRows:
    """Which rows of a THD dQ (``rows_q`` rows) and dK/dV (``rows_kv`` rows) must be 0.

    Offsets follow TE: ``cu_seqlens_*`` are cumulative valid lengths, ``*_padded`` the
    start of each sequence in the buffer (``None``: the valid offsets, as TE does).
    Sync-free; the masks live on the offsets' device.
    """
    pad_q = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
    pad_kv = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
    device = cu_seqlens_kv.device
    nseq = cu_seqlens_q.numel() - 1
    if nseq <= 0:
        q_dead = None if rows_q is None else torch.ones(rows_q, dtype=torch.bool, device=device)
        return DeadRows(q=q_dead, kv=torch.ones(rows_kv, dtype=torch.bool, device=device))
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_kv = cu_seqlens_kv.to(torch.int64)
    lq = cu_q[1:] - cu_q[:-1]
    lk = cu_kv[1:] - cu_kv[:-1]
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal)
    return _dead_row_masks(lq, lk, pad_q, pad_kv, rows_q, rows_kv, span)


def _dead_row_masks(
    lq: torch.Tensor,
    lk: torch.Tensor,
    pad_q: torch.Tensor,
    pad_kv: torch.Tensor,
    rows_q: Optional[int],
    rows_kv: int,
    span: KeySpan,
) -> DeadRows:
    lo, hi = _key_bounds(lq, lk, span)

    inside, seg, pos = _segments(rows_kv, pad_kv.to(torch.int64).contiguous())
    kv_keep = inside & (pos >= lo[seg]) & (pos < hi[seg])
    q_dead = None
    if rows_q is not None:
        inside_q, seg_q, pos_q = _segments(rows_q, pad_q.to(torch.int64).contiguous())
        q_keep = inside_q & (pos_q < lq[seg_q]) & (lk[seg_q] > 0)
        q_dead = ~q_keep
    return DeadRows(q=q_dead, kv=~kv_keep)


_QUANTIZED_WARNED = "quantized-output"


def _writable_rows(t: object, name: str) -> Optional[torch.Tensor]:
    """The plain tensor whose rows hold ``t``'s values, or None when we cannot write it.

    Plain tensors (and views of a packed buffer) are written directly. TE's FP8 tensors
    keep their bytes in ``_data`` with the logical shape; byte 0 is +0 in both E4M3 and
    E5M2, so zeroing those bytes zeroes the value whatever the scale. A cached transpose
    (or any other quantized layout) would go stale, so those pass through, logged once.
    """
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t  # type: ignore[return-value]
    data = getattr(t, "_data", None)
    transpose = getattr(t, "_transpose", None)
    transpose_live = transpose is not None and not getattr(t, "_transpose_invalid", False)
    if (
        isinstance(data, torch.Tensor)
        and data.dtype == torch.uint8
        and tuple(data.shape) == shape_of(t)
        and not transpose_live
    ):
        return data
    log_once(
        (_QUANTIZED_WARNED, type(t).__name__),
        logging.WARNING,
        "te_gqa_fix: %s is a %s whose raw rows cannot be zeroed safely; passed through "
        "unchanged (rows of sequences without queries may hold stale values)",
        name,
        type(t).__name__,
    )
    return None


def zero_rows_(t: Optional[object], dead: torch.Tensor, name: str = "tensor") -> None:
    """``t[dead] = 0`` in place along dim 0 via ``masked_fill_`` (works through views)."""
    if t is None:
        return
    target = _writable_rows(t, name)
    if target is None:
        return
    mask = dead.view(-1, *([1] * (target.dim() - 1)))
    target.masked_fill_(mask, 0)


def _use_triton(impl: Impl, dk: torch.Tensor) -> bool:
    if impl == "torch":
        return False
    if impl == "triton":
        return True
    if dk.device.type != "cuda":
        return False
    from . import triton_postpass

    return triton_postpass.available()


def zero_dead_rows(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    *,
    attn_mask_type: Optional[str] = "padding_causal",
    window_size: Optional[Sequence[int]] = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
    impl: Impl = "auto",
) -> None:
    """Zero in place the THD gradient rows whose true gradient is exactly 0.

    ``dq`` ([Tq, Hq, D], may be None), ``dk`` and ``dv`` ([Tkv, Hkv, D]) may be views of
    one packed buffer (``thd_t2hd``/``thd_th2d``). Offsets and mask arguments are TE's
    (see :func:`dead_row_masks`). KV rows are zeroed outside each sequence's attended key
    interval, dQ rows outside the valid query tokens and in sequences without keys.

    No host sync unless ``TE_GQA_FIX_VALIDATE=1``; raises ``ValueError`` on inputs whose
    metadata cannot be right. ``impl`` picks the Triton kernel (CUDA) or the PyTorch ops;
    ``auto`` uses Triton on CUDA when it is importable.
    """
    check_metadata(
        dq, dk, dv, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded
    )
    if deep_validation_enabled():
        _deep_check(
            dq, dk, (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
        )
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal)
    if _use_triton(impl, dk):
        from . import triton_postpass

        if triton_postpass.zero_dead_rows_triton(
            dq,
            dk,
            dv,
            cu_seqlens_q,
            cu_seqlens_kv,
            cu_seqlens_q_padded,
            cu_seqlens_kv_padded,
            span=span,
        ):
            return
    _zero_with_torch(
        dq, dk, dv, (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded), span
    )


def _deep_check(dq: Optional[object], dk: object, offsets: tuple) -> None:
    rows_q = None if dq is None else int(shape_of(dq)[0])  # type: ignore[index]
    rows_kv = int(shape_of(dk)[0])  # type: ignore[index]
    check_values(rows_q, rows_kv, *offsets)


def _zero_with_torch(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets: tuple,
    span: KeySpan,
) -> None:
    """The PyTorch post-pass on checked arguments (CPU, and the fallback on CUDA)."""
    cu_q_t, cu_kv_t, pad_q_t, pad_kv_t = offsets
    rows_q = None if dq is None else int(shape_of(dq)[0])  # type: ignore[index]
    rows_kv = int(shape_of(dk)[0])  # type: ignore[index]
    if cu_q_t.numel() - 1 <= 0:
        dead = dead_row_masks(*offsets, rows_q=rows_q, rows_kv=rows_kv)
    else:
        cu_q = cu_q_t.to(torch.int64)
        cu_kv = cu_kv_t.to(torch.int64)
        pad_q = cu_q_t if pad_q_t is None else pad_q_t
        pad_kv = cu_kv_t if pad_kv_t is None else pad_kv_t
        lq = cu_q[1:] - cu_q[:-1]
        lk = cu_kv[1:] - cu_kv[:-1]
        dead = _dead_row_masks(lq, lk, pad_q, pad_kv, rows_q, rows_kv, span)
    zero_rows_(dk, dead.kv, "dk")
    zero_rows_(dv, dead.kv, "dv")
    if dq is not None and dead.q is not None:
        zero_rows_(dq, dead.q, "dq")


def zero_dead_rows_prechecked(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets: tuple,
    span: KeySpan,
    launches: Optional[object],
) -> None:
    """The post-pass for a caller that has already checked the call (the wrapper).

    The wrapper validates TE's inputs and the offsets once per call (a cached comparison
    of their metadata) and resolves the mask to ``span`` once per call shape, so this
    skips :func:`check_metadata` and ``key_span``. ``launches``
    (:class:`te_gqa_fix.triton_postpass.Launches`, or None for the PyTorch route) keys
    the kernel launch on the outputs' metadata, which is new each call (the kernel checks
    them once per key). Whenever the kernel declines, the PyTorch post-pass runs on the
    outputs as they are (masks sized from each tensor's own rows; dK/dV of different
    rows make the fill raise, never zero wrong rows): rows are never left unzeroed.
    """
    if deep_validation_enabled():
        _deep_check(dq, dk, offsets)
    if launches is not None and launches.launch(dq, dk, dv, offsets, span):  # type: ignore[attr-defined]
        return
    _zero_with_torch(dq, dk, dv, offsets, span)
