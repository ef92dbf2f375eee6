"""The benchmarks' CPU parts: the post-pass benchmark counts the post-pass's own rows, its
host timing measures the modes it names (on a fake TE with TE 2.20's signature), the
fallback's benchmark makes TE's cuDNN judged wrong at its head dim and its timing goes on
past a call out of memory, start-up rows name their module, and every benchmark reaches
te-gqa-fix through its public API and ``wrapper_for`` only. The performance page made from
their output is tested in evidence/tests."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any, List

import pytest
import torch

import te_gqa_fix
from fakes.oracle import Ragged
from fakes.te_outputs import call_arguments
from fakes.te_signatures import build_fake
from te_gqa_fix import dead_row_masks, rules

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_postpass  # noqa: E402
import fallback_cost  # noqa: E402
from common import packed  # noqa: E402


def _batch(tokens: int) -> Ragged:
    """``packed(tokens)`` as the fakes' batch: both sides padded alike, ``tokens`` rows each."""
    b = packed(tokens)
    return Ragged(*(tuple(b[n]) for n in ("lq", "lk", "pad", "pad")), tokens, tokens)


@pytest.mark.parametrize("name", list(bench_postpass.WORKLOADS))
def test_dead_rows_are_the_postpass_rows(name: str) -> None:
    tokens = bench_postpass.WORKLOADS[name][0]
    dead = dead_row_masks(
        *_batch(tokens).tensors(), rows_q=tokens, rows_kv=tokens, attn_mask_type=bench_postpass.MASK
    )
    want = {"kv": int(dead.kv.sum()), "q": int(dead.q.sum())}
    assert bench_postpass.dead_rows(packed(tokens), tokens) == want


def test_host_timing_measures_the_modes_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.delenv("TE_GQA_FIX", raising=False)
    te_calls = []

    def body(bound):
        te_calls.append(1)
        return [torch.full_like(bound[n], 1000.0) for n in ("q", "k", "v")] + [None]

    te = build_fake("2.20", body)
    kw = call_arguments(  # 4 query heads, 2 KV heads
        "2.20", _batch(512), head_dim=8, dtype=torch.bfloat16, attn_mask_type=bench_postpass.MASK
    )
    out = te(**kw)
    res = bench_postpass.host_us(te, kw, out, {"postpass": "always", "passthrough": "off"}, 20)
    assert len(te_calls) == 1, "the stub must stand in for TE's function"
    assert set(res) == {"stub", "did", "postpass", "passthrough"}
    assert res["did"]["postpass"]["fixed"] == 1 and res["did"]["passthrough"]["fixed"] == 0
    assert all(res["did"][m]["returned_stub_output"] for m in ("postpass", "passthrough"))
    assert (
        int((out[1] == 0).all(dim=(1, 2)).sum()) == bench_postpass.dead_rows(packed(512), 512)["kv"]
    )


@pytest.mark.parametrize("cudnn", [(9, 14, 0), (9, 19, 0), (9, 27, 0), (9, 28, 0), None])
def test_the_fallback_benchmark_judges_te_wrong_at_its_head_dim(
    monkeypatch: pytest.MonkeyPatch, cudnn: Any
) -> None:
    """Its one knob makes whichever cuDNN TE runs judged wrong on live rows at head dim
    256 (so the wrapper takes the exact fallback, as on a build measured wrong there) and
    changes nothing else the rule says."""
    monkeypatch.setattr(rules, "MEASURED", rules.MEASURED)  # put back afterwards
    before = {d: rules.judge((9, 0), cudnn, d, d).status for d in (64, 128, 192)}
    fallback_cost.judge_wrong_at(fallback_cost.D)
    assert rules.judge((9, 0), cudnn, 256, 256).status == "live_rows_wrong"
    assert {d: rules.judge((9, 0), cudnn, d, d).status for d in (64, 128, 192)} == before
    assert rules.judge((8, 0), cudnn, 256, 256).status == "not_hopper"


def _te_gqa_fix_uses(path: Path) -> List[str]:
    """Every name of te-gqa-fix a script imports or reads: ``te_gqa_fix.X`` attributes and
    ``from te_gqa_fix[.M] import X`` (as ``M.X``), nested functions included."""
    tree = ast.parse(path.read_text())
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("te_gqa_fix"):
            used += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            used += [a.name for a in node.names if a.name.startswith("te_gqa_fix.")]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "te_gqa_fix"
        ):
            used.append(f"te_gqa_fix.{node.attr}")
    return used


def test_benchmarks_use_the_public_api_and_wrapper_for_only() -> None:
    """What the benchmarks time is what users call: a benchmark that reached into the
    package's internals would time (and break with) something no user runs. The fallback
    benchmark's knob (``rules.MEASURED``) is the one documented exception."""
    allowed = {f"te_gqa_fix.{name}" for name in te_gqa_fix.__all__}
    allowed.add("te_gqa_fix.wrapper.wrapper_for")
    for path in sorted(BENCH.glob("*.py")):
        extra = {"te_gqa_fix.rules"} if path.name == "fallback_cost.py" else set()
        bad = [u for u in _te_gqa_fix_uses(path) if u not in allowed | extra]
        assert not bad, f"{path.name} uses {bad}"


def test_a_call_out_of_memory_while_timed_leaves_the_rounds_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A function of fallback_cost's rounds that runs out of memory mid-run is returned
    with its error and no time; every other function is still timed in every round."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(fallback_cost, "event_ms", lambda fn: (fn(), 1.0)[1])
    calls = {"te": 0, "big": 0}

    def call(name: str, fails_at: int = 0) -> Any:
        def fn() -> None:
            calls[name] += 1
            if calls[name] == fails_at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.25 GiB")

        return fn

    reps = 4
    ms, errors = fallback_cost.timed({"te": call("te"), "big": call("big", fails_at=9)}, reps)
    assert set(ms) == {"te"}
    assert ms["te"] == {"synced": 1.0, "back-to-back": 1.0 / fallback_cost.BLOCK}
    assert list(errors) == ["big"] and errors["big"].startswith("out of memory while timed")
    blocks = max(3, reps // 2)
    assert calls["te"] == 3 + reps + blocks * fallback_cost.BLOCK  # warm-up, synced, blocks
    assert calls["big"] == 9  # 3 warm-up, 4 synced, then 2 calls into its first block


def test_startup_rows_name_the_module_they_import(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each start-up row keeps its module next to the import and process timings (the child
    processes are faked: 10/20 ms unset, 30/50 ms auto)."""
    import startup_cudnn

    def one(module, setting):
        auto = setting == "auto"
        return {"import_s": 0.03 if auto else 0.01, "process_s": 0.05 if auto else 0.02,
                "te_cudnn": None}  # fmt: skip

    monkeypatch.setattr(startup_cudnn, "one", one)
    out = tmp_path / "startup.json"
    assert startup_cudnn.main(["--repeat", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["module"] for r in doc["rows"]] == ["torch", "transformer_engine.pytorch"]
    for r in doc["rows"]:
        assert r["import"] == pytest.approx({"unset": 10.0, "auto": 30.0, "added": 20.0})
        assert r["process"] == pytest.approx({"unset": 20.0, "auto": 50.0, "added": 30.0})
