"""``te-gqa-fix doctor``: is this stack affected, and is the fix active?

Users run someone else's training stack in a pinned container and usually do not know
which cuDNN Transformer Engine really runs: TE loads cuDNN from the system (CUDNN_HOME,
CUDA_HOME, /usr/local/cuda, the loader path) before the copy that torch ships, so on the
H200 test machine TE silently takes 9.14 while torch has 9.19. This module asks
:mod:`te_gqa_fix.stack` and :mod:`te_gqa_fix.cudnn` for the facts (versions, GPU, the cuDNN
TE reports, the cuDNN files mapped into the process and every build on disk), asks
:mod:`te_gqa_fix.affected` (the one rule) for a verdict, runs the seed case for real with
and without the fix where a GPU and TE are present, and decides the exit code;
:mod:`te_gqa_fix.doctor_text` prints the result.

Exit codes (also in ``EXIT_CODES``): 0 healthy, 1 affected and the fix not active,
2 usage error, 3 cannot check, 4 broken beyond repair.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import affected, cudnn, doctor_text, stack
from .cudnn import CudnnLibrary

__all__ = [
    "EXIT_AFFECTED",
    "EXIT_CANNOT_CHECK",
    "EXIT_CODES",
    "EXIT_HEALTHY",
    "EXIT_UNREPAIRABLE",
    "EXIT_USAGE",
    "collect",
    "cudnn_library_warnings",
    "decide",
    "live_check",
]

EXIT_HEALTHY = 0
EXIT_AFFECTED = 1
EXIT_USAGE = 2
EXIT_CANNOT_CHECK = 3
EXIT_UNREPAIRABLE = 4

EXIT_CODES: Dict[int, str] = {
    EXIT_HEALTHY: "healthy: not affected, or affected with the fix active in this environment",
    EXIT_AFFECTED: "affected: the bug applies here and the fix is not active",
    EXIT_USAGE: "usage error (bad command-line arguments)",
    EXIT_CANNOT_CHECK: "cannot check: no GPU, no Transformer Engine, or its cuDNN unknown",
    EXIT_UNREPAIRABLE: "broken beyond repair: head dim > 128 on an affected cuDNN, or the "
    "live check found wrong values even with the fix; use cuDNN 9.18 or newer",
}

LIVE_TOLERANCE = 5e-2  # fp16, head dim 8, O(1) inputs: measured errors are ~4e-4


def _vstr(v: Optional[Sequence[int]]) -> Optional[str]:
    return None if v is None else ".".join(str(x) for x in v)


def _vtuple(s: Optional[str]) -> Optional[Tuple[int, ...]]:
    if not s:
        return None
    parts = re.findall(r"\d+", s)
    return tuple(int(p) for p in parts) if parts else None


def cudnn_library_warnings(
    libs: Sequence[CudnnLibrary],
    te_cudnn: Optional[Sequence[int]] = None,
    torch_cudnn: Optional[Sequence[int]] = None,
) -> List[str]:
    """Warnings about the cuDNN in use: a mixed set of mapped versions, one library
    mapped from two places, TE and torch on different cuDNN versions."""
    warnings: List[str] = []
    by_minor: Dict[Tuple[int, int], List[str]] = {}
    for lib in libs:
        v = _vtuple(lib.version)
        if v is not None and len(v) >= 2:
            by_minor.setdefault((v[0], v[1]), []).append(os.path.basename(lib.path))
    if len(by_minor) > 1:
        desc = "; ".join(
            f"{a}.{b}: {', '.join(sorted(set(names)))}"
            for (a, b), names in sorted(by_minor.items())
        )
        warnings.append(
            f"the cuDNN libraries mapped into this process mix versions ({desc}); TE may run "
            "kernels from another cuDNN than the one it reports: point CUDNN_HOME and "
            "LD_LIBRARY_PATH at a single cuDNN"
        )
    places: Dict[str, List[str]] = {}
    for lib in libs:
        places.setdefault(lib.name, []).append(os.path.dirname(lib.path))
    for name, dirs in sorted(places.items()):
        if len(set(dirs)) > 1:
            warnings.append(f"{name} is mapped from {len(set(dirs))} places: {sorted(set(dirs))}")
    if te_cudnn is not None and torch_cudnn is not None:
        if tuple(te_cudnn)[:2] != tuple(torch_cudnn)[:2]:
            warnings.append(
                f"Transformer Engine runs cuDNN {_vstr(te_cudnn)} but torch's cuDNN is "
                f"{_vstr(torch_cudnn)}: TE loads the system cuDNN (CUDNN_HOME, CUDA_HOME, "
                "/usr/local/cuda, the loader path) before the one torch ships"
            )
    return warnings


# ----------------------------------------------------------------------------- verdict


def decide(
    verdict_status: str, live: Optional[Dict[str, Any]], fix_active: bool
) -> Tuple[str, int, str]:
    """Overall ``(status, exit_code, advice)`` from the verdict, the live check and
    whether the fix is active here. An observation outranks the table of facts."""
    ran = bool(live and live.get("ran"))
    observed = ran and bool(live and live.get("bug_observed"))
    fix_failed = ran and live is not None and live.get("fix_ok") is False
    if fix_failed:
        return (
            "unrepairable",
            EXIT_UNREPAIRABLE,
            "the live check found wrong values even with the fix: use cuDNN 9.18 or newer",
        )
    if verdict_status == "unrepairable":
        return ("unrepairable", EXIT_UNREPAIRABLE, "use cuDNN 9.18 or newer")
    if verdict_status == "affected" or observed:
        if fix_active:
            return (
                "healthy",
                EXIT_HEALTHY,
                "affected stack, and te-gqa-fix is active in this environment",
            )
        return (
            "affected",
            EXIT_AFFECTED,
            "turn the fix on: TE_GQA_FIX_AUTOPATCH=1 in the job's environment, or "
            "te_gqa_fix.install() at start-up (if your code already calls it, you are covered)",
        )
    if verdict_status == "not_affected":
        return ("healthy", EXIT_HEALTHY, "nothing to do")
    return (
        "cannot_check",
        EXIT_CANNOT_CHECK,
        "run doctor where training runs (a GPU and Transformer Engine are needed)",
    )


# ----------------------------------------------------------------------------- live check


def _num(x: float) -> Any:
    return x if math.isfinite(x) else str(x)


def large_head_dim_check(device: str = "cuda", sentinel: float = 1000.0) -> Dict[str, Any]:
    """TE's own backward (no post-pass) at head dim 256, GQA 8/2, bf16, after a poisoned
    block, against the fp32 reference with the repository's tolerance rule: exact only when
    TE runs a fixed cuDNN (on 9.14 it is wrong on live rows). Never raises."""
    out: Dict[str, Any] = {
        "case": "h 8/2, d 256, bf16, thd_thd_thd, padding_causal, a q-empty sequence, "
        "padding between sequences, tail rows; TE unpatched",
    }
    try:
        from . import reproduce as rp
        from .te_compat import find_original

        batch = rp.large_head_dim_batch(256, (8, 2))
        rp.random_inputs(batch, device=device, seed=256)
        rp.te_forward(batch, device=device)
        rp.poison_allocator(sentinel, 1 << 26, device)
        res = rp.compare(batch, rp.te_backward(batch, fn=find_original(), device=device),
                         rp.references(batch, device))  # fmt: skip
        out.update({k: _num(float(v)) for k, v in res.items()})
        out["exact"] = rp.exact(res)
    except Exception as exc:  # report, never crash the doctor
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["exact"] = False
    return out


def live_check(
    device: str = "cuda",
    poison_numel: int = 1 << 28,
    sentinel: float = 1000.0,
    large_head_dim: bool = False,
) -> Dict[str, Any]:
    """The seed case on the real TE, unpatched and patched, each after a poisoned block.

    Seed case: 2 query heads, 1 KV head, head dim 8, fp16, ``thd_thd_thd``,
    ``padding_causal``, cu_seqlens_q [0,0,3], kv [0,3,9], padded [0,4,12]: sequence 0 has
    no queries, so dK/dV rows 0-3 must be exactly 0. Right before each backward a block of
    ``sentinel`` is allocated and freed so the caching allocator hands it to TE's
    workspace (deterministic trigger). With ``large_head_dim`` (the cuDNN route is active)
    it adds :func:`large_head_dim_check`, which must be exact too. Never raises.
    """
    out: Dict[str, Any] = {
        "ran": False,
        "case": "seed: h 2/1, d 8, fp16, thd_thd_thd, padding_causal, cu_q [0,0,3], "
        "cu_kv [0,3,9], padded [0,4,12]",
        "sentinel": sentinel,
    }
    try:
        import torch

        from . import reproduce as rp
        from .te_compat import find_original
        from .wrapper import wrapper_for

        original = find_original()
        variants = (("unpatched", original), ("patched", wrapper_for(original)))
        batch = rp.seed_batch(second_call=True)
        rp.random_inputs(batch, device=device, seed=0)
        rp.te_forward(batch, device=device)
        ref = rp.reference_attention(batch, dtype=torch.float32, device="cpu")
        must_be_zero = torch.zeros(batch.rows_kv, dtype=torch.bool)
        must_be_zero[0:4] = True
        for name, fn in variants:
            try:
                rp.poison_allocator(sentinel, poison_numel, device)
            except RuntimeError:  # a small GPU: a smaller block still lands in the pool
                rp.poison_allocator(sentinel, poison_numel // 64, device)
            grads = rp.te_backward(batch, fn=fn, device=device)
            dq, dk, dv = (g.detach().float().cpu() for g in grads[:3])
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            res = {
                "max_abs_dk_rows_0_3": _num(float(dk[must_be_zero].abs().max())),
                "max_abs_dv_rows_0_3": _num(float(dv[must_be_zero].abs().max())),
                "max_err_dq": _num(float((dq - ref["dq"]).abs().max())),
                "max_err_dk": _num(float((dk - ref["dk"]).abs().max())),
                "max_err_dv": _num(float((dv - ref["dv"]).abs().max())),
                "max_err_live_rows": _num(
                    float(
                        torch.cat(
                            [
                                (dk - ref["dk"])[~must_be_zero].abs().flatten(),
                                (dv - ref["dv"])[~must_be_zero].abs().flatten(),
                                (dq - ref["dq"]).abs().flatten(),
                            ]
                        ).max()
                    )
                ),
                "rows_0_3_zero": bool(
                    (dk[must_be_zero] == 0).all() and (dv[must_be_zero] == 0).all()
                ),
            }
            out[name] = res
        un, pa = out["unpatched"], out["patched"]
        out["bug_observed"] = not un["rows_0_3_zero"]
        live_ok = isinstance(pa["max_err_live_rows"], float) and (
            pa["max_err_live_rows"] <= LIVE_TOLERANCE
        )
        out["fix_ok"] = bool(pa["rows_0_3_zero"] and live_ok)
        out["tolerance"] = LIVE_TOLERANCE
        if large_head_dim:
            out["large_head_dim"] = large_head_dim_check(device, sentinel)
            out["fix_ok"] = bool(out["fix_ok"] and out["large_head_dim"]["exact"])
        out["ran"] = True
    except Exception as exc:  # report, never crash the doctor
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# ----------------------------------------------------------------------------- collect


def _section(fn, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _fix_info() -> Dict[str, Any]:
    from . import autopatch
    from .patch import is_installed

    st = autopatch.status()
    return {
        "installed": is_installed(),
        "autopatch_env": st["env"],
        "autopatch_mode": st["mode"],
        "autopatch_hook": st["hook_enabled"],
        "autopatch_fired": st["fired"],
        "autopatch_error": st["error"],
        "start_up_file": st["pth"],
    }


def _builds_section(libs: Sequence[CudnnLibrary], te_cudnn, torch_cudnn) -> List[Dict[str, Any]]:
    """Every cuDNN build on disk, marked with whether TE's / torch's cuDNN is that one.

    A build is "mapped" when this process has its libcudnn.so loaded; "te_runs" when it is
    mapped and its version is the one TE reports (likewise torch).
    """
    mapped_dirs = {
        os.path.realpath(os.path.dirname(lib.path)) for lib in libs if lib.name == "libcudnn"
    }
    out = []
    for b in cudnn.find_builds():
        mapped = os.path.realpath(b.lib_dir) in mapped_dirs
        version = b.version[:3] if b.version else None
        out.append(
            {
                "lib_dir": b.lib_dir,
                "version": b.version_str,
                "origin": b.origin,
                "how": b.how,
                "distribution": b.distribution,
                "fixed": b.fixed,
                "mapped": mapped,
                "te_runs": bool(mapped and te_cudnn and version == tuple(te_cudnn[:3])),
                "torch_runs": bool(mapped and torch_cudnn and version == tuple(torch_cudnn[:3])),
            }
        )
    return out


def _switch(builds: Sequence[Dict[str, Any]], te_cudnn) -> Optional[str]:
    """The one setting that makes TE run a fixed build installed here but unused, if any."""
    if te_cudnn is None or affected.cudnn_is_fixed(te_cudnn):
        return None
    wheel_fixed = [b for b in builds if b["fixed"] and b["origin"] == "wheel"]
    if wheel_fixed:
        best = max(wheel_fixed, key=lambda b: _vtuple(b["version"]) or ())
        return f"{cudnn.ENV_CUDNN}=auto  (loads cuDNN {best['version']} from {best['lib_dir']})"
    other = [b for b in builds if b["fixed"]]
    if other:
        return f"{cudnn.ENV_CUDNN}={other[0]['lib_dir']}  (cuDNN {other[0]['version']})"
    return None


def collect(live: bool = True, head_dim: Optional[int] = None) -> Dict[str, Any]:
    """Gather everything; never raises. The result is JSON-serialisable."""
    from . import __version__

    report: Dict[str, Any] = {
        "te_gqa_fix": {"version": __version__},
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    unchecked: List[str] = []
    # TE first, as in a training process: TE loads its cuDNN (system first) before torch
    # loads its own copy. Asking torch first maps torch's cuDNN and can make TE's import
    # fail on a mix of builds (seen on the H200 test machine), a state training never hits.
    te_section = _section(stack.te_info)
    report["torch"] = _section(stack.torch_info)
    report["gpu"] = _section(stack.gpu_info)
    report["transformer_engine"] = te_section
    te = report["transformer_engine"]
    gpu = report["gpu"]
    if not gpu.get("available"):
        unchecked.append("GPU: torch sees no CUDA device")
    if not te.get("imported"):
        unchecked.append(f"Transformer Engine: {te.get('error') or 'not importable'}")
    elif te.get("cudnn") is None:
        unchecked.append("the cuDNN version Transformer Engine runs (TE did not report it)")

    libs = _section(cudnn.mapped_cudnn_libraries)
    if isinstance(libs, dict):
        report["cudnn_libraries"] = []
        unchecked.append(f"cuDNN files mapped into the process: {libs['error']}")
        libs = []
    elif libs is None:
        report["cudnn_libraries"] = []
        unchecked.append("cuDNN files mapped into the process: /proc/self/maps unreadable")
        libs = []
    else:
        report["cudnn_libraries"] = [asdict(lib) for lib in libs]
    te_cudnn = _vtuple(te.get("cudnn"))
    torch_cudnn = _vtuple(report["torch"].get("cudnn"))
    route = cudnn.route_state()
    if route.get("verified"):
        # The route loaded the fixed build first on purpose; TE's own later load of the
        # system file is mapped too but binds nothing: not a mix to warn about.
        report["warnings"] = []
        report["notes"] = [
            f"{cudnn.ENV_CUDNN} loaded cuDNN {route['chosen_version']} first; TE's own load "
            "of its system cuDNN is mapped too, but symbols bind to the first copy (TE reports "
            f"{route['te_cudnn']})"
        ]
    else:
        report["warnings"] = cudnn_library_warnings(libs, te_cudnn, torch_cudnn)
    builds = _section(_builds_section, libs, te_cudnn, torch_cudnn)
    if isinstance(builds, dict):
        unchecked.append(f"cuDNN builds on disk: {builds['error']}")
        builds = []
    report["cudnn_builds"] = builds
    report["cudnn_route"] = {**route, "switch": _switch(builds, te_cudnn)}

    report["fix"] = _section(_fix_info)
    capability = gpu.get("capability")
    te_runs = te_cudnn if te.get("imported") else None
    v = affected.verdict(capability, te_runs, head_dim)
    report["verdict"] = {"status": v.status, "reasons": list(v.reasons), "head_dim": head_dim}
    report["post_pass"] = (
        "pass-through: the cuDNN TE runs is fixed, so the wrapper does nothing under "
        "TE_GQA_FIX=auto (TE_GQA_FIX=always still forces the post-pass)"
        if affected.cudnn_is_fixed(te_runs)
        else "runs on THD backward calls with h_q != h_kv (cuDNN not known to be fixed)"
    )

    if not live:
        report["live_check"] = {"ran": False, "skipped": "--no-live"}
    elif not gpu.get("available") or not te.get("imported"):
        report["live_check"] = {"ran": False, "skipped": "needs a CUDA GPU and Transformer Engine"}
        unchecked.append("live check (needs a CUDA GPU and Transformer Engine)")
    else:
        large = report["cudnn_route"].get("chosen") is not None
        report["live_check"] = live_check(large_head_dim=large)
        if report["live_check"].get("error"):
            unchecked.append(f"live check failed: {report['live_check']['error']}")
    status, code, advice = decide(
        v.status, report["live_check"], bool(report["fix"].get("installed"))
    )
    switch = report["cudnn_route"]["switch"]
    if switch and code != EXIT_HEALTHY:
        advice = f"set {switch}; or: {advice}"
    report["unchecked"] = unchecked
    report["status"] = status
    report["exit_code"] = code
    report["advice"] = advice
    report["exit_codes"] = {str(k): v for k, v in EXIT_CODES.items()}
    return report


def run(as_json: bool = False, live: bool = True, head_dim: Optional[int] = None) -> int:
    """The ``doctor`` command: print the report, return the exit code."""
    report = collect(live=live, head_dim=head_dim)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=False) + "\n")
    else:
        sys.stdout.write(doctor_text.format_report(report) + "\n")
    return int(report["exit_code"])
