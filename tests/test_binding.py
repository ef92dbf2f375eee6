"""The wrapper binds TE's arguments by name, for TE 2.8 and TE 2.20 signatures.

Fake ``fused_attn_bwd`` functions carry the exact signatures of TE 2.8.0 and 2.20.2
(``fakes/te_signatures.py``) and return ``[dq, dk, dv, extra]`` with stale values in
every row. They are called the ways TE's call sites call them (all positional as in
``FusedAttnFunc``, 12 positional plus keywords as in ``context_parallel.py``, keywords
only, and with defaults left out); the wrapper must route every argument to the
post-pass, return the very object TE returned, zero exactly the oracle's rows and leave
everything else alone.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

import pytest
import torch

from fakes.oracle import bits, make_ragged
from fakes.te_outputs import (
    FakeQuantizer,
    FakeTE,
    assert_post_pass,
    assert_untouched,
    call_arguments,
    split_call,
)
from te_gqa_fix.wrapper import call_counts, is_wrapper, unwrap, wrapper_for

VERSIONS = ("2.8", "2.20")
# Sequences (lq, lk): ordinary, q-empty (the bug), kv-empty, square, lq > lk, empty;
# padding after each, rows before the first offset and after the last.
RAGGED = make_ragged(
    [(3, 5), (0, 4), (4, 0), (2, 2), (5, 3), (0, 0)],
    gaps_q=[1, 0, 2, 1, 0, 1],
    gaps_kv=[2, 1, 0, 1, 1, 0],
    lead_q=1,
    lead_kv=2,
    tail_q=2,
    tail_kv=3,
)
# (attn_mask_type, window_size, bottom_right_diagonal): chosen so that reading any of the
# three from the wrong place changes the rows to zero.
MASK_CASES = {
    "padding_causal": ("padding_causal", (-1, -1), None),
    "bottom_right_window": ("padding_causal_bottom_right", (1, 0), None),
    "padding_window_br_flag": ("padding", (2, 0), True),
    "padding_window_tl": ("padding", (0, 1), False),
}
# How many leading parameters are passed positionally (the rest by keyword):
# 0 = keywords only, 12/13 = context_parallel.py style, None = all (FusedAttnFunc).
CUTS = (0, 3, "cp", None)


def _n_positional(cut: object, names: list, version: str) -> int:
    if cut is None:
        return len(names)
    if cut == "cp":  # every parameter before cu_seqlens_q_padded
        return names.index("cu_seqlens_q_padded")
    return int(cut)  # type: ignore[arg-type]


def _expected_brd(version: str, brd: Optional[bool]) -> Optional[bool]:
    return brd if version == "2.20" else None  # TE 2.8 has no bottom_right_diagonal


def _check_fixed(fake: FakeTE, out: Any, mask: str, window: tuple, brd: Optional[bool]) -> None:
    assert out is fake.backend.returned, "the wrapper must return TE's own object"
    outputs = fake.backend.outputs
    assert_post_pass(outputs, RAGGED, mask, window, brd)
    after, before = outputs["extra"]
    assert torch.equal(bits(after), bits(before)), "extra outputs must be untouched"


def _check_untouched(fake: FakeTE, out: Any) -> None:
    assert out is fake.backend.returned
    assert_untouched(fake.backend.outputs)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layout", ["thd_thd_thd", "thd_t2hd", "thd_th2d"])
@pytest.mark.parametrize("case", sorted(MASK_CASES))
@pytest.mark.parametrize("cut", CUTS, ids=str)
def test_wrapper_routes_arguments_and_zeroes_oracle_rows(
    version: str, layout: str, case: str, cut: object
) -> None:
    mask, window, brd = MASK_CASES[case]
    fake, wrapped = FakeTE.with_wrapper(version)
    arguments = call_arguments(
        version,
        RAGGED,
        layout=layout,
        attn_mask_type=mask,
        window_size=window,
        bottom_right_diagonal=brd,
    )
    names = fake.names
    args, kwargs = split_call(names, arguments, _n_positional(cut, names, version))

    out = wrapped(*args, **kwargs)

    # TE's function saw exactly what the caller passed, nothing added or changed.
    assert len(fake.backend.calls) == 1
    seen = fake.backend.calls[0]
    assert set(seen) == set(names)
    for name in names:
        assert seen[name] is arguments[name], name
    _check_fixed(fake, out, mask, window, _expected_brd(version, brd))
    assert call_counts() == {"calls": 1, "fixed": 1, "skipped": 0, "passthrough": 0, "fallback": 0}


@pytest.mark.parametrize("version", VERSIONS)
def test_defaults_left_out_like_context_parallel(version: str) -> None:
    # TE 2.20's context_parallel.py passes neither window_size nor bottom_right_diagonal:
    # the wrapper must use the signature's defaults ((-1, -1), None -> by mask name).
    fake, wrapped = FakeTE.with_wrapper(version)
    arguments = call_arguments(version, RAGGED, attn_mask_type="padding_causal_bottom_right")
    names = fake.names
    n = names.index("cu_seqlens_q_padded")
    kwargs = {
        k: arguments[k]
        for k in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded", "qkv_layout", "attn_mask_type")
    }
    if version == "2.20":
        kwargs["dqkv_layout"] = arguments["dqkv_layout"]
    out = wrapped(*[arguments[x] for x in names[:n]], **kwargs)
    _check_fixed(fake, out, "padding_causal_bottom_right", (-1, -1), None)


@pytest.mark.parametrize("version", VERSIONS)
def test_wrapper_metadata(version: str) -> None:
    fake, wrapped = FakeTE.with_wrapper(version)
    assert wrapped.__wrapped__ is fake.fn
    assert is_wrapper(wrapped) and not is_wrapper(fake.fn)
    assert unwrap(wrapped) is fake.fn
    assert wrapper_for(wrapped) is wrapped, "wrapping a wrapper must not nest"
    assert wrapper_for(fake.fn) is wrapped, "one wrapper per original"
    assert wrapped.__name__ == "fused_attn_bwd"
    # It accepts exactly what the original accepts.
    assert inspect.signature(wrapped) == inspect.signature(fake.fn)
    with pytest.raises(TypeError):
        wrapped(*range(3), no_such_argument=1)


@pytest.mark.parametrize("version", VERSIONS)
def test_policy_off_is_a_pure_pass_through(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_GQA_FIX", "off")  # its spellings: tests/test_settings.py
    fake, wrapped = FakeTE.with_wrapper(version)
    # Even metadata the post-pass would reject (int64 offsets) goes straight to TE.
    arguments = call_arguments(version, RAGGED, offsets_dtype=torch.int64)
    out = wrapped(**arguments)
    _check_untouched(fake, out)
    assert fake.backend.calls[0]["cu_seqlens_q"] is arguments["cu_seqlens_q"]
    assert call_counts()["fixed"] == 0


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layout", ["bshd_bshd_bshd", "sbhd_sb2hd", "bs3hd", "thd_bshd_bshd"])
def test_non_thd_layout_untouched(version: str, layout: str) -> None:
    # thd_bshd_bshd: dK/dV are not THD, nothing to do (dQ of such calls is not damaged).
    fake, wrapped = FakeTE.with_wrapper(version)
    heads = (2, 2) if "3" in layout else (4, 2)
    arguments = call_arguments(version, RAGGED, layout=layout, heads_q=heads[0], heads_kv=heads[1])
    if layout.startswith("thd"):
        arguments["k"] = arguments["v"] = torch.zeros(2, 5, 2, 3)
    out = wrapped(**arguments)
    _check_untouched(fake, out)
    assert call_counts()["skipped"] == 1


def test_dqkv_layout_decides_on_te_2_20() -> None:
    # THD inputs, 4-D gradients requested: the gradients' layout is what matters.
    fake, wrapped = FakeTE.with_wrapper("2.20")
    arguments = call_arguments("2.20", RAGGED)
    arguments["dqkv_layout"] = "bshd_bshd_bshd"
    out = wrapped(**arguments)
    _check_untouched(fake, out)
    # And packed THD gradients from separate THD inputs are fixed through the views.
    arguments["dqkv_layout"] = "thd_t2hd"
    out = wrapped(**arguments)
    assert "dkv" in fake.backend.outputs
    _check_fixed(fake, out, "padding_causal", (-1, -1), None)


@pytest.mark.parametrize("version", VERSIONS)
def test_unknown_layout_passed_through_and_logged_once(
    version: str, caplog: pytest.LogCaptureFixture
) -> None:
    fake, wrapped = FakeTE.with_wrapper(version)
    arguments = call_arguments(version, RAGGED, layout="thd_thd_thd")
    layout_arg = "dqkv_layout" if version == "2.20" else "qkv_layout"
    arguments[layout_arg] = "thd_future_layout"
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(3):
            out = wrapped(**arguments)
            _check_untouched(fake, out)
    records = [r for r in caplog.records if "thd_future_layout" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].levelno == logging.WARNING
    assert layout_arg in records[0].getMessage()
    assert call_counts()["passthrough"] == 3 == len(fake.backend.calls)


def test_unbindable_signature_passed_through_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def opaque(*args: Any, **kwargs: Any) -> list:
        calls.append((args, kwargs))
        return ["sentinel"]

    wrapped = wrapper_for(opaque)
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        first = wrapped(1, 2, x=3)
        second = wrapped(4)
    assert first == ["sentinel"] and second == ["sentinel"]
    assert calls == [((1, 2), {"x": 3}), ((4,), {})]
    assert len([r for r in caplog.records if "cannot read the signature" in r.getMessage()]) == 1


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("with_shape", [True, False], ids=["Float8Tensor", "Float8TensorStorage"])
def test_fp8_outputs_raw_bytes_zeroed(version: str, with_shape: bool) -> None:
    fake, wrapped = FakeTE.with_wrapper(version)
    arguments = call_arguments(
        version, RAGGED, dqkv_quantizer=FakeQuantizer(columnwise=False, with_shape=with_shape)
    )
    out = wrapped(**arguments)
    _check_fixed(fake, out, "padding_causal", (-1, -1), None)  # byte 0 is +0 in E4M3 and E5M2
    for i, name in enumerate(("dq", "dk", "dv")):
        after, _ = fake.backend.outputs[name]
        assert after.dtype == torch.uint8
        assert out[i]._data is after


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("with_shape", [True, False], ids=["Float8Tensor", "Float8TensorStorage"])
def test_fp8_with_live_transpose_passes_through_with_one_warning(
    version: str, with_shape: bool, caplog: pytest.LogCaptureFixture
) -> None:
    fake, wrapped = FakeTE.with_wrapper(version)
    arguments = call_arguments(
        version, RAGGED, dqkv_quantizer=FakeQuantizer(columnwise=True, with_shape=with_shape)
    )
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        for _ in range(2):
            out = wrapped(**arguments)
            _check_untouched(fake, out)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "passed through" in warnings[0].getMessage()
