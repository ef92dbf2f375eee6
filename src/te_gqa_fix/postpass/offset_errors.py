"""A per-device record of calls whose THD offsets were impossible, read without a sync.

A bad call zeroes nothing and ORs one bit per offending argument into a pinned host word;
the next post-pass call on that device reads it with a plain load and raises
:class:`OffsetsError`. On CPU, and with ``TE_GQA_FIX_VALIDATE=on``, the offending call raises.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, Optional

import torch

from ..validation import ARGUMENT_BITS, OffsetsError

__all__ = [
    "ARGUMENT_BITS",
    "OffsetsError",
    "check_offset_errors",
    "kernel_flag",
    "raise_pending",
    "record_device_bits",
]


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

    def clear(self) -> None:
        self.words[0] = 0
        self.words[1] = 0
        if self.acc is not None:
            self.acc.zero_()  # async, on the current stream


_records: Dict[torch.device, _Record] = {}
_lock = threading.Lock()


def _record(device: torch.device) -> _Record:
    if device not in _records:
        with _lock:
            if device not in _records:
                _records[device] = _Record(device)
    return _records[device]


def kernel_flag(device: torch.device) -> torch.Tensor:
    """The host words the Triton kernel ORs error bits into (slot 0); first use outside
    CUDA-graph capture allocates them, later uses get the same memory."""
    return _record(device).host


def record_device_bits(device: torch.device, bits: torch.Tensor) -> None:
    """PyTorch path on CUDA: OR ``bits`` (an int32 device scalar) into the record, no sync;
    during CUDA-graph capture only the device accumulator gets them."""
    rec = _record(device)
    if rec.acc is None:
        rec.acc = torch.zeros(1, dtype=torch.int32, device=device)
    rec.acc.bitwise_or_(bits.reshape(1).to(torch.int32))
    if not torch.cuda.is_current_stream_capturing():
        rec.host[1:2].copy_(rec.acc, non_blocking=True)


def raise_pending(device: torch.device, when: str = "an earlier") -> None:
    """Raise and clear :class:`OffsetsError` if a call on ``device`` recorded bad offsets.

    Hot path: a dict lookup and a host memory read, no CUDA call. ``when`` names the call.
    """
    rec = _records.get(device)
    bits = 0 if rec is None else rec.words[0] | rec.words[1]
    if not bits:
        return
    rec.clear()  # type: ignore[union-attr]
    names = ", ".join(name for name, bit in ARGUMENT_BITS.items() if bits & bit)
    raise OffsetsError(
        f"{names}: impossible offsets in {when} te-gqa-fix post-pass call on {device} "
        "(expected offsets >= 0 and non-decreasing, each padded segment at least as long "
        "as its valid length, and the last buffer offset within the buffer's rows); that "
        "call zeroed nothing, so its gradients are TE's output unrepaired. Set "
        "TE_GQA_FIX_VALIDATE=1 to raise in the offending call itself."
    )


_DEVICE_EXPECTED = (
    "device: expected None (every device), a torch.device or a device string such as "
    "'cuda', 'cuda:1' or 'cpu'"
)


def _device_arg(device: object) -> Optional[torch.device]:
    """``device`` as a torch.device with an index where CUDA needs one; None where nothing
    can have been recorded (plain 'cuda' before any CUDA post-pass call)."""
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError):
            raise ValueError(f"{_DEVICE_EXPECTED}, got {device!r}") from None
    elif isinstance(device, torch.device):
        dev = device
    else:  # an int means "current accelerator" to torch: say which device instead
        raise ValueError(f"{_DEVICE_EXPECTED}, got {device!r}")
    if dev.type == "cuda" and dev.index is None:
        if not any(d.type == "cuda" for d in _records):
            return None  # no CUDA call recorded anything (also: a CPU-only torch)
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_offset_errors(device: object = None, *, synchronize: bool = False) -> None:
    """Raise :class:`OffsetsError` if any post-pass call recorded impossible offsets.

    Args:
        device: the device to check (a torch.device or a string such as ``"cuda:1"``;
            ``"cuda"`` is the current CUDA device); None checks every device used so far.
            A device no post-pass call has used (any CUDA device on a CPU-only torch)
            has recorded nothing: the call returns.
        synchronize: first wait for the device(s) (a host sync; not inside graph capture)
            so the most recent call is included. Without it, only host memory is read.

    Raises:
        OffsetsError: a recorded error, naming the offending arguments (then cleared).
        ValueError: ``device`` is not None, a torch.device or a device string.
    """
    if device is None:
        devices = list(_records)
    else:
        dev = _device_arg(device)
        devices = [] if dev is None else [dev]
    for dev in devices:
        rec = _records.get(dev)
        if synchronize and rec is not None and dev.type == "cuda":
            torch.cuda.synchronize(dev)
            if rec.acc is not None:
                rec.words[1] |= int(rec.acc.item())
        raise_pending(dev, "a")


def _reset() -> None:
    """Forget every record (tests only)."""
    with _lock:
        for rec in _records.values():
            rec.clear()
