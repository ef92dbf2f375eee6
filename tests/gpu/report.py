"""Summarise a GPU validation run into markdown (docs/validation.md is made by this).

Input: a results folder written by ``tests/gpu/run_validation.sh``: for each cuDNN build
``junit-<build>.xml`` (pytest), ``records-<build>.jsonl`` (one JSON line per case, plus
one describing the stack), optionally ``doctor-<build>.json`` and ``cp-<build>.jsonl``.
Nothing here is typed by hand: every number comes from those files.

    python tests/gpu/report.py RESULTS_DIR --command "..." > docs/validation.md
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List


def _jsonl(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _junit(path: Path) -> Dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "xfailed": 0, "xpassed": 0}
    failures: List[str] = []
    if not path.exists():
        return {"counts": counts, "failures": ["(no junit file)"]}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kids = {c.tag: c for c in case}
        if "failure" in kids:
            counts["failed"] += 1
            failures.append(name + ": " + (kids["failure"].get("message") or "")[:300])
        elif "error" in kids:
            counts["error"] += 1
            failures.append(name + ": " + (kids["error"].get("message") or "")[:300])
        elif "skipped" in kids:
            msg = kids["skipped"].get("type", "") + (kids["skipped"].get("message") or "")
            counts["xfailed" if "xfail" in msg else "skipped"] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failures": failures}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def _table(rows: List[Dict[str, Any]], cols: List[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def render(res: Path, command: str, builds: List[str]) -> str:
    lines: List[str] = []
    recs = {b: _jsonl(res / f"records-{b}.jsonl") for b in builds}
    stacks = {b: next((r for r in recs[b] if r.get("kind") == "stack"), {}) for b in builds}
    any_stack = next((s for s in stacks.values() if s), {})
    lines.append(f"Run on: {any_stack.get('date', '')}")
    lines.append("")
    lines.append("Command (GPU machine, repository root, after staging the GPU kit):")
    lines.append("")
    lines.append("```bash\n" + command + "\n```")
    lines.append("")
    lines.append("### Stack")
    lines.append("")
    keys = [
        "gpu",
        "capability",
        "driver",
        "torch",
        "cuda",
        "te",
        "cudnn_te",
        "cudnn_torch",
        "cudnn_files",
    ]
    lines.append("| | " + " | ".join(builds) + " |")
    lines.append("|---|" + "---|" * len(builds))
    for k in keys:
        vals = []
        for b in builds:
            v = stacks[b].get(k, "")
            if isinstance(v, list):
                v = "<br>".join(Path(p).name for p in v) or "-"
            vals.append(str(v))
        lines.append(f"| {k} | " + " | ".join(vals) + " |")
    lines.append("")
    lines.append("### Test outcome (pytest, `-m gpu`)")
    lines.append("")
    lines.append("| build | passed | failed | errors | xfailed | skipped |")
    lines.append("|---|---|---|---|---|---|")
    junits = {b: _junit(res / f"junit-{b}.xml") for b in builds}
    for b in builds:
        c = junits[b]["counts"]
        lines.append(
            f"| {b} (cuDNN {stacks[b].get('cudnn_te', '?')}) | {c['passed']} | {c['failed']} | "
            f"{c['error']} | {c['xfailed']} | {c['skipped']} |"
        )
    for b in builds:
        for f in junits[b]["failures"]:
            lines.append(f"\n- {b}: FAILED `{f}`")
    lines.append("")

    def cases(b: str, prefix: str) -> List[Dict[str, Any]]:
        return [
            r for r in recs[b] if r.get("kind") == "case" and r.get("test", "").startswith(prefix)
        ]

    lines.append("### Seed reproduction (2 query heads, 1 KV head, d 8, fp16, poisoned block)")
    lines.append("")
    rows = []
    for b in builds:
        for r in cases(b, "test_seed.py"):
            rows.append({"build": b, **r})
    lines.append(
        _table(
            rows,
            [
                "build",
                "test",
                "cudnn",
                "patched",
                "dk_dead_max",
                "dv_dead_max",
                "dq_err",
                "dk_err",
                "dk_bound",
                "dv_err",
                "dv_bound",
            ],
        )
    )
    lines.append("")
    lines.append("### Exactness sweep (heads x d x dtype x mask x layout)")
    lines.append("")
    lines.append(
        "Unpatched: one call after a poisoned block (sentinel 1000.0). Patched: four calls in a "
        "row, poisoned and not; the worst of the four is shown. `err/bound` is the largest ratio "
        "of TE's error against the fp32 reference to the bound (2x the same-precision PyTorch "
        "error plus 4 ulps); dead rows must be exactly 0."
    )
    lines.append("")
    summary = []
    for b in builds:
        sw = cases(b, "test_sweep.py")
        if not sw:
            continue
        by_heads: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
        for r in sw:
            by_heads[r["heads"]].append(r)
        for heads, rs in sorted(by_heads.items()):
            ratio = max(
                max(
                    r[f"{g}_err"] / r[f"{g}_bound"] if r[f"{g}_bound"] else 0.0
                    for g in ("dq", "dk", "dv")
                )
                for r in rs
            )
            summary.append(
                {
                    "build": f"{b} ({rs[0].get('cudnn')})",
                    "heads q/kv": heads,
                    "cases": len(rs),
                    "corrupted unpatched": sum(bool(r["unpatched_corrupted"]) for r in rs),
                    "max dead-row value unpatched": max(
                        max(r["unpatched_dk_dead_max"], r["unpatched_dv_dead_max"]) for r in rs
                    ),
                    "exact patched": sum(bool(r["patched_exact"]) for r in rs),
                    "max dead-row value patched": max(
                        max(r["dk_dead_max"], r["dv_dead_max"], r["dq_dead_max"]) for r in rs
                    ),
                    "worst err/bound patched": ratio,
                }
            )
    lines.append(
        _table(
            summary,
            [
                "build",
                "heads q/kv",
                "cases",
                "corrupted unpatched",
                "max dead-row value unpatched",
                "exact patched",
                "max dead-row value patched",
                "worst err/bound patched",
            ],
        )
    )
    lines.append("")
    for title, prefix, cols in (
        (
            "DotProductAttention end to end (install(), cuDNN backend forced)",
            "test_dpa.py",
            [
                "build",
                "heads",
                "unpatched_corrupted",
                "unpatched_dk_dead_max",
                "counts",
                "dq_err",
                "dq_bound",
                "dk_err",
                "dk_bound",
                "dv_err",
                "dv_bound",
                "dk_dead_max",
            ],
        ),
        (
            "CUDA graphs (capture, replay with new offsets)",
            "test_graphs.py",
            [
                "build",
                "test",
                "label",
                "impl",
                "corrupted_any",
                "dk_dead_max",
                "dv_dead_max",
                "dq_err",
                "dk_err",
                "dv_err",
                "result",
            ],
        ),
        (
            "Head dim 192/256 (not repairable by a post-pass on old cuDNN)",
            "test_head_dim.py",
            [
                "build",
                "heads",
                "d",
                "exact",
                "dq_err",
                "dq_bound",
                "dk_err",
                "dk_bound",
                "dv_err",
                "dv_bound",
            ],
        ),
    ):
        rows = [{"build": b, **r} for b in builds for r in cases(b, prefix)]
        lines.append(f"### {title}")
        lines.append("")
        lines.append(_table(rows, cols) if rows else "(no records)")
        lines.append("")
    docs = {b: res / f"doctor-{b}.json" for b in builds}
    if any(p.exists() for p in docs.values()):
        lines.append("### `te-gqa-fix doctor --json` on the same machine")
        lines.append("")
        for b, p in docs.items():
            if p.exists():
                lines.append(f"{b}:\n\n```json\n{p.read_text().strip()}\n```\n")
    return "\n".join(lines) + "\n"


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", type=Path)
    ap.add_argument("--command", default="bash tests/gpu/run_validation.sh")
    ap.add_argument("--builds", default="system,pip")
    args = ap.parse_args(argv)
    sys.stdout.write(render(args.results, args.command, args.builds.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
