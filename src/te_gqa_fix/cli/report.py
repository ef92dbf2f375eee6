"""The text form of ``te-gqa-fix doctor``'s report (what a person reads in a job log).

Kept apart from :mod:`te_gqa_fix.doctor`, which gathers the facts and decides: this module
only prints a report dict that :func:`te_gqa_fix.doctor.collect` made.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["format_report"]


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def format_report(report: Dict[str, Any]) -> str:
    """Human-readable form of :func:`collect`'s result."""
    te = report.get("transformer_engine", {})
    tor = report.get("torch", {})
    gpu = report.get("gpu", {})
    fix = report.get("fix", {})
    lines = ["te-gqa-fix doctor", ""]

    def row(key: str, value: Any) -> None:
        lines.append(f"  {key:<20} {value}")

    row("te-gqa-fix", report.get("te_gqa_fix", {}).get("version"))
    row("python", report.get("python"))
    row("torch", f"{tor.get('version')} (CUDA {tor.get('cuda')})" if "version" in tor else tor)
    te_line = te.get("version") or "not installed"
    if te.get("error") and te.get("version"):
        te_line += f"  [{te['error']}]"
    row("Transformer Engine", te_line)
    if gpu.get("available"):
        cap = gpu.get("capability") or [0, 0]
        row("GPU", f"{gpu.get('name')}, compute capability {cap[0]}.{cap[1]} "
            f"(sm{cap[0]}{cap[1]}), {gpu.get('count')} device(s)")  # fmt: skip
    else:
        row("GPU", gpu.get("error") or "none visible to torch")
    row("cuDNN (TE runs)", te.get("cudnn") or "unknown")
    row("cuDNN (torch's)", tor.get("cudnn") or "unknown")
    libs = report.get("cudnn_libraries") or []
    if libs:
        for i, lib in enumerate(libs):
            row("cuDNN files mapped" if i == 0 else "", f"{lib['path']}  ({lib['version'] or '?'}, "
                f"{lib['source']})")  # fmt: skip
    else:
        row("cuDNN files mapped", "none")
    if fix.get("installed"):
        fix_line = "ACTIVE in this process"
        if fix.get("autopatch_fired"):
            fix_line += " (installed by TE_GQA_FIX_AUTOPATCH at TE import)"
    else:
        fix_line = "not active in this process"
    row("fix", fix_line)
    row("post-pass", report.get("post_pass") or "unknown")
    builds = report.get("cudnn_builds") or []
    if builds:
        for i, b in enumerate(builds):
            who = [w for w, k in (("TE", "te_runs"), ("torch", "torch_runs")) if b.get(k)]
            tags = ", ".join(
                [b["origin"], "fixed" if b["fixed"] else "affected"]
                + ([f"{' and '.join(who)} run{'s' if len(who) == 1 else ''} this"] if who else [])
            )
            row(
                "cuDNN builds on disk" if i == 0 else "",
                f"{b['version']:<9} {b['lib_dir']}  ({tags})",
            )
    else:
        row("cuDNN builds on disk", "none found")
    route = report.get("cudnn_route") or {}
    if route.get("setting"):
        state = (
            f"loaded cuDNN {route.get('chosen_version')} from {route.get('chosen')}"
            if route.get("chosen") and route.get("loaded")
            else f"nothing loaded: {route.get('error')}"
        )
        if route.get("verified") is not None:
            state += (
                "; TE runs it" if route["verified"] else f"; but TE runs {route.get('te_cudnn')}"
            )
        row("TE_GQA_FIX_CUDNN", f"{route['setting']}: {state}")
    else:
        row("TE_GQA_FIX_CUDNN", "unset")
    if route.get("switch"):
        row("switch to fixed cuDNN", route["switch"])
    row("TE_GQA_FIX_AUTOPATCH", fix.get("autopatch_env") or "unset")
    row("start-up file", fix.get("start_up_file") or "not installed (is te-gqa-fix pip-installed?)")
    if fix.get("autopatch_error"):
        row("autopatch error", fix["autopatch_error"])

    notes = report.get("notes") or []
    if notes:
        lines += ["", "notes:"]
        lines += [f"  - {n}" for n in notes]
    warnings = report.get("warnings") or []
    if warnings:
        lines += ["", "warnings:"]
        lines += [f"  ! {w}" for w in warnings]

    v = report.get("verdict", {})
    lines += ["", f"verdict (known facts): {str(v.get('status', '?')).upper()}"]
    lines += [f"  - {r}" for r in v.get("reasons", [])]

    live = report.get("live_check", {})
    lines += ["", "live check:"]
    if live.get("ran"):
        lines.append(f"  {live.get('case')}, poisoned block of {live.get('sentinel')}")
        lines.append(
            f"  {'':<11} {'max|dK| rows 0-3':>17} {'max|dV| rows 0-3':>17} "
            f"{'max err live rows':>18}"
        )
        for name in ("unpatched", "patched"):
            r = live.get(name, {})
            lines.append(
                f"  {name:<11} {_fmt(r.get('max_abs_dk_rows_0_3')):>17} "
                f"{_fmt(r.get('max_abs_dv_rows_0_3')):>17} {_fmt(r.get('max_err_live_rows')):>18}"
            )
        lines.append(
            "  bug observed without the fix: "
            + ("YES" if live.get("bug_observed") else "no (not triggered this time)")
        )
        large = live.get("large_head_dim")
        if large is not None:
            lines.append(f"  {large.get('case')}:")
            if large.get("error"):
                lines.append(f"    failed: {large['error']}")
            else:
                lines.append(
                    "    max err dQ/dK/dV "
                    + " / ".join(_fmt(large.get(f"{g}_err")) for g in ("dq", "dk", "dv"))
                    + " (bounds "
                    + " / ".join(_fmt(large.get(f"{g}_bound")) for g in ("dq", "dk", "dv"))
                    + "): "
                    + ("exact" if large.get("exact") else "WRONG")
                )
        lines.append(
            "  with the fix: "
            + ("exact (rows 0-3 are 0, live rows match fp32)" if live.get("fix_ok") else "WRONG")
        )
    elif live.get("error"):
        lines.append(f"  failed: {live['error']}")
    else:
        lines.append(f"  skipped: {live.get('skipped')}")

    unchecked = report.get("unchecked") or []
    if unchecked:
        lines += ["", "could not check:"]
        lines += [f"  - {u}" for u in unchecked]
    lines += [
        "",
        f"status: {report.get('status')} (exit {report.get('exit_code')}): {report.get('advice')}",
    ]
    return "\n".join(lines)
