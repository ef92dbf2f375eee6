"""Triton 3.5/3.6's ``CudaLauncher``, as far as a kernel launch goes, with a recording C
``launch``; and what the C launch (``te_gqa_fix.c_launch``) reads of a compiled kernel,
with a fake driver library to launch on.

Why here: the direct launch (``te_gqa_fix.triton_postpass._launcher_call``) calls the
launcher module's C ``launch`` itself on those releases, skipping ``__call__``. The CPU
tests check it hands ``launch`` the very arguments ``__call__`` would, and
``benchmarks/host_cpu.py`` counts the Python ``__call__`` costs; both use this one copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple


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


# ------------------------------------------------------------- the C launch (c_launch.py)

#: What te_gqa_fix.c_launch.record() reads from a CompiledKernel's ``metadata``.
META_FIELDS = (
    "num_warps", "num_ctas", "shared", "launch_cooperative_grid", "launch_pdl",
    "global_scratch_size", "profile_scratch_size",
)  # fmt: skip


def metadata(**fields: Any) -> Any:
    """A CompiledKernel's ``metadata``: 4 warps, one CTA, no shared memory or scratch."""
    values = dict.fromkeys(META_FIELDS, 0)
    values.update(num_warps=4, num_ctas=1, shared=0)
    values.update(fields)
    return type("KernelMetadata", (), values)()


def kernel_signature(names: List[str], scalars: tuple, meta: Dict[str, Any]) -> Dict[str, str]:
    """The ``src.signature`` Triton 3.6 gives the post-pass kernel launched with a plan's
    ``scalars`` and ``meta``: its eight pointers, the scalars as ``i32`` (one equal to 1
    specialized to a constexpr, as Triton does), then the constexprs."""
    kinds = ["*bf16", "*fp32", "*fp32", "*i32", "*i32", "*i32", "*i32", "*i32"]
    kinds += ["constexpr" if v == 1 else "i32" for v in scalars]
    kinds += ["constexpr"] * (len(names) - len(kinds))
    assert len(kinds) == 8 + len(scalars) + len([n for n in names if n in meta]), names
    return dict(zip(names, kinds))


def source(signature: Dict[str, str]) -> Any:
    """A CompiledKernel's ``src`` (Triton's ``ASTSource``) as far as ``record()`` reads
    it: the ``signature``, parameter name to type."""
    return type("Src", (), {"signature": signature})()


def c_compiler() -> bool:
    """A C compiler Triton's build helper would use (``CC``, gcc, clang): what Triton needs
    to build its own launchers, and the C launch module."""
    import os
    import shutil

    return bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang"))


def fake_driver() -> Any:
    """tests/fakes/fake_libcuda.c, built (Triton's C build helper) and imported: pass its
    ``__file__`` to the C launch module's ``setup`` as the driver library."""
    from triton.runtime.build import compile_module_from_src

    src = (Path(__file__).resolve().parent / "fake_libcuda.c").read_text()
    return compile_module_from_src(src=src, name="te_gqa_fix_fake_libcuda")


def on_fake_driver(
    get_device: Callable[[], int], raw_stream: Callable[[int], int], runtime_knobs: Any
) -> Tuple[Any, Any]:
    """``(fake driver, C launch module)``: ``te_gqa_fix.c_launch``'s module built and set up
    on :func:`fake_driver`, with these calls for the current device and stream and these
    launch hooks, and torch's plain tensor types (as ``triton_postpass`` sets it up)."""
    from te_gqa_fix import c_launch, triton_postpass

    driver = fake_driver()
    module = c_launch.build()
    module.setup(driver.__file__, get_device, raw_stream, runtime_knobs, *triton_postpass._PLAIN)
    return driver, module
