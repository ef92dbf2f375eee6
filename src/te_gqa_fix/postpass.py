"""The post-pass: zero, in place, every dQ/dK/dV row whose true gradient is exactly 0.

On the affected cuDNN builds the damage is on rows whose true gradient is 0, so zeros there
are exact. On CUDA with Triton one kernel launch does it (:mod:`._kernel`), prepared once
per call shape (:func:`prepare`); elsewhere PyTorch device ops do, shape-driven only (no
``.item()``, no branch on a tensor value). Neither syncs the host, so both are CUDA-graph
safe.

Impossible offsets make a call zero nothing. The call cannot raise without reading the
offsets (a sync), so it records the offending arguments in a per-device pinned host word,
and the next post-pass call on that device, or :func:`check_offset_errors`, raises
:class:`~te_gqa_fix.errors.OffsetsError`; on CPU, and with ``TE_GQA_FIX_VALIDATE=on``, the
call itself raises.

This module is what a repeat call of the wrapper enters after TE: :func:`zero` with the
launch it prepared.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Literal, Optional, Sequence, Tuple

import torch

from . import _kernel, checks, settings
from ._logging import log_once
from ._te import OFFSET_NAMES
from .checks import ARGUMENT_BITS, shape_of
from .errors import InputError, OffsetsError
from .masks import KeySpan, key_bounds, key_span

__all__ = [
    "DeadRows",
    "KernelLaunch",
    "check_offset_errors",
    "dead_row_masks",
    "implementation",
    "prepare",
    "zero",
    "zero_dead_rows",
]

Impl = Literal["auto", "torch", "triton"]


# ---------------------------------------------------------------------- error record
class _Record:
    """The host words of one device: slot 0 the Triton kernel's, slot 1 the PyTorch path's."""

    __slots__ = ("acc", "host", "words")

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            with torch.cuda.device(device):
                # Page-locked and, with unified addressing, mapped: the kernel stores to
                # it directly and the host reads it without a CUDA call.
                self.host = torch.zeros(2, dtype=torch.int32, pin_memory=True)
        else:
            self.host = torch.zeros(2, dtype=torch.int32)
        self.words = (ctypes.c_int32 * 2).from_address(self.host.data_ptr())
        self.acc: Optional[torch.Tensor] = None  # PyTorch path on CUDA: device accumulator

    def clear(self) -> None:
        self.words[0] = 0
        self.words[1] = 0
        if self.acc is not None:
            self.acc.zero_()  # async, on the current stream


_records: Dict[torch.device, _Record] = {}
_records_lock = threading.Lock()


def _record(device: torch.device) -> _Record:
    """The device's record; first use outside CUDA-graph capture allocates it."""
    if device not in _records:
        with _records_lock:
            if device not in _records:
                _records[device] = _Record(device)
    return _records[device]


def _raise_pending(device: torch.device, when: str = "an earlier") -> None:
    """Raise and clear :class:`OffsetsError` if a call on ``device`` recorded bad offsets.

    Hot path: a dict lookup and a host memory read, no CUDA call. ``when`` names the call.
    """
    rec = _records.get(device)
    bits = 0 if rec is None else rec.words[0] | rec.words[1]
    if not bits:
        return
    rec.clear()  # type: ignore[union-attr]
    raise OffsetsError(
        f"{checks.error_names(bits)}: impossible offsets in {when} te-gqa-fix post-pass call "
        f"on {device} (expected offsets >= 0 and non-decreasing, each padded segment at least "
        "as long as its valid length, and the last buffer offset within the buffer's rows); "
        "that call zeroed nothing, so its gradients are TE's output unrepaired. Set "
        "TE_GQA_FIX_VALIDATE=1 to raise in the offending call itself."
    )


def _record_errors(errors: torch.Tensor, device: torch.device) -> None:
    """Store a call's error bits (an int32 device scalar): on CPU raise now; on CUDA a
    device OR and a non-blocking copy into the pinned word (during CUDA-graph capture only
    the device accumulator gets them), no sync."""
    rec = _record(device)
    if device.type != "cuda":
        rec.host[1:2].bitwise_or_(errors.reshape(1).to(torch.int32))
        _raise_pending(device, when="this")
        return
    if rec.acc is None:
        rec.acc = torch.zeros(1, dtype=torch.int32, device=device)
    rec.acc.bitwise_or_(errors.reshape(1).to(torch.int32))
    if not torch.cuda.is_current_stream_capturing():
        rec.host[1:2].copy_(rec.acc, non_blocking=True)


def check_offset_errors(device: object = None, *, synchronize: bool = False) -> None:
    """Raise :class:`~te_gqa_fix.errors.OffsetsError` if any post-pass call recorded
    impossible offsets.

    Args:
        device: the device to check (a torch.device or a string such as ``"cuda:1"``;
            ``"cuda"`` is the current CUDA device); None checks every device used so far.
            A device no post-pass call has used has recorded nothing: the call returns.
        synchronize: first wait for the device(s) (a host sync; not inside graph capture)
            so the most recent call is included. Without it, only host memory is read.

    Raises:
        OffsetsError: a recorded error, naming the offending arguments (then cleared).
        InputError: ``device`` is not None, a torch.device or a device string.
    """
    if device is None:
        devices = list(_records)
    else:
        dev = checks.device(device)
        if dev.type == "cuda" and dev.index is None:
            if not any(d.type == "cuda" for d in _records):
                return  # no CUDA call recorded anything (also: a CPU-only torch)
            dev = torch.device("cuda", torch.cuda.current_device())
        devices = [dev]
    for dev in devices:
        rec = _records.get(dev)
        if synchronize and rec is not None and dev.type == "cuda":
            torch.cuda.synchronize(dev)
            if rec.acc is not None:
                rec.words[1] |= int(rec.acc.item())
        _raise_pending(dev, "a")


# ------------------------------------------------------------------- the PyTorch path
@dataclass(frozen=True)
class DeadRows:
    """Boolean masks, True where a row's true gradient is 0; ``errors``: the int32 device
    scalar of offset error bits (non-zero: both masks all False, nothing is zeroed)."""

    q: Optional[torch.Tensor]
    kv: torch.Tensor
    errors: Optional[torch.Tensor] = None


def _row_sequences(count: int, padded: torch.Tensor):
    """Per buffer row: inside a sequence (``padded[b] <= t < padded[b + 1]``), its ``b``,
    and its position in the sequence."""
    nseq = padded.numel() - 1
    t = torch.arange(count, device=padded.device, dtype=torch.int64)
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
    """:func:`dead_row_masks` for checked arguments and a resolved span (nothing recorded)."""
    cu_q, cu_kv = cu_seqlens_q.to(torch.int64), cu_seqlens_kv.to(torch.int64)
    given_q, given_kv = (
        None if t is None else t.to(torch.int64)
        for t in (cu_seqlens_q_padded, cu_seqlens_kv_padded)
    )
    faults = checks.offset_faults(cu_q, cu_kv, given_q, given_kv, rows_q, rows_kv)
    errors = checks.offset_error_bits(faults)
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


#: Bytes the PyTorch path allocates per buffer row while it builds the masks (int64 row
#: index, sequence, position, and boolean masks), as a message estimates them.
_BYTES_PER_ROW = 34


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
    Sync-free; the masks live on the offsets' device.

    Args:
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded: TE's int32
            offsets.
        rows_q: rows of the dQ buffer (None: no dQ mask); rows_kv: rows of dK/dV; ints from
            0 to 2**31 - 1 whose masks the device can allocate.
        attn_mask_type, window_size, bottom_right_diagonal: TE's mask arguments
            (``'arbitrary'``: keep every valid key of a sequence with queries).

    Returns:
        A :class:`DeadRows`.

    Raises:
        InputError: malformed arguments, naming the argument (the checks and messages of
            :func:`zero_dead_rows`), or row counts whose masks the device cannot allocate.
            Impossible offsets give masks with nothing dead and raise ``OffsetsError`` (an
            InputError): on CPU at once, on CUDA at the next post-pass call.
    """
    checks.mask_arguments(attn_mask_type, window_size, bottom_right_diagonal)
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal)
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    checks.offsets(*offsets, rows_q=rows_q)
    checks.rows("rows_kv", rows_kv)
    try:
        dead = _dead_rows(*offsets, rows_q, rows_kv, span)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "alloc" not in str(exc):
            raise
        name, count = max((("rows_q", rows_q or 0), ("rows_kv", rows_kv)), key=lambda x: x[1])
        raise InputError(
            f"{name}: the masks for {count} rows need about {count * _BYTES_PER_ROW >> 20} MiB "
            f"on {cu_seqlens_kv.device}, which could not be allocated ({type(exc).__name__})"
        ) from exc
    _record_errors(dead.errors, cu_seqlens_kv.device)  # type: ignore[arg-type]
    return dead


def _zero_rows(t: object, dead: torch.Tensor, name: str) -> None:
    """``t[dead] = 0`` in place along dim 0 via ``masked_fill_`` (works through views; a
    zero-stride inner dim is written once, as its one element repeats)."""
    target = checks.writable_rows(t, name)
    if target is None:
        return
    for dim in range(1, target.dim()):
        if target.stride(dim) == 0 and target.shape[dim] > 1:
            target = target.narrow(dim, 0, 1)
    target.masked_fill_(dead.view(-1, *([1] * (target.dim() - 1))), 0)


def _zero_with_torch(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple, span: KeySpan
) -> None:
    """The PyTorch post-pass on checked arguments."""
    rows_q = None if dq is None else int(shape_of(dq)[0])  # type: ignore[index]
    dead = _dead_rows(*offsets, rows_q, int(shape_of(dk)[0]), span)  # type: ignore[index]
    _zero_rows(dk, dead.kv, "dk")
    _zero_rows(dv, dead.kv, "dv")
    if dq is not None and dead.q is not None:
        _zero_rows(dq, dead.q, "dq")
    _record_errors(dead.errors, dk.device)  # type: ignore[arg-type]


# ------------------------------------------------------------------ the Triton kernel
#: Rows per unit, and elements per row in one store tile (powers of two).
BLOCK_T = 32
BLOCK_C = 128
#: Column tiles are split into shares until there are this many units per SM, and so that a
#: unit stores at most MAX_TILES tiles per tensor: small units balance the stores.
PROGRAMS_PER_SM = 8
MAX_TILES = 4
#: Programs per SM in the looping grid.
RESIDENT_PER_SM = 4
NUM_WARPS = 4
#: Up to this many offsets (batch + 1) a unit compares its rows with every sequence's kept
#: interval; beyond, each row binary-searches its sequence.
COMPARE_MAX_OFFSETS = 32
#: Offsets read per chunk by each program.
OFF_BLOCK_MAX = 256

_GRADIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OFFSET_DTYPES = (torch.int32, torch.int64)
_PLAIN = (torch.Tensor, torch.nn.Parameter)

#: Why CUDA calls get the PyTorch post-pass instead of the kernel (None: they get the kernel).
_no_kernel: Optional[str] = None


@functools.cache
def _kernel_available() -> bool:
    """True when Triton imports and CUDA is present (decided once; imports Triton)."""
    global _no_kernel
    if not torch.cuda.is_available():
        return False
    try:
        _kernel.build()
        return True
    except Exception as exc:  # ImportError, or a broken install raising anything else
        _no_kernel = f"Triton is unavailable ({type(exc).__name__}: {exc})"
        return False


def implementation() -> Tuple[str, Optional[str]]:
    """Which post-pass CUDA calls get: ``("triton", None)``, or ``("pytorch", why)``;
    ``("pytorch", "no CUDA device")`` without CUDA. Imports Triton where it is installed."""
    if not _kernel_available():
        return "pytorch", _no_kernel or "no CUDA device"
    return ("pytorch", _no_kernel) if _no_kernel else ("triton", None)


def _torch_instead(why: str) -> None:
    """Log once per process that CUDA calls get the PyTorch post-pass, and why."""
    log_once(
        ("pytorch-postpass", why),
        logging.WARNING,
        "the post-pass runs in PyTorch instead of its Triton kernel on CUDA: %s. It is exact "
        "but much slower (a dozen device ops per call instead of one launch)",
        why,
    )


def _unfit(dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple):
    """Why these CUDA tensors are not what the kernel takes (None: they are)."""
    device = dk.device
    for name, t in (("dk", dk), ("dv", dv)) if dq is None else (("dq", dq), ("dk", dk), ("dv", dv)):
        if type(t) not in _PLAIN:
            return f"{name} is a {type(t).__name__}, not a plain torch.Tensor"
        if t.dim() != 3 or t.dtype not in _GRADIENT_DTYPES or t.device != device:
            return f"{name} is a {t.dim()}-D {t.dtype} tensor on {t.device}"
        if any(n > 1 and st == 0 for n, st in zip(t.shape, t.stride())):
            return f"{name} is expanded (a zero stride)"
    for name, o in zip(OFFSET_NAMES, offsets):
        if o is not None and (o.dtype not in _OFFSET_DTYPES or o.device != device):
            return f"{name} is {o.dtype} on {o.device}"
    return None


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # the Triton interpreter's tests
        return 1
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_properties(index).multi_processor_count


_data_ptr = torch.Tensor.data_ptr
_SIXTEEN = 16


class KernelLaunch:
    """Everything a launch of the kernel needs that depends only on metadata (grid, scalars,
    compile-time constants), prepared once per call shape by :func:`prepare`. ``launchers``
    maps the pointers' offsets from 16-byte alignment (Triton specializes a pointer on its
    alignment) to a bound launcher of the compiled kernel."""

    __slots__ = ("device", "err", "grid", "launchers", "meta", "scalars")

    def __init__(
        self, grid: Tuple[int, int, int], scalars: tuple, meta: Dict[str, Any], device
    ) -> None:
        self.grid = grid
        self.scalars = scalars
        self.meta = meta
        self.device = device
        self.launchers: Dict[tuple, Callable[..., None]] = {}
        self.err = _record(device).host  # the kernel ORs error bits into slot 0

    def run(
        self, dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple
    ) -> None:
        """Zero the dead rows, on the current stream; no host sync.

        The first launch per pointer alignment goes through ``kernel[grid]`` (which
        compiles); later ones through the bound launcher, given the addresses: every
        tensor is on the launch's device (the wrapper's keys hold the devices).
        """
        cu_q, cu_kv, pad_q, pad_kv = offsets
        cu_q = cu_q if cu_q.is_contiguous() else cu_q.contiguous()
        cu_kv = cu_kv if cu_kv.is_contiguous() else cu_kv.contiguous()
        pad_q = cu_q if pad_q is None else pad_q if pad_q.is_contiguous() else pad_q.contiguous()
        pad_kv = (
            cu_kv if pad_kv is None else pad_kv if pad_kv.is_contiguous() else pad_kv.contiguous()
        )
        tensors = (dk if dq is None else dq, dk, dv, cu_q, cu_kv, pad_q, pad_kv)
        ptrs = list(map(_data_ptr, tensors))
        align = tuple(map(_SIXTEEN.__rmod__, ptrs))  # what Triton specializes a pointer on
        launcher = self.launchers.get(align)
        if launcher is not None:
            launcher(*ptrs)
            return
        compiled = _kernel.build()[self.grid](*tensors, self.err, *self.scalars, **self.meta)
        if compiled is not None and hasattr(compiled, "function"):  # None under the interpreter
            self.launchers[align] = self._bind(compiled)

    def _bind(self, compiled: Any) -> Callable[..., None]:
        """A launcher of ``compiled`` taking the seven tensor addresses, on the current
        stream, every other argument bound now: Triton's own launcher (``compiled.run``),
        without what ``kernel[grid](...)`` redoes at every launch (device and stream lookups,
        launch metadata); Triton's launch hooks are not called."""
        run = compiled.run
        between = (compiled.function, compiled.packed_metadata, None, None, None)
        grid_x, grid_y, grid_z = self.grid
        # The kernel's arguments: seven tensors, the error word, the scalars, then constants.
        names = _kernel.build().arg_names[8 + len(self.scalars) :]
        tail = (self.err.data_ptr(), *self.scalars, *(self.meta[n] for n in names))
        stream = torch._C._cuda_getCurrentRawStream
        index = self.device.index

        def launch_on_current_stream(*ptrs: int) -> None:
            run(grid_x, grid_y, grid_z, stream(index), *between, *ptrs, *tail)

        return launch_on_current_stream


def _launch_for(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple, span: KeySpan
) -> KernelLaunch:
    """The kernel's launch for these gradients, offsets (only their count and which are
    None matter) and span."""
    q_t = dk if dq is None else dq
    nseq = offsets[0].numel() - 1
    rows_kv, rows_q = int(dk.shape[0]), (0 if dq is None else int(dq.shape[0]))
    # At least one dK/dV unit: unit 0 judges the offsets and records their errors, also
    # when no buffer has a row to zero (its rows are then all past the buffer).
    nblk_kv, nblk_q = max(1, -(-rows_kv // BLOCK_T)), -(-rows_q // BLOCK_T)
    widths = [int(t.shape[1]) * _pow2(int(t.shape[2])) for t in (q_t, dk, dv)]
    block_c = max(1, min(BLOCK_C, _pow2(max(widths))))
    tiles = [-(-w // block_c) for w in widths]
    sms = _sm_count(dk.device)
    fill = -(-PROGRAMS_PER_SM * sms // max(1, nblk_kv + nblk_q))

    def shares(n_tiles: int) -> int:
        return max(1, min(n_tiles, fill), -(-n_tiles // MAX_TILES))

    split_kv = shares(max(tiles[1], tiles[2]))
    split_q = shares(tiles[0]) if dq is not None else 1
    units_kv = nblk_kv * split_kv
    units = units_kv + nblk_q * split_q
    n_prog = max(1, min(units, RESIDENT_PER_SM * sms))
    search = nseq + 1 > COMPARE_MAX_OFFSETS
    has_wl = span.exact and span.window_left >= 0
    has_wr = span.exact and span.window_right >= 0
    scalars = (
        nseq, rows_q, rows_kv, nblk_kv, nblk_q, units_kv, units, split_kv, split_q,
        -(-units // n_prog), int(q_t.shape[1]), int(q_t.shape[2]), *q_t.stride(),
        int(dk.shape[1]), int(dk.shape[2]), *dk.stride(),
        int(dv.shape[1]), int(dv.shape[2]), *dv.stride(),
        span.window_left if has_wl else 0, span.window_right if has_wr else 0,
    )  # fmt: skip
    bits = ARGUMENT_BITS
    off_block = min(_pow2(nseq + 1), OFF_BLOCK_MAX)
    meta: Dict[str, Any] = dict(
        EXACT=span.exact, TOP_LEFT=span.top_left, BOTTOM_RIGHT=span.bottom_right,
        HAS_WL=has_wl, HAS_WR=has_wr, SEARCH=search,
        SEARCH_STEPS=(nseq + 1).bit_length() if search else 0,
        BLOCK_T=BLOCK_T, BLOCK_C=block_c,
        BD_Q=_pow2(int(q_t.shape[2])), BD_K=_pow2(int(dk.shape[2])), BD_V=_pow2(int(dv.shape[2])),
        NT_Q=-(-tiles[0] // split_q) if dq is not None else 0,
        NT_K=-(-tiles[1] // split_kv), NT_V=-(-tiles[2] // split_kv),
        HAS_Q=dq is not None,
        CU_Q_BIT=bits["cu_seqlens_q"], CU_KV_BIT=bits["cu_seqlens_kv"],
        PAD_Q_BIT=bits["cu_seqlens_q_padded" if offsets[2] is not None else "cu_seqlens_q"],
        PAD_KV_BIT=bits["cu_seqlens_kv_padded" if offsets[3] is not None else "cu_seqlens_kv"],
        OFF_BLOCK=off_block, OFF_CHUNKS=-(-(nseq + 1) // off_block),
    )  # fmt: skip
    meta["ONCE"] = not search and meta["OFF_CHUNKS"] == 1
    if dk.device.type == "cuda":  # not under the Triton interpreter
        meta["num_warps"] = NUM_WARPS
    return KernelLaunch((n_prog, 1, 1), scalars, meta, dk.device)


def prepare(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple, span: KeySpan
) -> Optional[KernelLaunch]:
    """The one decision between the Triton kernel and PyTorch, for checked arguments.

    Args:
        dq, dk, dv: the gradients (dq None: dK/dV only); offsets: TE's four offsets.
        span: the mask's key interval rule.

    Returns:
        A :class:`KernelLaunch`, valid for every call with the same metadata, where the
        kernel handles these tensors (CUDA, Triton, plain fp16/bf16/fp32 tensors); else None
        for the PyTorch path (on CUDA, why is logged once at WARNING).
    """
    if dk.device.type != "cuda":
        return None
    why = _no_kernel if _kernel_available() else (_no_kernel or "no CUDA device")
    why = why or _unfit(dq, dk, dv, offsets)
    if why is not None:
        _torch_instead(why)
        return None
    return _launch_for(dq, dk, dv, offsets, span)


def zero(
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets: tuple,
    span: KeySpan,
    launch: Optional[KernelLaunch],
    validate: bool,
) -> None:
    """The post-pass on checked arguments: ``launch`` where given, else PyTorch.

    First raises what an earlier call on this device recorded (a host read, no sync).
    ``validate`` (``TE_GQA_FIX_VALIDATE=on``) reads the offsets now (a sync) and raises in
    this call.
    """
    global _no_kernel
    rec = _records.get(dk.device)
    if rec is not None and (rec.words[0] or rec.words[1]):
        _raise_pending(dk.device)
    if validate:
        rows_q = None if dq is None else int(shape_of(dq)[0])  # type: ignore[index]
        checks.offset_values(rows_q, int(shape_of(dk)[0]), *offsets)  # type: ignore[index]
    if launch is not None and _no_kernel is None:
        try:
            launch.run(dq, dk, dv, offsets)
            return
        except Exception as exc:  # compile or launch failure: never leave rows unzeroed
            _no_kernel = f"the Triton kernel failed ({type(exc).__name__}: {exc})"
            _torch_instead(_no_kernel)
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
        InputError: bad metadata or mask arguments, gradients that share memory, require
            grad (grad mode on) or are inference tensors (outside inference mode), naming
            the argument, before anything is written. Impossible offset values make the
            call zero nothing and raise ``OffsetsError`` (an InputError): at once on CPU or
            with validation on, else at the next post-pass call on that device.
    """
    checks.impl(impl)
    checks.mask_arguments(attn_mask_type, window_size, bottom_right_diagonal)
    span = key_span(attn_mask_type, window_size, bottom_right_diagonal)
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    checks.gradients(dq, dk, dv, *offsets)
    named = []
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        data = None if t is None else checks.writable_rows(t, name, strict=True)
        if data is not None:
            checks.in_place(name, t, data)
            checks.rows_disjoint(name, data)
        named.append((name, data))
    checks.disjoint(named)
    launch = None if impl == "torch" else prepare(dq, dk, dv, offsets, span)
    zero(dq, dk, dv, offsets, span, launch, settings.get("TE_GQA_FIX_VALIDATE") == "on")
