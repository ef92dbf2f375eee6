"""docs/validation.md and docs/compatibility.md are what evidence/validation_report.py renders
from docs/data/validation.jsonl; a run's blocks replace only the (build, suite) blocks it
measured, each block keeping its own date, commit and GPU; ``collect`` keeps what ``render``
needs; the compatibility table and the figures (CPU only)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest

import evidence_common as ev
import validation_report as vr

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "data"


def _block(build: str, suite: str, date: str, commit: str, gpu: str, rows: List[Dict[str, Any]],
           te: str = "2.20.2", cudnn: str = "9.14.0") -> List[Dict[str, Any]]:  # fmt: skip
    stack = {"gpu": gpu, "gpu_count": 1, "te": te, "torch": "2.11.0+cu130", "cuda": "13.0",
             "driver": "580.1", "cudnn_te": cudnn, "date": date}  # fmt: skip
    head = ev.block_head(build, suite, date=date, commit=commit, command="bash run", stack=stack)
    return [head, *({**r, "build": build, "suite": suite} for r in rows)]


def _pytest(passed: int) -> Dict[str, Any]:
    counts = {"passed": passed, "failed": 0, "error": 0, "xfailed": 0, "skipped": 0}
    return {"kind": "pytest", "counts": counts, "not_passed": []}


def _summary_row(page: str, build: str) -> str:
    summary = page.split("## Summary")[1].split("\n## ")[0]
    return next(ln for ln in summary.splitlines() if ln.startswith(f"| {build} |"))


# ----------------------------------------------------------------------------- committed files


def test_committed_pages_are_what_the_data_file_renders() -> None:
    assert vr.check(), "run: python3 evidence/validation_report.py render"


def test_check_fails_when_the_page_or_the_data_changes(tmp_path: Path) -> None:
    for name in ("validation.md", "compatibility.md"):
        shutil.copy(ROOT / "docs" / name, tmp_path / name)
    shutil.copy(DATA / "validation.jsonl", tmp_path / "validation.jsonl")
    data, page = tmp_path / "validation.jsonl", tmp_path / "validation.md"
    assert vr.main(["render", str(data), "-o", str(page), "--check"]) == 0
    text = page.read_text()
    page.write_text(text.replace("| GPU-validated |", "| CPU fakes only |", 1))
    assert vr.main(["render", str(data), "-o", str(page), "--check"]) == 1
    page.write_text(text)
    recs = ev.read_jsonl(data)
    drop = next(k for k in ev.blocks(recs) if k[1] == "tests")
    ev.write_jsonl([r for r in recs if ev.key(r) != drop], data)
    assert not vr.check(data, page)


def test_data_files_are_one_per_page_small_and_in_blocks() -> None:
    assert sorted(p.name for p in DATA.iterdir()) == ["performance.jsonl", "validation.jsonl"]
    assert sum(p.stat().st_size for p in DATA.iterdir()) <= 2 << 20
    for name in ("validation.jsonl", "performance.jsonl"):
        recs = ev.read_jsonl(DATA / name)
        # performance merges by rows: a (build, benchmark) may hold blocks of several runs
        ev.check_blocks(recs, one_per_key=name == "validation.jsonl")
        for h in ev.heads(recs):
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT.*", h["date"]), h
            assert h["commit"] and h["gpu"] and h["stack"].get("te"), h


def test_the_page_shows_each_build_with_its_own_date_and_gpu() -> None:
    page = (ROOT / "docs" / "validation.md").read_text()
    tests = [h for h in ev.blocks(ev.read_jsonl(DATA / "validation.jsonl")).values()
             if h["suite"] == "tests"]  # fmt: skip
    assert tests
    for h in tests:
        row = _summary_row(page, h["build"])
        assert f"| {h['date'][:10]} | {ev.gpus_words(h)} |" in row


def test_the_page_has_no_raw_test_ids_or_python_dicts() -> None:
    page = (ROOT / "docs" / "validation.md").read_text()
    assert not re.search(r"\btest_\w+\.py::", page)
    assert not re.search(r"\{'\w+': ", page)


# ----------------------------------------------------------------------------- merge


def test_a_run_replaces_only_the_blocks_it_measured(tmp_path: Path) -> None:
    case = {
        "kind": "case",
        "test": "test_seed.py::test_seed_drop_in_is_exact",
        "patched": "drop-in",
    }
    gone = {"kind": "case", "test": "test_seed.py::test_gone", "patched": True}
    old = [
        *_block("system", "tests", "2026-12-01T00:00:00", "aaaaaaa", "NVIDIA H200",
                [case, gone, _pytest(300)]),
        *_block("cudnn927", "tests", "2026-12-02T00:00:00", "bbbbbbb", "NVIDIA H200",
                [case, _pytest(323)], cudnn="9.27.0"),
        *_block("system", "examples", "2026-12-01T00:00:00", "aaaaaaa", "NVIDIA H200",
                [{"kind": "example", "name": "seed_repro", "exit": 0, "result": "exact"}]),
    ]  # fmt: skip
    new = [
        *_block("system", "tests", "2026-12-06T00:00:00", "ccccccc", "NVIDIA H100 80GB HBM3",
                [case, _pytest(361)]),
        *_block("pip", "tests", "2026-12-06T00:00:00", "ccccccc", "NVIDIA H100 80GB HBM3",
                [case, _pytest(361)], cudnn="9.19.0"),
    ]  # fmt: skip
    data, run = tmp_path / "validation.jsonl", tmp_path / "run.jsonl"
    ev.write_jsonl(old, data)
    ev.write_jsonl(new, run)
    assert vr.main(["merge", str(run), "--into", str(data)]) == 0
    merged = ev.read_jsonl(data)

    def block(build: str, suite: str, recs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        return [r for r in recs if ev.key(r) == (build, suite)]

    assert block("cudnn927", "tests", merged) == block("cudnn927", "tests", old)
    assert block("system", "examples", merged) == block("system", "examples", old)
    assert block("system", "tests", merged) == block("system", "tests", new)
    assert block("pip", "tests", merged) == block("pip", "tests", new)
    assert gone not in [{k: v for k, v in r.items() if k not in ("build", "suite")} for r in merged]
    heads = ev.blocks(merged)
    assert heads["cudnn927", "tests"]["commit"] == "bbbbbbb"
    assert heads["system", "examples"]["date"].startswith("2026-12-01")
    assert heads["system", "tests"]["commit"] == "ccccccc"

    page = vr.render(merged, ["2.20"])
    assert "| 2026-12-02 | one NVIDIA H200 | 323 |" in _summary_row(page, "cudnn927")
    assert "| 2026-12-06 | one NVIDIA H100 80GB HBM3 | 361 |" in _summary_row(page, "system")
    assert "| `cudnn927` | GPU tests and doctor | 2026-12-02 | one NVIDIA H200 | bbbbbbb |" in page


def test_merging_the_same_run_twice_changes_nothing() -> None:
    old = _block("system", "tests", "2026-12-01T00:00:00", "aaaaaaa", "G", [_pytest(1)])
    new = _block("pip", "tests", "2026-12-02T00:00:00", "bbbbbbb", "G", [_pytest(2)])
    once = vr.merge(old, new)
    assert vr.merge(once, new) == once


def test_a_run_file_with_rows_outside_any_block_is_refused() -> None:
    new = _block("system", "tests", "2026-12-06T00:00:00", "c", "G", [_pytest(1)])
    stray = {"kind": "case", "test": "test_seed.py::x", "build": "pip", "suite": "tests"}
    with pytest.raises(ValueError, match="without a block"):
        vr.merge([], [*new, stray])
    with pytest.raises(ValueError, match="opened twice"):
        vr.merge([], [*new, *new])


# ----------------------------------------------------------------------------- collect


def test_collect_records_each_blocks_date_commit_and_gpu(tmp_path: Path) -> None:
    stack = {"kind": "stack", "gpu": "Fake GPU", "gpu_count": 1, "te": "2.20.2",
             "cudnn_te": "9.14.0", "cudnn_files": ["/x"], "date": "2026-01-02T03:04:05"}  # fmt: skip
    case = {"kind": "case", "test": "test_seed.py::t", "patched": True, "dk_dead_max": 0.0,
            "dk_err": 0.5, "dk_bound": 1.0}  # fmt: skip
    (tmp_path / "records-system.jsonl").write_text(
        json.dumps(stack) + "\n" + json.dumps(case) + "\n"
    )
    (tmp_path / "junit-system.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_seed" name="a"/>'
        '<testcase classname="tests.gpu.test_seed" name="test_b"><failure message="boom"/>'
        "</testcase></testsuite></testsuites>"
    )
    (tmp_path / "doctor-system.json").write_text(json.dumps({"status": "affected", "exit_code": 1}))
    unfinished = dict(stack, cudnn_te="9.19.0")  # records, but pytest was cut off: no junit
    (tmp_path / "records-pip.jsonl").write_text(json.dumps(unfinished) + "\n")
    probe = {"gpu": "Fake GPU", "gpu_count": 2, "te": "2.20.2", "cudnn_te": "9.14.0",
             "date": "2026-01-02T04:00:00"}  # fmt: skip
    (tmp_path / "stack-system.json").write_text(json.dumps(probe))
    (tmp_path / "seed_repro-system.log").write_text("te-gqa-fix: exact\nexit 0\n")
    out = tmp_path / "v.jsonl"
    args = ["collect", "--tests", str(tmp_path), "--extra", str(tmp_path), "--builds",
            "system,pip", "--commit", "abc1234", "-o", str(out)]  # fmt: skip
    assert vr.main(args) == 0
    recs = ev.read_jsonl(out)
    heads = ev.blocks(recs)
    assert set(heads) == {("system", "tests"), ("pip", "tests"), ("system", "examples")}
    for h in heads.values():
        assert h["commit"] == "abc1234" and h["gpu"] == "Fake GPU" and h["stack"]["te"] == "2.20.2"
    assert heads["system", "tests"]["date"] == "2026-01-02T03:04:05"
    assert heads["system", "examples"]["gpu_count"] == 1  # the examples use one GPU
    assert all(r["kind"] != "stack" and "cudnn_files" not in json.dumps(r) for r in recs)

    text = vr.render(recs, ["2.20"])
    assert _summary_row(text, "system") == (
        "| system | 9.14.0 | 2026-01-02 | one Fake GPU | 1 | 1 | 0 | 0 | affected (exit 1) |"
    )
    assert _summary_row(text, "pip") == "| pip | 9.19.0 | 2026-01-02 | one Fake GPU | - | - | - | - | - (exit -) |"  # fmt: skip
    assert "- `pip`: pytest did not finish" in text
    assert "- failed on `system`: *b* (`test_seed.py`): boom." in text
    assert "| system | patched, first call | 0 | - | 0.5 |" in text
    assert "abc1234" in text.split("## Runs")[1].split("##")[0]
    assert "| system | examples/seed_repro.py | 0 | `te-gqa-fix: exact` |" in text
    assert "03:04" not in text


def test_the_commit_comes_from_git_or_from_COMMIT(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMMIT", "feedbee")
    assert ev.code_commit(tmp_path) == "feedbee"
    monkeypatch.delenv("COMMIT")
    assert ev.code_commit(tmp_path) == "unknown"  # a copy of the tree without .git
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", ev.code_commit(ROOT))


def test_sequence_counts_section_only_with_its_records() -> None:
    head = _block("system", "tests", "2026-12-01T00:00:00", "a", "G", [])
    case = {"kind": "case", "build": "system", "suite": "tests", "d": 256, "deterministic": True,
            "sequences": [6, 3, 12], "exact": True, "dk_dead_max": 0.0, "dk_err": 0.25,
            "dk_bound": 1.0, "test": "test_sweep.py::test_sequence_counts_in_one_call_shape[256-det]"}  # fmt: skip
    assert "## Sequence counts in one call shape" not in vr.render(head)
    text = vr.render([*head, case])
    assert "| system | 256 | yes | 6, 3, 12 | yes | 0 | 0.25 |" in text
    assert "| system | 256 |" not in text.split("## Exactness sweep")[1].split("## Sequence")[0]


def test_the_status_of_each_build_shows_with_its_printed_form() -> None:
    status = {"kind": "status", "installed": True, "sites": ["a.f", "b.f"], "cudnn": "9.14.0",
              "gpu": "sm90", "verdict": "stale_rows", "postpass": "triton",
              "calls": {"calls": 1, "fixed": 1, "skipped": 0},
              "text": "te-gqa-fix  0.2.0\nfix         ACTIVE"}  # fmt: skip
    blocks = _block("system", "tests", "2026-12-01T00:00:00", "a", "G", [status])
    assert "## In-process status" not in vr.render(blocks[:1])
    text = vr.render(blocks)
    assert (
        "| system | active | 2 | 9.14.0 | sm90 | stale_rows | triton | calls 1, fixed 1 |" in text
    )
    assert "```\nte-gqa-fix  0.2.0\nfix         ACTIVE\n```" in text


def test_a_printed_result_reads_as_words() -> None:
    res = ("RESULT True 2 True {'dq_err': 0.1, 'dq_bound': 1.0, 'dq_dead_max': 0.0, "
           "'dk_err': 0.3, 'dk_bound': 1.0, 'dk_dead_max': 0.0}")  # fmt: skip
    case = {"kind": "case", "test": "test_graphs.py::test_head_dim_256_in_graph_through_startup_hook",
            "result": res}  # fmt: skip
    assert vr._graph_result(case) == (
        "exact: yes, fallback calls 2, expected unrepairable: yes, worst err/bound 0.3, "
        "dead-row max 0"
    )
    line = "cp_size=2 calls: {'calls': 2, 'fixed': 0} (fixed > 0: ok)"
    assert vr._dicts_as_words(line) == "cp_size=2 calls: calls 2, fixed 0 (fixed > 0: ok)"


# ----------------------------------------------------------------------------- compatibility


def _compat_rows(lines: List[str]) -> Dict[str, List[str]]:
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| ")]
    return {r[0]: r for r in rows}


def test_compatibility_marks_gpu_data_and_fakes_only() -> None:
    heads = [
        *_block("system", "tests", "2026-12-06T00:00:00", "c", "NVIDIA H100", [])[:1],
        *_block("cudnn927", "tests", "2026-12-02T00:00:00", "b", "NVIDIA H200", [],
                cudnn="9.27.0")[:1],
        *_block("pip", "tests", "2026-12-07T00:00:00", "d", "NVIDIA H200", [], te="2.21.0",
                cudnn="9.19.0")[:1],
    ]  # fmt: skip
    rows = _compat_rows(ev.compatibility(heads, ["2.8", "2.20"]))
    assert rows["2.20"][1:4] == ["2.20.2", "GPU-validated", "yes"]
    assert rows["2.20"][5] == "9.14.0, 9.27.0" and rows["2.20"][7] == "2026-12-06"
    assert rows["2.21"][1:4] == ["2.21.0", "GPU-validated", "no"]
    assert rows["2.8"][1:4] == ["-", "CPU fakes only", "yes"]
    assert rows["9.27.0"][1:3] == ["`cudnn927`", "GPU-validated"]
    assert list(rows).index("2.21") < list(rows).index("2.20") < list(rows).index("2.8")


def test_fake_releases_are_read_from_the_signatures_file(tmp_path: Path) -> None:
    src = tmp_path / "sigs.py"
    src.write_text('A = "x"\nSIGNATURES: Dict[str, str] = {"2.8": A, "2.20": A}\n')
    assert ev.fake_releases(src) == ["2.8", "2.20"]
    src.write_text("OTHER = {}\n")
    with pytest.raises(ValueError):
        ev.fake_releases(src)
    real = ev.fake_releases()
    assert real and all(isinstance(r, str) for r in real)
    compat = (ROOT / "docs" / "compatibility.md").read_text()
    assert all(f"| {r} |" in compat for r in real)


# ----------------------------------------------------------------------------- figures


def test_figures_draw_from_a_small_sample(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    recs: List[Dict[str, Any]] = []
    for build, te_exact, dead in (("system", False, float("inf")), ("pip", True, 0.0)):
        rows = [
            {"kind": "case", "test": f"test_head_dim.py::test_rule_matches_te[{d}]", "d": d,
             "d_v": d, "te_exact": te_exact or d == 128, "status": "x"}
            for d in (128, 256)
        ] + [
            {"kind": "case", "test": f"test_head_dim.py::test_wrapper_exact[{d}]", "d": d,
             "d_v": d, "exact": True, "fallback": int(not te_exact)}
            for d in (128, 256)
        ] + [
            {"kind": "case", "test": f"test_sweep.py::test_sweep[{h}]", "heads": h,
             "unpatched_dk_dead_max": dead if h == "16/1" else 3.5, "unpatched_corrupted": True,
             "patched_exact": True}
            for h in ("8/2", "16/1")
        ]  # fmt: skip
        recs += _block(build, "tests", "2026-12-01T00:00:00", "a", "G", rows)
    first = vr.draw_figures(recs, tmp_path / "a")
    assert [p.name for p in first] == ["validation-head-dims.svg", "validation-dead-rows.svg"]
    for p in first:
        text = p.read_text()
        assert p.stat().st_size > 1000 and text.lstrip().startswith("<?xml")
        assert "<dc:date>" not in text
    again = vr.draw_figures(recs, tmp_path / "b")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in first]
    assert vr.draw_figures(_block("x", "tests", "2026-12-01T00:00:00", "a", "G", []), tmp_path / "c") == []  # fmt: skip
