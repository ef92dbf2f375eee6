"""CPU tests of issue 11's Megatron-Core check (evidence/multigpu/megatron/check.py) and of
the pure parts of examples/megatron_core.py (the packed dataset, the grad statistics).

No GPU, TE or Megatron-Core: synthetic run JSONs stand in for the GPU runs, so the
comparison's pass/fail logic is checked before the GPU machine ever runs it; the start-up
hook's log line the check looks for comes from the hook itself, with a fake TE."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional

import pytest

from fakes import background, te_package
from fakes.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "evidence" / "multigpu" / "megatron" / "check.py"
EXAMPLE = ROOT / "examples" / "megatron_core.py"


@pytest.fixture(scope="module")
def ck() -> ModuleType:
    return load_script("te_gqa_fix_tests_megatron_check", CHECK)


@pytest.fixture(scope="module")
def ex() -> ModuleType:
    return load_script("te_gqa_fix_tests_megatron_example", EXAMPLE)


# ----------------------------------------------------------------------------- synthetic runs

STEPS = 12
FIX_LINE = "te_gqa_fix: installed: 3 call sites of fused_attn_bwd rebound"  # as the hook logs


def curve(scale: float = 0.0, seed: int = 0) -> Dict[str, List[float]]:
    """A plausible training curve, plus a deterministic wiggle of relative size ``scale``."""
    wig = [math.sin(1.7 * t + seed) * scale for t in range(STEPS)]
    return {
        "loss": [6.9 * math.exp(-0.08 * t) * (1 + w) for t, w in enumerate(wig)],
        "grad_norm": [3.0 / (1 + 0.2 * t) * (1 + w) for t, w in enumerate(wig)],
        "attn_qkv": [1.0 / (1 + 0.2 * t) * (1 + 2 * w) for t, w in enumerate(wig)],
        "attn_proj": [0.5 / (1 + 0.2 * t) * (1 - w) for t, w in enumerate(wig)],
    }


def make_run(
    c: Dict[str, List[float]],
    *,
    fix: bool,
    cudnn: str,
    cp: int = 2,
    poison: bool = False,
    nan_from: Optional[int] = None,
    init_sum: float = 123.456,
    complete: bool = True,
) -> Dict[str, Any]:
    steps = []
    for t in range(STEPS):
        nan = nan_from is not None and t >= nan_from
        v = {q: (float("nan") if nan else c[q][t]) for q in c}
        steps.append(
            {
                "step": t,
                "loss": "nan" if nan else v["loss"],
                "loss_tokens": 7000 + t,
                "grad_norm": "nan" if nan else v["grad_norm"],
                "attn_grad_norm": math.hypot(v["attn_qkv"], v["attn_proj"]),
                "nan": nan,
                "groups": {
                    "attn_qkv": {"norm": v["attn_qkv"], "max_abs": v["attn_qkv"] / 10},
                    "attn_proj": {"norm": v["attn_proj"], "max_abs": v["attn_proj"] / 10},
                },
            }
        )
    sites = {
        "transformer_engine.pytorch.cpp_extensions.fused_attn": fix,
        "transformer_engine.pytorch.attention.dot_product_attention.backends": fix,
        "transformer_engine.pytorch.attention.dot_product_attention.context_parallel": fix,
    }
    return {
        "config": {"steps": STEPS, "cp": cp, "layers": 4, "heads": 16, "groups": 4},
        "stack": {"cudnn_te": cudnn, "fused_attn_bwd_wrapped": sites, "gpu": "fake"},
        "init_checksum": {"sum": init_sum, "sumsq": 1.0},
        "poison": poison,
        "complete": complete,
        "steps": steps,
    }


def good_runs() -> Dict[str, Dict[str, Any]]:
    c = curve()
    return {
        "a": make_run(curve(0.001, 3), fix=False, cudnn="9.14.0"),
        "b": make_run(curve(0.001, 1), fix=True, cudnn="9.14.0"),
        "c": make_run(c, fix=False, cudnn="9.19.0"),
        "d": make_run(curve(0.002, 2), fix=True, cudnn="9.14.0", cp=1),
    }


def logs_for(runs: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    on = {"b", "d"}
    return {n: ("INFO\n" + (FIX_LINE if n.split("_")[0] in on else "") + "\n") for n in runs}


def write(folder: Path, runs: Dict[str, Dict[str, Any]], logs: Dict[str, str]) -> None:
    for name, run in runs.items():
        (folder / f"{name}.json").write_text(json.dumps(run))
        (folder / f"{name}.log").write_text(logs.get(name, ""))


# ----------------------------------------------------------------------------- tolerance


def test_band_is_factor_times_running_spread_plus_ulps(ck):
    ref = [1.0, 1.0, 2.0]
    alt = [1.1, 1.0, 2.0]  # spread 0.1 at step 0; the running max keeps it afterwards
    got = ck.band(ref, alt, factor=2.0, ulps=4.0)
    eps = 2.0**-7
    assert got == pytest.approx([0.2 + 4 * eps, 0.2 + 4 * eps, 0.2 + 8 * eps])


def test_compare_flags_first_step_outside_and_nan(ck):
    ref, alt = [1.0] * 5, [1.0] * 5  # no spread: only the ulps term, 4 eps = 0.03125
    ok = ck.compare([1.0, 1.02, 0.99, 1.0, 1.0], ref, alt)
    assert ok["ok"] and ok["max_ratio"] < 1
    bad = ck.compare([1.0, 1.0, 1.1, 1.0, 1.0], ref, alt)
    assert not bad["ok"] and bad["first_step_outside"] == 2
    nan = ck.compare([1.0, float("nan"), 1.0, 1.0, 1.0], ref, alt)
    assert not nan["ok"] and nan["first_step_outside"] == 1


def test_matching_runs_pass(ck):
    runs = good_runs()
    report = ck.evaluate(runs, logs_for(runs))
    assert report["problems"] == []
    assert report["ok"]
    assert {(m["test"], m["ref"]) for m in report["matches"]} == {("b", "c"), ("b", "d")}


def _b(c: Dict[str, List[float]], **kw: Any) -> Dict[str, Any]:
    """Run (b), the fix on cuDNN 9.14, of curve ``c``."""
    return make_run(c, fix=True, cudnn="9.14.0", **kw)


def _scaled(name: str, factor: float, steps: slice = slice(None)) -> Dict[str, List[float]]:
    c = curve(0.001, 1)
    c[name][steps] = [x * factor for x in c[name][steps]]
    return c


#: An edit of the good runs (returning log overrides, or not), then the start of each
#: problem evaluate must report.
FAILS: Dict[str, Any] = {
    "b outside the band": (lambda r: r.update(b=_b(_scaled("attn_qkv", 1.5, slice(5, 6)))),
                           ["b does not match c: attn_qkv"]),  # one step off by 50%
    "NaN in b": (lambda r: r.update(b=_b(curve(0.001, 1), nan_from=8)),
                 ["b does not match c: loss, grad_norm, attn_qkv, attn_proj (NaN at steps [8,"]),
    "poisoned b": (lambda r: r.update(b_poison=_b(_scaled("grad_norm", 100), poison=True)),
                   ["b_poison does not match c: grad_norm"]),
    # the start-up hook never logged: the fix may not be active
    "fix not seen in b": (lambda r: {"b": "INFO\n"}, ["b: fix expected on but not seen active"]),
    "fix seen in a": (lambda r: r.update(a=make_run(curve(0.001, 3), fix=True, cudnn="9.14.0")),
                      ["a: fix expected off but seen active"]),
    # the "fixed" reference ran the buggy cuDNN, and (b) a cuDNN where the fix is moot
    "wrong cuDNN": (lambda r: (r["c"]["stack"].update(cudnn_te="9.14.0"),
                               r["b"]["stack"].update(cudnn_te="9.19.0")),
                    ["c: cuDNN (9, 14, 0) < 9.18", "b: cuDNN (9, 19, 0) >= 9.18"]),
    "other initial weights": (lambda r: r["d"]["init_checksum"].update(sum=999.0),
                              ["runs did not start from the same weights"]),
    "incomplete or missing": (lambda r: (r["c"].update(complete=False, steps=r["c"]["steps"][:5]),
                                         r.pop("d")),
                              ["run d missing", "c: incomplete (5 of 12"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FAILS))
def test_evaluate_fails(ck, case):
    edit, problems = FAILS[case]
    runs = good_runs()
    logs = edit(runs)
    report = ck.evaluate(runs, {**logs_for(runs), **(logs if isinstance(logs, dict) else {})})
    assert not report["ok"]
    for problem in problems:
        assert any(p.startswith(problem) for p in report["problems"]), report["problems"]


def test_divergence_of_a_is_measured(ck):
    runs = good_runs()
    a = curve(0.001, 3)
    for t in range(3, STEPS):
        a["grad_norm"][t] *= 1000.0
        a["attn_qkv"][t] *= 4000.0
    runs["a"] = make_run(a, fix=False, cudnn="9.14.0", nan_from=9)
    report = ck.evaluate(runs, logs_for(runs))
    assert report["ok"], report["problems"]  # (a) diverging is a finding, not a failure
    dv = report["divergence"]["a"]
    assert dv["diverged"]
    assert dv["first_nan_step"] == 9
    assert dv["first_step_outside_band"] == 3
    assert dv["max_grad_norm_ratio"] == pytest.approx(1000.0, rel=0.01)
    assert dv["max_attn_qkv_ratio"] == pytest.approx(4000.0, rel=0.01)


def test_quiet_a_is_reported_as_not_diverged(ck):
    runs = good_runs()
    report = ck.evaluate(runs, logs_for(runs))
    assert report["divergence"]["a"]["diverged"] is False
    assert report["divergence"]["a"]["first_nan_step"] is None


# ----------------------------------------------------------------------------- entry point


def test_main_writes_summary_and_curves(ck, tmp_path):
    runs = good_runs()
    write(tmp_path, runs, logs_for(runs))
    rc = ck.main([str(tmp_path)])
    assert rc == 0
    md = (tmp_path / "summary.md").read_text()
    assert "RESULT: PASS" in md and "(a) cuDNN 9.14, fix off" in md
    rows = (tmp_path / "curves.csv").read_text().splitlines()
    assert len(rows) == STEPS + 1 and rows[0].startswith("step,a.loss,a.grad_norm")
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is True


def test_main_exits_nonzero_when_b_does_not_match(ck, tmp_path):
    runs = {**good_runs(), "b": _b(_scaled("loss", 1.2))}
    write(tmp_path, runs, logs_for(runs))
    assert ck.main([str(tmp_path)]) == 1
    assert "RESULT: FAIL" in (tmp_path / "summary.md").read_text()


def test_main_usage_errors(ck, tmp_path):
    assert ck.main([str(tmp_path / "nope")]) == 2
    assert ck.main([str(tmp_path)]) == 2  # no run JSON


# The example's logging set-up, then TE's import with the start-up file of src/ run as
# site-packages runs it: what a run's log holds about the fix. The fake TE imports torch, so
# this child starts when collection ends (tests/fakes/background.py).
HOOK_RUN = """
import logging, site, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
site.addsitedir(sys.argv[1])
import transformer_engine.pytorch
"""


def _start_hook_run(folder: Path) -> background.Job:
    fake = te_package.write_fake_te(folder / "te")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TE_GQA_FIX")}
    env["PYTHONPATH"] = os.pathsep.join(
        [*te_package.pythonpath(fake, ROOT / "src"), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, "-c", HOOK_RUN, str(ROOT / "src")]
    return background.Job(cmd, folder, timeout=300, env={**env, "TE_GQA_FIX_AUTOPATCH": "1"})


background.STARTERS["hook_run"] = _start_hook_run


@pytest.fixture(scope="module")
def hook_run() -> subprocess.CompletedProcess:
    return background.get("hook_run").wait()  # type: ignore[union-attr]


def test_the_hook_logs_the_line_the_check_looks_for(ck, hook_run):
    """TE_GQA_FIX_AUTOPATCH=1 and a (fake) TE import: the run's log has the line that
    makes the check see the fix on (before: the check looked for the old hook's wording, so
    every run with the fix read as one without)."""
    assert hook_run.returncode == 0, hook_run.stderr
    assert ck.fix_seen({}, hook_run.stderr)["log_line"] is True, hook_run.stderr
    assert ck.fix_seen({}, "te_gqa_fix: some other line\n")["log_line"] is False


# ----------------------------------------------------------------------------- the example


def test_example_has_no_te_gqa_fix_call():
    """Issue 11: the fix must come from the environment only."""
    tree = ast.parse(EXAMPLE.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0].startswith("te_gqa_fix") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith(("te_gqa_fix", "_te_gqa_fix"))
        elif isinstance(node, ast.Name):
            assert not node.id.startswith(("te_gqa_fix", "_te_gqa_fix"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in ("__import__", "import_module")


def test_example_imports_megatron_only_inside_main():
    """Its dataset and statistics helpers import on a machine without Megatron or TE."""
    tree = ast.parse(EXAMPLE.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.startswith(("megatron", "transformer_engine"))]


@pytest.mark.parametrize("cp", [1, 2])
def test_dataset_is_packed_like_megatron(ex, cp):
    mult = ex.pad_multiple_for(cp)
    assert mult == 4  # the same global batch for CP 1 and CP 2
    ds = ex.make_dataset(7, 3, 1024, 256, mult)
    assert ds == ex.make_dataset(7, 3, 1024, 256, mult)  # fixed: a function of the seed
    assert ds != ex.make_dataset(8, 3, 1024, 256, mult)
    for b in ds:
        cu, cu_pad = b["cu_seqlens"], b["cu_seqlens_padded"]
        assert len(b["tokens"]) == len(b["labels"]) == len(b["loss_mask"]) == 1024
        assert cu_pad[-1] == 1024 and len(cu) == len(cu_pad)
        lens = [y - x for x, y in zip(cu, cu[1:])]
        padded = [y - x for x, y in zip(cu_pad, cu_pad[1:])]
        assert all(p % (2 * cp) == 0 and p >= n >= 1 for n, p in zip(lens, padded))
        assert any(p > n for n, p in zip(lens, padded))  # padding between sequences
        assert sum(b["loss_mask"]) == sum(n - 1 for n in lens)
        assert b["max_seqlen"] == max(padded)
        for start, n, p in zip(cu_pad, lens, padded):
            assert 0 not in b["tokens"][start : start + n]
            assert b["tokens"][start + n : start + p] == [0] * (p - n)
            assert b["labels"][start : start + n - 1] == b["tokens"][start + 1 : start + n]


def test_pad_multiple_must_suit_cp(ex):
    assert ex.pad_multiple_for(4) == 8
    with pytest.raises(ValueError):
        ex.pad_multiple_for(2, 6)


def test_grad_stats_groups_and_nan(ex):
    import torch

    stats = ex.grad_stats(
        [
            ("module.module.decoder.layers.0.self_attention.linear_qkv.weight", torch.ones(4, 4)),
            ("module.module.decoder.layers.1.self_attention.linear_qkv.weight", torch.ones(3) * 2),
            ("module.module.decoder.layers.1.self_attention.linear_proj.weight", torch.ones(1)),
            ("module.module.decoder.layers.0.mlp.linear_fc1.weight", torch.tensor([float("nan")])),
        ]
    )
    assert stats["layer0.attn_qkv"]["norm"] == pytest.approx(4.0)
    assert stats["attn_qkv"]["norm"] == pytest.approx(math.sqrt(16 + 12))
    assert stats["attn_qkv"]["max_abs"] == 2.0
    assert stats["attn_proj"]["norm"] == pytest.approx(1.0)
    assert stats["mlp"]["nonfinite"] == 1 and math.isnan(stats["all"]["norm"])
    assert stats["attn_qkv"]["nonfinite"] == 0
