"""Rows of THD tensors moved between two buffers' sequences: the exact fallback's split.

Top-left causal across two offsets tensors runs as one FlashAttention-2 call on keys moved to
their queries' rows (:mod:`te_gqa_fix.fallback`); the gradients move back. Both moves follow
one rule, :func:`move_rows`. On CUDA with Triton it is one kernel launch per move (the same
rule in PyTorch is a dozen small device ops, each a launch on the host); elsewhere it is
PyTorch. Both keep the offsets on the device: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence, Tuple

import torch

from .. import _kernel
from .._logging import log_once

__all__ = ["move_rows"]

#: Rows and elements per row (of the flattened heads x head dim) per program step.
BLOCK_R = 32
BLOCK_W = 256


@functools.cache
def _triton_available() -> bool:
    try:
        return _kernel.build_row_moves() is not None
    except Exception as exc:  # ImportError, or a broken install raising anything else
        log_once(("triton-moves",), logging.INFO, "no Triton (%s); PyTorch row moves", exc)  # fmt: skip
        return False


Side = Tuple[torch.Tensor, Optional[torch.Tensor]]


def move_rows(
    tensors: Sequence[torch.Tensor], rows: int, to: Side, source: Side, impl: str = "auto"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two ``[t, h, d]`` tensors' rows, moved to another buffer's segmentation.

    Sequence ``b`` of side ``s`` starts at buffer row ``padded_s[b]`` and holds
    ``cu_s[b + 1] - cu_s[b]`` valid rows. With ``n_b`` the smaller of the two sides' counts,
    row ``padded_to[b] + p`` of the result is row ``padded_source[b] + p`` of the input for
    ``0 <= p < n_b``, and every other row is 0. Offsets outside the buffers are clamped to
    them, so impossible offsets read and write nothing outside.

    Args:
        tensors: two tensors ``[rows_source, h, d]`` with unit last stride (``d`` may differ).
        rows: the result's row count.
        to, source: each side's ``(cu_seqlens, cu_seqlens_padded or None)``, int32, of one
            length ``nseq + 1 >= 2``, on the tensors' device.
        impl: ``auto`` (the Triton kernel on CUDA where Triton imports), ``torch``, or
            ``triton``.

    Returns:
        The two moved tensors, ``[rows, h, d]``, contiguous.
    """
    outs = tuple(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensors)
    cu_to, pad_to = to[0], to[0] if to[1] is None else to[1]
    cu_from, pad_from = source[0], source[0] if source[1] is None else source[1]
    use_triton = impl == "triton" or (
        impl == "auto" and outs[0].device.type == "cuda" and _triton_available()
    )
    if not use_triton:
        return _move_with_torch(tensors, outs, cu_to, pad_to, cu_from, pad_from)
    a, b = tensors
    nseq = cu_to.shape[0] - 1
    # The kernel reads the offsets at unit stride.
    cu_to, pad_to, cu_from, pad_from = (t.contiguous() for t in (cu_to, pad_to, cu_from, pad_from))
    grid = (max(1, -(-rows // BLOCK_R)),)
    _kernel.build_row_moves()[grid](
        a, b, outs[0], outs[1], cu_to, pad_to, cu_from, pad_from,
        nseq, rows, a.shape[0], a.shape[2], b.shape[2], a.shape[1] * a.shape[2],
        b.shape[1] * b.shape[2], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        outs[0].stride(0), outs[0].stride(1), outs[1].stride(0), outs[1].stride(1),
        BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, SEARCH_STEPS=nseq.bit_length(),
    )  # fmt: skip
    return outs


def _move_with_torch(tensors, outs, cu_to, pad_to, cu_from, pad_from) -> Tuple[torch.Tensor, ...]:
    """:func:`move_rows` in PyTorch device ops, into ``outs``."""
    rows, rows_from = outs[0].shape[0], tensors[0].shape[0]
    if rows_from == 0:  # nothing to move: every row is 0
        return tuple(out.zero_() for out in outs)
    starts = pad_to[:-1]
    t = torch.arange(rows, dtype=starts.dtype, device=starts.device)
    seq = torch.searchsorted(starts, t, right=True) - 1  # the last b with padded_to[b] <= t
    found = seq >= 0
    seq = seq.clamp_(min=0)
    pos = t - starts[seq]
    n = torch.minimum(cu_to[1:] - cu_to[:-1], cu_from[1:] - cu_from[:-1])[seq]
    live = (found & (pos >= 0) & (pos < n)).view(-1, 1, 1)
    source = (pad_from[:-1][seq] + pos).clamp_(0, max(rows_from - 1, 0))
    for src, out in zip(tensors, outs):
        torch.index_select(src, 0, source, out=out)
        out.masked_fill_(~live, 0)
    return outs
