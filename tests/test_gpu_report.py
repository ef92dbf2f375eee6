"""The committed validation page is what ``tests/gpu/report.py`` renders from the committed
data file, and ``collect`` keeps what ``render`` needs (CPU only)."""

from __future__ import annotations

import json
from pathlib import Path

from fakes.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted((ROOT / "docs" / "results").glob("*/run.json"))


def _report():
    return load_script("te_gqa_fix_gpu_report", ROOT / "tests/gpu/report.py")


def test_each_run_is_one_data_file() -> None:
    assert RUNS, "no docs/results/<run>/run.json"
    for run in RUNS:
        assert [p.name for p in run.parent.iterdir()] == ["run.json"], run.parent


def test_validation_page_is_rendered_from_the_latest_run() -> None:
    data = json.loads(RUNS[-1].read_text())
    assert _report().render(data) == (ROOT / "docs" / "validation.md").read_text()


def test_collect_then_render_round_trip(tmp_path: Path) -> None:
    report = _report()
    res = tmp_path / "res"
    res.mkdir()
    stack = {"kind": "stack", "gpu": "Fake GPU", "cudnn_te": "9.14.0", "date": "today"}
    case = {"kind": "case", "test": "test_seed.py::t", "cudnn": "9.14.0", "patched": True}
    (res / "records-system.jsonl").write_text(json.dumps(stack) + "\n" + json.dumps(case) + "\n")
    (res / "junit-system.xml").write_text(
        '<testsuites><testsuite><testcase classname="c" name="a"/>'
        '<testcase classname="c" name="b"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>"
    )
    (res / "doctor-system.json").write_text(json.dumps({"status": "affected"}))
    out = tmp_path / "run.json"
    assert report.main(["collect", str(res), "--builds", "system", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    build = data["builds"]["system"]
    assert build["pytest"]["counts"]["passed"] == 1 and build["pytest"]["counts"]["failed"] == 1
    assert build["pytest"]["outcomes"] == {"c::a": "passed", "c::b": "failed"}
    text = report.render(data)
    assert "| system (cuDNN 9.14.0) | 1 | 1 | 0 | 0 | 0 |" in text
    assert "FAILED `c::b: boom`" in text and '"status": "affected"' in text
