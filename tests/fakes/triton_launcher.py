"""Triton 3.5/3.6's ``CudaLauncher``, as far as a kernel launch goes, with a recording C
``launch``.

Why here: the direct launch (``te_gqa_fix.triton_postpass._launcher_call``) calls the
launcher module's C ``launch`` itself on those releases, skipping ``__call__``. The CPU
tests check it hands ``launch`` the very arguments ``__call__`` would, and
``benchmarks/host_cpu.py`` counts the Python ``__call__`` costs; both use this one copy.
"""

from __future__ import annotations

from typing import Any, List


class CLaunch:
    """Stands in for a Triton launcher module's compiled C ``launch``: records its arguments."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []

    def __call__(self, *args: Any) -> None:
        self.calls.append(args)


class _Allocator:
    """Triton's scratch allocator, handing out one fake address."""

    @staticmethod
    def get() -> Any:
        return lambda size, align, stream: 0xD000


class _Allocation:
    """Triton's ``runtime._allocation`` module: its two allocators."""

    _allocator = _Allocator
    _profile_allocator = _Allocator


_allocation = _Allocation


class CudaLauncher:
    """``__call__`` is Triton 3.5/3.6's, line for line, with its allocators stubbed (they
    are only called when a scratch size is positive). ``called`` counts its calls."""

    def __init__(self, global_scratch: int = 0, profile_scratch: int = 0) -> None:
        self.num_ctas = 1
        self.launch: Any = CLaunch()
        self.global_scratch_size = global_scratch
        self.global_scratch_align = 1
        self.profile_scratch_size = profile_scratch
        self.profile_scratch_align = 1
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.called = 0

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # type: ignore[no-untyped-def]
        self.called += 1

        def allocate_scratch(size, align, allocator):  # type: ignore[no-untyped-def]
            if size > 0:
                grid_size = gridX * gridY * gridZ
                alloc_size = grid_size * self.num_ctas * size
                alloc_fn = allocator.get()
                return alloc_fn(alloc_size, align, stream)
            return None

        global_scratch = allocate_scratch(
            self.global_scratch_size, self.global_scratch_align, _allocation._allocator
        )
        profile_scratch = allocate_scratch(
            self.profile_scratch_size, self.profile_scratch_align, _allocation._profile_allocator
        )
        self.launch(
            gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
            global_scratch, profile_scratch, *args,
        )  # fmt: skip
