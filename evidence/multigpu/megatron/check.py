"""Compare the Megatron-Core training runs of issue 11 and say whether the fix is exact.

    python3 evidence/multigpu/megatron/check.py RESULTS_DIR [--md summary.md] [--csv curves.csv]

``RESULTS_DIR`` holds ``<name>.json`` (written by ``examples/megatron_core.py --out``) and
``<name>.log`` (its stdout + stderr) for the runs of ``run.sh``:

====== ================================================================================
a      cuDNN 9.14 (system), fix off, CP 2 on two GPUs
b      cuDNN 9.14, fix on (``TE_GQA_FIX_AUTOPATCH=1``, nothing else changed), CP 2
c      cuDNN 9.19 (torch's), fix off, CP 2: fixed upstream, the reference
d      CP 1 on one GPU, same global batch (system cuDNN, fix on; CP 1 has no q-empty
       sequence, so no run here depends on the fix to be right)
*_poison  the same with ``--poison`` (the allocator-poisoning trigger of the bug notes)
====== ================================================================================

The tolerance is the repository's rule (tests/thd.py's ``tolerance``, cp_check.py: flash-attention's
"twice the error of the same computation in the same precision, plus a few ulps of the
reference's magnitude"), applied to training curves. There is no fp32 training run (TE's
fused attention has no fp32 path), so "the same computation in the same precision" is the
other legitimate bf16 run: for (b) against the reference (c), the allowed difference at step
``t`` of a quantity ``q`` (loss, Megatron's grad norm, attention qkv / proj grad norms) is

    bound_t = factor * max_{s <= t} |c_s - d_s|  +  ulps * eps_bf16 * |c_t|

with ``factor`` 2 and ``ulps`` 4 as in thd.py, and the same against (d) with the roles of
(c) and (d) swapped. ``|c - d|`` is how far two correct bf16 runs of the same training drift
apart (a different cuDNN release's kernels, a different CP split, TE's non-deterministic
dQ accumulation); the running maximum keeps the band from collapsing where the two curves
happen to cross. A run "matches" when every step of every quantity is inside its band and
nothing is NaN. (b) must match (c) and (d); with ``--poison`` runs present, (b_poison) must
too. (a) is only measured: first step outside the band, first NaN, largest grad-norm ratio,
largest loss difference.

Preconditions, checked before any comparison (each failure is reported and fails the check,
because it would make the comparison meaningless): every run completed every step; all runs
started from bit-identical weights (``init_checksum``) and trained on the same loss tokens;
(a)/(b) ran cuDNN < 9.18 on Hopper (else (a) cannot show the bug) and (c) >= 9.18; the fix
was active in (b)/(d) and not in (a)/(c), seen twice: the ``te_gqa_fix`` logger's line
"installed: N call sites of fused_attn_bwd rebound" in the log (the example calls no
te-gqa-fix function: only the start-up hook installs), and TE's ``fused_attn_bwd`` names
carrying ``__wrapped__`` in the JSON.

Exit status 0 when (b) matches and the preconditions hold; 1 otherwise; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

EPS_BF16 = 2.0**-7  # torch.finfo(torch.bfloat16).eps
QUANTITIES = ("loss", "grad_norm", "attn_qkv", "attn_proj")
#: te_gqa_fix.patch.install's INFO line, as the example's logging format shows it.
FIX_LOG_LINE = "te_gqa_fix: installed: "
LABELS = {
    "a": "(a) cuDNN 9.14, fix off",
    "b": "(b) cuDNN 9.14, fix on",
    "c": "(c) cuDNN 9.19",
    "d": "(d) CP 1, one GPU",
}
# name -> (fix expected on, cuDNN expected fixed upstream (>= 9.18) or None: any)
EXPECT = {"a": (False, False), "b": (True, False), "c": (False, True), "d": (True, None)}


def base(name: str) -> str:
    return name.split("_", 1)[0]


def label(name: str) -> str:
    text = LABELS.get(base(name), name)
    return text + (", poisoned" if name.endswith("_poison") else "")


def num(x: Any) -> float:
    """A JSON number (NaN/Inf were written as strings); missing -> NaN."""
    if x is None:
        return float("nan")
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def series(run: Dict[str, Any], quantity: str) -> List[float]:
    out = []
    for rec in run.get("steps", []):
        if quantity in ("loss", "grad_norm", "attn_grad_norm"):
            out.append(num(rec.get(quantity)))
        else:
            out.append(num(rec.get("groups", {}).get(quantity, {}).get("norm")))
    return out


def load_runs(folder: str) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, str]]:
    runs: Dict[str, Dict[str, Any]] = {}
    logs: Dict[str, str] = {}
    for entry in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(entry)
        if ext == ".json" and base(stem) in LABELS:
            with open(os.path.join(folder, entry)) as f:
                runs[stem] = json.load(f)
            log = os.path.join(folder, stem + ".log")
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    logs[stem] = f.read()
    return runs, logs


# ----------------------------------------------------------------------------- tolerance


def band(ref: Sequence[float], alt: Sequence[float], factor: float, ulps: float) -> List[float]:
    """Per-step bound around ``ref``: factor x running max |ref - alt| + ulps x eps x |ref|.
    NaN in ref or alt makes the bound NaN (so nothing can pass against it)."""
    out, spread = [], 0.0
    for r, a in zip(ref, alt):
        d = abs(r - a)
        spread = d if math.isnan(d) else max(spread, d)
        out.append(factor * spread + ulps * EPS_BF16 * abs(r))
    return out


def compare(
    test: Sequence[float],
    ref: Sequence[float],
    alt: Sequence[float],
    factor: float = 2.0,
    ulps: float = 4.0,
) -> Dict[str, Any]:
    """``test`` against ``ref`` with the band from ``alt`` (see the module docstring)."""
    n = min(len(test), len(ref), len(alt))
    bounds = band(ref[:n], alt[:n], factor, ulps)
    worst, worst_step, first_out = 0.0, None, None
    for t in range(n):
        err = abs(test[t] - ref[t])
        ratio = err / bounds[t] if bounds[t] > 0 else (0.0 if err == 0 else math.inf)
        if math.isnan(err) or math.isnan(bounds[t]):
            ratio = math.inf
        if worst_step is None or ratio > worst:
            worst, worst_step = ratio, t
        if ratio > 1.0 and first_out is None:
            first_out = t
    return {
        "steps": n,
        "max_ratio": worst,  # max over steps of |test - ref| / bound; <= 1 inside the band
        "worst_step": worst_step,
        "first_step_outside": first_out,
        "ok": n > 0 and first_out is None,
    }


def matches(
    runs: Dict[str, Dict[str, Any]],
    test: str,
    ref: str,
    alt: str,
    factor: float = 2.0,
    ulps: float = 4.0,
) -> Dict[str, Any]:
    res = {
        q: compare(series(runs[test], q), series(runs[ref], q), series(runs[alt], q), factor, ulps)
        for q in QUANTITIES
    }
    nan_steps = [s for s, rec in enumerate(runs[test].get("steps", [])) if rec.get("nan")]
    return {
        "test": test,
        "ref": ref,
        "alt": alt,
        "quantities": res,
        "nan_steps": nan_steps,
        "ok": all(r["ok"] for r in res.values()) and not nan_steps,
    }


def divergence(run: Dict[str, Any], ref: Dict[str, Any], alt: Dict[str, Any]) -> Dict[str, Any]:
    """How a run departs from the reference: NaN, grad-norm ratios, loss difference."""
    out: Dict[str, Any] = {}
    nan_steps = [s for s, rec in enumerate(run.get("steps", [])) if rec.get("nan")]
    out["first_nan_step"] = nan_steps[0] if nan_steps else None
    for q in ("grad_norm", "attn_qkv", "attn_proj"):
        a, r = series(run, q), series(ref, q)
        ratios = [x / y for x, y in zip(a, r) if y > 0 and not math.isnan(x)]
        out[f"max_{q}_ratio"] = max(ratios) if ratios else float("nan")
    la, lr = series(run, "loss"), series(ref, "loss")
    deltas = [abs(x - y) for x, y in zip(la, lr) if not math.isnan(x)]
    out["max_loss_delta"] = max(deltas) if deltas else float("nan")
    out["final_loss"] = la[-1] if la else float("nan")
    out["final_loss_ref"] = lr[-1] if lr else float("nan")
    maxabs = [num(rec.get("groups", {}).get("attn_qkv", {}).get("max_abs")) for rec in run["steps"]]
    out["max_attn_qkv_grad_abs"] = max((x for x in maxabs if not math.isnan(x)), default=None)
    band_check = {q: compare(series(run, q), series(ref, q), series(alt, q)) for q in QUANTITIES}
    firsts = [
        r["first_step_outside"] for r in band_check.values() if r["first_step_outside"] is not None
    ]
    out["first_step_outside_band"] = min(firsts) if firsts else None
    out["outside_band"] = {q: r["first_step_outside"] for q, r in band_check.items()}
    out["diverged"] = (
        out["first_nan_step"] is not None or out["first_step_outside_band"] is not None
    )
    return out


# ----------------------------------------------------------------------------- preconditions


def cudnn_tuple(run: Dict[str, Any]) -> Optional[Tuple[int, ...]]:
    text = str(run.get("stack", {}).get("cudnn_te", ""))
    try:
        return tuple(int(x) for x in text.split("."))
    except ValueError:
        return None


def fix_seen(run: Dict[str, Any], log: Optional[str]) -> Dict[str, Any]:
    wrapped = run.get("stack", {}).get("fused_attn_bwd_wrapped", {}) or {}
    flags = [v for v in wrapped.values() if v is not None]
    return {
        "log_line": None if log is None else FIX_LOG_LINE in log,
        "te_sites_wrapped": bool(flags) and all(flags),
        "te_sites_unwrapped": bool(flags) and not any(flags),
    }


def preconditions(runs: Dict[str, Dict[str, Any]], logs: Dict[str, str]) -> List[str]:
    problems: List[str] = []
    for need in ("a", "b", "c", "d"):
        if need not in runs:
            problems.append(f"run {need} missing")
    for name, run in runs.items():
        want_steps = run.get("config", {}).get("steps")
        got = len(run.get("steps", []))
        if not run.get("complete") or (want_steps is not None and got != want_steps):
            problems.append(f"{name}: incomplete ({got} of {want_steps} steps)")
        on, fixed = EXPECT[base(name)]
        seen = fix_seen(run, logs.get(name))
        if on and not (seen["log_line"] and seen["te_sites_wrapped"]):
            problems.append(f"{name}: fix expected on but not seen active ({seen})")
        if not on and (seen["log_line"] or not seen["te_sites_unwrapped"]):
            problems.append(f"{name}: fix expected off but seen active ({seen})")
        ver = cudnn_tuple(run)
        if fixed is not None:
            if ver is None:
                problems.append(
                    f"{name}: cuDNN version unknown ({run.get('stack', {}).get('cudnn_te')})"
                )
            elif fixed and ver < (9, 18):
                problems.append(f"{name}: cuDNN {ver} < 9.18, expected a fixed cuDNN")
            elif not fixed and ver >= (9, 18):
                problems.append(f"{name}: cuDNN {ver} >= 9.18: this run cannot show the bug")
    sums = {n: (r.get("init_checksum") or {}).get("sum") for n, r in runs.items()}
    if len({json.dumps(v) for v in sums.values()}) > 1:
        problems.append(f"runs did not start from the same weights: {sums}")
    tokens = {n: [s.get("loss_tokens") for s in r.get("steps", [])] for n, r in runs.items()}
    if len({json.dumps(v) for v in tokens.values()}) > 1:
        problems.append("runs did not train on the same loss tokens per step")
    return problems


# ----------------------------------------------------------------------------- report


def evaluate(
    runs: Dict[str, Dict[str, Any]], logs: Dict[str, str], factor: float = 2.0, ulps: float = 4.0
) -> Dict[str, Any]:
    report: Dict[str, Any] = {"factor": factor, "ulps": ulps, "runs": sorted(runs)}
    problems = preconditions(runs, logs)
    checks = []
    if all(n in runs for n in ("b", "c", "d")):
        for test in [n for n in ("b", "b_poison") if n in runs]:
            checks.append(matches(runs, test, "c", "d", factor, ulps))
            checks.append(matches(runs, test, "d", "c", factor, ulps))
        for chk in checks:
            if not chk["ok"]:
                bad = [q for q, r in chk["quantities"].items() if not r["ok"]]
                problems.append(
                    f"{chk['test']} does not match {chk['ref']}: {', '.join(bad) or 'NaN'}"
                    + (f" (NaN at steps {chk['nan_steps'][:5]})" if chk["nan_steps"] else "")
                )
    report["matches"] = checks
    report["divergence"] = {
        n: divergence(runs[n], runs["c"], runs["d"])
        for n in sorted(runs)
        if base(n) == "a" and "c" in runs and "d" in runs
    }
    report["spread_c_d"] = (
        {q: max_abs_diff(series(runs["c"], q), series(runs["d"], q)) for q in QUANTITIES}
        if "c" in runs and "d" in runs
        else {}
    )
    report["problems"] = problems
    report["ok"] = not problems and bool(checks)
    return report


def max_abs_diff(x: Sequence[float], y: Sequence[float]) -> float:
    d = [abs(a - b) for a, b in zip(x, y)]
    return max(d) if d else float("nan")


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def markdown(report: Dict[str, Any], runs: Dict[str, Dict[str, Any]]) -> str:
    lines = ["## Megatron-Core (issue 11): results", ""]
    any_run = next(iter(runs.values()), {})
    st = any_run.get("stack", {})
    cfg = any_run.get("config", {})
    lines.append(
        f"Stack: {st.get('gpu')}, torch {st.get('torch')}, TE {st.get('te')}, Megatron-Core "
        f"{st.get('megatron_core')}. Model: {cfg.get('layers')} layers, hidden {cfg.get('hidden')}, "
        f"{cfg.get('heads')}/{cfg.get('groups')} heads, vocab {cfg.get('vocab')}, bf16; "
        f"{cfg.get('micro_batches')} packed bins of {cfg.get('seq_length')} tokens per step, "
        f"{cfg.get('steps')} steps, Adam lr {cfg.get('lr')}, clip {cfg.get('clip_grad')}."
    )
    lines.append("")
    lines.append(
        "| run | cuDNN | CP | fix seen | poison | final loss | max grad norm | NaN steps |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for name in sorted(runs):
        r = runs[name]
        gn = [x for x in series(r, "grad_norm") if not math.isnan(x)]
        nans = sum(1 for s in r.get("steps", []) if s.get("nan"))
        wrapped = fix_seen(r, None)["te_sites_wrapped"]
        loss = series(r, "loss")
        lines.append(
            f"| {label(name)} | {r.get('stack', {}).get('cudnn_te')} | "
            f"{r.get('config', {}).get('cp')} | {fmt(wrapped)} | {fmt(bool(r.get('poison')))} | "
            f"{fmt(loss[-1] if loss else None)} | {fmt(max(gn) if gn else None)} | {nans} |"
        )
    lines += [
        "",
        f"Tolerance: |test - ref| <= {report['factor']} x running max |c - d| + "
        f"{report['ulps']} x eps_bf16 x |ref| per step (evidence/multigpu/megatron/check.py).",
        "",
    ]
    if report.get("spread_c_d"):
        lines.append(
            "Spread of the two correct runs, max |c - d|: "
            + ", ".join(f"{q} {fmt(v)}" for q, v in report["spread_c_d"].items())
        )
        lines.append("")
    lines.append(
        "| test | vs | "
        + " | ".join(f"{q} (max err/bound)" for q in QUANTITIES)
        + " | NaN | match |"
    )
    lines.append("|---|---|" + "---|" * len(QUANTITIES) + "---|---|")
    for chk in report.get("matches", []):
        cells = [fmt(chk["quantities"][q]["max_ratio"]) for q in QUANTITIES]
        lines.append(
            f"| {chk['test']} | {chk['ref']} | "
            + " | ".join(cells)
            + f" | {len(chk['nan_steps'])} | {'yes' if chk['ok'] else '**no**'} |"
        )
    lines.append("")
    for name, dv in report.get("divergence", {}).items():
        lines.append(
            f"- {label(name)}: diverged {fmt(dv['diverged'])}; first step outside the band "
            f"{fmt(dv['first_step_outside_band'])} ({', '.join(f'{q} {fmt(s)}' for q, s in dv['outside_band'].items())}); "
            f"first NaN step {fmt(dv['first_nan_step'])}; max grad-norm ratio to (c) "
            f"{fmt(dv['max_grad_norm_ratio'])}, attention qkv {fmt(dv['max_attn_qkv_ratio'])}, "
            f"proj {fmt(dv['max_attn_proj_ratio'])}; max |qkv grad| {fmt(dv['max_attn_qkv_grad_abs'])}; "
            f"max |loss - loss(c)| {fmt(dv['max_loss_delta'])}; final loss {fmt(dv['final_loss'])} "
            f"vs {fmt(dv['final_loss_ref'])}."
        )
    lines += ["", "RESULT: " + ("PASS" if report["ok"] else "FAIL")]
    for p in report["problems"]:
        lines.append(f"- {p}")
    return "\n".join(lines) + "\n"


def write_csv(runs: Dict[str, Dict[str, Any]], path: str) -> None:
    """The curves: one row per step, columns run.quantity."""
    names = sorted(runs)
    cols = [(n, q) for n in names for q in QUANTITIES]
    steps = max((len(r.get("steps", [])) for r in runs.values()), default=0)
    data = {(n, q): series(runs[n], q) for n, q in cols}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"{n}.{q}" for n, q in cols])
        for s in range(steps):
            w.writerow([s] + [repr(data[c][s]) if s < len(data[c]) else "" for c in cols])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("results", help="folder with <run>.json and <run>.log")
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--ulps", type=float, default=4.0)
    p.add_argument("--md", default="", help="markdown summary (default RESULTS/summary.md)")
    p.add_argument("--csv", default="", help="curves CSV (default RESULTS/curves.csv)")
    p.add_argument("--json", default="", help="report JSON (default RESULTS/report.json)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.results):
        print(f"check.py: no such folder {args.results}", file=sys.stderr)
        return 2
    runs, logs = load_runs(args.results)
    if not runs:
        print(f"check.py: no run JSON in {args.results}", file=sys.stderr)
        return 2
    report = evaluate(runs, logs, args.factor, args.ulps)
    csv_path = args.csv or os.path.join(args.results, "curves.csv")
    write_csv(runs, csv_path)
    md = markdown(report, runs)
    with open(args.md or os.path.join(args.results, "summary.md"), "w") as f:
        f.write(md)
    with open(args.json or os.path.join(args.results, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(md)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
