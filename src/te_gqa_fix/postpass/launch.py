"""Prepared launches of the post-pass kernel, and the one launch route (:func:`run_kernel`).

A :class:`KernelLaunch` holds everything a launch needs that depends only on metadata (grid,
scalars, compile-time constants), so a caller that caches it per call shape pays for it
once. The first launch per pointer alignment goes through ``kernel[grid]`` (which
compiles); later ones call Triton's launcher, or its C entry point where Triton's
arguments to it are known (:func:`launch_entry`): in TE's wake every Python layer of a
launch costs several times what it costs warm. Triton is optional: nothing here imports it
until :func:`available` is asked.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .._logging import log_once
from ..masks import KeySpan
from ..stack.versions import release
from . import kernel, offset_errors

__all__ = ["KernelLaunch", "available", "prepare", "run_kernel", "unsupported"]

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


@functools.cache
def available() -> bool:
    """True when Triton imports and CUDA is present (decided once; imports Triton)."""
    try:
        return bool(torch.cuda.is_available()) and kernel.build() is not None
    except Exception as exc:  # ImportError, or a broken install raising anything else
        log_once(("triton",), logging.INFO, "te_gqa_fix: no Triton (%s); PyTorch post-pass", exc)
        return False


def unsupported(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple
) -> Optional[str]:
    """None when the kernel handles these CUDA tensors, else why not (metadata only)."""
    device = dk.device
    if device.type != "cuda":
        return f"device {device}"
    return _unfit(dq, dk, dv, offsets, device)


def _unfit(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple, device
) -> Optional[str]:
    """Why these tensors, all meant to be on ``device``, are not what the kernel takes."""
    for t in (dk, dv) if dq is None else (dq, dk, dv):
        if type(t) not in _PLAIN:
            return f"{type(t).__name__} (not a plain torch.Tensor)"
        if t.dim() != 3 or t.dtype not in _GRADIENT_DTYPES or t.device != device:
            return f"a {t.dim()}-D {t.dtype} gradient on {t.device}"
        if any(n > 1 and st == 0 for n, st in zip(t.shape, t.stride())):
            return "an expanded (zero-stride) gradient"
    for o in offsets:
        if o is not None and (o.dtype not in _OFFSET_DTYPES or o.device != device):
            return f"{o.dtype} offsets on {o.device}"
    return None


class KernelLaunch:
    """One launch's metadata-only arguments. ``launchers`` maps the pointers' 16-byte
    alignment (what Triton specializes a pointer on) to the compiled kernel's launcher."""

    __slots__ = ("err", "err_ptr", "grid", "launchers", "meta", "scalars")

    def __init__(
        self, grid: Tuple[int, int, int], scalars: tuple, meta: Dict[str, Any], device
    ) -> None:
        self.grid = grid
        self.scalars = scalars
        self.meta = meta
        self.launchers: Dict[tuple, Callable[..., None]] = {}
        self.err = offset_errors.kernel_flag(device)
        # Pinned host memory under unified addressing: the kernel stores to this address.
        self.err_ptr = self.err.data_ptr()


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_properties(index).multi_processor_count


def prepare(
    dq: Optional[torch.Tensor], dk: torch.Tensor, dv: torch.Tensor, offsets: tuple, span: KeySpan
) -> KernelLaunch:
    """The launch for these gradients, offsets (valid q/kv, padded q/kv or None) and span.

    Args:
        dq: ``[Tq, Hq, D]`` or None (dK/dV only); dk, dv: ``[Tkv, H, D]``, any strides.
        offsets: TE's four offset tensors; only their count and which are None matter.
        span: the mask's key interval rule (:func:`te_gqa_fix.masks.key_span`).

    Returns:
        A :class:`KernelLaunch`, valid for every call with the same metadata.
    """
    q_t = dk if dq is None else dq
    nseq = offsets[0].numel() - 1
    rows_kv, rows_q = int(dk.shape[0]), (0 if dq is None else int(dq.shape[0]))
    nblk_kv, nblk_q = -(-rows_kv // BLOCK_T), -(-rows_q // BLOCK_T)
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
    bits = offset_errors.ARGUMENT_BITS
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
        PAD_Q_BIT=bits["cu_seqlens_q_padded" if offsets[2] is not None else "cu_seqlens_q"],
        PAD_KV_BIT=bits["cu_seqlens_kv_padded" if offsets[3] is not None else "cu_seqlens_kv"],
        OFF_BLOCK=off_block, OFF_CHUNKS=-(-(nseq + 1) // off_block),
    )  # fmt: skip
    meta["ONCE"] = not search and meta["OFF_CHUNKS"] == 1
    if dk.device.type == "cuda":
        meta["num_warps"] = NUM_WARPS
    return KernelLaunch((n_prog, 1, 1), scalars, meta, dk.device)


#: Triton releases whose launcher's C entry point (``CompiledKernel.run.launch``) takes
#: ``(grid x, y, z, stream, function, cooperative grid, PDL, global scratch, profile
#: scratch, packed metadata, launch metadata, enter hook, exit hook, *kernel arguments)``:
#: what their ``CudaLauncher.__call__`` passes it once the scratch memory is allocated.
C_ENTRY_RELEASES = ((3, 5), (3, 6))


def launch_entry(compiled: Any, triton_version: str) -> Tuple[Callable[..., None], tuple]:
    """The function a launch of ``compiled`` calls, and its arguments between the stream and
    the kernel's own: both are called as ``entry(x, y, z, stream, *between, *arguments)``.

    Args:
        compiled: a Triton ``CompiledKernel``.
        triton_version: ``triton.__version__``.

    Returns:
        On a release of :data:`C_ENTRY_RELEASES`, for a kernel that needs no scratch memory,
        the launcher's C entry point: it skips the Python layer that would allocate that
        memory. Anywhere else Triton's own launcher, ``compiled.run``.
    """
    run = compiled.run
    if (
        release(triton_version) in C_ENTRY_RELEASES
        and getattr(run, "global_scratch_size", None) == 0
        and getattr(run, "profile_scratch_size", None) == 0
    ):
        between = (
            compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None,
        )  # fmt: skip
        return run.launch, between
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


def _launcher(
    compiled: Any, kernel_launch: KernelLaunch, device: torch.device
) -> Callable[..., None]:
    """A launcher of ``compiled`` taking the seven tensor addresses, on the current stream,
    every other argument bound now (:func:`launch_entry`).

    This skips what Triton's ``compiled[grid](...)`` redoes at every launch (device and
    stream lookups through its driver, launch metadata); its launch hooks are not called.
    """
    import triton

    entry, between = launch_entry(compiled, triton.__version__)
    grid_x, grid_y, grid_z = kernel_launch.grid
    # The kernel's arguments: seven tensors, the error word, the scalars, then constants.
    names = kernel.build().arg_names[8 + len(kernel_launch.scalars) :]
    tail = (kernel_launch.err_ptr, *kernel_launch.scalars, *(kernel_launch.meta[n] for n in names))
    stream = torch._C._cuda_getCurrentRawStream
    index = device.index

    def launch_on_current_stream(*ptrs: int) -> None:
        entry(grid_x, grid_y, grid_z, stream(index), *between, *ptrs, *tail)

    return launch_on_current_stream


def run_kernel(
    kernel_launch: KernelLaunch,
    dq: Optional[torch.Tensor],
    dk: torch.Tensor,
    dv: torch.Tensor,
    offsets: tuple,
) -> None:
    """Zero the dead rows with the kernel, on the current stream; no host sync.

    The first launch per pointer alignment goes through ``kernel[grid]`` (which compiles);
    later ones through :func:`_launcher`, given the addresses: every tensor is on the kernel_launch's
    device (checked when the launch was prepared; the wrapper's keys hold the devices).
    """
    cu_q, cu_kv, pad_q, pad_kv = offsets
    cu_q = cu_q if cu_q.is_contiguous() else cu_q.contiguous()
    cu_kv = cu_kv if cu_kv.is_contiguous() else cu_kv.contiguous()
    pad_q = cu_q if pad_q is None else pad_q if pad_q.is_contiguous() else pad_q.contiguous()
    pad_kv = cu_kv if pad_kv is None else pad_kv if pad_kv.is_contiguous() else pad_kv.contiguous()
    tensors = (dk if dq is None else dq, dk, dv, cu_q, cu_kv, pad_q, pad_kv)
    ptrs = [t.data_ptr() for t in tensors]
    align = tuple([p % 16 == 0 for p in ptrs])
    launcher = kernel_launch.launchers.get(align)
    if launcher is not None:
        launcher(*ptrs)
        return
    compiled = kernel.build()[kernel_launch.grid](
        *tensors, kernel_launch.err, *kernel_launch.scalars, **kernel_launch.meta
    )
    if compiled is not None and hasattr(compiled, "function"):  # None under the interpreter
        kernel_launch.launchers[align] = _launcher(compiled, kernel_launch, dk.device)
