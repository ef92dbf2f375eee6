"""Reporting for ``cp_check.py``: decide pass/fail from its results and render them.

``cp_check.py`` measures (torchrun, TE, the references) and hands its results dict here;
this module only reads that dict: :func:`check_results` (the exit status and the pytest
wrapper's assertions), :func:`summary_table` (the text printed and written next to the
JSON) and :func:`write_results` (``cp_results_cp<N>[_<tag>].json`` and
``cp_summary_cp<N>[_<tag>].txt``). Standard library only.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

RESULTS_NAME = "cp_results_cp{n}{tag}.json"
SUMMARY_NAME = "cp_summary_cp{n}{tag}.txt"


def _finite(x: Any) -> Any:
    """JSON-safe numbers: NaN/Inf become strings (json would write non-standard NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def check_results(results: Dict[str, Any], mode: Optional[str] = None) -> List[str]:
    """What is wrong with a finished run (empty: it passes), for ``mode`` (None: both).

    Shared by the exit status and the pytest wrapper. Patched: every config TE supports
    passes, p2p is never "unsupported", at least one p2p config passed. Unpatched: each run
    has an outcome (corruption observed or clean), nothing raised. A fatal harness error
    fails both.
    """
    problems: List[str] = []
    recs = [r for r in results.get("records", []) if mode is None or r.get("mode") == mode]
    if results.get("fatal"):
        problems.append(f"fatal: {results['fatal']}")
    if not recs:
        problems.append(f"no {mode or ''} configs ran".replace("  ", " "))
    for r in recs:
        tag = f"{r['cp_comm_type']} {r['heads_q']}/{r['heads_kv']} {r['shape']} {r['mode']}"
        status = r.get("status")
        why = "; ".join(r.get("reasons", []))[:600]
        if r["mode"] == "patched":
            if status == "unsupported" and r["cp_comm_type"] != "p2p":
                continue
            if status != "pass":
                problems.append(f"{tag}: {status}: {why}")
        elif status not in ("corruption_observed", "clean", "unsupported"):
            problems.append(f"{tag}: {status}: {why}")
    patched_p2p = [r for r in recs if r["mode"] == "patched" and r["cp_comm_type"] == "p2p"]
    if patched_p2p and not any(r.get("status") == "pass" for r in patched_p2p):
        problems.append("no patched p2p config passed")
    return problems


def summary_table(results: Dict[str, Any]) -> str:
    stack = results.get("stack", {})
    lines = [
        f"cp_check: cp={stack.get('cp_size')} gpu={stack.get('gpu')} torch={stack.get('torch')} "
        f"te={stack.get('te')} cudnn(TE)={stack.get('cudnn_te')} bug_expected={stack.get('bug_expected')} "
        f"poison={results.get('poison')}",
        f"{'comm':<10} {'heads':<6} {'shape':<7} {'mode':<9} {'status':<19} "
        f"{'dq/dk/dv err vs fp32':<26} {'dk/dv bound':<17} {'dk/dv pad max':<17} "
        f"{'dk/dv vs 1-GPU':<17} {'fixed':<7} {'s':>5}",
    ]

    def fmt(d: Optional[Dict[str, Any]], names: Sequence[str]) -> str:
        if not d:
            return "-"
        return "/".join(
            f"{d[n]:.3g}" if isinstance(d.get(n), float) else str(d.get(n)) for n in names
        )

    for r in results.get("records", []):
        lines.append(
            f"{r['cp_comm_type']:<10} {r['heads_q']}/{r['heads_kv']:<4} {r['shape']:<7} {r['mode']:<9} "
            f"{r.get('status', '?'):<19} {fmt(r.get('err_vs_fp32'), ('dq', 'dk', 'dv')):<26} "
            f"{fmt(r.get('bound'), ('dk', 'dv')):<17} {fmt(r.get('pad_rows_max_abs'), ('dk', 'dv')):<17} "
            f"{fmt(r.get('err_vs_single'), ('dk', 'dv')):<17} "
            f"{','.join(map(str, r.get('fixed_calls', []))) or '-':<7} {r.get('elapsed_s', 0):>5.1f}"
        )
    seen = set()
    for r in results.get("records", []):
        if r.get("status") not in ("fail", "error", "unsupported") or not r.get("reasons"):
            continue
        why = " | ".join(r["reasons"])[:800]
        if r["status"] == "unsupported":
            if why in seen:
                continue
            seen.add(why)
            tag = f"{r['cp_comm_type']} {r['heads_q']}/{r['heads_kv']}"
        else:
            tag = f"{r['cp_comm_type']} {r['heads_q']}/{r['heads_kv']} {r['shape']} {r['mode']}"
        lines.append(f"  [{tag}] {r['status']}: {why}")
    problems = check_results(results)
    lines.append(
        "RESULT: PASS" if not problems else "RESULT: FAIL (" + "; ".join(problems)[:1500] + ")"
    )
    return "\n".join(lines)


def output_paths(out_dir: str, cp_size: Any, tag: str) -> Tuple[str, str]:
    """Where rank 0 writes: ``cp_results_cp<N>[_<tag>].json`` and the matching summary."""
    suffix = f"_{tag}" if tag else ""
    return (
        os.path.join(out_dir, RESULTS_NAME.format(n=cp_size, tag=suffix)),
        os.path.join(out_dir, SUMMARY_NAME.format(n=cp_size, tag=suffix)),
    )


def write_results(out_dir: str, results: Dict[str, Any]) -> Tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    tag = str(results.get("config", {}).get("tag") or "")
    path, spath = output_paths(out_dir, results.get("stack", {}).get("cp_size", "x"), tag)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(results), f, indent=1, default=str)
    os.replace(tmp, path)
    with open(spath, "w") as f:
        f.write(summary_table(results) + "\n")
    return path, spath
