"""The post-pass: zero, in place, every dQ/dK/dV row whose true gradient is exactly 0.

On the affected cuDNN builds the damage is on rows whose true gradient is 0, so zeros there
are exact. :func:`prepare_kernel` decides kernel-or-torch; the PyTorch path uses shape-driven
device ops only (no ``.item()``, no branch on a tensor value), so it is CUDA-graph safe.

The package is the whole post-pass: this module (the public functions and the PyTorch path),
:mod:`.kernel` (the Triton kernel), :mod:`.launch` (its prepared launches and the one launch
route) and :mod:`.offset_errors` (the sync-free error channel for impossible offsets).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from .. import settings
from .._logging import log_once
from ..masks import KeySpan, key_bounds, key_span
from ..validation import (
    check_disjoint,
    check_in_place,
    check_metadata,
    check_offsets,
    check_rows,
    check_rows_disjoint,
    check_values,
    offset_error_bits,
    offset_faults,
    shape_of,
)
from . import launch, offset_errors

__all__ = [
    "DeadRows",
    "dead_row_masks",
    "prepare_kernel",
    "zero_checked",
    "zero_dead_rows",
    "zero_rows_",
]

Impl = Literal["auto", "torch", "triton"]


@dataclass(frozen=True)
class DeadRows:
    """Boolean masks, True where a row's true gradient is 0; ``errors``: the int32 device
    scalar of offset error bits (non-zero: both masks all False, nothing is zeroed)."""

    q: Optional[torch.Tensor]
    kv: torch.Tensor
    errors: Optional[torch.Tensor] = None


def _row_sequences(rows: int, padded: torch.Tensor):
    """Per buffer row: inside a sequence (``padded[b] <= t < padded[b + 1]``), its ``b``,
    and its position in the sequence."""
    nseq = padded.numel() - 1
    t = torch.arange(rows, device=padded.device, dtype=torch.int64)
    seg = torch.searchsorted(padded, t, right=True) - 1
    inside = (seg >= 0) & (seg < nseq)
    seg = seg.clamp(0, max(nseq - 1, 0))
    pos = t - padded[seg]
    return inside, seg, pos


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
    cu_q, cu_kv = cu_seqlens_q.to(torch.int64), cu_seqlens_kv.to(torch.int64)
    given_q, given_kv = (
        None if t is None else t.to(torch.int64)
        for t in (cu_seqlens_q_padded, cu_seqlens_kv_padded)
    )
    errors = offset_error_bits(offset_faults(cu_q, cu_kv, given_q, given_kv, rows_q, rows_kv))
    pad_q = cu_q if given_q is None else given_q  # the buffer offsets (TE's rule)
    pad_kv = cu_kv if given_kv is None else given_kv
    ok = errors == 0
    if cu_seqlens_q.numel() <= 1:  # no sequence: every row is dead
        ones = dict(dtype=torch.bool, device=cu_seqlens_kv.device)
        q_dead = None if rows_q is None else torch.ones(rows_q, **ones) & ok
        return DeadRows(q=q_dead, kv=torch.ones(rows_kv, **ones) & ok, errors=errors)
    lq, lk = cu_q[1:] - cu_q[:-1], cu_kv[1:] - cu_kv[:-1]
    lo, hi = key_bounds(lq, lk, span)
    inside, seg, pos = _row_sequences(rows_kv, pad_kv.contiguous())
    kv_keep = inside & (pos >= lo[seg]) & (pos < hi[seg])
    q_dead = None
    if rows_q is not None:
        inside_q, seg_q, pos_q = _row_sequences(rows_q, pad_q.contiguous())
        q_keep = inside_q & (pos_q < lq[seg_q]) & (lk[seg_q] > 0)
        q_dead = ~q_keep & ok
    return DeadRows(q=q_dead, kv=~kv_keep & ok, errors=errors)


def _record_errors(errors: Optional[torch.Tensor], device: torch.device) -> None:
    """Store a call's error bits where :mod:`.offset_errors` reads them: on CPU, raise now;
    on CUDA, a device OR and a non-blocking copy into the pinned word (no sync)."""
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
    Sync-free; the masks live on the offsets' device (``'arbitrary'``: keep every valid
    key of a sequence with queries).

    Args:
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded: TE's int32
            offsets. rows_q (None: no dQ mask), rows_kv: ints from 0 to 2**31 - 1.
        attn_mask_type, window_size, bottom_right_diagonal: TE's mask arguments.

    Returns:
        A :class:`DeadRows`.

    Raises:
        ValueError: malformed arguments, naming the argument (the checks and messages of
            :func:`zero_dead_rows`). Impossible offsets give masks with nothing dead and
            are reported as described in :mod:`te_gqa_fix.postpass.offset_errors` (CPU:
            ``OffsetsError``, a ``ValueError``, at once; CUDA: at the next post-pass call).
    """
    # The checks of zero_dead_rows, in its order: the same input gets the same error.
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal, strict=True)
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    check_offsets(*offsets, rows_q=rows_q)
    check_rows("rows_kv", rows_kv)
    dead = _dead_rows(*offsets, rows_q, rows_kv, span)
    _record_errors(dead.errors, cu_seqlens_kv.device)
    return dead


def _plain_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass whose data is its own strided tensor (no ``__torch_dispatch__``
    of its own, so its memory is what a plain tensor view of it sees)."""
    return (
        type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__  # type: ignore[attr-defined]
        and t.layout is torch.strided
    )


def _writable_rows(t: object, name: str, strict: bool = False) -> Optional[torch.Tensor]:
    """The plain strided tensor holding ``t``'s rows; where there is none, ``strict`` (the
    public API) raises ``ValueError`` naming ``name``, else None is returned (logged once).

    Plain tensors and ``nn.Parameter`` are their own rows; a tensor subclass without its own
    ``__torch_dispatch__`` is written through a plain view of its memory; a TE FP8 storage
    through its raw bytes (byte 0 is +0 in E4M3 and E5M2) unless a cached transpose would
    go stale. Everything else (other wrapper subclasses, sparse or nested layouts) is not.
    """
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        if t.layout is torch.strided:  # type: ignore[union-attr]
            return t  # type: ignore[return-value]
    elif isinstance(t, torch.Tensor) and _plain_subclass(t):
        with torch._C.DisableTorchFunctionSubclass():
            return t.view(t.shape)
    data = getattr(t, "_data", None)
    transpose = getattr(t, "_transpose", None)
    transpose_live = transpose is not None and not getattr(t, "_transpose_invalid", False)
    if (
        isinstance(data, torch.Tensor)
        and type(data) is torch.Tensor
        and data.dtype == torch.uint8
        and tuple(data.shape) == shape_of(t)
        and not transpose_live
    ):
        return data
    kind = type(t).__name__
    if strict:
        raise ValueError(
            f"{name}: expected a torch.Tensor whose rows can be zeroed in place (a plain or "
            "nn.Parameter tensor, a subclass without its own __torch_dispatch__, or a TE FP8 "
            f"tensor without a live cached transpose), got a {kind} (layout "
            f"{getattr(t, 'layout', None)}) whose raw rows cannot be zeroed safely"
        )
    log_once(
        ("quantized-output", kind),
        logging.WARNING,
        "te_gqa_fix: %s is a %s whose raw rows cannot be zeroed safely; passed through "
        "unchanged (rows of sequences without queries may hold stale values)",
        name,
        kind,
    )
    return None


def zero_rows_(t: Optional[object], dead: torch.Tensor, name: str = "tensor") -> None:
    """``t[dead] = 0`` in place along dim 0 via ``masked_fill_`` (works through views; a
    zero-stride inner dim is written once, as its one element repeats)."""
    if t is None:
        return
    target = _writable_rows(t, name)
    if target is None:
        return
    for dim in range(1, target.dim()):
        if target.stride(dim) == 0 and target.shape[dim] > 1:
            target = target.narrow(dim, 0, 1)
    mask = dead.view(-1, *([1] * (target.dim() - 1)))
    target.masked_fill_(mask, 0)


_broken = False


def prepare_kernel(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple, span: KeySpan
) -> Optional[launch.KernelLaunch]:
    """The one decision between the Triton kernel and PyTorch: a prepared launch, or None.

    Args:
        dq, dk, dv: the gradients (dq None: dK/dV only); offsets: TE's four offsets.
        span: the mask's key interval rule.

    Returns:
        A :class:`te_gqa_fix.postpass.launch.KernelLaunch` where the kernel handles these tensors (CUDA,
        Triton, plain fp16/bf16/fp32 tensors), else None (why is logged once at DEBUG).
    """
    if _broken or dk.device.type != "cuda" or not launch.available():
        return None
    why = launch.unsupported(dq, dk, dv, offsets)
    if why is not None:
        log_once(("no-kernel", why), logging.DEBUG, "te_gqa_fix: PyTorch post-pass for %s", why)
        return None
    return launch.prepare(dq, dk, dv, offsets, span)


def zero_checked(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets: tuple,
    span: KeySpan,
    kernel_launch: Optional[launch.KernelLaunch],
    validate: bool,
) -> None:
    """The post-pass on checked arguments: the kernel when ``kernel_launch`` is given, else PyTorch.

    First raises what an earlier call on this device recorded (a host read, no sync).
    ``validate`` (``TE_GQA_FIX_VALIDATE=on``) reads the offsets now (a sync) and raises in
    this call.
    """
    global _broken
    offset_errors.raise_pending(dk.device)
    if validate:
        rows_q = None if dq is None else int(shape_of(dq)[0])  # type: ignore[index]
        check_values(rows_q, int(shape_of(dk)[0]), *offsets)  # type: ignore[index]
    if kernel_launch is not None and not _broken:
        try:
            launch.run_kernel(kernel_launch, dq, dk, dv, offsets)
            return
        except Exception as exc:  # compile or launch failure: never leave rows unzeroed
            _broken = True
            msg = "te_gqa_fix: Triton post-pass failed (%r); PyTorch post-pass from now on"
            log_once(("kernel-failed",), logging.WARNING, msg, exc)
    _zero_with_torch(dq, dk, dv, offsets, span)


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

    KV rows are zeroed outside each sequence's attended key interval, dQ rows outside the
    valid query tokens and in sequences without keys. No host sync unless
    ``TE_GQA_FIX_VALIDATE=on``.

    Args:
        dq: ``[Tq, Hq, D]`` or None; dk, dv: ``[Tkv, Hkv, D]``. Each a torch.Tensor whose
            rows can be written in place: plain, ``nn.Parameter``, a subclass without its
            own ``__torch_dispatch__``, or a TE FP8 tensor without a live cached transpose.
            Disjoint views of one packed buffer are fine; views that overlap are not.
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded: TE's int32
            offsets (padded None: the valid ones).
        attn_mask_type, window_size, bottom_right_diagonal: TE's mask arguments.
        impl: ``auto``/``triton`` (the kernel where it applies) or ``torch``.

    Raises:
        ValueError: bad metadata or mask arguments, gradients that share memory, require
            grad (grad mode on) or are inference tensors (outside inference mode), naming
            the argument, before anything is written. Impossible offset values make the
            call zero nothing and raise ``OffsetsError`` (a ValueError): at once on CPU or
            with validation on, else at the next post-pass call on that device (see
            :mod:`te_gqa_fix.postpass.offset_errors`).
    """
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl: expected 'auto', 'torch' or 'triton', got {impl!r}")
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal, strict=True)
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    check_metadata(dq, dk, dv, *offsets)
    named = []
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        data = None if t is None else _writable_rows(t, name, strict=True)
        if data is not None:
            check_in_place(name, t, data)
            check_rows_disjoint(name, data)
        named.append((name, data))
    check_disjoint(named)
    kernel_launch = None if impl == "torch" else prepare_kernel(dq, dk, dv, offsets, span)
    zero_checked(
        dq, dk, dv, offsets, span, kernel_launch, settings.get("TE_GQA_FIX_VALIDATE") == "on"
    )


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
