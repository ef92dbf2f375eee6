"""A per-device record of calls whose THD offsets were impossible, read without a sync.

Why: the post-pass must never turn bad offsets into a silently wrong gradient, but on
CUDA the offsets live on the device and reading them costs a host sync, which TE's
CUDA-graph capture forbids. So the device computation itself judges the offsets
(negative, decreasing, a padded segment shorter than its valid length, a last padded
offset past the buffer's rows), zeroes **nothing** for a call that fails, and writes
one bit per offending argument into a small page-locked (pinned) host word. The host
reads that word with a plain memory load (no CUDA call) at the start of the next
post-pass call on the same device, when the bad call's kernel has long finished, and
raises :class:`OffsetsError` naming the argument.

When an error surfaces, exactly:

* CPU tensors: immediately, in the call itself (the offsets are host memory).
* ``TE_GQA_FIX_VALIDATE=1``: immediately, in the call itself (this reads the offsets: a
  host sync, for debugging).
* otherwise (CUDA): at the start of the first te-gqa-fix post-pass call on that device
  (``zero_dead_rows`` or the ``fused_attn_bwd`` wrapper) that begins after the bad call's
  device work has completed, normally the next call; or at
  :func:`check_offset_errors`, which reads the same word (call it after
  ``torch.cuda.synchronize()`` to be sure the last call is included, or pass
  ``synchronize=True``). Under a CUDA graph the recorded word is the same memory, so a
  replay with bad offsets surfaces the same way.

The bad call itself leaves its gradient rows exactly as TE produced them (nothing is
zeroed, so no live row is ever destroyed by a wrong offset); the exception stops the
step that would use them.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = [
    "ARGUMENT_BITS",
    "OffsetsError",
    "check_offset_errors",
    "describe",
    "kernel_flag",
    "kernel_meta",
    "pending_words",
    "raise_pending",
    "record_device_bits",
]

#: One bit per offset argument, in TE's names.
ARGUMENT_BITS: Dict[str, int] = {
    "cu_seqlens_q": 1,
    "cu_seqlens_kv": 2,
    "cu_seqlens_q_padded": 4,
    "cu_seqlens_kv_padded": 8,
}


class OffsetsError(ValueError):
    """Offsets passed to an earlier post-pass call on a device could not be right."""


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
        self.acc: Optional[torch.Tensor] = None  # PyTorch path: device accumulator

    def take(self) -> int:
        bits = self.words[0] | self.words[1]
        if bits:
            self.words[0] = 0
            self.words[1] = 0
            if self.acc is not None:
                self.acc.zero_()  # async, on the current stream
        return bits


_records: Dict[torch.device, _Record] = {}
_lock = threading.Lock()


def _record(device: torch.device) -> _Record:
    rec = _records.get(device)
    if rec is None:
        with _lock:
            rec = _records.get(device)
            if rec is None:
                rec = _Record(device)
                _records[device] = rec
    return rec


def kernel_flag(device: torch.device) -> torch.Tensor:
    """The word the Triton kernel ORs its error bits into (slot 0 of ``device``'s record).

    Allocated on first use (do the first call outside CUDA-graph capture, as warm-up
    for any Triton kernel requires anyway); the same memory afterwards.
    """
    return _record(device).host


def pending_words(device: torch.device) -> Any:
    """The two host words of ``device``'s record (a ctypes array): non-zero means an
    earlier call recorded bad offsets. Callers that hold it (a launch plan) test it with
    one read per call and then let :func:`raise_pending` raise and clear."""
    return _record(device).words


_META: Dict[Tuple[int, bool, bool, bool], Dict[str, Any]] = {}
#: Offsets scanned per chunk by each kernel program.
_OFF_BLOCK_MAX = 256


def kernel_meta(nseq: int, has_q: bool, pad_q: bool, pad_kv: bool) -> Dict[str, Any]:
    """The kernel's compile-time arguments for the offset check (cached, ~0.1 us).

    ``PAD_Q_BIT``/``PAD_KV_BIT`` name the argument that holds the buffer offsets: the
    padded one when given, else the valid one (TE's rule).
    """
    key = (nseq, has_q, pad_q, pad_kv)
    meta = _META.get(key)
    if meta is None:
        n = nseq + 1
        block = 1 if n <= 1 else 1 << (n - 1).bit_length()
        block = min(block, _OFF_BLOCK_MAX)
        meta = dict(
            HAS_Q=has_q,
            PAD_Q_BIT=ARGUMENT_BITS["cu_seqlens_q_padded" if pad_q else "cu_seqlens_q"],
            PAD_KV_BIT=ARGUMENT_BITS["cu_seqlens_kv_padded" if pad_kv else "cu_seqlens_kv"],
            OFF_BLOCK=block,
            OFF_CHUNKS=-(-n // block),
        )
        if len(_META) > 1024:
            _META.clear()
        _META[key] = meta
    return meta


def record_device_bits(device: torch.device, bits: torch.Tensor) -> None:
    """PyTorch path on CUDA: OR ``bits`` (an int32 device scalar) into the record.

    Device ops only: an OR into a device accumulator and a ``non_blocking`` copy of it
    into the pinned word (skipped while the stream is being captured into a CUDA graph;
    the accumulator still holds the bits, read by ``check_offset_errors(synchronize=True)``
    or copied out by the next uncaptured call).
    """
    rec = _record(device)
    if rec.acc is None:
        rec.acc = torch.zeros(1, dtype=torch.int32, device=device)
    rec.acc.bitwise_or_(bits.reshape(1).to(torch.int32))
    if not torch.cuda.is_current_stream_capturing():
        rec.host[1:2].copy_(rec.acc, non_blocking=True)


def describe(bits: int) -> str:
    """The argument names behind error ``bits``."""
    return ", ".join(name for name, bit in ARGUMENT_BITS.items() if bits & bit)


_WHAT = (
    "expected offsets >= 0 and non-decreasing, each padded segment at least as long as "
    "its valid length, and the last buffer offset within the buffer's rows"
)


def _error(bits: int, device: torch.device, when: str) -> OffsetsError:
    return OffsetsError(
        f"{describe(bits)}: impossible offsets in {when} te-gqa-fix post-pass call on "
        f"{device} ({_WHAT}); that call zeroed nothing, so its gradients are TE's output "
        "unrepaired. Set TE_GQA_FIX_VALIDATE=1 to raise in the offending call itself."
    )


def raise_pending(device: torch.device, when: str = "an earlier") -> None:
    """Raise :class:`OffsetsError` if a call on ``device`` recorded bad offsets.

    Hot path: a dict lookup and a plain host memory read; no CUDA call, no sync.
    Clears the record it reports. ``when`` says which call it was, for the message.
    """
    rec = _records.get(device)
    if rec is None:
        return
    if rec.words[0] | rec.words[1]:
        raise _error(rec.take(), device, when)


def check_offset_errors(
    device: Optional[torch.device] = None, *, synchronize: bool = False
) -> None:
    """Raise :class:`OffsetsError` if any post-pass call recorded impossible offsets.

    ``device`` None checks every device used so far. Without ``synchronize`` this reads
    host memory only (no sync) and sees every call whose device work has completed;
    with ``synchronize=True`` it first waits for the device(s) (a host sync: call it at
    the end of a step, not inside graph capture) so the most recent call is included.
    """
    if device is None:
        devices = list(_records)
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        devices = [dev]
    for dev in devices:
        rec = _records.get(dev)
        if rec is None:
            continue
        if synchronize and dev.type == "cuda":
            torch.cuda.synchronize(dev)
            if rec.acc is not None:
                rec.words[1] |= int(rec.acc.item())
        if rec.words[0] | rec.words[1]:
            raise _error(rec.take(), dev, "a")


def _reset() -> None:
    """Forget every record (tests only)."""
    with _lock:
        for rec in _records.values():
            rec.words[0] = 0
            rec.words[1] = 0
            if rec.acc is not None:
                rec.acc.zero_()
