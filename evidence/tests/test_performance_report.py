"""docs/performance.md is what evidence/performance_report.py renders from its data file; a
benchmark missing from the data renders as a placeholder; start-up rows name their module
(CPU only)."""

from __future__ import annotations

import json

import performance_report


def test_performance_page_is_rendered_from_its_data_file() -> None:
    assert performance_report.check(), "run: python3 evidence/performance_report.py render"


def test_a_missing_benchmark_renders_as_a_placeholder() -> None:
    data = json.loads(performance_report.DATA.read_text())
    data["results"] = [d for d in data["results"] if d["bench"] != "step"]
    assert performance_report.PLACEHOLDER in performance_report.render(data)


def test_startup_rows_name_the_module_they_import() -> None:
    rows = [{"module": m, "import": {"unset": 10.0, "auto": 30.0, "added": 20.0},
             "process": {"unset": 20.0, "auto": 50.0, "added": 30.0}, "te_cudnn": None}
            for m in ("torch", "transformer_engine.pytorch")]  # fmt: skip
    doc = {"bench": "startup", "date": "2026-12-06", "command": "python3 x", "stack": {}, "rows": rows}  # fmt: skip
    page = performance_report.render({"command": "bash evidence/run_benchmarks.sh", "results": [doc]})  # fmt: skip
    for module in ("torch", "transformer_engine.pytorch"):
        assert f"| `import {module}` | import | 10 ms | 30 ms | 20 ms |" in page
        assert f"| `import {module}` | process | 20 ms | 50 ms | 30 ms |" in page
