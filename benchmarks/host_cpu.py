#!/usr/bin/env python3
"""Host (Python) overhead of the wrapper per call, on CPU, with the kernel launch stubbed.

Why: the GPU benchmark measures the wrapper's host time against TE's, but a GPU is not
always at hand while working on the hot path. This measures the Python the wrapper adds
around a fake ``fused_attn_bwd`` that returns preallocated tensors (so the original costs
next to nothing), with the Triton route forced on CPU tensors and the compiled kernel's
launch replaced by a no-op. By default the C launch (``te_gqa_fix.c_launch``) runs on a
fake driver library (``tests/fakes/fake_libcuda.c``) whose ``cuLaunchKernel`` only counts:
everything but the driver's own work. With ``--no-c-launch``, Triton 3.5/3.6's Python
launcher runs and its C ``launch`` does nothing: that also leaves out the C launcher's
reading of every argument. The driver's work is a few microseconds on the GPU host.

    PYTHONPATH=src python benchmarks/host_cpu.py [--calls 20000] [--no-c-launch]

Prints nanoseconds per call (minimum over repeats), called positionally as TE 2.20 does
and by keyword: the bare fake, the wrapper with the post-pass, the wrapper
under the fixed-cuDNN pass-through, and the differences. Not a test: no timed asserts.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "src", ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_postpass import positional  # noqa: E402

from fakes.te_signatures import build_fake  # noqa: E402
from fakes.triton_launcher import (  # noqa: E402
    CudaLauncher,
    c_compiler,
    kernel_signature,
    metadata,
    on_fake_driver,
    source,
)
from te_gqa_fix import c_launch, guard, triton_postpass  # noqa: E402
from te_gqa_fix.wrapper import wrapper_for  # noqa: E402


def fake_original(
    rows: int, h_q: int, h_kv: int, d: int, out: Optional[List[Any]] = None
) -> Callable[..., Any]:
    """The test suite's fake of TE 2.20's ``fused_attn_bwd`` (its exact signature, from
    ``tests/fakes/te_signatures.py``) returning preallocated gradients (``out``, else new
    CPU tensors): the cost of "TE's call" is then next to nothing."""
    if out is None:
        out = [
            torch.zeros(rows, h_q, d, dtype=torch.bfloat16),
            torch.zeros(rows, h_kv, d, dtype=torch.bfloat16),
            torch.zeros(rows, h_kv, d, dtype=torch.bfloat16),
            None,
        ]
    return build_fake("2.20", lambda arguments: out)


class _NoLaunch:
    """The launcher module's C ``launch``, made a no-op."""

    def __call__(self, *args: Any) -> None:
        return None


class _StubCompiled:
    """Stands in for Triton's CompiledKernel: ``run`` is Triton 3.5/3.6's
    ``CudaLauncher`` (its Python ``__call__``, the test suite's copy), the launch a no-op."""

    function = 0xF00D
    packed_metadata = ()

    def __init__(self) -> None:
        self.run = CudaLauncher()
        self.run.launch = _NoLaunch()
        self.metadata = metadata()
        self.src: Any = None  # the signature: set when the first plan is made


class _StubKernel:
    """Stands in for the JITFunction: ``kernel[grid](...)`` returns a stub compiled kernel."""

    def __init__(self, arg_names: List[str]) -> None:
        self.arg_names = arg_names
        self.compiled = _StubCompiled()

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *a, **k: self.compiled


def stub_triton(release: str, c: bool) -> None:
    """Route CPU tensors through the Triton host path with a no-op launch, as under
    Triton ``release`` (the GPU machine's is 3.6); ``c``: the C launch on the fake
    driver, else none."""
    names = list(inspect.signature(triton_postpass._postpass_kernel).parameters)
    kernel = _StubKernel(names)
    triton_postpass._kernel = kernel
    c_launch._tried = True  # never the real driver
    if c:
        knobs = type("Knobs", (), {"launch_enter_hook": None, "launch_exit_hook": None})()
        driver, module = on_fake_driver(lambda: 0, lambda index: 0, knobs)
        driver.configure(-1, 0, 1)  # count launches only
        triton_postpass._c_launch, triton_postpass._c_lane = module.launch, module.lane
        c_launch._module = module  # what launch_count() reads
        triton_postpass._device_address = lambda err: 0xABC0  # type: ignore[assignment]
    triton_postpass._available = True
    if hasattr(triton_postpass, "_triton_version"):
        triton_postpass._triton_version = lambda: release  # type: ignore[assignment]
    original = triton_postpass._why_unsupported

    def why(*args: Any, **kwargs: Any) -> Optional[str]:
        kwargs["require_cuda"] = False
        return original(*args, **kwargs)

    triton_postpass._why_unsupported = why  # type: ignore[assignment]
    if hasattr(triton_postpass, "_raw_stream"):
        # Pretend the CPU tensors live on CUDA device 0, so the direct launch is taken.
        triton_postpass._raw_stream = lambda index: 0  # type: ignore[attr-defined]
        triton_postpass._current_device = lambda: 0  # type: ignore[attr-defined]
        make_plan = triton_postpass._make_launch_plan

        def plan_on_device_0(*args: Any) -> Any:
            plan = make_plan(*args)
            plan.device_index = 0
            kernel.compiled.src = source(kernel_signature(names, plan.scalars, plan.meta))
            return plan

        triton_postpass._make_launch_plan = plan_on_device_0  # type: ignore[assignment]
    import te_gqa_fix.postpass as pp

    pp._use_triton = lambda impl, dk: impl != "torch"  # type: ignore[assignment]


def per_call_ns(fn: Callable[[], Any], calls: int, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    samples = []  # the minimum of the repeats: other load on the machine only adds
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / calls)
    return min(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument(
        "--triton-release",
        default="3.6.0",
        help="the Triton release the launch path is chosen for (the GPU machine's: 3.6.0)",
    )
    p.add_argument(
        "--no-c-launch",
        action="store_true",
        help="launch through Triton's Python launcher, not from C (te_gqa_fix.c_launch)",
    )
    args = p.parse_args()
    c = not args.no_c_launch and c_compiler()
    if not args.no_c_launch and not c:
        print("no C compiler: launching through Triton's Python launcher (as --no-c-launch)")
    stub_triton(args.triton_release, c=c)
    rows, h_q, h_kv, d = 64, 8, 2, 16
    original = fake_original(rows, h_q, h_kv, d)
    wrapped = wrapper_for(original)
    i32 = dict(dtype=torch.int32)
    kw: Dict[str, Any] = dict(
        max_seqlen_q=32, max_seqlen_kv=32,
        cu_seqlens_q=torch.tensor([0, 0, 10, 30], **i32),
        cu_seqlens_kv=torch.tensor([0, 8, 20, 40], **i32),
        q=torch.zeros(rows, h_q, d, dtype=torch.bfloat16),
        k=torch.zeros(rows, h_kv, d, dtype=torch.bfloat16),
        v=torch.zeros(rows, h_kv, d, dtype=torch.bfloat16),
        o=None, d_o=None, fake_dtype=torch.bfloat16, aux_ctx_tensors=[],
        fused_attention_backend=None,
        cu_seqlens_q_padded=torch.tensor([0, 8, 24, 48], **i32),
        cu_seqlens_kv_padded=torch.tensor([0, 8, 24, 48], **i32),
        qkv_layout="thd_thd_thd", o_format="thd", do_format="thd", dqkv_layout="thd_thd_thd",
        attn_mask_type="padding_causal_bottom_right", window_size=(-1, -1),
    )  # fmt: skip
    import te_gqa_fix.wrapper as w

    has_device_hook = hasattr(w, "_device_index")
    if has_device_hook:
        w._device_index = lambda q: 0  # type: ignore[assignment]
        guard._decisions[(0, d, d)] = None
    # TE 2.20's FusedAttnFunc.backward passes all 33 arguments by position; by keyword
    # is the benchmark's own convenience and costs the forwarding of a dict twice.
    pos, rest = positional(original, kw)
    assert not rest, rest
    for label, call_orig, call_wrapped in (
        ("positional", lambda: original(*pos), lambda: wrapped(*pos)),
        ("keywords", lambda: original(**kw), lambda: wrapped(**kw)),
    ):
        guard._fixed[0] = False
        bare = per_call_ns(call_orig, args.calls)
        fixing = per_call_ns(call_wrapped, args.calls)
        guard._fixed[0] = True
        passing = per_call_ns(call_wrapped, args.calls)
        print(f"[{label}] launched from C: {c_launch.launch_count() > 0}")
        print(f"bare fake original      {bare:8.0f} ns/call")
        print(f"wrapper, post-pass      {fixing:8.0f} ns/call  (+{fixing - bare:.0f} ns)")
        if has_device_hook:
            print(f"wrapper, pass-through   {passing:8.0f} ns/call  (+{passing - bare:.0f} ns)")
        else:
            print("wrapper, pass-through   (needs a CUDA device index: not measurable here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
