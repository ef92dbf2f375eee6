"""The text form of ``te-gqa-fix doctor``'s report (:func:`te_gqa_fix.cli.doctor.collect`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

__all__ = ["format_report"]


def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _route_text(route: Dict[str, Any]) -> str:
    if route.get("chosen") and route.get("loaded"):
        text = f"loaded cuDNN {route.get('chosen_version')} from {route.get('chosen')}"
    else:
        text = f"nothing loaded: {route.get('error')}"
    if route.get("verified") is not None:
        text += "; TE runs it" if route["verified"] else f"; but TE runs {route.get('te_cudnn')}"
    return f"{route['setting']}: {text}"


def _live_lines(live: Dict[str, Any]) -> List[str]:
    if not live.get("ran"):
        why = f"failed: {live['error']}" if live.get("error") else f"skipped: {live.get('skipped')}"
        return [f"  {why}"]
    table = "  {:<11} {:>17} {:>17} {:>18}".format
    keys = ("max_abs_dk_rows_0_3", "max_abs_dv_rows_0_3", "max_err_live_rows")
    lines = [
        f"  {live.get('case')}, poisoned block of {live.get('sentinel')}",
        table("", "max|dK| rows 0-3", "max|dV| rows 0-3", "max err live rows"),
    ]
    for name in ("unpatched", "patched"):
        lines.append(table(name, *(_fmt(live.get(name, {}).get(k)) for k in keys)))
    seen = "YES" if live.get("bug_observed") else "no (not triggered this time)"
    lines.append(f"  bug observed without the fix: {seen}")
    large = live.get("large_head_dim")
    if large is not None:
        lines.append(f"  {large.get('case')}:")
        if large.get("error"):
            lines.append(f"    failed: {large['error']}")
        else:
            errs = "/".join(_fmt(large.get(f"{g}_err")) for g in ("dq", "dk", "dv"))
            bounds = "/".join(_fmt(large.get(f"{g}_bound")) for g in ("dq", "dk", "dv"))
            verdict = "exact" if large.get("exact") else "WRONG"
            lines.append(f"    max err dQ/dK/dV {errs} (bounds {bounds}): {verdict}")
    ok = "exact (rows 0-3 are 0, live rows match fp32)" if live.get("fix_ok") else "WRONG"
    return [*lines, f"  with the fix: {ok}"]


def format_report(report: Dict[str, Any]) -> str:
    """Human-readable form of :func:`te_gqa_fix.cli.doctor.collect`'s result.

    Args:
        report: the report.

    Returns:
        The text, one fact per line, then the verdict, the live check and the status.
    """
    te, tor = report.get("transformer_engine", {}), report.get("torch", {})
    gpu, fix = report.get("gpu", {}), report.get("fix", {})
    lines = ["te-gqa-fix doctor", ""]

    def row(key: str, value: Any) -> None:
        lines.append(f"  {key:<20} {value}")

    def rows(key: str, values: List[str], none: str) -> None:
        for i, value in enumerate(values or [none]):
            row(key if i == 0 else "", value)

    def section(title: str, items: Optional[List[str]], mark: str) -> None:
        if items:
            lines.extend(["", title, *(f"  {mark}{x}" for x in items)])

    row("te-gqa-fix", report.get("te_gqa_fix", {}).get("version"))
    row("python", report.get("python"))
    row("torch", f"{tor.get('version')} (CUDA {tor.get('cuda')})" if "version" in tor else tor)
    row("Transformer Engine", te.get("version") or te.get("error") or "version unknown")
    a, b = gpu.get("capability") or [0, 0]
    card = f"{gpu.get('name')}, compute capability {a}.{b} (sm{a}{b}), {gpu.get('count')} device(s)"
    row("GPU", card if gpu.get("available") else gpu.get("error") or "none visible to torch")
    row("cuDNN (TE runs)", te.get("cudnn") or "unknown")
    row("cuDNN (torch's)", tor.get("cudnn") or "unknown")
    libs = report.get("cudnn_libraries") or []
    mapped = [f"{x['path']}  ({x['version'] or '?'}, {x['source']})" for x in libs]
    rows("cuDNN files mapped", mapped, "none")
    fired = " (installed by TE_GQA_FIX_AUTOPATCH at TE import)" if fix.get("fired") else ""
    row("fix", f"{'ACTIVE' if fix.get('installed') else 'not active'} in this process{fired}")
    row("post-pass", report.get("post_pass") or "unknown")
    builds = []
    for b in report.get("cudnn_builds") or []:
        tags = [b["origin"], "fixed" if b["fixed"] else "affected"]
        tags += [f"{w} runs this" for w in ("TE", "torch") if b.get(f"{w.lower()}_runs")]
        builds.append(f"{b['version']:<9} {b['lib_dir']}  ({', '.join(tags)})")
    rows("cuDNN builds on disk", builds, "none found")
    route = report.get("cudnn_route") or {}
    if route.get("setting"):
        row("cuDNN route", _route_text(route))
    if route.get("switch"):
        row("switch to fixed cuDNN", route["switch"])
    row("start-up file", fix.get("pth") or "not installed (is te-gqa-fix pip-installed?)")
    if fix.get("error"):
        row("autopatch error", fix["error"])

    lines += ["", "settings:"]
    for name, s in (report.get("settings") or {}).items():
        raw = "unset" if s["raw"] is None else repr(s["raw"])
        row(name, f"ERROR: {s['error']}" if s["error"] else f"{s['value']}  ({raw})")
    section("notes:", report.get("notes"), "- ")
    section("warnings:", report.get("warnings"), "! ")
    v = report.get("verdict", {})
    lines += ["", f"verdict (known facts): {str(v.get('status', '?')).upper()}"]
    lines += [f"  - {r}" for r in v.get("reasons", [])]
    section("exact fallback (TE_GQA_FIX_GUARD=fallback):", report.get("fallback"), "")
    lines += ["", "live check:", *_live_lines(report.get("live_check", {}))]
    section("could not check:", report.get("unchecked"), "- ")
    status = f"status: {report.get('status')} (exit {report.get('exit_code')})"
    lines += ["", f"{status}: {report.get('advice')}"]
    return "\n".join(lines)
