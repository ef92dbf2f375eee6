"""CPU tests of evidence/multigpu/cp_check.py's pure parts: batch shapes, the DualChunkSwap
cross-check, the fp32/bf16 references (tests/thd.py's, against SDPA), and cp_report.py's
pass/fail logic. No GPU, no TE: they run in CI, so the multi-GPU script's bookkeeping is
checked before it ever reaches the GPU machine."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Optional

import pytest
import torch

from fakes import background, te_package
from fakes.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "evidence" / "multigpu" / "cp_check.py"


@pytest.fixture(scope="module")
def cc() -> ModuleType:
    return load_script("te_gqa_fix_tests_cp_check", SCRIPT)


@pytest.fixture(scope="module")
def cr(cc) -> ModuleType:
    """cp_report.py, as cp_check.py imported it (its folder is on the path by then)."""
    return sys.modules["cp_report"]


def test_te2186_shape_is_the_issue_batch_at_cp2(cc):
    pairs = cc.shape_pairs("te2186", 2)
    assert cc.cumulative([n for n, _ in pairs]) == [0, 9, 17, 25, 37, 45, 57]
    assert cc.cumulative([p for _, p in pairs]) == [0, 12, 20, 28, 40, 48, 60]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", ["te2186", "tailpad", "empty"])
def test_shapes_padded_to_multiple_of_2cp(cc, shape, cp):
    pairs = cc.shape_pairs(shape, cp)
    for n, p in pairs:
        assert 0 <= n <= p and p % (2 * cp) == 0


def test_dual_chunk_swap_matches_te_docstring_example(cc):
    # transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py,
    # thd_sequence_order_to_cp_rank_order: cu_seqlens [0, 8, 16, 24, 40], cp_size 4; the
    # values listed there are each token's position inside its sequence.
    padded = [8, 8, 8, 16]
    starts = cc.cumulative(padded)
    pos = [t - starts[max(i for i in range(4) if starts[i] <= t)] for t in range(40)]
    expected = {
        0: [0, 7, 0, 7, 0, 7, 0, 1, 14, 15],
        1: [1, 6, 1, 6, 1, 6, 2, 3, 12, 13],
        2: [2, 5, 2, 5, 2, 5, 4, 5, 10, 11],
        3: [3, 4, 3, 4, 3, 4, 6, 7, 8, 9],
    }
    for rank, want in expected.items():
        assert [pos[t] for t in cc.dual_chunk_swap_indices(padded, 4, rank)] == want


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("shape", ["te2186", "tailpad", "empty"])
def test_partition_covers_every_row_once(cc, shape, cp):
    padded = [p for _, p in cc.shape_pairs(shape, cp)]
    rows = [cc.dual_chunk_swap_indices(padded, cp, r) for r in range(cp)]
    assert len({len(r) for r in rows}) == 1
    assert sorted(x for r in rows for x in r) == list(range(sum(padded)))


@pytest.mark.parametrize("cp", [2, 4])
def test_shapes_have_ranks_whose_second_half_is_pure_padding(cc, cp):
    """The case TE #2186 is about: some rank holds a chunk of a sequence with no tokens."""
    for shape in ("te2186", "tailpad"):
        pairs = cc.shape_pairs(shape, cp)
        hits = 0
        for n, p in pairs:
            c = p // (2 * cp)
            for rank in range(cp):
                second = 2 * cp - 1 - rank
                if c and second * c >= n:
                    hits += 1
        assert hits > 0, (shape, cp)


def test_valid_rows(cc):
    valid, pad = cc.valid_rows([(2, 4), (0, 4), (4, 4)])
    assert valid == [0, 1, 8, 9, 10, 11]
    assert pad == [2, 3, 4, 5, 6, 7]


def test_predicted_unsupported(cc):
    assert cc.predicted_unsupported("a2a", 8, 1, 2) is not None
    assert cc.predicted_unsupported("a2a", 8, 2, 4) is not None
    assert cc.predicted_unsupported("a2a", 8, 2, 2) is None
    assert cc.predicted_unsupported("a2a", 32, 8, 4) is None
    assert cc.predicted_unsupported("p2p", 8, 1, 2) is None
    assert cc.predicted_unsupported("all_gather", 8, 1, 4) is None


def test_parse_heads(cc):
    assert cc.parse_heads("8/2, 8/1,32/8") == [(8, 2), (8, 1), (32, 8)]
    with pytest.raises(ValueError):
        cc.parse_heads("8/3")


def _sdpa_reference(q, k, v, dout, pairs, scale):
    """Independent oracle: torch SDPA per sequence (causal), GQA by explicit expansion."""
    qf, kf, vf = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    outs, grads = [], []
    for (n, _), s in zip(pairs, _starts([p for _, p in pairs])):
        if n == 0:
            continue
        qb = qf[s : s + n].transpose(0, 1)
        kb = kf[s : s + n].repeat_interleave(g, 1).transpose(0, 1)
        vb = vf[s : s + n].repeat_interleave(g, 1).transpose(0, 1)
        ob = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scale
        ).transpose(0, 1)
        out[s : s + n] = ob.detach()
        outs.append(ob)
        grads.append(dout[s : s + n].double())
    torch.autograd.backward(outs, grads)
    return {"out": out, "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}


def _starts(values):
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out[:-1]


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
def test_fp32_reference_matches_sdpa(cc, heads):
    torch.manual_seed(0)
    hq, hkv = heads
    pairs = [(5, 8), (0, 4), (8, 8), (1, 4)]
    total = sum(p for _, p in pairs)
    d = 16
    q, dout = torch.randn(total, hq, d), torch.randn(total, hq, d)
    k, v = torch.randn(total, hkv, d), torch.randn(total, hkv, d)
    scale = d**-0.5
    mine = cc.reference_pair(cc.thd_batch(pairs, q, k, v, dout), torch.device("cpu"))["fp32"]
    oracle = _sdpa_reference(q, k, v, dout, pairs, scale)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(mine[name].double(), oracle[name], atol=2e-5, rtol=2e-5)
    _, pad = cc.valid_rows(pairs)
    pad_t = torch.tensor(pad)
    for name in ("out", "dq", "dk", "dv"):
        assert mine[name].index_select(0, pad_t).abs().max().item() == 0.0


def test_bf16_reference_error_and_bound_are_sane(cc):
    """The flash-attention bound is positive and the bf16 reference is within it of fp32
    (it is the yardstick, so it must be close but not exact)."""
    torch.manual_seed(1)
    pairs = [(9, 12), (8, 8), (12, 12)]
    total = sum(p for _, p in pairs)
    q, dout = torch.randn(total, 8, 32), torch.randn(total, 8, 32)
    k, v = torch.randn(total, 2, 32), torch.randn(total, 2, 32)
    batch = cc.thd_batch(pairs, *(x.to(torch.bfloat16) for x in (q, k, v, dout)))
    refs = cc.reference_pair(batch, torch.device("cpu"))
    ref, low = refs["fp32"], refs["low"]
    valid, _ = cc.valid_rows(pairs)
    rows = torch.tensor(valid)
    for name in ("out", "dq", "dk", "dv"):
        err = cc.max_abs(low[name], ref[name], rows)
        bound = cc.tolerance(err, cc.max_abs(ref[name], None, rows), torch.bfloat16)
        atol = bound - 2 * err
        assert 0.0 < err < 0.5, (name, err)
        assert atol > 0.0
        # a corrupted tensor (the bug writes 1000 x group size) is far outside the bound
        bad = ref[name].clone()
        bad[rows[0]] += 4000.0
        assert cc.max_abs(bad, ref[name], rows) > 2 * err + atol


def test_max_abs_propagates_nan(cc):
    a = torch.zeros(4, 2)
    a[1, 0] = float("nan")
    assert math.isnan(cc.max_abs(a, None, torch.tensor([0, 1])))
    assert cc.max_abs(a, None, torch.tensor([0, 2])) == 0.0
    assert cc.max_abs(a, None, torch.tensor([], dtype=torch.long)) == 0.0


def _rec(comm, mode, status, **kw):
    rec = {
        "cp_comm_type": comm,
        "heads_q": 8,
        "heads_kv": 2,
        "shape": "te2186",
        "mode": mode,
        "status": status,
        "reasons": [],
    }
    rec.update(kw)
    return rec


def test_check_results_logic(cr):
    good = {
        "records": [
            _rec("p2p", "patched", "pass"),
            _rec("a2a", "patched", "unsupported"),
            _rec("p2p", "unpatched", "corruption_observed"),
            _rec("a2a", "unpatched", "unsupported"),
            _rec("all_gather", "unpatched", "clean"),
        ]
    }
    assert cr.check_results(good) == []
    assert cr.check_results(good, mode="patched") == []
    assert cr.check_results(good, mode="unpatched") == []

    failing = {"records": [*good["records"], _rec("all_gather", "patched", "fail", reasons=["dk"])]}
    assert any("all_gather" in p for p in cr.check_results(failing, mode="patched"))
    assert cr.check_results(failing, mode="unpatched") == []

    p2p_skipped = {"records": [_rec("p2p", "patched", "unsupported")]}
    assert cr.check_results(p2p_skipped, mode="patched")

    unpatched_error = {"records": [_rec("p2p", "unpatched", "error", reasons=["raised"])]}
    assert cr.check_results(unpatched_error, mode="unpatched")

    assert cr.check_results({"records": []})
    assert cr.check_results({"records": good["records"], "fatal": "boom"})


def test_results_are_strict_json_and_summarised(cr, tmp_path):
    results = {
        "stack": {"cp_size": 2, "cudnn_te": "9.14.0"},
        "poison": True,
        "records": [
            _rec(
                "p2p",
                "unpatched",
                "corruption_observed",
                err_vs_fp32={"out": 0.01, "dq": 0.02, "dk": 4000.0, "dv": float("nan")},
                bound={"out": 0.03, "dq": 0.05, "dk": 0.05, "dv": 0.05},
                pad_rows_max_abs={"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": float("inf")},
                fixed_calls=[0, 0],
                elapsed_s=1.5,
            )
        ],
    }
    path, spath = cr.write_results(str(tmp_path), results)
    loaded = json.loads(Path(path).read_text(), parse_constant=lambda c: pytest.fail(c))
    assert loaded["records"][0]["err_vs_fp32"]["dv"] == "nan"
    text = Path(spath).read_text()
    assert "corruption_observed" in text and "RESULT: PASS" in text


# ----------------------------------------------------------------------------- dry run
# The whole harness (torchrun, process groups, TE's partition helper, all-gather and
# un-partition, references, install/uninstall and call counts, JSON, exit status) on CPU
# with gloo, against the fake TE (fakes/te_package.py with context_parallel=True) whose
# fused_attn_bwd writes the bug's sentinel.


def _start_dry_runs(folder: Path) -> Optional[background.Job]:
    """cp_dry_runs.py: this configuration, then one with TE_GQA_FIX=off, in one launch."""
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        return None
    environ = {k: v for k, v in os.environ.items()
               if k not in ("OUT", "GPU_KIT_CUDNN") and not k.startswith("TE_GQA_FIX")}  # fmt: skip
    fake = te_package.write_fake_te(folder / "fake_te", kernel="reference", consumers=False,
                                    context_parallel=True, version="0.0.0+fake")  # fmt: skip
    environ["PYTHONPATH"] = os.pathsep.join(
        [*te_package.pythonpath(fake, REPO / "src"), environ.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(SCRIPT.with_name("cp_dry_runs.py")), str(folder), "--cpu-dry-run",
           "--head-dim=16", "--heads=4/2,4/1", "--shapes=te2186,empty"]  # fmt: skip
    return background.Job(cmd, folder, timeout=240, env=environ)


background.STARTERS["dry_runs"] = _start_dry_runs


@pytest.fixture(scope="module")
def dry_runs() -> Dict[str, Any]:
    """Each run's exit status, results and output folder; the launch's output."""
    job = background.get("dry_runs")
    if job is None:
        pytest.skip("needs torch.distributed with gloo")
    proc = job.wait()
    said = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0 and (job.folder / "status.json").exists(), said
    status = json.loads((job.folder / "status.json").read_text())
    runs = {}
    for name, code in zip(("on", "off"), status):
        path = job.folder / name / "cp_results_cp2.json"
        assert path.exists(), said
        runs[name] = (code, json.loads(path.read_text()), job.folder / name, said)
    return runs


def test_dry_run_patched_passes_unpatched_shows_sentinel(cr, dry_runs):
    code, results, out, said = dry_runs["on"]
    assert code == 0, said
    assert cr.check_results(results) == []
    recs = results["records"]
    assert results["stack"]["cp_size"] == 2
    assert {r["cp_comm_type"] for r in recs} == {"p2p", "all_gather", "a2a"}
    for r in recs:
        if r["cp_comm_type"] == "a2a" and r["heads_kv"] == 1:
            assert r["status"] == "unsupported"
        elif r["mode"] == "patched":
            assert r["status"] == "pass"
            assert all(n > 0 for n in r["fixed_calls"])
            assert r["pad_rows_max_abs"]["dk"] == 0.0
        else:
            # the fake writes 1000 x group size into dK/dV rows whose true gradient is 0
            assert r["status"] == "corruption_observed"
            group = r["heads_q"] // r["heads_kv"]
            assert r["pad_rows_max_abs"]["dk"] == 1000.0 * group
            assert all(n == 0 for n in r["fixed_calls"])
    assert "RESULT: PASS" in (out / "cp_summary_cp2.txt").read_text()


def test_dry_run_fails_when_the_fix_is_off(cr, dry_runs):
    """The harness can fail: with the post-pass disabled, patched runs keep the sentinel."""
    code, results, _, said = dry_runs["off"]
    assert code != 0, said
    problems = cr.check_results(results, mode="patched")
    assert any("padding rows == 0" in p for p in problems), problems
    assert any("fixed calls > 0" in p for p in problems), problems
