"""The wrapper of TE's ``fused_attn_bwd``, call by call.

Fake ``fused_attn_bwd`` functions carry the exact signatures of TE 2.8.0 and 2.20.2
(``fakes/te_signatures.py``) and return ``[dq, dk, dv, extra]`` with bit-exact stale values
in every row (NaN, +-Inf, 1000.0 among them): a row the wrapper fails to zero, or one it
zeroes that it should keep, is visible. The oracle (``fakes/oracle.py``) says from the
mask's definition which rows must be exactly +0.

What is tested: the decision per call shape (pass through, post-pass, the guard's modes
fallback/warn/strict/off), reading TE's arguments by name whatever the release and however
the call site passes them, the counts, what is cached per call shape (and that nothing
stale is reused when one fact changes), settings read on every call, TE's outputs checked
before anything is written, the drop-in ``te_gqa_fix.fused_attn_bwd``, and (on a GPU) no
host sync.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

import te_gqa_fix
from fakes import te_package
from fakes.oracle import SAME_ROWS_OTHER_COUNTS, bits, make_ragged
from fakes.te_outputs import (
    FakeBackend,
    FakeQuantizer,
    FakeTE,
    assert_post_pass,
    assert_untouched,
    call_arguments,
    split_call,
)
from te_gqa_fix import InputError, OffsetsError, UnrepairableConfiguration, postpass
from te_gqa_fix import wrapper as wrapper_module
from te_gqa_fix._te import FallbackArgs
from te_gqa_fix.wrapper import (
    Signature,
    call_counts,
    chain,
    is_wrapper,
    reset_call_counts,
    unwrap,
    wrapper_for,
)

VERSIONS = ("2.8", "2.20")
#: Sequences (lq, lk): ordinary, without queries (the bug), without keys, square, lq > lk,
#: empty; padding after each, rows before the first offset and after the last.
RAGGED = make_ragged(
    [(3, 5), (0, 4), (4, 0), (2, 2), (5, 3), (0, 0)],
    gaps_q=[1, 0, 2, 1, 0, 1],
    gaps_kv=[2, 1, 0, 1, 1, 0],
    lead_q=1,
    lead_kv=2,
    tail_q=2,
    tail_kv=3,
)
#: Another batch: a sequence without queries first, no padded offsets, tail rows.
OTHER = make_ragged([(0, 6), (2, 3), (1, 1)], padded=False, tail_q=1, tail_kv=2)
NO_CHANGE: Dict[str, Any] = {}


def _counts(calls: int, fixed: int = 0, skipped: int = 0, passthrough: int = 0,
            fallback: int = 0) -> Dict[str, int]:  # fmt: skip
    return dict(calls=calls, fixed=fixed, skipped=skipped, passthrough=passthrough,
                fallback=fallback)  # fmt: skip


def _check(fake: FakeTE, ragged: Any = RAGGED, mask: str = "padding_causal",
           window: Any = (-1, -1), brd: Any = None) -> None:  # fmt: skip
    """TE's outputs held to the oracle: dead rows exactly +0, every other row bit for bit."""
    assert_post_pass(fake.backend.outputs, ragged, mask, window, brd)


def _fixed_call(fake: FakeTE, wrapped: Callable, args: Optional[dict] = None, **check: Any) -> Any:
    """One call (RAGGED's by default) on fresh outputs, its rows then held to the oracle."""
    fake.backend.reset()
    out = wrapped(**(args or call_arguments("2.20", RAGGED)))
    assert out is fake.backend.returned, "the wrapper must return TE's own object"
    _check(fake, **check)
    return out


def _te_then(monkeypatch: pytest.MonkeyPatch, then: Callable[[FakeBackend, list], Any]) -> None:
    """Every fake TE returns ``then(backend, outputs)`` instead of its outputs."""
    plain = FakeBackend.__call__
    monkeypatch.setattr(FakeBackend, "__call__", lambda self, args: then(self, plain(self, args)))


def _warnings(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


class _Sub(torch.Tensor):
    """A tensor subclass, as TE's FP8 tensors are (TE zero-fills only some of their rows)."""


# ------------------------------------------------------------------- reading by name


def _n_positional(cut: object, names: List[str]) -> int:
    if cut is None:  # FusedAttnFunc: every argument by position
        return len(names)
    if cut == "cp":  # context_parallel.py: every parameter before cu_seqlens_q_padded
        return names.index("cu_seqlens_q_padded")
    return int(cut)  # type: ignore[call-overload]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("cut", [0, 3, "cp", None], ids=str)
def test_signature_reads_every_argument_by_name(version: str, cut: object) -> None:
    """``Signature.pick`` and ``pick_all`` read each argument te-gqa-fix needs by TE's
    name, positional, keyword or mixed; a name this release lacks reads None;
    ``has_right_bound`` is the release's (2.20 passes a right window bound to cuDNN with
    every mask)."""
    fake = FakeTE(version)
    arguments = call_arguments(version, RAGGED, window_size=(3, 0), bottom_right_diagonal=True)
    arguments["deterministic"] = True
    args, kwargs = split_call(fake.names, arguments, _n_positional(cut, fake.names))
    sig = Signature(fake.fn)
    for picked in (sig.pick(args, kwargs), sig.pick_all(args, kwargs)):
        for name in picked._fields:
            assert getattr(picked, name) is arguments.get(name), name
    assert (picked.dqkv_dtype is None) == (version == "2.20")
    assert (picked.o_format is None) == (version == "2.8")
    assert sig.has_right_bound is (version == "2.20")


@pytest.mark.parametrize("version", VERSIONS)
def test_signature_reads_defaults_for_arguments_left_out(version: str) -> None:
    """TE 2.20's context_parallel.py passes neither ``window_size`` nor
    ``bottom_right_diagonal``, nor ``deterministic``: their defaults are read."""
    fake = FakeTE(version)
    arguments = call_arguments(version, RAGGED, window_size=(3, 0), bottom_right_diagonal=True)
    for name in ("window_size", "bottom_right_diagonal", "deterministic"):
        arguments.pop(name, None)
    names = [n for n in fake.names if n in arguments]
    args, kwargs = split_call(names, arguments, names.index("cu_seqlens_q_padded"))
    picked = Signature(fake.fn).pick_all(args, kwargs)
    assert picked.window_size == (-1, -1) and picked.deterministic is False
    assert picked.bottom_right_diagonal is None and picked.q is arguments["q"]


def test_signature_follows_another_wrapper_and_refuses_star_args() -> None:
    """Another library's ``functools.wraps`` wrapper (``*args, **kwargs``) is read through
    its ``__wrapped__`` chain; a bare ``*args`` signature cannot be read by name."""
    fake = FakeTE("2.20")

    @functools.wraps(fake.fn)
    def profiled(*args: Any, **kwargs: Any) -> Any:
        return fake.fn(*args, **kwargs)

    arguments = call_arguments("2.20", RAGGED)
    args, kwargs = split_call(fake.names, arguments, 12)
    assert Signature(profiled).pick(args, kwargs).cu_seqlens_kv is arguments["cu_seqlens_kv"]
    with pytest.raises(TypeError, match="by name"):
        Signature(lambda *args, **kwargs: None)


# ------------------------------------------------------------------- one call each way

#: (attn_mask_type, window_size, bottom_right_diagonal): chosen so that reading any of the
#: three from the wrong place changes the rows to zero.
MASK_CASES = {
    "padding_causal": ("padding_causal", (-1, -1), None),
    "bottom_right_window": ("padding_causal_bottom_right", (1, 0), None),
    "padding_window_br_flag": ("padding", (2, 0), True),
    "padding_window_tl": ("padding", (0, 1), False),
}


#: (version, layout, mask case, cut): every cut with every mask case, the release and the
#: layout picked from their sum, so that every value of each meets every value of every
#: other (pairwise; deterministic follows the cut).
ROUTES = [
    (VERSIONS[(i + j) % 2], ("thd_thd_thd", "thd_t2hd", "thd_th2d")[(i + j) % 3], case, cut)
    for i, cut in enumerate((0, 3, "cp", None)) for j, case in enumerate(sorted(MASK_CASES))
]  # fmt: skip


@pytest.mark.parametrize("version, layout, case, cut", ROUTES, ids=lambda v: str(v))
def test_wrapper_routes_arguments_and_zeroes_oracle_rows(
    version: str, layout: str, case: str, cut: object
) -> None:
    """TE's function sees exactly what the caller passed; the wrapper returns TE's own
    object with exactly the oracle's rows zeroed (views of a packed buffer included), and
    the extra outputs untouched."""
    mask, window, brd = MASK_CASES[case]
    fake, wrapped = FakeTE.with_wrapper(version)
    arguments = call_arguments(version, RAGGED, layout=layout, attn_mask_type=mask,
                               window_size=window, bottom_right_diagonal=brd)  # fmt: skip
    arguments["deterministic"] = cut in (3, None)  # both ways across the cases
    args, kwargs = split_call(fake.names, arguments, _n_positional(cut, fake.names))
    out = wrapped(*args, **kwargs)
    (seen,) = fake.backend.calls
    assert seen.keys() == arguments.keys()
    assert all(seen[name] is arguments[name] for name in arguments)
    assert out is fake.backend.returned
    _check(fake, RAGGED, mask, window, brd if version == "2.20" else None)  # 2.8: no flag
    after, before = fake.backend.outputs["extra"]
    assert torch.equal(bits(after), bits(before)), "extra outputs must be untouched"
    assert call_counts() == _counts(1, fixed=1)


@pytest.mark.parametrize("version", VERSIONS)
def test_wrapper_is_one_per_function_and_accepts_what_it_accepts(version: str) -> None:
    fake, wrapped = FakeTE.with_wrapper(version)
    assert is_wrapper(wrapped) and not is_wrapper(fake.fn) and unwrap(wrapped) is fake.fn
    assert wrapper_for(wrapped) is wrapped, "wrapping a wrapper must not nest"
    assert wrapper_for(fake.fn) is wrapped, "one wrapper per original"
    assert wrapped.__name__ == "fused_attn_bwd"
    assert inspect.signature(wrapped) == inspect.signature(fake.fn)
    with pytest.raises(TypeError):
        wrapped(*range(3), no_such_argument=1)
    assert fake.backend.calls == []


def test_another_librarys_wrapper_is_wrapped_not_skipped() -> None:
    """``wrapper_for`` a ``functools.wraps`` wrapper of TE's function wraps that wrapper
    (it keeps running); ``unwrap`` strips te-gqa-fix's wrappers only; ``chain`` lists every
    link down to TE's function."""
    fake = FakeTE("2.20")
    ran: List[str] = []

    @functools.wraps(fake.fn)
    def profiled(*args: Any, **kwargs: Any) -> Any:
        ran.append("profiled")
        return fake.fn(*args, **kwargs)

    wrapped = wrapper_for(profiled)
    assert wrapped.__wrapped__ is profiled and unwrap(wrapped) is profiled
    assert chain(wrapped) == [wrapped, profiled, fake.fn]
    _fixed_call(fake, wrapped)
    assert ran == ["profiled"]


@pytest.mark.parametrize("version", VERSIONS)
def test_policy_off_is_a_pure_pass_through(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_GQA_FIX", "off")  # its spellings: tests/test_settings.py
    fake, wrapped = FakeTE.with_wrapper(version)
    # Even metadata the post-pass would refuse (int64 offsets) goes straight to TE.
    arguments = call_arguments(version, RAGGED, offsets_dtype=torch.int64)
    assert wrapped(**arguments) is fake.backend.returned
    assert_untouched(fake.backend.outputs)
    assert fake.backend.calls[0]["cu_seqlens_q"] is arguments["cu_seqlens_q"]
    assert call_counts() == _counts(1, skipped=1)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layout", ["bshd_bshd_bshd", "sbhd_sb2hd", "bs3hd", "thd_bshd_bshd"])
def test_non_thd_layout_untouched(version: str, layout: str) -> None:
    """dK/dV not THD: nothing to do (thd_bshd_bshd's dQ is not damaged either)."""
    fake, wrapped = FakeTE.with_wrapper(version)
    heads = (2, 2) if "3" in layout else (4, 2)
    arguments = call_arguments(version, RAGGED, layout=layout, heads_q=heads[0], heads_kv=heads[1])
    if layout.startswith("thd"):
        arguments["k"] = arguments["v"] = torch.zeros(2, 5, 2, 3)
    assert wrapped(**arguments) is fake.backend.returned
    assert_untouched(fake.backend.outputs)
    assert call_counts() == _counts(1, skipped=1)


def test_dqkv_layout_decides_on_te_2_20() -> None:
    """THD inputs, 4-D gradients requested: the gradients' layout is what matters; packed
    THD gradients of separate THD inputs are zeroed through the views."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    arguments = call_arguments("2.20", RAGGED)
    arguments["dqkv_layout"] = "bshd_bshd_bshd"
    wrapped(**arguments)
    assert_untouched(fake.backend.outputs)
    arguments["dqkv_layout"] = "thd_t2hd"
    _fixed_call(fake, wrapped, arguments)
    assert "dkv" in fake.backend.outputs


def test_which_layout_argument_was_given_decides() -> None:
    """TE 2.20: ``dqkv_layout`` when the call gives it, else ``qkv_layout``. A call that
    gives ``dqkv_layout`` its default (``sbh3d``, not THD) must not reuse the entry of calls
    that left it out: nothing to do there."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for _ in range(2):
        arguments = call_arguments("2.20", RAGGED)
        del arguments["dqkv_layout"]
        _fixed_call(fake, wrapped, arguments)
    fake.backend.reset()
    arguments = call_arguments("2.20", RAGGED)
    arguments["dqkv_layout"] = "sbh3d"
    wrapped(**arguments)
    assert_untouched(fake.backend.outputs)
    assert call_counts() == _counts(3, fixed=2, skipped=1)


@pytest.mark.parametrize("version", VERSIONS)
def test_unknown_layout_passed_through_and_logged_once(
    version: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake, wrapped = FakeTE.with_wrapper(version)
    arguments = call_arguments(version, RAGGED)
    layout_arg = "dqkv_layout" if version == "2.20" else "qkv_layout"
    arguments[layout_arg] = "thd_future_layout"
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(3):
            assert wrapped(**arguments) is fake.backend.returned
            assert_untouched(fake.backend.outputs)
    (said,) = _warnings(caplog)
    assert "thd_future_layout" in said and layout_arg in said, said
    assert not said.startswith("te_gqa_fix"), "the logger's name says it"
    assert call_counts() == _counts(3, passthrough=3)


def test_unbindable_signature_passed_through_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def opaque(*args: Any, **kwargs: Any) -> list:
        calls.append((args, kwargs))
        return ["sentinel"]

    wrapped = wrapper_for(opaque)
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        assert wrapped(1, 2, x=3) == ["sentinel"] and wrapped(4) == ["sentinel"]
    assert calls == [((1, 2), {"x": 3}), ((4,), {})]
    (said,) = _warnings(caplog)
    assert "cannot read the signature" in said, said
    assert call_counts() == _counts(2, passthrough=2)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("with_shape", [True, False], ids=["Float8Tensor", "Float8TensorStorage"])
def test_fp8_outputs_raw_bytes_zeroed(version: str, with_shape: bool) -> None:
    """TE's FP8 gradients: their raw bytes are zeroed (byte 0 is +0 in E4M3 and E5M2)."""
    fake, wrapped = FakeTE.with_wrapper(version)
    quantizer = FakeQuantizer(columnwise=False, with_shape=with_shape)
    out = _fixed_call(fake, wrapped, call_arguments(version, RAGGED, dqkv_quantizer=quantizer))
    for i, name in enumerate(("dq", "dk", "dv")):
        after, _ = fake.backend.outputs[name]
        assert after.dtype == torch.uint8 and out[i]._data is after


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("with_shape", [True, False], ids=["Float8Tensor", "Float8TensorStorage"])
def test_fp8_with_live_transpose_passes_through_with_one_warning(
    version: str, with_shape: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Zeroing the bytes would leave a cached transpose stale: nothing is written."""
    fake, wrapped = FakeTE.with_wrapper(version)
    quantizer = FakeQuantizer(columnwise=True, with_shape=with_shape)
    arguments = call_arguments(version, RAGGED, dqkv_quantizer=quantizer)
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(2):
            assert wrapped(**arguments) is fake.backend.returned
            assert_untouched(fake.backend.outputs)
    (said,) = _warnings(caplog)
    assert "passed through" in said, said


# ------------------------------------------------------------------- self-attention

#: Queries and keys at the same rows: gaps, a leading row, tail rows, a zero-length
#: sequence; and the same sequences back to back (no padded offsets).
SELF = make_ragged([(3, 3), (0, 0), (5, 5), (2, 2)], gaps_q=[1, 0, 2, 1], gaps_kv=[1, 0, 2, 1],
                   lead_q=1, lead_kv=1, tail_q=2, tail_kv=2)  # fmt: skip
SELF_PACKED = make_ragged([(3, 3), (0, 0), (5, 5), (2, 2)], padded=False, tail_q=2, tail_kv=2)


def _one_offsets_tensor(args: Dict[str, Any]) -> None:
    args["cu_seqlens_kv"], args["cu_seqlens_kv_padded"] = (
        args["cu_seqlens_q"], args["cu_seqlens_q_padded"])  # fmt: skip


def _fp32(args: Dict[str, Any]) -> None:
    """One offsets tensor, fp32 tensors (the rule reads q's dtype; ``fake_dtype`` is kept)."""
    _one_offsets_tensor(args)
    args.update({n: args[n].float() for n in ("q", "k", "v", "o", "d_o")})


#: case -> (batch, change to its bf16 GQA call, TE_GQA_FIX, whether the post-pass runs).
SELF_CASES: Dict[str, tuple] = {
    "one offsets tensor": (SELF, _one_offsets_tensor, "auto", False),
    "valid offsets only": (SELF_PACKED, _one_offsets_tensor, "auto", False),
    "valid offsets of two tensors": (SELF_PACKED, lambda a: None, "auto", True),
    "equal values, two tensors": (SELF, lambda a: None, "auto", True),
    "padded offsets of two tensors": (
        SELF, lambda a: a.update(cu_seqlens_kv=a["cu_seqlens_q"]), "auto", True),
    "fp32 (TE zero-fills fp16/bf16 only)": (SELF, _fp32, "auto", True),
    "always": (SELF, _one_offsets_tensor, "always", True),
    "q a tensor subclass (an FP8 tensor's kind)": (
        SELF, lambda a: (_one_offsets_tensor(a), a.update(q=a["q"].as_subclass(_Sub))),
        "auto", True),
}  # fmt: skip


def _self_call(fake: FakeTE, wrapped: Callable, case: str) -> None:
    """One call of ``case``, then its outputs held to what ``SELF_CASES`` says."""
    ragged, change, _, repaired = SELF_CASES[case]
    fake.backend.reset()
    reset_call_counts()
    args = call_arguments("2.20", ragged, dtype=torch.bfloat16)
    change(args)
    wrapped(**args)
    if repaired:
        assert call_counts()["fixed"] == 1, case
        _check(fake, ragged)
    else:
        assert call_counts()["skipped"] == 1, case
        assert_untouched(fake.backend.outputs)


@pytest.mark.parametrize("case", list(SELF_CASES))
def test_one_offsets_tensor_for_queries_and_keys_needs_no_post_pass(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Self-attention through one offsets tensor in fp16/bf16: every key is its own query's
    and TE zero-fills the rest, so TE's output is returned untouched (counted skipped). Any
    other call of the same rows is repaired (in fp32, the padding and tail rows), and so is
    every call under ``always``."""
    monkeypatch.setenv("TE_GQA_FIX", SELF_CASES[case][2])
    _self_call(*FakeTE.with_wrapper("2.20"), case)


def test_the_call_key_tells_self_attention_calls_apart() -> None:
    """One wrapper, calls of one shape in turn: the self-attention decision is not reused
    for a call whose offsets are two tensors, nor for one in fp32 (gradients TE does not
    zero-fill)."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for case in ("one offsets tensor", "padded offsets of two tensors",
                 "equal values, two tensors", "one offsets tensor",
                 "fp32 (TE zero-fills fp16/bf16 only)", "one offsets tensor",
                 "valid offsets only", "valid offsets of two tensors"):  # fmt: skip
        _self_call(fake, wrapped, case)


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right",
                                  "arbitrary"])  # fmt: skip
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (3, 0), (0, 2), (2, 5)])
@pytest.mark.parametrize("brd", [None, True, False])
def test_as_many_queries_as_keys_attend_every_key(mask: str, window: tuple, brd: Any) -> None:
    """What the self-attention pass-through rests on, held to the one statement of the
    attended-key rule: with ``lq == lk`` every key of a sequence with queries is attended."""
    from te_gqa_fix.masks import key_bounds, key_span

    lengths = torch.tensor([0, 1, 2, 7, 40])
    lo, hi = key_bounds(lengths, lengths, key_span(mask, window, brd))
    assert lo.tolist() == [0] * 5 and hi.tolist() == lengths.tolist()


# ------------------------------------------------------------------- one call shape, cached


class _Unhashable(list):
    __hash__ = None  # type: ignore[assignment]


CHANGES: List[Dict[str, Any]] = [
    NO_CHANGE,
    dict(attn_mask_type="padding_causal_bottom_right"),
    dict(attn_mask_type="padding", window_size=(1, 0), bottom_right_diagonal=True),
    dict(attn_mask_type="padding", window_size=[1, 0], bottom_right_diagonal=False),
    dict(attn_mask_type="padding", window_size=(0, 2), bottom_right_diagonal=False),
    dict(layout="thd_t2hd"),
    dict(layout="thd_th2d", attn_mask_type="padding_causal_bottom_right"),
    dict(ragged=OTHER),
    dict(ragged=OTHER, heads_q=6, heads_kv=3, head_dim=5),
    dict(attn_mask_type="padding", window_size=_Unhashable([1, 0])),  # twice, never cached
    dict(attn_mask_type="padding", window_size=_Unhashable([1, 0])),
    dict(attn_mask_type="padding_causal", window_size=None),  # None: unbounded, as (-1, -1)
    NO_CHANGE,
]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_each_call_follows_every_change(version: str, deterministic: bool) -> None:
    """One wrapper, one call after another with the mask, window, diagonal flag, layout,
    batch or shapes changed: each call's rows match the oracle (a stale entry would not).
    A window of a list type without a hash is decided without the cache, still right."""
    fake, wrapped = FakeTE.with_wrapper(version)
    for change in CHANGES:
        args = {"attn_mask_type": "padding_causal", "window_size": (-1, -1), **change}
        ragged = args.pop("ragged", RAGGED)
        brd = args.get("bottom_right_diagonal") if version == "2.20" else None  # 2.8: no flag
        arguments = call_arguments(version, ragged, **args)
        arguments["deterministic"] = deterministic
        window = args["window_size"]
        _fixed_call(fake, wrapped, arguments, ragged=ragged, mask=args["attn_mask_type"],
                    window=window and tuple(window), brd=brd)  # fmt: skip
    assert call_counts() == _counts(len(CHANGES), fixed=len(CHANGES))


@pytest.mark.parametrize("n_positional", [0, 12, 40])
def test_positional_keyword_and_context_parallel_calls_share_nothing_stale(
    n_positional: int,
) -> None:
    """All by keyword, TE's context-parallel shape (twelve by position, the rest by
    keyword) and all by position, three calls each: every call fixed."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for _ in range(3):
        fake.backend.reset()
        args, kwargs = split_call(fake.names, call_arguments("2.20", RAGGED), n_positional)
        assert wrapped(*args, **kwargs) is fake.backend.returned
        _check(fake)
    assert call_counts() == _counts(3, fixed=3)


#: A change to one fact of a good call that makes it bad, one of each kind the call shape is
#: keyed on (an offsets tensor's dtype, length and device, a tensor's rows and device; 2-D
#: tensors, which have no heads to compare), and the argument the InputError names (the
#: messages, and every other bad input: tests/test_checks.py; offsets that cannot be keyed:
#: the test after this one).
BAD: Dict[str, tuple] = {
    "padded dtype": (lambda a: a.update(cu_seqlens_kv_padded=a["cu_seqlens_kv_padded"].long()),
                     "cu_seqlens_kv_padded"),
    "query offsets length alone": (
        lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), "cu_seqlens_kv"),
    "offsets on meta": (lambda a: a.update(cu_seqlens_kv=a["cu_seqlens_kv"].to("meta")),
                        "cu_seqlens_kv"),  # the key tells devices apart, not only CUDA ones
    "v rows": (lambda a: a.update(v=a["v"][:-1]), "v"),
    "k on meta": (lambda a: a.update(k=a["k"].to("meta")), "v"),
    "q and k 2-D, as many rows": (  # no heads to compare: checked, not taken for MHA
        lambda a: a.update(q=a["k"][:, 0], k=a["k"][:, 0], v=a["v"][:, 0]), "k"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_new_call_shape_is_checked_again_and_bad_input_never_cached(case: str) -> None:
    """After a good call of one shape, a call that differs in one fact is checked again:
    the bad one raises an InputError naming the argument, before TE runs, on every try
    (never cached); the good shape still works after it."""
    change, name = BAD[case]
    fake, wrapped = FakeTE.with_wrapper("2.20")
    wrapped(**call_arguments("2.20", RAGGED))
    for _ in range(2):
        bad = call_arguments("2.20", RAGGED)
        change(bad)
        with pytest.raises(InputError, match=rf"^{name}: "):
            wrapped(**bad)
    assert len(fake.backend.calls) == 1, "TE ran with bad input"
    _fixed_call(fake, wrapped)
    assert call_counts()["fixed"] == 2


def test_inputs_that_cannot_be_keyed_are_checked_on_every_call() -> None:
    """Offsets of a tensor subclass cannot be keyed: good calls of them do not let a later
    bad one of the same call shape through unchecked."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for dtype in (torch.int32, torch.int32, torch.int64):
        args = call_arguments("2.20", RAGGED)
        args["cu_seqlens_q_padded"] = args["cu_seqlens_q_padded"].to(dtype).as_subclass(_Sub)
        if dtype == torch.int32:
            _fixed_call(fake, wrapped, args)
            continue
        fake.backend.reset()
        with pytest.raises(InputError, match=r"^cu_seqlens_q_padded: "):
            wrapped(**args)
        assert not fake.backend.calls, "TE ran with bad input"


def test_the_bounded_cache_clears_and_decides_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``_MAX_SHAPES`` call shapes the cache starts over; a shape decided before the
    clear is decided again, still right."""
    monkeypatch.setattr(wrapper_module, "_MAX_SHAPES", 3)
    fake, wrapped = FakeTE.with_wrapper("2.20")
    shapes = [make_ragged([(n, n + 1), (0, 2)], tail_kv=1) for n in (1, 2, 3, 4)]
    for ragged in (*shapes, shapes[0], shapes[3], shapes[1]):
        _fixed_call(fake, wrapped, call_arguments("2.20", ragged), ragged=ragged)
    assert call_counts() == _counts(7, fixed=7)


class _FrozenLaunch:
    """Stands in for a prepared post-pass kernel launch on CPU: like the Triton kernel's,
    it bakes in what it was prepared for (the number of sequences, the gradients' strides)
    and zeroes as those say, whatever tensors it is run on. Reused for other offsets or
    other strides, it zeroes the wrong rows, as the real kernel would."""

    def __init__(self, dq: Any, dk: Any, dv: Any, offsets: tuple, span: Any) -> None:
        self.offsets = offsets[0].numel()
        self.strides = [None if t is None else t.stride() for t in (dq, dk, dv)]
        self.span = span

    def run(self, dq: Any, dk: Any, dv: Any, offsets: tuple) -> None:
        frozen = tuple(None if o is None else o[: self.offsets] for o in offsets)
        views = [None if t is None else t.as_strided(t.shape, s)
                 for t, s in zip((dq, dk, dv), self.strides)]  # fmt: skip
        postpass._zero_with_torch(*views, frozen, self.span)  # type: ignore[arg-type]


@pytest.fixture
def frozen_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU calls get a :class:`_FrozenLaunch` where CUDA calls get a kernel launch."""
    monkeypatch.setattr(postpass, "_no_kernel", None)
    monkeypatch.setattr(postpass, "prepare", _FrozenLaunch)


#: Pairs of batches of one call shape (the same rows) with 3 and 5 sequences, a sequence
#: without queries and tail rows in each: with padded offsets; with valid offsets only (the
#: offsets' length is all that changes); q and kv sharing one offsets tensor (fp32, so the
#: post-pass runs: tail rows).
OTHER_COUNTS = {
    "padded": (SAME_ROWS_OTHER_COUNTS, lambda a: None),
    "valid offsets only": (
        (make_ragged([(3, 5), (0, 4), (4, 4)], padded=False, tail_q=2, tail_kv=2),
         make_ragged([(1, 2), (0, 3), (2, 2), (1, 1), (2, 2)], padded=False, tail_q=3, tail_kv=5)),
        lambda a: None),
    "one offsets tensor": (
        (make_ragged([(3, 3), (0, 0), (4, 4)], padded=False, tail_q=2, tail_kv=2),
         make_ragged([(1, 1), (0, 0), (2, 2), (1, 1), (2, 2)], padded=False, tail_q=3, tail_kv=3)),
        _fp32),
}  # fmt: skip


@pytest.mark.parametrize("batches", list(OTHER_COUNTS))
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_launch_is_never_shared_between_sequence_counts(
    frozen_launches: None, batches: str, deterministic: bool
) -> None:
    """Packed training batches of one token count differ in their number of sequences
    from step to step: calls of one shape whose offsets hold 3, then 5 sequences each get
    the launch prepared for their own count; every call's rows match the oracle."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    (three, five), change = OTHER_COUNTS[batches]
    assert (three.rows_q, three.rows_kv) == (five.rows_q, five.rows_kv)
    for ragged in (three, five, three, five):
        args = call_arguments("2.20", ragged)
        args["deterministic"] = deterministic
        change(args)
        _fixed_call(fake, wrapped, args, ragged=ragged)
    assert call_counts() == _counts(4, fixed=4)


def _restrided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with ``t``'s shape, stored heads-major: other strides, not contiguous."""
    out = torch.empty((t.shape[1], t.shape[0], *t.shape[2:]), dtype=t.dtype).transpose(0, 1)
    return out.copy_(t)


@pytest.mark.parametrize("name", ["dq", "dk", "dv"])
def test_gradients_of_other_strides_get_their_own_launch(
    frozen_launches: None, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """What a launch depends on includes each gradient's strides: the same call shape,
    then TE's gradient as a non-contiguous view of the same shape, then the first again:
    every call's rows exact."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    restride = [False]
    index = ("dq", "dk", "dv").index(name)

    def strided(backend: FakeBackend, out: list) -> list:
        if restride[0]:
            out[index] = _restrided(out[index])
            backend.outputs[name] = (out[index], out[index].clone())
        return out

    _te_then(monkeypatch, strided)
    for restride[0] in (False, True, False, True):
        _fixed_call(fake, wrapped)
        assert fake.backend.outputs[name][0].is_contiguous() is not restride[0]
    assert call_counts() == _counts(4, fixed=4)


# ------------------------------------------------------------------- settings per call


def test_policy_change_between_calls_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, wrapped = FakeTE.with_wrapper("2.20")
    mha = dict(heads_q=2, heads_kv=2)
    wrapped(**call_arguments("2.20", RAGGED, **mha, offsets_dtype=torch.int64))
    assert_untouched(fake.backend.outputs)  # MHA under auto: not even checked
    monkeypatch.setenv("TE_GQA_FIX", "always")
    _fixed_call(fake, wrapped, call_arguments("2.20", RAGGED, **mha))
    monkeypatch.setenv("TE_GQA_FIX", "off")
    fake.backend.reset()
    wrapped(**call_arguments("2.20", RAGGED))
    assert_untouched(fake.backend.outputs)
    assert call_counts() == _counts(3, fixed=1, skipped=2)


def test_validate_change_between_calls_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached call shape still reads TE_GQA_FIX_VALIDATE: turned on, the host check
    names the bad offset values in this call (off, the post-pass's verdict says less)."""
    _, wrapped = FakeTE.with_wrapper("2.20")
    wrapped(**call_arguments("2.20", RAGGED))
    bad = call_arguments("2.20", RAGGED)
    bad["cu_seqlens_kv"][2] = 100  # same metadata, values going back down after it
    with pytest.raises(OffsetsError, match="impossible offsets") as off:
        wrapped(**bad)
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_kv: .* 100 then 9 at index 3") as on:
        wrapped(**bad)
    assert "100" not in str(off.value) and "index" not in str(off.value)
    assert on.type is off.type


# ------------------------------------------------------------------- TE's outputs


def _on_meta(index: int) -> Callable[[list], list]:
    return lambda out: [t.to("meta") if t is out[index] else t for t in out]


#: What TE returns instead of its outputs, and words of the warning that names why. The
#: "after a good call" rows follow a good call of the same shape: outputs of new metadata
#: are checked as on a first call.
ODD_OUTPUTS: Dict[str, tuple] = {
    "dict": (lambda out: dict(enumerate(out)), "returned dict, not (dq, dk, dv, ...)"),
    "two": (lambda out: out[:2], "returned list, not (dq, dk, dv, ...)"),
    "none": (lambda out: None, "returned NoneType"),
    "grads-none": (lambda out: [out[0], None, None], "cannot zero (dk: "),
    "dk-2d": (lambda out: [out[0], out[1].flatten(1), *out[2:]], "cannot zero (dk: "),
    "after a good call: dv rows": (lambda out: [*out[:2], out[2][:-1], *out[3:]], "cannot zero (dv: "),
    "after a good call: dq on meta": (_on_meta(0), "cannot zero (dq: "),
    "after a good call: dv on meta": (_on_meta(2), "cannot zero (dv: "),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ODD_OUTPUTS))
def test_outputs_not_understood_pass_through_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Outputs the post-pass cannot read (or that disagree with each other) are returned
    as TE returned them, untouched, with one warning naming why (TE has run, so there is
    nothing left to refuse)."""
    shaped, words = ODD_OUTPUTS[case]
    fake, wrapped = FakeTE.with_wrapper("2.20")
    if case.startswith("after a good call"):
        _fixed_call(fake, wrapped)
        reset_call_counts()
    got: List[Any] = []
    _te_then(monkeypatch, lambda backend, out: got.append(shaped(out)) or got[-1])
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(3):
            fake.backend.reset()
            assert wrapped(**call_arguments("2.20", RAGGED)) is got[-1]
            assert_untouched(fake.backend.outputs)
    (said,) = _warnings(caplog)
    assert "passed through untouched" in said and words in said, said
    assert not said.startswith("te_gqa_fix")
    assert call_counts() == _counts(3, passthrough=3)


def _overlapping_rows(backend: FakeBackend, out: list) -> list:
    """dK's rows all one row's memory (an expand along tokens)."""
    out[1] = out[1][:1].expand_as(out[1])
    return out


def _rows_share_heads(backend: FakeBackend, out: list) -> list:
    """dV's row r and row r + 1 overlap (a row stride smaller than a row)."""
    t, h, d = out[2].shape
    out[2] = torch.as_strided(backend.outputs["dv"][0], (t, h, d), (d, d, 1))
    return out


def _dk_is_dv(backend: FakeBackend, out: list) -> list:
    out[2] = out[1]
    return out


def _dv_one_row_after_dk(backend: FakeBackend, out: list) -> list:
    """dK and dV views of one buffer, one row apart: zeroing a dead row of dK zeroes a
    row of dV before it."""
    buf = torch.cat([out[1], out[2][-1:]])
    backend.outputs["buf"] = (buf, buf.clone())
    out[1], out[2] = buf[:-1], buf[1:]
    return out


def _dk_inside_dq(backend: FakeBackend, out: list) -> list:
    """dK laid over the start of dQ's memory."""
    out[1] = torch.as_strided(out[0], out[1].shape, out[1].stride())
    return out


SHARED_MEMORY = {
    "dk rows overlap (expand)": _overlapping_rows,
    "dv rows overlap": _rows_share_heads,
    "dk is dv": _dk_is_dv,
    "dk and dv one row apart": _dv_one_row_after_dk,
    "dk inside dq": _dk_inside_dq,
}


@pytest.mark.parametrize("case", list(SHARED_MEMORY))
def test_outputs_sharing_memory_are_not_zeroed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """TE's gradients whose rows overlap, or dQ/dK/dV sharing memory: zeroing one dead row
    would zero a row that must be kept. Nothing is written, the call counts as passed
    through, and one WARNING says why (whatever the number of calls)."""
    _te_then(monkeypatch, SHARED_MEMORY[case])
    fake, wrapped = FakeTE.with_wrapper("2.20")
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(3):
            fake.backend.reset()
            wrapped(**call_arguments("2.20", RAGGED))
            assert_untouched(fake.backend.outputs)
    (said,) = _warnings(caplog)
    assert "passed through untouched" in said and "memory" in said, said
    assert call_counts() == _counts(3, passthrough=3)


# ------------------------------------------------------------------- the guard

HOPPER, AMPERE = (9, 0), (8, 0)
AFFECTED, FIXED = (9, 14, 0), (9, 19, 0)
GQA, MHA = dict(heads_q=4, heads_kv=2), dict(heads_q=2, heads_kv=2)
GUARDED = make_ragged([(3, 5), (0, 4), (4, 0), (2, 2)], gaps_kv=[2, 1, 0, 1], lead_kv=1, tail_kv=2)


class FakeFallback:
    """Stands in for :mod:`te_gqa_fix.fallback`'s decision and work: declines with
    ``reason`` (None: serves, returning stale outputs from its own :class:`FakeBackend`).
    ``asked`` holds the arguments of the calls it served."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reason: Optional[str]) -> None:
        from te_gqa_fix import fallback

        self.reason = reason
        self.backend = FakeBackend(seed=5)
        self.asked: List[FallbackArgs] = []
        self.recipe = fallback.Recipe((-1, -1), False, True, "thd_thd_thd", False, False,
                                      (False, False))  # fmt: skip
        monkeypatch.setattr(fallback, "decide", lambda a, has_right_bound=True: reason or self.recipe)  # fmt: skip
        monkeypatch.setattr(fallback, "run", self.run)

    def run(self, recipe: Any, a: FallbackArgs) -> list:
        assert self.reason is None and recipe is self.recipe, recipe
        self.asked.append(a)
        call = {k: v for k, v in a._asdict().items() if v is not None or k != "dqkv_layout"}
        return self.backend(call)


class Stack:
    """The stack the wrapper sees for CPU tensors standing in for CUDA ones on device
    ``device``: ``facts[device]`` (compute capability, the cuDNN TE runs) through the
    wrapper's per-device cache; ``TE_GQA_FIX_GUARD`` set to ``guard`` (None: unset); the
    exact fallback replaced by ``exact`` (a :class:`FakeFallback`); a wrapped fake TE 2.20
    (``fake``, ``wrapped``). On CUDA the call key holds q's device index: the stand-in's
    index is added to it here."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cudnn: Optional[tuple],
                 capability: Optional[tuple] = HOPPER, guard: Optional[str] = None,
                 declines: Optional[str] = None) -> None:  # fmt: skip
        self.device = 0
        self.facts = wrapper_module._stack  # a fresh dict per test (conftest)
        self.facts[0] = (capability, cudnn)
        call_key = wrapper_module._call_key

        def on_device(*args: Any) -> Optional[tuple]:
            key = call_key(*args)
            return None if key is None else (self.device, key)

        monkeypatch.setattr(wrapper_module, "_device_index", lambda q: self.device)
        monkeypatch.setattr(wrapper_module, "_call_key", on_device)
        if guard is not None:
            monkeypatch.setenv("TE_GQA_FIX_GUARD", guard)
        self.exact = FakeFallback(monkeypatch, declines)
        self.fake, self.wrapped = FakeTE.with_wrapper("2.20")


def _args(head_dim: int = 256, d_v: Optional[int] = None, heads: Optional[dict] = None,
          ragged: Any = GUARDED, **kw: Any) -> Dict[str, Any]:  # fmt: skip
    arguments = call_arguments("2.20", ragged, head_dim=head_dim, **(heads or GQA), **kw)
    if d_v is not None:
        arguments["v"] = torch.randn(*arguments["k"].shape[:2], d_v)
    return arguments


def _guarded_check(backend: FakeBackend) -> None:
    assert_post_pass(backend.outputs, GUARDED, "padding_causal", (-1, -1), None)


def test_auto_passes_through_on_a_cudnn_measured_right(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing to repair and nothing to guard: TE's outputs untouched, nothing checked
    (offsets the post-pass would refuse go to TE), no guard even under strict. The device
    is q's, read from a q that is not a plain tensor too (an FP8 input, say)."""

    class OnCuda(torch.Tensor):
        device = torch.device("cuda", 0)

    wrapper_module._stack[0] = (HOPPER, FIXED)  # device 0's facts, read once
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "strict")
    fake, wrapped = FakeTE.with_wrapper("2.20")
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(3):
            fake.backend.reset()
            arguments = _args(offsets_dtype=torch.int64)
            arguments["q"] = arguments["q"].as_subclass(OnCuda)
            assert wrapped(**arguments) is fake.backend.returned
            assert_untouched(fake.backend.outputs)
    assert _warnings(caplog) == []
    assert call_counts() == _counts(3, skipped=3)


@pytest.mark.parametrize(
    ("cudnn", "capability", "env", "head_dim", "heads"),
    [(AFFECTED, HOPPER, {}, 128, GQA), (None, HOPPER, {}, 128, GQA), (FIXED, None, {}, 128, GQA),
     (AFFECTED, AMPERE, {}, 128, GQA), (AFFECTED, HOPPER, {"TE_GQA_FIX_GUARD": "off"}, 256, GQA),
     ((9, 18, 0), HOPPER, {}, 128, GQA), ((9, 29, 0), HOPPER, {}, 256, GQA),
     (FIXED, HOPPER, {"TE_GQA_FIX": "always"}, 8, GQA),
     (FIXED, HOPPER, {"TE_GQA_FIX": "always"}, 8, MHA)],
    ids=["affected", "cudnn-unknown", "gpu-unknown", "ampere", "guard-off-256",
         "unmeasured-9.18", "unmeasured-newer-9.29", "always-on-fixed-gqa", "always-on-fixed-mha"],
)  # fmt: skip
def test_post_pass_on_every_call_where_no_measurement_says_right(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cudnn: Optional[tuple],
    capability: Optional[tuple], env: Dict[str, str], head_dim: int, heads: dict,
) -> None:  # fmt: skip
    """Not measured right (an affected cuDNN, an unknown one, an unmeasured one, older or
    newer than the measured builds, an unknown GPU, a GPU other than Hopper), or
    ``always`` on a measured-right cuDNN: the post-pass runs on every call, each held to
    the oracle; at a repairable head dim, or beyond one with the guard off, there is
    nothing to say and the fallback is never asked."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    stack = Stack(monkeypatch, cudnn, capability)
    fake, wrapped = stack.fake, stack.wrapped
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for i in range(3):
            fake.backend.reset()
            wrapped(**_args(head_dim=head_dim, heads=heads))
            _guarded_check(fake.backend)
            assert call_counts()["fixed"] == i + 1
    assert _warnings(caplog) == [] and stack.exact.asked == []
    assert call_counts() == _counts(3, fixed=3)


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
                _guarded_check(fake.backend)
            else:
                assert_untouched(fake.backend.outputs)
    (said,) = _warnings(caplog)
    assert "head dim 256" in said and "sm90" in said and "cuDNN 9.14.0" in said, said
    assert "TE_GQA_FIX_CUDNN=auto" in said and "TE_GQA_FIX_GUARD=warn" in said, said
    assert stack.exact.asked == [] and not said.startswith("te_gqa_fix")
    assert call_counts() == _counts(3, **{"fixed" if heads is GQA else "skipped": 3})


@pytest.mark.parametrize(
    ("setting", "heads", "n_positional", "deterministic"),
    [(None, GQA, 0, False), ("fallback", MHA, 12, True), (" Fallback", GQA, 40, True),
     (None, MHA, 40, False)],
    ids=["default-gqa-keywords", "fallback-mha-cp", "Fallback-gqa-positional",
         "default-mha-positional"],
)  # fmt: skip
def test_fallback_replaces_tes_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, setting: Optional[str],
    heads: dict, n_positional: int, deterministic: bool,
) -> None:  # fmt: skip
    """The default guard: where the fallback can serve the call, its output is returned
    instead of TE's (TE's function never runs), with the post-pass run on it; it gets the
    caller's arguments by name, however they were passed (the last one left out: its
    default)."""
    stack = Stack(monkeypatch, AFFECTED, guard=setting)
    fake, wrapped, exact = stack.fake, stack.wrapped, stack.exact
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for i in range(2):
            exact.backend.reset()
            arguments = _args(heads=heads)
            arguments["deterministic"] = deterministic
            if n_positional == 12:  # an unhashable fact: decided without the cache
                arguments["dropout"] = [0.0]
            args, kwargs = split_call(fake.names[:-1], arguments, n_positional)
            assert wrapped(*args, **kwargs) is exact.backend.returned
            _guarded_check(exact.backend)
            picked = exact.asked[i]
            assert all(
                getattr(picked, n) is arguments[n] for n in FallbackArgs._fields if n in arguments
            )
    assert fake.backend.calls == [], "TE's function ran"
    (said,) = _warnings(caplog)
    assert "exactly" in said and "slower" in said and "TE_GQA_FIX_CUDNN=auto" in said, said
    assert call_counts() == _counts(2, fallback=2)


@pytest.mark.parametrize("n_shapes", [1, 2])
def test_fallback_that_declines_raises_with_its_reason_and_the_remedy(
    monkeypatch: pytest.MonkeyPatch, n_shapes: int
) -> None:
    """The default guard never returns a gradient it knows is wrong. Where the fallback
    declines, every call raises, naming its reason, the remedy and the way out; TE's
    function never runs."""
    reason = "dropout=0.1 (cuDNN's dropout mask cannot be replayed)"
    stack = Stack(monkeypatch, AFFECTED, declines=reason)
    for i in range(4):
        ragged = GUARDED if i % n_shapes == 0 else make_ragged([(2, 2), (0, 3)])
        with pytest.raises(UnrepairableConfiguration) as err:
            stack.wrapped(**_args(ragged=ragged))
        said = str(err.value)
        assert "head dim 256" in said and "dropout=0.1" in said, said
        assert "TE_GQA_FIX_CUDNN=auto" in said and "TE_GQA_FIX_GUARD=warn" in said, said
    assert stack.fake.backend.calls == [] and stack.exact.asked == []
    assert call_counts() == _counts(4)


def test_fallback_output_not_understood_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fallback output the post-pass does not understand is returned as it is; TE never ran."""
    from te_gqa_fix import fallback

    stack = Stack(monkeypatch, AFFECTED)
    asked = stack.exact.asked
    monkeypatch.setattr(fallback, "run", lambda recipe, a: asked.append(a) or {"dq": None})
    assert stack.wrapped(**_args()) == {"dq": None}
    assert len(asked) == 1 and stack.fake.backend.calls == []
    assert call_counts() == _counts(1, passthrough=1)


def test_guard_setting_change_between_calls_takes_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call shape, the setting changed between calls: each call does what it says."""
    stack = Stack(monkeypatch, AFFECTED)
    for mode in ("warn", "strict", "off", "fallback", "strict"):
        monkeypatch.setenv("TE_GQA_FIX_GUARD", mode)
        if mode == "strict":
            with pytest.raises(UnrepairableConfiguration, match="TE_GQA_FIX_GUARD=strict"):
                stack.wrapped(**_args())
        else:
            stack.wrapped(**_args())
    assert len(stack.fake.backend.calls) == 2 and len(stack.exact.asked) == 1
    assert call_counts() == _counts(5, fixed=2, fallback=1)


def test_guard_warns_per_configuration_and_device(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning per configuration (head dims on a stack), whatever the call shape; a
    device of another stack is decided on its own facts."""
    stack = Stack(monkeypatch, AFFECTED, guard="warn")
    stack.facts[1] = (AMPERE, AFFECTED)
    wrapped = stack.wrapped
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for head_dim in (256, 256, 192):
            wrapped(**_args(head_dim=head_dim))
        wrapped(**_args(ragged=make_ragged([(2, 2)])))
    said = _warnings(caplog)
    assert len(said) == 2 and "head dim 256" in said[0] and "head dim 192" in said[1], said
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "strict")
    stack.device = 1  # the same call shape on an Ampere GPU: nothing to guard
    stack.fake.backend.reset()
    wrapped(**_args())
    _guarded_check(stack.fake.backend)
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
    """The rule is per (q/k head dim, v head dim): 192/128 was measured right on 9.14's
    live rows, so the post-pass runs. Beyond repair, strict raises on every call (cached
    call shapes too), GQA or MHA, naming the head dims and the GPU, and TE never runs."""
    stack = Stack(monkeypatch, AFFECTED, guard="strict")
    fake, wrapped = stack.fake, stack.wrapped
    if said is None:
        wrapped(**_args(head_dim=d_qk, d_v=d_v, heads=heads))
        _guarded_check(fake.backend)
        return
    for _ in range(3):
        with pytest.raises(UnrepairableConfiguration, match=re.escape(said)):
            wrapped(**_args(head_dim=d_qk, d_v=d_v, heads=heads))
    assert fake.backend.calls == [], "TE ran under strict"


def test_cpu_tensors_are_never_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA device, no cuDNN, no GPU read: the post-pass runs, strict raises nothing."""

    def no_gpu(*args: Any) -> None:
        raise AssertionError("a CPU call read a GPU's capability")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    monkeypatch.setenv("TE_GQA_FIX_GUARD", "strict")
    fake, wrapped = FakeTE.with_wrapper("2.20")
    wrapped(**_args())
    _guarded_check(fake.backend)


@pytest.mark.parametrize("heads", [GQA, MHA], ids=["gqa", "mha"])
def test_measured_right_cudnn_still_wrong_at_256_128_goes_to_the_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, heads: dict
) -> None:
    """q/k 256 with v 128 was measured wrong on cuDNN 9.19 too: there the wrapper does not
    pass it through; the fallback serves it, and names the newest build measured right there
    (9.28.1)."""
    stack = Stack(monkeypatch, FIXED)
    fake, wrapped, asked = stack.fake, stack.wrapped, stack.exact.asked
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        wrapped(**_args(256, d_v=128, heads=heads))
        wrapped(**_args(256))  # 256/256 on 9.19: passed through
    assert len(asked) == 1 and len(fake.backend.calls) == 1
    assert call_counts() == _counts(2, skipped=1, fallback=1)
    (said,) = _warnings(caplog)
    assert "256 (q/k) / 128 (v)" in said and "nvidia-cudnn-cu13>=9.28" in said, said


@pytest.fixture(params=["raises", "missing"])
def cudnn_unreadable(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """TE imported on a Hopper GPU (device 0 stands in for CPU tensors), but the cuDNN it
    runs cannot be read: its ``get_cudnn_version`` raises, or TE has none."""
    utils = types.ModuleType("transformer_engine.pytorch.utils")
    if request.param == "raises":

        def get_cudnn_version() -> tuple:
            raise RuntimeError("cudnnGetVersion: undefined symbol")

        utils.get_cudnn_version = get_cudnn_version  # type: ignore[attr-defined]
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.utils", utils)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: HOPPER)
    monkeypatch.setattr(wrapper_module, "_device_index", lambda q: 0)


@pytest.mark.parametrize(
    ("d_qk", "d_v", "guard", "does"),
    [(256, 256, None, "fallback"), (256, 256, "strict", "raise"), (160, 160, "strict", "raise"),
     (128, 128, "strict", "post-pass"), (192, 128, "strict", "post-pass")],
)  # fmt: skip
def test_an_unreadable_cudnn_on_hopper_is_judged_as_the_oldest_measured(
    cudnn_unreadable: None, monkeypatch: pytest.MonkeyPatch, d_qk: int, d_v: int,
    guard: Optional[str], does: str,
) -> None:  # fmt: skip
    """Unknown is not right: on Hopper a cuDNN whose version TE cannot report is judged as
    9.14, the oldest measured build. Above 128 (but 192/128, measured right there) its live
    rows are wrong: the fallback serves the call, strict raises; never the post-pass alone.
    Up to 128 the post-pass repairs TE's result."""
    if guard is not None:
        monkeypatch.setenv("TE_GQA_FIX_GUARD", guard)
    exact = FakeFallback(monkeypatch, None)
    fake, wrapped = FakeTE.with_wrapper("2.20")
    te_ran = 0
    for _ in range(2):
        fake.backend.reset()
        exact.backend.reset()
        if does == "raise":
            with pytest.raises(UnrepairableConfiguration, match=r"oldest measured build, 9\.14\.0"):
                wrapped(**_args(head_dim=d_qk, d_v=d_v))
        else:
            wrapped(**_args(head_dim=d_qk, d_v=d_v))
            _guarded_check(exact.backend if does == "fallback" else fake.backend)
        te_ran += len(fake.backend.calls)
    assert te_ran == (2 if does == "post-pass" else 0)
    expected = {"fallback": _counts(2, fallback=2), "raise": _counts(2),
                "post-pass": _counts(2, fixed=2)}  # fmt: skip
    assert call_counts() == expected[does]


def test_a_fallback_recipe_is_not_reused_for_other_kv_dtypes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The exact fallback declines k and v of another dtype than q's: a call shape it served
    in bf16 does not reuse that recipe for fp16 k and v; it raises, naming why, and the
    fallback never runs on them."""
    from te_gqa_fix import fallback

    decide = fallback.decide
    stack = Stack(monkeypatch, AFFECTED)
    monkeypatch.setattr(fallback, "decide", decide)  # the real decision,
    monkeypatch.setattr(fallback, "_device_reason", lambda dtype, device: None)  # as on CUDA
    monkeypatch.setattr(fallback, "run", lambda recipe, a: stack.exact.run(stack.exact.recipe, a))
    stack.wrapped(**_args(dtype=torch.bfloat16))
    _guarded_check(stack.exact.backend)
    other = _args(dtype=torch.bfloat16)
    other["k"], other["v"] = other["k"].half(), other["v"].half()
    for _ in range(2):
        with pytest.raises(UnrepairableConfiguration, match="k differs from q in dtype"):
            stack.wrapped(**other)
    assert len(stack.exact.asked) == 1 and stack.fake.backend.calls == []


# ------------------------------------------------------------------- the drop-in


def test_drop_in_calls_the_installed_te_through_one_wrapper(fake_te: Path) -> None:
    """``te_gqa_fix.fused_attn_bwd`` calls TE's function through the wrapper, by keyword or
    by position; after install() it is the very wrapper TE's module holds (one post-pass,
    one count per call); when TE's module holds another function, it calls that one."""
    importlib.import_module("transformer_engine.pytorch")
    fused_attn = sys.modules[te_package.DEFINING]
    original = fused_attn.fused_attn_bwd
    backend = te_package.BACKEND

    def drop_in(*args: Any, **kwargs: Any) -> None:
        backend.reset()
        assert te_gqa_fix.fused_attn_bwd(*args, **kwargs) is backend.returned
        assert_post_pass(backend.outputs, RAGGED, "padding_causal", (-1, -1), None)

    arguments = call_arguments("2.20", RAGGED, backend=te_package.MUST_BE_PATCHED)
    drop_in(**arguments)
    drop_in(*[arguments[n] for n in inspect.signature(original).parameters])
    te_gqa_fix.install()
    assert fused_attn.fused_attn_bwd is wrapper_for(original)
    drop_in(**arguments)
    assert call_counts() == _counts(3, fixed=3) and te_package.DIRECT_CALLERS == []
    other = FakeTE("2.20")
    fused_attn.fused_attn_bwd = other.fn  # a reload, or another library's replacement
    assert te_gqa_fix.fused_attn_bwd(**arguments) is other.backend.returned
    assert_post_pass(other.backend.outputs, RAGGED, "padding_causal", (-1, -1), None)


# ------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_wrapper_no_sync_and_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper's steady state (a cached call shape and launch) syncs nothing and
    replays inside a captured CUDA graph, positional and context-parallel calls alike; a
    stub of TE's signature stands in for TE (no TE needed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fakes.cuda_checks import capture, no_host_sync

    monkeypatch.setenv("TE_GQA_FIX", "always")  # also on a cuDNN measured right
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

    wrapped = wrapper_for(fused_attn_bwd)
    i32 = dict(dtype=torch.int32, device=dev)
    cu_q = torch.tensor([0, 0, 500, 900], **i32)
    cu_kv = torch.tensor([0, 300, 800, 1200], **i32)
    pad = torch.tensor([0, 512, 1024, 1536], **i32)
    q = torch.zeros(rows, h_q, d, device=dev, dtype=torch.bfloat16)
    k = torch.zeros(rows, h_kv, d, device=dev, dtype=torch.bfloat16)

    def positional() -> None:
        wrapped(512, 512, cu_q, cu_kv, q, k, k, pad, pad, "thd_thd_thd", "padding_causal",
                (-1, -1))  # fmt: skip

    def context_parallel() -> None:
        wrapped(512, 512, cu_q, cu_kv, q, k, k, cu_seqlens_q_padded=pad,
                cu_seqlens_kv_padded=pad, qkv_layout="thd_thd_thd",
                attn_mask_type="padding_causal", window_size=(-1, -1))  # fmt: skip

    for call in (positional, context_parallel):
        call()  # decides, checks and prepares (Triton compiles here)
        torch.cuda.synchronize()
        with no_host_sync():
            call()
        graph, _ = capture(call)
        dq.fill_(float("nan"))
        kv.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert bool((dk[:512] == 0).all()) and bool((dv[:512] == 0).all())  # no queries
        assert bool(dk[512:1012].isnan().all())  # attended keys untouched
        assert bool((dk[1012:1024] == 0).all())  # padding
        assert bool((dk[1536:] == 0).all())  # tail
        assert bool((dq[:512] == 0).all()) and bool(dq[512:1012].isnan().all())
    assert call_counts() == _counts(8, fixed=8)
