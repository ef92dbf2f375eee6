"""The post-pass kernel's steady-state launch, from C.

Why: in the wrapper's steady state the launch was the larger part of its host time. On
the H200, right after TE's backward, Python's launch took 9.3-9.7 us, and the wrapper's
own Python another 8.4-8.6 us (``benchmarks/wake_split.py``, round 6). Per call, that
launch read seven ``data_ptr()`` values, checked their alignment, Triton's launch hooks,
the current device and stream, built a tuple of every kernel argument (constexprs
included, about 60), and Triton's C launcher parsed that tuple back into C values. Only
the seven addresses and the stream change between calls of one launch plan.

How: :func:`record` packs, once per launch plan, everything a launch of the plan's
compiled kernel needs into bytes: the function handle, grid, block, shared memory,
device, and one 8-byte slot per kernel parameter in the order Triton's CUDA launcher
passes them (the signature less its constexprs; two scratch pointers follow). ``c_launch.c``
(built on first use with Triton's own C build helper, as Triton builds its launchers, and
cached by Triton) reads the seven addresses into slots 0-6 and calls ``cuLaunchKernel``.
It declines, doing nothing, whenever Triton's own path must run: a pointer not 16-byte
aligned, a launch hook set, another current device, no current CUDA context. The
wrapper's fast lane calls ``serve`` right after TE's call: TE's outputs checked against
the output key the lane recorded (as the lane checks them in Python), no bad offsets
pending, then the same launch: after TE's call, in C only. ``lane`` goes one step
further, for the same reason: the whole fast lane of the wrapper (its checks before TE's
call, the call, then ``serve``) in one C call (see ``te_gqa_fix.wrapper._Lane``).

When: only for kernels Triton 3.5/3.6 compiled (the releases whose launcher was read:
``te_gqa_fix.triton_postpass._C_LAUNCH_RELEASES``) with one CTA per program, no
cooperative or PDL launch and no scratch memory, all of whose parameters are pointers or
integers. ``TE_GQA_FIX_C_LAUNCH=0`` turns it off, the C lane with it. Without a C
compiler, or anywhere the build fails, the launch and the lane stay in Python (logged
once).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Tuple

from ._logging import log_once

__all__ = ["enabled", "lane_count", "launch_count", "load", "record"]

ENV = "TE_GQA_FIX_C_LAUNCH"

#: function, grid x/y/z, threads per block, shared memory, device, parameters, reserved,
#: the address of the host error words: ``record_t`` in c_launch.c, little-endian.
HEADER = struct.Struct("<QIIIIIiIIQ")
#: Kernel parameters are tensors' addresses first: slots 0-6 are rewritten per call.
N_TENSORS = 7
MAX_PARAMS = 128
#: Triton's integer parameter types, by the C type its launcher gives them.
INT_FORMATS = {
    "i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H",
    "i32": "i", "u32": "I", "i64": "q", "u64": "Q",
}  # fmt: skip
MODULE_NAME = "te_gqa_fix_c_launch"

_module: Any = None
_tried = False


def enabled() -> bool:
    """Not turned off by ``TE_GQA_FIX_C_LAUNCH=0``."""
    return os.environ.get(ENV, "1").strip() != "0"


def source() -> str:
    """The C source of the launch module (shipped beside this file)."""
    return Path(__file__).with_name("c_launch.c").read_text()


def build() -> Any:
    """Build (or take from Triton's cache) and import the launch module."""
    from triton.runtime.build import compile_module_from_src

    module = compile_module_from_src(src=source(), name=MODULE_NAME)
    if module.header_size() != HEADER.size:
        raise RuntimeError(f"c_launch.c record header is {module.header_size()} bytes")
    return module


def load(
    library: str,
    get_device: Callable[[], int],
    raw_stream: Callable[[int], int],
    runtime_knobs: Any,
    plain_types: Tuple[type, type],
) -> Any:
    """The launch module, set up once per process: the driver ``library``; what it calls
    per launch for the current device, its current stream and Triton's launch hooks
    (``triton.knobs.runtime``); the two tensor types ``serve`` takes as plain (torch's
    ``Tensor`` and ``Parameter``). Its ``launch(record, *tensors)`` and ``serve(record,
    output_key, out, *offsets)`` return True when they launched. None (logged once) when
    it cannot be built or set up, or is turned off: the caller keeps the Python launch."""
    global _module, _tried
    if _module is not None:
        return _module
    if _tried or not enabled():
        return None
    _tried = True
    try:
        module = build()
        module.setup(library, get_device, raw_stream, runtime_knobs, *plain_types)
    except Exception as exc:  # no compiler, no driver, another Python ABI...
        log_once(
            ("c-launch-unavailable",),
            logging.INFO,
            "te_gqa_fix: launching the post-pass from C is unavailable (%r); "
            "launching through Triton's launcher",
            exc,
        )
        return None
    _module = module
    return module


def launch_count() -> int:
    """Kernels launched from C in this process (0 before the module is loaded)."""
    return 0 if _module is None else int(_module.launches())


def lane_count() -> int:
    """Wrapper calls the C lane (``lane`` in c_launch.c) served in this process: launched
    the post-pass, or passed through on a fixed cuDNN (0 before the module is loaded)."""
    return 0 if _module is None else int(_module.lanes())


def record(
    compiled: Any,
    args: Sequence[Any],
    grid: Tuple[int, int, int],
    device: int,
    words: int = 0,
) -> Optional[bytes]:
    """A launch record for ``compiled`` (Triton's ``CompiledKernel``) called with ``args``
    (every kernel argument in parameter order, constexprs included, the seven tensors as
    placeholders) on ``device``, or None when the C launch must not serve it (see the
    module docstring). ``words``: the address of the device's two int32 host error words
    (:func:`te_gqa_fix.offset_errors.pending_words`), which ``serve`` reads; 0: none
    (then ``serve`` always declines, and only ``launch`` serves the record)."""
    try:
        signature = list(compiled.src.signature.values())
        meta = compiled.metadata
        function = int(compiled.function)
        block = 32 * int(meta.num_warps)
        shared = int(meta.shared)
        special = (
            int(getattr(meta, "num_ctas", 1)) != 1
            or bool(getattr(meta, "launch_cooperative_grid", False))
            or bool(getattr(meta, "launch_pdl", False))
            or int(getattr(meta, "global_scratch_size", 0) or 0) > 0
            or int(getattr(meta, "profile_scratch_size", 0) or 0) > 0
        )
    except (AttributeError, TypeError, ValueError):
        return None
    if special or len(signature) != len(args) or len(grid) != 3:
        return None
    slots = []
    for i, (kind, value) in enumerate(zip(signature, args)):
        if kind == "constexpr":
            continue
        if not isinstance(kind, str):  # tuples of parameters
            return None
        if kind.startswith("*"):
            fmt = "Q"
            if type(value) is not int:  # a tensor would need data_ptr() per call
                return None
        elif kind in INT_FORMATS and type(value) in (int, bool):
            fmt = INT_FORMATS[kind]
        else:  # floats, tensor descriptors, anything else
            return None
        if len(slots) < N_TENSORS and (i != len(slots) or fmt != "Q"):
            return None  # the first seven parameters must be the tensors' pointers
        try:
            slots.append(struct.pack("<" + fmt, value).ljust(8, b"\0"))
        except struct.error:
            return None
    if not N_TENSORS <= len(slots) <= MAX_PARAMS:
        return None
    try:
        head = HEADER.pack(function, *grid, block, shared, device, len(slots), 0, words)
    except struct.error:
        return None
    return head + b"".join(slots)
