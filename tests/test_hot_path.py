"""The wrapper's hot path (issue 12): one check per call shape, the fixed-cuDNN
pass-through, a plan cache keyed on everything it depends on, and the direct Triton launch.

No timing here: the host cost is measured by benchmarks/host_cpu.py (CPU) and
benchmarks/bench_postpass.py (GPU). These tests pin the behaviour that makes the fast path
safe: what is cached, what is still checked on every call, and the fallbacks.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch

from fakes.cuda_checks import capture, no_host_sync
from fakes.oracle import make_ragged
from fakes.te_outputs import (
    FakeBackend,
    FakeTE,
    assert_post_pass,
    assert_untouched,
    call_arguments,
)
from fakes.triton_launcher import (
    CLaunch,
    CudaLauncher,
    c_compiler,
    kernel_signature,
    metadata,
    on_fake_driver,
    source,
)
from te_gqa_fix import c_launch, guard, postpass, triton_postpass
from te_gqa_fix import wrapper as wrapper_module
from te_gqa_fix._logging import _reset_log_once
from te_gqa_fix.masks import key_span
from te_gqa_fix.wrapper import _new_wrapper as make_wrapper
from te_gqa_fix.wrapper import call_counts, reset_call_counts

RAGGED = make_ragged(
    [(3, 5), (0, 4), (4, 0), (2, 2), (5, 3)],
    gaps_q=[1, 0, 2, 1, 0],
    gaps_kv=[2, 1, 0, 1, 1],
    lead_q=1,
    lead_kv=2,
    tail_q=2,
    tail_kv=3,
)
OTHER = make_ragged([(0, 6), (2, 3), (1, 1)], gaps_kv=[1, 0, 2], lead_kv=1, tail_kv=2)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TE_GQA_FIX", raising=False)
    monkeypatch.delenv("TE_GQA_FIX_VALIDATE", raising=False)
    reset_call_counts()
    _reset_log_once()


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[str, ...]]:
    """Record every check_metadata call, wherever the package calls it from."""
    from te_gqa_fix import validation

    seen: List[Tuple[str, ...]] = []
    real = validation.check_metadata

    def counting(*args: Any, **kwargs: Any) -> None:
        seen.append(tuple(kwargs.get("names", ("dq", "dk", "dv"))))
        real(*args, **kwargs)

    for module in (wrapper_module, postpass, triton_postpass):
        if hasattr(module, "check_metadata"):
            monkeypatch.setattr(module, "check_metadata", counting)
    return seen


def _check(fake: FakeTE, out: Any, ragged: Any, mask: str, window: Any, brd: Any) -> None:
    assert_post_pass(fake.backend.outputs, ragged, mask, window, brd)


# --------------------------------------------------------------------- validation


def test_metadata_checked_once_per_call_shape_not_per_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """First call: one check (the wrapper's, of q/k/v and the offsets), none in the
    post-pass; later calls with new offset tensors of the same metadata: none."""
    seen = _count_checks(monkeypatch)
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    for i in range(4):
        fake.backend.reset()
        arguments = call_arguments("2.20", RAGGED)  # new tensors every call, as in training
        out = wrapped(**arguments)
        _check(fake, out, RAGGED, "padding_causal", (-1, -1), None)
        assert len(seen) == 1, (i, seen)
    assert seen == [("q", "k", "v")]
    assert call_counts()["fixed"] == 4


def test_new_offset_tensors_are_still_checked_on_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cache compares each call's offset metadata: int64 offsets after a good call
    raise the same ValueError as on a first call, and a wrong length too."""
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    wrapped(**call_arguments("2.20", RAGGED))
    bad = call_arguments("2.20", RAGGED, offsets_dtype=torch.int64)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: expected dtype torch\.int32"):
        wrapped(**bad)
    short = call_arguments("2.20", RAGGED)
    short["cu_seqlens_kv"] = short["cu_seqlens_kv"][:-1]
    with pytest.raises(ValueError, match="cu_seqlens_kv: expected 6 offsets"):
        wrapped(**short)
    # ... and the good shape still works afterwards (the bad calls were not cached).
    fake.backend.reset()
    out = wrapped(**call_arguments("2.20", RAGGED))
    _check(fake, out, RAGGED, "padding_causal", (-1, -1), None)


def test_public_zero_dead_rows_still_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_checks(monkeypatch)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    dk = torch.zeros(4, 1, 2)
    postpass.zero_dead_rows(None, dk, dk.clone(), cu, cu, impl="torch")
    postpass.zero_dead_rows(None, dk, dk.clone(), cu, cu, impl="torch")
    assert len(seen) == 2
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        postpass.zero_dead_rows(None, dk, dk.clone(), cu, cu.to(torch.int64), impl="torch")


# --------------------------------------------------------------------- pass-through


def _on_cuda_device_0(monkeypatch: pytest.MonkeyPatch, fixed: bool) -> List[tuple]:
    """Make the wrapper believe q is on CUDA device 0 with a fixed (or affected) cuDNN."""
    guards: List[tuple] = []
    monkeypatch.setattr(wrapper_module, "_device_index", lambda q: 0)
    monkeypatch.setattr(wrapper_module, "cudnn_fixed", lambda index: fixed and index == 0)
    monkeypatch.setattr(wrapper_module, "check_head_dims", lambda *a: guards.append(a))
    return guards


def test_auto_passes_through_on_fixed_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    guards = _on_cuda_device_0(monkeypatch, fixed=True)
    ran: List[int] = []
    monkeypatch.setattr(wrapper_module, "zero_dead_rows_prechecked", lambda *a, **k: ran.append(1))
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    for _ in range(3):
        fake.backend.reset()
        out = wrapped(**call_arguments("2.20", RAGGED))
        assert out is fake.backend.returned
        assert_untouched(fake.backend.outputs)
    assert ran == [] and guards == []
    # The first call reads the settings; the fast lane passes the other two through.
    assert call_counts() == {"calls": 3, "fixed": 0, "skipped": 3, "passthrough": 0, "fast_lane": 2}


def test_always_still_runs_the_post_pass_on_fixed_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    guards = _on_cuda_device_0(monkeypatch, fixed=True)
    monkeypatch.setenv("TE_GQA_FIX", "always")
    fake = FakeTE("2.20")
    out = make_wrapper(fake.fn)(**call_arguments("2.20", RAGGED))
    _check(fake, out, RAGGED, "padding_causal", (-1, -1), None)
    assert call_counts()["fixed"] == 1
    assert guards == [(0, 3, 3)]


def test_auto_runs_the_post_pass_and_guard_on_affected_cudnn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not fixed: the post-pass runs and the head-dim guard is asked on every call
    (a dict lookup after the first), also on cached call shapes."""
    guards = _on_cuda_device_0(monkeypatch, fixed=False)
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    for _ in range(3):
        fake.backend.reset()
        out = wrapped(**call_arguments("2.20", RAGGED))
        _check(fake, out, RAGGED, "padding_causal", (-1, -1), None)
    assert guards == [(0, 3, 3)] * 3


def test_guard_strict_raises_on_cached_call_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wrapper_module, "_device_index", lambda q: 0)
    monkeypatch.setattr(wrapper_module, "cudnn_fixed", lambda index: False)
    monkeypatch.setitem(guard._decisions, (0, 3, 3), None)
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    wrapped(**call_arguments("2.20", RAGGED))  # cached as fine
    monkeypatch.setitem(guard._decisions, (0, 3, 3), "unrepairable here")
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "strict")
    with pytest.raises(guard.UnrepairableConfiguration, match="unrepairable here"):
        wrapped(**call_arguments("2.20", RAGGED))


# --------------------------------------------------------------------- plan cache


CHANGES: List[Dict[str, Any]] = [
    dict(),
    dict(attn_mask_type="padding_causal_bottom_right"),
    dict(attn_mask_type="padding", window_size=(1, 0), bottom_right_diagonal=True),
    dict(attn_mask_type="padding", window_size=[1, 0], bottom_right_diagonal=False),
    dict(attn_mask_type="padding", window_size=(0, 2), bottom_right_diagonal=False),
    dict(layout="thd_t2hd"),
    dict(layout="thd_th2d", attn_mask_type="padding_causal_bottom_right"),
    dict(ragged=OTHER),
    dict(ragged=OTHER, heads_q=6, heads_kv=3, head_dim=5),
    dict(),
]


@pytest.mark.parametrize("version", ["2.8", "2.20"])
def test_plan_follows_every_change_between_calls(version: str) -> None:
    """One wrapper, one call after another with the mask, window, diagonal flag, layout,
    batch or shapes changed: each call's rows match the oracle (a stale plan would not)."""
    fake = FakeTE(version)
    wrapped = make_wrapper(fake.fn)
    for change in CHANGES:
        change = dict(change)
        ragged = change.pop("ragged", RAGGED)
        if version == "2.8":
            change.pop("bottom_right_diagonal", None)
        fake.backend.reset()
        arguments = call_arguments(version, ragged, **change)
        out = wrapped(**arguments)
        brd = change.get("bottom_right_diagonal") if version == "2.20" else None
        window = tuple(change.get("window_size", (-1, -1)))
        _check(fake, out, ragged, change.get("attn_mask_type", "padding_causal"), window, brd)


def test_policy_change_between_calls_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    mha = dict(heads_q=2, heads_kv=2)
    wrapped(**call_arguments("2.20", RAGGED, **mha))
    assert call_counts()["skipped"] == 1  # MHA under auto
    monkeypatch.setenv("TE_GQA_FIX", "always")
    fake.backend.reset()
    out = wrapped(**call_arguments("2.20", RAGGED, **mha))
    _check(fake, out, RAGGED, "padding_causal", (-1, -1), None)
    monkeypatch.setenv("TE_GQA_FIX", "off")
    fake.backend.reset()
    wrapped(**call_arguments("2.20", RAGGED))
    assert_untouched(fake.backend.outputs)


def test_unhashable_arguments_still_work() -> None:
    """A window given as a list of lists-like object: decided without the cache."""

    class Window(list):
        __hash__ = None  # type: ignore[assignment]

    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    for _ in range(2):
        fake.backend.reset()
        args = call_arguments("2.20", RAGGED, attn_mask_type="padding")
        args["window_size"] = Window([1, 0])
        out = wrapped(**args)
        _check(fake, out, RAGGED, "padding", (1, 0), None)


def test_picker_reads_positional_keyword_and_default() -> None:
    def fn(a, q, k=1, *, window_size=(-1, -1), dqkv_layout=None, qkv_layout="x"):
        return None

    binder = wrapper_module._Args(fn)
    pick = binder.picker(("q", "k", "window_size", "layout_name", "layout", "absent"))
    assert pick((0, "Q"), {}) == ("Q", 1, (-1, -1), "qkv_layout", "x", None)
    assert pick((0, "Q", 2), {"window_size": (3, 4), "dqkv_layout": "thd_thd_thd"}) == (
        "Q", 2, (3, 4), "dqkv_layout", "thd_thd_thd", None,
    )  # fmt: skip
    assert pick((0,), {"q": "kw"})[0] == "kw"


# --------------------------------------------------------------------- direct launch


class _Compiled:
    """Stands in for Triton's CompiledKernel; records direct launches."""

    function = "fn-handle"
    packed_metadata = ("packed",)

    def __init__(self, fail: bool = False) -> None:
        self.launches: List[tuple] = []
        self.fail = fail

    def run(self, *args: Any) -> None:
        if self.fail:
            raise RuntimeError("launcher exploded")
        self.launches.append(args)


class _Kernel:
    """Stands in for the JITFunction: ``kernel[grid](...)`` records and returns the stub."""

    def __init__(self, compiled: Optional[_Compiled], arg_names: Optional[List[str]] = None):
        self.arg_names = arg_names or list(
            inspect.signature(triton_postpass._postpass_kernel).parameters
        )
        self.compiled = compiled
        self.slow: List[tuple] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **meta: Any) -> Any:
            self.slow.append((grid, args, meta))
            return self.compiled

        return launch


class _Hooks:
    def __init__(self) -> None:
        self.launch_enter_hook: Any = None
        self.launch_exit_hook: Any = None


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, kernel: _Kernel) -> _Hooks:
    hooks = _Hooks()
    monkeypatch.setattr(triton_postpass, "_build", lambda: kernel)
    monkeypatch.setattr(triton_postpass, "_current_device", lambda: 0)
    monkeypatch.setattr(triton_postpass, "_raw_stream", lambda index: 1234)
    monkeypatch.setattr(triton_postpass, "_runtime_knobs", hooks)
    monkeypatch.setattr(triton_postpass, "_fast_ok", True)
    monkeypatch.setattr(triton_postpass, "_launch_plans", {})
    # No C launch unless a test sets one up (tests below): never a build attempt here.
    monkeypatch.setattr(triton_postpass, "_c_launch", None)
    monkeypatch.setattr(c_launch, "_module", None)
    monkeypatch.setattr(c_launch, "_tried", True)
    return hooks


def _plan_and_tensors(offset: int = 0) -> Tuple[Any, tuple]:
    base = torch.zeros(400, dtype=torch.bfloat16)
    dq = base[offset : offset + 20 * 4 * 4].view(20, 4, 4)
    dk, dv = torch.zeros(20, 2, 4), torch.zeros(20, 2, 4)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    tensors = (dq, dk, dv, cu, cu, cu, cu)
    plan = triton_postpass._launch_plan(
        dq, dk, dv, True, 2, key_span("padding_causal"), (cu.dtype,) * 4
    )
    plan.device_index = 0
    return plan, tensors


def test_direct_launch_after_first_normal_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    _fake_cuda(monkeypatch, kernel)
    plan, tensors = _plan_and_tensors()
    triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 1 and compiled.launches == []
    triton_postpass._run(plan, tensors)
    triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 1 and len(compiled.launches) == 2
    grid, args, meta = kernel.slow[0]
    launch = compiled.launches[0]
    assert launch[:4] == (grid[0], grid[1], 1, 1234)
    assert launch[4:9] == ("fn-handle", ("packed",), None, None, None)
    # Every kernel parameter in order: what Triton's own run() hands the launcher.
    # The seven device pointers go to the launcher as integers (no data_ptr() call and no
    # driver query per pointer there); the pinned error word stays a tensor (the driver
    # gives its device address); the rest exactly as Triton's own run() binds them.
    bound = dict(zip(kernel.arg_names, (*args, *[meta[n] for n in kernel.arg_names[len(args) :]])))
    expected = tuple(bound[n] for n in kernel.arg_names)
    assert launch[9:16] == tuple(t.data_ptr() for t in tensors)
    assert all(type(p) is int for p in launch[9:16])
    assert launch[16] is expected[7] and launch[16] is plan.err
    assert launch[17:] == expected[8:]


class _Driver:
    """Stands in for libcuda: answers cuPointerGetAttribute with a fixed address."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.asked: List[int] = []

    def cuPointerGetAttribute(self, out: Any, attribute: Any, pointer: Any) -> int:
        import ctypes

        self.asked.append(attribute.value)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_uint64))[0] = 0xABC0
        return self.status


@pytest.mark.parametrize("status", [0, 1])
def test_direct_launch_passes_the_error_words_device_address(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """Asked once when the launch is armed, the driver's device address of the pinned
    error word goes to the launcher as an int; a driver that cannot say: the tensor."""
    compiled = _Compiled()
    _fake_cuda(monkeypatch, _Kernel(compiled))
    driver = _Driver(status)
    monkeypatch.setattr(triton_postpass, "_libcuda", driver)
    plan, tensors = _plan_and_tensors()
    for _ in range(3):
        triton_postpass._run(plan, tensors)
    assert driver.asked == [triton_postpass._CU_POINTER_ATTRIBUTE_DEVICE_POINTER]
    assert [launch[16] for launch in compiled.launches] == [0xABC0 if status == 0 else plan.err] * 2


def test_direct_launch_keys_on_pointer_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton specializes pointers on 16-byte alignment: a misaligned view must not reuse
    the kernel compiled for aligned pointers."""
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    _fake_cuda(monkeypatch, kernel)
    plan, aligned = _plan_and_tensors(0)
    _, misaligned = _plan_and_tensors(1)  # bf16: 2 bytes off
    assert misaligned[0].data_ptr() % 16 != 0
    triton_postpass._run(plan, aligned)
    triton_postpass._run(plan, misaligned)
    assert len(kernel.slow) == 2 and compiled.launches == []
    triton_postpass._run(plan, misaligned)
    triton_postpass._run(plan, aligned)
    assert len(kernel.slow) == 2 and len(compiled.launches) == 2


def test_direct_launch_respects_hooks_and_other_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    hooks = _fake_cuda(monkeypatch, kernel)
    plan, tensors = _plan_and_tensors()
    triton_postpass._run(plan, tensors)

    class Chain:
        def __init__(self) -> None:
            self.calls = [print]

    hooks.launch_enter_hook = Chain()
    triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 2 and compiled.launches == []
    hooks.launch_enter_hook = type("Empty", (), {"calls": []})()  # Triton 3.6's empty chain
    triton_postpass._run(plan, tensors)
    assert len(compiled.launches) == 1
    entered: List[int] = []

    class Device:
        def __init__(self, index: int) -> None:
            entered.append(index)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> None:
            return None

    monkeypatch.setattr(triton_postpass, "_current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", Device)
    triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 3 and entered == [0]


def test_failed_direct_launch_falls_back_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    compiled = _Compiled(fail=True)
    kernel = _Kernel(compiled)
    _fake_cuda(monkeypatch, kernel)
    plan, tensors = _plan_and_tensors()
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        for _ in range(3):
            triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 3  # every call still launched (Triton's path)
    assert sum("direct Triton launch failed" in r.getMessage() for r in caplog.records) == 1
    assert triton_postpass._fast_ok is False


def test_unknown_kernel_signature_keeps_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose parameters do not match the plan (say a merge added one) is never
    launched directly: the arguments would land in the wrong slots."""
    compiled = _Compiled()
    names = list(inspect.signature(triton_postpass._postpass_kernel).parameters)
    kernel = _Kernel(compiled, arg_names=[*names[:7], "flag_ptr", *names[7:]])
    _fake_cuda(monkeypatch, kernel)
    plan, tensors = _plan_and_tensors()
    for _ in range(3):
        triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 3 and compiled.launches == []


def test_interpreter_or_cpu_never_takes_the_direct_path(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    _fake_cuda(monkeypatch, kernel)
    plan, tensors = _plan_and_tensors()
    plan.device_index = -1  # CPU tensors (the interpreter)
    for _ in range(3):
        triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 3 and compiled.launches == []


class _CompiledByLauncher(_Compiled):
    """A CompiledKernel whose ``run`` is a :class:`CudaLauncher`."""

    def __init__(self, launcher: CudaLauncher) -> None:
        super().__init__()
        self.run = launcher  # type: ignore[assignment,method-assign]


def _launched_by(
    monkeypatch: pytest.MonkeyPatch, launcher: CudaLauncher, release: str
) -> List[tuple]:
    """What the C ``launch`` received over three calls of one plan under Triton ``release``
    (the first call goes through ``kernel[grid](...)`` and is not the launcher's), each
    tensor's pointer checked and replaced by its name (each case has its own tensors)."""
    monkeypatch.setattr(triton_postpass, "_triton_version", lambda: release)
    _fake_cuda(monkeypatch, _Kernel(_CompiledByLauncher(launcher)))
    plan, tensors = _plan_and_tensors()
    for _ in range(3):
        triton_postpass._run(plan, tensors)
    calls = launcher.launch.calls if isinstance(launcher.launch, CLaunch) else []
    named = []
    for args in calls:
        assert args[13:20] == tuple(t.data_ptr() for t in tensors)
        named.append((*args[:13], *(f"ptr{i}" for i in range(7)), *args[20:]))
    return named


@pytest.mark.parametrize("release", ["3.5.1", "3.6.0"])
def test_direct_launch_calls_the_c_launch_with_what_the_launcher_would(
    monkeypatch: pytest.MonkeyPatch, release: str
) -> None:
    """Under a Triton release whose launcher is known, the direct launch skips
    ``CudaLauncher.__call__`` and hands its C ``launch`` exactly the arguments that
    ``__call__`` would have: the same tuple, argument for argument."""
    through_call = CudaLauncher()
    want = _launched_by(monkeypatch, through_call, "3.7.0")  # unknown: through __call__
    assert through_call.called == 2 and len(want) == 2
    direct = CudaLauncher()
    got = _launched_by(monkeypatch, direct, release)
    assert direct.called == 0, "CudaLauncher.__call__ ran: the C launch was not called directly"
    assert got == want
    assert got[0][5:9] == (False, True, None, None)  # the flags, no scratch


@pytest.mark.parametrize(
    "case", ["global scratch", "profile scratch", "wrapped launch", "release 3.4", "release 3.7"]
)
def test_direct_launch_keeps_the_launcher_call_where_it_is_needed(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Scratch to allocate, a launch wrapped in Python (tensor descriptors), a release
    whose launcher was not read: ``CudaLauncher.__call__`` runs as Triton's own launch
    would call it."""
    launcher = CudaLauncher(
        global_scratch=64 if case == "global scratch" else 0,
        profile_scratch=64 if case == "profile scratch" else 0,
    )
    calls = launcher.launch.calls
    if case == "wrapped launch":
        launcher.launch = lambda *args, inner=launcher.launch: inner(*args)
    release = {"release 3.4": "3.4.0", "release 3.7": "3.7.0"}.get(case, "3.6.0")
    _launched_by(monkeypatch, launcher, release)
    assert launcher.called == 2 and len(calls) == 2
    if "scratch" in case:
        assert 0xD000 in calls[0][7:9]


# --------------------------------------------------------------------- C launch

_KERNEL_ARGS = list(inspect.signature(triton_postpass._postpass_kernel).parameters)


class _CompiledForC(_Compiled):
    """A CompiledKernel as Triton 3.6 gives it: ``run`` a :class:`CudaLauncher`, the
    ``src.signature`` and ``metadata`` the C launch record is built from."""

    def __init__(self, launcher: CudaLauncher, **meta: Any) -> None:
        super().__init__()
        self.run = launcher  # type: ignore[assignment,method-assign]
        self.function = 0xF00D  # type: ignore[assignment]
        self.src: Any = None
        self.metadata = metadata(**meta)


class _CDriver:
    """The C launch module set up on the fake libcuda (tests/fakes/fake_libcuda.c), as
    under Triton 3.6 with a driver that gives the error word's device address 0xABC0."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, device: int = 0) -> None:
        pytest.importorskip("triton.runtime.build")
        if not c_compiler():
            pytest.skip("needs a C compiler (Triton builds its own launchers with one)")
        self.hooks = _Hooks()
        self.fake, self.module = on_fake_driver(lambda: device, lambda index: 1234, self.hooks)
        self.fake.launches()  # drop earlier tests' records
        monkeypatch.setattr(triton_postpass, "_triton_version", lambda: "3.6.0")
        monkeypatch.setattr(triton_postpass, "_libcuda", _Driver(0))
        self.n_record = 0
        monkeypatch.setattr(triton_postpass, "_c_launch", self.module.launch)
        monkeypatch.setattr(triton_postpass, "_c_lane", self.module.lane)
        monkeypatch.setattr(triton_postpass, "_runtime_knobs", self.hooks)

    def configure(self, n_record: int, status: int = 0, context: bool = True) -> None:
        self.n_record = n_record
        self.fake.configure(n_record, status, int(context))


def _c_setup(
    monkeypatch: pytest.MonkeyPatch, device: int = 0, offset: int = 0, **meta: Any
) -> Tuple[_CDriver, CudaLauncher, _Kernel, Any, tuple]:
    """A plan whose kernel Triton 3.6 compiled, the C launch on the fake driver."""
    launcher = CudaLauncher()
    compiled = _CompiledForC(launcher, **meta)
    kernel = _Kernel(compiled)
    _fake_cuda(monkeypatch, kernel)
    driver = _CDriver(monkeypatch, device)
    plan, tensors = _plan_and_tensors(offset)
    signature = kernel_signature(_KERNEL_ARGS, plan.scalars, plan.meta)
    compiled.src = source(signature)
    # Every parameter the launch passes: the non-constexpr ones and two scratch pointers.
    driver.configure(sum(k != "constexpr" for k in signature.values()) + 2)
    return driver, launcher, kernel, plan, tensors


def test_c_launch_hands_the_kernel_what_tritons_launcher_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once armed, a plan's kernel is launched from C with the parameter values Triton's C
    launcher would pass: the signature's non-constexpr arguments of the Python launch, in
    order, then the two scratch pointers; same grid, block, stream and function."""
    driver, launcher, kernel, plan, tensors = _c_setup(monkeypatch)
    for _ in range(3):
        triton_postpass._run(plan, tensors)
    got = driver.fake.launches()
    assert len(kernel.slow) == 1 and len(got) == 2, "the C launch did not serve the plan"
    assert launcher.called == 0 and launcher.launch.calls == [], "Python launched too"
    assert plan.c is not None and driver.module.launches() >= 2
    # The same plan through the Python direct launch: what Triton's C launch receives.
    monkeypatch.setattr(plan, "c", None)
    triton_postpass._run(plan, tensors)
    (args,) = launcher.launch.calls
    kinds = list(kernel_signature(_KERNEL_ARGS, plan.scalars, plan.meta).values())
    want = [v for kind, v in zip(kinds, args[13:]) if kind != "constexpr"] + [0, 0]
    for launch in got:
        function, gx, gy, gz, bx, by, bz, shared, stream, params, extra = launch
        assert (function, stream) == (0xF00D, 1234) and args[3:5] == (1234, 0xF00D)
        assert (gx, gy, gz) == tuple(args[:3]) and (bx, by, bz, shared) == (128, 1, 1, 0)
        assert list(params) == want and extra is False
    assert list(got[0][9][:7]) == [t.data_ptr() for t in tensors]
    assert got[0][9][7] == 0xABC0  # the pinned error word's device address


@pytest.mark.parametrize("c", [False, True], ids=["python-launch", "c-launch"])
def test_a_hook_that_fails_to_say_its_calls(monkeypatch: pytest.MonkeyPatch, c: bool) -> None:
    """``getattr(hook, "calls", True)``, in Python (``_hooks_clear``) and in C (the C
    launch's own check): a hook without ``calls`` (AttributeError) is a set hook, so the
    direct launch declines; any other exception from it propagates (here a
    BaseException, which no launch fallback catches). The C launch once cleared every
    error there and declined."""
    if c:
        pytest.importorskip("triton.runtime.build")
        driver, _, _, plan, tensors = _c_setup(monkeypatch)
        hooks = driver.hooks
        triton_postpass._run(plan, tensors)  # arms the plan: a launch record

        def clear() -> bool:
            before = len(driver.fake.launches())
            launched = triton_postpass._c_launch(plan.c, *tensors)
            assert len(driver.fake.launches()) == before + bool(launched)
            return bool(launched)

    else:
        hooks = _fake_cuda(monkeypatch, _Kernel(_Compiled()))
        clear = triton_postpass._hooks_clear

    class Stop(BaseException):
        pass

    class NoChain:
        pass

    class Broken:
        @property
        def calls(self) -> list:
            raise Stop("calls")

    assert clear() is True
    hooks.launch_enter_hook = NoChain()
    assert clear() is False
    hooks.launch_enter_hook = Broken()
    with pytest.raises(Stop):
        clear()


def test_c_launch_declines_to_tritons_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the Python direct launch hands to Triton's path, the C launch does too: a
    pointer not 16-byte aligned, a launch hook, another current device. With no current
    CUDA context, Triton's C launcher (which makes one current) launches. Nothing is
    launched from C then, and the call still launches, once."""
    driver, launcher, kernel, plan, tensors = _c_setup(monkeypatch)
    triton_postpass._run(plan, tensors)  # arms the plan
    _, misaligned = _plan_and_tensors(1)

    class Chain:
        calls = (print,)

    cases = [
        ("misaligned", lambda: None, misaligned, "triton"),
        ("enter hook", lambda: setattr(driver.hooks, "launch_enter_hook", Chain()), tensors, "triton"),
        ("exit hook", lambda: setattr(driver.hooks, "launch_exit_hook", Chain()), tensors, "triton"),
        ("no context", lambda: driver.configure(driver.n_record, 0, False), tensors, "launcher"),
    ]  # fmt: skip
    for name, arrange, args, path in cases:
        driver.hooks.launch_enter_hook = driver.hooks.launch_exit_hook = None
        driver.configure(driver.n_record)
        arrange()
        before = len(kernel.slow), len(launcher.launch.calls)
        triton_postpass._run(plan, args)
        assert driver.fake.launches() == [], name
        after = len(kernel.slow), len(launcher.launch.calls)
        assert after == (before[0] + (path == "triton"), before[1] + (path == "launcher")), name
    driver.configure(driver.n_record)
    driver.hooks.launch_enter_hook = type("Empty", (), {"calls": []})()  # 3.6's empty chain
    before = len(kernel.slow), len(launcher.launch.calls)
    triton_postpass._run(plan, tensors)
    assert len(driver.fake.launches()) == 1
    assert (len(kernel.slow), len(launcher.launch.calls)) == before
    other, launcher, kernel, plan, tensors = _c_setup(monkeypatch, device=1)
    for _ in range(2):
        triton_postpass._run(plan, tensors)
    assert other.fake.launches() == [], "launched from C on another device"
    assert len(kernel.slow) == 1 and len(launcher.launch.calls) == 1  # Python's direct launch


def test_failed_c_launch_falls_back_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    driver, _, kernel, plan, tensors = _c_setup(monkeypatch)
    driver.configure(driver.n_record, status=700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        for _ in range(3):
            triton_postpass._run(plan, tensors)
    assert len(kernel.slow) == 3  # every call launched through Triton's path
    assert len(driver.fake.launches()) == 1  # the one that failed
    messages = [r.getMessage() for r in caplog.records]
    assert sum("direct Triton launch failed" in m and "700" in m for m in messages) == 1
    assert triton_postpass._fast_ok is False


def _record_args(n: int = 3) -> Tuple[Any, tuple]:
    """A compiled-kernel stand-in and arguments for :func:`c_launch.record`: seven
    pointers, an error-word address, ``n`` scalars, a constexpr."""
    compiled = _CompiledForC(CudaLauncher(), num_warps=8, shared=1024)
    kinds = ["*bf16"] * 8 + ["i32", "i64", "i1"][:n] + ["constexpr"]
    compiled.src = source({f"a{i}": k for i, k in enumerate(kinds)})
    args = (0,) * 7 + (0xE0, -5, 1 << 40, True)[: 1 + n] + (128,)
    return compiled, args


def test_record_packs_what_the_c_launch_reads() -> None:
    compiled, args = _record_args()
    rec = c_launch.record(compiled, args, (7, 1, 1), 3, words=0xBEEF0)
    assert rec is not None and len(rec) == c_launch.HEADER.size + 8 * 11
    head = c_launch.HEADER.unpack_from(rec)
    assert head == (0xF00D, 7, 1, 1, 256, 1024, 3, 11, 0, 0xBEEF0)
    slots = [
        rec[c_launch.HEADER.size + 8 * i : c_launch.HEADER.size + 8 * (i + 1)] for i in range(11)
    ]
    assert slots[7] == (0xE0).to_bytes(8, "little")
    assert slots[8][:4] == (-5).to_bytes(4, "little", signed=True) and slots[8][4:] == bytes(4)
    assert slots[9] == (1 << 40).to_bytes(8, "little") and slots[10] == b"\x01" + bytes(7)


@pytest.mark.parametrize(
    "change",
    [
        "float", "tensor pointer", "num_ctas", "cooperative", "pdl", "global scratch",
        "profile scratch", "length", "scalar first", "out of range", "tuple",
    ],
)  # fmt: skip
def test_record_refuses_what_it_cannot_launch(change: str) -> None:
    """Anything record() would pack wrongly, or the C launch does not do: no record."""
    compiled, args = _record_args()
    sig = compiled.src.signature
    meta = compiled.metadata
    if change == "float":
        sig["a9"] = "fp32"
    elif change == "tensor pointer":
        args = (*args[:7], torch.zeros(1), *args[8:])
    elif change == "num_ctas":
        meta.num_ctas = 2
    elif change == "cooperative":
        meta.launch_cooperative_grid = True
    elif change == "pdl":
        meta.launch_pdl = True
    elif change == "global scratch":
        meta.global_scratch_size = 64
    elif change == "profile scratch":
        meta.profile_scratch_size = 64
    elif change == "length":
        args = args[:-1]
    elif change == "scalar first":
        sig["a0"], sig["a8"] = "i32", "*bf16"
        args = (5, *args[1:8], 0, *args[9:])
    elif change == "out of range":
        args = (*args[:8], 1 << 31, *args[9:])
    elif change == "tuple":
        sig["a9"] = ("i32", "i32")
    assert c_launch.record(compiled, args, (7, 1, 1), 0) is None


def test_c_launch_module_refuses_malformed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _CDriver(monkeypatch)
    tensors = [torch.zeros(8) for _ in range(7)]
    compiled, args = _record_args()
    rec = c_launch.record(compiled, args, (1, 1, 1), 0)
    assert rec is not None
    with pytest.raises(TypeError):
        driver.module.launch(rec, *tensors[:6])
    with pytest.raises(TypeError):
        driver.module.launch(bytearray(rec), *tensors)
    with pytest.raises(ValueError, match="malformed"):
        driver.module.launch(rec[:-1], *tensors)
    assert driver.fake.launches() == []


class _Sub(torch.Tensor):
    """A tensor subclass: not a plain tensor (the lane sends it to the general path)."""


class _Outputs(NamedTuple):
    dq: Any
    dk: Any
    dv: Any


@pytest.mark.parametrize(
    "change, served",
    [
        ("none", True), ("tuple", True), ("parameter", True), ("dq not fixed", True),
        ("dq shape", False), ("dk strides", False), ("dv dtype", False), ("dv device", False),
        ("dk subclass", False), ("dq subclass", False), ("dq none", False),
        ("two outputs", False), ("dict", False), ("namedtuple", False),
        ("list subclass", False), ("pending", False), ("pending kernel", False),
        ("no words", False),
    ],
)  # fmt: skip
def test_serve_checks_what_the_lane_checks(
    monkeypatch: pytest.MonkeyPatch, change: str, served: bool
) -> None:
    """serve() launches only for outputs whose key equals the recorded one (shape,
    strides, dtype, device index of dQ when fixed, dK, dV; plain tensors; a list or tuple
    of three or more) and no bad offsets pending; else it declines, launching nothing.
    ``served`` is also what the lane's Python checks decide (computed below)."""
    from te_gqa_fix import offset_errors
    from te_gqa_fix.wrapper import _SEQUENCES

    driver = _CDriver(monkeypatch)
    driver.configure(7)
    words = offset_errors.pending_words(torch.device("cpu"))
    compiled, args = _record_args()
    address = 0 if change == "no words" else ctypes.addressof(words)
    rec = c_launch.record(compiled, args, (1, 1, 1), 0, words=address)
    dq, dk, dv = torch.zeros(16, 4, 8), torch.zeros(16, 2, 8), torch.zeros(16, 2, 8)
    cu = torch.zeros(4, dtype=torch.int32)
    key = triton_postpass.output_key(None if change == "dq not fixed" else dq, dk, dv)
    out: Any = [dq, dk, dv, None]
    if change == "tuple":
        out = tuple(out)
    elif change == "parameter":
        out[1] = torch.nn.Parameter(dk)
    elif change in ("dq not fixed", "dq shape"):
        out[0] = dq[:8]
    elif change == "dk strides":
        out[1] = dk.transpose(0, 1).contiguous().transpose(0, 1)
    elif change == "dv dtype":
        out[2] = dv.double()
    elif change == "dv device":
        key = (*key[:11], 0)  # recorded on device 0; these are CPU tensors (-1)
    elif change == "dk subclass":
        out[1] = dk.as_subclass(_Sub)
    elif change == "dq subclass":
        out[0] = dq.as_subclass(_Sub)
    elif change == "dq none":
        out[0] = None
    elif change == "two outputs":
        out = out[:2]
    elif change == "dict":
        out = dict(enumerate(out))
    elif change == "namedtuple":
        out = _Outputs(*out[:3])
    elif change == "list subclass":
        out = type("Outputs", (list,), {})(out)
    try:
        if change.startswith("pending"):
            words[0 if change == "pending kernel" else 1] = 4
        # What the lane's Python decides (wrapper.py, after TE's call).
        python_serves = (
            type(out) in _SEQUENCES and len(out) > 2
            and triton_postpass.output_key(out[0] if len(key) == 12 else None, out[1], out[2])
            == key and not (words[0] | words[1]) and change != "no words"
        )  # fmt: skip
        got = driver.module.serve(rec, key, out, cu, cu, cu, cu)
    finally:
        offset_errors._reset()
    assert python_serves is served, change
    launches = driver.fake.launches()
    assert got is served and len(launches) == int(served), (change, got, launches)
    if served:
        first = out[0] if len(key) == 12 else out[1]
        assert launches[0][9][:3] == tuple(t.data_ptr() for t in (first, out[1], out[2]))
    with pytest.raises(ValueError, match="output key"):
        driver.module.serve(rec, key[:5], out, cu, cu, cu, cu)


def test_c_launch_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(c_launch, "_module", None)
    monkeypatch.setattr(c_launch, "_tried", False)
    monkeypatch.setenv("TE_GQA_FIX_C_LAUNCH", "0")
    assert c_launch.load("libcuda.so.1", lambda: 0, lambda i: 0, None, (torch.Tensor,) * 2) is None
    assert c_launch._tried is False and c_launch._module is None


def test_c_launch_unavailable_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No driver library: None, said once (with why), and never tried again."""
    pytest.importorskip("triton.runtime.build")
    if not c_compiler():
        pytest.skip("needs a C compiler (Triton builds its own launchers with one)")
    monkeypatch.setattr(c_launch, "_module", None)
    monkeypatch.setattr(c_launch, "_tried", False)
    plain = triton_postpass._PLAIN
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(2):
            loaded = c_launch.load("/nonexistent/libcuda.so", lambda: 0, lambda i: 0, None, plain)
            assert loaded is None
    said = [r.getMessage() for r in caplog.records if "from C is unavailable" in r.getMessage()]
    assert len(said) == 1 and "cannot open /nonexistent/libcuda.so" in said[0], said


# --------------------------------------------------------------------- wrapper's launch cache


def _launches_on_cpu(monkeypatch: pytest.MonkeyPatch) -> List[tuple]:
    """Launches on CPU tensors with the launch recorded, not run (no Triton, no CUDA)."""
    runs: List[tuple] = []
    monkeypatch.setattr(triton_postpass, "_handles", lambda *a: True)
    monkeypatch.setattr(triton_postpass, "_run", lambda plan, tensors: runs.append(tensors))
    monkeypatch.setattr(triton_postpass, "_broken", False)
    monkeypatch.setattr(triton_postpass, "_launch_plans", {})
    return runs


def _outputs(rows: int = 20) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    dq = torch.zeros(rows, 4, 4)
    return dq, torch.zeros(rows, 2, 4), torch.zeros(rows, 2, 4), (cu, cu, None, None)


def test_launch_raises_what_an_earlier_call_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan holds its device's host words: bits set there (by the kernel of an earlier
    call) raise before anything is launched, name the argument, and are cleared."""
    from te_gqa_fix import offset_errors

    runs = _launches_on_cpu(monkeypatch)
    launches = triton_postpass.Launches()
    dq, dk, dv, offs = _outputs()
    span = key_span("padding_causal")
    words = offset_errors.pending_words(torch.device("cpu"))
    try:
        assert launches.launch(dq, dk, dv, offs, span) and len(runs) == 1
        words[0] = offset_errors.ARGUMENT_BITS["cu_seqlens_kv"]
        with pytest.raises(offset_errors.OffsetsError, match=r"^cu_seqlens_kv\b"):
            launches.launch(dq, dk, dv, offs, span)
        assert len(runs) == 1, "launched despite the recorded error"
        assert launches.launch(dq, dk, dv, offs, span) and len(runs) == 2  # cleared
        # A new output shape: the recorded error still comes before any other check.
        words[1] = offset_errors.ARGUMENT_BITS["cu_seqlens_q"]
        bad_dq, bad_dk, _, _ = _outputs(rows=12)
        with pytest.raises(offset_errors.OffsetsError, match=r"^cu_seqlens_q\b"):
            launches.launch(bad_dq, bad_dk, dv, offs, span)  # dv has 20 rows, dk 12
        with pytest.raises(ValueError, match="dv: expected the same number of token rows"):
            launches.launch(bad_dq, bad_dk, dv, offs, span)
    finally:
        offset_errors._reset()


def test_launch_sends_tensor_subclasses_to_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything but a plain tensor is declined before a key is built (the PyTorch
    post-pass then runs), and is not cached as a plan."""

    class Sub(torch.Tensor):
        pass

    runs = _launches_on_cpu(monkeypatch)
    launches = triton_postpass.Launches()
    dq, dk, dv, offs = _outputs()
    span = key_span("padding_causal")
    assert launches.launch(dq, dk.as_subclass(Sub), dv, offs, span) is False
    assert runs == [] and launches.plans == {}
    assert launches.launch(dq, dk, dv, offs, span) and len(runs) == 1


class _RecordingLaunches:
    """Stands in for a call shape's Launches: records launches, accepts or declines."""

    def __init__(self, accept: bool) -> None:
        self.accept = accept
        self.calls: List[tuple] = []

    def launch(self, dq: Any, dk: Any, dv: Any, offsets: tuple, span: Any) -> bool:
        self.calls.append((dq, dk, dv))
        return self.accept


@pytest.mark.parametrize(
    "accept, validate, launched, general",
    [
        (True, False, 1, None),  # the common case: the launch cache only
        (False, False, 1, "none"),  # declined: PyTorch, never the kernel again
        (True, True, 0, "launches"),  # deep validation: checks first, then the kernel
    ],
)
def test_apply_routes_between_launch_cache_and_general_post_pass(
    monkeypatch: pytest.MonkeyPatch, accept: bool, validate: bool, launched: int, general: Any
) -> None:
    """The wrapper hands TE's outputs straight to the launch cache; only a declined launch
    or TE_GQA_FIX_VALIDATE goes through zero_dead_rows_prechecked, which then gets the
    cache only under validation (it runs the kernel after its checks)."""
    if validate:
        monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
    seen: List[Any] = []
    monkeypatch.setattr(wrapper_module, "zero_dead_rows_prechecked", lambda *a: seen.append(a[-1]))
    launches = _RecordingLaunches(accept)
    span = key_span("padding_causal")
    plan = wrapper_module._Decision(True, fix_q=False, span=span, launches=launches)
    dq, dk, dv, offs = _outputs()
    wrapper_module._apply(plan, offs, (dq, dk, dv, None))
    assert len(launches.calls) == launched
    if launched:
        assert launches.calls[0] == (None, dk, dv)  # fix_q False: dQ is not touched
    if general is None:
        assert seen == []
    else:
        assert seen == [None if general == "none" else launches]
    assert call_counts()["fixed"] == 1


def test_plan_key_separates_offset_dtypes() -> None:
    dq, dk, dv = torch.zeros(8, 2, 4), torch.zeros(8, 1, 4), torch.zeros(8, 1, 4)
    span = key_span("padding_causal")
    a = triton_postpass._launch_plan(dq, dk, dv, True, 2, span, (torch.int32,) * 4)
    b = triton_postpass._launch_plan(dq, dk, dv, True, 2, span, (torch.int64,) * 4)
    c = triton_postpass._launch_plan(dq, dk, dv, True, 2, span, (torch.int32,) * 4)
    assert a is not b and a is c


# --------------------------------------------------------------------- fast lane


class _Lane:
    """A wrapper whose kernel route runs on CPU tensors with the launch recorded: the
    tensors pretend to be on CUDA device 0 (as benchmarks/host_cpu.py does), Triton's
    kernel and compiled kernel are the recording stand-ins above. ``general`` counts the
    calls that took the general path (its first step, ``_prepare``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, version: str = "2.20", c: bool = False):
        self.c = c
        self.compiled = _CompiledForC(CudaLauncher()) if c else _Compiled()
        self.kernel = _Kernel(self.compiled)
        self.hooks = _fake_cuda(monkeypatch, self.kernel)
        self.driver: Optional[_CDriver] = None
        self.c_log: List[tuple] = []
        if c:  # Triton 3.6: the C launch, on the fake driver
            self.driver = _CDriver(monkeypatch)
            self.hooks = self.driver.hooks
            launch = triton_postpass._c_launch

            def counted(*args: Any) -> Any:  # the C launch reached through _run
                self.through_run += 1
                return launch(*args)

            monkeypatch.setattr(triton_postpass, "_c_launch", counted)
        self.through_run = 0
        self.lanes0 = self.driver.module.lanes() if self.driver is not None else 0
        self.fixed = False
        self.general = 0
        monkeypatch.setattr(wrapper_module, "_device_index", lambda q: 0)
        monkeypatch.setattr(wrapper_module, "cudnn_fixed", lambda index: self.fixed)
        monkeypatch.setattr(triton_postpass, "_available", True)
        monkeypatch.setattr(triton_postpass, "_broken", False)
        monkeypatch.setattr(triton_postpass, "_handles", lambda *a: True)
        make_plan = triton_postpass._make_launch_plan

        def on_device_0(*args: Any) -> Any:
            plan = make_plan(*args)
            plan.device_index = 0
            if self.driver is not None:
                self.compiled.src = source(kernel_signature(_KERNEL_ARGS, plan.scalars, plan.meta))
                self.driver.configure(7)  # the seven tensors' addresses
            return plan

        monkeypatch.setattr(triton_postpass, "_make_launch_plan", on_device_0)
        prepare = wrapper_module._prepare

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.general += 1
            return prepare(*args, **kwargs)

        monkeypatch.setattr(wrapper_module, "_prepare", counting)
        for d in (3, 5):  # the head dims used here: decided, nothing to say
            monkeypatch.setitem(guard._decisions, (0, d, d), None)
        self.fake = FakeTE(version)
        self.wrapped = make_wrapper(self.fake.fn)

    def call(self, ragged: Any = RAGGED, **change: Any) -> Tuple[list, Dict[str, Any]]:
        """One call as TE makes it: every argument by position, new tensors."""
        arguments = call_arguments(self.fake.version, ragged, **change)
        out = self.wrapped(*(arguments[n] for n in self.fake.names))
        return out, arguments

    def warm(self) -> None:
        """Two calls: the first reads the settings, the second is recorded for the lane."""
        for _ in range(2):
            self.call()
        assert self.general == 2

    def c_served(self) -> int:
        """Calls the C lane (c_launch.c's ``lane``) served in this test: 0 without ``c``."""
        return 0 if self.driver is None else self.driver.module.lanes() - self.lanes0

    def direct(self) -> List[tuple]:
        """The seven pointers of every direct launch so far: from C (the fake driver's
        record) with ``c``, else through the recording compiled kernel. With ``c`` no
        direct launch may have gone through Python: the C launch would have been skipped."""
        if self.driver is None:
            return [launch[9:16] for launch in self.compiled.launches]
        self.c_log += [launch[9][:7] for launch in self.driver.fake.launches()]
        assert self.compiled.run.launch.calls == [], "a direct launch skipped the C launch"
        return self.c_log


@pytest.fixture(params=[False, True], ids=["python-launch", "c-launch"])
def lane_c(request: pytest.FixtureRequest) -> bool:
    """The lane tests run twice: launching from Python, and from C (te_gqa_fix.c_launch on
    the fake driver, serve() after TE's call), which must behave the same."""
    if request.param:
        pytest.importorskip("triton.runtime.build")
    return bool(request.param)


def _pointers(out: list, arguments: Dict[str, Any]) -> tuple:
    names = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    return tuple(t.data_ptr() for t in (*out[:3], *(arguments[n] for n in names)))


def test_lane_serves_repeat_calls_with_new_tensors(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool
) -> None:
    """From the third call of a shape on, TE-style calls skip the general path and launch
    directly, on this call's outputs and offsets."""
    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()
    assert len(lane.kernel.slow) == 1 and len(lane.direct()) == 1
    through_run = lane.through_run
    for i in range(3):
        out, arguments = lane.call()
        assert lane.general == 2, f"call {i + 3} took the general path"
        assert lane.direct()[-1] == _pointers(out, arguments)
    # From C: the whole lane, serve() after TE's call, not its Python path into _run.
    assert lane.through_run == through_run and lane.c_served() == (3 if lane_c else 0)
    assert len(lane.kernel.slow) == 1 and len(lane.direct()) == 4
    assert call_counts() == {"calls": 5, "fixed": 5, "skipped": 0, "passthrough": 0, "fast_lane": 3}


@pytest.mark.parametrize("n_positional", [0, 12, 20])
def test_lane_serves_calls_with_keywords(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool, n_positional: int
) -> None:
    """TE's context-parallel call sites pass the first twelve arguments by position and the
    rest by keyword: the same lane, keyed on TE's layout rule (which layout argument was
    given), serves them from the third call on."""
    from fakes.te_outputs import split_call

    lane = _Lane(monkeypatch, c=lane_c)
    for i in range(4):
        arguments = call_arguments("2.20", RAGGED)
        args, kwargs = split_call(lane.fake.names, arguments, n_positional)
        out = lane.wrapped(*args, **kwargs)
        assert lane.general == min(i + 1, 2), f"call {i + 1}"
        assert i == 0 or lane.direct()[-1] == _pointers(out, arguments)
    assert call_counts()["fixed"] == 4
    # With the C module: the third and fourth calls through the C lane (its picker path).
    assert lane.c_served() == (2 if lane_c else 0)


def test_lane_keys_on_which_layout_argument_was_given(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool
) -> None:
    """The wrapper reads ``dqkv_layout`` when the call gives it, else ``qkv_layout``: a
    call that gives ``dqkv_layout`` its default value must not be served by the entry of
    calls that left it out (TE 2.20's default is ``sbh3d``, not THD: nothing to do)."""
    lane = _Lane(monkeypatch, c=lane_c)
    default = inspect.signature(lane.fake.fn).parameters["dqkv_layout"].default
    assert default == "sbh3d"
    for _ in range(3):
        arguments = call_arguments("2.20", RAGGED)
        del arguments["dqkv_layout"]
        lane.wrapped(**arguments)
    assert lane.general == 2 and call_counts()["fixed"] == 3
    arguments = call_arguments("2.20", RAGGED)
    arguments["dqkv_layout"] = default
    launches = len(lane.direct())
    lane.wrapped(**arguments)
    assert lane.general == 3 and len(lane.direct()) == launches
    assert call_counts()["skipped"] == 1


def test_lane_passes_through_on_fixed_cudnn(monkeypatch: pytest.MonkeyPatch, lane_c: bool) -> None:
    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()
    lane.fixed = True
    lane.fake.backend.reset()
    lane.call()
    assert lane.general == 2 and len(lane.direct()) == 1
    assert call_counts()["skipped"] == 1 and lane.c_served() == int(lane_c)
    assert_untouched(lane.fake.backend.outputs)


def test_c_lane_reads_the_cached_cudnn_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``wrapper.cudnn_fixed`` as defined there, the C lane reads the cached
    decision (``guard._fixed``) itself: fixed, it passes through; affected, it serves the
    post-pass; both without calling into Python's lane."""
    lane = _Lane(monkeypatch, c=True)
    monkeypatch.setattr(wrapper_module, "cudnn_fixed", wrapper_module._C_READS[1])
    monkeypatch.setitem(guard._fixed, 0, False)
    lane.warm()
    prepare, lane.general = lane.general, 0
    lane.call()
    assert lane.c_served() == 1 and len(lane.direct()) == 2
    monkeypatch.setitem(guard._fixed, 0, True)
    lane.fake.backend.reset()
    lane.call()
    assert lane.c_served() == 2 and len(lane.direct()) == 2 and lane.general == 0
    assert call_counts() == {
        "calls": prepare + 2, "fixed": prepare + 1, "skipped": 1, "passthrough": 0,
        "fast_lane": 2,
    }  # fmt: skip
    assert_untouched(lane.fake.backend.outputs)


def test_lane_takes_a_cached_none_as_undecided(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool
) -> None:
    """``guard._fixed[device]`` holding None: ``guard.cudnn_fixed`` decides again (here:
    fixed), so both lanes pass through. The C lane once read None as "affected" and
    served the post-pass."""
    lane = _Lane(monkeypatch, c=lane_c)
    monkeypatch.setattr(wrapper_module, "cudnn_fixed", wrapper_module._C_READS[1])
    monkeypatch.setitem(guard._fixed, 0, False)
    lane.warm()
    monkeypatch.setattr(guard, "runtime_facts", lambda index: type("F", (), {"cudnn": None}))
    monkeypatch.setattr(guard, "cudnn_is_fixed", lambda version: True)
    monkeypatch.setitem(guard._fixed, 0, None)
    launches = len(lane.direct())
    lane.fake.backend.reset()
    lane.call()
    assert call_counts()["skipped"] == 1 and len(lane.direct()) == launches
    assert guard._fixed[0] is True and lane.c_served() == 0
    assert_untouched(lane.fake.backend.outputs)


def _shapeless() -> Tuple[torch.Tensor, type]:
    """A nested tensor (an exact torch.Tensor whose ``shape`` raises, as the lane's keys
    read it) and the type of what it raises."""
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert type(nested) is torch.Tensor
    with pytest.raises(Exception) as raised:
        nested.shape  # noqa: B018
    return nested, type(raised.value)


def _te_then(monkeypatch: pytest.MonkeyPatch, then: Callable[[list], None]) -> None:
    """The fake TE's call runs ``then`` on the outputs it made before it returns them:
    Python run inside TE's call, or outputs changed after the lane recorded them."""
    plain = FakeBackend.__call__

    def call(self: FakeBackend, args: Dict[str, Any]) -> list:
        out = plain(self, args)
        then(out)
        return out

    monkeypatch.setattr(FakeBackend, "__call__", call)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("fault", ["getter", "device"])
def test_lane_raises_what_it_raises_in_python(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool, fault: str
) -> None:
    """An exception before TE's call leaves the lane as it leaves the Python lane: the
    same exception (not a SystemError from C calls made with it pending), the call
    counted, TE not called. ``getter``: an offsets tensor whose ``shape`` raises (a
    nested tensor is an exact torch.Tensor); ``device``: a replaced ``_device_index``."""
    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()
    calls, te_calls = call_counts()["calls"], len(lane.fake.backend.calls)
    arguments = call_arguments("2.20", RAGGED)
    if fault == "getter":
        arguments["cu_seqlens_q"], want = _shapeless()
    else:

        def no_device(q: Any) -> int:
            raise RuntimeError("no device here")

        monkeypatch.setattr(wrapper_module, "_device_index", no_device)
        want = RuntimeError
    with pytest.raises(want) as got:
        lane.wrapped(*(arguments[n] for n in lane.fake.names))
    assert type(got.value) is want and not isinstance(got.value, SystemError)
    assert call_counts()["calls"] == calls + 1
    assert len(lane.fake.backend.calls) == te_calls and lane.c_served() == 0


def test_lane_reads_the_cudnn_decisions_the_guard_holds_now(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool
) -> None:
    """``guard._fixed`` rebound (not cleared in place) after the lane was made: both
    lanes read the new table, as ``guard.cudnn_fixed`` does, and pass through."""
    lane = _Lane(monkeypatch, c=lane_c)
    monkeypatch.setattr(wrapper_module, "cudnn_fixed", wrapper_module._C_READS[1])
    monkeypatch.setitem(guard._fixed, 0, False)
    lane.warm()
    monkeypatch.setattr(guard, "_fixed", {0: True})
    lane.fake.backend.reset()
    lane.call()
    assert call_counts()["skipped"] == 1 and lane.c_served() == int(lane_c)
    assert_untouched(lane.fake.backend.outputs)


def test_c_lane_hands_a_failed_launch_to_python(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A launch that fails inside the C lane (after TE's call) is logged once and turns
    the direct launch off, as in Python; the call still gets its post-pass, through
    Triton's own launch, and TE is called once."""
    lane = _Lane(monkeypatch, c=True)
    lane.warm()
    assert lane.driver is not None
    lane.driver.configure(7, status=700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    slow = len(lane.kernel.slow)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        lane.call()
        lane.call()
    assert len(lane.kernel.slow) == slow + 2 and lane.general == 2
    assert len(lane.fake.backend.calls) == 4 and lane.c_served() == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("direct Triton launch failed" in m and "700" in m for m in messages) == 1
    assert triton_postpass._fast_ok is False
    assert call_counts()["fixed"] == 4


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_lane_raises_a_failing_output_getter_and_keeps_the_direct_launch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, lane_c: bool
) -> None:
    """A getter of TE's outputs that raises (a nested tensor as dQ: an exact torch.Tensor
    whose ``shape`` raises) propagates, as the Python lane's ``output_key`` does, outside
    the launch's ``try``: the direct launch stays on and nothing blames it. The C lane
    once handed this to the launch's failure path, turning the direct launch off for the
    process."""
    monkeypatch.setattr(triton_postpass, "_fast_ok", True)
    _reset_log_once()
    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()
    nested, raises = _shapeless()

    def nested_dq(out: list) -> None:
        out[0] = nested

    _te_then(monkeypatch, nested_dq)
    te_calls = len(lane.fake.backend.calls)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        with pytest.raises(raises) as got:
            lane.call()
    assert not isinstance(got.value, SystemError)
    assert len(lane.fake.backend.calls) == te_calls + 1
    assert triton_postpass._fast_ok is True
    assert not [r for r in caplog.records if "launch failed" in r.getMessage()]


@pytest.mark.parametrize("shrink", ["truncated", "cleared"])
def test_lane_counts_with_a_list_shrunk_during_tes_call(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool, shrink: str
) -> None:
    """Python code that runs inside TE's call and shrinks ``wrapper._counts``: both lanes
    raise IndexError when they count the served call. The C lane once read past the end
    of the list (a SystemError, or a crash on a cleared one)."""
    monkeypatch.setattr(wrapper_module, "_counts", list(wrapper_module._counts))
    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()

    def shrinking(out: list) -> None:
        counts = wrapper_module._counts
        if shrink == "truncated":
            del counts[1:]
        else:
            counts.clear()

    _te_then(monkeypatch, shrinking)
    with pytest.raises(IndexError):
        lane.call()


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t, t], 1)[:, 0]


@pytest.mark.parametrize(
    "change",
    ["keywords", "policy", "validate", "shape", "layout", "noncontiguous", "guard", "broken"],
)
def test_lane_steps_aside_for_anything_new(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool, change: str
) -> None:
    """Each of these sends the call through the general path (a given-up kernel: the
    general post-pass after TE's call, checked against the oracle)."""
    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()
    ragged, kw, mask = RAGGED, {}, "padding_causal"
    lane.fake.backend.reset()
    if change == "keywords":
        lane.wrapped(**call_arguments("2.20", RAGGED))
    else:
        if change == "policy":
            monkeypatch.setenv("TE_GQA_FIX", "always")
        elif change == "validate":
            monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
        elif change == "shape":
            ragged = OTHER
        elif change == "layout":
            kw = dict(layout="thd_t2hd")
        elif change == "guard":
            monkeypatch.setitem(guard._decisions, (0, 3, 3), "head dims 3/3: unrepairable")
            monkeypatch.setenv("TE_GQA_FIX_GUARD", "strict")
        elif change == "broken":
            monkeypatch.setattr(triton_postpass, "_broken", True)
        if change == "noncontiguous":
            arguments = call_arguments("2.20", RAGGED)
            arguments["cu_seqlens_q"] = _noncontiguous(arguments["cu_seqlens_q"])
            lane.wrapped(*(arguments[n] for n in lane.fake.names))
        elif change == "guard":
            with pytest.raises(guard.UnrepairableConfiguration):
                lane.call()
            return
        else:
            lane.call(ragged, **kw)
    if change == "broken":  # the kernel was given up: the lane hands TE's outputs to the
        # general post-pass, which runs PyTorch's
        assert lane.general == 2 and len(lane.direct()) == 1
        _check(lane.fake, None, ragged, mask, (-1, -1), None)
    else:
        assert lane.general == 3


def test_lane_follows_setting_changes_both_ways(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool
) -> None:
    """A changed setting clears the lane; set back, it is learned again (two calls)."""
    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()
    monkeypatch.setenv("TE_GQA_FIX", "off")
    lane.fake.backend.reset()
    lane.call()
    assert lane.general == 3 and call_counts()["skipped"] == 1
    assert_untouched(lane.fake.backend.outputs)
    monkeypatch.delenv("TE_GQA_FIX")
    for _ in range(3):
        lane.call()
    assert lane.general == 5  # read the settings, record, then the lane


def test_lane_checks_the_outputs_and_pending_errors(
    monkeypatch: pytest.MonkeyPatch, lane_c: bool
) -> None:
    """After TE's call: outputs of other metadata than recorded go to the launch cache
    (a new plan, Triton's own launch) and are recorded; bad offsets recorded by an
    earlier call raise before anything is launched, then the lane serves again."""
    from te_gqa_fix import offset_errors

    lane = _Lane(monkeypatch, c=lane_c)
    lane.warm()

    def strided_dq(out: list) -> None:
        out[0] = out[0].transpose(0, 1).contiguous().transpose(0, 1)  # same shape, new strides

    _te_then(monkeypatch, strided_dq)
    out, arguments = lane.call()
    assert lane.general == 2  # the inputs are as recorded
    assert len(lane.kernel.slow) == 2, "the new output strides reused the recorded plan"
    out, arguments = lane.call()  # recorded in the step before: the lane, directly
    assert len(lane.kernel.slow) == 2 and lane.direct()[-1] == _pointers(out, arguments)
    direct = len(lane.direct())
    words = offset_errors.pending_words(torch.device("cpu"))
    try:
        words[0] = offset_errors.ARGUMENT_BITS["cu_seqlens_kv"]
        with pytest.raises(offset_errors.OffsetsError, match=r"^cu_seqlens_kv\b"):
            lane.call()
        assert len(lane.direct()) == direct, "launched despite the recorded error"
        lane.call()  # cleared: the lane again
        assert len(lane.direct()) == direct + 1 and lane.general == 2
    finally:
        offset_errors._reset()


# --------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_wrapper_fast_path_no_sync_and_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper's steady state (the fast lane: cached plan, direct launch) syncs
    nothing and replays inside a captured CUDA graph; a fake original stands in for TE
    (no TE needed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    monkeypatch.setenv("TE_GQA_FIX", "always")  # also on a fixed cuDNN
    dev = "cuda"
    rows, h_q, h_kv, d = 2048, 8, 2, 64
    dq = torch.full((rows, h_q, d), float("nan"), device=dev, dtype=torch.bfloat16)
    kv = torch.full((rows, 2, h_kv, d), float("nan"), device=dev, dtype=torch.bfloat16)
    dk, dv = kv[:, 0], kv[:, 1]

    def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                       cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                       qkv_layout="thd_thd_thd", attn_mask_type="padding_causal",
                       window_size=(-1, -1)):  # fmt: skip
        return [dq, dk, dv, None]

    wrapped = make_wrapper(fused_attn_bwd)
    i32 = dict(dtype=torch.int32, device=dev)
    cu_q = torch.tensor([0, 0, 500, 900], **i32)
    cu_kv = torch.tensor([0, 300, 800, 1200], **i32)
    pad = torch.tensor([0, 512, 1024, 1536], **i32)
    q = torch.zeros(rows, h_q, d, device=dev, dtype=torch.bfloat16)
    k = torch.zeros(rows, h_kv, d, device=dev, dtype=torch.bfloat16)
    general: List[int] = []
    prepare = wrapper_module._prepare
    monkeypatch.setattr(wrapper_module, "_prepare", lambda *a: (general.append(1), prepare(*a))[1])

    def call() -> None:  # every argument by position, as TE calls it: the fast lane
        wrapped(512, 512, cu_q, cu_kv, q, k, k, pad, pad, "thd_thd_thd", "padding_causal",
                (-1, -1))  # fmt: skip

    call()
    call()  # the second call takes the direct launch, and is recorded for the lane
    torch.cuda.synchronize()
    plans = [p for p in triton_postpass._launch_plans.values() if p.compiled]
    assert plans, "the direct launch was never armed"
    # Triton 3.5/3.6: the steady state launches from C (te_gqa_fix.c_launch), also
    # under capture; the replay below then checks what the C launch captured.
    from_c = triton_postpass._triton_version().startswith(triton_postpass._C_LAUNCH_RELEASES)
    launched, lanes = c_launch.launch_count(), c_launch.lane_count()
    assert not from_c or any(p.c for p in plans), "no C launch record"
    with no_host_sync():
        call()
    assert len(general) == 2, "the third call did not take the fast lane"
    graph, _ = capture(call)
    assert len(general) == 2, "the captured call did not take the fast lane"
    assert c_launch.launch_count() - launched == (3 if from_c else 0)  # capture calls twice
    # ... and all three through the C lane, which read q's CUDA device itself.
    assert c_launch.lane_count() - lanes == (3 if from_c else 0)
    # TE's context-parallel call sites pass the rest by keyword: the lane's picker path
    # (a new key: the general path once, recording it for the launch already armed).
    lanes = c_launch.lane_count()
    for _ in range(3):
        with no_host_sync():
            wrapped(512, 512, cu_q, cu_kv, q, k, k, cu_seqlens_q_padded=pad,
                    cu_seqlens_kv_padded=pad, qkv_layout="thd_thd_thd",
                    attn_mask_type="padding_causal", window_size=(-1, -1))  # fmt: skip
    assert len(general) == 3, "keyword calls: the general path once, then the fast lane"
    assert c_launch.lane_count() - lanes == (2 if from_c else 0)
    dq.fill_(float("nan"))
    kv.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert bool((dk[:512] == 0).all()) and bool((dv[:512] == 0).all())  # no queries
    assert bool(dk[512:712].isnan().all())  # attended keys untouched
    assert bool((dk[1536:] == 0).all())  # tail
    assert bool((dq[:512] == 0).all()) and bool(dq[512:1012].isnan().all())
