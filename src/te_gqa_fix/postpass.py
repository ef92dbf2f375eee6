"""The post-pass: zero, in place, every dQ/dK/dV row whose true gradient is exactly 0.

Why a post-pass is enough: on the affected cuDNN builds the damage is on rows whose true
gradient is 0, so writing zeros there is exact. Rows that receive attention are never
touched. Measured on cuDNN 9.14 (``benchmarks/damage_map.py``), the damaged rows are the
KV rows of sequences without query tokens; TE zero-fills THD dQ/dK/dV before it calls
cuDNN, and padding, tail, unattended-key and dQ rows came back 0. The post-pass zeroes
all of them anyway (a superset, at 1.3% of the backward at 8K tokens in the benchmark), so
that exactness rests neither on TE's zero-fill nor on builds nobody measured.

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

from . import offset_errors
from ._logging import log_once
from .masks import KeySpan, key_span
from .policy import deep_validation_enabled
from .validation import check_metadata, check_rows_disjoint, check_values, shape_of

__all__ = [
    "DeadRows",
    "dead_row_masks",
    "zero_dead_rows",
    "zero_dead_rows_prechecked",
    "zero_rows_",
]

Impl = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class DeadRows:
    """Boolean masks, True where a row's true gradient is 0 (and so must be zeroed).

    ``errors`` is an int32 device scalar: the :data:`te_gqa_fix.offset_errors.ARGUMENT_BITS`
    of offsets that cannot be right. When it is non-zero both masks are all False: a
    call with impossible offsets zeroes nothing (see :mod:`te_gqa_fix.offset_errors`).
    """

    q: Optional[torch.Tensor]
    kv: torch.Tensor
    errors: Optional[torch.Tensor] = None


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


def _any_decrease(x: torch.Tensor) -> torch.Tensor:
    """Device bool scalar: some offset negative or smaller than the one before."""
    return (x < 0).any() | (x[1:] < x[:-1]).any()


def _offset_error_bits(
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    pad_q: torch.Tensor,
    pad_kv: torch.Tensor,
    pad_q_given: bool,
    pad_kv_given: bool,
    rows_q: Optional[int],
    rows_kv: int,
) -> torch.Tensor:
    """The same verdict as the Triton kernel's, as an int32 device scalar (no sync).

    Offsets are int64 here. A buffer offset that fails names the padded argument when
    one was passed, else the valid one (TE's rule: no padded offsets = the valid ones).
    """
    bit = offset_errors.ARGUMENT_BITS
    pq_bit = bit["cu_seqlens_q_padded" if pad_q_given else "cu_seqlens_q"]
    pk_bit = bit["cu_seqlens_kv_padded" if pad_kv_given else "cu_seqlens_kv"]
    bad_pq = _any_decrease(pad_q)
    bad_pk = _any_decrease(pad_kv)
    if rows_q is not None:
        bad_pq = bad_pq | (pad_q[-1] > rows_q)
    bad_pk = bad_pk | (pad_kv[-1] > rows_kv)
    # A padded segment shorter than its valid length: the two disagree, name both.
    short_q = ((pad_q[1:] - pad_q[:-1]) < (cu_q[1:] - cu_q[:-1])).any()
    short_k = ((pad_kv[1:] - pad_kv[:-1]) < (cu_kv[1:] - cu_kv[:-1])).any()
    i32 = torch.int32
    bits = _any_decrease(cu_q).to(i32) * bit["cu_seqlens_q"]
    bits = bits | _any_decrease(cu_kv).to(i32) * bit["cu_seqlens_kv"]
    bits = bits | bad_pq.to(i32) * pq_bit | bad_pk.to(i32) * pk_bit
    bits = bits | short_q.to(i32) * (pq_bit | bit["cu_seqlens_q"])
    return bits | short_k.to(i32) * (pk_bit | bit["cu_seqlens_kv"])


def _dead_rows(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
    rows_q: Optional[int],
    rows_kv: int,
    span: KeySpan,
) -> DeadRows:
    """:func:`dead_row_masks` for a resolved :class:`KeySpan` (nothing recorded)."""
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_kv = cu_seqlens_kv.to(torch.int64)
    pad_q = cu_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded.to(torch.int64)
    pad_kv = cu_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded.to(torch.int64)
    device = cu_seqlens_kv.device
    errors = _offset_error_bits(
        cu_q,
        cu_kv,
        pad_q,
        pad_kv,
        cu_seqlens_q_padded is not None,
        cu_seqlens_kv_padded is not None,
        rows_q,
        rows_kv,
    )
    ok = errors == 0
    nseq = cu_seqlens_q.numel() - 1
    if nseq <= 0:
        q_dead = None if rows_q is None else torch.ones(rows_q, dtype=torch.bool, device=device)
        kv_dead = torch.ones(rows_kv, dtype=torch.bool, device=device)
        return DeadRows(q=None if q_dead is None else q_dead & ok, kv=kv_dead & ok, errors=errors)
    lq = cu_q[1:] - cu_q[:-1]
    lk = cu_kv[1:] - cu_kv[:-1]
    lo, hi = _key_bounds(lq, lk, span)

    inside, seg, pos = _segments(rows_kv, pad_kv.contiguous())
    kv_keep = inside & (pos >= lo[seg]) & (pos < hi[seg])
    q_dead = None
    if rows_q is not None:
        inside_q, seg_q, pos_q = _segments(rows_q, pad_q.contiguous())
        q_keep = inside_q & (pos_q < lq[seg_q]) & (lk[seg_q] > 0)
        q_dead = ~q_keep & ok
    return DeadRows(q=q_dead, kv=~kv_keep & ok, errors=errors)


def _record_errors(errors: Optional[torch.Tensor], device: torch.device) -> None:
    """Put a call's error bits where :mod:`te_gqa_fix.offset_errors` reads them (no sync).

    CPU: straight into the host word, then raised at once (host memory, no sync).
    CUDA: a device accumulator and a ``non_blocking`` copy into the pinned word.
    """
    if errors is None:
        return
    if device.type == "cuda":
        offset_errors.record_device_bits(device, errors)
        return
    word = offset_errors.kernel_flag(device)[1:2]
    word.bitwise_or_(errors.reshape(1).to(torch.int32))
    offset_errors.raise_pending(device, when="this")


def dead_row_masks(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    *,
    rows_q: Optional[int],
    rows_kv: int,
    attn_mask_type: str = "padding_causal",
    window_size: Optional[Sequence[int]] = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
) -> DeadRows:
    """Which rows of a THD dQ (``rows_q`` rows) and dK/dV (``rows_kv`` rows) must be 0.

    Offsets follow TE: ``cu_seqlens_*`` are cumulative valid lengths, ``*_padded`` the
    start of each sequence in the buffer (``None``: the valid offsets, as TE does).
    Sync-free; the masks live on the offsets' device. Malformed mask arguments raise
    ``ValueError`` naming the argument (``'arbitrary'``: keep every valid key of a
    sequence with queries). Impossible offsets give masks with nothing dead and are
    reported as described in :mod:`te_gqa_fix.offset_errors` (CPU: ``OffsetsError``, a
    ``ValueError``, at once; CUDA: at the next post-pass call).
    """
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal, strict=True)
    dead = _dead_rows(
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        rows_q,
        rows_kv,
        span,
    )
    _record_errors(dead.errors, cu_seqlens_kv.device)
    return dead


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
    attn_mask_type: str = "padding_causal",
    window_size: Optional[Sequence[int]] = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
    impl: Impl = "auto",
) -> None:
    """Zero in place the THD gradient rows whose true gradient is exactly 0.

    ``dq`` ([Tq, Hq, D], may be None), ``dk`` and ``dv`` ([Tkv, Hkv, D]) may be views of
    one packed buffer (``thd_t2hd``/``thd_th2d``). Offsets and mask arguments are TE's
    (see :func:`dead_row_masks`). KV rows are zeroed outside each sequence's attended key
    interval, dQ rows outside the valid query tokens and in sequences without keys.

    Bad input raises ``ValueError`` naming the argument, never a silently wrong
    gradient: metadata (dtype, shape, device, heads that do not divide, rows that share
    memory) and mask arguments (unknown ``attn_mask_type``, malformed ``window_size``,
    non-bool ``bottom_right_diagonal``) at once; impossible offset *values* (negative,
    decreasing, a padded segment shorter than its valid length, past the buffer) make the
    call zero nothing and raise ``OffsetsError`` (a ``ValueError``) naming the argument:
    at once on CPU or with ``TE_GQA_FIX_VALIDATE=1``, else on CUDA at the start of the
    next post-pass call on that device (see :mod:`te_gqa_fix.offset_errors`).

    No host sync unless ``TE_GQA_FIX_VALIDATE=1``. ``impl`` picks the Triton kernel
    (CUDA) or the PyTorch ops; ``auto`` uses Triton on CUDA when it is importable.
    """
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal, strict=True)
    check_metadata(
        dq, dk, dv, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded
    )
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        check_rows_disjoint(name, t)
    _zero_dead_rows(
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        span,
        impl,
    )


def zero_dead_rows_prechecked(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets: tuple,
    span: KeySpan,
    launches: Optional[object],
) -> None:
    """The post-pass for a caller that has already checked the call (the wrapper).

    The wrapper validates TE's inputs and the offsets' metadata once per call (a cached
    comparison) and resolves the mask to ``span`` once per call shape (TE validates its
    masks itself, so one this library does not know keeps the conservative set, logged
    once at WARNING), so this skips :func:`check_metadata`, the row-overlap check (TE's
    outputs are fresh tensors) and ``key_span``. Offset *values* are judged exactly as in
    :func:`zero_dead_rows`. ``launches`` (:class:`te_gqa_fix.triton_postpass.Launches`, or
    None for the PyTorch route) keys the kernel launch on the outputs' metadata. Whenever
    the kernel declines, the PyTorch post-pass runs: rows are never left unzeroed.
    """
    if deep_validation_enabled():
        offset_errors.raise_pending(dk.device)
        _deep_check(dq, dk, offsets)
    # The kernel's launch first raises what an earlier call on this device recorded
    # (its plan holds the device's host words: one read, no sync).
    if launches is not None and launches.launch(dq, dk, dv, offsets, span):  # type: ignore[attr-defined]
        return
    offset_errors.raise_pending(dk.device)
    _zero_with_torch(dq, dk, dv, offsets, span)


def _zero_dead_rows(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
    span: KeySpan,
    impl: Impl,
) -> None:
    """The post-pass proper, on checked metadata and a resolved span."""
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    # Bad offsets recorded by an earlier call on this device (host read, no sync).
    offset_errors.raise_pending(dk.device)
    if deep_validation_enabled():
        _deep_check(dq, dk, offsets)
    if _use_triton(impl, dk):
        from . import triton_postpass

        if triton_postpass.zero_dead_rows_triton(dq, dk, dv, *offsets, span=span):
            return
    _zero_with_torch(dq, dk, dv, offsets, span)


def _deep_check(dq: Optional[object], dk: object, offsets: tuple) -> None:
    """``TE_GQA_FIX_VALIDATE=1``: read the offsets now (a host sync) and raise at once."""
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
    rows_q = None if dq is None else int(shape_of(dq)[0])  # type: ignore[index]
    rows_kv = int(shape_of(dk)[0])  # type: ignore[index]
    dead = _dead_rows(*offsets, rows_q, rows_kv, span)
    zero_rows_(dk, dead.kv, "dk")
    zero_rows_(dv, dead.kv, "dv")
    if dq is not None and dead.q is not None:
        zero_rows_(dq, dead.q, "dq")
    _record_errors(dead.errors, dk.device)
