"""``te-gqa-fix plan`` and ``te-gqa-fix doctor`` on CPU (no GPU, no real TE).

The plan's expected rows are written out by hand from the mask definitions (one run of
rows per line below), never computed by the code under test. Doctor is checked on its
pure parts (maps parser, verdict, exit-code decision) with tables of facts, its wiring
with monkeypatched probes, its live check with a fake TE whose backward runs on CPU, and
end to end in a subprocess that sees no GPU and no importable TE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import te_package
from te_gqa_fix import affected, cudnn, doctor, doctor_text, stack
from te_gqa_fix.cli import main
from te_gqa_fix.plan import PlanInput, build_plan
from te_gqa_fix.postpass import dead_row_masks

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

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
    assert side["zeroed_rows"] == [i for i, c in enumerate(codes) if c not in kept]
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


def test_plan_seed_case_row_by_row(capsys: pytest.CaptureFixture) -> None:
    out = run_plan_json(capsys, SEED_ARGS)
    check_side(out["dkv"], SEED_KV, ("attended",))
    check_side(out["dq"], SEED_Q, ("valid_query",))
    assert out["consistent"] is True
    assert out["sequences"][1]["attended_keys"] == [0, 3]
    assert out["dkv"]["zeroed"] == 9 and out["dkv"]["kept"] == 3


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


def test_plan_context_parallel_step_row_by_row(capsys: pytest.CaptureFixture) -> None:
    out = run_plan_json(capsys, CP_STEP_ARGS)
    check_side(out["dkv"], CP_STEP_KV, ("attended",))
    check_side(out["dq"], CP_STEP_Q, ("valid_query",))


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


def test_plan_context_parallel_batch_with_tail_row_by_row(capsys: pytest.CaptureFixture) -> None:
    out = run_plan_json(capsys, CP_GLOBAL_ARGS)
    check_side(out["dkv"], CP_GLOBAL_KV, ("attended",))
    check_side(out["dq"], CP_GLOBAL_Q, ("valid_query",))


def test_plan_sliding_window_and_rows_before_the_first_sequence(
    capsys: pytest.CaptureFixture,
) -> None:
    # Sequence 0: 4 queries, 6 keys, bottom-right, window (1, 0): query i attends keys
    # i+1..i+2, so keys 1-5; key 0 is outside. Sequence 1: 2 queries, no keys.
    # Two rows before the first sequence in each buffer.
    args = [
        "--cu-seqlens-q", "0,4,6", "--padded-q", "2,6,8",
        "--cu-seqlens-kv", "0,6,6", "--padded-kv", "2,8,10",
        "--mask", "padding_causal_bottom_right", "--window", "1,0",
    ]  # fmt: skip
    out = run_plan_json(capsys, args)
    kv: Runs = [
        (0, 1, "before_first", None),
        (2, 2, "outside_window", 0),
        (3, 7, "attended", 0),
        (8, 9, "padding", 1),  # sequence 1 has no keys: its 2 rows are padding
    ]
    q: Runs = [
        (0, 1, "before_first", None),
        (2, 5, "valid_query", 0),
        (6, 7, "no_keys", 1),
    ]
    check_side(out["dkv"], kv, ("attended",))
    check_side(out["dq"], q, ("valid_query",))
    assert out["span"]["bottom_right"] is True and out["span"]["top_left"] is False


def test_plan_from_json_file_matches_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "batch.json"
    f.write_text(
        json.dumps(
            {
                "cu_seqlens_q": [0, 0, 3],
                "cu_seqlens_kv": [0, 3, 9],
                "cu_seqlens_q_padded": [0, 4, 12],
                "cu_seqlens_kv_padded": [0, 4, 12],
                "attn_mask_type": "padding_causal",
                "window_size": [-1, -1],
            }
        )
    )
    from_file = run_plan_json(capsys, ["--file", str(f)])
    from_flags = run_plan_json(capsys, SEED_ARGS)
    assert from_file == from_flags
    check_side(from_file["dkv"], SEED_KV, ("attended",))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cu-seqlens-q", "0,3", "--cu-seqlens-kv", "0,3,9"], "cu_seqlens_kv: expected 2"),
        (["--cu-seqlens-q", "0,3,1", "--cu-seqlens-kv", "0,3,9"], "non-decreasing"),
        (
            ["--cu-seqlens-q", "0,5", "--cu-seqlens-kv", "0,3", "--padded-q", "0,4"],
            "sequence 0 has 5 tokens",
        ),
        (
            ["--cu-seqlens-q", "0,3", "--cu-seqlens-kv", "0,3", "--rows-kv", "2"],
            "past the 2 kv rows",
        ),
    ],
)
def test_plan_rejects_bad_offsets(
    capsys: pytest.CaptureFixture, args: List[str], message: str
) -> None:
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_plan_needs_offsets(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--cu-seqlens-q", "0,1"])
    assert exc.value.code == 2


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
    i32 = dict(dtype=torch.int32)
    dead = dead_row_masks(
        torch.tensor(inp.cu_seqlens_q, **i32),
        torch.tensor(inp.cu_seqlens_kv, **i32),
        torch.tensor(inp.cu_seqlens_q_padded, **i32),
        torch.tensor(inp.cu_seqlens_kv_padded, **i32),
        rows_q=inp.rows_q,
        rows_kv=inp.rows_kv,
        attn_mask_type=inp.attn_mask_type,
        window_size=inp.window_size,
        bottom_right_diagonal=inp.bottom_right_diagonal,
    )
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
    libs = cudnn.parse_cudnn_maps(MAPS)
    assert [(lib.name, lib.version) for lib in libs] == [
        ("libcudnn_adv", "9.14.0"),
        ("libcudnn_engines_precompiled", "9.14.0"),
        ("libcudnn", "9"),
        ("libcudnn_graph", "9.19.0"),
        ("libcudnn", "9.14.0"),
    ]
    assert libs[3].path == "/opt/cudnn-9.19/lib/libcudnn_graph.so.9.19.0"  # "(deleted)" cut


def test_cudnn_warnings_flag_mixed_sets_and_duplicates() -> None:
    libs = cudnn.parse_cudnn_maps(MAPS)
    warnings = doctor.cudnn_library_warnings(libs, (9, 14, 0), (9, 19, 0))
    text = "\n".join(warnings)
    assert "mix versions" in text and "9.14" in text and "9.19" in text
    assert "libcudnn is mapped from 2 places" in text
    assert "Transformer Engine runs cuDNN 9.14.0 but torch's cuDNN is 9.19.0" in text
    clean = [lib for lib in libs if lib.version == "9.14.0"]
    assert doctor.cudnn_library_warnings(clean, (9, 14, 0), (9, 14, 2)) == []


def test_resolve_versions_from_the_owning_wheel(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    lib_dir = site / "nvidia" / "cudnn" / "lib"
    lib_dir.mkdir(parents=True)
    (lib_dir / "libcudnn_adv.so.9").write_bytes(b"")
    (site / "nvidia_cudnn_cu13-9.19.0.56.dist-info").mkdir()
    libs = cudnn.parse_cudnn_maps(f"7f-7f r-xp 00000000 08:01 1 {lib_dir / 'libcudnn_adv.so.9'}\n")
    (resolved,) = cudnn.resolve_versions(libs)
    assert resolved.version == "9.19.0.56" and resolved.source == "nvidia-cudnn wheel"


@pytest.mark.parametrize(
    "encoded, expected", [(91400, (9, 14, 0)), (91901, (9, 19, 1)), (8907, (8, 9, 7))]
)
def test_decode_cudnn_version(encoded: int, expected: Tuple[int, int, int]) -> None:
    assert cudnn.decode_cudnn_version(encoded) == expected


@pytest.mark.parametrize(
    "capability, cudnn, head_dim, status",
    [
        ((9, 0), (9, 14, 0), None, "affected"),
        ((9, 0), (9, 14, 0), 128, "affected"),
        ((9, 0), (9, 14, 0), 192, "unrepairable"),
        ((9, 0), (9, 14, 0), 256, "unrepairable"),
        ((9, 0), (9, 17, 9), 64, "affected"),
        ((9, 0), (9, 18, 0), None, "not_affected"),
        ((9, 0), (9, 19, 0), 256, "not_affected"),
        ((9, 0), (8, 9, 7), None, "affected"),
        ((8, 0), (9, 14, 0), 256, "not_affected"),
        ((10, 0), (9, 10, 0), None, "not_affected"),
        (None, (9, 14, 0), None, "unknown"),
        ((9, 0), None, None, "unknown"),
    ],
)
def test_verdict_table(
    capability: Optional[Tuple[int, int]],
    cudnn: Optional[Tuple[int, int, int]],
    head_dim: Optional[int],
    status: str,
) -> None:
    v = affected.verdict(capability, cudnn, head_dim)
    assert v.status == status
    assert v.reasons


@pytest.mark.parametrize(
    "verdict_status, live, fix_active, status, code",
    [
        ("not_affected", None, False, "healthy", 0),
        ("affected", None, False, "affected", 1),
        ("affected", None, True, "healthy", 0),
        ("unrepairable", None, True, "unrepairable", 4),
        ("unknown", None, False, "cannot_check", 3),
        ("unknown", {"ran": False, "error": "x"}, False, "cannot_check", 3),
        # an observation outranks the table of facts
        ("not_affected", {"ran": True, "bug_observed": True, "fix_ok": True}, False, "affected", 1),
        ("unknown", {"ran": True, "bug_observed": True, "fix_ok": True}, True, "healthy", 0),
        ("affected", {"ran": True, "bug_observed": False, "fix_ok": True}, False, "affected", 1),
        ("affected", {"ran": True, "bug_observed": True, "fix_ok": False}, True, "unrepairable", 4),
    ],
)
def test_decide_table(
    verdict_status: str,
    live: Optional[Dict[str, Any]],
    fix_active: bool,
    status: str,
    code: int,
) -> None:
    assert doctor.decide(verdict_status, live, fix_active)[:2] == (status, code)


def _fake_probes(
    monkeypatch: pytest.MonkeyPatch,
    capability: Optional[List[int]],
    te_cudnn: Optional[str],
    installed: bool = False,
    live: Optional[Dict[str, Any]] = None,
) -> List[str]:
    calls: List[str] = []
    gpu = {"available": capability is not None, "count": 1, "name": "Fake H200"}
    monkeypatch.setattr(stack, "gpu_info", lambda: {**gpu, "capability": capability})
    te = {"version": "2.20.2", "imported": True, "cudnn": te_cudnn, "error": None}
    monkeypatch.setattr(stack, "te_info", lambda: dict(te))
    monkeypatch.setattr(
        stack, "torch_info", lambda: {"version": "2.11.0", "cuda": "13.0", "cudnn": "9.19.0"}
    )
    monkeypatch.setattr(cudnn, "mapped_cudnn_libraries", lambda: [])
    monkeypatch.setattr(cudnn, "find_builds", lambda: [])

    def fake_live(large_head_dim: bool = False) -> Dict[str, Any]:
        calls.append("live")
        return live or {"ran": True, "bug_observed": True, "fix_ok": True}

    monkeypatch.setattr(doctor, "live_check", fake_live)
    monkeypatch.setattr("te_gqa_fix.patch.is_installed", lambda: installed)
    return calls


@pytest.mark.parametrize(
    "capability, te_cudnn, installed, head_dim, code",
    [
        ([9, 0], "9.14.0", False, None, doctor.EXIT_AFFECTED),
        ([9, 0], "9.14.0", True, None, doctor.EXIT_HEALTHY),
        ([9, 0], "9.14.0", True, 256, doctor.EXIT_UNREPAIRABLE),
        ([9, 0], "9.19.0", False, None, doctor.EXIT_HEALTHY),
    ],
)
def test_collect_wires_facts_live_check_and_fix_state(
    monkeypatch: pytest.MonkeyPatch,
    capability: List[int],
    te_cudnn: str,
    installed: bool,
    head_dim: Optional[int],
    code: int,
) -> None:
    live = {"ran": True, "bug_observed": te_cudnn < "9.18", "fix_ok": True}
    calls = _fake_probes(monkeypatch, capability, te_cudnn, installed, live)
    report = doctor.collect(live=True, head_dim=head_dim)
    assert report["exit_code"] == code
    assert calls == ["live"]
    assert report["fix"]["installed"] is installed
    if te_cudnn != "9.19.0":
        assert any("torch's cuDNN is 9.19.0" in w for w in report["warnings"])
    text = doctor_text.format_report(report)
    assert f"(exit {code})" in text and "cuDNN (TE runs)      " + te_cudnn in text


def test_collect_skips_the_live_check_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_probes(monkeypatch, [9, 0], "9.14.0")
    report = doctor.collect(live=False)
    assert calls == []
    assert report["live_check"] == {"ran": False, "skipped": "--no-live"}
    assert report["exit_code"] == doctor.EXIT_AFFECTED


# ------------------------------------------------------------------- doctor: subprocesses

REPORT_KEYS = {
    "te_gqa_fix", "python", "torch", "gpu", "transformer_engine", "cudnn_libraries",
    "warnings", "fix", "verdict", "live_check", "unchecked", "status", "exit_code", "advice",
    "exit_codes",
}  # fmt: skip


def _run_module(args: List[str], pythonpath: List[str], env: Optional[Dict[str, str]] = None):
    full = {k: v for k, v in os.environ.items() if not k.startswith("TE_GQA_FIX")}
    full["PYTHONPATH"] = os.pathsep.join(
        [*pythonpath, str(SRC)] + ([full["PYTHONPATH"]] if full.get("PYTHONPATH") else [])
    )
    full["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a GPU machine
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "te_gqa_fix", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_doctor_without_gpu_or_te_says_what_it_could_not_check(tmp_path: Path) -> None:
    # A transformer_engine that cannot be imported shadows any real one.
    blocked = tmp_path / "blocked" / "transformer_engine"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    proc = _run_module(["doctor", "--json"], [str(blocked.parent)])
    assert proc.returncode == doctor.EXIT_CANNOT_CHECK, proc.stderr
    report = json.loads(proc.stdout)
    assert REPORT_KEYS <= set(report)
    assert report["status"] == "cannot_check"
    assert report["exit_code"] == doctor.EXIT_CANNOT_CHECK
    assert report["gpu"]["available"] is False
    assert report["transformer_engine"]["imported"] is False
    assert report["verdict"]["status"] == "unknown"
    assert report["live_check"]["ran"] is False
    unchecked = " ".join(report["unchecked"])
    assert "GPU" in unchecked and "Transformer Engine" in unchecked and "live check" in unchecked
    text = _run_module(["doctor"], [str(blocked.parent)])
    assert text.returncode == doctor.EXIT_CANNOT_CHECK
    assert "could not check:" in text.stdout and "status: cannot_check (exit 3)" in text.stdout


_LIVE = (
    "import json; from te_gqa_fix.doctor import live_check; "
    "print('LIVE' + json.dumps(live_check(device='cpu', poison_numel=1024)))"
)


def write_fake_cpu_te(root: Path, bug: str = "affected", sig: str = "2.20") -> Path:
    """The fake TE whose fused attention runs on CPU: forward returns zeros, backward the
    exact gradients (the fp32 reference), plus stale values in the dK/dV rows no query
    reaches (``affected``), or also wrong live rows (``broken``), or none (``healthy``);
    ``sig`` picks TE 2.20's or TE 2.8's signature."""
    return te_package.write_fake_te(
        root, signature=sig, kernel="reference", bug=bug, consumers=False
    )


def _live(tmp_path: Path, mode: str, sig: str) -> Dict[str, Any]:
    fake = write_fake_cpu_te(tmp_path / "fake_cpu_te", mode, sig)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TE_GQA_FIX")}
    env.update(
        PYTHONPATH=os.pathsep.join([*te_package.pythonpath(fake, SRC), env.get("PYTHONPATH", "")]),
        CUDA_VISIBLE_DEVICES="",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _LIVE], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("LIVE")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[0][4:])


@pytest.mark.parametrize("sig", ["2.20", "2.8"])
def test_live_check_sees_the_bug_and_the_fix(tmp_path: Path, sig: str) -> None:
    out = _live(tmp_path, "affected", sig)
    assert out.get("error") is None and out["ran"] is True
    assert out["unpatched"]["max_abs_dk_rows_0_3"] == 2000.0  # 1000 x group 2
    assert out["unpatched"]["max_abs_dv_rows_0_3"] == 2000.0
    assert out["patched"]["max_abs_dk_rows_0_3"] == 0.0
    assert out["patched"]["max_abs_dv_rows_0_3"] == 0.0
    assert out["patched"]["max_err_live_rows"] < 1e-2
    assert out["bug_observed"] is True and out["fix_ok"] is True


def test_live_check_on_a_clean_stack(tmp_path: Path) -> None:
    out = _live(tmp_path, "healthy", "2.20")
    assert out["bug_observed"] is False and out["fix_ok"] is True
    assert out["unpatched"]["max_abs_dk_rows_0_3"] == 0.0


def test_live_check_reports_damage_the_fix_cannot_repair(tmp_path: Path) -> None:
    out = _live(tmp_path, "broken", "2.20")
    assert out["bug_observed"] is True
    assert out["patched"]["rows_0_3_zero"] is True
    assert out["patched"]["max_err_live_rows"] >= 0.5
    assert out["fix_ok"] is False
    assert doctor.decide("affected", out, True)[1] == doctor.EXIT_UNREPAIRABLE


def test_doctor_with_an_importable_te_but_no_gpu(tmp_path: Path) -> None:
    fake = write_fake_cpu_te(tmp_path / "fake_cpu_te")
    proc = _run_module(["doctor", "--json"], te_package.pythonpath(fake))
    assert proc.returncode == doctor.EXIT_CANNOT_CHECK, proc.stderr
    report = json.loads(proc.stdout)
    te = report["transformer_engine"]
    assert te["imported"] is True and te["cudnn"] == "9.14.0"
    assert report["verdict"]["status"] == "unknown"  # no compute capability without a GPU
    assert report["live_check"]["ran"] is False


def test_module_entry_point_and_version() -> None:
    proc = _run_module(["--version"], [])
    assert proc.returncode == 0 and proc.stdout.strip().startswith("te-gqa-fix ")
    proc = _run_module(["plan", *SEED_ARGS, "--json"], [])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["dkv"]["zeroed_rows"] == [0, 1, 2, 3, 7, 8, 9, 10, 11]


# ----------------------------------------------------------------------------- cuDNN route


def _builds(monkeypatch: pytest.MonkeyPatch, te_dir: str) -> None:
    wheel = cudnn.CudnnBuild("/venv/site-packages/nvidia/cudnn/lib", (9, 19, 0), "wheel", "header")
    system = cudnn.CudnnBuild("/usr/lib/x86_64-linux-gnu", (9, 14, 0), "system", "file name")
    monkeypatch.setattr(cudnn, "find_builds", lambda: [wheel, system])
    mapped = [cudnn.CudnnLibrary(f"{te_dir}/libcudnn.so.9", "libcudnn", None, "file name")]
    monkeypatch.setattr(cudnn, "mapped_cudnn_libraries", lambda: mapped)


def test_doctor_names_the_switch_to_an_unused_fixed_build(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _fake_probes(monkeypatch, [9, 0], "9.14.0")
    _builds(monkeypatch, "/usr/lib/x86_64-linux-gnu")
    report = doctor.collect(live=False)
    assert report["exit_code"] == doctor.EXIT_AFFECTED
    assert report["cudnn_route"]["switch"].startswith("TE_GQA_FIX_CUDNN=auto")
    assert "/venv/site-packages/nvidia/cudnn/lib" in report["cudnn_route"]["switch"]
    assert report["advice"].startswith("set TE_GQA_FIX_CUDNN=auto")
    runs = {b["version"]: b["te_runs"] for b in report["cudnn_builds"]}
    assert runs == {"9.19.0": False, "9.14.0": True}
    text = doctor_text.format_report(report)
    assert "switch to fixed cuDNN TE_GQA_FIX_CUDNN=auto" in text
    assert "9.19.0    /venv/site-packages/nvidia/cudnn/lib  (wheel, fixed)" in text
    assert "runs on THD backward calls" in report["post_pass"]


def test_doctor_on_the_route_is_healthy_even_for_head_dim_256(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unrepairable stack (d 256 on 9.14) that the route fixed reports healthy, with
    the d 256 live case requested, no switch, no mix warning, and the pass-through state."""
    calls = _fake_probes(monkeypatch, [9, 0], "9.19.0")
    _builds(monkeypatch, "/venv/site-packages/nvidia/cudnn/lib")
    seen = {}

    def fake_live(large_head_dim: bool = False) -> Dict[str, Any]:
        seen["large"] = large_head_dim
        return {"ran": True, "bug_observed": False, "fix_ok": True}

    monkeypatch.setattr(doctor, "live_check", fake_live)
    monkeypatch.setattr(
        cudnn,
        "route_state",
        lambda: {"setting": "auto", "chosen": "/venv/site-packages/nvidia/cudnn/lib",
                 "chosen_version": "9.19.0", "loaded": ["x"], "verified": True,
                 "te_cudnn": "9.19.0", "error": None},
    )  # fmt: skip
    report = doctor.collect(live=True, head_dim=256)
    assert calls == []  # the replaced live check ran instead
    assert seen == {"large": True}
    assert report["exit_code"] == doctor.EXIT_HEALTHY
    assert report["cudnn_route"]["switch"] is None
    assert report["warnings"] == [] and report["notes"]
    assert report["post_pass"].startswith("pass-through")
    assert "TE_GQA_FIX_CUDNN     auto: loaded cuDNN 9.19.0" in doctor_text.format_report(report)
