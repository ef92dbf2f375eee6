"""The wrapper's cache (issue 24): one entry per call shape, keyed by ``_call_key``.

A call shape is decided and its metadata checked once; a call that differs in any fact the
decision reads is decided and checked again; bad input raises before TE runs and is never
cached; settings are read on every call; outputs of new metadata are checked and planned
again. No timing here: benchmarks/ measures the host cost.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from fakes.cuda_checks import capture, no_host_sync
from fakes.oracle import SAME_ROWS_OTHER_COUNTS, make_ragged
from fakes.te_outputs import (
    FakeBackend,
    FakeTE,
    assert_post_pass,
    assert_untouched,
    call_arguments,
    split_call,
)
from te_gqa_fix import postpass, validation
from te_gqa_fix import wrapper as wrapper_module
from te_gqa_fix.wrapper import _Signature, call_counts, reset_call_counts, wrapper_for

RAGGED = make_ragged([(3, 5), (0, 4), (4, 0), (2, 2), (5, 3)], gaps_q=[1, 0, 2, 1, 0],
                     gaps_kv=[2, 1, 0, 1, 1], lead_q=1, lead_kv=2, tail_q=2, tail_kv=3)  # fmt: skip
OTHER = make_ragged([(0, 6), (2, 3), (1, 1)], gaps_kv=[1, 0, 2], lead_kv=1, tail_kv=2)


class _Sub(torch.Tensor):
    """A tensor subclass, as TE's FP8 tensors are (TE zero-fills only some of their rows)."""


def _te_then(monkeypatch: pytest.MonkeyPatch, then: Callable[[FakeBackend, list], Any]) -> None:
    """The fake TE returns ``then(backend, outputs)`` instead of its outputs."""
    plain = FakeBackend.__call__
    monkeypatch.setattr(FakeBackend, "__call__", lambda self, args: then(self, plain(self, args)))


def _check(fake: FakeTE, ragged: Any = RAGGED, mask: str = "padding_causal", window: Any = (-1, -1),
           brd: Any = None) -> None:  # fmt: skip
    assert_post_pass(fake.backend.outputs, ragged, mask, window, brd)


def _fixed_call(fake: FakeTE, wrapped: Callable, args: Optional[dict] = None, **check: Any) -> None:
    """One call (RAGGED's by default) on fresh outputs, its rows then held to the oracle."""
    fake.backend.reset()
    wrapped(**(args or call_arguments("2.20", RAGGED)))
    _check(fake, **check)


# --------------------------------------------------------------------- one check per shape


def test_call_shape_checked_once_not_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """First call: the inputs' check (q, k, v and the offsets) and the outputs' check; later
    calls with new tensors of the same metadata: none, and every call still fixed."""
    seen: List[tuple] = []  # the names of every check_metadata call
    real = validation.check_metadata

    def counting(*args: Any, **kwargs: Any) -> None:
        seen.append(tuple(kwargs.get("names", args[9] if len(args) > 9 else ("dq", "dk", "dv"))))
        real(*args, **kwargs)

    for module in (wrapper_module, postpass):
        monkeypatch.setattr(module, "check_metadata", counting)
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for _ in range(4):
        _fixed_call(fake, wrapped)  # new tensors every call, as in training
    assert seen == [("q", "k", "v"), ("dq", "dk", "dv")]
    assert call_counts()["fixed"] == 4


#: A change to one fact of the call key that makes the call bad, and the error it gives.
BAD: Dict[str, tuple] = {
    "offsets dtype": (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()),
                      r"^cu_seqlens_q: expected dtype torch\.int32"),
    "offsets length": (lambda a: a.update(cu_seqlens_kv=a["cu_seqlens_kv"][:-1]),
                       r"^cu_seqlens_kv: expected 6 offsets"),
    "padded dtype": (lambda a: a.update(cu_seqlens_kv_padded=a["cu_seqlens_kv_padded"].long()),
                     r"^cu_seqlens_kv_padded: expected dtype torch\.int32"),
    "padded shape": (lambda a: a.update(cu_seqlens_q_padded=a["cu_seqlens_q_padded"].reshape(1, -1)),
                     r"^cu_seqlens_q_padded: expected a 1-D tensor"),
    # not keyable: decided and checked on every call
    **{f"{n} not a tensor": (lambda a, n=n: a.update({n: a[n].tolist()}),
                             rf"^{n}: expected a 1-D torch\.int32 tensor .*, got list")
       for n in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")},
    "kv heads": (lambda a: a.update(dict.fromkeys("kv", torch.zeros(a["k"].shape[0], 3, a["k"].shape[2]))),
                 r"^k: expected a number of KV heads that divides the query heads \(4\), got 3"),
    "k rows": (lambda a: a.update(k=a["k"][:-1]),
               r"^v: expected the same number of token rows as k \(\d+\), got"),
    "v rows": (lambda a: a.update(v=a["v"][:-1]), r"^v: expected the same number of token rows as k"),
    "q shape": (lambda a: a.update(q=a["q"].unsqueeze(0)), r"^q: expected a THD tensor"),
    "q and k without a shape": (lambda a: a.update(dict.fromkeys(
        "qk", type("Shapeless", (), {"device": torch.device("cpu")})())), r"^k: expected a THD tensor"),
    "q and k 2-D, as many rows": (  # no heads to compare: checked, not taken for MHA
        lambda a: a.update(q=a["k"][:, 0], k=a["k"][:, 0], v=a["v"][:, 0]), r"^k: expected a THD tensor"),
    "offsets on meta": (  # the key must tell devices apart, not only CUDA ones
        lambda a: a.update(cu_seqlens_kv=a["cu_seqlens_kv"].to("meta")),
        r"^cu_seqlens_kv: expected a tensor with data"),
    **{f"{n} on meta": (lambda a, n=n: a.update({n: a[n].to("meta")}), message)
       for n, message in (("q", r"^q: expected it on k's device cpu, got meta"),
                          ("k", r"^v: expected it on k's device meta, got cpu"),
                          ("v", r"^v: expected it on k's device cpu, got meta"))},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_new_call_shape_is_checked_again_and_bad_input_never_cached(case: str) -> None:
    """After a good call of one shape, a call that differs in one fact is checked again:
    the bad one raises ValueError naming the argument, before TE runs, on every try (never
    cached); the good shape still works after it."""
    change, message = BAD[case]
    fake, wrapped = FakeTE.with_wrapper("2.20")
    wrapped(**call_arguments("2.20", RAGGED))
    for _ in range(2):
        bad = call_arguments("2.20", RAGGED)
        change(bad)
        with pytest.raises(ValueError, match=message):
            wrapped(**bad)
    assert len(fake.backend.calls) == 1, "TE ran with bad input"
    _fixed_call(fake, wrapped)
    assert call_counts()["fixed"] == 2


def test_inputs_that_cannot_be_keyed_are_checked_on_every_call() -> None:
    """Offsets of a tensor subclass cannot be keyed: good calls of them do not let a later
    bad one of the same call shape through unchecked."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for dtype in (torch.int32, torch.int32, torch.int64):
        fake.backend.reset()
        args = call_arguments("2.20", RAGGED)
        args["cu_seqlens_q_padded"] = args["cu_seqlens_q_padded"].to(dtype).as_subclass(_Sub)
        if dtype == torch.int32:
            wrapped(**args)
            _check(fake)
            continue
        with pytest.raises(ValueError, match=r"^cu_seqlens_q_padded: expected dtype torch\.int32"):
            wrapped(**args)
        assert not fake.backend.calls, "TE ran with bad input"


# --------------------------------------------------------------------- self-attention

#: Queries and keys at the same rows: gaps, a leading row, tail rows, a zero-length sequence;
#: and the same sequences back to back (no padded offsets).
SELF = make_ragged([(3, 3), (0, 0), (5, 5), (2, 2)], gaps_q=[1, 0, 2, 1], gaps_kv=[1, 0, 2, 1],
                   lead_q=1, lead_kv=1, tail_q=2, tail_kv=2)  # fmt: skip
SELF_PACKED = make_ragged([(3, 3), (0, 0), (5, 5), (2, 2)], padded=False, tail_q=2, tail_kv=2)


def _one_offsets_tensor(args: Dict[str, Any]) -> None:
    args["cu_seqlens_kv"], args["cu_seqlens_kv_padded"] = (
        args["cu_seqlens_q"], args["cu_seqlens_q_padded"])  # fmt: skip


#: case -> (batch, change to its bf16 GQA call, TE_GQA_FIX, whether the post-pass runs).
SELF_CASES: Dict[str, tuple] = {
    "one offsets tensor": (SELF, _one_offsets_tensor, "auto", False),
    "valid offsets only": (SELF_PACKED, _one_offsets_tensor, "auto", False),
    "valid offsets of two tensors": (SELF_PACKED, lambda a: None, "auto", True),
    "equal values, two tensors": (SELF, lambda a: None, "auto", True),
    "padded offsets of two tensors": (
        SELF, lambda a: a.update(cu_seqlens_kv=a["cu_seqlens_q"]), "auto", True),
    "fp32 (TE zero-fills fp16/bf16)": (
        SELF, lambda a: (_one_offsets_tensor(a), a.update({n: a[n].float() for n in "qkv"})),
        "auto", True),
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
    """Self-attention through one offsets tensor: every key is its own query's, so no row
    can hold the bug's values and TE's output is returned untouched (counted skipped). Any
    other call of the same rows is repaired, and so is every call under ``always``."""
    monkeypatch.setenv("TE_GQA_FIX", SELF_CASES[case][2])
    _self_call(*FakeTE.with_wrapper("2.20"), case)


def test_the_call_key_tells_one_offsets_tensor_from_two() -> None:
    """One wrapper, calls of one shape in turn: the shared-offsets decision is not reused
    for a call whose padded (or valid) offsets are two tensors."""
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for case in ("one offsets tensor", "padded offsets of two tensors",
                 "equal values, two tensors", "one offsets tensor", "valid offsets only",
                 "valid offsets of two tensors"):  # fmt: skip
        _self_call(fake, wrapped, case)


def test_the_inputs_key_holds_what_a_launch_and_the_inputs_check_read() -> None:
    """Every device and the offsets' dtypes, lengths and which are None are in the inputs'
    key (a launch reads the number of sequences; the inputs' check, the devices); values
    and tensor identities are not."""
    from te_gqa_fix.wrapper import _inputs_key

    def picked(**change: Any) -> tuple:
        t = dict(
            q=torch.zeros(8, 4, 2), k=torch.zeros(8, 2, 2), v=torch.zeros(8, 2, 2),
            cu_q=torch.tensor([0, 3, 8]), cu_kv=torch.tensor([0, 4, 8]),
            pad_q=torch.tensor([0, 4, 8]), pad_kv=torch.tensor([0, 4, 8]),
        )  # fmt: skip
        t.update(change)
        return (*t.values(), "padding_causal", (-1, 0), None, "thd_thd_thd", None)

    base = _inputs_key(picked())
    assert base is not None and _inputs_key(picked()) == base
    meta = {n: torch.empty(s, device="meta") for n, s in (("q", (8, 4, 2)), ("k", (8, 2, 2)), ("v", (8, 2, 2)))}  # fmt: skip
    changes = [
        *({n: t} for n, t in meta.items()),
        dict(cu_kv=torch.tensor([0, 4, 8], dtype=torch.int32)),
        dict(pad_q=torch.tensor([0, 2, 4, 8])),
        dict(pad_kv=None),
        dict(cu_q=torch.tensor([0, 3, 8], device="meta")),
    ]
    for change in changes:
        assert _inputs_key(picked(**change)) != base, change
    assert _inputs_key(picked(pad_q=[0, 4, 8])) is None  # not a tensor: checked every call


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right",
                                  "arbitrary"])  # fmt: skip
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (3, 0), (0, 2), (2, 5)])
@pytest.mark.parametrize("brd", [None, True, False])
def test_as_many_queries_as_keys_attend_every_key(mask: str, window: tuple, brd: Any) -> None:
    """What the self-attention pass-through rests on, held to the one statement of the
    attended-key rule: with ``lq == lk`` every key of a sequence with queries is attended."""
    from te_gqa_fix.masks import key_bounds, key_span

    lengths = torch.tensor([0, 1, 2, 7, 40])
    lo, hi = key_bounds(lengths, lengths, key_span(mask, window, brd, strict=True))
    assert lo.tolist() == [0] * 5 and hi.tolist() == lengths.tolist()


# --------------------------------------------------------------------- every fact of a call


class _Unhashable(list):
    __hash__ = None  # type: ignore[assignment]


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
    dict(attn_mask_type="padding", window_size=_Unhashable([1, 0])),  # twice, never cached
    dict(attn_mask_type="padding", window_size=_Unhashable([1, 0])),
    dict(attn_mask_type="padding_causal", window_size=None),  # None: unbounded, as (-1, -1)
    dict(),
]


@pytest.mark.parametrize("version", ["2.8", "2.20"])
def test_each_call_follows_every_change(version: str) -> None:
    """One wrapper, one call after another with the mask, window, diagonal flag, layout,
    batch or shapes changed: each call's rows match the oracle (a stale entry would not).
    A window of a list type without a hash is decided without the cache, still right."""
    fake, wrapped = FakeTE.with_wrapper(version)
    for change in CHANGES:
        args = {"attn_mask_type": "padding_causal", "window_size": (-1, -1), **change}
        ragged = args.pop("ragged", RAGGED)
        brd = args.get("bottom_right_diagonal") if version == "2.20" else None  # 2.8: no flag
        fake.backend.reset()
        wrapped(**call_arguments(version, ragged, **args))
        window = args["window_size"]
        _check(fake, ragged, args["attn_mask_type"], window and tuple(window), brd)
    assert call_counts()["fixed"] == len(CHANGES)


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
    assert call_counts() == {"calls": 3, "fixed": 2, "skipped": 1, "passthrough": 0, "fallback": 0}


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
    assert call_counts()["fixed"] == 3


# --------------------------------------------------------------------- settings per call


def test_policy_change_between_calls_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, wrapped = FakeTE.with_wrapper("2.20")
    mha = dict(heads_q=2, heads_kv=2)
    wrapped(**call_arguments("2.20", RAGGED, **mha, offsets_dtype=torch.int64))
    assert_untouched(fake.backend.outputs)
    assert call_counts()["skipped"] == 1  # MHA under auto: not even checked
    monkeypatch.setenv("TE_GQA_FIX", "always")
    _fixed_call(fake, wrapped, call_arguments("2.20", RAGGED, **mha))
    monkeypatch.setenv("TE_GQA_FIX", "off")
    fake.backend.reset()
    wrapped(**call_arguments("2.20", RAGGED))
    assert_untouched(fake.backend.outputs)
    assert call_counts() == {"calls": 3, "fixed": 1, "skipped": 2, "passthrough": 0, "fallback": 0}


def test_validate_change_between_calls_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached call shape still reads TE_GQA_FIX_VALIDATE: turned on, the host check
    names the bad offset values in this call (off, the device verdict says less)."""
    _, wrapped = FakeTE.with_wrapper("2.20")
    wrapped(**call_arguments("2.20", RAGGED))
    bad = call_arguments("2.20", RAGGED)
    bad["cu_seqlens_kv"][2] = 100  # same metadata, values going back down after it
    with pytest.raises(ValueError, match="impossible offsets"):
        wrapped(**bad)
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv: expected non-decreasing offsets"):
        wrapped(**bad)


# --------------------------------------------------------------------- outputs


def test_new_output_metadata_is_checked_and_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch plan depends on the outputs' metadata: the same call shape with outputs
    of new strides is planned again (and run with that plan)."""
    plans: List[tuple] = []
    ran: List[Optional[object]] = []
    real_run = postpass.zero_checked

    def plan(dq: Any, dk: Any, dv: Any, offsets: tuple, span: Any) -> object:
        plans.append((dq.stride(), dk.stride(), dv.stride()))
        return f"plan {len(plans)}"

    def run(
        dq: Any, dk: Any, dv: Any, offsets: tuple, span: Any, plan: Any, validate: bool
    ) -> None:
        ran.append(plan)
        real_run(dq, dk, dv, offsets, span, None, validate)  # the PyTorch post-pass: CPU tensors

    monkeypatch.setattr(postpass, "prepare_kernel", plan)
    monkeypatch.setattr(postpass, "zero_checked", run)
    fake, wrapped = FakeTE.with_wrapper("2.20")
    for _ in range(2):
        _fixed_call(fake, wrapped)
    assert len(plans) == 1 and ran == ["plan 1", "plan 1"]

    def strided_dq(backend: FakeBackend, out: list) -> list:
        out[0] = out[0].transpose(0, 1).contiguous().transpose(0, 1)  # same shape, new strides
        backend.outputs["dq"] = (out[0], out[0].clone())
        return out[:3]  # and no extra output: (dq, dk, dv) is gradients too

    _te_then(monkeypatch, strided_dq)
    _fixed_call(fake, wrapped)
    assert len(plans) == 2 and plans[1][0] != plans[0][0] and ran[-1] == "plan 2"


def test_a_launch_is_never_shared_between_sequence_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch reads the offsets' length: calls of one shape whose batches hold 3, then 5
    sequences in the same rows each run the launch prepared for their own offsets, prepared
    once per count, alternating; every call's rows match the oracle."""
    prepared: Dict[str, int] = {}  # launch -> the sequences it was prepared for
    ran: List[tuple] = []
    real_run = postpass.zero_checked

    def prepare(dq: Any, dk: Any, dv: Any, offsets: tuple, span: Any) -> str:
        name = f"launch {len(prepared) + 1}"
        prepared[name] = offsets[0].numel() - 1
        return name

    def run(dq: Any, dk: Any, dv: Any, offsets: tuple, span: Any, launch: Any, validate: bool) -> None:  # fmt: skip
        ran.append((launch, offsets[0].numel() - 1))
        real_run(dq, dk, dv, offsets, span, None, validate)  # the PyTorch post-pass: CPU tensors

    monkeypatch.setattr(postpass, "prepare_kernel", prepare)
    monkeypatch.setattr(postpass, "zero_checked", run)
    fake, wrapped = FakeTE.with_wrapper("2.20")
    three, five = SAME_ROWS_OTHER_COUNTS
    for ragged in (three, five, three, five):
        _fixed_call(fake, wrapped, call_arguments("2.20", ragged), ragged=ragged)
    assert prepared == {"launch 1": 3, "launch 2": 5}
    assert ran == [("launch 1", 3), ("launch 2", 5)] * 2


def _on_meta(index: int) -> Callable[[list], list]:
    return lambda out: [t.to("meta") if t is out[index] else t for t in out]


#: What TE returns instead of its outputs, and words of the warning that names why. The
#: "after a good call" rows follow a good call of the same shape: outputs of new metadata
#: are checked as on a first call, so the output key must hold every output's device.
ODD_OUTPUTS: Dict[str, tuple] = {
    "dict": (lambda out: dict(enumerate(out)), "returned dict, not (dq, dk, dv, ...)"),
    "two": (lambda out: out[:2], "returned list, not (dq, dk, dv, ...)"),
    "none": (lambda out: None, "returned NoneType"),
    "grads-none": (lambda out: [out[0], None, None], "returned gradients it cannot read"),
    "dk-2d": (lambda out: [out[0], out[1].flatten(1), *out[2:]], "dk: expected a THD tensor"),
    "after a good call: dv rows": (
        lambda out: [*out[:2], out[2][:-1], *out[3:]],
        "dv: expected the same number of token rows as dk",
    ),
    "after a good call: dq on meta": (_on_meta(0), "dq: expected it on dk's device cpu, got meta"),
    "after a good call: dv on meta": (_on_meta(2), "dv: expected it on dk's device cpu, got meta"),
}


@pytest.mark.parametrize("case", list(ODD_OUTPUTS))
def test_outputs_not_understood_pass_through_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Outputs the post-pass cannot read (or that disagree with each other) are returned
    as TE returned them, untouched, with one warning naming why (issue 34: TE has run, so
    there is nothing left to refuse), and the post-pass never runs on them."""
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
    said = [r for r in caplog.records if "passed through untouched" in r.getMessage()]
    assert said == [r for r in caplog.records if r.levelno >= logging.WARNING] and len(said) == 1
    assert words in said[0].getMessage(), said[0].getMessage()
    assert call_counts() == {"calls": 3, "fixed": 0, "skipped": 0, "passthrough": 3, "fallback": 0}


# --------------------------------------------------------------------- reading by name


def test_signature_reads_positional_keyword_and_default() -> None:
    def every_name_by_position(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
        attn_mask_type, window_size, bottom_right_diagonal, qkv_layout, dqkv_layout, extra=None,
    ):  # fmt: skip
        return None

    names = list(wrapper_module._NAMES)
    sig = _Signature(every_name_by_position)
    slots, sig.slots = sig.slots, None  # all by position: one itemgetter, the slots unread
    assert sig.pick(names, {}) == tuple(names)
    sig.slots = slots
    assert sig.pick(names[:-1], {}) == (*names[:-1], None)  # the last one left out
    assert sig.pick(names[:3], {n: n.upper() for n in names[3:]})[3:] == tuple(
        n.upper() for n in names[3:]
    )

    def some(a, q, k=1, *, window_size=(2, 3), dqkv_layout="sbh3d", qkv_layout="x"):
        return None

    sig = _Signature(some)
    picked = dict(zip(names, sig.pick((0, "Q"), {})))
    assert (picked["q"], picked["k"], picked["window_size"]) == ("Q", 1, (2, 3))
    assert picked["qkv_layout"] == "x" and picked["dqkv_layout"] is None  # not given: None
    assert picked["v"] is None and picked["cu_seqlens_q"] is None
    picked = dict(zip(names, sig.pick((0,), {"q": "kw", "k": 2, "dqkv_layout": "sbh3d"})))
    assert (picked["q"], picked["k"], picked["dqkv_layout"]) == ("kw", 2, "sbh3d")
    with pytest.raises(TypeError, match="by name"):
        _Signature(lambda *args: None)


def _bind_target(a, q, k=1, /, v=2, *, w=3, x):  # type: ignore[no-untyped-def]
    return None


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((0, "q"), {"x": 9}),  # positional-only given, defaults applied
        ((0, "q", "k", "v"), {"x": 9, "w": 4}),
        ((0, "q"), {"v": 5, "x": 9}),
        ((0, "q", 1, 2, 3), {"x": 9}),  # too many positionals
        ((0,), {"x": 9}),  # q missing
        ((0, "q"), {}),  # keyword-only x missing
        ((0, "q"), {"x": 9, "nope": 1}),  # unknown keyword
        ((0, "q", "k", "v"), {"v": 1, "x": 9}),  # v twice
        ((0,), {"q": "q", "x": 9}),  # positional-only by keyword
    ],
)
def test_bind_is_inspects_bind(args: tuple, kwargs: dict) -> None:
    sig = _Signature(_bind_target)
    expected = inspect.signature(_bind_target)
    try:
        bound = expected.bind(*args, **kwargs)
    except TypeError:
        with pytest.raises(TypeError):
            sig.bind(args, kwargs)
        return
    bound.apply_defaults()
    sig.sig = None  # a call TE's call would accept never reaches inspect's bind (slow)
    assert sig.bind(args, kwargs) == dict(bound.arguments)


# --------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_wrapper_no_sync_and_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper's steady state (a cached call shape and plan) syncs nothing and replays
    inside a captured CUDA graph, positional and context-parallel calls alike; a fake
    original stands in for TE (no TE needed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
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
        call()  # decides, checks and plans (Triton compiles here)
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
    assert call_counts()["fixed"] == call_counts()["calls"] == 8


def test_the_bounded_cache_clears_and_decides_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``_MAX_SHAPES`` call shapes the cache starts over: it never grows without bound,
    and a shape decided before the clear is decided (and checked) again, still right."""
    monkeypatch.setattr(wrapper_module, "_MAX_SHAPES", 3)
    decided: List[tuple] = []
    real = wrapper_module._decide
    monkeypatch.setattr(wrapper_module, "_decide", lambda *a: decided.append(a) or real(*a))
    fake, wrapped = FakeTE.with_wrapper("2.20")
    shapes = [make_ragged([(n, n + 1), (0, 2)]) for n in (1, 2, 3, 4)]
    for ragged in (*shapes, shapes[0], shapes[3]):
        _fixed_call(fake, wrapped, call_arguments("2.20", ragged), ragged=ragged)
    # 1 2 3 decided; 4 clears and is decided; 1 again (cleared); 4 is a hit.
    assert len(decided) == 5
