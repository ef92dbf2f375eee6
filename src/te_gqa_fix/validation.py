"""The one input gate: every public entry point checks its arguments here, same messages.

:func:`check_offsets` and :func:`check_metadata` read only metadata (no host sync, safe in
CUDA-graph capture); :func:`check_values` reads the offsets (a host sync) and runs on CPU
offsets, for ``plan``, and with ``TE_GQA_FIX_VALIDATE=on``. Errors name the argument.
"""

from __future__ import annotations

from typing import Optional

import torch

from .offset_errors import OffsetsError

__all__ = [
    "check_metadata",
    "check_offsets",
    "check_rows",
    "check_rows_disjoint",
    "check_values",
    "shape_of",
]


_OFFSET_NAMES = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def _offsets(name: str, value: object, device: Optional[torch.device]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{name}: expected a 1-D torch.int32 tensor of batch_size + 1 offsets, "
            f"got {type(value).__name__}"
        )
    if value.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32 (as TE requires), got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(
            f"{name}: expected a 1-D tensor of batch_size + 1 offsets, got shape {tuple(value.shape)}"
        )
    if value.numel() < 1:
        raise ValueError(f"{name}: expected at least one offset (batch_size + 1 >= 1), got none")
    if value.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data, got a meta tensor")
    if device is not None and value.device != device:
        raise ValueError(
            f"{name}: expected it on the attention tensors' device {device}, got {value.device}"
        )
    return value


def check_offsets(
    cu_seqlens_q: object,
    cu_seqlens_kv: object,
    cu_seqlens_q_padded: object = None,
    cu_seqlens_kv_padded: object = None,
    *,
    rows_q: object = None,
    rows_kv: object = None,
    device: Optional[torch.device] = None,
) -> int:
    """Check TE's four offset arguments' metadata (no sync); raise ``ValueError`` naming one.

    Args:
        cu_seqlens_q, cu_seqlens_kv: valid offsets; ``*_padded``: buffer offsets or None.
        rows_q, rows_kv: the buffers' row counts, when given: non-negative ints.
        device: the device they must be on (default: ``cu_seqlens_q``'s).

    Returns:
        The number of offsets (batch size + 1), the same for all four.
    """
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, device)
    device = cu_q.device if device is None else device
    n = cu_q.numel()
    values = (cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    for name, value in zip(_OFFSET_NAMES[1:], values):
        if value is None and name != "cu_seqlens_kv":
            continue
        t = _offsets(name, value, device)
        if t.numel() != n:
            raise ValueError(
                f"{name}: expected {n} offsets (batch_size + 1, as cu_seqlens_q), got {t.numel()}"
            )
    for name, rows in (("rows_q", rows_q), ("rows_kv", rows_kv)):
        if rows is not None:
            check_rows(name, rows)
    return n


def check_rows(name: str, rows: object) -> int:
    """``rows`` as a non-negative int, else ``ValueError`` naming ``name``."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {rows!r}")
    return rows


def shape_of(t: object) -> Optional[tuple]:
    """The logical shape of a tensor, or of a TE FP8 storage (``size()`` but no ``shape``)."""
    shape = getattr(t, "shape", None)
    if shape is None:
        size = getattr(t, "size", None)
        if callable(size):
            try:
                shape = size()
            except Exception:  # a storage without data: shape unknown
                shape = None
    try:
        return None if shape is None else tuple(shape)
    except TypeError:
        return None


def _rows(name: str, t: object) -> int:
    shape = shape_of(t)
    if shape is None or len(shape) != 3:
        raise ValueError(
            f"{name}: expected a THD tensor of shape [tokens, heads, head_dim], got {shape}"
        )
    return int(shape[0])


def check_metadata(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
    num_heads_q: Optional[int] = None,
    num_heads_kv: Optional[int] = None,
    names: tuple[str, str, str] = ("dq", "dk", "dv"),
) -> None:
    """Sync-free checks of gradients (or TE's ``q, k, v``: ``names``) and offsets; raise
    ``ValueError`` naming the offending argument."""
    name_q, name_k, name_v = names
    rows_k = _rows(name_k, dk)
    rows_v = _rows(name_v, dv)
    if rows_k != rows_v:
        raise ValueError(
            f"{name_v}: expected the same number of token rows as {name_k} ({rows_k}), got {rows_v}"
        )
    if dq is not None:
        _rows(name_q, dq)
    device = dk.device
    for name, t in ((name_v, dv), (name_q, dq)):
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected it on {name_k}'s device {device}, got {t.device}")
    check_offsets(
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, device=device
    )
    # Heads: from the arguments when the wrapper passes TE's q/k heads, else the shapes
    # (the README promises this check for the public post-pass too).
    heads_k = int(shape_of(dk)[1])  # type: ignore[index]
    heads_v = int(shape_of(dv)[1])  # type: ignore[index]
    if heads_v != heads_k:
        raise ValueError(
            f"{name_v}: expected the same number of heads as {name_k} ({heads_k}), got {heads_v}"
        )
    if num_heads_kv is None:
        num_heads_kv = heads_k
    if num_heads_q is None and dq is not None:
        num_heads_q = int(shape_of(dq)[1])  # type: ignore[index]
    if num_heads_kv <= 0:
        raise ValueError(f"{name_k}: expected at least one KV head, got {num_heads_kv}")
    if num_heads_q is not None and (num_heads_q <= 0 or num_heads_q % num_heads_kv != 0):
        raise ValueError(
            f"{name_k}: expected a number of KV heads that divides the query heads "
            f"({num_heads_q}), got {num_heads_kv}"
        )


def check_rows_disjoint(name: str, t: object) -> None:
    """Raise ``ValueError`` when two token rows of ``t`` share memory (zeroing one would zero
    the other). Ignoring zero-stride inner dims, the dims of size > 1 sorted by stride must
    each reach past what the smaller ones span (packed views like ``buf[:, 0]`` pass)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] <= 1:
        return
    if t.is_contiguous():
        return
    dims = sorted(
        (abs(st), n)
        for i, (n, st) in enumerate(zip(t.shape, t.stride()))
        if n > 1 and (st != 0 or i == 0)
    )
    extent = 1
    for stride, size in dims:
        if stride < extent:
            raise ValueError(
                f"{name}: expected token rows that do not share memory, got shape "
                f"{tuple(t.shape)} with strides {tuple(t.stride())} (rows overlap, e.g. an "
                "expand along the token axis); zeroing one row would zero another. Pass a "
                "tensor with its own storage per row (e.g. .contiguous())"
            )
        extent += (size - 1) * stride


def _check_monotonic(name: str, t: torch.Tensor) -> list[int]:
    values = [int(x) for x in t.tolist()]
    if values and values[0] < 0:
        raise OffsetsError(f"{name}: expected offsets >= 0, got {values[0]} first")
    for i, (a, b) in enumerate(zip(values, values[1:]), 1):
        if b < a:
            raise OffsetsError(
                f"{name}: expected non-decreasing offsets, got {a} then {b} at index {i}"
            )
    return values


def check_values(
    rows_q: Optional[int],
    rows_kv: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
) -> None:
    """Deep checks that read the offsets (host sync): monotonic, lengths fit, in bounds.

    Raises :class:`~te_gqa_fix.offset_errors.OffsetsError` (a ``ValueError``), the same
    error the sync-free check raises later, so one ``except`` catches both.
    """
    sides = (
        ("q", rows_q, cu_seqlens_q, cu_seqlens_q_padded),
        ("kv", rows_kv, cu_seqlens_kv, cu_seqlens_kv_padded),
    )
    for side, rows, cu, pad in sides:
        cu_name, pad_name = f"cu_seqlens_{side}", f"cu_seqlens_{side}_padded"
        valid = _check_monotonic(cu_name, cu)
        padded = valid if pad is None else _check_monotonic(pad_name, pad)
        where = pad_name if pad is not None else cu_name
        for b, (v0, v1, p0, p1) in enumerate(zip(valid, valid[1:], padded, padded[1:])):
            if v1 - v0 > p1 - p0:
                raise OffsetsError(
                    f"{cu_name}: sequence {b} has {v1 - v0} tokens but {where} gives it "
                    f"only {p1 - p0} rows"
                )
        if rows is not None and padded and padded[-1] > rows:
            raise OffsetsError(
                f"{where}: last offset {padded[-1]} is past the {rows} {side} rows of the buffer"
            )
