"""The one input gate: every public entry point checks its arguments here, same messages.

:func:`check_offsets` and :func:`check_metadata` read only metadata (no host sync, safe in
CUDA-graph capture). :func:`offset_faults` is the one statement of which offset values are
impossible, as device ops: :func:`check_values` reads it on the host (a sync: on CPU offsets,
for ``plan``, and with ``TE_GQA_FIX_VALIDATE=on``) and :func:`offset_error_bits` folds it
into the error word the post-pass records without a sync. Errors name the argument.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from .te_names import OFFSET_NAMES


class OffsetsError(ValueError):
    """Offsets that cannot be right: found by :func:`check_values` on the host, or by the
    post-pass on the device and raised later from its error channel."""


__all__ = [
    "ARGUMENT_BITS",
    "MAX_ROWS",
    "OffsetsError",
    "check_disjoint",
    "check_in_place",
    "check_metadata",
    "check_offsets",
    "check_rows",
    "check_rows_disjoint",
    "check_values",
    "offset_error_bits",
    "offset_faults",
    "shape_of",
]

#: The most token rows a buffer may have: TE's offsets are int32.
MAX_ROWS = 2**31 - 1

#: The error word's layout: one bit per offset argument, in TE's names.
ARGUMENT_BITS: Dict[str, int] = {name: 1 << i for i, name in enumerate(OFFSET_NAMES)}


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


class Fault(NamedTuple):
    """One way offsets are impossible: where it holds and which arguments it names."""

    names: tuple  # the offending arguments (their ARGUMENT_BITS)
    bad: torch.Tensor  # bool, per offset or per sequence: where it holds
    message: Callable[[int], str]  # the error for the first index where it holds (host)


def _order_message(name: str, x: torch.Tensor, i: int) -> str:
    if i == 0:
        return f"{name}: expected offsets >= 0, got {int(x[0])} first"
    a, b = int(x[i - 1]), int(x[i])
    return f"{name}: expected non-decreasing offsets, got {a} then {b} at index {i}"


def _short_message(names: tuple, cu: torch.Tensor, buf: torch.Tensor, b: int) -> str:
    tokens, rows = int(cu[b + 1] - cu[b]), int(buf[b + 1] - buf[b])
    return f"{names[0]}: sequence {b} has {tokens} tokens but {names[1]} gives it only {rows} rows"


def _past_message(name: str, buf: torch.Tensor, rows: int, side: str, _: int) -> str:
    return f"{name}: last offset {int(buf[-1])} is past the {rows} {side} rows of the buffer"


def offset_faults(
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    pad_q: Optional[torch.Tensor],
    pad_kv: Optional[torch.Tensor],
    rows_q: Optional[int],
    rows_kv: int,
) -> List[Fault]:
    """The one statement of impossible THD offsets, as device ops (no sync, graph-safe).

    Every offset argument is non-negative and non-decreasing; every sequence's buffer segment
    holds its valid tokens; each side's last buffer offset lies within its buffer. The buffer
    offsets are the padded ones, or the valid ones where padded offsets are not given (TE's
    rule), and a fault of the buffer offsets names that argument. The Triton kernel restates
    this in ``tl``; its tests hold it to :func:`offset_error_bits`.

    Args:
        cu_q, cu_kv, pad_q, pad_kv: int64 offsets of one length >= 1 (``pad_*`` None: not
            given).
        rows_q: the q buffer's rows, or None (its end is not checked); rows_kv: kv's rows.

    Returns:
        The faults, in the order :func:`check_values` reports them.
    """
    faults = []
    for side, cu, pad, rows in (("q", cu_q, pad_q, rows_q), ("kv", cu_kv, pad_kv, rows_kv)):
        cu_name, pad_name = f"cu_seqlens_{side}", f"cu_seqlens_{side}_padded"
        for name, x in ((cu_name, cu), (pad_name, pad)):
            if x is not None:
                bad = torch.cat((x[:1] < 0, x[1:] < x[:-1]))
                faults.append(Fault((name,), bad, functools.partial(_order_message, name, x)))
        buf, buf_name = (cu, cu_name) if pad is None else (pad, pad_name)
        if pad is not None:  # a segment shorter than its valid length: the two disagree
            short = (pad[1:] - pad[:-1]) < (cu[1:] - cu[:-1])
            names = (cu_name, pad_name)
            faults.append(Fault(names, short, functools.partial(_short_message, names, cu, pad)))
        if rows is not None:
            past = buf[-1:] > rows
            message = functools.partial(_past_message, buf_name, buf, rows, side)
            faults.append(Fault((buf_name,), past, message))
    return faults


def offset_error_bits(faults: Sequence[Fault]) -> torch.Tensor:
    """The :data:`ARGUMENT_BITS` of every argument some fault names, as an int32 device
    scalar (no sync): what the post-pass records in its error word."""
    bits = None
    for fault in faults:
        mask = sum(ARGUMENT_BITS[name] for name in set(fault.names))
        term = fault.bad.any().to(torch.int32) * mask
        bits = term if bits is None else bits | term
    return bits  # type: ignore[return-value]


def check_values(
    rows_q: Optional[int],
    rows_kv: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
) -> None:
    """:func:`offset_faults`, read on the host (a sync): the first fault raises.

    Raises :class:`OffsetsError` (a ``ValueError``), the same error the sync-free check
    raises later, so one ``except`` catches both.
    """
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    cpu = [None if t is None else t.detach().to("cpu", torch.int64) for t in offsets]
    for fault in offset_faults(*cpu, rows_q, rows_kv):  # type: ignore[arg-type]
        where = fault.bad.nonzero()
        if where.numel():
            raise OffsetsError(fault.message(int(where[0, 0])))
