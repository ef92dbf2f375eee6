"""Bad input never becomes a silently wrong gradient (issues #13 and #26; a group per finding).

Each test here failed on the code before its fix. The Triton kernel's side of findings 3
and 6 (impossible offsets: the kernel's verdict, nothing stored, raised at the next call)
runs under the Triton interpreter in tests/test_triton_postpass.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import te_gqa_fix
from fakes.oracle import assert_rows, bits, expected_keep, make_ragged
from fakes.te_outputs import FakeTE, call_arguments
from te_gqa_fix import launch, offset_errors, postpass, zero_dead_rows
from te_gqa_fix.cli import main
from te_gqa_fix.cli.plan import PlanInput, build_plan, plan_from_json
from te_gqa_fix.offset_errors import OffsetsError
from te_gqa_fix.postpass import dead_row_masks
from te_gqa_fix.wrapper import _new_wrapper as make_wrapper

I32 = torch.int32


def _t(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


@pytest.fixture(autouse=True)
def _clean_records() -> Any:
    offset_errors._reset()
    yield
    offset_errors._reset()


# ------------------------------------------------------------- 1. plan --file types


def _plan_file(tmp_path: Path, **fields: Any) -> str:
    data = {"cu_seqlens_q": [0, 3], "cu_seqlens_kv": [0, 6], "attn_mask_type": "padding_causal"}
    data.update(fields)
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_plan_file_string_false_is_an_error_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Before: bool("false") is True, a wrong plan (6 KV rows kept instead of 3), exit 0.
    assert main(["plan", "--file", _plan_file(tmp_path, bottom_right_diagonal="false")]) == 2
    err = capsys.readouterr().err
    assert "bottom_right_diagonal: expected true, false or null" in err
    # JSON false is the top-left diagonal of padding_causal: keys 0-2 kept.
    assert (
        main(["plan", "--json", "--file", _plan_file(tmp_path, bottom_right_diagonal=False)]) == 0
    )
    assert json.loads(capsys.readouterr().out)["dkv"]["kept"] == 3


def test_plan_file_null_mask_is_an_error_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Before: null became the string "None" and the conservative set, exit 0.
    assert main(["plan", "--file", _plan_file(tmp_path, attn_mask_type=None)]) == 2
    assert "attn_mask_type: expected a string" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"rows_q": "12"}, "rows_q"),
        ({"rows_kv": 2.5}, "rows_kv"),
        ({"rows_kv": True}, "rows_kv"),
        ({"window_size": [-1]}, "window_size"),
        ({"window_size": [-1, True]}, "window_size"),
        ({"window_size": [-5, 0]}, "window_size"),
        ({"attn_mask_type": "padding_casual"}, "attn_mask_type"),
        ({"cu_seqlens_kv_padded": [0, "4"]}, "cu_seqlens_kv_padded"),
        ({"cu_seqlens_q": None}, "cu_seqlens_q"),
        ({"typo_field": 1}, "typo_field"),
    ],
)
def test_plan_file_errors_name_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture, fields: Dict[str, Any], name: str
) -> None:
    assert main(["plan", "--file", _plan_file(tmp_path, **fields)]) == 2
    assert f"error: {name}:" in capsys.readouterr().err


def test_plan_file_bad_json_names_the_option(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert main(["plan", "--file", str(path)]) == 2
    assert "error: --file: not valid JSON" in capsys.readouterr().err


def test_plan_from_json_keeps_real_booleans() -> None:
    text = '{"cu_seqlens_q": [0, 3], "cu_seqlens_kv": [0, 6], "bottom_right_diagonal": true}'
    assert plan_from_json(text).bottom_right_diagonal is True


# ------------------------------------------------------------- 2. heads that do not divide


def _grads(rows_q: int = 5, rows_kv: int = 10, h_q: int = 4, h_kv: int = 2, d: int = 2):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(rows_q, h_q, d, generator=gen),
        torch.randn(rows_kv, h_kv, d, generator=gen),
        torch.randn(rows_kv, h_kv, d, generator=gen),
    )


OFFS = dict(
    cu_seqlens_q=_t([0, 2, 2, 5]),
    cu_seqlens_kv=_t([0, 3, 5, 6]),
    cu_seqlens_q_padded=None,
    cu_seqlens_kv_padded=_t([1, 5, 7, 9]),
)


def _unchanged(before: List[torch.Tensor], after: List[torch.Tensor]) -> None:
    for b, a in zip(before, after):
        assert torch.equal(bits(a), bits(b)), "bad input changed a gradient"


@pytest.mark.parametrize("impl", ["torch", "triton", "auto"])
def test_heads_that_do_not_divide_raise_in_the_public_post_pass(impl: str) -> None:
    # Before: accepted (only the wrapper passed the head counts to the check).
    dq, dk, dv = _grads(h_q=3, h_kv=2)
    before = [t.clone() for t in (dq, dk, dv)]
    with pytest.raises(ValueError, match=r"^dk: expected a number of KV heads that divides"):
        zero_dead_rows(dq, dk, dv, **OFFS, impl=impl)  # type: ignore[arg-type]
    _unchanged(before, [dq, dk, dv])


def test_dk_dv_heads_must_agree() -> None:
    dq, dk, _ = _grads()
    dv = torch.zeros(10, 1, 2)
    with pytest.raises(ValueError, match=r"^dv: expected the same number of heads as dk"):
        zero_dead_rows(dq, dk, dv, **OFFS)  # type: ignore[arg-type]


# ------------------------------------------------------------- 3. impossible offsets


BAD_OFFSETS = {
    # name: (overrides, argument named)
    "negative_kv": (dict(cu_seqlens_kv=_t([0, -3, 5, 6])), "cu_seqlens_kv"),
    "negative_first": (dict(cu_seqlens_kv_padded=_t([-1, 5, 7, 9])), "cu_seqlens_kv_padded"),
    "decreasing_q": (dict(cu_seqlens_q=_t([0, 2, 1, 5])), "cu_seqlens_q"),
    "past_buffer_padded": (dict(cu_seqlens_kv_padded=_t([1, 5, 7, 12])), "cu_seqlens_kv_padded"),
    "padded_shorter": (dict(cu_seqlens_kv=_t([0, 3, 7, 8])), "cu_seqlens_kv_padded"),
    "one_row_short": (dict(cu_seqlens_kv=_t([0, 3, 6, 7])), "cu_seqlens_kv_padded"),
    "valid_past_buffer": (dict(cu_seqlens_q=_t([0, 2, 2, 6])), "cu_seqlens_q"),
}


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_impossible_offsets_raise_and_zero_nothing_on_cpu(case: str) -> None:
    # Before: accepted without TE_GQA_FIX_VALIDATE=1; cu_seqlens_kv=[0,-3,5,6] zeroed both
    # valid dQ rows of sequence 0.
    overrides, name = BAD_OFFSETS[case]
    dq, dk, dv = _grads()
    before = [t.clone() for t in (dq, dk, dv)]
    with pytest.raises(OffsetsError, match=rf"^[a-z_, ]*\b{name}\b[a-z_, ]*: impossible offsets"):
        zero_dead_rows(dq, dk, dv, **{**OFFS, **overrides}, impl="torch")  # type: ignore[arg-type]
    _unchanged(before, [dq, dk, dv])
    # Reported once: the next good call goes through.
    zero_dead_rows(dq, dk, dv, **OFFS, impl="torch")  # type: ignore[arg-type]


def test_the_issue_example_keeps_the_valid_dq_rows() -> None:
    dq, dk, dv = _grads()
    keep = dq[:2].clone()
    with pytest.raises(OffsetsError, match="cu_seqlens_kv"):
        zero_dead_rows(dq, dk, dv, **{**OFFS, "cu_seqlens_kv": _t([0, -3, 5, 6])})  # type: ignore[arg-type]
    assert torch.equal(dq[:2], keep)


#: What TE_GQA_FIX_VALIDATE=1 says about each of BAD_OFFSETS.
VALIDATE_MESSAGES = {
    "negative_kv": "cu_seqlens_kv: expected non-decreasing offsets, got 0 then -3 at index 1",
    "negative_first": "cu_seqlens_kv_padded: expected offsets >= 0, got -1 first",
    "decreasing_q": "cu_seqlens_q: expected non-decreasing offsets, got 2 then 1 at index 2",
    "past_buffer_padded": "cu_seqlens_kv_padded: last offset 12 is past the 10 kv rows of the "
    "buffer",
    "padded_shorter": "cu_seqlens_kv: sequence 1 has 4 tokens but cu_seqlens_kv_padded gives it "
    "only 2 rows",
    "one_row_short": "cu_seqlens_kv: sequence 1 has 3 tokens but cu_seqlens_kv_padded gives it "
    "only 2 rows",
    "valid_past_buffer": "cu_seqlens_q: last offset 6 is past the 5 q rows of the buffer",
}


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_validate_keeps_its_immediate_check(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel judges offsets on the device (on CUDA: raised at the next call);
    # TE_GQA_FIX_VALIDATE=1 reads them first and raises in the call, before the launch.
    launches: List[int] = []
    monkeypatch.setattr(postpass, "kernel_plan", lambda *args: object())  # as on CUDA
    monkeypatch.setattr(launch, "launch", lambda *args: launches.append(1))
    dq, dk, dv = _grads()
    bad = {**OFFS, **BAD_OFFSETS[case][0]}
    zero_dead_rows(dq, dk, dv, **bad)  # type: ignore[arg-type]
    assert launches == [1]
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
    with pytest.raises(OffsetsError) as info:
        zero_dead_rows(dq, dk, dv, **bad)  # type: ignore[arg-type]
    assert str(info.value) == VALIDATE_MESSAGES[case] and launches == [1]


def test_dead_row_masks_refuse_impossible_offsets() -> None:
    with pytest.raises(OffsetsError, match="cu_seqlens_q"):
        dead_row_masks(_t([0, 3, 1]), _t([0, 2, 4]), rows_q=3, rows_kv=4)


def test_a_recorded_error_surfaces_at_the_next_call_and_is_cleared() -> None:
    # What the CUDA kernel does (store the argument bits into the device's pinned word),
    # simulated on the CPU record: the next call raises naming the argument, before it
    # touches anything, and the record is cleared.
    word = offset_errors.kernel_flag(torch.device("cpu"))
    word[0] = offset_errors.ARGUMENT_BITS["cu_seqlens_kv_padded"]
    dq, dk, dv = _grads()
    before = [t.clone() for t in (dq, dk, dv)]
    with pytest.raises(
        OffsetsError, match=r"^cu_seqlens_kv_padded: impossible offsets in an earlier"
    ):
        zero_dead_rows(dq, dk, dv, **OFFS, impl="torch")  # type: ignore[arg-type]
    _unchanged(before, [dq, dk, dv])
    zero_dead_rows(dq, dk, dv, **OFFS, impl="torch")  # type: ignore[arg-type]
    word[0] = offset_errors.ARGUMENT_BITS["cu_seqlens_q"]
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_q: impossible offsets in a te-gqa-fix"):
        te_gqa_fix.check_offset_errors("cpu")
    te_gqa_fix.check_offset_errors()  # cleared


def test_the_wrapper_surfaces_a_recorded_error() -> None:
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    ragged = make_ragged([(2, 3), (0, 2)], gaps_kv=[1, 0])
    offset_errors.kernel_flag(torch.device("cpu"))[0] = 2
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_kv: impossible offsets"):
        wrapped(**call_arguments("2.20", ragged))
    wrapped(**call_arguments("2.20", ragged))


def test_the_wrapper_refuses_impossible_offsets_from_te() -> None:
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    ragged = make_ragged([(2, 3), (0, 2)], gaps_kv=[1, 0])
    arguments = call_arguments("2.20", ragged)
    arguments["cu_seqlens_kv_padded"] = _t([0, 4, 3])
    with pytest.raises(OffsetsError, match="cu_seqlens_kv_padded"):
        wrapped(**arguments)


# ------------------------------------------------------------- 4. mask arguments


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(attn_mask_type="padding_casual"), "attn_mask_type"),
        (dict(attn_mask_type=None), "attn_mask_type"),
        (dict(window_size=(-5, 0)), "window_size"),
        (dict(window_size=(1, 2, 3)), "window_size"),
        (dict(window_size=(1.5, 0)), "window_size"),
        (dict(bottom_right_diagonal="false"), "bottom_right_diagonal"),
    ],
)
def test_malformed_mask_arguments_raise_in_the_public_post_pass(
    kwargs: Dict[str, Any], name: str
) -> None:
    # Before: the conservative rows, logged at INFO.
    dq, dk, dv = _grads()
    before = [t.clone() for t in (dq, dk, dv)]
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        zero_dead_rows(dq, dk, dv, **OFFS, **kwargs)  # type: ignore[arg-type]
    _unchanged(before, [dq, dk, dv])


def test_arbitrary_mask_is_the_explicit_conservative_set() -> None:
    ragged = make_ragged([(2, 4), (0, 3)], gaps_kv=[1, 0])
    dq, dk, dv = _grads(ragged.rows_q, ragged.rows_kv)
    before = dk.clone()
    zero_dead_rows(dq, dk, dv, *ragged.tensors(), attn_mask_type="arbitrary")
    _, keep_kv = expected_keep(ragged, "arbitrary")
    assert keep_kv[:4] == [True] * 4
    assert_rows(dk, before, keep_kv, "dk")


def test_wrapper_keeps_conservative_set_for_unknown_masks_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeTE("2.20")
    wrapped = make_wrapper(fake.fn)
    ragged = make_ragged([(2, 3), (0, 2)], gaps_kv=[1, 0])
    arguments = call_arguments("2.20", ragged, attn_mask_type="padding_casual")
    with caplog.at_level(logging.DEBUG, logger="te_gqa_fix"):
        wrapped(**arguments)
        wrapped(**arguments)
    records = [r for r in caplog.records if "not understood" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert te_gqa_fix.call_counts()["fixed"] == 2


# ------------------------------------------------------------- 5. rows that share memory


def test_rows_sharing_memory_raise() -> None:
    # Before: a stride-0 expand along the token axis had its live rows zeroed.
    dq, _, _ = _grads()
    one = torch.randn(1, 2, 2)
    dk, dv = one.expand(10, 2, 2), torch.randn(10, 2, 2)
    with pytest.raises(ValueError, match=r"^dk: expected token rows that do not share memory"):
        zero_dead_rows(dq, dk, dv, **OFFS)  # type: ignore[arg-type]
    assert not bool((one == 0).any())
    # Overlapping but not zero stride: rows of 4 elements, 2 apart.
    base = torch.randn(40)
    dv = base.as_strided((10, 2, 2), (2, 2, 1))
    with pytest.raises(ValueError, match=r"^dv: expected token rows"):
        zero_dead_rows(dq, torch.randn(10, 2, 2), dv, **OFFS)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["t2hd", "th2d", "transposed", "heads_major"])
def test_legit_layouts_are_not_mistaken_for_overlap(layout: str) -> None:
    rows, h, d = 10, 2, 2
    if layout == "t2hd":
        buf = torch.randn(rows, 2, h, d)
        dk, dv = buf[:, 0], buf[:, 1]
    elif layout == "th2d":
        buf = torch.randn(rows, h, 2, d)
        dk, dv = buf[:, :, 0], buf[:, :, 1]
    elif layout == "transposed":
        dk = torch.randn(rows, d, h).transpose(1, 2)
        dv = torch.randn(rows, d, h).transpose(1, 2)
    else:  # heads-major storage: rows interleave without overlapping
        dk = torch.randn(h, rows, d).transpose(0, 1)
        dv = torch.randn(h, rows, d).transpose(0, 1)
    dq = torch.randn(5, 2 * h, d)
    zero_dead_rows(dq, dk, dv, **OFFS, impl="torch")  # type: ignore[arg-type]
    assert bool((dk[0] == 0).all()) and not bool((dk[1] == 0).all())


# ------------------------------------------------------------- 6. Triton failure


def test_a_failing_kernel_falls_back_to_the_pytorch_post_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: no test proved the fallback runs (a mutant skipping it survived).
    launches: List[int] = []

    def boom(*args: Any) -> None:
        launches.append(1)
        raise RuntimeError("compile failed")

    monkeypatch.setattr(postpass, "_broken", False)
    monkeypatch.setattr(postpass, "kernel_plan", lambda *args: object())  # as on CUDA
    monkeypatch.setattr(launch, "launch", boom)
    ragged = make_ragged([(3, 5), (0, 4), (2, 2)], gaps_q=[1, 0, 1], gaps_kv=[0, 2, 1], tail_kv=1)
    keep_q, keep_kv = expected_keep(ragged, "padding_causal")
    for _ in range(2):  # the second call goes straight to PyTorch
        dq, dk, dv = _grads(ragged.rows_q, ragged.rows_kv)
        before = [t.clone() for t in (dq, dk, dv)]
        with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
            zero_dead_rows(dq, dk, dv, *ragged.tensors(), impl="triton")
        assert_rows(dq, before[0], keep_q, "dq")
        assert_rows(dk, before[1], keep_kv, "dk")
        assert_rows(dv, before[2], keep_kv, "dv")
    assert postpass._broken is True and launches == [1]
    assert any("Triton post-pass failed" in r.getMessage() for r in caplog.records)


def test_impl_torch_never_asks_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: Any) -> None:
        raise AssertionError("impl='torch' asked for a kernel plan")

    monkeypatch.setattr(postpass, "kernel_plan", no_kernel)
    dq, dk, dv = _grads()
    zero_dead_rows(dq, dk, dv, **OFFS, impl="torch")  # type: ignore[arg-type]
    assert bool((dk[0] == 0).all())


# ------------------------------------------------------------- 8. CLI negative offsets


def test_cli_takes_negative_offsets_and_names_them(capsys: pytest.CaptureFixture) -> None:
    # Before: argparse died on "-1,0,3" ("expected one argument").
    code = main(["plan", "--cu-seqlens-q", "-1,0,3", "--cu-seqlens-kv", "0,3,9"])
    assert code == 2
    assert "cu_seqlens_q: expected offsets >= 0" in capsys.readouterr().err
    code = main(["plan", "--cu-seqlens-q", "0,0,3", "--cu-seqlens-kv", "0,3,9", "--padded-kv",
                 "-2,4,12"])  # fmt: skip
    assert code == 2
    assert "cu_seqlens_kv_padded: expected offsets >= 0" in capsys.readouterr().err


def test_build_plan_names_malformed_fields() -> None:
    with pytest.raises(ValueError, match=r"^bottom_right_diagonal: expected"):
        build_plan(PlanInput((0, 3), (0, 6), bottom_right_diagonal="false"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^rows_kv: expected a number of rows >= 0"):
        build_plan(PlanInput((0, 3), (0, 6), rows_kv=-1))


# ------------------------------------------------------------- issue #26: one gate
# zero_dead_rows and dead_row_masks pass the same checks with the same messages. Before,
# dead_row_masks checked no offset metadata: with cu_seqlens_q=[0,3], cu_seqlens_kv=[0,3,6]
# it marked no KV row dead, the reverse raised a bare IndexError, float offsets were
# truncated, 2-D and meta offsets raised raw torch errors, and rows were not checked;
# zero_dead_rows took impl="garbage" as "auto". window_size=(2, True) was refused already,
# but no test said so (a mutant dropping the bool check survived).

META = torch.device("meta")
#: (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded) -> message
BAD_METADATA = {
    "kv_longer": ((_t([0, 3]), _t([0, 3, 6]), None, None),
                  "cu_seqlens_kv: expected 2 offsets (batch_size + 1, as cu_seqlens_q), got 3"),
    "kv_shorter": ((_t([0, 3, 6]), _t([0, 3]), None, None),
                   "cu_seqlens_kv: expected 3 offsets (batch_size + 1, as cu_seqlens_q), got 2"),
    "padded_shorter": ((_t([0, 2, 5]), _t([0, 3, 6]), None, _t([0, 3])),
                       "cu_seqlens_kv_padded: expected 3 offsets (batch_size + 1, as "
                       "cu_seqlens_q), got 2"),
    "float": ((torch.tensor([0, 2.5, 5]), _t([0, 3, 6]), None, None),
              "cu_seqlens_q: expected dtype torch.int32 (as TE requires), got torch.float32"),
    "int64": ((_t([0, 2, 5]), torch.tensor([0, 3, 6]), None, None),
              "cu_seqlens_kv: expected dtype torch.int32 (as TE requires), got torch.int64"),
    "2-D": ((_t([[0, 2, 5]]), _t([0, 3, 6]), None, None),
            "cu_seqlens_q: expected a 1-D tensor of batch_size + 1 offsets, got shape (1, 3)"),
    "meta": ((_t([0, 2, 5]), _t([0, 3, 6]), torch.empty(3, dtype=I32, device=META), None),
             "cu_seqlens_q_padded: expected a tensor with data, got a meta tensor"),
    "empty": ((_t([]), _t([]), None, None),
              "cu_seqlens_q: expected at least one offset (batch_size + 1 >= 1), got none"),
    "list": (([0, 2, 5], _t([0, 3, 6]), None, None),
             "cu_seqlens_q: expected a 1-D torch.int32 tensor of batch_size + 1 offsets, got list"),
    "kv_none": ((_t([0, 2, 5]), None, None, None),
                "cu_seqlens_kv: expected a 1-D torch.int32 tensor of batch_size + 1 offsets, "
                "got NoneType"),
}  # fmt: skip


def _error_of(call: Any) -> Any:
    try:
        call()
    except Exception as exc:  # what each entry point raises, compared below
        return type(exc), str(exc)
    return None


def _both_entry_points(offsets: tuple, **kwargs: Any) -> List[Any]:
    """The error each public entry point raises on ``offsets`` (None: none), and a check
    that zero_dead_rows wrote nothing before raising."""
    dq, dk, dv = _grads()
    before = [t.clone() for t in (dq, dk, dv)]
    errors = [
        _error_of(lambda: zero_dead_rows(dq, dk, dv, *offsets, **kwargs)),
        _error_of(lambda: dead_row_masks(*offsets, rows_q=5, rows_kv=10, **kwargs)),
    ]
    if errors[0] is not None:
        _unchanged(before, [dq, dk, dv])
    return errors


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_offset_metadata_raises_the_same_named_error_everywhere(case: str) -> None:
    offsets, message = BAD_METADATA[case]
    assert _both_entry_points(offsets) == [(ValueError, message)] * 2


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_impossible_offsets_raise_the_same_error_everywhere(case: str) -> None:
    overrides, name = BAD_OFFSETS[case]
    offsets = tuple({**OFFS, **overrides}.values())
    errors = _both_entry_points(offsets)
    assert errors[0] == errors[1] and errors[0][0] is OffsetsError and name in errors[0][1]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(window_size=(2, True)), "window_size"),  # mutant K05 survived this
        (dict(window_size=(True, 2)), "window_size"),
        (dict(window_size=(2.0, 0)), "window_size"),
        (dict(attn_mask_type="padding_casual"), "attn_mask_type"),
        (dict(bottom_right_diagonal=1), "bottom_right_diagonal"),
    ],
)
def test_bad_mask_arguments_raise_the_same_named_error_everywhere(
    kwargs: Dict[str, Any], name: str
) -> None:
    errors = _both_entry_points(tuple(OFFS.values()), **kwargs)
    assert errors[0] == errors[1] and errors[0][0] is ValueError
    assert errors[0][1].startswith(f"{name}: expected"), errors[0][1]


def test_good_input_passes_both_entry_points_alike() -> None:
    assert _both_entry_points(tuple(OFFS.values())) == [None, None]


@pytest.mark.parametrize("rows", [-1, 2.5, True, "10", None])
@pytest.mark.parametrize("name", ["rows_q", "rows_kv"])
def test_dead_row_masks_rows_must_be_non_negative_ints(name: str, rows: Any) -> None:
    if name == "rows_q" and rows is None:
        assert dead_row_masks(*OFFS.values(), rows_q=None, rows_kv=10).q is None  # no dQ
        return
    kwargs = {"rows_q": 5, "rows_kv": 10, name: rows}
    with pytest.raises(ValueError, match=rf"^{name}: expected a non-negative int, got {rows!r}$"):
        dead_row_masks(*OFFS.values(), **kwargs)


@pytest.mark.parametrize("name", ["dq", "dv"])
def test_gradients_on_another_device_raise_naming_it(name: str) -> None:
    grads = dict(zip(("dq", "dk", "dv"), _grads()))
    grads[name] = torch.empty(grads[name].shape, device=META)
    with pytest.raises(ValueError, match=rf"^{name}: expected it on dk's device cpu, got meta$"):
        zero_dead_rows(*grads.values(), **OFFS)  # type: ignore[arg-type]


def test_unknown_impl_raises_before_anything_is_written() -> None:
    dq, dk, dv = _grads()
    before = [t.clone() for t in (dq, dk, dv)]
    with pytest.raises(ValueError, match=r"^impl: expected 'auto', 'torch' or 'triton', got 'gpu'"):
        zero_dead_rows(dq, dk, dv, **OFFS, impl="gpu")  # type: ignore[arg-type]
    _unchanged(before, [dq, dk, dv])
