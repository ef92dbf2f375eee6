"""Issue #13: bad input never becomes a silently wrong gradient (one test group per finding).

Each test here failed on the code before the fix (see the commit message of the fix for
the before/after table). The Triton kernel's side of finding 3 and finding 6 runs under
the Triton interpreter in a child process (``TRITON_INTERPRET=1`` must be set before
Triton decorates a kernel), like tests/test_triton_postpass.py: this file run as a
script, ``python tests/test_bad_input.py <check>``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import te_gqa_fix
from fakes.interpreter import run_worker
from fakes.oracle import assert_rows, bits, expected_keep, make_ragged
from fakes.te_outputs import FakeTE, call_arguments
from te_gqa_fix import offset_errors, triton_postpass, zero_dead_rows
from te_gqa_fix.cli import main
from te_gqa_fix.offset_errors import OffsetsError
from te_gqa_fix.plan import PlanInput, build_plan, plan_from_json
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
    "decreasing_q": (dict(cu_seqlens_q=_t([0, 2, 1, 5])), "cu_seqlens_q"),
    "past_buffer_padded": (dict(cu_seqlens_kv_padded=_t([1, 5, 7, 12])), "cu_seqlens_kv_padded"),
    "padded_shorter": (dict(cu_seqlens_kv=_t([0, 3, 7, 8])), "cu_seqlens_kv_padded"),
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


def test_validate_keeps_its_immediate_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TE_GQA_FIX_VALIDATE", "1")
    dq, dk, dv = _grads()
    with pytest.raises(ValueError, match=r"^cu_seqlens_kv: expected offsets >= 0|non-decreasing"):
        zero_dead_rows(dq, dk, dv, **{**OFFS, "cu_seqlens_kv": _t([0, -3, 5, 6])})  # type: ignore[arg-type]


def test_dead_row_masks_refuse_impossible_offsets() -> None:
    with pytest.raises(OffsetsError, match="cu_seqlens_q"):
        te_gqa_fix.postpass.dead_row_masks(_t([0, 3, 1]), _t([0, 2, 4]), rows_q=3, rows_kv=4)


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
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("compile failed")

    monkeypatch.setattr(triton_postpass, "_available", True)
    monkeypatch.setattr(triton_postpass, "_broken", False)
    monkeypatch.setattr(triton_postpass, "_why_unsupported", lambda *a, **k: None)
    monkeypatch.setattr(triton_postpass, "_launch", boom)
    ragged = make_ragged([(3, 5), (0, 4), (2, 2)], gaps_q=[1, 0, 1], gaps_kv=[0, 2, 1], tail_kv=1)
    keep_q, keep_kv = expected_keep(ragged, "padding_causal")
    dq, dk, dv = _grads(ragged.rows_q, ragged.rows_kv)
    before = [t.clone() for t in (dq, dk, dv)]
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        zero_dead_rows(dq, dk, dv, *ragged.tensors(), impl="triton")
    assert triton_postpass._broken is True
    assert any("Triton post-pass failed" in r.getMessage() for r in caplog.records)
    assert_rows(dq, before[0], keep_q, "dq")
    assert_rows(dk, before[1], keep_kv, "dk")
    assert_rows(dv, before[2], keep_kv, "dv")


@pytest.mark.parametrize("check", ["kernel_offsets", "kernel_offsets_chunked", "public_triton"])
def test_interpreter_worker(check: str) -> None:
    pytest.importorskip("triton")
    proc = run_worker(__file__, check)
    assert proc.returncode == 0, f"worker {check!r} failed:\n{proc.stdout}\n{proc.stderr}"
    assert f"worker {check}: ok" in proc.stdout, proc.stdout


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


# ------------------------------------------------------------- interpreter worker bodies
# Run with TRITON_INTERPRET=1 in a child process (see the module docstring).


def _bits_from_torch(cu_q, cu_kv, pad_q, pad_kv, rows_q, rows_kv) -> int:
    from te_gqa_fix.postpass import _offset_error_bits

    def i64(t):
        return t.to(torch.int64)

    return int(
        _offset_error_bits(
            i64(cu_q),
            i64(cu_kv),
            i64(cu_q if pad_q is None else pad_q),
            i64(cu_kv if pad_kv is None else pad_kv),
            pad_q is not None,
            pad_kv is not None,
            rows_q,
            rows_kv,
        )
    )


@st.composite
def _malformed(draw: Any) -> Dict[str, Any]:
    n = draw(st.integers(0, 5)) + 1
    value = st.integers(-3, 14)
    offs = [draw(st.lists(value, min_size=n, max_size=n)) for _ in range(4)]
    if draw(st.booleans()):  # often well formed, so both verdicts are exercised
        offs[0] = sorted(abs(x) for x in offs[0])
        offs[1] = sorted(abs(x) for x in offs[1])
    return dict(
        offs=offs,
        pad_q=draw(st.booleans()),
        pad_kv=draw(st.booleans()),
        rows_q=draw(st.integers(0, 14)),
        rows_kv=draw(st.integers(0, 14)),
        with_q=draw(st.booleans()),
        mask=draw(st.sampled_from(["padding_causal", "padding", "padding_causal_bottom_right"])),
    )


def _worker_kernel_offsets() -> None:
    """The kernel's verdict equals the PyTorch path's, bit for bit; bad = nothing stored.

    Run with kept rows found by the binary search (``kernel_offsets``) and, offsets
    scanned 2 at a time, by the interval compare (``kernel_offsets_chunked``).
    """
    from te_gqa_fix.masks import key_span

    cpu = torch.device("cpu")

    @settings(max_examples=250, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(case=_malformed())
    def check(case: Dict[str, Any]) -> None:
        offset_errors._reset()
        cu_q, cu_kv, pq, pk = (_t(x) for x in case["offs"])
        pad_q = pq if case["pad_q"] else None
        pad_kv = pk if case["pad_kv"] else None
        rows_q, rows_kv = max(case["rows_q"], 1), max(case["rows_kv"], 1)
        gen = torch.Generator().manual_seed(1)
        dq = torch.randn(rows_q, 2, 3, generator=gen) if case["with_q"] else None
        dk, dv = torch.randn(rows_kv, 1, 3, generator=gen), torch.randn(rows_kv, 1, 3)
        before = [None if t is None else t.clone() for t in (dq, dk, dv)]
        triton_postpass._launch(dq, dk, dv, cu_q, cu_kv, pad_q, pad_kv, key_span(case["mask"]))
        want = _bits_from_torch(
            cu_q, cu_kv, pad_q, pad_kv, rows_q if case["with_q"] else None, rows_kv
        )
        got = int(offset_errors.kernel_flag(cpu)[0])
        assert got == want, (got, want, case)
        if want:
            for t, b in zip((dq, dk, dv), before):
                assert t is None or torch.equal(bits(t), bits(b)), "bad offsets: a store"
            with pytest.raises(OffsetsError):
                offset_errors.raise_pending(cpu)

    check()
    # The issue's example through the kernel: nothing zeroed, cu_seqlens_kv named.
    offset_errors._reset()
    dq, dk, dv = _grads()
    before = [t.clone() for t in (dq, dk, dv)]
    triton_postpass._launch(dq, dk, dv, _t([0, 2, 2, 5]), _t([0, -3, 5, 6]), None,
                            _t([1, 5, 7, 9]), key_span("padding_causal"))  # fmt: skip
    _unchanged(before, [dq, dk, dv])
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_kv\b.*: impossible offsets"):
        zero_dead_rows(dq, dk, dv, **OFFS, impl="torch")  # type: ignore[arg-type]


def _worker_public_triton() -> None:
    """Public zero_dead_rows(impl="triton") on CPU tensors through the interpreted kernel.

    ``available`` and the CUDA requirement are lifted so the public path reaches the
    kernel; against the brute-force oracle with q and kv padded offsets that differ and
    explicit bottom_right_diagonal, so swapping the padded offsets or dropping the flag
    on the way to the kernel fails here.
    """
    from fakes.oracle import Ragged

    triton_postpass._available = True
    real = triton_postpass._why_unsupported
    triton_postpass._why_unsupported = lambda dq, dk, dv, offs, require_cuda: real(  # type: ignore[assignment]
        dq, dk, dv, offs, False
    )
    reached: List[int] = []
    launch = triton_postpass._launch

    def counted(*args: Any) -> None:
        reached.append(1)
        launch(*args)

    triton_postpass._launch = counted  # type: ignore[assignment]

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(
        pairs=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5),
        gq=st.lists(st.integers(0, 3), min_size=5, max_size=5),
        gk=st.lists(st.integers(0, 3), min_size=5, max_size=5),
        mask=st.sampled_from(
            ["padding_causal", "padding_causal_bottom_right", "padding", "causal"]
        ),
        window=st.tuples(st.integers(-1, 4), st.integers(-1, 4)),
        brd=st.sampled_from([None, True, False]),
        with_q=st.booleans(),
    )
    def check(pairs, gq, gk, mask, window, brd, with_q) -> None:
        n = len(pairs)
        if "causal" in mask and window[1] > 0:  # TE leaves right in {-1, 0} for causal
            window = (window[0], 0)
        ragged: Ragged = make_ragged(pairs, gaps_q=gq[:n], gaps_kv=gk[:n], lead_q=1, tail_kv=2)
        keep_q, keep_kv = expected_keep(ragged, mask, window, brd)
        gen = torch.Generator().manual_seed(3)
        dq = torch.randn(ragged.rows_q, 4, 3, generator=gen)
        dk = torch.randn(ragged.rows_kv, 2, 3, generator=gen)
        dv = torch.randn(ragged.rows_kv, 2, 3, generator=gen)
        before = [t.clone() for t in (dq, dk, dv)]
        zero_dead_rows(dq if with_q else None, dk, dv, *ragged.tensors(), attn_mask_type=mask,
                       window_size=window, bottom_right_diagonal=brd, impl="triton")  # fmt: skip
        if with_q:
            assert_rows(dq, before[0], keep_q, "dq")
        else:
            assert torch.equal(dq, before[0])
        assert_rows(dk, before[1], keep_kv, "dk")
        assert_rows(dv, before[2], keep_kv, "dv")

    check()
    assert reached, "the public path never reached the kernel"
    assert not triton_postpass._broken


def _worker_kernel_offsets_chunked() -> None:
    """The same with the offsets scanned 2 at a time (errors in every chunk position),
    kept rows found by the interval compare."""
    offset_errors._OFF_BLOCK_MAX = 2
    triton_postpass._COMPARE_MAX_OFFSETS = 1 << 30
    _worker_kernel_offsets()
    chunks = {p.meta["OFF_CHUNKS"] for p in triton_postpass._launch_plans.values()}
    assert max(chunks) == 3, chunks


def _worker_kernel_offsets_search() -> None:
    triton_postpass._COMPARE_MAX_OFFSETS = 0
    _worker_kernel_offsets()


WORKER_CHECKS = {
    "kernel_offsets": _worker_kernel_offsets_search,
    "kernel_offsets_chunked": _worker_kernel_offsets_chunked,
    "public_triton": _worker_public_triton,
}


if __name__ == "__main__":
    name = sys.argv[1]
    WORKER_CHECKS[name]()
    print(f"worker {name}: ok")
