"""``te-gqa-fix doctor``: is this stack affected, and is the fix active?

Gathers the facts (TE first, as in training: asking torch first maps torch's cuDNN), asks
:func:`te_gqa_fix.rules.judge` what the measurements say and words it here, runs the
original report's case on the real TE with and without the fix where a GPU and TE are
present, and decides the exit code. A process of its own: a training script's
``install()`` is not active here (``--assume-installed``, or ``te_gqa_fix.status()`` inside
that script).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import _te_gqa_fix_autopatch as hook

from .. import __version__, _te, cudnn_route, rules, settings
from ..cudnn_route import CudnnLibrary, version_str, version_tuple
from ._live import live_check

__all__ = ["EXIT_CODES", "add_parser", "collect", "decide", "format_report", "run", "verdict"]

EXIT_HEALTHY, EXIT_AFFECTED, EXIT_USAGE, EXIT_CANNOT_CHECK, EXIT_UNREPAIRABLE = range(5)
EXIT_CODES: Dict[int, str] = {
    EXIT_HEALTHY: "healthy: not affected, or affected and protected by the fix in this environment",
    EXIT_AFFECTED: "affected: the bug applies here and the fix is not active in doctor's own "
    "process (a script that calls te_gqa_fix.install() is protected in its own process: "
    "check te_gqa_fix.status() there, or pass --assume-installed)",
    EXIT_USAGE: "usage error (bad command-line arguments)",
    EXIT_CANNOT_CHECK: "cannot check: no GPU, no Transformer Engine, or no verdict possible",
    EXIT_UNREPAIRABLE: "broken beyond repair: a head dim neither the post-pass nor the exact "
    "fallback (TE_GQA_FIX_GUARD=fallback) covers on this cuDNN, or the live check found "
    "wrong values even with the fix",
}
_TURN_ON = (
    "turn the fix on: TE_GQA_FIX_AUTOPATCH=1 in the job's environment, or te_gqa_fix.install() "
    "at start-up (a script that calls it is covered: check te_gqa_fix.status() there)"
)


# ---------------------------------------------------------------------------- facts
def torch_info() -> Dict[str, Any]:
    """torch's version, CUDA and own cuDNN (``cudnn_error`` where torch's query raises)."""
    import torch

    info: Dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": None}
    try:
        v = torch.backends.cudnn.is_available() and torch.backends.cudnn.version()
        info["cudnn"] = version_str(cudnn_route.decode_cudnn_version(v)) if v else None
    except Exception as exc:  # with TE's system cuDNN loaded first, torch's query can raise
        info["cudnn_error"] = f"{type(exc).__name__}: {exc}"
    return info


def gpu_info() -> Dict[str, Any]:
    """Whether torch sees a CUDA device; its count, name and compute capability."""
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "count": 0, "name": None, "capability": None}
    dev = torch.cuda.current_device()
    return {
        "available": True,
        "count": torch.cuda.device_count(),
        "name": torch.cuda.get_device_name(dev),
        "capability": list(torch.cuda.get_device_capability(dev)),
    }


def te_info() -> Dict[str, Any]:
    """TE's version, whether ``transformer_engine.pytorch`` imports, and the cuDNN it runs."""
    version = _te.te_version()
    info = {"version": version, "imported": False, "cudnn": None, "error": None}
    try:
        importlib.import_module(_te.TE_PYTORCH)
        info.update(imported=True, cudnn=version_str(_te.te_cudnn_version()))
    except Exception as exc:
        absent = isinstance(exc, ModuleNotFoundError) and exc.name == "transformer_engine"
        error = f"import {_te.TE_PYTORCH} failed: {type(exc).__name__}: {exc}"
        info["error"] = "not installed" if absent and version is None else error
    return info


def cudnn_library_warnings(libs: Sequence[CudnnLibrary], te_cudnn, torch_cudnn) -> List[str]:
    """Warnings about the cuDNN in use.

    Args:
        libs: the cuDNN libraries mapped into the process.
        te_cudnn, torch_cudnn: the versions TE and torch report (or None).

    Returns:
        One line each for mixed mapped versions, a library mapped from two folders, and TE
        and torch on different cuDNN versions.
    """
    minors = sorted({v[:2] for v in (version_tuple(x.version) or () for x in libs) if len(v) > 1})
    warnings = []
    if len(minors) > 1:
        found = ", ".join(f"{a}.{b}" for a, b in minors)
        warnings.append(
            f"the cuDNN libraries mapped into this process mix versions ({found}); TE may run "
            "kernels from another cuDNN than the one it reports: point CUDNN_HOME and "
            "LD_LIBRARY_PATH at a single cuDNN"
        )
    for name in sorted({lib.name for lib in libs}):
        dirs = sorted({os.path.dirname(x.path) for x in libs if x.name == name})
        if len(dirs) > 1:
            warnings.append(f"{name} is mapped from {len(dirs)} places: {dirs}")
    if te_cudnn and torch_cudnn and tuple(te_cudnn)[:2] != tuple(torch_cudnn)[:2]:
        warnings.append(
            f"Transformer Engine runs cuDNN {version_str(te_cudnn)} but torch's cuDNN is "
            f"{version_str(torch_cudnn)}: TE loads the system cuDNN (CUDNN_HOME, CUDA_HOME, "
            "/usr/local/cuda, the loader path) before the one torch ships"
        )
    return warnings


def _shapes(dims) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}/{b}" for a, b in sorted(dims)) or "none"


def verdict(
    capability: Optional[Sequence[int]], te_cudnn: Optional[Sequence[int]], head_dim: Optional[int]
) -> Tuple[str, List[str]]:
    """:func:`te_gqa_fix.rules.judge`, in words.

    Args:
        capability: the GPU's compute capability; te_cudnn: the cuDNN TE runs (None: TE did
            not say); head_dim: the model's head dim (None: up to 128).

    Returns:
        ``(status, reasons)``: status ``affected``, ``not_affected``, ``unrepairable`` or
        ``unknown``.
    """
    if capability is None:
        return "unknown", ["cannot tell without the GPU's compute capability"]
    v = rules.judge(capability, te_cudnn, head_dim)
    sm = f"sm{capability[0]}{capability[1] if len(capability) > 1 else 0}"
    if v.status == "not_hopper":
        return "not_affected", [
            f"{sm} is not Hopper: the stale-workspace bug is known on Hopper (sm90) only; "
            "te-gqa-fix does no harm elsewhere"
        ]
    m = v.judged_as
    assert m is not None
    measured = rules.version_text(m.cudnn)
    if te_cudnn is None:
        build = f"a cuDNN whose version TE could not report (judged as the oldest measured build, {measured})"
    elif v.measured:
        build = f"cuDNN {rules.version_text(te_cudnn)}"
    else:
        build = f"cuDNN {rules.version_text(te_cudnn)} (not measured; judged on live rows as {measured})"
    reasons: List[str] = []
    if v.status == "right":
        scope = "head dims up to 128" if head_dim is None else f"head dim {head_dim}"
        reasons.append(f"{build} was measured right at {scope} on {sm}")
        if m.wrong and head_dim is None:
            reasons.append(
                f"wrong on live rows at {_shapes(m.wrong)}: the exact fallback serves those (pass --head-dim to check)"
            )
        return "not_affected", reasons
    if v.status == "live_rows_wrong":
        right = rules.newest_right(head_dim or 0).cudnn
        why = (
            "zero-length sequences make rows that receive attention wrong"
            if m.zero_length_wrong
            else (
                f"head dim {head_dim} is wrong on rows that receive attention (measured wrong at "
                f"{_shapes(m.wrong)}; right at {_shapes(m.clean)})"
            )
        )
        reasons.append(
            f"{build} on {sm}: {why}: no post-pass can repair it; the exact fallback "
            f"(TE_GQA_FIX_GUARD=fallback, the default) recomputes it with FlashAttention-2, "
            f"and cuDNN {rules.version_text(right)} was measured right there"
        )
        return "unrepairable", reasons
    stale = m.stale_rows or te_cudnn is None or tuple(te_cudnn) < rules.CUDNN_FIXED
    reasons.append(
        f"Hopper ({sm}) with {build}: TE's fused_attn_bwd (THD layout, GQA/MQA) sums stale "
        "workspace into dK/dV rows of sequences without query tokens"
        if stale
        else f"Hopper ({sm}) with {build}: rows of sequences without query tokens were not "
        "measured clean here (cuDNN >= 9.18 fixes the stale workspace upstream)"
    )
    reasons.append("te-gqa-fix repairs it exactly (the post-pass zeroes those rows)")
    if head_dim is None and m.wrong:
        reasons.append(
            f"head dims {_shapes(m.wrong)} are wrong on live rows here: the exact fallback "
            "serves them (pass --head-dim to check)"
        )
    return "affected", reasons


def decide(
    status: str,
    live: Optional[Dict[str, Any]],
    fix_active: bool,
    fallback: bool = False,
    te_cudnn: Optional[Sequence[int]] = None,
) -> Tuple[str, int, str]:
    """The overall ``(status, exit_code, advice)``; an observation outranks the facts.

    Args:
        status: :func:`verdict`'s status.
        live: :func:`te_gqa_fix.cli._live.live_check`'s result, or None.
        fix_active: te-gqa-fix is installed (or assumed installed).
        fallback: the exact fallback covers an ``unrepairable`` configuration here.
        te_cudnn: the cuDNN TE runs, so advice never asks for what runs already.

    Returns:
        ``(status, exit code, advice)``.
    """
    live = live or {}
    ran = bool(live.get("ran"))
    right = rules.newest_right().cudnn
    if te_cudnn is None or tuple(te_cudnn)[:2] < right[:2]:
        upgrade = (
            f"use cuDNN {rules.version_text(right[:2])} or newer (the newest build measured right)"
        )
    elif rules.measurement_for(te_cudnn)[1]:
        upgrade = "please report this stack: it was measured right here"
    else:  # newer than every measured build
        upgrade = (
            f"please report this stack: cuDNN {rules.version_text(te_cudnn)} was not measured "
            f"(cuDNN {rules.version_text(right[:2])}, the newest build measured right, was)"
        )
    if ran and live.get("fix_ok") is False:
        return (
            "unrepairable",
            EXIT_UNREPAIRABLE,
            f"the live check found wrong values even with the fix: {upgrade}",
        )
    if status == "unrepairable" and not fallback:
        return "unrepairable", EXIT_UNREPAIRABLE, upgrade
    if status in ("affected", "unrepairable") or (ran and live.get("bug_observed")):
        if not fix_active:
            return "affected", EXIT_AFFECTED, _TURN_ON
        how = ", its exact fallback covering this head dim" if fallback else ""
        return "healthy", EXIT_HEALTHY, f"affected stack, and te-gqa-fix is active here{how}"
    if status == "not_affected":
        return "healthy", EXIT_HEALTHY, "nothing to do"
    advice = "run doctor where training runs (a GPU and Transformer Engine are needed)"
    return "cannot_check", EXIT_CANNOT_CHECK, advice


def _section(fn, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _builds_section(libs: Sequence[CudnnLibrary], te_cudnn, torch_cudnn) -> List[Dict[str, Any]]:
    """Every cuDNN build on disk; ``te_runs`` when its libcudnn.so is mapped and its version
    is the one TE reports (likewise torch)."""
    mapped = {os.path.realpath(os.path.dirname(x.path)) for x in libs if x.name == "libcudnn"}
    out = []
    for b in cudnn_route.find_builds():
        here = os.path.realpath(b.lib_dir) in mapped
        runs = {
            k: bool(here and v and b.version == tuple(v[:3]))
            for k, v in (("te_runs", te_cudnn), ("torch_runs", torch_cudnn))
        }
        out.append(
            {
                **asdict(b),
                "version": b.version_str,
                "fixed": b.fixed,
                "measured": b.measured,
                "mapped": here,
                **runs,
            }
        )
    return out


def _switch(builds: Sequence[Dict[str, Any]], te_cudnn) -> Optional[str]:
    """The one setting that makes TE run an installed build better than the one it runs:
    newer, or measured right where TE's own build was not measured; never the build TE
    runs (by major and minor version), from wherever it is loaded."""
    if te_cudnn is None:
        return None
    m, own = rules.measurement_for(te_cudnn)
    if own and m.right_at_every_shape:
        return None
    runs = tuple(te_cudnn)[:2]

    def better(b: Dict[str, Any]) -> bool:
        v = (version_tuple(b["version"]) or ())[:2]
        return v != runs and (v > runs or (b["measured"] == "right" and not own))

    def rank(b: Dict[str, Any]) -> Tuple[bool, Tuple[int, ...]]:  # cudnn_route.choose's order
        return b["measured"] == "right", version_tuple(b["version"]) or ()

    usable = [b for b in builds if b["fixed"] and b["measured"] in ("right", "unmeasured")]
    wheels = [b for b in usable if b["origin"] == "wheel"]
    auto = max(wheels, key=rank, default=None)  # what TE_GQA_FIX_CUDNN=auto loads
    if auto is not None and better(auto):
        return f"{cudnn_route.ENV_CUDNN}=auto  (loads cuDNN {auto['version']} from {auto['lib_dir']}, {auto['measured']})"
    best = max(filter(better, usable), key=rank, default=None)
    if best is None:
        return None
    return (
        f"{cudnn_route.ENV_CUDNN}={best['lib_dir']}  (cuDNN {best['version']}, {best['measured']})"
    )


def _fix_info() -> Dict[str, Any]:
    from .. import patch

    return {
        "installed": patch.is_installed(),
        "unreached": patch.unreached_call_sites(),
        "hook_enabled": hook.is_enabled(),
        "pth": hook.find_pth(),
        **hook.state(),
    }


def collect(
    live: bool = True, head_dim: Optional[int] = None, assume_installed: bool = False
) -> Dict[str, Any]:
    """Gather everything and decide.

    Args:
        live: run the live check where a GPU and TE are present.
        head_dim: the model's head dim (above 128 a cuDNN may be wrong on live rows).
        assume_installed: the training code calls ``te_gqa_fix.install()``: judge as if
            the fix were installed.

    Returns:
        The report, JSON-serialisable; never raises.
    """
    report: Dict[str, Any] = {
        "te_gqa_fix": {"version": __version__},
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    te = report["transformer_engine"] = _section(te_info)
    report["torch"] = _section(torch_info)
    gpu = report["gpu"] = _section(gpu_info)
    unchecked = []
    if not gpu.get("available"):
        unchecked.append("GPU: torch sees no CUDA device")
    if not te.get("imported"):
        unchecked.append(f"Transformer Engine: {te.get('error') or 'not importable'}")
    elif te.get("cudnn") is None:
        unchecked.append(
            "the cuDNN version Transformer Engine runs (TE did not report it): judged as the "
            f"oldest measured build, {rules.version_text(rules.MEASURED[0].cudnn)}"
        )
    libs = _section(cudnn_route.mapped_cudnn_libraries)
    if not isinstance(libs, list):
        reason = libs["error"] if isinstance(libs, dict) else "/proc/self/maps unreadable"
        unchecked.append(f"cuDNN files mapped into the process: {reason}")
        libs = []
    report["cudnn_libraries"] = [asdict(lib) for lib in libs]
    te_cudnn = version_tuple(te.get("cudnn"))
    torch_cudnn = version_tuple(report["torch"].get("cudnn"))
    route = cudnn_route.route_state()
    report["warnings"], report["notes"] = cudnn_library_warnings(libs, te_cudnn, torch_cudnn), []
    if route.get("verified"):  # TE's own later load of its system cuDNN binds nothing
        report["warnings"] = []
        report["notes"] = [
            f"{route['setting']} loaded cuDNN {route['chosen_version']} first; TE's own load "
            "of its system cuDNN is mapped too, but symbols bind to the first copy (TE reports "
            f"{route['te_cudnn']})"
        ]
    if route.get("warning"):
        report["warnings"].append(route["warning"])
    builds = _section(_builds_section, libs, te_cudnn, torch_cudnn)
    if isinstance(builds, dict):
        unchecked.append(f"cuDNN builds on disk: {builds['error']}")
        builds = []
    report["cudnn_builds"] = builds
    report["cudnn_route"] = {**route, "switch": _switch(builds, te_cudnn)}
    report["settings"] = settings.describe()
    report["warnings"] += [s["error"] for s in report["settings"].values() if s["error"]]
    report["unknown_settings"] = [{"name": n, "closest": c} for n, c in settings.unknown_names()]
    report["warnings"] += [
        f"{n} is not a te-gqa-fix setting (ignored)" + (f"; did you mean {c}?" if c else "")
        for n, c in settings.unknown_names()
    ]
    report["fix"] = _section(_fix_info)

    capability = gpu.get("capability")
    status, reasons = (
        ("unknown", ["Transformer Engine is not importable"])
        if not te.get("imported")
        else verdict(capability, te_cudnn, head_dim)
    )
    fallback = False
    guard = report["settings"]["TE_GQA_FIX_GUARD"]["value"]
    if status == "unrepairable" and guard == "fallback" and head_dim is not None:
        from ..fallback import head_dim_reason  # a known GPU: torch imports

        declined = head_dim_reason(head_dim)
        fallback = declined is None
        reasons.append(
            f"the exact fallback declines it: {declined}"
            if declined
            else "the exact fallback (TE_GQA_FIX_GUARD=fallback) computes its gradients"
        )
    report["verdict"] = dict(status=status, reasons=reasons, head_dim=head_dim, fallback=fallback)
    report["fallback"] = _fallback_coverage()
    policy = report["settings"]["TE_GQA_FIX"]["value"]
    report["post_pass"] = _post_pass(capability, te_cudnn, policy)

    if not live:
        report["live_check"] = {"ran": False, "skipped": "--no-live"}
    elif not gpu.get("available") or not te.get("imported"):
        report["live_check"] = {"ran": False, "skipped": "needs a CUDA GPU and Transformer Engine"}
        unchecked.append("live check (needs a CUDA GPU and Transformer Engine)")
    else:
        report["live_check"] = live_check(large_head_dim=route.get("chosen") is not None)
        if report["live_check"].get("error"):
            unchecked.append(f"live check failed: {report['live_check']['error']}")
    installed = bool(report["fix"].get("installed")) or assume_installed
    active = installed and policy != "off"  # off: the wrapper passes every call to TE
    status, code, advice = decide(status, report["live_check"], active, fallback, te_cudnn)
    if code == EXIT_AFFECTED and policy == "off":
        advice = "TE_GQA_FIX=off turns the fix off: unset it (auto is the default)" + (
            "" if installed else f"; and {advice}"
        )
    switch = report["cudnn_route"]["switch"]
    report.update(
        unchecked=unchecked,
        status=status,
        exit_code=code,
        assume_installed=assume_installed,
        advice=f"set {switch}; or: {advice}" if switch and code != EXIT_HEALTHY else advice,
        exit_codes={str(k): text for k, text in EXIT_CODES.items()},
    )
    return report


def _fallback_coverage() -> List[str]:
    """What the exact fallback covers; none where torch cannot be imported."""
    try:
        from ..fallback import coverage
    except ImportError:
        return []
    return list(coverage())


def _post_pass(capability, te_cudnn, policy: str = "auto") -> str:
    """What the wrapper does with GQA calls here, and which post-pass CUDA calls get."""
    if policy == "off":
        return "off: TE_GQA_FIX=off: the wrapper passes every call to TE untouched"
    if capability is not None and rules.judge(capability, te_cudnn).status == "right":
        return (
            "pass-through: the cuDNN TE runs was measured right here, so the wrapper does "
            "nothing under TE_GQA_FIX=auto (TE_GQA_FIX=always still forces the post-pass)"
        )
    try:
        from ..postpass import implementation

        impl, why = implementation()
    except Exception as exc:  # torch missing or broken: say so
        impl, why = "unknown", f"{type(exc).__name__}: {exc}"
    kernel = "the Triton kernel" if impl == "triton" else f"PyTorch ({why})"
    return (
        f"runs on THD backward calls with h_q != h_kv (this stack is not measured right): {kernel}"
    )


# ----------------------------------------------------------------------------- text
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
        got = live.get(name, {})
        skipped = got.get("skipped")
        lines.append(
            f"  {name:<11} skipped: {skipped}"
            if skipped
            else table(name, *(_fmt(got.get(k)) for k in keys))
        )
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
            right = "exact" if large.get("exact") else "WRONG"
            lines.append(f"    max err dQ/dK/dV {errs} (bounds {bounds}): {right}")
    ok = "exact (rows 0-3 are 0, live rows match fp32)" if live.get("fix_ok") else "WRONG"
    if live.get("fix_ok") is None:
        ok = f"not checked ({live.get('patched', {}).get('skipped')})"
    return [*lines, f"  with the fix: {ok}"]


def format_report(report: Dict[str, Any]) -> str:
    """The human-readable form of :func:`collect`'s result.

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
    assumed = " (--assume-installed: judged as installed)" if report.get("assume_installed") else ""
    row(
        "fix",
        f"{'ACTIVE' if fix.get('installed') else 'not active'} in this process{fired}{assumed}",
    )
    row("post-pass", report.get("post_pass") or "unknown")
    builds = []
    for bld in report.get("cudnn_builds") or []:
        tags = [bld["origin"], bld["measured"], "fixed" if bld["fixed"] else "affected"]
        tags += [f"{w} runs this" for w in ("TE", "torch") if bld.get(f"{w.lower()}_runs")]
        builds.append(f"{bld['version']:<9} {bld['lib_dir']}  ({', '.join(tags)})")
    rows("cuDNN builds on disk", builds, "none found")
    route = report.get("cudnn_route") or {}
    if route.get("setting"):
        row("cuDNN route", _route_text(route))
    if route.get("switch"):
        row("switch cuDNN", route["switch"])
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


# ------------------------------------------------------------------------ command
#: The head dims TE's fused attention takes on the cuDNN backend (the one this fix is
#: about): 1..256; TE runs larger head dims on other backends, which the bug does not touch.
HEAD_DIMS = range(1, 257)


def _head_dim(text: str) -> int:
    """``--head-dim``'s value: an integer in :data:`HEAD_DIMS`; argparse names the option."""
    from .plan import INTEGER

    if not INTEGER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected an integer head dim, got {text!r}")
    value = int(text)
    if value not in HEAD_DIMS:
        raise argparse.ArgumentTypeError(
            f"expected a head dim in {HEAD_DIMS.start}..{HEAD_DIMS.stop - 1} (what TE's fused "
            f"attention takes on cuDNN), got {value}"
        )
    return value


def add_parser(sub: Any) -> None:
    """``doctor``'s subcommand and options on ``sub`` (argparse's subparsers)."""
    doctor = sub.add_parser(
        "doctor",
        help="check whether this stack is affected and whether the fix is active",
        description="Versions, GPU, the cuDNN TE really runs (and the files mapped) next to "
        "torch's, every TE_GQA_FIX_* setting, whether te-gqa-fix is active in this process, "
        "a verdict and, with a GPU and TE, a live run of the original report's case without "
        "and with the fix.",
        epilog="exit codes:\n" + "\n".join(f"  {k}  {v}" for k, v in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument("--no-live", action="store_true", help="skip the live GPU check")
    doctor.add_argument(
        "--head-dim", type=_head_dim, metavar="D", help="your model's head dim (1..256)"
    )
    doctor.add_argument(
        "--assume-installed",
        action="store_true",
        help="your training code calls te_gqa_fix.install(): judge as if the fix were active",
    )


def run(args: argparse.Namespace) -> int:
    """The ``doctor`` command: print the report (text or JSON); return the exit code."""
    result = collect(
        live=not args.no_live, head_dim=args.head_dim, assume_installed=args.assume_installed
    )
    text = json.dumps(result, indent=2) if args.json else format_report(result)
    sys.stdout.write(text + "\n")
    return int(result["exit_code"])
