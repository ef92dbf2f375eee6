#!/usr/bin/env python3
"""docs/validation.md, docs/compatibility.md and their figures from one data file,
docs/data/validation.jsonl (blocks keyed by build and suite: see evidence_common.py).

``collect`` turns one GPU run's raw outputs into a file of the blocks that run measured
(the records the GPU tests append under ``GPU_TESTS_RECORD``, pytest's outcomes and
doctor's verdict: suite ``tests``; the one-GPU examples: ``examples``; the
context-parallel check: ``cp``; ``examples/context_parallel.py``: ``examples-multigpu``;
the Megatron-Core check: ``megatron``). ``merge`` puts such a file into the data file,
replacing only the (build, suite) blocks it holds. ``render`` writes the pages and
figures; ``render --check`` fails when a committed page is not what the data file gives.

    python3 evidence/validation_report.py collect --tests RES [--extra DIR] [--megatron DIR] -o RUN.jsonl
    python3 evidence/validation_report.py merge RUN.jsonl [--into DATA]
    python3 evidence/validation_report.py render [DATA] [-o PAGE] [--check]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_common as ev
from evidence_common import Rec, cell, day, table

ROOT = ev.ROOT
DATA = ROOT / "docs" / "data" / "validation.jsonl"
PAGE = ROOT / "docs" / "validation.md"
COMPAT = "compatibility.md"  # beside the page
FIGURES = "figures"  # beside the page
BUILDS = {
    "system": "the machine's cuDNN, which TE loads by default",
    "pip": "the cuDNN wheel torch ships, which TE loads through `CUDNN_HOME` and the loader path",
    "route": "`system` with `TE_GQA_FIX_CUDNN=auto` through the installed start-up hook",
    "cudnn920": "`system` with `TE_GQA_FIX_CUDNN=strict:FOLDER`, FOLDER the libraries of the "
    "`nvidia-cudnn-cu13` 9.20.0.48 wheel but `adv` and `ext` (torch 2.12 and 2.13 bring 9.20)",
    "cudnn9241": "the same with the 9.24.1.1 wheel (torch 2.14.1 brings 9.24)",
    "cudnn927": "the same with the 9.27.0.42 wheel (all but `adv`)",
    "cudnn9281": "the same with the 9.28.1.4 wheel, the newest",
    "system+pip": "the Megatron-Core runs, each on `system` or `pip` as its row says",
}
SUITES = {
    "tests": "GPU tests and doctor",
    "examples": "one-GPU examples",
    "cp": "context-parallel check",
    "examples-multigpu": "`examples/context_parallel.py`",
    "megatron": "Megatron-Core training",
}
EXAMPLES = ("seed_repro", "drop_in", "context_parallel")
MULTIGPU_EXAMPLES = ("context_parallel",)
GRADS = ("dq", "dk", "dv")
MEGATRON_BUILD = "system+pip"


# ----------------------------------------------------------------------------- collect


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


def pytest_record(outcomes: Dict[str, Any]) -> Rec:
    counts = Counter(o for o, _ in outcomes.values())
    others = [{"test": t, "outcome": o, "message": m} for t, (o, m) in outcomes.items()]
    return {
        "kind": "pytest",
        "counts": {
            k: counts.get(k, 0) for k in ("passed", "failed", "error", "xfailed", "skipped")
        },
        "not_passed": [r for r in others if r["outcome"] != "passed"],
    }


def doctor_record(doc: Dict[str, Any]) -> Rec:
    return {"kind": "doctor", **{k: doc.get(k) for k in ("status", "exit_code", "advice")}}


def cp_records(data: Dict[str, Any]) -> List[Rec]:
    """One compact record per configuration of ``evidence/multigpu/cp_check.py``'s results."""
    out: List[Rec] = []
    for r in data.get("records", []):
        err, bound = r.get("err_vs_fp32") or {}, r.get("bound") or {}
        ratios = [err[g] / bound[g] for g in GRADS if bound.get(g) and g in err]
        pad = r.get("pad_rows_max_abs") or {}
        out.append(
            {
                "kind": "cp",
                **{k: r.get(k) for k in ("cp_comm_type", "heads_q", "heads_kv", "shape", "mode")},
                "status": r.get("status"),
                "err_over_bound": max(ratios) if ratios else None,
                "pad_rows_max": max((pad.get(g, 0.0) for g in ("dk", "dv")), default=None),
            }
        )
    return out


def example_record(name: str, log: str) -> Rec:
    """The example's exit status (``run_all.sh`` appends ``exit N``) and its verdict line."""
    lines = [ln for ln in log.splitlines() if ln.strip() and "warn" not in ln.lower()]
    code = None
    if lines and lines[-1].startswith("exit "):
        code = int(lines.pop()[5:])
    return {
        "kind": "example",
        "name": name,
        "exit": code,
        "result": lines[-1][:300] if lines else "",
    }


def _megatron_check():
    path = ROOT / "evidence" / "multigpu" / "megatron" / "check.py"
    spec = importlib.util.spec_from_file_location("te_gqa_fix_megatron_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def megatron_record(results: Path) -> Rec:
    """What ``evidence/multigpu/megatron/check.py`` decides from the runs in ``results``."""
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
        "stack": {k: stack.get(k) for k in ("gpu", "world_size", "torch", "te", "megatron_core")},
        "date": stack.get("date"),
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


def _json(path: Path) -> Optional[Rec]:
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError:
        return None


def _block(build: str, suite: str, rows: List[Rec], stack: Optional[Rec], commit: str,
           command: str) -> List[Rec]:  # fmt: skip
    head = ev.block_head(build, suite, date=(stack or {}).get("date"), commit=commit,
                         command=command, stack=stack)  # fmt: skip
    return [head, *({**r, "build": build, "suite": suite} for r in rows)]


def collect(
    tests: Optional[Path],
    builds: List[str],
    command: str,
    commit: str,
    extra: Optional[Path] = None,
    megatron: Optional[Path] = None,
    megatron_command: Optional[str] = None,
) -> List[Rec]:
    """The blocks of one run: for each build, one per suite the run measured there."""
    out: List[Rec] = []
    probes: Dict[str, Optional[Rec]] = {}
    for b in builds:
        probes[b] = next((s for d in (tests, extra) if d is not None
                          if (s := _json(d / f"stack-{b}.json"))), None)  # fmt: skip
        if tests is None:
            continue
        rows: List[Rec] = []
        stack = None
        for r in ev.read_jsonl(tests / f"records-{b}.jsonl"):
            if r.get("kind") == "stack":
                stack = stack or r
            else:
                rows.append(r)
        if (tests / f"junit-{b}.xml").exists():
            rows.append(pytest_record(junit_outcomes(tests / f"junit-{b}.xml")))
        if (tests / f"doctor-{b}.json").exists():
            doc = _json(tests / f"doctor-{b}.json")
            rows.append(doctor_record(doc) if doc is not None else {"kind": "doctor", "status": "no JSON"})  # fmt: skip
        if rows or stack:
            out += _block(b, "tests", rows, stack or probes[b], commit, command)
            probes[b] = probes[b] or stack
    if extra is not None:
        for b in builds:
            cp: List[Rec] = []
            stack = None
            for p in sorted(extra.glob(f"cp_results_cp*_{b}.json")):
                data = json.loads(p.read_text())
                stack = stack or data.get("stack")
                cp += cp_records(data)
            if cp:
                out += _block(b, "cp", cp, stack, commit, command)
            for suite, names in (("examples", [n for n in EXAMPLES if n not in MULTIGPU_EXAMPLES]),
                                 ("examples-multigpu", MULTIGPU_EXAMPLES)):  # fmt: skip
                rows = [example_record(n, (extra / f"{n}-{b}.log").read_text())
                        for n in names if (extra / f"{n}-{b}.log").exists()]  # fmt: skip
                if rows:
                    probe = dict(probes[b] or {})
                    if suite == "examples" and probe:
                        probe["gpu_count"] = 1
                    out += _block(b, suite, rows, probe, commit, command)
    if megatron is not None and any(megatron.glob("*.json")):
        m = megatron_record(megatron)
        stack = {**m["stack"], "date": m.pop("date")}
        out += _block(MEGATRON_BUILD, "megatron", [m], stack, commit, megatron_command or command)
    return [ev.compact(r) for r in out]


def merge(old: List[Rec], new: List[Rec]) -> List[Rec]:
    return ev.merge(old, new, list(SUITES), list(BUILDS))


# ----------------------------------------------------------------------------- render


def _ratio(r: Rec) -> Optional[float]:
    """The worst of err/bound over dQ, dK, dV (1 or less: within the bound)."""
    vals = [r[f"{g}_err"] / r[f"{g}_bound"] for g in GRADS if r.get(f"{g}_bound")]
    return max(vals) if vals else None


def _dead(r: Rec, prefix: str = "") -> Optional[float]:
    vals = [r[k] for g in GRADS if (k := f"{prefix}{g}_dead_max") in r]
    return max(vals) if vals else None


def _case(r: Rec) -> str:
    return r["test"].split("::", 1)[1]


def humanize(test: str) -> str:
    """``test_x.py::test_a_b[p-q]`` -> ``a b (p, q)``: a test's name as words."""
    name = test.split("::")[-1]
    name, _, params = name.partition("[")
    words = re.sub(r"^test_", "", name).replace("_", " ")
    return words + (f" ({params.rstrip(']').replace('-', ', ')})" if params else "")


def _dicts_as_words(text: str) -> str:
    """Python dicts printed in a line (``{'calls': 2, 'fixed': 2}``) as ``calls 2, fixed 2``."""

    def words(m: re.Match) -> str:
        try:
            d = ast.literal_eval(m.group(0))
        except (ValueError, SyntaxError):
            return m.group(0)
        return (
            ", ".join(f"{k} {cell(v)}" for k, v in d.items()) if isinstance(d, dict) else m.group(0)
        )

    return re.sub(r"\{[^{}]*\}", words, text)


def _short(text: str, n: int = 120) -> str:
    return f"`{text}`" if len(text) <= n else f"`{text[: n - 3]}...`"


def _builds_words(builds: Sequence[str]) -> str:
    return ", ".join(f"`{b}`" for b in builds)


def _header(heads: List[Rec]) -> List[str]:
    te = sorted({(h.get("stack") or {}).get("te") for h in heads} - {None})
    L = [
        "What the GPU runs measured, build by build. Each build and suite keeps the results "
        "of its latest run, with that run's date, GPU and the commit of the code measured: a "
        "new run replaces only the blocks it measured again (see Regenerate).",
        "",
        "How the runs are made: on a GPU machine without network, Transformer Engine (TE) "
        f"{', '.join(te) or '?'} installed there from PyPI wheels carried in (the run scripts "
        "call that staged copy the *GPU kit*); the outputs of each command come back in one "
        "folder (`$OUT` in the scripts) and are merged into the data file on a CPU machine.",
        "",
        "Builds (the cuDNN TE runs): "
        + "; ".join(f"`{b}`: {t}" for b, t in BUILDS.items() if any(h["build"] == b for h in heads))
        + ".",
        "",
        "## Runs",
        "",
    ]
    groups: Dict[Tuple[Any, ...], List[Rec]] = {}
    for h in heads:
        k = (h["suite"], day(h.get("date")), ev.gpus_words(h), ev.commit_cell(h), h.get("command"))
        groups.setdefault(k, []).append(h)
    rows = [[_builds_words([h["build"] for h in g]), SUITES.get(k[0], k[0]), k[1], k[2], k[3],
             f"`{k[4] or '-'}`"] for k, g in groups.items()]  # fmt: skip
    L += table(["builds", "suite", "date", "GPU", "commit", "command"], rows)
    L += ["The stacks, in words:", ""]
    for first, g in ev.stack_groups(heads):
        cud: Dict[str, List[str]] = {}
        for h in g:
            v = (h.get("stack") or {}).get("cudnn_te")
            if v and h["build"] not in cud.setdefault(v, []):
                cud[v].append(h["build"])
        suites = ", ".join(dict.fromkeys(SUITES.get(h["suite"], h["suite"]) for h in g))
        builds = _builds_words(list(dict.fromkeys(h["build"] for h in g)))
        text = f"- {builds} ({suites}; {day(first.get('date'))}): {ev.stack_words(first)}"
        if cud:
            text += "; cuDNN as TE runs it: " + ", ".join(
                f"{v} ({_builds_words(bs)})" for v, bs in cud.items()
            )
        L.append(text + ".")
    return [*L, ""]


def _section(title: str, text: str, head: str, rows: List[List[Any]]) -> List[str]:
    """A heading, one paragraph, and a table whose ``head`` is ``"a|b|c"``."""
    return [f"## {title}", "", *([text, ""] if text else []), *table(head.split("|"), rows)]


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


#: The sweep's layouts with empty sequences (tests/gpu/test_sweep.py), in words.
EMPTY_LAYOUTS = {
    "q_empty": "queries",
    "kv_empty": "keys",
    "both_empty": "either",
}


def _empty_rows(sweep: List[Rec], builds: List[str]) -> List[List[Any]]:
    """Per build and layout with empty sequences, ``deterministic`` both ways: cases,
    corrupted unpatched, exact patched, non-finite values in rows that receive attention."""
    rows = []
    for b in builds:
        for layout, words in EMPTY_LAYOUTS.items():
            rs = [r for r in sweep if r["build"] == b and r.get("layout") == layout]
            if not rs:
                continue
            det = sorted({"yes" if r.get("deterministic") else "no" for r in rs}, reverse=True)
            live = sum(r.get(f"{g}_nonfinite_live") or 0 for r in rs for g in GRADS)
            rows.append([
                b, f"{layout} ({words})", "/".join(det), len(rs),
                sum(bool(r["unpatched_corrupted"]) for r in rs),
                sum(bool(r["patched_exact"]) for r in rs), live,
                max(_ratio(r) or 0.0 for r in rs),
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
                         "/".join(cell(r.get("te_exact")) for r in mine) or "-",
                         "/".join(cell(r.get("exact")) for r in wrap) or "-",
                         sum(r.get("fallback") or 0 for r in wrap)])  # fmt: skip
    return rows


def _dpa_label(r: Rec) -> str:
    t = _case(r).split("[")[0]
    if t == "test_dpa_thd_gqa" and r.get("heads"):
        return str(r["heads"])
    if t == "test_dpa_steady_state":
        return "steady state"
    if t == "test_dpa_one_offsets_tensor_is_exact_untouched":
        return f"one offsets tensor, d {r.get('head_dim', '?')}, {r.get('mask', '?')}"
    if t == "test_dpa_large_head_dims":
        dims = "/".join(map(str, r.get("dims") or ["?"]))
        return ", ".join(x for x in (f"d {dims}", r.get("mask"), r.get("layout")) if x)
    return humanize(r["test"])


def _dpa_rows(dpa: List[Rec]) -> List[List[Any]]:
    """One row per build and case; a case run deterministic and not whose cells are the
    same is one row (``no, yes``)."""
    rows: List[List[Any]] = []
    for r in dpa:
        if "skipped" in r:
            counts = f"skipped: {_short(r['skipped'])}"
        elif isinstance(r.get("counts"), dict):
            counts = ", ".join(f"{k} {v}" for k, v in r["counts"].items() if v) or "-"
        else:
            counts = "-"
        det = r.get("deterministic")
        row = [r["build"], _dpa_label(r), "-" if det is None else cell(bool(det)),
               r.get("unpatched_corrupted"), r.get("unpatched_dk_dead_max"), counts, _dead(r),
               _ratio(r), cell(r.get("bitwise_repeatable"))]  # fmt: skip
        prev = rows[-1] if rows else None
        if prev and prev[:2] == row[:2] and prev[3:] == row[3:] and prev[2] != row[2]:
            prev[2] = f"{prev[2]}, {row[2]}"
        else:
            rows.append(row)
    return rows


def _seed_label(r: Rec) -> str:
    p = r.get("patched")
    if p is False:
        return "unpatched"
    if p is True:
        return "patched, " + ("second call" if r.get("second_call") else "first call")
    return str(p) if p is not None else humanize(r["test"])


def _graph_result(r: Rec) -> str:
    """A case's result in words; the start-up hook case prints ``RESULT exact fallback-calls
    expected {errors}``, read here."""
    text = r.get("result")
    if not text:
        dead = max(r.get("dk_dead_max", 0.0), r.get("dv_dead_max", 0.0))
        return f"corrupted: {cell(r.get('corrupted_any'))}, dead-row max {cell(dead)}"
    m = re.match(r"RESULT (\w+) (\d+) (\w+) (\{.*\})\s*$", text)
    if not m:
        return _dicts_as_words(text)
    try:
        res = ast.literal_eval(m.group(4))
    except (ValueError, SyntaxError):
        res = {}
    return (
        f"exact: {cell(m.group(1) == 'True')}, fallback calls {m.group(2)}, expected "
        f"unrepairable: {cell(m.group(3) == 'True')}, worst err/bound {cell(_ratio(res))}, "
        f"dead-row max {cell(_dead(res))}"
    )


def _graph_label(r: Rec) -> str:
    t = _case(r).split("[")[0]
    return {
        "test_postpass_graph_replay_new_offsets": "the post-pass, replayed with new offsets",
        "test_te_backward_with_wrapper_in_graph": "TE's backward through the wrapper",
        "test_head_dim_256_in_graph_through_startup_hook": "head dim 256 through the start-up hook",
    }.get(t, humanize(r["test"]))


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
        "bf16 ulps (`evidence/multigpu/megatron/check.py`)."
    )
    keys = ("run", "cudnn", "cp", "fix", "final_loss", "max_grad_norm", "nan_steps")
    L = _section("Megatron-Core", text, "run|cuDNN|CP|fix active|final loss|max grad norm|NaN steps",
                 [[r[k] for k in keys] for r in m["runs"]])  # fmt: skip
    for t in m["matches"]:
        ok = "matches" if t["ok"] else "**does not match**"
        L.append(
            f"- ({t['test']}) against ({t['ref']}): worst err/bound {cell(t['max_ratio'])}, {ok}."
        )
    for name, d in m["divergence"].items():
        L.append(f"- {name}: grad norm up to {cell(d['max_grad_norm_ratio'])}x that of (c), "
                 f"first NaN step {cell(d['first_nan_step'])}.")  # fmt: skip
    return [*L, f"- check: {'PASS' if m['ok'] else 'FAIL'}", ""]


def _not_passed(pytest_recs: List[Rec], builds: List[str], finished: set) -> List[str]:
    """The tests that did not pass, grouped by outcome, file and message, in words."""
    groups: Dict[Tuple[str, str, str], Dict[str, List[str]]] = {}
    for r in pytest_recs:
        for t in r["not_passed"]:
            file = t["test"].split("::")[0]
            g = groups.setdefault((t["outcome"], file, t.get("message") or ""), {})
            g.setdefault(humanize(t["test"]), []).append(r["build"])
    L = []
    for (outcome, file, msg), names in groups.items():
        bs = list(dict.fromkeys(b for v in names.values() for b in v))
        tests = ", ".join(f"*{n}*" for n in names)
        why = f": {msg.rstrip('.')}" if msg else ""
        L.append(f"- {outcome} on {_builds_words(bs)}: {tests} (`{file}`){why}.")
    L += [f"- `{b}`: pytest did not finish (no outcomes): the sections below hold the records "
          "of the cases it ran." for b in builds if b not in finished]  # fmt: skip
    return ["Tests that did not pass:", "", *L, ""] if L else []


def render(recs: List[Rec], fakes: Sequence[str] = ()) -> str:
    """The page: runs and stacks, compatibility, then one section per part of the data."""
    heads = [r for r in recs if r.get("kind") == ev.BLOCK]
    by: Dict[str, List[Rec]] = defaultdict(list)
    for r in recs:
        by[r["kind"]].append(r)
    tests = {h["build"]: h for h in heads if h["suite"] == "tests"}
    builds = list(tests) or list(dict.fromkeys(h["build"] for h in heads))

    def cases(prefix: str) -> List[Rec]:
        return [r for r in by["case"] if r.get("test", "").startswith(prefix)]

    L = ["# Validation on the GPU", "",
         "<!-- Generated by evidence/validation_report.py from docs/data/validation.jsonl; "
         "do not edit. -->", "", *_header(heads)]  # fmt: skip
    L += [
        "![Head dims above 128: TE's backward plus the post-pass, and the wrapper, per build]"
        f"({FIGURES}/validation-head-dims.svg)",
        "",
        "![Dead-row maximum of TE's backward unpatched, per heads layout and build]"
        f"({FIGURES}/validation-dead-rows.svg)",
        "",
        "## Compatibility",
        "",
        *ev.compatibility(heads, fakes),
        ev.COMPAT_LEGEND,
        "",
    ]
    doctor = {r["build"]: r for r in by["doctor"]}
    outcomes = {r["build"]: r for r in by["pytest"]}
    rows = []
    for b in builds:
        c, d, h = outcomes.get(b, {}).get("counts"), doctor.get(b, {}), tests.get(b, {})
        counts = ["-"] * 4 if c is None else [c["passed"], c["failed"] + c["error"], c["xfailed"], c["skipped"]]  # fmt: skip
        rows.append([b, (h.get("stack") or {}).get("cudnn_te"), day(h.get("date")),
                     ev.gpus_words(h) if h else "-", *counts,
                     f"{d.get('status', '-')} (exit {d.get('exit_code', '-')})"])  # fmt: skip
    L += _section("Summary", "`pytest -m gpu` and `te-gqa-fix doctor` on each build.",
                  "build|cuDNN|date|GPU|passed|failed|xfailed|skipped|doctor", rows)  # fmt: skip
    L += _not_passed(by["pytest"], builds, set(outcomes))

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
    empty = _empty_rows(cases("test_sweep.py::test_sweep"), builds)
    if empty:
        L += _section(
            "Sequences without queries or keys",
            "The same sweep by layout: every layout has its kind of empty sequence in the middle "
            "of the batch and at its end, with padding between sequences and tail rows. Context "
            "parallelism makes such sequences on every step. Non-finite live: NaN or inf, patched, "
            "in rows that receive attention, which no post-pass may zero.",
            "build|sequences without|deterministic|cases|corrupted unpatched|exact patched"
            "|non-finite live|worst err/bound",
            empty,
        )
    counts = cases("test_sweep.py::test_sequence_counts")
    if counts:
        L += _section(
            "Sequence counts in one call shape",
            "`tests/gpu/test_sweep.py`, sequence counts in one call shape: one wrapper, GQA "
            "8/2, bf16, calls whose batches hold 6, 3, 12, then 6 sequences in the same rows "
            "(sequences without queries, padding, tail rows), each after a freed block of "
            "1000.0: the post-pass (d 128), or the fallback where cuDNN is wrong on live rows "
            "(d 256 on an affected build).",
            "build|d|deterministic|sequences|exact|dead-row max|worst err/bound",
            [[r["build"], r.get("d"), cell(r.get("deterministic")),
              ", ".join(map(str, r.get("sequences") or [])) or "-",
              cell(r.get("exact")), _dead(r), _ratio(r)] for r in counts],
        )  # fmt: skip
    statuses = by["status"]
    if statuses:
        L += _section(
            "In-process status",
            "`tests/gpu/test_status.py`: `te_gqa_fix.status()` inside the test process after "
            "`install()` and one backward of the seed case through TE's own module: what a "
            "training script that calls `install()` sees (`te-gqa-fix doctor` runs in a process "
            "of its own).",
            "build|fix|call sites|cuDNN TE runs|GPU|verdict|post-pass on CUDA|calls",
            [[r["build"], "active" if r.get("installed") else "NOT active", len(r.get("sites") or []),
              r.get("cudnn"), r.get("gpu"), r.get("verdict"), r.get("postpass"),
              ", ".join(f"{k} {v}" for k, v in (r.get("calls") or {}).items() if v)]
             for r in statuses],
        )  # fmt: skip
        first = statuses[0]
        L += [f"What `print(te_gqa_fix.status())` shows on `{first['build']}`:", "", "```",
              *str(first.get("text", "")).splitlines(), "```", ""]  # fmt: skip
    L += _section(
        "Seed reproduction (TE #2448)",
        "2 query heads, 1 KV head, d 8, fp16, `cu_seqlens_q` [0, 0, 3], a freed block before "
        "the backward.",
        "build|call|dK dead-row max|dV dead-row max|err/bound",
        [[r["build"], _seed_label(r), r.get("dk_dead_max"), r.get("dv_dead_max"), _ratio(r)]
         for r in cases("test_seed.py")],
    )  # fmt: skip
    L += _section(
        "DotProductAttention",
        "`install()`, cuDNN backend forced, a freed block between forward and backward; above "
        "head dim 128 also in TE's deterministic mode (`NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`), "
        "two steps compared bitwise. Cases: heads 8/2 and 16/1 (one call each); the steady "
        "state (five calls); one offsets tensor (self-attention, one offsets tensor for "
        "queries and keys, which the wrapper leaves to TE: counted skipped); head dims above "
        "128 (d q-k/v, mask, layout). A case run deterministic and not with the same results "
        "is one row.",
        "build|case|deterministic|corrupted unpatched|dK dead-row max unpatched|wrapper calls"
        "|dead-row max patched|err/bound|bitwise repeatable",
        _dpa_rows(cases("test_dpa.py")),
    )
    L += _section("CUDA graphs", "Capture once, replay with new offsets.",
                  "build|case|variant|result",
                  [[r["build"], _graph_label(r), r.get("label") or r.get("impl") or "-",
                    _graph_result(r)] for r in cases("test_graphs.py")])  # fmt: skip
    L += _section(
        "Head dims above 128",
        "`tests/gpu/test_head_dim.py`, per shape for MHA 8/8, GQA 8/2, MQA 8/1 after a poisoned "
        "block: is TE's own backward plus the post-pass exact (the measured table behind the "
        "rule in `te_gqa_fix/rules.py`), and is the wrapper exact with default settings (the "
        "exact fallback where the rule says `live_rows_wrong`, counted; a fourth result with "
        "the PyTorch post-pass where there is one). *rule* is the verdict of the code run: a "
        "build not yet measured then reads `stale_rows` (the post-pass kept), with live rows "
        "judged by the measured build below it; its row here is what measured it.",
        "build|d/d_v|rule|TE + post-pass exact|wrapper exact|fallback calls",
        _head_dim_rows(cases("test_head_dim.py::test_rule_matches_te"),
                       cases("test_head_dim.py::test_wrapper_exact"), builds),
    )  # fmt: skip
    L += _section(
        "Guard settings (head dim 256, GQA)",
        "`TE_GQA_FIX_GUARD`: `warn` logs once and returns TE's result, `strict` raises, "
        "`fallback` (default) logs once and computes exactly.",
        "build|setting|warnings logged|expected unrepairable",
        [[r["build"], r.get("mode") or humanize(r["test"]), r.get("warned"), r.get("expected")]
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
        cp_builds = list(dict.fromkeys(r["build"] for r in by["cp"]))
        L += _section(
            "Context parallelism",
            "`evidence/multigpu/cp_check.py` under torchrun: DotProductAttention (THD, padding_causal, "
            "bf16, d 128) with P2P, all-gather and A2A, compared with one GPU and with fp32; "
            "unpatched runs free a block of 1000.0 before the backward.",
            "build|mode|configurations|outcomes|worst err/bound",
            _cp_rows(by["cp"], cp_builds),
        )
    if by["example"]:
        L += _section("Examples", "The last line each example printed.",
                      "build|example|exit|last line",
                      [[r["build"], f"examples/{r['name']}.py", r["exit"],
                        _short(_dicts_as_words(r["result"]), 160)]
                       for r in by["example"]])  # fmt: skip
    for m in by["megatron"]:
        L += _megatron(m)
    L += [
        "## Regenerate",
        "",
        "```bash",
        "# GPU machine, repository root, TE installed as above; BUILDS=... and PARTS=... pick",
        "# what runs (see the script). Writes $OUT/validation.jsonl: the blocks this run measured.",
        "bash evidence/run_all.sh",
        "# CPU machine, with that file back: replace those (build, suite) blocks, keep the rest,",
        "# then write this page, docs/compatibility.md and docs/figures/validation-*.svg.",
        "python3 evidence/validation_report.py merge $OUT/validation.jsonl",
        "python3 evidence/validation_report.py render",
        "python3 evidence/validation_report.py render --check    # the pages are what the data gives",
        "```",
    ]
    return "\n".join(L).rstrip("\n") + "\n"


def render_compat(recs: List[Rec], fakes: Sequence[str]) -> str:
    heads = [r for r in recs if r.get("kind") == ev.BLOCK]
    L = ["# Compatibility", "",
         "<!-- Generated by evidence/validation_report.py from docs/data/validation.jsonl and "
         "tests/fakes/te_signatures.py; do not edit. -->", "",
         "Which releases te-gqa-fix was run against. The GPU runs behind each row, with their "
         "dates and commits, are on the [validation page](validation.md).", "",
         *ev.compatibility(heads, fakes), ev.COMPAT_LEGEND]  # fmt: skip
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------- figures


def draw_figures(recs: List[Rec], folder: Path) -> List[Path]:
    """The validation page's figures, as SVG files in ``folder``; [] without matplotlib."""
    plt = ev.pyplot()
    if plt is None:
        return []
    tests = [r["build"] for r in recs if r.get("kind") == ev.BLOCK and r["suite"] == "tests"]
    dates = {r["build"]: day(r.get("date")) for r in recs if r.get("kind") == ev.BLOCK and r["suite"] == "tests"}  # fmt: skip
    gpus = {r["build"]: r.get("gpu") or "?" for r in recs if r.get("kind") == ev.BLOCK and r["suite"] == "tests"}  # fmt: skip
    cases = [r for r in recs if r.get("kind") == "case"]
    out = []

    # Head dims: per build and shape, TE's backward + the post-pass exact or not.
    rule = [r for r in cases if r["test"].startswith("test_head_dim.py::test_rule_matches_te")]
    wrap = [r for r in cases if r["test"].startswith("test_head_dim.py::test_wrapper_exact")]
    builds = [b for b in tests if any(r["build"] == b for r in rule)]
    dims = sorted({(r["d"], r["d_v"]) for r in rule})
    if builds and dims:
        import matplotlib.colors as mcolors

        grid = [[math.nan] * len(dims) for _ in builds]
        fig, ax = plt.subplots(figsize=(1.1 * len(dims) + 2.2, 0.75 * len(builds) + 1.6))
        for i, b in enumerate(builds):
            for j, d in enumerate(dims):
                mine = [r for r in rule if r["build"] == b and (r["d"], r["d_v"]) == d]
                ours = [r for r in wrap if r["build"] == b and (r["d"], r["d_v"]) == d]
                if not mine:
                    continue
                grid[i][j] = sum(bool(r.get("te_exact")) for r in mine) / len(mine)
                te = (
                    "TE exact" if grid[i][j] == 1 else "TE wrong" if grid[i][j] == 0 else "TE mixed"
                )
                ok = ours and all(r.get("exact") for r in ours)
                fb = sum(r.get("fallback") or 0 for r in ours)
                ax.text(j, i, f"{te}\nwrapper {'exact' if ok else 'NOT exact'}"
                        + ("\n(fallback)" if fb else ""), ha="center", va="center", fontsize=7)  # fmt: skip
        cmap = mcolors.LinearSegmentedColormap.from_list("te", ["#f4a6a6", "#b8e0b0"])
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(dims)), [f"{a}/{b}" for a, b in dims])
        ax.set_yticks(range(len(builds)), [f"{b}\n{gpus[b]}, {dates[b]}" for b in builds])
        ax.set_xlabel("head dim q-k/v")
        ax.grid(False)
        ax.set_title("TE's backward + post-pass (colour) and the wrapper (text), MHA/GQA/MQA")
        fig.tight_layout()
        out.append(ev.save(fig, folder / "validation-head-dims.svg"))

    # Dead rows unpatched: the sweep's worst value per heads layout, per build.
    sweep = [r for r in cases if r["test"].startswith("test_sweep.py::test_sweep")]
    builds = [b for b in tests if any(r["build"] == b for r in sweep)]
    heads = sorted({r["heads"] for r in sweep}, key=lambda h: [int(x) for x in h.split("/")])
    if builds and heads:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        width = 0.8 / len(builds)
        top = 1e6
        for i, b in enumerate(builds):
            vals = [max((_dead(r, "unpatched_") or 0.0 for r in sweep
                         if r["build"] == b and r["heads"] == h), default=0.0) for h in heads]  # fmt: skip
            xs = [j + (i - (len(builds) - 1) / 2) * width for j in range(len(heads))]
            bars = ax.bar(xs, [min(v, top) for v in vals], width, label=f"{b} ({gpus[b]}, {dates[b]})")  # fmt: skip
            for x, v, bar in zip(xs, vals, bars):
                if math.isinf(v):
                    ax.text(x, top, "inf", ha="center", va="bottom", fontsize=7)
                    bar.set_hatch("//")
                elif v == 0:
                    ax.text(x, 0, "0", ha="center", va="bottom", fontsize=6, color=f"C{i}")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(0, top * 5)
        ax.set_xticks(range(len(heads)), heads)
        ax.set_xlabel("heads q/kv")
        ax.set_ylabel("dead-row max, unpatched")
        ax.set_title("TE's backward unpatched: largest value on rows whose true gradient is 0")
        ax.legend(fontsize=7)
        fig.tight_layout()
        out.append(ev.save(fig, folder / "validation-dead-rows.svg"))
    return out


# ----------------------------------------------------------------------------- main


def outputs(page: Path) -> Tuple[Path, Path]:
    """The compatibility snippet and the figures' folder that go with ``page``."""
    return page.parent / COMPAT, page.parent / FIGURES


def check(data: Path = DATA, page: Path = PAGE) -> bool:
    """Whether ``page`` and the compatibility snippet beside it are what ``data`` renders to
    (figures are not compared: their bytes depend on matplotlib's release)."""
    recs, fakes = ev.read_jsonl(data), ev.fake_releases()
    compat, _ = outputs(page)
    return (
        page.exists()
        and page.read_text() == render(recs, fakes)
        and compat.exists()
        and compat.read_text() == render_compat(recs, fakes)
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    co = sub.add_parser("collect", help="one run's raw outputs -> a file of its blocks")
    co.add_argument("--tests", type=Path, help="records-, junit-, doctor- and stack-<build> files")
    co.add_argument("--builds", default="system,pip,route")
    co.add_argument(
        "--extra", type=Path, help="cp_results_*.json, example logs, stack-<build>.json"
    )
    co.add_argument("--megatron", type=Path, help="evidence/multigpu/megatron/run.sh's results")
    co.add_argument("--command", default="bash evidence/run_all.sh")
    co.add_argument("--megatron-command", default=None)
    co.add_argument("--commit", default=None, help="the code measured (default: COMMIT or git)")
    co.add_argument("-o", "--output", type=Path, required=True)
    me = sub.add_parser("merge", help="a run's blocks -> the data file, replacing those blocks")
    me.add_argument("run", type=Path, nargs="+")
    me.add_argument("--into", type=Path, default=DATA)
    re_ = sub.add_parser("render", help="the data file -> the pages and figures")
    re_.add_argument("data", type=Path, nargs="?", default=DATA)
    re_.add_argument("-o", "--output", type=Path, default=PAGE)
    re_.add_argument("--check", action="store_true", help="exit 1 if a page differs")
    re_.add_argument("--no-figures", action="store_true")
    a = ap.parse_args(argv)
    if a.step == "collect":
        recs = collect(a.tests, a.builds.split(","), a.command, a.commit or ev.code_commit(),
                       a.extra, a.megatron, a.megatron_command)  # fmt: skip
        ev.write_jsonl(recs, a.output)
        print(f"{a.output}: {len(ev.blocks(recs))} blocks: "
              + ", ".join(f"{b}/{s}" for b, s in ev.blocks(recs)))  # fmt: skip
        return 0
    if a.step == "merge":
        recs = ev.read_jsonl(a.into)
        for p in a.run:
            new = ev.read_jsonl(p)
            recs = merge(recs, new)
            print(f"{p}: replaced " + ", ".join(f"{b}/{s}" for b, s in ev.blocks(new)))
        ev.write_jsonl(recs, a.into)
        return 0
    compat, figures = outputs(a.output)
    if a.check:
        ok = check(a.data, a.output)
        if not ok:
            print(f"{a.output} or {compat} is not what {a.data} renders to: "
                  f"run {Path(__file__).name} render")  # fmt: skip
        return 0 if ok else 1
    recs, fakes = ev.read_jsonl(a.data), ev.fake_releases()
    a.output.write_text(render(recs, fakes))
    compat.write_text(render_compat(recs, fakes))
    if not a.no_figures:
        drawn = draw_figures(recs, figures)
        print(f"figures: {', '.join(str(p) for p in drawn) or 'none (pip install matplotlib)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
