"""The benchmark scripts' CPU parts, so that CI runs them.

``bench_postpass.py --selftest``: the host timer's paired medians on a fake clock, the
direct measurement's stub of TE's function (negative controls included) and the report's
goal decisions. ``bench_report.py``: the stored raw results of an older run (no direct
timings) still render, decided on the paired overheads, and regenerating
docs/performance.md and README.md touches only their generated blocks.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RAW = BENCH / "results" / "2026-11-30-h200x2-te2.20.2-both"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_report  # noqa: E402


def _split(text: str, markers: Sequence[str]) -> tuple:
    head, rest = text.split(markers[0], 1)
    block, tail = rest.split(markers[1], 1)
    return head + markers[0] + markers[1] + tail, block


def test_bench_postpass_selftest(capsys: pytest.CaptureFixture) -> None:
    import bench_postpass

    assert bench_postpass.main(["--selftest"]) == 0
    out = capsys.readouterr().out
    assert "stub check fires on a stub made with functools.wraps(TE's wrapper)" in out
    assert "stub check fires on a stub made with no signature" in out


def test_raw_results_without_direct_timings_render(tmp_path: Path) -> None:
    raw = [str(RAW / "system" / "bench.json"), str(RAW / "pip" / "bench.json")]
    reports = bench_report.load(raw)
    assert len(reports) == 2
    for report in reports:
        for res in report["workloads"]:
            s = bench_report.summarize(res, report["bandwidth"])
            for goal, name in (("host", "wrapper_host"), ("passthrough", "passthrough_host")):
                assert s[f"{goal}_goal_basis"] == "paired"
                assert s[f"{goal}_overhead_us"] == res["timings"][name]["overhead_us"]
                assert f"{goal}_overhead_direct_us" not in s
    doc, readme = tmp_path / "performance.md", tmp_path / "README.md"
    shutil.copy(ROOT / "docs" / "performance.md", doc)
    shutil.copy(ROOT / "README.md", readme)
    assert bench_report.main([*raw, "--doc", str(doc), "--readme", str(readme)]) == 0

    rest_before, _ = _split((ROOT / "docs" / "performance.md").read_text(), bench_report.RESULTS)
    rest_after, block = _split(doc.read_text(), bench_report.RESULTS)
    assert rest_after == rest_before
    assert block.strip() == bench_report.results_block(reports).strip()
    assert "| paired overhead vs TE | direct overhead (stub) | <= 15 us |" in block
    assert "| 34.6 us | - | NO (paired) |" in block  # llama8b-8k, cuDNN 9.14
    assert "wrapper host overhead (paired vs TE's call) <= 15 us: **NO**" in block

    rest_before, _ = _split((ROOT / "README.md").read_text(), bench_report.HEADLINE)
    rest_after, head = _split(readme.read_text(), bench_report.HEADLINE)
    assert rest_after == rest_before
    assert "us of host time per call to TE's" in " ".join(head.split())


def test_wake_table_renders_from_runs_that_have_it(tmp_path: Path) -> None:
    """Round 5's raw results have the direct timings in TE's wake: one row per workload and
    build; older results have none, and no table."""
    new = BENCH / "results" / "2026-11-30-h200-te2.20.2-round5-lane"
    reports = bench_report.load(
        [str(new / "system" / "bench.json"), str(new / "pip" / "bench.json")]
    )
    rows = bench_report.wake_table(reports)
    n = sum(len(r["workloads"]) for r in reports)
    assert len(rows) == 2 + n and n == 12
    res = reports[0]["workloads"][0]
    after = res["timings"]["wrapper_stub_host_after_te"]["overhead_us"]
    assert f"{after:.1f} us" in rows[2] and f"{res['host_context']['t_s']} s" in rows[2]
    old = bench_report.load([str(RAW / "system" / "bench.json")])
    assert bench_report.wake_table(old) == []


def test_checks_table_shows_how_the_steady_state_ran() -> None:
    """Round 8's raw results count the launches from C and the C-lane calls per workload:
    the checks table shows both; older results show "-"."""
    new = BENCH / "results" / "2026-12-01-h200-te2.20.2-round8-c-lane-repeat"
    reports = bench_report.load(
        [str(new / "system" / "bench.json"), str(new / "pip" / "bench.json")]
    )
    rows = bench_report.checks_table(reports)
    res = reports[0]["workloads"][1]  # llama8b-8k, cuDNN 9.14
    counts = f"| {res['checks']['launched_from_c']} / {res['checks']['c_lane_calls']} |"
    assert rows[3].endswith(counts) and "llama8b-8k" in rows[3]
    assert res["checks"]["c_lane_calls"] > 0
    old = bench_report.checks_table(bench_report.load([str(RAW / "system" / "bench.json")]))
    assert all(row.endswith("| - / - |") for row in old[2:])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc (Linux)")
def test_host_context_names_a_busy_thread() -> None:
    """The share of a CPU each thread used over the host timings: a thread spinning
    through the whole interval shows up, by its tid, and a sleeping one does not."""
    import threading
    import time

    import bench_postpass

    stop = threading.Event()
    tids: dict = {}

    def spin() -> None:
        tids["spin"] = threading.get_native_id()
        while not stop.is_set():
            pass

    def sleep() -> None:
        tids["sleep"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=sleep)]
    since = bench_postpass.host_snapshot()
    for t in threads:
        t.start()
    time.sleep(0.5)
    ctx = bench_postpass.host_context(since=since)
    stop.set()
    for t in threads:
        t.join()
    share = {int(name.split(":")[0]): v for name, v in ctx["thread_cpu_share"].items()}
    assert share.get(tids["spin"], 0) > 0.2, ctx
    assert tids["sleep"] not in share, ctx
    assert 0.0 <= ctx["steal_share_max"] <= 1.0, ctx


def test_damage_map_kinds_cover_the_postpass_rows(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """damage_map.py's kinds of zero-gradient rows are exactly the post-pass's rows, on
    every batch it measures; a kind left out fails the check."""
    import damage_map

    assert damage_map.main(["--selftest"]) == 0
    assert "the kinds cover exactly the post-pass's rows in 48 batches" in capsys.readouterr().out
    batch = damage_map.make("padding_causal", (8, 0), (8, 2), 64)
    real = damage_map.kinds
    for side, kind in (("kv", "unattended key"), ("kv", "padding"), ("q", "outside sequences")):

        def dropped(b, side=side, kind=kind):
            k = real(b)
            k[side][kind][:] = False
            return k

        monkeypatch.setattr(damage_map, "kinds", dropped)
        with pytest.raises(AssertionError, match=f"{side}: kinds differ"):
            damage_map.check_union(batch)
    monkeypatch.setattr(damage_map, "kinds", real)
    damage_map.check_union(batch)
