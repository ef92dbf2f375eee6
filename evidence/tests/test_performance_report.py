"""docs/performance.md is what evidence/performance_report.py renders from
docs/data/performance.jsonl; a run's blocks replace only the (build, benchmark) blocks it
measured, each block keeping its own date, commit and GPU; the figures draw (CPU only)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest

import evidence_common as ev
import performance_report as pr

ROOT = Path(__file__).resolve().parents[2]


def _stack(gpu: str, date: str, cudnn: str = "9.19.0") -> Dict[str, Any]:
    return {"gpu": gpu, "gpu_count": 1, "driver": "580.1", "torch": "2.11.0+cu130",
            "cuda": "13.0", "te": "2.20.2", "cudnn_te": cudnn, "date": date}  # fmt: skip


def _step(tokens: int, added: float) -> Dict[str, Any]:
    return {"tokens": tokens, "offsets": "two", "mode": "synced", "pairs": 10, "step_ms": 1.0,
            "added_us": added, "added_pct": added / 10, "added_us_ci95": [added - 1, added + 1],
            "calls_patched": {"calls": 5, "fixed": 5}}  # fmt: skip


def _fallback(tokens: int) -> List[Dict[str, Any]]:
    return [
        {"workload": f"{tokens // 1024}k", "tokens": tokens, "variant": v,
         "ms": {"synced": x, "back-to-back": x}, "x_te": {"synced": x, "back-to-back": x},
         **({"bitwise_repeatable": True} if "det" in v else {})}
        for v, x in (("te", 1.0), ("fallback", 1.3), ("fallback_deterministic", 1.6))
    ]  # fmt: skip


def _postpass(tokens: int) -> Dict[str, Any]:
    did = {"postpass": {"fixed": 1}, "passthrough": {"fixed": 0}}
    return {"name": f"llama8b-{tokens // 1024}k", "tokens": tokens, "heads": "32/8",
            "bytes_to_write": 4225 * tokens, "passthrough_via": "TE_GQA_FIX=off",
            "device_us": {"bwd": tokens / 8.0, "postpass_triton": tokens / 500, "postpass_torch": tokens / 20},
            "host_us": {"stub": 0.5, "postpass": 17.0, "launch": 7.5, "passthrough": 1.2, "did": did}}  # fmt: skip


def _doc(bench: str, build: str, gpu: str, date: str, rows: List[Dict[str, Any]], **extra: Any) -> Dict[str, Any]:  # fmt: skip
    key = "workloads" if bench == "postpass" else "rows"
    return {"bench": bench, "build": build, "date": date[:10], "stack": _stack(gpu, date),
            "command": f"GPU_KIT_CUDNN={build} python3 benchmarks/{bench}.py --out /tmp/x.json",
            key: rows, **extra}  # fmt: skip


def _blocks(doc: Dict[str, Any], commit: str) -> List[Dict[str, Any]]:
    return ev.compact(pr.blocks_of(doc, "bash evidence/run_benchmarks.sh", commit))


def test_committed_page_is_what_the_data_file_renders() -> None:
    assert pr.check(), "run: python3 evidence/performance_report.py render"


def test_check_fails_when_the_page_differs(tmp_path: Path) -> None:
    page, data = tmp_path / "performance.md", tmp_path / "performance.jsonl"
    shutil.copy(ROOT / "docs" / "performance.md", page)
    shutil.copy(pr.DATA, data)
    assert pr.main(["render", str(data), "-o", str(page), "--check"]) == 0
    page.write_text(page.read_text().replace(" ms |", " us |", 1))
    assert pr.main(["render", str(data), "-o", str(page), "--check"]) == 1


def test_a_missing_benchmark_renders_as_a_placeholder() -> None:
    recs = [r for r in ev.read_jsonl(pr.DATA) if r["suite"] != "step"]
    page = pr.render(recs)
    section = page.split("## Training step")[1].split("\n## ")[0]
    assert pr.PLACEHOLDER in section and "| build | tokens |" not in section


def test_a_run_of_one_benchmark_keeps_the_others_with_their_own_run(tmp_path: Path) -> None:
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    old = [
        *_blocks(_doc("step", "system", h200, "2026-12-04T01:00:00", [_step(2048, 30.0)]), "aaaaaaa"),
        *_blocks(_doc("fallback", "pip", h200, "2026-12-04T02:00:00", _fallback(8192)), "aaaaaaa"),
        *_blocks(_doc("startup", "system", h200, "2026-12-04T03:00:00", []), "aaaaaaa"),
    ]  # fmt: skip
    run = tmp_path / "run.jsonl"
    data = tmp_path / "performance.jsonl"
    ev.write_jsonl(old, data)
    raw = tmp_path / "step-system.json"
    raw.write_text(json.dumps(_doc("step", "system", h100, "2026-12-06T04:00:00", [_step(2048, 60.0)])))  # fmt: skip
    assert pr.main(["collect", str(raw), "--commit", "ccccccc", "-o", str(run)]) == 0
    assert pr.main(["merge", str(run), "--into", str(data)]) == 0
    merged = ev.read_jsonl(data)
    heads = ev.blocks(merged)
    assert set(heads) == {("system", "step"), ("pip", "fallback"), ("system", "startup")}
    assert heads["pip", "fallback"] == ev.blocks(old)["pip", "fallback"]
    assert heads["system", "startup"] == ev.blocks(old)["system", "startup"]
    assert heads["system", "step"]["commit"] == "ccccccc"
    assert heads["system", "step"]["gpu"] == h100
    assert [r["added_us"] for r in merged if r["suite"] == "step" and r["kind"] == "row"] == [60.0]
    assert len([r for r in merged if r["suite"] == "fallback" and r["kind"] == "row"]) == 3

    page = pr.render(merged)
    step = page.split("## Training step")[1].split("\n## ")[0]
    fallback = page.split("## The exact fallback")[1].split("\n## ")[0]
    assert f"Measured: `system` on one {h100}, 2026-12-06, commit ccccccc." in step
    assert f"Measured: `pip` on one {h200}, 2026-12-04, commit aaaaaaa." in fallback
    assert "| pip | 8k | fallback | 1.300 ms | 1.30x | 1.300 ms | 1.30x | - |" in fallback
    assert "| system | 2048 | two | synced | 1.000 ms | 60.0 us |" in step
    runs = page.split("## Runs")[1].split("\n## ")[0]
    assert f"| exact fallback | pip | 2026-12-04 | one {h200} | aaaaaaa |" in runs
    assert "--out" not in runs


def test_collect_keeps_what_render_needs(tmp_path: Path) -> None:
    doc = _doc("postpass", "system", "G", "2026-12-06T04:00:00", [_postpass(8192)], copy_GBps=4225.0)  # fmt: skip
    raw = tmp_path / "postpass-system.json"
    raw.write_text(json.dumps(doc))
    recs = pr.collect([raw], "QUICK=1 bash evidence/run_benchmarks.sh", "abc1234")
    head = ev.blocks(recs)["system", "postpass"]
    assert head["date"] == "2026-12-06T04:00:00" and head["commit"] == "abc1234"
    assert head["run"] == "QUICK=1 bash evidence/run_benchmarks.sh"
    assert head["params"] == {"copy_GBps": 4225.0}
    (back,) = pr.documents(recs)
    assert back["workloads"] == [ev.compact(_postpass(8192))] and back["copy_GBps"] == 4225.0
    page = pr.render(recs)
    assert "| system | llama8b-8k | 8192 | 32/8 | 1.02 ms | 16.4 us | 1.60% | 409.6 us |" in page
    assert "`QUICK=1 bash evidence/run_benchmarks.sh` (2026-12-06, one G: post-pass)" in page


def test_startup_rows_name_the_module_they_import() -> None:
    rows = [{"module": m, "import": {"unset": 10.0, "auto": 30.0, "added": 20.0},
             "process": {"unset": 20.0, "auto": 50.0, "added": 30.0},
             "te_cudnn": {"unset": 91400, "auto": 91900}}
            for m in ("torch", "transformer_engine.pytorch")]  # fmt: skip
    recs = _blocks(_doc("startup", "system", "G", "2026-12-06T04:00:00", rows, repeat=1), "a")
    page = pr.render(recs)
    for module in ("torch", "transformer_engine.pytorch"):
        assert f"| `import {module}` | import | 10 ms | 30 ms | 20 ms | 9.14.0 -> 9.19.0 |" in page
        assert f"| `import {module}` | process | 20 ms | 50 ms | 30 ms |" in page


def test_figures_draw_from_a_small_sample(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    recs = [
        *_blocks(_doc("postpass", "system", "G", "2026-12-06T04:00:00",
                      [_postpass(8192), _postpass(32768)], copy_GBps=4225.0), "a"),
        *_blocks(_doc("fallback", "pip", "H", "2026-12-04T04:00:00",
                      _fallback(8192) + _fallback(32768)), "b"),
    ]  # fmt: skip
    first = pr.draw_figures(recs, tmp_path / "a")
    assert [p.name for p in first] == ["performance-postpass.svg", "performance-fallback.svg"]
    for p in first:
        text = p.read_text()
        assert p.stat().st_size > 1000 and "<dc:date>" not in text
        assert "commit" in text  # the run each figure comes from is named on it
    again = pr.draw_figures(recs, tmp_path / "b")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in first]
    assert pr.draw_figures([], tmp_path / "c") == []
