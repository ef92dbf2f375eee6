"""The benchmarks' CPU parts: the post-pass benchmark counts the post-pass's own rows, its
host timing measures the modes it names (on a fake TE with TE 2.20's signature), the
fallback's timing goes on past a call out of memory, and start-up rows name their module.
The performance page made from their output is tested in evidence/tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fakes.oracle import Ragged
from fakes.te_outputs import call_arguments
from fakes.te_signatures import build_fake
from te_gqa_fix.postpass import dead_row_masks

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
    offs = tuple(kw[f"cu_seqlens_{side}"] for side in ("q", "kv", "q_padded", "kv_padded"))
    out = te(**kw)
    launched = []
    plan = object()  # what prepare_kernel returns where CUDA and Triton are present
    monkeypatch.setattr(bench_postpass, "prepare_kernel", lambda *a: plan)
    monkeypatch.setattr(bench_postpass, "run_kernel", lambda *a: launched.append(a))
    res = bench_postpass.host_us(te, kw, out, {"postpass": "always", "passthrough": "off"}, 20)
    assert len(te_calls) == 1, "the stub must stand in for TE's function"
    assert "launch" in res and len(launched) == 30  # 10 warm-up rounds + 20
    want = (plan, *out[:3], offs)  # TE's order: valid q/kv, padded q/kv
    assert all(len(a) == 5 and all(x is y for x, y in zip(a[:4], want)) for a in launched)
    assert all(all(x is y for x, y in zip(a[4], want[4])) for a in launched)
    assert res["did"]["postpass"]["fixed"] == 1 and res["did"]["passthrough"]["fixed"] == 0
    assert all(res["did"][m]["returned_stub_output"] for m in ("postpass", "passthrough"))
    assert (
        int((out[1] == 0).all(dim=(1, 2)).sum()) == bench_postpass.dead_rows(packed(512), 512)["kv"]
    )


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
