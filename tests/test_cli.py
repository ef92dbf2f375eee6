"""``te-gqa-fix plan`` and ``te-gqa-fix doctor`` on CPU (no GPU, no real TE), in this process.

The plan's expected rows are written out by hand from the mask definitions (one run of
rows per line below), never computed by the code under test. Doctor is checked on its
pure parts (maps parser, exit-code decision) with tables of facts, its wiring with
monkeypatched probes, and its live check and whole report with a fake TE whose backward
runs on CPU, or with no importable TE at all.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import runpy
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import te_package
from te_gqa_fix import checks, cudnn_route, postpass, rules
from te_gqa_fix.cli import _live, doctor, main
from te_gqa_fix.cli import plan as plan_module
from te_gqa_fix.cli.plan import MAX_ROWS, PlanInput, build_plan
from te_gqa_fix.postpass import dead_row_masks
from te_gqa_fix.settings import SETTINGS

Runs = Sequence[Tuple[int, int, str, Optional[int]]]  # (first row, last row, code, sequence)


def expand(runs: Runs, rows: int) -> Tuple[List[str], List[Optional[int]]]:
    codes: List[str] = []
    seqs: List[Optional[int]] = []
    for first, last, code, seq in runs:
        assert first == len(codes), "runs must be contiguous"
        codes += [code] * (last - first + 1)
        seqs += [seq] * (last - first + 1)
    assert len(codes) == rows
    return codes, seqs


def run_plan_json(capsys: pytest.CaptureFixture, args: List[str]) -> Dict[str, Any]:
    code = main(["plan", *args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def check_side(side: Dict[str, Any], runs: Runs, kept: Tuple[str, ...]) -> None:
    codes, _ = expand(runs, side["rows"])
    assert side["row_codes"] == codes  # row by row
    zeroed = [i for i, c in enumerate(codes) if c not in kept]
    assert side["zeroed_rows"] == zeroed and side["zeroed"] == len(zeroed)
    assert side["kept"] == side["rows"] - len(zeroed)
    got_runs = [(r["start"], r["stop"] - 1, r["code"], r["sequence"]) for r in side["runs"]]
    assert got_runs == list(runs)
    for r in side["runs"]:
        assert r["zeroed"] == (r["code"] not in kept)


SEED_ARGS = [
    "--cu-seqlens-q", "0,0,3", "--cu-seqlens-kv", "0,3,9",
    "--padded-q", "0,4,12", "--padded-kv", "0,4,12",
    "--mask", "padding_causal", "--window", "-1,-1",
]  # fmt: skip

# Seed: sequence 0 has no queries; sequence 1 has 3 queries and 6 keys, top-left causal,
# so its queries attend keys 0-2 only.
SEED_KV: Runs = [
    (0, 2, "no_queries", 0),
    (3, 3, "padding", 0),  # 3 valid keys in 4 rows
    (4, 6, "attended", 1),
    (7, 9, "outside_window", 1),  # keys 3-5: after every query of the causal diagonal
    (10, 11, "padding", 1),
]
SEED_Q: Runs = [
    (0, 3, "no_queries", 0),
    (4, 6, "valid_query", 1),
    (7, 11, "padding", 1),
]


def test_plan_seed_case_text(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", *SEED_ARGS]) == 0
    text = capsys.readouterr().out
    assert "dK/dV rows (12): 9 zeroed, 3 kept" in text
    assert "rows 0-2       ZEROED  sequence 0 has no query tokens" in text
    assert "row  3         ZEROED  padding after sequence 0 (3 valid keys)" in text
    assert "rows 4-6       kept    attended by sequence 1" in text
    assert "rows 7-9       ZEROED  outside the attended window of sequence 1" in text
    assert "rows 10-11     ZEROED  padding after sequence 1 (6 valid keys)" in text


# Context parallelism, cp_size 2, THD with load balancing: each sequence (valid lengths
# 9, 8, 8, 12, 8, 12 from cu_seqlens [0,9,17,25,37,45,57], padded [0,12,20,28,40,48,60])
# is cut into 4 chunks (3, 2, 2, 3, 2, 3 rows); rank 0 holds chunks 0 and 3, rank 1
# chunks 1 and 2. Ring step 1 on rank 0 attends its second half of queries (chunk 3:
# valid 0, 2, 2, 3, 2, 3) to rank 1's keys (chunks 1+2: valid 6, 4, 4, 6, 4, 6) with no
# causal mask. Sequence 0's valid tokens end in chunk 2, so it has no queries this step.
CP_STEP_ARGS = [
    "--cu-seqlens-q", "0,0,2,4,7,9,12", "--padded-q", "0,3,5,7,10,12,15",
    "--cu-seqlens-kv", "0,6,10,14,20,24,30", "--padded-kv", "0,6,10,14,20,24,30",
    "--mask", "padding",
]  # fmt: skip
CP_STEP_KV: Runs = [
    (0, 5, "no_queries", 0),
    (6, 9, "attended", 1),
    (10, 13, "attended", 2),
    (14, 19, "attended", 3),
    (20, 23, "attended", 4),
    (24, 29, "attended", 5),
]
CP_STEP_Q: Runs = [
    (0, 2, "no_queries", 0),
    (3, 4, "valid_query", 1),
    (5, 6, "valid_query", 2),
    (7, 9, "valid_query", 3),
    (10, 11, "valid_query", 4),
    (12, 14, "valid_query", 5),
]


# The whole CP batch seen by one step with per-sequence query counts (some 0), top-left
# causal, and 4 tail rows past the last offset in both buffers.
CP_GLOBAL_ARGS = [
    "--cu-seqlens-q", "0,4,4,8,8,12,18", "--padded-q", "0,12,20,28,40,48,60",
    "--cu-seqlens-kv", "0,9,17,25,37,45,57", "--padded-kv", "0,12,20,28,40,48,60",
    "--mask", "padding_causal", "--window", "-1,0", "--rows-q", "64", "--rows-kv", "64",
]  # fmt: skip
CP_GLOBAL_KV: Runs = [
    (0, 3, "attended", 0),  # 4 queries, causal top-left: keys 0-3
    (4, 8, "outside_window", 0),
    (9, 11, "padding", 0),
    (12, 19, "no_queries", 1),
    (20, 23, "attended", 2),
    (24, 27, "outside_window", 2),
    (28, 39, "no_queries", 3),
    (40, 43, "attended", 4),
    (44, 47, "outside_window", 4),
    (48, 53, "attended", 5),  # 6 queries: keys 0-5 of 12
    (54, 59, "outside_window", 5),
    (60, 63, "tail", None),
]
CP_GLOBAL_Q: Runs = [
    (0, 3, "valid_query", 0),
    (4, 11, "padding", 0),
    (12, 19, "no_queries", 1),
    (20, 23, "valid_query", 2),
    (24, 27, "padding", 2),
    (28, 39, "no_queries", 3),
    (40, 43, "valid_query", 4),
    (44, 47, "padding", 4),
    (48, 53, "valid_query", 5),
    (54, 59, "padding", 5),
    (60, 63, "tail", None),
]


# Sequence 0: 4 queries, 6 keys, bottom-right, window (1, 0): query i attends keys
# i+1..i+2, so keys 1-5; key 0 is outside. Sequence 1: 2 queries, no keys.
# Two rows before the first sequence in each buffer.
WINDOW_ARGS = [
    "--cu-seqlens-q", "0,4,6", "--padded-q", "2,6,8",
    "--cu-seqlens-kv", "0,6,6", "--padded-kv", "2,8,10",
    "--mask", "padding_causal_bottom_right", "--window", "1,0",
]  # fmt: skip
WINDOW_KV: Runs = [
    (0, 1, "before_first", None),
    (2, 2, "outside_window", 0),
    (3, 7, "attended", 0),
    (8, 9, "padding", 1),  # sequence 1 has no keys: its 2 rows are padding
]
WINDOW_Q: Runs = [
    (0, 1, "before_first", None),
    (2, 5, "valid_query", 0),
    (6, 7, "no_keys", 1),
]


@pytest.mark.parametrize(
    "args, kv, q, bottom_right",
    [
        (SEED_ARGS, SEED_KV, SEED_Q, False),
        (CP_STEP_ARGS, CP_STEP_KV, CP_STEP_Q, False),
        (CP_GLOBAL_ARGS, CP_GLOBAL_KV, CP_GLOBAL_Q, False),
        (WINDOW_ARGS, WINDOW_KV, WINDOW_Q, True),
    ],
    ids=["seed", "cp-step", "cp-batch-with-tail", "sliding-window-and-rows-before-the-first"],
)
def test_plan_row_by_row(
    capsys: pytest.CaptureFixture, args: List[str], kv: Runs, q: Runs, bottom_right: bool
) -> None:
    out = run_plan_json(capsys, args)
    check_side(out["dkv"], kv, ("attended",))
    check_side(out["dq"], q, ("valid_query",))
    assert out["consistent"] is True
    span = out["span"]
    assert span["bottom_right"] is bottom_right and span["top_left"] is not bottom_right


def test_plan_from_json_file_matches_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    batch = {
        "cu_seqlens_q": [0, 0, 3],
        "cu_seqlens_kv": [0, 3, 9],
        "cu_seqlens_q_padded": [0, 4, 12],
        "cu_seqlens_kv_padded": [0, 4, 12],
        "attn_mask_type": "padding_causal",
        "window_size": [-1, -1],
        "bottom_right_diagonal": False,  # top-left, as the mask's name says
    }
    f = tmp_path / "batch.json"
    f.write_text(json.dumps(batch))
    from_file = run_plan_json(capsys, ["--file", str(f)])
    from_flags = run_plan_json(capsys, [*SEED_ARGS, "--bottom-right-diagonal", "false"])
    assert from_file == from_flags
    check_side(from_file["dkv"], SEED_KV, ("attended",))
    assert from_file["sequences"][1]["attended_keys"] == [0, 3]
    text = '{"cu_seqlens_q": [0, 3], "cu_seqlens_kv": [0, 6], "bottom_right_diagonal": true}'
    assert plan_module.plan_from_json(text).bottom_right_diagonal is True


@pytest.mark.parametrize(
    "args",
    [["--cu-seqlens-q", "0,1"],
     [*SEED_ARGS, "--file", ""]],  # before: an empty --file was ignored, exit 0
    ids=["no-kv-offsets", "empty-file-name"],
)  # fmt: skip
def test_plan_usage_errors(capsys: pytest.CaptureFixture, args: List[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "", out
    assert "te-gqa-fix: error: plan: " in err


# ------------------------------------------------------------- plan: what it refuses

Q3, KV3 = ["--cu-seqlens-q", "0,3"], ["--cu-seqlens-kv", "0,3"]
DEEP = "[" * 100_000  # before: RecursionError, exit 1

#: plan's arguments (a dict or text: the JSON of --file), then what follows "error: " in
#: its one line of stderr. Each exits 2 before any row-sized allocation. These are plan's
#: own parsing (flags and JSON); what the input gate refuses, plan refuses in the gate's
#: words (the ..._own_gate test below; each message: tests/test_checks.py), so a row that
#: reaches the gate names only the argument.
REFUSED = [
    # past int32 (before: a RuntimeError from torch, exit 1)
    (["--cu-seqlens-q", "0,2147483648", *KV3], "cu_seqlens_q: offset 2147483648 does not fit "
     "in int32"),
    (["--cu-seqlens-q", "-2147483649,0", "--cu-seqlens-kv", "0,0"], "cu_seqlens_q: offset "
     "-2147483649 does not fit in int32"),
    ([*Q3, *KV3, "--padded-kv", "0,4294967296"], "cu_seqlens_kv_padded: offset 4294967296"),
    # too many rows to list (before: --rows-kv 3000000000 was killed for memory)
    ([*Q3, *KV3, "--rows-kv", "3000000000"], f"rows_kv: expected at most {MAX_ROWS} rows"),
    ([*Q3, *KV3, "--rows-q", str(MAX_ROWS + 1)], f"rows_q: expected at most {MAX_ROWS} rows"),
    (["--cu-seqlens-q", "0,0", "--cu-seqlens-kv", f"0,{MAX_ROWS + 1}"],
     f"cu_seqlens_kv: expected at most {MAX_ROWS}"),
    (["--cu-seqlens-q", "0,0", "--cu-seqlens-kv", "0,1", "--padded-q", "0,2000000000",
      "--padded-kv", "0,1"], f"cu_seqlens_q_padded: expected at most {MAX_ROWS}"),
    # not ASCII decimal integers (before: "0,,3" read as [0, 3]; 1_0 as 10, ١ as 1)
    *[(["--cu-seqlens-q", text, *KV3], f"cu_seqlens_q: expected comma-separated integers "
       f"(0,0,3), got {text!r}")
      for text in ["0,,3", "0,3,", ",0,3", "0;3", "0,3.0", "0 3", "", "0,1_0", "0,\u0661",
                   "0,+3", "0,\uff13"]],
    ([*Q3, *KV3, "--rows-q", "1_0"], "rows_q: expected an integer, got '1_0'"),
    ([*Q3, *KV3, "--window", "1_0,0"], "window_size: expected comma-separated integers"),
    # the window (before: 2**64 was an OverflowError, exit 1; 2**63 - 1 wrapped around)
    ([*Q3, *KV3, "--window", "18446744073709551616,0"], "window_size: "),
    ([*Q3, *KV3, "--window", "0,9223372036854775807"], "window_size: "),
    ([*Q3, *KV3, "--mask", ""], "attn_mask_type: "),  # before: the default
    # negative offsets (before: argparse took "-1,0,3" for an option)
    (["--cu-seqlens-q", "-1,0,3", "--cu-seqlens-kv", "0,3,9"], "cu_seqlens_q: "),
    (["--cu-seqlens-q", "0,0,3", "--cu-seqlens-kv", "0,3,9", "--padded-kv", "-2,4,12"],
     "cu_seqlens_kv_padded: "),
    # --file: JSON's own types, then the same checks
    ({"cu_seqlens_q": [0, True]}, "cu_seqlens_q: "),  # a JSON true is 1 in Python
    ({"bottom_right_diagonal": "false"}, "bottom_right_diagonal: expected true, false or null"),
    ({"attn_mask_type": None}, "attn_mask_type: expected a string"),  # before: "None"
    *[({k: v}, f"{k}: expected an integer, got {v!r}")
      for k, v in (("rows_q", "12"), ("rows_kv", 2.5), ("rows_kv", True))],
    ({"rows_kv": -1}, "rows_kv: expected a number of rows >= 0, got -1"),
    ({"window_size": [-1, True]}, "window_size: "),  # a JSON true is no integer
    ({"cu_seqlens_kv_padded": [0, "4"]}, "cu_seqlens_kv_padded: expected a list of integers"),
    ({"cu_seqlens_q": None}, "cu_seqlens_q: expected a list of integers, got None"),
    ({"typo_field": 1}, "typo_field: unknown key"),
    ("{not json", "--file: not valid JSON"),
    ({"cu_seqlens_kv_padded": [False, 6]}, "cu_seqlens_kv_padded: "),
    ({"cu_seqlens_q": [0, 2**31]}, "cu_seqlens_q: offset 2147483648 does not fit in int32"),
    ({"rows_kv": 3000000000}, "rows_kv: expected at most"),
    ({"window_size": [2**64, 0]}, "window_size: "),
    (DEEP, "--file: JSON nested too deeply"),
    ('{"cu_seqlens_q": ' + DEEP, "--file: JSON nested too deeply"),
]  # fmt: skip


@pytest.fixture
def no_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    def allocates(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("plan allocated row masks for a batch it must refuse")

    monkeypatch.setattr(plan_module, "dead_row_masks", allocates)


@pytest.mark.parametrize("args, error", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_plan_refuses_bad_input_before_allocating(
    tmp_path: Path, capsys: pytest.CaptureFixture, no_alloc: None, args: Any, error: str
) -> None:
    if not isinstance(args, list):
        text = args if isinstance(args, str) else json.dumps({**json.loads(FILE), **args})
        (tmp_path / "batch.json").write_text(text)
        args = ["--file", str(tmp_path / "batch.json")]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("te-gqa-fix plan: error: ") and err.count("\n") == 1, err
    assert error in err


FILE = json.dumps({"cu_seqlens_q": [0, 3], "cu_seqlens_kv": [0, 6]})


def test_plan_row_limit_is_inclusive() -> None:
    """MAX_ROWS rows, and a window of int32's largest values, are accepted (more: REFUSED)."""
    assert plan_module._rows(MAX_ROWS, "rows_kv") == MAX_ROWS
    assert build_plan(PlanInput((0, 3), (0, 3), window_size=(2**31 - 1,) * 2)).consistent


@pytest.mark.parametrize(
    "args, offsets",
    [
        (["--cu-seqlens-q", "0,3", "--cu-seqlens-kv", "0,3,9"], ([0, 3], [0, 3, 9], None, None)),
        (["--cu-seqlens-q", "0,3,1", "--cu-seqlens-kv", "0,3,9"], ([0, 3, 1], [0, 3, 9], None, None)),
        (["--cu-seqlens-q", "0,5", "--cu-seqlens-kv", "0,3", "--padded-q", "0,4"],
         ([0, 5], [0, 3], [0, 4], None)),
    ],
)  # fmt: skip
def test_plan_refuses_offsets_through_the_post_passs_own_gate(
    capsys: pytest.CaptureFixture, no_alloc: None, args: List[str], offsets: Tuple[Any, ...]
) -> None:
    """plan's offset errors are the gate's (``te_gqa_fix.checks``), word for word, and
    come before any row-sized allocation."""
    t = [None if o is None else torch.tensor(o, dtype=torch.int32) for o in offsets]
    rows = [max(o[-1], 0) for o in (offsets[2] or offsets[0], offsets[3] or offsets[1])]
    with pytest.raises(ValueError) as gate:
        checks.offsets(*t, rows_q=rows[0], rows_kv=rows[1])
        checks.offset_values(*rows, *t)
    assert main(["plan", *args]) == 2
    assert capsys.readouterr().err == f"te-gqa-fix plan: error: {gate.value}\n"


@st.composite
def batches(draw: st.DrawFn) -> PlanInput:
    n = draw(st.integers(0, 5))
    lq = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    lk = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))

    def layout(lengths: List[int]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        cu, pad = [0], [draw(st.integers(0, 2))]
        for length in lengths:
            cu.append(cu[-1] + length)
            pad.append(pad[-1] + length + draw(st.integers(0, 2)))
        return tuple(cu), tuple(pad)

    cu_q, pad_q = layout(lq)
    cu_kv, pad_kv = layout(lk)
    mask = draw(
        st.sampled_from(
            ["padding", "padding_causal", "padding_causal_bottom_right", "no_mask", "arbitrary"]
        )
    )
    window = (draw(st.integers(-1, 3)), draw(st.integers(-1, 3)))
    return PlanInput(
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        cu_seqlens_q_padded=pad_q,
        cu_seqlens_kv_padded=pad_kv,
        attn_mask_type=mask,
        window_size=window,
        bottom_right_diagonal=draw(st.sampled_from([None, True, False])),
        rows_q=pad_q[-1] + draw(st.integers(0, 2)),
        rows_kv=pad_kv[-1] + draw(st.integers(0, 2)),
    )


@settings(max_examples=150, deadline=None)
@given(batches())
def test_plan_reasons_agree_with_the_post_pass(inp: PlanInput) -> None:
    """Every row gets a reason that matches what the post-pass does to it."""
    plan = build_plan(inp)
    assert plan.consistent
    fields = dataclasses.asdict(inp)  # TE's argument names, as the post-pass takes them
    offsets = {k: torch.tensor(v, dtype=torch.int32) for k, v in fields.items() if "seqlens" in k}
    dead = dead_row_masks(**{**fields, **offsets})
    assert plan.kv_zeroed == dead.kv.tolist()
    assert dead.q is not None and plan.q_zeroed == dead.q.tolist()
    covered = sum(r.stop - r.start for r in plan.runs("kv"))
    assert covered == inp.rows_kv


# ---------------------------------------------------------------------------- doctor: parts

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.12
7f10a0000000-7f10a1000000 r-xp 00000000 08:01 901 /usr/lib/x86_64-linux-gnu/libcudnn_adv.so.9.14.0
7f10a1000000-7f10a1100000 r--p 01000000 08:01 901 /usr/lib/x86_64-linux-gnu/libcudnn_adv.so.9.14.0
7f10a2000000-7f10a2100000 r-xp 00000000 08:01 902 /usr/lib/x86_64-linux-gnu/libcudnn_engines_precompiled.so.9.14.0
7f10a3000000-7f10a3100000 r-xp 00000000 08:01 903 /opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
7f10a4000000-7f10a4100000 r-xp 00000000 08:01 904 /opt/cudnn-9.19/lib/libcudnn_graph.so.9.19.0 (deleted)
7f10a5000000-7f10a5100000 rw-p 00000000 00:00 0
7f10a6000000-7f10a6100000 r-xp 00000000 08:01 905 /usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0
7f10a7000000-7f10a7100000 r-xp 00000000 08:01 906 /usr/lib/x86_64-linux-gnu/libcudnn_frontend_fake.txt
7f10a8000000-7f10a8100000 r-xp 00000000 08:01 907 /usr/lib/x86_64-linux-gnu/libcublas.so.13
"""


def test_parse_cudnn_maps() -> None:
    libs = cudnn_route.parse_cudnn_maps(MAPS)
    assert [(lib.name, lib.version) for lib in libs] == [
        ("libcudnn_adv", "9.14.0"),
        ("libcudnn_engines_precompiled", "9.14.0"),
        ("libcudnn", "9"),
        ("libcudnn_graph", "9.19.0"),
        ("libcudnn", "9.14.0"),
    ]
    assert libs[3].path == "/opt/cudnn-9.19/lib/libcudnn_graph.so.9.19.0"  # "(deleted)" cut


def test_cudnn_warnings_flag_mixed_sets_and_duplicates() -> None:
    libs = cudnn_route.parse_cudnn_maps(MAPS)
    warnings = doctor.cudnn_library_warnings(libs, (9, 14, 0), (9, 19, 0))
    text = "\n".join(warnings)
    assert "mix versions" in text and "9.14" in text and "9.19" in text
    assert "libcudnn is mapped from 2 places" in text
    assert "Transformer Engine runs cuDNN 9.14.0 but torch's cuDNN is 9.19.0" in text
    clean = [lib for lib in libs if lib.version == "9.14.0"]
    assert doctor.cudnn_library_warnings(clean, (9, 14, 0), (9, 14, 2)) == []


@pytest.mark.parametrize(
    "encoded, expected",
    [(91400, (9, 14, 0)), (91901, (9, 19, 1)), (8907, (8, 9, 7)), (90000, (9, 0, 0)),
     (8000, (8, 0, 0)), (100000, (10, 0, 0))],
)  # fmt: skip
def test_decode_cudnn_version(encoded: int, expected: Tuple[int, int, int]) -> None:
    assert cudnn_route.decode_cudnn_version(encoded) == expected


@pytest.mark.parametrize(
    "verdict_status, live, fix_active, fallback, status, code",
    [
        ("not_affected", None, False, False, "healthy", 0),
        ("affected", None, False, False, "affected", 1),
        ("affected", None, True, False, "healthy", 0),
        ("unrepairable", None, True, False, "unrepairable", 4),
        ("unrepairable", None, True, True, "healthy", 0),  # the exact fallback covers it
        ("unrepairable", None, False, True, "affected", 1),  # it would, with the fix on
        ("unknown", None, False, False, "cannot_check", 3),
        ("unknown", {"ran": False, "error": "x"}, False, False, "cannot_check", 3),
        # an observation outranks the table of facts
        ("not_affected", {"ran": True, "bug_observed": True, "fix_ok": True}, False, False,
         "affected", 1),
        ("unknown", {"ran": True, "bug_observed": True, "fix_ok": True}, True, False, "healthy", 0),
        ("affected", {"ran": True, "bug_observed": False, "fix_ok": True}, False, False,
         "affected", 1),
        ("affected", {"ran": True, "bug_observed": True, "fix_ok": False}, True, False,
         "unrepairable", 4),
        ("unrepairable", {"ran": True, "bug_observed": True, "fix_ok": False}, True, True,
         "unrepairable", 4),
    ],
)  # fmt: skip
def test_decide_table(
    verdict_status: str,
    live: Optional[Dict[str, Any]],
    fix_active: bool,
    fallback: bool,
    status: str,
    code: int,
) -> None:
    assert doctor.decide(verdict_status, live, fix_active, fallback)[:2] == (status, code)


NEWEST_RIGHT = rules.version_text(rules.newest_right().cudnn[:2])  # 9.27 today


@pytest.mark.parametrize("te_cudnn", [(9, 14, 0), (9, 19, 0), None])
def test_doctor_advises_the_newest_right_build_to_an_older_one(te_cudnn) -> None:
    wrong_with_fix = {"ran": True, "bug_observed": True, "fix_ok": False}
    for status, live in (("unrepairable", None), ("affected", wrong_with_fix)):
        advice = doctor.decide(status, live, True, False, te_cudnn)[2]
        assert f"use cuDNN {NEWEST_RIGHT} or newer" in advice, (te_cudnn, advice)


@pytest.mark.parametrize(
    "status, live, fallback",
    [("unrepairable", None, False),
     ("affected", {"ran": True, "bug_observed": True, "fix_ok": False}, False),
     ("not_affected", {"ran": True, "bug_observed": False, "fix_ok": False}, False)],
)  # fmt: skip
@pytest.mark.parametrize("te_cudnn", [(9, 28, 1), (9, 28, 0), (9, 29, 0)])
def test_doctor_never_asks_to_install_the_cudnn_te_runs(status, live, fallback, te_cudnn) -> None:
    """A stack on the newest measured build (or a newer one) that still goes wrong is
    reported as such, never told to install what it runs (before: "use cuDNN 9.27 or
    newer" to a 9.27 user)."""
    code, advice = doctor.decide(status, live, True, fallback, te_cudnn)[1:]
    assert code == doctor.EXIT_UNREPAIRABLE
    assert f"use cuDNN {NEWEST_RIGHT}" not in advice and "or newer" not in advice, advice
    assert "report this stack" in advice, advice
    measured = rules.measurement_for(te_cudnn)[1]
    assert ("measured right here" in advice) is measured, advice  # 9.29: not measured


@pytest.mark.parametrize(
    "value, error",
    [("-1", "got -1"), ("0", "got 0"), ("257", "got 257"), ("100000", "got 100000"),
     ("1_0", "expected an integer head dim, got '1_0'"), ("\u0661", "expected an integer"),
     ("x", "expected an integer")],
)  # fmt: skip
def test_doctor_refuses_a_head_dim_outside_1_to_256(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, value: str, error: str
) -> None:
    ran: List[Any] = []
    monkeypatch.setattr(doctor, "run", lambda args: ran.append(args.head_dim) or 0)
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--no-live", "--head-dim", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and ran == []
    assert "doctor: error: argument --head-dim: expected " in err and error in err
    if "got" in error and "integer" not in error:
        assert "expected a head dim in 1..256" in err
    assert [main(["doctor", "--head-dim", d]) for d in ("1", "256")] == [0, 0] and ran == [1, 256]


@pytest.mark.parametrize(
    "te_cudnn, installed, head_dim, guard, declines, code",
    [
        ("9.14.0", False, None, None, None, doctor.EXIT_AFFECTED),
        ("9.14.0", True, None, None, None, doctor.EXIT_HEALTHY),
        ("9.14.0", True, 256, None, None, doctor.EXIT_HEALTHY),  # protected by the fallback
        ("9.14.0", False, 256, None, None, doctor.EXIT_AFFECTED),
        ("9.14.0", True, 256, "fallback", "head dim 288", doctor.EXIT_UNREPAIRABLE),
        ("9.14.0", True, 256, "warn", None, doctor.EXIT_UNREPAIRABLE),
        ("9.14.0", True, 256, "strict", None, doctor.EXIT_UNREPAIRABLE),
        ("9.14.0", True, 256, "off", None, doctor.EXIT_UNREPAIRABLE),
        ("9.19.0", False, None, None, None, doctor.EXIT_HEALTHY),
    ],
)
def test_collect_wires_facts_live_check_fallback_and_fix_state(
    monkeypatch: pytest.MonkeyPatch,
    doctor_probes: Callable[..., List[str]],
    te_cudnn: str,
    installed: bool,
    head_dim: Optional[int],
    guard: Optional[str],
    declines: Optional[str],
    code: int,
) -> None:
    """doctor's exit code from the stack's facts, the live check, the guard (a mistyped one:
    tests/test_settings.py), the fallback's coverage and whether the fix is installed."""
    live = {"ran": True, "bug_observed": te_cudnn < "9.18", "fix_ok": True}
    calls = doctor_probes(te_cudnn, installed, live, declines)
    if guard is not None:
        monkeypatch.setenv("TE_GQA_FIX_GUARD", guard)
    rep = doctor.collect(live=True, head_dim=head_dim)
    assert rep["exit_code"] == code
    assert calls == ["live"]
    assert rep["fix"]["installed"] is installed
    protected = head_dim == 256 and guard in (None, "fallback") and declines is None
    assert rep["verdict"]["fallback"] is protected
    if te_cudnn != "9.19.0":
        assert any("torch's cuDNN is 9.19.0" in w for w in rep["warnings"])
    text = doctor.format_report(rep)
    assert f"(exit {code})" in text and "cuDNN (TE runs)      " + te_cudnn in text
    assert ("computes its gradients" in text) is protected


def test_doctor_and_plan_say_what_the_fallback_covers(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    doctor_probes: Callable[..., List[str]],
) -> None:
    lines = ("exact: one covered configuration", "declined: one that is not")
    fallback = importlib.import_module("te_gqa_fix.fallback")
    monkeypatch.setattr(fallback, "coverage", lambda: lines)
    doctor_probes("9.14.0")
    rep = doctor.collect(live=False)
    assert rep["fallback"] == list(lines)
    text = doctor.format_report(rep)
    assert "exact fallback (TE_GQA_FIX_GUARD=fallback):\n  exact: one covered configuration\n" \
        "  declined: one that is not" in text  # fmt: skip
    assert main(["plan", *SEED_ARGS]) == 0
    assert (
        "  exact: one covered configuration\n  declined: one that is not" in capsys.readouterr().out
    )
    assert main(["plan", *SEED_ARGS, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fallback"] == list(lines)


def test_doctor_lists_every_setting_and_skips_the_live_check_on_request(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    doctor_probes: Callable[..., List[str]],
) -> None:
    calls = doctor_probes("9.14.0")
    monkeypatch.setenv("TE_GQA_FIX", "ALWAYS")
    assert main(["doctor", "--json", "--no-live"]) == doctor.EXIT_AFFECTED
    rep = json.loads(capsys.readouterr().out)
    assert calls == [] and rep["live_check"] == {"ran": False, "skipped": "--no-live"}
    listed = rep["settings"]
    assert list(listed) == list(SETTINGS)
    assert listed["TE_GQA_FIX"] == {**listed["TE_GQA_FIX"], "raw": "ALWAYS", "value": "always"}
    assert listed["TE_GQA_FIX_GUARD"]["value"] == "fallback"  # the default, unset
    assert all(s["error"] is None and s["help"] for s in listed.values())
    assert main(["doctor", "--no-live"]) == doctor.EXIT_AFFECTED
    text = capsys.readouterr().out
    assert "  TE_GQA_FIX           always  ('ALWAYS')\n" in text
    assert "  TE_GQA_FIX_GUARD     fallback  (unset)\n" in text


def test_doctor_judges_an_unreadable_cudnn_as_the_oldest_measured_build(
    capsys: pytest.CaptureFixture, doctor_probes: Callable[..., List[str]]
) -> None:
    """Hopper, TE imported but not saying which cuDNN it runs: doctor says it could not
    read it and judges the stack as the oldest measured build (stale rows; wrong on live
    rows above 128), not as unknown (before: "cannot check", exit 3)."""
    doctor_probes(None)
    oldest = rules.version_text(rules.MEASURED[0].cudnn)
    assert main(["doctor", "--no-live", "--json"]) == doctor.EXIT_AFFECTED
    rep = json.loads(capsys.readouterr().out)
    assert rep["verdict"]["status"] == "affected"
    said = " ".join(rep["unchecked"] + rep["verdict"]["reasons"])
    assert "could not report" in said or "did not report" in said, said
    assert f"oldest measured build, {oldest}" in said, said
    assert main(["doctor", "--no-live", "--head-dim", "256"]) == doctor.EXIT_AFFECTED
    text = capsys.readouterr().out
    assert "cuDNN (TE runs)      unknown" in text
    assert f"judged as the oldest measured build, {oldest}" in text
    assert "verdict (known facts): UNREPAIRABLE" in text  # d 256 is wrong on 9.14's live rows
    assert "the exact fallback (TE_GQA_FIX_GUARD=fallback) computes its gradients" in text


def test_doctor_names_unknown_settings_with_the_closest_known_one(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    doctor_probes: Callable[..., List[str]],
) -> None:
    """A misspelt setting is ignored by te-gqa-fix: doctor says so and names the setting it
    likely meant (before: not mentioned at all)."""
    doctor_probes("9.14.0")
    monkeypatch.setenv("TE_GQA_FIX_GAURD", "strict")
    monkeypatch.setenv("TE_GQA_FIX_ZZZZZZZZZZZZZZ", "1")
    assert main(["doctor", "--no-live", "--json"]) == doctor.EXIT_AFFECTED
    rep = json.loads(capsys.readouterr().out)
    assert {"name": "TE_GQA_FIX_GAURD", "closest": "TE_GQA_FIX_GUARD"} in rep["unknown_settings"]
    assert rep["settings"]["TE_GQA_FIX_GUARD"]["value"] == "fallback"  # the typo sets nothing
    main(["doctor", "--no-live"])
    text = capsys.readouterr().out
    assert "TE_GQA_FIX_GAURD is not a te-gqa-fix setting (ignored); did you mean " \
        "TE_GQA_FIX_GUARD?" in text  # fmt: skip
    assert "TE_GQA_FIX_ZZZZZZZZZZZZZZ is not a te-gqa-fix setting (ignored)\n" in text


@pytest.mark.parametrize("head_dim", [None, 256])
def test_assume_installed_judges_an_affected_stack_as_protected(
    capsys: pytest.CaptureFixture, doctor_probes: Callable[..., List[str]], head_dim
) -> None:
    """doctor runs in a process of its own, where a training script's install() never ran:
    ``--assume-installed`` judges the stack as that script's (exit 0 where the fix, or its
    exact fallback, covers it)."""
    doctor_probes("9.14.0", installed=False)
    args = ["doctor", "--no-live"] + ([] if head_dim is None else ["--head-dim", str(head_dim)])
    assert main(args) == doctor.EXIT_AFFECTED
    assert "te_gqa_fix.status()" in capsys.readouterr().out  # where to look, said
    assert main([*args, "--assume-installed"]) == doctor.EXIT_HEALTHY
    text = capsys.readouterr().out
    assert "(--assume-installed: judged as installed)" in text
    assert "status: healthy (exit 0): affected stack, and te-gqa-fix is active here" in text


@pytest.mark.parametrize("assumed", [False, True])
def test_doctor_with_the_fix_turned_off_is_not_healthy(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    doctor_probes: Callable[..., List[str]],
    assumed: bool,
) -> None:
    """TE_GQA_FIX=off makes an installed wrapper pass every call to TE untouched: an
    affected stack is affected, whatever is installed (before: "healthy, te-gqa-fix is
    active here"), and the advice says which setting turns the fix off."""
    doctor_probes("9.14.0", installed=not assumed)
    monkeypatch.setenv("TE_GQA_FIX", "off")
    args = ["doctor", "--no-live"] + ["--assume-installed"] * assumed
    assert main(args) == doctor.EXIT_AFFECTED
    text = capsys.readouterr().out
    assert "status: affected (exit 1): TE_GQA_FIX=off turns the fix off" in text
    assert "post-pass            off: TE_GQA_FIX=off" in text


@pytest.mark.parametrize(
    "impl, why, said",
    [("triton", None, "the Triton kernel"),
     ("pytorch", "Triton is unavailable (ImportError: no triton)",
      "PyTorch (Triton is unavailable (ImportError: no triton))")],
)  # fmt: skip
def test_doctor_names_the_post_pass_cuda_calls_get(
    monkeypatch: pytest.MonkeyPatch,
    doctor_probes: Callable[..., List[str]],
    impl: str,
    why: Optional[str],
    said: str,
) -> None:
    """Where the post-pass runs, doctor says whether CUDA calls get the Triton kernel or
    PyTorch's ops, and why PyTorch (a dozen device ops a call instead of one launch)."""
    doctor_probes("9.14.0")
    monkeypatch.setattr(postpass, "implementation", lambda: (impl, why))
    rep = doctor.collect(live=False)
    assert rep["post_pass"].endswith(f": {said}"), rep["post_pass"]
    assert "  post-pass            runs on THD backward calls" in doctor.format_report(rep)


# ----------------------------------------------------------- doctor: with a fake TE, or none


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees no CUDA device, even on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


REPORT_KEYS = {
    "te_gqa_fix", "python", "torch", "gpu", "transformer_engine", "cudnn_libraries",
    "warnings", "fix", "settings", "verdict", "live_check", "unchecked", "status", "exit_code",
    "advice", "exit_codes",
}  # fmt: skip


def test_doctor_without_gpu_or_te_says_what_it_could_not_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, no_gpu: None
) -> None:
    # A transformer_engine that cannot be imported shadows any real one.
    blocked = tmp_path / "transformer_engine"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in te_package.loaded_fake_modules():
        monkeypatch.delitem(sys.modules, name)
    assert main(["doctor", "--json"]) == doctor.EXIT_CANNOT_CHECK
    rep = json.loads(capsys.readouterr().out)
    assert REPORT_KEYS <= set(rep)
    assert rep["status"] == "cannot_check"
    assert rep["exit_code"] == doctor.EXIT_CANNOT_CHECK
    assert rep["gpu"]["available"] is False
    assert rep["transformer_engine"]["imported"] is False
    assert "blocked for this test" in rep["transformer_engine"]["error"]
    assert rep["verdict"]["status"] == "unknown"
    assert rep["live_check"]["ran"] is False
    unchecked = " ".join(rep["unchecked"])
    assert "GPU" in unchecked and "Transformer Engine" in unchecked and "live check" in unchecked
    assert main(["doctor"]) == doctor.EXIT_CANNOT_CHECK
    text = capsys.readouterr().out
    assert "could not check:" in text and "status: cannot_check (exit 3)" in text


@pytest.fixture
def cpu_te(fake_te: Path):
    """Rewrites the fake TE so that its fused attention runs on CPU: the forward returns
    zeros, the backward the exact gradients (the fp32 reference), plus stale values in the
    dK/dV rows no query reaches (``affected``), or also wrong live rows (``broken``), or none
    (``healthy``); ``sig`` picks TE 2.20's or TE 2.8's signature."""

    def write(bug: str = "affected", sig: str = "2.20") -> Path:
        return te_package.write_fake_te(
            fake_te, signature=sig, kernel="reference", bug=bug, consumers=False
        )

    return write


@pytest.mark.parametrize(
    "bug, sig, stale, observed, fix_ok",
    [("affected", "2.20", 2000.0, True, True), ("affected", "2.8", 2000.0, True, True),
     ("healthy", "2.20", 0.0, False, True), ("broken", "2.20", 2000.0, True, False)],
)  # fmt: skip
def test_live_check_sees_the_bug_and_the_fix(cpu_te, bug, sig, stale, observed, fix_ok) -> None:
    """Stale values 1000 x group 2 in dK/dV rows 0-3 unpatched (none on a clean stack), none
    patched; the live rows right with the fix, unless damaged beyond repair (``broken``)."""
    cpu_te(bug, sig)
    out = _live.live_check(device="cpu", poison_numel=1024)
    assert out.get("error") is None and out["ran"] is True
    before, after = out["unpatched"], out["patched"]
    assert before["max_abs_dk_rows_0_3"] == before["max_abs_dv_rows_0_3"] == stale
    assert after["max_abs_dk_rows_0_3"] == after["max_abs_dv_rows_0_3"] == 0.0
    assert after["rows_0_3_zero"] is True
    err = after["max_err_live_rows"]
    assert err < 1e-2 if fix_ok else err >= 0.5
    assert out["bug_observed"] is observed and out["fix_ok"] is fix_ok
    exit_code = doctor.EXIT_HEALTHY if fix_ok else doctor.EXIT_UNREPAIRABLE
    assert doctor.decide("affected", out, True)[1] == exit_code


def test_live_check_with_the_fix_turned_off_checks_no_fix(
    cpu_te, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TE_GQA_FIX=off: the patched variant would be TE itself, so it is skipped and the fix
    not judged (before: it read as the fix failing, "unrepairable", exit 4)."""
    cpu_te("affected")
    monkeypatch.setenv("TE_GQA_FIX", "off")
    out = _live.live_check(device="cpu", poison_numel=1024)
    assert out.get("error") is None and out["ran"] is True
    assert out["bug_observed"] is True and out["fix_ok"] is None
    assert out["patched"] == {"skipped": "TE_GQA_FIX=off"}
    assert doctor.decide("affected", out, False)[1] == doctor.EXIT_AFFECTED
    text = doctor.format_report({"live_check": out})
    assert "patched     skipped: TE_GQA_FIX=off" in text
    assert "with the fix: not checked (TE_GQA_FIX=off)" in text


def test_doctor_with_an_importable_te_but_no_gpu(
    cpu_te, capsys: pytest.CaptureFixture, no_gpu: None
) -> None:
    cpu_te()
    assert main(["doctor", "--json"]) == doctor.EXIT_CANNOT_CHECK
    rep = json.loads(capsys.readouterr().out)
    te = rep["transformer_engine"]
    assert te["imported"] is True and te["cudnn"] == "9.14.0"
    assert rep["verdict"]["status"] == "unknown"  # no compute capability without a GPU
    assert rep["live_check"]["ran"] is False


def test_module_entry_point_and_version(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("te-gqa-fix ")
    monkeypatch.setattr(sys, "argv", ["te_gqa_fix", "plan", *SEED_ARGS, "--json"])
    with pytest.raises(SystemExit) as exc:  # python -m te_gqa_fix
        runpy.run_module("te_gqa_fix", run_name="__main__")
    assert exc.value.code == 0
    zeroed = json.loads(capsys.readouterr().out)["dkv"]["zeroed_rows"]
    assert zeroed == [0, 1, 2, 3, 7, 8, 9, 10, 11]


def test_no_command_is_a_usage_error_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``python -m te_gqa_fix`` alone: the usage and what to give, on stderr, exit 2 (before:
    the whole help on stdout, where a script piping doctor's JSON would read it)."""
    monkeypatch.setattr(sys, "argv", ["te_gqa_fix"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("te_gqa_fix", run_name="__main__")
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.startswith("usage: te-gqa-fix") and "doctor or plan" in err
    assert len(err.splitlines()) <= 3, err  # the usage, not the help


# ----------------------------------------------------------------------------- cuDNN route


def _builds(monkeypatch: pytest.MonkeyPatch, te_dir: str, *extra: Any) -> None:
    wheel = cudnn_route.CudnnBuild("/venv/site-packages/nvidia/cudnn/lib", (9, 19, 0), "wheel", "header")  # fmt: skip
    system = cudnn_route.CudnnBuild("/usr/lib/x86_64-linux-gnu", (9, 14, 0), "system", "file name")  # fmt: skip
    monkeypatch.setattr(cudnn_route, "find_builds", lambda: [wheel, system, *extra])
    mapped = [cudnn_route.CudnnLibrary(f"{te_dir}/libcudnn.so.9", "libcudnn", None, "file name")]
    monkeypatch.setattr(cudnn_route, "mapped_cudnn_libraries", lambda: mapped)


def test_doctor_names_the_switch_to_an_unused_fixed_build(
    monkeypatch: pytest.MonkeyPatch, doctor_probes: Callable[..., List[str]]
) -> None:
    doctor_probes("9.14.0")
    _builds(monkeypatch, "/usr/lib/x86_64-linux-gnu")
    rep = doctor.collect(live=False)
    assert rep["exit_code"] == doctor.EXIT_AFFECTED
    assert rep["cudnn_route"]["switch"].startswith("TE_GQA_FIX_CUDNN=auto")
    assert "/venv/site-packages/nvidia/cudnn/lib" in rep["cudnn_route"]["switch"]
    assert rep["advice"].startswith("set TE_GQA_FIX_CUDNN=auto")
    runs = {b["version"]: b["te_runs"] for b in rep["cudnn_builds"]}
    assert runs == {"9.19.0": False, "9.14.0": True}
    text = doctor.format_report(rep)
    assert "switch cuDNN         TE_GQA_FIX_CUDNN=auto" in text
    assert "9.19.0    /venv/site-packages/nvidia/cudnn/lib  (wheel, right, fixed)" in text
    assert "9.14.0    /usr/lib/x86_64-linux-gnu  (system, wrong, affected, TE runs this)" in text


@pytest.mark.parametrize("te_runs", ["wheel", "system"])
def test_doctor_never_names_a_switch_to_the_build_te_runs(
    monkeypatch: pytest.MonkeyPatch, doctor_probes: Callable[..., List[str]], te_runs: str
) -> None:
    """TE on cuDNN 9.19 (right up to head dim 128, wrong at 256/128): no switch to 9.19
    itself, wherever it is loaded from, nor to an older fixed build; one to 9.27 when
    installed (before: "TE_GQA_FIX_CUDNN=auto (loads cuDNN 9.19.0 ...)", what runs)."""
    doctor_probes("9.19.0")
    older = cudnn_route.CudnnBuild("/opt/cudnn-9.18/lib", (9, 18, 0), "system", "header")
    other = cudnn_route.CudnnBuild("/opt/cudnn-9.19/lib", (9, 19, 0), "system", "header")
    te_dir = "/venv/site-packages/nvidia/cudnn/lib" if te_runs == "wheel" else other.lib_dir
    _builds(monkeypatch, te_dir, older, other)
    rep = doctor.collect(live=False)
    assert rep["cudnn_route"]["switch"] is None, rep["cudnn_route"]["switch"]
    assert "switch cuDNN" not in doctor.format_report(rep)
    newest = cudnn_route.CudnnBuild("/opt/cudnn-9.27/lib", (9, 27, 0), "system", "header")
    _builds(monkeypatch, te_dir, older, other, newest)
    switch = doctor.collect(live=False)["cudnn_route"]["switch"]
    assert switch.startswith("TE_GQA_FIX_CUDNN=/opt/cudnn-9.27/lib"), switch


def test_doctor_on_the_route_is_healthy_even_for_head_dim_256(
    monkeypatch: pytest.MonkeyPatch, doctor_probes: Callable[..., List[str]]
) -> None:
    """An unrepairable stack (d 256 on 9.14) that the route moved to 9.19 (measured right at
    d 256) reports healthy, with the d 256 live case requested, no switch, no mix
    warning, and the pass-through state."""
    calls = doctor_probes("9.19.0")
    right = cudnn_route.CudnnBuild("/venv/site-packages/nvidia/cudnn/lib", (9, 19, 0), "wheel", "header")  # fmt: skip
    monkeypatch.setattr(cudnn_route, "find_builds", lambda: [right])
    seen = {}

    def fake_live(large_head_dim: bool = False) -> Dict[str, Any]:
        seen["large"] = large_head_dim
        return {"ran": True, "bug_observed": False, "fix_ok": True}

    monkeypatch.setattr(doctor, "live_check", fake_live)
    monkeypatch.setattr(
        cudnn_route,
        "route_state",
        lambda: {"setting": "TE_GQA_FIX_CUDNN='auto'", "chosen": right.lib_dir,
                 "chosen_version": "9.19.0", "loaded": ["x"], "verified": True,
                 "te_cudnn": "9.19.0", "error": None},
    )  # fmt: skip
    mixed = {"version": "2.11", "cudnn": "9.14.0"}  # torch's cuDNN is not the one TE runs
    monkeypatch.setattr(doctor, "torch_info", lambda: mixed)
    rep = doctor.collect(live=True, head_dim=256)
    assert calls == []  # the replaced live check ran instead
    assert seen == {"large": True}
    assert rep["exit_code"] == doctor.EXIT_HEALTHY
    assert rep["cudnn_route"]["switch"] is None
    assert rep["warnings"] == [] and rep["notes"]
    assert rep["post_pass"].startswith("pass-through")
    text = doctor.format_report(rep)
    assert "cuDNN route          TE_GQA_FIX_CUDNN='auto': loaded cuDNN 9.19.0" in text
