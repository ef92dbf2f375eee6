"""docs/validation.md is what evidence/validation_report.py renders from docs/data/validation.jsonl,
and ``collect`` keeps what ``render`` needs (CPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import validation_report

ROOT = Path(__file__).resolve().parents[2]


def _report():
    return validation_report


def test_validation_page_is_rendered_from_its_data_file() -> None:
    assert _report().check(), "run: python3 evidence/validation_report.py render"


def test_results_are_one_data_file_per_page_and_small() -> None:
    data = sorted(p.name for p in (ROOT / "docs" / "data").iterdir())
    assert data == ["performance.json", "validation.jsonl"]
    assert sum(p.stat().st_size for p in (ROOT / "docs" / "data").iterdir()) <= 1 << 20
    assert (
        not (ROOT / "docs" / "results").exists() and not (ROOT / "benchmarks" / "results").exists()
    )


def test_collect_then_render(tmp_path: Path) -> None:
    report = _report()
    stack = {
        "kind": "stack",
        "gpu": "Fake GPU",
        "cudnn_te": "9.14.0",
        "date": "2026-01-02T03:04:05",
    }
    case = {
        "kind": "case",
        "test": "test_seed.py::t",
        "patched": True,
        "dk_dead_max": 0.0,
        "dk_err": 0.5,
        "dk_bound": 1.0,
    }
    (tmp_path / "records-system.jsonl").write_text(
        json.dumps(stack) + "\n" + json.dumps(case) + "\n"
    )
    (tmp_path / "junit-system.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_seed" name="a"/>'
        '<testcase classname="tests.gpu.test_seed" name="b"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    (tmp_path / "doctor-system.json").write_text(json.dumps({"status": "affected", "exit_code": 1}))
    unfinished = dict(stack, cudnn_te="9.19.0")  # records, but pytest was cut off: no junit
    (tmp_path / "records-pip.jsonl").write_text(json.dumps(unfinished) + "\n")
    out = tmp_path / "v.jsonl"
    args = ["collect", "--tests", str(tmp_path), "--builds", "system,pip", "-o", str(out)]
    assert report.main(args) == 0
    text = report.render(report._jsonl(out))
    assert "| system | 9.14.0 | 1 | 1 | 0 | 0 | affected (exit 1) |" in text
    assert "| pip | 9.19.0 | - | - | - | - | - (exit -) |" in text
    assert "- `pip`: pytest did not finish" in text
    assert "- `system` failed: `test_seed.py::b`" in text
    assert "| system | t | yes | 0 | - | 0.5 |" in text
    assert "Date: 2026-01-02" in text and "03:04" not in text


def test_sequence_counts_section_only_with_its_records() -> None:
    report = _report()
    stack = {"kind": "stack", "part": "tests", "build": "system", "cudnn_te": "9.14.0"}
    case = {"kind": "case", "build": "system", "d": 256, "deterministic": True,
            "sequences": [6, 3, 12], "exact": True, "dk_dead_max": 0.0, "dk_err": 0.25,
            "dk_bound": 1.0, "test": "test_sweep.py::test_sequence_counts_in_one_call_shape[256-det]"}  # fmt: skip
    assert "## Sequence counts in one call shape" not in report.render([stack])
    text = report.render([stack, case])
    assert "| system | 256 | yes | [6, 3, 12] | yes | 0 | 0.25 |" in text
    assert "| system | 256 |" not in text.split("## Exactness sweep")[1].split("## Sequence")[0]
