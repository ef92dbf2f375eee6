"""docs/performance.md is what evidence/performance_report.py renders from
docs/data/performance.jsonl; a run replaces only the rows it measured again (build,
benchmark and row key), every other row keeping its own run's date, commit, GPU and stack,
and the page names each row's run; the figures draw (CPU only)."""

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


# ----------------------------------------------------------------------------- rows by run

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _steps(added: float, tokens=(2048, 8192, 32768), offsets=("one", "two"),
           modes=("synced", "back-to-back")) -> List[Dict[str, Any]]:  # fmt: skip
    return [{**_step(t, added), "offsets": o, "mode": m}
            for t in tokens for o in offsets for m in modes]  # fmt: skip


def _merged(tmp_path: Path, old: List[Dict[str, Any]], *docs: Dict[str, Any],
            commit: str = "bbbbbbb") -> List[Dict[str, Any]]:  # fmt: skip
    """``old`` as the data file, ``docs`` collected as one run and merged into it (CLI)."""
    data, run = tmp_path / "performance.jsonl", tmp_path / "run.jsonl"
    ev.write_jsonl(old, data)
    raws = []
    for i, doc in enumerate(docs):
        raws.append(tmp_path / f"raw-{i}.json")
        raws[-1].write_text(json.dumps(doc))
    assert pr.main(["collect", *map(str, raws), "--commit", commit, "-o", str(run)]) == 0
    assert pr.main(["merge", str(run), "--into", str(data)]) == 0
    return ev.read_jsonl(data)


def _section(page: str, title: str) -> str:
    return page.split(f"## {title}")[1].split("\n## ")[0]


def test_a_partial_run_replaces_exactly_the_rows_it_measured_again(tmp_path: Path) -> None:
    old = _blocks(_doc("step", "system", H100, "2026-12-06T04:00:00", _steps(30.0)), "aaaaaaa")
    new = _doc("step", "system", H200, "2026-12-07T06:00:00",
               _steps(60.0, tokens=(2048, 8192), modes=("back-to-back",)))  # fmt: skip
    merged = _merged(tmp_path, old, new)
    ev.check_blocks(merged, one_per_key=False)
    (h_new, rows_new), (h_old, rows_old) = ev.split_blocks(merged)  # newest first
    assert [h_new[k] for k in ("commit", "gpu", "date")] == ["bbbbbbb", H200, "2026-12-07T06:00:00"]  # fmt: skip
    assert h_old == old[0]  # the earlier run's date, commit, GPU and stack, as they were
    key = lambda r: (r["tokens"], r["offsets"], r["mode"])  # noqa: E731
    assert sorted(map(key, rows_new)) == [(t, o, "back-to-back") for t in (2048, 8192) for o in ("one", "two")]  # fmt: skip
    assert {r["added_us"] for r in rows_new} == {60.0}
    kept = sorted(map(key, rows_old))
    assert kept == sorted(key(r) for r in old[1:] if key(r) not in set(map(key, rows_new)))
    assert len(kept) == 8 and {r["added_us"] for r in rows_old} == {30.0}

    step = _section(pr.render(merged), "Training step")
    lines = [ln for ln in step.splitlines() if ln.startswith("| system |")]
    # the benchmark's own order, whichever run each row comes from
    assert [ln.split(" | ")[1:4] for ln in lines] == [
        [str(t), o, m] for t in (2048, 8192, 32768) for o in ("one", "two") for m in ("synced", "back-to-back")
    ]  # fmt: skip
    assert "| system | 2048 | one | synced | 1.000 ms | 30.0 us |" in step
    for ln in lines:
        run = "2026-12-07 H200 bbbbbbb" if "back-to-back" in ln and "32768" not in ln else "2026-12-06 H100 aaaaaaa"  # fmt: skip
        assert ln.endswith(f" | {run} |"), ln
    assert f"`system` on one {H200}, 2026-12-07, commit bbbbbbb" in step
    assert f"`system` on one {H100}, 2026-12-06, commit aaaaaaa" in step
    runs = _section(pr.render(merged), "Runs")
    assert f"| training step | system | 2026-12-07 | one {H200} | bbbbbbb |" in runs
    assert f"| training step | system | 2026-12-06 | one {H100} | aaaaaaa |" in runs
    assert [ln.rsplit(" | ", 1)[1] for ln in runs.splitlines() if "| training step |" in ln] == ["4 |", "8 |"]  # fmt: skip

    # a run that measures the rest again leaves the first run with no rows: its block goes
    rest = _doc("step", "system", H200, "2026-12-08T06:00:00",
                [*_steps(90.0, tokens=(2048, 8192), modes=("synced",)), *_steps(90.0, tokens=(32768,))])  # fmt: skip
    again = _merged(tmp_path, merged, rest, commit="ccccccc")
    assert [(h["commit"], len(rs)) for h, rs in ev.split_blocks(again)] == [("ccccccc", 8), ("bbbbbbb", 4)]  # fmt: skip


def test_merging_the_same_run_twice_changes_nothing(tmp_path: Path) -> None:
    old = [
        *_blocks(_doc("step", "system", H100, "2026-12-06T04:00:00", _steps(30.0)), "aaaaaaa"),
        *_blocks(_doc("fallback", "pip", H100, "2026-12-06T05:00:00", _fallback(8192) + _fallback(32768)), "aaaaaaa"),
    ]  # fmt: skip
    run = [
        *_blocks(_doc("step", "system", H200, "2026-12-07T06:00:00", _steps(60.0, tokens=(2048,))), "bbbbbbb"),
        *_blocks(_doc("fallback", "pip", H200, "2026-12-07T07:00:00", _fallback(8192)), "bbbbbbb"),
    ]  # fmt: skip
    once = pr.merge(old, run)
    assert pr.merge(once, run) == once
    assert pr.merge(pr.merge(once, run), run) == once
    assert pr.render(pr.merge(once, run)) == pr.render(once)
    data = tmp_path / "performance.jsonl"
    ev.write_jsonl(once, data)
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run))
    before = data.read_bytes()
    assert pr.main(["merge", str(tmp_path / "run.jsonl"), "--into", str(data)]) == 0
    assert data.read_bytes() == before


def test_an_earlier_run_merged_late_does_not_replace_later_rows() -> None:
    newer = _blocks(_doc("step", "pip", H200, "2026-12-07T06:00:00", _steps(60.0, tokens=(2048,))), "b")  # fmt: skip
    older = _blocks(_doc("step", "pip", H100, "2026-12-06T04:00:00", _steps(30.0)), "a")
    merged = pr.merge(newer, older)
    (h1, r1), (h2, r2) = ev.split_blocks(merged)
    assert (h1["commit"], len(r1), h2["commit"], len(r2)) == ("b", 4, "a", 8)
    assert {r["tokens"] for r in r2} == {8192, 32768}


def test_each_row_of_every_table_names_its_run_and_ratios_stay_within_their_run(tmp_path: Path) -> None:  # fmt: skip
    unlaunched = [_postpass(8192), _postpass(131072)]
    for w in unlaunched:
        del w["host_us"]["launch"]  # the earlier run did not time the launch alone
    old = [
        *_blocks(_doc("postpass", "system", H100, "2026-12-06T04:00:00", unlaunched,
                      copy_GBps=3000.0), "aaaaaaa"),
        *_blocks(_doc("fallback", "pip", H100, "2026-12-06T05:00:00",
                      _fallback(8192) + _fallback(32768)), "aaaaaaa"),
        *_blocks(_doc("startup", "system", H100, "2026-12-06T06:00:00",
                      [{"module": "torch", "import": {"unset": 1.0, "auto": 2.0, "added": 1.0},
                        "process": {"unset": 1.0, "auto": 2.0, "added": 1.0}}]), "aaaaaaa"),
    ]  # fmt: skip
    # the new run: 8K only, TE's backward slower, the fallback's ratio to it 1.1x
    fb = [{**r, "ms": {m: 2 * x for m, x in r["ms"].items()},
           "x_te": {m: (1.1 if r["variant"] == "fallback" else x) for m, x in r["x_te"].items()}}
          for r in _fallback(8192)]  # fmt: skip
    merged = _merged(
        tmp_path, old,
        _doc("postpass", "system", H200, "2026-12-07T06:00:00", [_postpass(8192)], copy_GBps=4000.0),
        _doc("fallback", "pip", H200, "2026-12-07T07:00:00", fb),
    )  # fmt: skip
    page = pr.render(merged)
    new, was = "2026-12-07 H200 bbbbbbb", "2026-12-06 H100 aaaaaaa"
    fallback = _section(page, "The exact fallback")
    assert f"| pip | 8k | te | 2.000 ms | 1.00x | 2.000 ms | 1.00x | - | {new} |" in fallback
    assert f"| pip | 8k | fallback | 2.600 ms | 1.10x | 2.600 ms | 1.10x | - | {new} |" in fallback
    # 32K: the earlier run's rows and ratios, to the `te` row of that run
    assert f"| pip | 32k | te | 1.000 ms | 1.00x | 1.000 ms | 1.00x | - | {was} |" in fallback
    assert f"| pip | 32k | fallback | 1.300 ms | 1.30x | 1.300 ms | 1.30x | - | {was} |" in fallback
    device = _section(page, "Post-pass device time")
    # the write bound of each row is over the copy bandwidth its own run measured
    assert f"| system | llama8b-8k | 8192 | 32/8 | 1.02 ms | 16.4 us | 1.60% | 409.6 us | 34.6 MB | 1.89x | {new} |" in device  # fmt: skip
    assert f"| system | llama8b-128k | 131072 | 32/8 | 16.38 ms | 262.1 us | 1.60% | 6554.0 us | 553.8 MB | 1.42x | {was} |" in device  # fmt: skip
    host = _section(page, "Host time of the wrapper")
    assert f"| system | llama8b-8k | 0.5 us | +17.0 us | 7.5 us | +1.2 us | TE_GQA_FIX=off | {new} |" in host  # fmt: skip
    assert f"| system | llama8b-128k | 0.5 us | +17.0 us | - | +1.2 us | TE_GQA_FIX=off | {was} |" in host  # fmt: skip
    assert f"| `import torch` | import | 1 ms | 2 ms | 1 ms | - -> - | {was} |" in page
    runs = _section(page, "Runs")
    assert len([ln for ln in runs.splitlines() if ln.startswith("| post-pass | system |")]) == 2
    assert len([ln for ln in runs.splitlines() if ln.startswith("| exact fallback | pip |")]) == 2


def test_figures_draw_each_row_once_from_several_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    old = _blocks(_doc("fallback", "pip", H100, "2026-12-06T05:00:00", _fallback(8192) + _fallback(32768)), "aaaaaaa")  # fmt: skip
    merged = pr.merge(old, _blocks(_doc("fallback", "pip", H200, "2026-12-07T07:00:00", _fallback(8192)), "bbbbbbb"))  # fmt: skip
    (fig,) = pr.draw_figures(merged, tmp_path)
    text = fig.read_text()
    assert "commit bbbbbbb" in text and "commit aaaaaaa" in text
    assert (
        "fallback, 2026-12-07 H200 bbbbbbb" in text and "fallback, 2026-12-06 H100 aaaaaaa" in text
    )
