"""The wrapper's decisions that depend on the stack: a fixed cuDNN, and the guard.

The tensors stay on CPU; the wrapper is told they are on CUDA device 0 (``_device_index``)
and the stack facts are the ones :mod:`te_gqa_fix.stack.affected` reads (``runtime_facts``), so
its real rule decides: Hopper with cuDNN < 9.18 is affected; head dim 256 (or q/k 128 with
v 192) is beyond any post-pass there; 9.18 and newer is fixed. The exact fallback is
replaced by a fake (``te_gqa_fix.fallback.decide``/``run``) that records what it was asked.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from fakes.oracle import make_ragged
from fakes.te_outputs import FakeBackend, FakeTE, assert_post_pass, assert_untouched, call_arguments
from te_gqa_fix import fallback
from te_gqa_fix import wrapper as wrapper_module
from te_gqa_fix.stack import affected
from te_gqa_fix.stack.affected import UnrepairableConfiguration
from te_gqa_fix.stack.versions import RuntimeFacts
from te_gqa_fix.wrapper import call_counts, wrapper_for

RAGGED = make_ragged([(3, 5), (0, 4), (4, 0), (2, 2)], gaps_kv=[2, 1, 0, 1], lead_kv=1, tail_kv=2)
HOPPER, AMPERE = (9, 0), (8, 0)
AFFECTED, FIXED = (9, 14, 0), (9, 19, 0)
GQA, MHA = dict(heads_q=4, heads_kv=2), dict(heads_q=2, heads_kv=2)


class Stack:
    """The stack the wrapper sees, and a wrapped fake TE 2.20 (``fake``, ``wrapped``): the
    tensors on CUDA device ``device``, whose facts are ``facts[device]`` (device 0: Hopper
    with the given cuDNN unless told otherwise), ``TE_GQA_FIX_GUARD`` set to ``guard`` (None:
    unset), and the exact fallback replaced by ``exact``, a :class:`FakeFallback` that
    declines with ``declines`` (None: serves)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cudnn: Optional[tuple],
                 capability: Optional[tuple] = HOPPER, guard: Optional[str] = None,
                 declines: Optional[str] = None) -> None:  # fmt: skip
        self.device = 0
        self.facts = {0: RuntimeFacts(capability, cudnn)}  # type: ignore[arg-type]
        monkeypatch.setattr(wrapper_module, "_device_index", lambda q: self.device)
        monkeypatch.setattr(affected, "runtime_facts", lambda index: self.facts[index])
        affected.reset()
        if guard is not None:
            monkeypatch.setenv("TE_GQA_FIX_GUARD", guard)
        self.exact = FakeFallback(monkeypatch, declines)
        self.fake, self.wrapped = FakeTE.with_wrapper("2.20")


def _args(head_dim: int = 256, d_v: Optional[int] = None, heads: Optional[dict] = None,
          **kw: Any) -> Dict[str, Any]:  # fmt: skip
    arguments = call_arguments("2.20", RAGGED, head_dim=head_dim, **(heads or GQA), **kw)
    if d_v is not None:
        arguments["v"] = torch.randn(*arguments["k"].shape[:2], d_v)
    return arguments


def _warnings(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


class FakeFallback:
    """Stands in for :mod:`te_gqa_fix.fallback`'s decision and work: declines with
    ``reason`` (None: serves, returning stale outputs from its own :class:`FakeBackend`).
    ``decided`` holds the facts it was asked about, ``asked`` the calls it served."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reason: Optional[str]) -> None:
        self.reason = reason
        self.backend = FakeBackend(seed=5)
        self.decided: List[Any] = []
        self.asked: List[Dict[str, Any]] = []
        monkeypatch.setattr(fallback, "decide", self.decide)
        monkeypatch.setattr(fallback, "run", self.run)

    def decide(self, facts: Any) -> Any:
        self.decided.append(facts)
        return self.reason or fallback.Recipe(
            (-1, -1), False, True, "thd_thd_thd", False, False, (False, False)
        )

    def run(self, plan: Any, call: Dict[str, Any]) -> list:
        assert self.reason is None and isinstance(plan, fallback.Recipe), plan
        self.asked.append(call)
        return self.backend(dict(call))


# --------------------------------------------------------------------- a fixed cuDNN


def test_auto_passes_through_on_fixed_cudnn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing to repair and nothing to guard: TE's outputs untouched, nothing checked
    (offsets the post-pass would refuse go to TE), no guard even under strict. The device
    is q's, read from a q that is not a plain tensor too (an FP8 input, say), not k's."""

    class OnCuda(torch.Tensor):
        device = torch.device("cuda", 0)

    read_device = wrapper_module._device_index
    stack = Stack(monkeypatch, FIXED, guard="strict")
    monkeypatch.setattr(wrapper_module, "_device_index", read_device)
    fake, wrapped = stack.fake, stack.wrapped
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(3):
            fake.backend.reset()
            arguments = _args(offsets_dtype=torch.int64)
            arguments["q"] = arguments["q"].as_subclass(OnCuda)
            assert wrapped(**arguments) is fake.backend.returned
            assert_untouched(fake.backend.outputs)
    assert _warnings(caplog) == []
    assert call_counts() == {"calls": 3, "fixed": 0, "skipped": 3, "passthrough": 0, "fallback": 0}


@pytest.mark.parametrize(
    ("cudnn", "capability", "env", "head_dim", "heads"),
    [(AFFECTED, HOPPER, {}, 128, GQA), (None, HOPPER, {}, 128, GQA), (FIXED, None, {}, 128, GQA),
     (AFFECTED, AMPERE, {}, 128, GQA), (AFFECTED, HOPPER, {"TE_GQA_FIX_GUARD": "off"}, 256, GQA),
     (FIXED, HOPPER, {"TE_GQA_FIX": "always"}, 8, GQA),
     (FIXED, HOPPER, {"TE_GQA_FIX": "always"}, 8, MHA)],
    ids=["affected", "cudnn-unknown", "gpu-unknown", "ampere", "guard-off-256",
         "always-on-fixed-gqa", "always-on-fixed-mha"],
)  # fmt: skip
def test_post_pass_on_every_call_where_cudnn_is_not_known_fixed_or_always(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cudnn: Optional[tuple],
    capability: Optional[tuple], env: Dict[str, str], head_dim: int, heads: dict,
) -> None:  # fmt: skip
    """Not measured clean (an affected cuDNN, an unknown one, an unknown GPU, a GPU other than
    Hopper), or ``always`` on a fixed cuDNN (issue 26, mutant W08): the post-pass runs on
    every call, not only the first, each checked against the oracle; at a repairable head
    dim, or beyond one with the guard off, there is nothing to say and the fallback is never
    asked."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    stack = Stack(monkeypatch, cudnn, capability)
    fake, wrapped = stack.fake, stack.wrapped
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for i in range(3):
            fake.backend.reset()
            wrapped(**_args(head_dim=head_dim, heads=heads))
            assert_post_pass(fake.backend.outputs, RAGGED, "padding_causal", (-1, -1), None)
            assert call_counts()["fixed"] == i + 1
    assert _warnings(caplog) == [] and stack.exact.asked == []
    assert call_counts() == {"calls": 3, "fixed": 3, "skipped": 0, "passthrough": 0, "fallback": 0}


# --------------------------------------------------------------------- the guard


@pytest.mark.parametrize("heads", [GQA, MHA], ids=["gqa", "mha"])
def test_guard_warn_warns_once_and_keeps_tes_result(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, heads: dict
) -> None:
    """Beyond repair, warn: TE's result on every call (post-pass run where it applies), one
    warning naming the configuration and the remedy, the fallback never asked."""
    stack = Stack(monkeypatch, AFFECTED, guard="warn")
    fake, wrapped = stack.fake, stack.wrapped
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(3):
            fake.backend.reset()
            assert wrapped(**_args(heads=heads)) is fake.backend.returned
            assert len(fake.backend.calls) == 1
            if heads is GQA:  # the post-pass still runs where it applies
                assert_post_pass(fake.backend.outputs, RAGGED, "padding_causal", (-1, -1), None)
            else:
                assert_untouched(fake.backend.outputs)
    (said,) = _warnings(caplog)
    assert "head dim 256" in said and "sm90" in said and "cuDNN 9.14.0" in said, said
    assert "TE_GQA_FIX_CUDNN=auto" in said and stack.exact.asked == [], said
    assert call_counts()["fixed" if heads is GQA else "skipped"] == 3


@pytest.mark.parametrize(
    ("setting", "heads", "n_positional"),
    [(None, GQA, 0), ("fallback", MHA, 12), (" Fallback", GQA, 40), (None, MHA, 40)],
    ids=[
        "default-gqa-keywords",
        "fallback-mha-cp",
        "Fallback-gqa-positional",
        "default-mha-positional",
    ],
)
def test_fallback_replaces_tes_call(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    setting: Optional[str],
    heads: dict,
    n_positional: int,
) -> None:
    """The default guard: where the fallback can serve the call (``decide`` gives a plan), its
    output is returned instead of TE's (TE's original is not called), with the post-pass
    run on it; it is asked with every argument by name, as the caller passed them (the last
    one left out: its default)."""
    from fakes.te_outputs import split_call

    stack = Stack(monkeypatch, AFFECTED, guard=setting)
    fake, wrapped, exact = stack.fake, stack.wrapped, stack.exact
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for i in range(2):
            exact.backend.reset()
            arguments = _args(heads=heads)
            if n_positional == 12:  # an unhashable fact: decided without the cache
                arguments["dropout"] = [0.0]
            args, kwargs = split_call(fake.names[:-1], arguments, n_positional)
            out = wrapped(*args, **kwargs)
            assert out is exact.backend.returned
            assert_post_pass(exact.backend.outputs, RAGGED, "padding_causal", (-1, -1), None)
            call = exact.asked[i]
            assert set(call) == set(fake.names)
            assert all(call[n] is arguments[n] for n in fake.names)
    assert fake.backend.calls == [], "TE's original ran"
    (said,) = _warnings(caplog)
    assert "exactly" in said and "slower" in said and "TE_GQA_FIX_CUDNN=auto" in said, said
    assert call_counts() == {"calls": 2, "fixed": 0, "skipped": 0, "passthrough": 0, "fallback": 2}


@pytest.mark.parametrize("n_shapes", [1, 2])
def test_fallback_that_declines_raises_with_its_reason_and_the_remedy(
    monkeypatch: pytest.MonkeyPatch, n_shapes: int
) -> None:
    """Issue 32: the default guard never returns a gradient it knows is wrong. Where the
    fallback declines, every call raises, naming its reason, the remedy and the way out;
    TE's original never runs; the decision is made once per call shape."""
    reason = "dropout=0.1 (cuDNN's dropout mask cannot be replayed)"
    stack = Stack(monkeypatch, AFFECTED, declines=reason)
    fake, wrapped, exact = stack.fake, stack.wrapped, stack.exact
    for i in range(4):
        ragged = RAGGED if i % n_shapes == 0 else make_ragged([(2, 2), (0, 3)])
        with pytest.raises(UnrepairableConfiguration) as err:
            wrapped(**call_arguments("2.20", ragged, head_dim=256, **GQA))
        said = str(err.value)
        assert "head dim 256" in said and "dropout=0.1" in said, said
        assert "TE_GQA_FIX_CUDNN=auto" in said and "TE_GQA_FIX_GUARD=warn" in said, said
    assert fake.backend.calls == [] and exact.asked == []
    assert len(exact.decided) == n_shapes
    assert call_counts() == {"calls": 4, "fixed": 0, "skipped": 0, "passthrough": 0, "fallback": 0}


def test_fallback_output_not_understood_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fallback output the post-pass does not understand is returned as it is; TE never ran."""
    stack = Stack(monkeypatch, AFFECTED)
    asked = stack.exact.asked
    monkeypatch.setattr(fallback, "run", lambda plan, call: asked.append(call) or {"dq": None})
    assert stack.wrapped(**_args()) == {"dq": None}
    assert len(asked) == 1 and stack.fake.backend.calls == []
    assert call_counts() == {"calls": 1, "fixed": 0, "skipped": 0, "passthrough": 1, "fallback": 0}


def test_guard_setting_change_between_calls_takes_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call shape, the setting changed between calls: each call does what it says."""
    stack = Stack(monkeypatch, AFFECTED)
    for mode in ("warn", "strict", "off", "fallback", "strict"):
        monkeypatch.setenv("TE_GQA_FIX_GUARD", mode)
        if mode == "strict":
            with pytest.raises(UnrepairableConfiguration):
                stack.wrapped(**_args())
        else:
            stack.wrapped(**_args())
    assert len(stack.fake.backend.calls) == 2 and len(stack.exact.asked) == 1
    assert call_counts() == {"calls": 5, "fixed": 2, "skipped": 0, "passthrough": 0, "fallback": 1}


def test_guard_counts_configurations_and_devices(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning per configuration (device, head dims), whatever the call shape; a
    device of another stack is decided on its own facts, also for a cached call shape."""
    stack = Stack(monkeypatch, AFFECTED, guard="warn")
    stack.facts[1] = RuntimeFacts(AMPERE, AFFECTED)
    wrapped = stack.wrapped
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for head_dim, ragged in ((256, RAGGED), (256, RAGGED), (192, RAGGED)):
            wrapped(**call_arguments("2.20", ragged, head_dim=head_dim, **GQA))
        wrapped(**call_arguments("2.20", make_ragged([(2, 2)]), head_dim=256, **GQA))
    said = _warnings(caplog)
    assert len(said) == 2 and "head dim 256" in said[0] and "head dim 192" in said[1], said
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "strict")
    stack.device = 1  # the same call shape on an Ampere GPU: nothing to guard
    wrapped(**_args())
    stack.device = 0
    with pytest.raises(UnrepairableConfiguration):
        wrapped(**_args())


@pytest.mark.parametrize(
    ("d_qk", "d_v", "heads", "said"),
    [
        (192, 128, GQA, None),
        (128, 192, GQA, "head dim 128 (q/k) / 192 (v) on sm90"),
        (128, 128, GQA, None),
        (192, 192, GQA, "head dim 192 on sm90"),
        (256, 256, GQA, "head dim 256 on sm90"),
        (256, 256, MHA, "head dim 256 on sm90"),
    ],
)
def test_guard_strict_reads_the_qk_and_v_head_dims(
    monkeypatch: pytest.MonkeyPatch, d_qk: int, d_v: int, heads: dict, said: Optional[str]
) -> None:
    """The rule is per (q/k head dim, v head dim): 192/128 was measured clean, so the
    post-pass runs. Beyond repair, strict raises on every call (cached call shapes too),
    GQA or MHA, naming the head dims and the GPU, and TE never runs."""
    stack = Stack(monkeypatch, AFFECTED, guard="strict")
    fake, wrapped = stack.fake, stack.wrapped
    if said is None:
        wrapped(**_args(head_dim=d_qk, d_v=d_v, heads=heads))
        assert_post_pass(fake.backend.outputs, RAGGED, "padding_causal", (-1, -1), None)
        return
    for _ in range(3):
        with pytest.raises(UnrepairableConfiguration, match=re.escape(said)):
            wrapped(**_args(head_dim=d_qk, d_v=d_v, heads=heads))
    assert fake.backend.calls == [], "TE ran under strict"


def test_cpu_tensors_are_never_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA device, no cuDNN: the post-pass runs, the guard is never asked."""
    asked: List[Tuple[Any, ...]] = []
    monkeypatch.setattr(affected, "why_unrepairable", lambda *a: asked.append(a))
    monkeypatch.setattr(affected, "cudnn_fixed", lambda *a: asked.append(a))
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "strict")
    fake = FakeTE("2.20")
    wrapper_for(fake.fn)(**_args())
    assert asked == []
    assert_post_pass(fake.backend.outputs, RAGGED, "padding_causal", (-1, -1), None)


@pytest.mark.parametrize("heads", [GQA, MHA], ids=["gqa", "mha"])
def test_fixed_cudnn_still_wrong_at_256_128_goes_to_the_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, heads: dict
) -> None:
    """q/k 256 with v 128 was measured wrong on cuDNN 9.19 too: there the wrapper does not
    pass it through; the fallback serves it, and names the build measured right (9.27)."""
    stack = Stack(monkeypatch, FIXED)
    fake, wrapped, asked = stack.fake, stack.wrapped, stack.exact.asked
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        wrapped(**_args(256, d_v=128, heads=heads))
        wrapped(**_args(256))  # 256/256 on a fixed cuDNN: passed through
    assert len(asked) == 1 and fake.backend.calls and len(fake.backend.calls) == 1
    assert call_counts()["fallback"] == 1 and call_counts()["skipped"] == 1
    (said,) = _warnings(caplog)
    assert "256 (q/k) / 128 (v)" in said and "nvidia-cudnn-cu13>=9.27" in said, said
