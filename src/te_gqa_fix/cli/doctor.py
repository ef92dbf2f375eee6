"""``te-gqa-fix doctor``: is this stack affected, and is the fix active?

Gathers the facts, asks :mod:`te_gqa_fix.stack.affected` for a verdict, runs the seed case on the
real TE with and without the fix where a GPU and TE are present, and decides the exit code.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import __version__, settings
from ..autopatch import status as autopatch_status
from ..stack import affected, cudnn
from ..stack import versions as stack
from ..stack.cudnn import CudnnLibrary, version_str, version_tuple
from . import fallback_coverage, report

__all__ = ["EXIT_CODES", "collect", "cudnn_library_warnings", "decide", "live_check", "run"]

EXIT_HEALTHY, EXIT_AFFECTED, EXIT_USAGE, EXIT_CANNOT_CHECK, EXIT_UNREPAIRABLE = range(5)
EXIT_CODES: Dict[int, str] = {
    EXIT_HEALTHY: "healthy: not affected, or affected and protected by the fix in this environment",
    EXIT_AFFECTED: "affected: the bug applies here and the fix is not active",
    EXIT_USAGE: "usage error (bad command-line arguments)",
    EXIT_CANNOT_CHECK: "cannot check: no GPU, no Transformer Engine, or its cuDNN unknown",
    EXIT_UNREPAIRABLE: "broken beyond repair: a head dim neither the post-pass nor the exact "
    "fallback (TE_GQA_FIX_GUARD=fallback) covers on an affected cuDNN, or the live check found "
    f"wrong values even with the fix; use cuDNN {affected.NEWEST_CLEAN} or newer",
}
LIVE_TOLERANCE = 5e-2  # fp16, head dim 8, O(1) inputs: measured errors are ~4e-4
SENTINEL = 1000.0  # what the freed block that lands in TE's workspace holds
_TURN_ON = (
    "turn the fix on: TE_GQA_FIX_AUTOPATCH=1 in the job's environment, or te_gqa_fix.install() "
    "at start-up (if your code already calls it, you are covered)"
)


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


def decide(
    verdict_status: str, live: Optional[Dict[str, Any]], fix_active: bool, fallback: bool = False
) -> Tuple[str, int, str]:
    """The overall ``(status, exit_code, advice)``; an observation outranks the facts.

    Args:
        verdict_status: :func:`te_gqa_fix.stack.affected.verdict`'s status.
        live: :func:`live_check`'s result, or None.
        fix_active: te-gqa-fix is installed in this process.
        fallback: the exact fallback covers an ``unrepairable`` configuration here.

    Returns:
        ``(status, exit code, advice)``.
    """
    live = live or {}
    ran = bool(live.get("ran"))
    if ran and live.get("fix_ok") is False:
        advice = (
            "the live check found wrong values even with the fix: use cuDNN "
            f"{affected.NEWEST_CLEAN} or newer (the newest build measured right)"
        )
        return "unrepairable", EXIT_UNREPAIRABLE, advice
    if verdict_status == "unrepairable" and not fallback:
        advice = f"use cuDNN {affected.NEWEST_CLEAN} or newer (the newest build measured right)"
        return "unrepairable", EXIT_UNREPAIRABLE, advice
    if verdict_status in ("affected", "unrepairable") or (ran and live.get("bug_observed")):
        if not fix_active:
            return "affected", EXIT_AFFECTED, _TURN_ON
        how = ", its exact fallback covering this head dim" if fallback else ""
        return "healthy", EXIT_HEALTHY, f"affected stack, and te-gqa-fix is active here{how}"
    if verdict_status == "not_affected":
        return "healthy", EXIT_HEALTHY, "nothing to do"
    advice = "run doctor where training runs (a GPU and Transformer Engine are needed)"
    return "cannot_check", EXIT_CANNOT_CHECK, advice


def _num(x: Any) -> Any:
    x = float(x)
    return x if math.isfinite(x) else str(x)


def _large_head_dim_check(rp, original, device: str) -> Dict[str, Any]:
    """TE's own backward (``original``) at head dim 256 after a poisoned block against the
    fp32 reference: exact only when TE runs a fixed cuDNN. Never raises."""
    out: Dict[str, Any] = {
        "case": "h 8/2, d 256, bf16, thd_thd_thd, padding_causal, a q-empty sequence, "
        "padding between sequences, tail rows; TE unpatched"
    }
    try:
        batch = rp.large_head_dim_batch(256, (8, 2))
        rp.random_inputs(batch, device=device, seed=256)
        rp.te_forward(batch, device=device)
        rp.poison_allocator(SENTINEL, 1 << 26, device)
        grads = rp.te_backward(batch, fn=original, device=device)
        res = rp.compare(batch, grads, rp.references(batch, device))
        out.update({k: _num(v) for k, v in res.items()})
        out["exact"] = rp.exact(res)
    except Exception as exc:  # report, never crash the doctor
        out.update(error=f"{type(exc).__name__}: {exc}", exact=False)
    return out


def live_check(
    device: str = "cuda", poison_numel: int = 1 << 28, large_head_dim: bool = False
) -> Dict[str, Any]:
    """The seed case on the real TE, unpatched and patched, each after a freed block of
    :data:`SENTINEL` that lands in TE's workspace: sequence 0 has no queries, so dK/dV rows 0-3
    must be 0. ``large_head_dim`` (the cuDNN route is active) adds a head dim 256 case that
    must be exact too. Never raises."""
    out: Dict[str, Any] = {
        "ran": False,
        "case": "seed: h 2/1, d 8, fp16, thd_thd_thd, padding_causal, cu_q [0,0,3], "
        "cu_kv [0,3,9], padded [0,4,12]",
        "sentinel": SENTINEL,
    }
    try:
        import torch

        from .. import testing as rp
        from ..patch import find_original
        from ..wrapper import wrapper_for

        original = find_original()
        batch = rp.seed_batch(second_call=True)
        rp.random_inputs(batch, device=device, seed=0)
        rp.te_forward(batch, device=device)
        ref = rp.reference_attention(batch, dtype=torch.float32, device="cpu")
        for name, fn in (("unpatched", original), ("patched", wrapper_for(original))):
            try:
                rp.poison_allocator(SENTINEL, poison_numel, device)
            except RuntimeError:  # a small GPU: a smaller block still lands in the pool
                rp.poison_allocator(SENTINEL, poison_numel // 64, device)
            grads = rp.te_backward(batch, fn=fn, device=device)
            dq, dk, dv = (g.detach().float().cpu() for g in grads[:3])
            live = [(dk - ref["dk"])[4:], (dv - ref["dv"])[4:], dq - ref["dq"]]
            out[name] = {
                "max_abs_dk_rows_0_3": _num(dk[:4].abs().max()),
                "max_abs_dv_rows_0_3": _num(dv[:4].abs().max()),
                "max_err_live_rows": _num(torch.cat([e.flatten() for e in live]).abs().max()),
                "rows_0_3_zero": bool((dk[:4] == 0).all() and (dv[:4] == 0).all()),
            }
        err = out["patched"]["max_err_live_rows"]  # a string where not finite
        out["bug_observed"] = not out["unpatched"]["rows_0_3_zero"]
        live_ok = isinstance(err, float) and err <= LIVE_TOLERANCE
        out["fix_ok"] = bool(out["patched"]["rows_0_3_zero"] and live_ok)
        out["tolerance"] = LIVE_TOLERANCE
        if large_head_dim:
            out["large_head_dim"] = _large_head_dim_check(rp, original, device)
            out["fix_ok"] = bool(out["fix_ok"] and out["large_head_dim"]["exact"])
        out["ran"] = True
    except Exception as exc:  # report, never crash the doctor
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _section(fn, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _fix_info() -> Dict[str, Any]:
    from ..patch import is_installed

    return {"installed": is_installed(), **autopatch_status()}


def _builds_section(libs: Sequence[CudnnLibrary], te_cudnn, torch_cudnn) -> List[Dict[str, Any]]:
    """Every cuDNN build on disk; ``te_runs`` when its libcudnn.so is mapped and its version
    is the one TE reports (likewise torch)."""
    mapped = {os.path.realpath(os.path.dirname(x.path)) for x in libs if x.name == "libcudnn"}
    out = []
    for b in cudnn.find_builds():
        here = os.path.realpath(b.lib_dir) in mapped
        runs = {
            k: bool(here and v and b.version == tuple(v[:3]))
            for k, v in (("te_runs", te_cudnn), ("torch_runs", torch_cudnn))
        }
        out.append(
            {**asdict(b), "version": b.version_str, "fixed": b.fixed, "mapped": here, **runs}
        )
    return out


def _switch(builds: Sequence[Dict[str, Any]], te_cudnn) -> Optional[str]:
    """The one setting that makes TE run a fixed build installed here but unused, if any."""
    fixed = [b for b in builds if b["fixed"]]
    if te_cudnn is None or affected.cudnn_is_fixed(te_cudnn) or not fixed:
        return None
    wheels = [b for b in fixed if b["origin"] == "wheel"]
    if not wheels:
        return f"{cudnn.ENV_CUDNN}={fixed[0]['lib_dir']}  (cuDNN {fixed[0]['version']})"
    best = max(wheels, key=lambda b: version_tuple(b["version"]) or ())
    return f"{cudnn.ENV_CUDNN}=auto  (loads cuDNN {best['version']} from {best['lib_dir']})"


def collect(live: bool = True, head_dim: Optional[int] = None) -> Dict[str, Any]:
    """Gather everything and decide.

    Args:
        live: run the live check where a GPU and TE are present.
        head_dim: the model's head dim (above 128 an affected cuDNN may be unrepairable).

    Returns:
        The report, JSON-serialisable; never raises.
    """
    report: Dict[str, Any] = {
        "te_gqa_fix": {"version": __version__},
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    # TE first, as in training: asking torch first maps torch's cuDNN and can break TE's import.
    te = report["transformer_engine"] = _section(stack.te_info)
    report["torch"] = _section(stack.torch_info)
    gpu = report["gpu"] = _section(stack.gpu_info)
    unchecked = []
    if not gpu.get("available"):
        unchecked.append("GPU: torch sees no CUDA device")
    if not te.get("imported"):
        unchecked.append(f"Transformer Engine: {te.get('error') or 'not importable'}")
    elif te.get("cudnn") is None:
        unchecked.append("the cuDNN version Transformer Engine runs (TE did not report it)")

    libs = _section(cudnn.mapped_cudnn_libraries)
    if not isinstance(libs, list):
        reason = libs["error"] if isinstance(libs, dict) else "/proc/self/maps unreadable"
        unchecked.append(f"cuDNN files mapped into the process: {reason}")
        libs = []
    report["cudnn_libraries"] = [asdict(lib) for lib in libs]
    te_cudnn = version_tuple(te.get("cudnn"))
    torch_cudnn = version_tuple(report["torch"].get("cudnn"))
    route = cudnn.route_state()
    report["warnings"], report["notes"] = cudnn_library_warnings(libs, te_cudnn, torch_cudnn), []
    if route.get("verified"):  # TE's own later load of its system cuDNN binds nothing
        report["warnings"] = []
        report["notes"] = [
            f"{cudnn.ENV_CUDNN} loaded cuDNN {route['chosen_version']} first; TE's own load "
            "of its system cuDNN is mapped too, but symbols bind to the first copy (TE reports "
            f"{route['te_cudnn']})"
        ]
    builds = _section(_builds_section, libs, te_cudnn, torch_cudnn)
    if isinstance(builds, dict):
        unchecked.append(f"cuDNN builds on disk: {builds['error']}")
        builds = []
    report["cudnn_builds"] = builds
    report["cudnn_route"] = {**route, "switch": _switch(builds, te_cudnn)}
    report["settings"] = settings.describe()
    report["warnings"] += [s["error"] for s in report["settings"].values() if s["error"]]
    report["fix"] = _section(_fix_info)

    v = affected.verdict(gpu.get("capability"), te_cudnn, head_dim)
    reasons, fallback = list(v.reasons), False
    guard = report["settings"]["TE_GQA_FIX_GUARD"]["value"]
    if v.status == "unrepairable" and guard == "fallback" and head_dim is not None:
        from ..fallback import head_dim_reason  # a known GPU: torch imports

        declined = head_dim_reason(head_dim)
        fallback = declined is None
        reasons.append(
            f"the exact fallback declines it: {declined}"
            if declined
            else "the exact fallback (TE_GQA_FIX_GUARD=fallback) computes its gradients"
        )
    report["verdict"] = dict(status=v.status, reasons=reasons, head_dim=head_dim, fallback=fallback)
    report["fallback"] = fallback_coverage()
    report["post_pass"] = (
        "pass-through: the cuDNN TE runs was measured clean here, so the wrapper does nothing "
        "under TE_GQA_FIX=auto (TE_GQA_FIX=always still forces the post-pass)"
        if affected.measured_clean(gpu.get("capability"), te_cudnn)
        else "runs on THD backward calls with h_q != h_kv (this stack is not measured clean)"
    )

    if not live:
        report["live_check"] = {"ran": False, "skipped": "--no-live"}
    elif not gpu.get("available") or not te.get("imported"):
        report["live_check"] = {"ran": False, "skipped": "needs a CUDA GPU and Transformer Engine"}
        unchecked.append("live check (needs a CUDA GPU and Transformer Engine)")
    else:
        report["live_check"] = live_check(large_head_dim=route.get("chosen") is not None)
        if report["live_check"].get("error"):
            unchecked.append(f"live check failed: {report['live_check']['error']}")
    installed = bool(report["fix"].get("installed"))
    status, code, advice = decide(v.status, report["live_check"], installed, fallback)
    switch = report["cudnn_route"]["switch"]
    report.update(
        unchecked=unchecked,
        status=status,
        exit_code=code,
        advice=f"set {switch}; or: {advice}" if switch and code != EXIT_HEALTHY else advice,
        exit_codes={str(k): text for k, text in EXIT_CODES.items()},
    )
    return report


def run(as_json: bool = False, live: bool = True, head_dim: Optional[int] = None) -> int:
    """The ``doctor`` command: print the report (text or JSON); return the exit code."""
    result = collect(live=live, head_dim=head_dim)
    text = json.dumps(result, indent=2) if as_json else report.format_report(result)
    sys.stdout.write(text + "\n")
    return int(result["exit_code"])
