"""The input gate: every entry point checks its arguments here, with one set of messages.

Each check raises :class:`~te_gqa_fix.errors.InputError` (a ``ValueError``) naming the
argument and what was expected, before anything is written. All but :func:`offset_values`
read metadata only (no host sync, safe in CUDA-graph capture). :func:`offset_faults` is the
one statement of which offset values are impossible, as device ops: :func:`offset_values`
reads it on the host (a sync: on CPU, in ``plan``, and with ``TE_GQA_FIX_VALIDATE=on``) and
:func:`offset_error_bits` folds it into the error word the post-pass records without a sync
(the Triton kernel restates it in ``tl``; the tests hold the two together).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ._logging import log_once
from ._te import MASKS, OFFSET_NAMES
from .errors import InputError, OffsetsError
from .masks import CONSERVATIVE_MASK_TYPES, window_pair

__all__ = [
    "ARGUMENT_BITS",
    "MAX_ROWS",
    "device",
    "disjoint",
    "error_names",
    "gradients",
    "impl",
    "in_place",
    "mask_arguments",
    "offset_error_bits",
    "offset_faults",
    "offset_values",
    "offsets",
    "rows",
    "rows_disjoint",
    "shape_of",
    "writable_rows",
]

#: The most token rows a buffer may have: TE's offsets are int32.
MAX_ROWS = 2**31 - 1

#: The error word's layout: one bit per offset argument, in TE's names.
ARGUMENT_BITS: Dict[str, int] = {name: 1 << i for i, name in enumerate(OFFSET_NAMES)}


# --------------------------------------------------------------------------- offsets
def _offsets(name: str, value: object, device: Optional[torch.device], of: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InputError(
            f"{name}: expected a 1-D torch.int32 tensor of batch_size + 1 offsets, "
            f"got {type(value).__name__}"
        )
    if value.dtype != torch.int32:
        raise InputError(f"{name}: expected dtype torch.int32 (as TE requires), got {value.dtype}")
    if value.dim() != 1:
        raise InputError(
            f"{name}: expected a 1-D tensor of batch_size + 1 offsets, got shape {tuple(value.shape)}"
        )
    if value.numel() < 1:
        raise InputError(f"{name}: expected at least one offset (batch_size + 1 >= 1), got none")
    if value.device.type == "meta":
        raise InputError(f"{name}: expected a tensor with data, got a meta tensor")
    if device is not None and value.device != device:
        raise InputError(f"{name}: expected it on {of}'s device {device}, got {value.device}")
    return value


def offsets(
    cu_seqlens_q: object,
    cu_seqlens_kv: object,
    cu_seqlens_q_padded: object = None,
    cu_seqlens_kv_padded: object = None,
    *,
    rows_q: object = None,
    rows_kv: object = None,
    device: Optional[torch.device] = None,
    device_of: str = "cu_seqlens_q",
) -> None:
    """Check TE's four offset arguments' metadata: int32, 1-D, at least one, not meta, of
    one length (batch size + 1) and on one device.

    Args:
        cu_seqlens_q, cu_seqlens_kv: valid offsets; ``*_padded``: buffer offsets or None.
        rows_q, rows_kv: the buffers' row counts, when given (:func:`rows`).
        device: the device they must be on (default: ``cu_seqlens_q``'s).
        device_of: what ``device`` is the device of, as the message names it.
    """
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, device, device_of)
    if device is None:
        device, device_of = cu_q.device, "cu_seqlens_q"
    n = cu_q.numel()
    values = (cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    for name, value in zip(OFFSET_NAMES[1:], values):
        if value is None and name != "cu_seqlens_kv":
            continue
        t = _offsets(name, value, device, device_of)
        if t.numel() != n:
            raise InputError(
                f"{name}: expected {n} offsets (batch_size + 1, as cu_seqlens_q), got {t.numel()}"
            )
    for name, count in (("rows_q", rows_q), ("rows_kv", rows_kv)):
        if count is not None:
            rows(name, count)


def rows(name: str, count: object) -> int:
    """``count`` as an int in ``0 .. MAX_ROWS``, else :class:`InputError` naming ``name``."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_ROWS:
        raise InputError(
            f"{name}: expected a non-negative int, at most 2**31 - 1 (TE's int32 offsets), "
            f"got {count!r}"
        )
    return count


# ------------------------------------------------------------------------- gradients
def shape_of(t: object) -> Optional[tuple]:
    """The logical shape of a tensor, or of a TE FP8 storage (``size()`` but no ``shape``);
    None where there is none (a nested tensor, a storage without data)."""
    try:
        shape = getattr(t, "shape", None)
        return tuple(t.size() if shape is None else shape)  # type: ignore[attr-defined]
    except Exception:  # no size(), a nested tensor, a shape that is no sequence
        return None


def _thd_rows(name: str, t: object) -> int:
    # A tensor, or a TE FP8 storage (which has a torch.device too); numpy has a str device.
    if not isinstance(getattr(t, "device", None), torch.device):
        raise InputError(
            f"{name}: expected a torch.Tensor of shape [tokens, heads, head_dim], got "
            f"{type(t).__name__}"
        )
    if getattr(t, "is_nested", False):
        raise InputError(
            f"{name}: expected a strided torch.Tensor of shape [tokens, heads, head_dim], got "
            "a nested tensor (pass the packed THD buffer itself)"
        )
    shape = shape_of(t)
    if shape is None or len(shape) != 3:
        raise InputError(
            f"{name}: expected a THD tensor of shape [tokens, heads, head_dim], got {shape}"
        )
    return int(shape[0])


def gradients(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
    num_heads_q: Optional[int] = None,
    num_heads_kv: Optional[int] = None,
    names: Tuple[str, str, str] = ("dq", "dk", "dv"),
) -> None:
    """Sync-free checks of THD gradients (or TE's ``q, k, v``: ``names``) and their offsets:
    ``[tokens, heads, head_dim]``, dK and dV of equal rows and heads, KV heads dividing
    query heads, one device.

    Args:
        dq, dk, dv: the tensors (dq None: not checked).
        cu_seqlens_*: TE's offsets (:func:`offsets`).
        num_heads_q, num_heads_kv: the heads to check (default: from the shapes).
        names: how the messages name dq, dk and dv.
    """
    name_q, name_k, name_v = names
    rows_k = _thd_rows(name_k, dk)
    rows_v = _thd_rows(name_v, dv)
    if rows_k != rows_v:
        raise InputError(
            f"{name_v}: expected the same number of token rows as {name_k} ({rows_k}), got {rows_v}"
        )
    if dq is not None:
        _thd_rows(name_q, dq)
    device = dk.device
    for name, t in ((name_v, dv), (name_q, dq)):
        if t is not None and t.device != device:
            raise InputError(f"{name}: expected it on {name_k}'s device {device}, got {t.device}")
    offsets(
        cu_seqlens_q,
        cu_seqlens_kv,
        cu_seqlens_q_padded,
        cu_seqlens_kv_padded,
        device=device,
        device_of=name_k,
    )
    heads_k = int(shape_of(dk)[1])  # type: ignore[index]
    heads_v = int(shape_of(dv)[1])  # type: ignore[index]
    if heads_v != heads_k:
        raise InputError(
            f"{name_v}: expected the same number of heads as {name_k} ({heads_k}), got {heads_v}"
        )
    if num_heads_kv is None:
        num_heads_kv = heads_k
    if num_heads_q is None and dq is not None:
        num_heads_q = int(shape_of(dq)[1])  # type: ignore[index]
    if num_heads_kv <= 0:
        raise InputError(f"{name_k}: expected at least one KV head, got {num_heads_kv}")
    if num_heads_q is not None and (num_heads_q <= 0 or num_heads_q % num_heads_kv != 0):
        raise InputError(
            f"{name_k}: expected a number of KV heads that divides the query heads "
            f"({num_heads_q}), got {num_heads_kv}"
        )


def _plain_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass whose data is its own strided tensor (no ``__torch_dispatch__``
    of its own, so its memory is what a plain tensor view of it sees)."""
    return (
        type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__  # type: ignore[attr-defined]
        and t.layout is torch.strided
        and not t.is_nested
    )


def writable_rows(t: object, name: str, strict: bool = False) -> Optional[torch.Tensor]:
    """The plain strided tensor holding ``t``'s rows, which the post-pass writes.

    Plain tensors and ``nn.Parameter`` are their own rows; a tensor subclass without its own
    ``__torch_dispatch__`` is written through a plain view of its memory; a TE FP8 storage
    through its raw bytes (byte 0 is +0 in E4M3 and E5M2) unless a cached transpose would
    go stale. Everything else (other wrapper subclasses, sparse or nested layouts) is not.

    Args:
        t: the gradient; name: how messages name it.
        strict: the public API: raise where there is no such tensor (else None is returned
            and the wrapper's pass-through is logged once).
    """
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        if t.layout is torch.strided and not t.is_nested:  # type: ignore[union-attr]
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
        raise InputError(
            f"{name}: expected a torch.Tensor whose rows can be zeroed in place (a plain or "
            "nn.Parameter tensor, a subclass without its own __torch_dispatch__, or a TE FP8 "
            f"tensor without a live cached transpose), got a {kind} (layout "
            f"{getattr(t, 'layout', None)}) whose raw rows cannot be zeroed safely"
        )
    log_once(
        ("unwritable-gradient", kind),
        logging.WARNING,
        "%s is a %s whose raw rows cannot be zeroed safely; passed through unchanged (rows "
        "of sequences without queries may hold stale values)",
        name,
        kind,
    )
    return None


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


#: Steps a lattice check may take before it assumes the memory is shared.
LATTICE_STEPS = 4096


def rows_disjoint(name: str, t: torch.Tensor) -> None:
    """Raise :class:`InputError` when two token rows of ``t`` share memory (zeroing one
    would zero the other). Metadata only.

    Zero-stride inner dims are ignored: a tensor expanded along heads or head_dim repeats
    each row's own memory, and rows are zeroed whole, so zeroing a row zeroes it for every
    head at once, which is exact. Otherwise two rows ``i != j`` share an element exactly
    when ``(i - j) * stride_0 + sum(k_d * stride_d) == 0`` for some ``|k_d| < size_d``: a
    small integer check (assumed shared past :data:`LATTICE_STEPS` steps).
    """
    if t.shape[0] <= 1 or t.is_contiguous():
        return
    row_stride = abs(t.stride(0))
    inner = [(abs(st), 1 - n, n - 1) for n, st in zip(t.shape[1:], t.stride()[1:]) if n > 1 and st]
    dims = sorted([(row_stride, 1, t.shape[0] - 1), *inner], reverse=True)
    shared = row_stride == 0 or _lattice_meets(0, dims, [LATTICE_STEPS])
    if shared:
        raise InputError(
            f"{name}: expected token rows that do not share memory, got shape "
            f"{tuple(t.shape)} with strides {tuple(t.stride())} (rows overlap, e.g. an "
            "expand along the token axis); zeroing one row would zero another. Pass a "
            "tensor with its own storage per row (e.g. .contiguous())"
        )


def in_place(name: str, t: object, data: torch.Tensor) -> None:
    """Raise :class:`InputError` naming ``name`` where torch would refuse to write ``t`` in
    place.

    ``data`` is the tensor the post-pass writes (``t`` itself, or the raw bytes of a TE FP8
    storage). With grad mode on, a gradient that requires grad is refused: torch forbids
    in-place writes to a leaf that requires grad (an ``nn.Parameter``) and to views of one,
    and on any other such tensor the zeroing would enter the autograd graph. Under
    ``torch.no_grad()`` torch allows the write, and so does this check. An inference tensor
    can be written only inside ``torch.inference_mode()``.
    """
    if torch.is_grad_enabled() and getattr(t, "requires_grad", False):
        raise InputError(
            f"{name}: expected a gradient that does not require grad, got one that requires "
            "grad (torch forbids zeroing it in place while grad mode is on); pass .detach() "
            "or call under torch.no_grad()"
        )
    if data.is_inference() and not torch.is_inference_mode_enabled():
        raise InputError(
            f"{name}: expected a normal tensor, got an inference tensor outside inference "
            "mode (torch forbids writing it in place there); call under "
            "torch.inference_mode() or pass a clone made outside it"
        )


def _byte_range(t: torch.Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


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
    return _lattice_meets(delta // size, dims, [LATTICE_STEPS])


def disjoint(tensors: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> None:
    """Raise :class:`InputError` naming two of ``tensors`` (``(name, tensor)``, None
    skipped) when zeroing rows of one could write memory of the other. Metadata only.

    The rule: tensors whose byte ranges do not overlap are disjoint; so are tensors with the
    same element size and, on every dim where both have size > 1 and a non-zero stride,
    the same stride, when no element offset of one equals one of the other (a small
    integer check on the offset difference, exact for TE's packings: ``buf[:, 0]`` /
    ``buf[:, 1]`` of ``[t, 2, h, d]``, ``buf[:, :, 0]`` / ``buf[:, :, 1]`` of ``[t, h, 2,
    d]``, head slices of one ``[t, h, d]`` buffer). Anything else whose ranges overlap is
    refused, though it may not alias: pass separate buffers then. The tensors share one
    device (:func:`gradients` checked that).
    """
    present = [(name, t) for name, t in tensors if t is not None]
    for i, (name_a, a) in enumerate(present):
        for name_b, b in present[i + 1 :]:
            if _may_share(a, b):
                raise InputError(
                    f"{name_b}: expected memory separate from {name_a}'s, got views that "
                    f"overlap (shapes {tuple(a.shape)} and {tuple(b.shape)}, strides "
                    f"{tuple(a.stride())} and {tuple(b.stride())}): zeroing rows of one "
                    "would zero rows of the other. Pass separate buffers or disjoint views "
                    "of one packed buffer"
                )


# ------------------------------------------------------------------------ other args
def mask_arguments(
    attn_mask_type: object, window_size: object, bottom_right_diagonal: object
) -> None:
    """Raise :class:`InputError` naming the argument when TE's mask arguments are malformed
    (the public API refuses what the wrapper would keep every valid key for)."""
    if not isinstance(attn_mask_type, str) or (
        attn_mask_type not in MASKS and attn_mask_type not in CONSERVATIVE_MASK_TYPES
    ):
        names = ", ".join((*MASKS, *CONSERVATIVE_MASK_TYPES))
        raise InputError(
            f"attn_mask_type: expected one of {names} (TE's names; 'arbitrary' keeps every "
            f"valid key of a sequence with queries), got {attn_mask_type!r}"
        )
    if window_pair(window_size) is None:  # type: ignore[arg-type]
        raise InputError(
            "window_size: expected None or (left, right), two integers from -1 to "
            f"2**31 - 1 (-1 = unbounded), got {window_size!r}"
        )
    if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
        raise InputError(
            "bottom_right_diagonal: expected True, False or None (by mask name), got "
            f"{bottom_right_diagonal!r}"
        )


def impl(value: object) -> str:
    """``zero_dead_rows``'s ``impl``: ``auto``, ``torch`` or ``triton``."""
    if value not in ("auto", "torch", "triton"):
        raise InputError(f"impl: expected 'auto', 'torch' or 'triton', got {value!r}")
    return value  # type: ignore[return-value]


_DEVICE_EXPECTED = (
    "device: expected None (every device), a torch.device or a device string such as "
    "'cuda', 'cuda:1' or 'cpu'"
)


def device(value: object) -> torch.device:
    """``check_offset_errors``'s ``device`` (not None) as a torch.device."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):  # an int means "current accelerator" to torch: refused
        try:
            return torch.device(value)
        except (RuntimeError, ValueError):
            pass
    raise InputError(f"{_DEVICE_EXPECTED}, got {value!r}")


# --------------------------------------------------------------------- offset values
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
    tokens, count = int(cu[b + 1] - cu[b]), int(buf[b + 1] - buf[b])
    return f"{names[0]}: sequence {b} has {tokens} tokens but {names[1]} gives it only {count} rows"


def _past_message(name: str, buf: torch.Tensor, count: int, side: str, _: int) -> str:
    return f"{name}: last offset {int(buf[-1])} is past the {count} {side} rows of the buffer"


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
    rule), and a fault of the buffer offsets names that argument.

    Args:
        cu_q, cu_kv, pad_q, pad_kv: int64 offsets of one length >= 1 (``pad_*`` None: not
            given).
        rows_q: the q buffer's rows, or None (its end is not checked); rows_kv: kv's rows.

    Returns:
        The faults, in the order :func:`offset_values` reports them.
    """
    faults = []
    for side, cu, pad, count in (("q", cu_q, pad_q, rows_q), ("kv", cu_kv, pad_kv, rows_kv)):
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
        if count is not None:
            past = buf[-1:] > count
            message = functools.partial(_past_message, buf_name, buf, count, side)
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


def offset_values(
    rows_q: Optional[int],
    rows_kv: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: Optional[torch.Tensor],
    cu_seqlens_kv_padded: Optional[torch.Tensor],
) -> None:
    """:func:`offset_faults`, read on the host (a sync): the first fault raises
    :class:`~te_gqa_fix.errors.OffsetsError`, the error the sync-free check raises later."""
    given = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    cpu = [None if t is None else t.detach().to("cpu", torch.int64) for t in given]
    for fault in offset_faults(*cpu, rows_q, rows_kv):  # type: ignore[arg-type]
        where = fault.bad.nonzero()
        if where.numel():
            raise OffsetsError(fault.message(int(where[0, 0])))


def error_names(bits: int) -> str:
    """The offset arguments whose :data:`ARGUMENT_BITS` are set in ``bits``."""
    return ", ".join(name for name, bit in ARGUMENT_BITS.items() if bits & bit)
