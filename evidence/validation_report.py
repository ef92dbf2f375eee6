"""docs/validation.md from one data file, docs/data/validation.jsonl.

``collect`` merges one GPU run's raw outputs into the data file (one JSON record a line:
the records the GPU tests append under ``TE_GQA_FIX_RECORD``, each tagged with its cuDNN
build, plus pytest's outcomes, doctor's verdict, the context-parallel check, the examples
and the Megatron-Core check). ``render`` writes the page from it; ``--check`` fails when
the committed page is not what the data file gives.

    python3 evidence/validation_report.py collect --tests RES [--extra DIR] [--megatron DIR] -o DATA
    python3 evidence/validation_report.py render [DATA] [-o PAGE] [--check]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "validation.jsonl"
PAGE = ROOT / "docs" / "validation.md"
BUILDS = {
    "system": "the machine's cuDNN, which TE loads by default",
    "pip": "the cuDNN wheel torch ships, which TE loads through `CUDNN_HOME` and the loader path",
    "route": "`system` with `TE_GQA_FIX_CUDNN=auto` through the installed start-up hook",
    "cudnn927": "`system` with `TE_GQA_FIX_CUDNN=strict:FOLDER`, FOLDER the libraries of the "
    "`nvidia-cudnn-cu13` 9.27.0.42 wheel",
}
EXAMPLES = ("seed_repro", "drop_in", "context_parallel")
GRADS = ("dq", "dk", "dv")
Rec = Dict[str, Any]


# ----------------------------------------------------------------------------- collect


def _compact(v: Any) -> Any:
    """Floats to 4 significant digits, recursively: the page shows 3."""
    if isinstance(v, float) and math.isfinite(v):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: _compact(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_compact(x) for x in v]
    return v


def _jsonl(path: Path) -> List[Rec]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def junit_outcomes(path: Path) -> Dict[str, Any]:
    """``{test id: (outcome, message)}`` from pytest's junit XML."""
    out: Dict[str, Any] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        name = name.split("tests/gpu/", 1)[-1]
        kids = {c.tag: c for c in case}
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            if tag in kids:
                msg = (kids[tag].get("message") or "")[:200]
                outcome = "failed" if tag == "failure" else tag
                if tag == "skipped" and "xfail" in kids[tag].get("type", "") + msg:
                    outcome = "xfailed"
        out[name] = (outcome, msg)
    return out


def pytest_record(build: str, outcomes: Dict[str, Any]) -> Rec:
    counts = Counter(o for o, _ in outcomes.values())
    others = [{"test": t, "outcome": o, "message": m} for t, (o, m) in outcomes.items()]
    return {
        "kind": "pytest",
        "build": build,
        "counts": {
            k: counts.get(k, 0) for k in ("passed", "failed", "error", "xfailed", "skipped")
        },
        "not_passed": [r for r in others if r["outcome"] != "passed"],
    }


def doctor_record(build: str, doc: Dict[str, Any]) -> Rec:
    keep = ("status", "exit_code", "advice")
    return {"kind": "doctor", "build": build, **{k: doc.get(k) for k in keep}}


def cp_records(build: str, data: Dict[str, Any]) -> List[Rec]:
    """One compact record per configuration of ``tests/multigpu/cp_check.py``'s results."""
    stack = {k: v for k, v in data.get("stack", {}).items() if k != "cudnn_files"}
    out: List[Rec] = [{"kind": "stack", "part": "cp", "build": build, **stack}]
    for r in data.get("records", []):
        err, bound = r.get("err_vs_fp32") or {}, r.get("bound") or {}
        ratios = [err[g] / bound[g] for g in GRADS if bound.get(g) and g in err]
        pad = r.get("pad_rows_max_abs") or {}
        out.append(
            {
                "kind": "cp",
                "build": build,
                **{k: r.get(k) for k in ("cp_comm_type", "heads_q", "heads_kv", "shape", "mode")},
                "status": r.get("status"),
                "err_over_bound": max(ratios) if ratios else None,
                "pad_rows_max": max((pad.get(g, 0.0) for g in ("dk", "dv")), default=None),
            }
        )
    return out


def example_record(build: str, name: str, log: str) -> Rec:
    """The example's exit status (``run_all.sh`` appends ``exit N``) and its verdict line."""
    lines = [ln for ln in log.splitlines() if ln.strip() and "warn" not in ln.lower()]
    code = None
    if lines and lines[-1].startswith("exit "):
        code = int(lines.pop()[5:])
    return {
        "kind": "example",
        "build": build,
        "name": name,
        "exit": code,
        "result": lines[-1][:300] if lines else "",
    }


def _megatron_check():
    path = ROOT / "tests" / "multigpu" / "megatron" / "check.py"
    spec = importlib.util.spec_from_file_location("te_gqa_fix_megatron_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def megatron_record(results: Path, command: str) -> Rec:
    """What ``tests/multigpu/megatron/check.py`` decides from the runs in ``results``."""
    check = _megatron_check()
    runs, logs = check.load_runs(str(results))
    rep = check.evaluate(runs, logs, 2.0, 4.0)
    first = runs[sorted(runs)[0]]
    rows = []
    for name in sorted(runs):
        r = runs[name]
        loss = check.series(r, "loss")
        gn = [x for x in check.series(r, "grad_norm") if not math.isnan(x)]
        rows.append(
            {
                "run": check.label(name),
                "cudnn": r.get("stack", {}).get("cudnn_te"),
                "cp": r.get("config", {}).get("cp"),
                "fix": check.fix_seen(r, None)["te_sites_wrapped"],
                "final_loss": loss[-1] if loss else None,
                "max_grad_norm": max(gn) if gn else None,
                "nan_steps": sum(1 for s in r.get("steps", []) if s.get("nan")),
            }
        )
    stack = first.get("stack", {})
    return {
        "kind": "megatron",
        "command": command,
        "date": stack.get("date"),
        "stack": {k: stack.get(k) for k in ("gpu", "world_size", "torch", "te", "megatron_core")},
        "config": first.get("config", {}),
        "runs": rows,
        "matches": [
            {
                "test": m["test"],
                "ref": m["ref"],
                "ok": m["ok"],
                "max_ratio": max(q["max_ratio"] for q in m["quantities"].values()),
            }
            for m in rep.get("matches", [])
        ],
        "divergence": {check.label(n): d for n, d in rep.get("divergence", {}).items()},
        "ok": rep["ok"],
        "problems": rep["problems"],
    }


def collect(
    tests: Optional[Path],
    builds: List[str],
    command: str,
    extra: Optional[Path] = None,
    megatron: Optional[Path] = None,
    megatron_command: Optional[str] = None,
) -> List[Rec]:
    """Every record of one run, in page order."""
    recs: List[Rec] = [{"kind": "run", "part": "tests", "command": command}]
    for b in builds:
        if tests is None:
            break
        for r in _jsonl(tests / f"records-{b}.jsonl"):
            if r.get("kind") == "stack":
                r = {k: v for k, v in r.items() if k != "cudnn_files"}
                r["part"] = "tests"
            recs.append({**r, "build": b})
        if (tests / f"junit-{b}.xml").exists():
            recs.append(pytest_record(b, junit_outcomes(tests / f"junit-{b}.xml")))
        if (tests / f"doctor-{b}.json").exists():
            try:
                recs.append(doctor_record(b, json.loads((tests / f"doctor-{b}.json").read_text())))
            except ValueError:
                recs.append({"kind": "doctor", "build": b, "status": "no JSON"})
    if extra is not None:
        for b in builds:
            for p in sorted(extra.glob(f"cp_results_cp*_{b}.json")):
                recs.extend(cp_records(b, json.loads(p.read_text())))
            for name in EXAMPLES:
                log = extra / f"{name}-{b}.log"
                if log.exists():
                    recs.append(example_record(b, name, log.read_text()))
    if megatron is not None and any(megatron.glob("*.json")):
        recs.append(megatron_record(megatron, megatron_command or command))
    return [_compact(r) for r in recs]


def write_jsonl(recs: Iterable[Rec], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


# ----------------------------------------------------------------------------- render


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x}" for k, x in v.items() if x) or "-"
    return str(v).replace("|", "\\|")


def _short(text: str, n: int = 120) -> str:
    return f"`{text}`" if len(text) <= n else f"`{text[: n - 3]}...`"


def _table(head: List[str], rows: List[List[Any]]) -> List[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return [*out, ""]


def _ratio(r: Rec) -> Optional[float]:
    """The worst of err/bound over dQ, dK, dV (1 or less: within the bound)."""
    vals = [r[f"{g}_err"] / r[f"{g}_bound"] for g in GRADS if r.get(f"{g}_bound")]
    return max(vals) if vals else None


def _dead(r: Rec, prefix: str = "") -> Optional[float]:
    vals = [r[k] for g in GRADS if (k := f"{prefix}{g}_dead_max") in r]
    return max(vals) if vals else None


def _case(r: Rec) -> str:
    return r["test"].split("::", 1)[1]


def _header(recs: List[Rec]) -> List[str]:
    stacks = [r for r in recs if r["kind"] == "stack"]
    runs = {r["part"]: r["command"] for r in recs if r["kind"] == "run"}
    meg = next((r for r in recs if r["kind"] == "megatron"), None)
    parts: Dict[str, Dict[str, Any]] = {}
    for s in stacks:
        p = parts.setdefault(s["part"], {"dates": set(), "gpus": set()})
        p["dates"].add(str(s.get("date", ""))[:10])
        p["gpus"].add(s.get("gpu_count") or s.get("world_size") or 1)
    if meg:
        parts["megatron"] = {"dates": {str(meg["date"])[:10]}, "gpus": {meg["stack"]["world_size"]}}
        runs.setdefault("megatron", meg["command"])
    first = stacks[0] if stacks else {}
    gpus = max((n for p in parts.values() for n in p["gpus"]), default=1)
    cudnn = {s["build"]: s.get("cudnn_te") for s in stacks if s["part"] == "tests"}
    lines = [
        f"Stack: {first.get('gpu', '?')}, driver {first.get('driver', '?')}, torch "
        f"{first.get('torch', '?')} (CUDA {first.get('cuda', '?')}), Transformer Engine "
        f"{first.get('te', '?')}; cuDNN as TE runs it: "
        + ", ".join(f"{v} (`{b}`)" for b, v in cudnn.items())
        + ".",
        "",
    ]
    dates = sorted({d for p in parts.values() for d in p["dates"]})
    if len(set(runs.values())) == 1 and len(dates) == 1:
        where = f"{gpus} GPU" + ("s" if gpus > 1 else "")
        lines += [f"Command: `{next(iter(runs.values()))}` ({where}). Date: {dates[0]}.", ""]
    else:
        rows = [
            [
                p,
                f"`{runs.get(p, runs.get('tests', '?'))}`",
                ", ".join(sorted(v["dates"])),
                "/".join(map(str, sorted(v["gpus"]))),
            ]
            for p, v in parts.items()
        ]
        lines += _table(["part", "command", "date", "GPUs"], rows)
    lines += [
        "Builds: " + "; ".join(f"`{b}`: {t}" for b, t in BUILDS.items() if b in cudnn) + ".",
        "",
    ]
    return lines


def _section(title: str, text: str, head: str, rows: List[List[Any]]) -> List[str]:
    """A heading, one paragraph, and a table whose ``head`` is ``"a|b|c"``."""
    return [f"## {title}", "", *([text, ""] if text else []), *_table(head.split("|"), rows)]


def _sweep_rows(sweep: List[Rec], builds: List[str]) -> List[List[Any]]:
    """Per build and heads: cases, how many were corrupted unpatched and exact patched."""
    rows = []
    for b in builds:
        groups: Dict[str, List[Rec]] = defaultdict(list)
        for r in sweep:
            if r["build"] == b:
                groups[r["heads"]].append(r)
        for heads in sorted(groups, key=lambda h: [int(x) for x in h.split("/")]):
            rs = groups[heads]
            rows.append([
                b, heads, len(rs), sum(bool(r["unpatched_corrupted"]) for r in rs),
                max(_dead(r, "unpatched_") or 0.0 for r in rs),
                sum(bool(r["patched_exact"]) for r in rs),
                max(_dead(r) or 0.0 for r in rs), max(_ratio(r) or 0.0 for r in rs),
            ])  # fmt: skip
    return rows


def _head_dim_rows(rule: List[Rec], wrapped: List[Rec], builds: List[str]) -> List[List[Any]]:
    """One row per build and shape: the three head layouts' outcomes side by side."""
    rows = []
    for b in builds:
        dims = sorted({(r["d"], r["d_v"]) for r in rule + wrapped if r["build"] == b})
        for d in dims:
            mine = [r for r in rule if r["build"] == b and (r["d"], r["d_v"]) == d]
            wrap = [r for r in wrapped if r["build"] == b and (r["d"], r["d_v"]) == d]
            rows.append([b, f"{d[0]}/{d[1]}", mine[0].get("status") if mine else "-",
                         "/".join(_fmt(r.get("te_exact")) for r in mine) or "-",
                         "/".join(_fmt(r.get("exact")) for r in wrap) or "-",
                         sum(r.get("fallback") or 0 for r in wrap)])  # fmt: skip
    return rows


def _cp_rows(cp: List[Rec], builds: List[str]) -> List[List[Any]]:
    rows = []
    for b in builds:
        for mode in ("unpatched", "patched"):
            rs = [r for r in cp if r["build"] == b and r["mode"] == mode]
            worst = [r["err_over_bound"] for r in rs if r["err_over_bound"] is not None]
            outcomes = Counter(r["status"] for r in rs)
            if rs:
                rows.append([b, mode, len(rs), ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())),
                             max(worst) if worst else None])  # fmt: skip
    return rows


def _megatron(m: Rec) -> List[str]:
    c, s = m["config"], m["stack"]
    text = (
        f"`examples/megatron_core.py` on Megatron-Core {s.get('megatron_core')}: GPTModel with the "
        f"TE spec, {c.get('layers')} layers, hidden {c.get('hidden')}, GQA {c.get('heads')}/"
        f"{c.get('groups')}, packed THD, {c.get('steps')} steps; the fix only from "
        "`TE_GQA_FIX_AUTOPATCH=1`. Tolerance per step: 2x the running max of |c - d| plus 4 "
        "bf16 ulps (`tests/multigpu/megatron/check.py`)."
    )
    keys = ("run", "cudnn", "cp", "fix", "final_loss", "max_grad_norm", "nan_steps")
    L = _section("Megatron-Core", text, "run|cuDNN|CP|fix active|final loss|max grad norm|NaN steps",
                 [[r[k] for k in keys] for r in m["runs"]])  # fmt: skip
    for t in m["matches"]:
        ok = "matches" if t["ok"] else "**does not match**"
        L.append(
            f"- ({t['test']}) against ({t['ref']}): worst err/bound {_fmt(t['max_ratio'])}, {ok}."
        )
    for name, d in m["divergence"].items():
        L.append(f"- {name}: grad norm up to {_fmt(d['max_grad_norm_ratio'])}x that of (c), "
                 f"first NaN step {_fmt(d['first_nan_step'])}.")  # fmt: skip
    return [*L, f"- check: {'PASS' if m['ok'] else 'FAIL'}", ""]


def render(recs: List[Rec]) -> str:
    """The page: header, then one section per part of the run that the data file holds."""
    by: Dict[str, List[Rec]] = defaultdict(list)
    for r in recs:
        by[r["kind"]].append(r)
    stacks = {s["build"]: s for s in by["stack"] if s.get("part") == "tests"}
    builds = list(stacks) or sorted({r["build"] for r in recs if "build" in r})

    def cases(prefix: str) -> List[Rec]:
        return [r for r in by["case"] if r.get("test", "").startswith(prefix)]

    L = ["# Validation on the GPU", "",
         "<!-- Generated by evidence/validation_report.py from docs/data/validation.jsonl; do not edit. -->",
         "", *_header(recs)]  # fmt: skip
    doctor = {r["build"]: r for r in by["doctor"]}
    outcomes = {r["build"]: r for r in by["pytest"]}
    rows = []
    for b in builds:
        c, d = outcomes.get(b, {}).get("counts"), doctor.get(b, {})
        counts = ["-"] * 4 if c is None else [c["passed"], c["failed"] + c["error"], c["xfailed"], c["skipped"]]  # fmt: skip
        rows.append([b, stacks.get(b, {}).get("cudnn_te"), *counts,
                     f"{d.get('status', '-')} (exit {d.get('exit_code', '-')})"])  # fmt: skip
    L += _section("Summary", "`pytest -m gpu` and `te-gqa-fix doctor` on each build.",
                  "build|cuDNN|passed|failed|xfailed|skipped|doctor", rows)  # fmt: skip
    not_passed = [f"- `{r['build']}` {t['outcome']}: `{t['test']}`"
                  for r in by["pytest"] for t in r["not_passed"]]  # fmt: skip
    not_passed += [f"- `{b}`: pytest did not finish (no outcomes): the sections below hold "
                   "the records of the cases it ran" for b in builds if b not in outcomes]  # fmt: skip
    L += [*not_passed, ""] if not_passed else []

    L += _section(
        "Exactness sweep",
        "`tests/gpu/test_sweep.py`: heads x head dim x dtype x mask x layout. Unpatched: one "
        "backward after a freed block of 1000.0; patched: four in a row, poisoned and not. Dead "
        "rows (true gradient 0) must be exactly 0; err/bound is the worst of TE's error against "
        "fp32 over the bound (2x PyTorch's own error in the same precision plus 4 ulps).",
        "build|heads q/kv|cases|corrupted unpatched|dead-row max unpatched|exact patched"
        "|dead-row max patched|worst err/bound",
        _sweep_rows(cases("test_sweep.py::test_sweep"), builds),
    )
    counts = cases("test_sweep.py::test_sequence_counts")
    if counts:
        L += _section(
            "Sequence counts in one call shape",
            "`tests/gpu/test_sweep.py::test_sequence_counts_in_one_call_shape`: one wrapper, GQA "
            "8/2, bf16, calls whose batches hold 6, 3, 12, then 6 sequences in the same rows "
            "(sequences without queries, padding, tail rows), each after a freed block of "
            "1000.0: the post-pass (d 128), or the fallback where cuDNN is wrong on live rows "
            "(d 256 on an affected build).",
            "build|d|deterministic|sequences|exact|dead-row max|worst err/bound",
            [[r["build"], r.get("d"), _fmt(r.get("deterministic")), _fmt(r.get("sequences")),
              _fmt(r.get("exact")), _dead(r), _ratio(r)] for r in counts],
        )  # fmt: skip
    L += _section(
        "Seed reproduction (TE #2448)",
        "2 query heads, 1 KV head, d 8, fp16, `cu_seqlens_q` [0, 0, 3], a freed block before "
        "the backward.",
        "build|test|patched|dK dead-row max|dV dead-row max|err/bound",
        [[r["build"], _case(r), _fmt(r.get("patched")), r.get("dk_dead_max"),
          r.get("dv_dead_max"), _ratio(r)] for r in cases("test_seed.py")],
    )  # fmt: skip
    L += _section(
        "DotProductAttention",
        "`install()`, cuDNN backend forced, a freed block between forward and backward; above "
        "head dim 128 also in TE's deterministic mode (`NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`), "
        "two steps compared bitwise. `one_offsets_tensor`: self-attention, one offsets tensor "
        "for queries and keys, which the wrapper leaves to TE (counted skipped).",
        "build|case|corrupted unpatched|dK dead-row max unpatched|wrapper calls"
        "|dead-row max patched|err/bound|bitwise repeatable",
        [[r["build"], r.get("heads") or _case(r), r.get("unpatched_corrupted"),
          r.get("unpatched_dk_dead_max"), _fmt(r.get("counts")) if "skipped" not in r
          else f"skipped: {_short(r['skipped'])}", _dead(r), _ratio(r),
          _fmt(r.get("bitwise_repeatable"))]
         for r in cases("test_dpa.py")],
    )  # fmt: skip
    rows = []
    for r in cases("test_graphs.py"):
        dead = max(r.get("dk_dead_max", 0.0), r.get("dv_dead_max", 0.0))
        result = (
            r.get("result")
            or f"corrupted: {_fmt(r.get('corrupted_any'))}, dead-row max {_fmt(dead)}"
        )
        rows.append([r["build"], _case(r), r.get("label") or r.get("impl") or "-", result])
    L += _section("CUDA graphs", "Capture once, replay with new offsets.",
                  "build|test|variant|result", rows)  # fmt: skip
    L += _section(
        "Head dims above 128",
        "`tests/gpu/test_head_dim.py`, per shape for MHA 8/8, GQA 8/2, MQA 8/1 after a poisoned "
        "block: is TE's own backward plus the post-pass exact (the measured table behind the "
        "rule in `te_gqa_fix/stack/affected.py`), and is the wrapper exact with default settings "
        "(the exact fallback where the rule says `unrepairable`, counted).",
        "build|d/d_v|rule|TE + post-pass exact|wrapper exact|fallback calls",
        _head_dim_rows(cases("test_head_dim.py::test_rule_matches_te"),
                       cases("test_head_dim.py::test_wrapper_exact"), builds),
    )  # fmt: skip
    L += _section(
        "Guard settings (head dim 256, GQA)",
        "`TE_GQA_FIX_GUARD`: `warn` logs once and returns TE's result, `strict` raises, "
        "`fallback` (default) logs once and computes exactly.",
        "build|test|warnings logged|expected unrepairable",
        [[r["build"], _case(r), r.get("warned"), r.get("expected")]
         for r in cases("test_head_dim.py::test_guard")],
    )  # fmt: skip
    fb = cases("test_fallback.py::test_exact_backward_matches_fp32")
    L += _section(
        "The exact fallback",
        "`tests/gpu/test_fallback.py`: `fallback.exact_backward`, fed TE's forward output and "
        "softmax statistics, then the post-pass, against fp32: head dims 192, 256 and 256/128 "
        "x GQA/MQA/MHA x padding, top-left causal across two offsets tensors, bottom-right "
        "causal, bottom-right window, top-left window (one offsets tensor) x `thd_thd_thd`/"
        "`thd_t2hd`/`deterministic=True` (GQA), zero-length sequences on both sides; two calls "
        "compared bitwise. Also one CUDA-graph capture and replay, a forward recompute for "
        "statistics of another layout, and a declined call (dropout) raising under the default.",
        "build|deterministic|cases|exact|bitwise repeatable|worst err/bound|dead-row max"
        "|TE's own backward exact",
        [[b, det, len(rs), sum(bool(r.get("exact")) for r in rs),
          sum(bool(r.get("bitwise_repeatable")) for r in rs),
          max((x for r in rs if (x := _ratio(r)) is not None), default=None),
          max((x for r in rs if (x := _dead(r)) is not None), default=None),
          f"{sum(bool(r.get('te_exact')) for r in rs)}/{sum('te_exact' in r for r in rs)}"]
         for b in builds for det in (False, True)
         if (rs := [r for r in fb if r["build"] == b and bool(r.get("deterministic")) == det])],
    )  # fmt: skip
    if by["cp"]:
        L += _section(
            "Context parallelism",
            "`tests/multigpu/cp_check.py` under torchrun: DotProductAttention (THD, padding_causal, "
            "bf16, d 128) with P2P, all-gather and A2A, compared with one GPU and with fp32; "
            "unpatched runs free a block of 1000.0 before the backward.",
            "build|mode|configurations|outcomes|worst err/bound",
            _cp_rows(by["cp"], builds),
        )
    if by["example"]:
        L += _section("Examples", "", "build|example|exit|last line",
                      [[r["build"], f"examples/{r['name']}.py", r["exit"], _short(r["result"])]
                       for r in by["example"]])  # fmt: skip
    for m in by["megatron"]:
        L += _megatron(m)
    L += ["## Regenerate", "", "```bash",
          "bash evidence/run_all.sh    # GPU machine with TE; PARTS=... picks parts, see the script",
          "cp $OUT/validation.jsonl docs/data/ && python3 evidence/validation_report.py render",
          "python3 evidence/validation_report.py render --check    # CPU: page == data",
          "```"]  # fmt: skip
    return "\n".join(L).rstrip("\n") + "\n"


def check(data: Path = DATA, page: Path = PAGE) -> bool:
    """Whether ``page`` is exactly what ``data`` renders to."""
    return page.read_text() == render(_jsonl(data))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    co = sub.add_parser("collect", help="one run's raw outputs -> the data file")
    co.add_argument("--tests", type=Path, help="records-, junit- and doctor-<build> files")
    co.add_argument("--builds", default="system,pip,route")
    co.add_argument("--extra", type=Path, help="cp_results_*.json and example logs")
    co.add_argument("--megatron", type=Path, help="tests/multigpu/megatron/run.sh's results")
    co.add_argument("--command", default="bash evidence/run_all.sh")
    co.add_argument("-o", "--output", type=Path, default=DATA)
    re_ = sub.add_parser("render", help="the data file -> the page")
    re_.add_argument("data", type=Path, nargs="?", default=DATA)
    re_.add_argument("-o", "--output", type=Path, default=PAGE)
    re_.add_argument("--check", action="store_true", help="exit 1 if the page differs")
    a = ap.parse_args(argv)
    if a.step == "collect":
        write_jsonl(collect(a.tests, a.builds.split(","), a.command, a.extra, a.megatron), a.output)
        return 0
    if a.check:
        ok = check(a.data, a.output)
        if not ok:
            print(f"{a.output} is not what {a.data} renders to: run {Path(__file__).name} render")
        return 0 if ok else 1
    a.output.write_text(render(_jsonl(a.data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
