"""The one input gate: every public entry point checks its arguments here, same messages.

:func:`check_offsets` and :func:`check_metadata` read only metadata (no host sync, safe in
CUDA-graph capture); :func:`check_values` reads the offsets (a host sync) and runs on CPU
offsets, for ``plan``, and with ``TE_GQA_FIX_VALIDATE=on``. Errors name the argument.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .offset_errors import OffsetsError
from .te_names import OFFSET_NAMES

__all__ = [
    "MAX_ROWS",
    "check_disjoint",
    "check_in_place",
    "check_metadata",
    "check_offsets",
    "check_rows",
    "check_rows_disjoint",
    "check_values",
    "shape_of",
]

#: The most token rows a buffer may have: TE's offsets are int32.
MAX_ROWS = 2**31 - 1


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
) -> None:
    """Check TE's four offset arguments' metadata (no sync); raise ``ValueError`` naming one.

    The four must have one length (batch size + 1) and one device.

    Args:
        cu_seqlens_q, cu_seqlens_kv: valid offsets; ``*_padded``: buffer offsets or None.
        rows_q, rows_kv: the buffers' row counts, when given: non-negative ints.
        device: the device they must be on (default: ``cu_seqlens_q``'s).
    """
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, device)
    device = cu_q.device if device is None else device
    n = cu_q.numel()
    values = (cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    for name, value in zip(OFFSET_NAMES[1:], values):
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


def check_rows(name: str, rows: object) -> int:
    """``rows`` as an int in ``0 .. MAX_ROWS``, else ``ValueError`` naming ``name``."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= MAX_ROWS:
        raise ValueError(
            f"{name}: expected a non-negative int, at most 2**31 - 1 (TE's int32 offsets), "
            f"got {rows!r}"
        )
    return rows


def shape_of(t: object) -> Optional[tuple]:
    """The logical shape of a tensor, or of a TE FP8 storage (``size()`` but no ``shape``)."""
    shape = getattr(t, "shape", None)
    try:
        return tuple(t.size() if shape is None else shape)  # type: ignore[attr-defined]
    except Exception:  # no size(), a storage without data, a shape that is no sequence
        return None


def _rows(name: str, t: object) -> int:
    # A tensor, or a TE FP8 storage (which has a torch.device too); numpy has a str device.
    if not isinstance(getattr(t, "device", None), torch.device):
        raise ValueError(
            f"{name}: expected a torch.Tensor of shape [tokens, heads, head_dim], got "
            f"{type(t).__name__}"
        )
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


def check_rows_disjoint(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` when two token rows of ``t`` share memory (zeroing one would zero
    the other).

    Zero-stride inner dims are ignored: a tensor expanded along heads or head_dim repeats
    each row's own memory, and rows are zeroed whole, so zeroing a row zeroes it for every
    head at once, which is exact. The other dims of size > 1, sorted by stride, must each
    reach past what the smaller ones span (packed views like ``buf[:, 0]`` pass). A single
    row shares memory with no other row, whatever its inner layout.
    """
    if t.shape[0] <= 1 or t.is_contiguous():  # contiguous: the rule below passes it too
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


def check_in_place(name: str, t: object, data: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` where torch would refuse to write ``t`` in place.

    ``data`` is the tensor the post-pass writes (``t`` itself, or the raw bytes of a TE FP8
    storage). With grad mode on, a gradient that requires grad is refused: torch forbids
    in-place writes to a leaf that requires grad (an ``nn.Parameter``) and to views of one,
    and on any other such tensor the zeroing would enter the autograd graph. Under
    ``torch.no_grad()`` torch allows the write, and so does this check. An inference tensor
    can be written only inside ``torch.inference_mode()``.
    """
    if torch.is_grad_enabled() and getattr(t, "requires_grad", False):
        raise ValueError(
            f"{name}: expected a gradient that does not require grad, got one that requires "
            "grad (torch forbids zeroing it in place while grad mode is on); pass .detach() "
            "or call under torch.no_grad()"
        )
    if data.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{name}: expected a normal tensor, got an inference tensor outside inference "
            "mode (torch forbids writing it in place there); call under "
            "torch.inference_mode() or pass a clone made outside it"
        )


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _lattice_meets(delta: int, dims: list, budget: list) -> bool:
    """Whether ``delta == sum(k * stride)`` for some ``lo <= k <= hi`` per ``(stride, lo,
    hi)`` of ``dims`` (largest stride first); True too when ``budget`` runs out."""
    if not dims:
        return delta == 0
    (stride, lo, hi), rest = dims[0], dims[1:]
    low = sum(s * k for s, k, _ in rest)
    high = sum(s * k for s, _, k in rest)
    k_min = max(lo, -((high - delta) // stride))  # ceil((delta - high) / stride)
    k_max = min(hi, (delta - low) // stride)
    for k in range(k_min, k_max + 1):
        budget[0] -= 1
        if budget[0] < 0 or _lattice_meets(delta - k * stride, rest, budget):
            return True
    return False


def _may_share(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an element of ``a`` and one of ``b`` (on one device) can be the same memory
    (metadata only)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    if a1 <= b0 or b1 <= a0:
        return False
    size = a.element_size()
    delta = b.data_ptr() - a.data_ptr()
    if b.element_size() != size or delta % size or a.dim() != b.dim():
        return True
    dims = []
    for n_a, s_a, n_b, s_b in zip(a.shape, a.stride(), b.shape, b.stride()):
        live_a, live_b = n_a > 1 and s_a != 0, n_b > 1 and s_b != 0
        if live_a and live_b and s_a != s_b:
            return True  # different strides: no common lattice to reason on
        if live_a or live_b:
            dims.append(
                (s_a if live_a else s_b, 1 - n_b if live_b else 0, n_a - 1 if live_a else 0)
            )
    dims.sort(reverse=True)
    return _lattice_meets(delta // size, dims, [4096])


def check_disjoint(tensors: Sequence[tuple[str, Optional[torch.Tensor]]]) -> None:
    """Raise ``ValueError`` naming two of ``tensors`` (``(name, tensor)``, None skipped) when
    zeroing rows of one could write memory of the other. Metadata only (no sync).

    The rule: tensors whose byte ranges (``data_ptr`` to the last element) do not overlap
    are disjoint; so are tensors with the same element size and, on every dim where both
    have size > 1 and a non-zero stride, the same stride, when no element offset of one
    equals one of the other. That is a small integer check on the offset difference
    (``sum(k_i * stride_i)`` with each ``k_i`` bounded by the two sizes), exact for TE's
    packings: ``buf[:, 0]``/``buf[:, 1]`` of ``[t, 2, h, d]`` (``thd_t2hd``, ``t3hd``) and
    ``buf[:, :, 0]``/``buf[:, :, 1]`` of ``[t, h, 2, d]`` (``thd_th2d``, ``th3d``), and
    head slices of one ``[t, h, d]`` buffer. Anything else whose ranges overlap (other
    strides or dtypes) is refused, though it may not alias: pass separate buffers then; so
    is a pair whose check would take more than 4096 steps. The tensors share one device
    (:func:`check_metadata` checked that).
    """
    present = [(name, t) for name, t in tensors if t is not None]
    for i, (name_a, a) in enumerate(present):
        for name_b, b in present[i + 1 :]:
            if _may_share(a, b):
                raise ValueError(
                    f"{name_b}: expected memory separate from {name_a}'s, got views that "
                    f"overlap (shapes {tuple(a.shape)} and {tuple(b.shape)}, strides "
                    f"{tuple(a.stride())} and {tuple(b.stride())}): zeroing rows of one "
                    "would zero rows of the other. Pass separate buffers or disjoint views "
                    "of one packed buffer"
                )


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
