"""``te-gqa-fix doctor``: is this stack affected, and is the fix active?

Users run someone else's training stack in a pinned container and usually do not know
which cuDNN Transformer Engine really runs: TE loads cuDNN from the system (CUDNN_HOME,
CUDA_HOME, /usr/local/cuda, the loader path) before the copy that torch ships, so on the
H200 test machine TE silently takes 9.14 while torch has 9.19. This module gathers the
facts (versions, GPU, the cuDNN TE reports and the cuDNN files actually mapped into the
process), turns them into a verdict from what is known about the bug, and, where a GPU
and TE are present, runs the seed case for real with and without the fix.

Known facts the verdict uses (see docs and ``bug-anatomy``):

* Hopper (sm90) with cuDNN older than 9.18, THD layout, GQA/MQA: TE's ``fused_attn_bwd``
  sums never-written workspace into dK/dV rows of sequences without queries. Affected;
  te-gqa-fix repairs it.
* Head dim above 128 on such a cuDNN is wrong on live rows too: no post-pass can repair
  it; use cuDNN 9.18 or newer.
* cuDNN 9.18+ fixes the workspace initialisation (upstream); 9.19 measured clean.

Exit codes (also in ``EXIT_CODES``): 0 healthy, 1 affected and the fix not active,
2 usage error, 3 cannot check, 4 broken beyond repair.
"""

from __future__ import annotations

import glob
import json
import math
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "EXIT_AFFECTED",
    "EXIT_CANNOT_CHECK",
    "EXIT_CODES",
    "EXIT_HEALTHY",
    "EXIT_UNREPAIRABLE",
    "EXIT_USAGE",
    "CudnnLibrary",
    "Verdict",
    "collect",
    "cudnn_library_warnings",
    "decide",
    "decode_cudnn_version",
    "format_report",
    "live_check",
    "parse_cudnn_maps",
    "verdict",
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

CUDNN_FIXED = (9, 18, 0)  # upstream: the workspace initialisation is fixed on Hopper
HOPPER_MAJOR = 9  # compute capability 9.x
MAX_REPAIRABLE_HEAD_DIM = 128
LIVE_TOLERANCE = 5e-2  # fp16, head dim 8, O(1) inputs: measured errors are ~4e-4

Version = Tuple[int, ...]


def decode_cudnn_version(encoded: int) -> Tuple[int, int, int]:
    """``cudnnGetVersion()`` / ``torch.backends.cudnn.version()`` -> (major, minor, patch).

    cuDNN 9 encodes ``major*10000 + minor*100 + patch``, cuDNN 8 ``major*1000 + ...``.
    """
    magnitude = 1000 if encoded < 90000 else 10000
    major, rest = divmod(int(encoded), magnitude)
    minor, patch = divmod(rest, 100)
    return (major, minor, patch)


def _vstr(v: Optional[Sequence[int]]) -> Optional[str]:
    return None if v is None else ".".join(str(x) for x in v)


def _vtuple(s: Optional[str]) -> Optional[Version]:
    if not s:
        return None
    parts = re.findall(r"\d+", s)
    return tuple(int(p) for p in parts) if parts else None


# ----------------------------------------------------------------------------- cuDNN files


@dataclass(frozen=True)
class CudnnLibrary:
    """One cuDNN shared library mapped into the process.

    ``version`` is as precise as could be learned (``"9.14.0"``, or ``"9"`` when only the
    file name's major is known); ``source`` says where it came from.
    """

    path: str
    name: str
    version: Optional[str]
    source: str


_LIB_RE = re.compile(r"^(libcudnn(?:_[A-Za-z0-9_]+)?)\.so(?:\.(\d+(?:\.\d+)*))?$")


def parse_cudnn_maps(text: str) -> List[CudnnLibrary]:
    """The cuDNN libraries in a ``/proc/<pid>/maps`` text, in first-seen order.

    Each library appears once (maps lists one line per mapped segment). Versions come from
    the file names (``libcudnn_adv.so.9.14.0`` -> 9.14.0; ``libcudnn.so.9`` -> 9).
    """
    seen: Dict[str, CudnnLibrary] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if not path.startswith("/") or path in seen:
            continue
        m = _LIB_RE.match(os.path.basename(path))
        if m is None:
            continue
        seen[path] = CudnnLibrary(
            path=path, name=m.group(1), version=m.group(2), source="file name"
        )
    return list(seen.values())


def _wheel_version(path: str) -> Optional[str]:
    """Version of the ``nvidia-cudnn-cu*`` wheel that owns ``path`` (its dist-info name)."""
    parts = path.split(os.sep)
    if "nvidia" not in parts:
        return None
    idx = len(parts) - 1 - parts[::-1].index("nvidia")
    site_dir = os.sep.join(parts[:idx])
    for info in sorted(glob.glob(os.path.join(site_dir, "nvidia_cudnn_cu*-*.dist-info"))):
        m = re.search(r"-(\d+(?:\.\d+)+)\.dist-info$", info)
        if m:
            return m.group(1)
    return None


def _ctypes_version(path: str) -> Optional[str]:
    """``cudnnGetVersion`` of an already loaded ``libcudnn.so*`` (never loads a new one)."""
    try:
        import ctypes

        mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
        lib = ctypes.CDLL(path, mode=mode)
        fn = lib.cudnnGetVersion
        fn.restype = ctypes.c_size_t
        return _vstr(decode_cudnn_version(int(fn())))
    except Exception:
        return None


def resolve_versions(libs: Sequence[CudnnLibrary]) -> List[CudnnLibrary]:
    """Make versions precise where the file name gives only the major (pip wheels name
    their files ``libcudnn*.so.9``): ask the loaded library, then the owning wheel."""
    out = []
    for lib in libs:
        v = _vtuple(lib.version)
        if v is not None and len(v) >= 2:
            out.append(lib)
            continue
        real = os.path.realpath(lib.path)
        m = _LIB_RE.match(os.path.basename(real))
        if m and m.group(2) and len(_vtuple(m.group(2)) or ()) >= 2:
            out.append(CudnnLibrary(lib.path, lib.name, m.group(2), "real path"))
            continue
        found = _ctypes_version(lib.path) if lib.name == "libcudnn" else None
        if found:
            out.append(CudnnLibrary(lib.path, lib.name, found, "cudnnGetVersion"))
            continue
        wheel = _wheel_version(lib.path)
        if wheel:
            out.append(CudnnLibrary(lib.path, lib.name, wheel, "nvidia-cudnn wheel"))
            continue
        out.append(lib)
    return out


def mapped_cudnn_libraries(maps_path: str = "/proc/self/maps") -> Optional[List[CudnnLibrary]]:
    """The cuDNN libraries mapped into this process, or None where maps is unreadable."""
    try:
        with open(maps_path) as f:
            text = f.read()
    except OSError:
        return None
    return resolve_versions(parse_cudnn_maps(text))


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


@dataclass(frozen=True)
class Verdict:
    """``status``: ``affected``, ``not_affected``, ``unrepairable`` or ``unknown``."""

    status: str
    reasons: Tuple[str, ...]


def verdict(
    capability: Optional[Sequence[int]],
    cudnn_version: Optional[Sequence[int]],
    head_dim: Optional[int] = None,
) -> Verdict:
    """What the known facts say for THD + GQA training on this GPU and cuDNN.

    ``cudnn_version`` is the cuDNN Transformer Engine runs (not torch's). ``head_dim``
    (optional) is the model's attention head dim; above 128 an affected cuDNN is wrong on
    live rows too, which no post-pass can repair.
    """
    if capability is None or cudnn_version is None:
        missing = []
        if capability is None:
            missing.append("the GPU's compute capability")
        if cudnn_version is None:
            missing.append("the cuDNN version Transformer Engine runs")
        return Verdict("unknown", (f"cannot tell without {' and '.join(missing)}",))
    cap = tuple(int(x) for x in capability)
    cud = tuple(int(x) for x in cudnn_version)
    sm = f"sm{cap[0]}{cap[1] if len(cap) > 1 else 0}"
    cud_s = _vstr(cud)
    if cap[0] != HOPPER_MAJOR:
        return Verdict(
            "not_affected",
            (
                f"{sm} is not Hopper: the stale-workspace bug is known on Hopper (sm90) only; "
                "te-gqa-fix does no harm elsewhere",
            ),
        )
    if cud >= CUDNN_FIXED:
        return Verdict(
            "not_affected",
            (f"cuDNN {cud_s} >= 9.18 initialises the GQA workspace (9.19 measured clean)",),
        )
    base = (
        f"Hopper ({sm}) with cuDNN {cud_s} < 9.18: TE's fused_attn_bwd (THD layout, GQA/MQA) "
        "sums stale workspace into dK/dV rows of sequences without query tokens"
    )
    if head_dim is not None and head_dim > MAX_REPAIRABLE_HEAD_DIM:
        return Verdict(
            "unrepairable",
            (
                base,
                f"head dim {head_dim} > {MAX_REPAIRABLE_HEAD_DIM} on this cuDNN is wrong on "
                "rows that receive attention too (dQ up to 8.6e4 measured): no post-pass can "
                "repair it; use cuDNN 9.18 or newer",
            ),
        )
    reasons = [base, "te-gqa-fix repairs it exactly (head dim <= 128)"]
    if head_dim is None:
        reasons.append(
            f"if your model's head dim is above {MAX_REPAIRABLE_HEAD_DIM} (192, 256), this "
            "cuDNN is broken beyond repair: use 9.18 or newer (pass --head-dim to check)"
        )
    return Verdict("affected", tuple(reasons))


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


def live_check(
    device: str = "cuda", poison_numel: int = 1 << 28, sentinel: float = 1000.0
) -> Dict[str, Any]:
    """The seed case on the real TE, unpatched and patched, each after a poisoned block.

    Seed case: 2 query heads, 1 KV head, head dim 8, fp16, ``thd_thd_thd``,
    ``padding_causal``, cu_seqlens_q [0,0,3], kv [0,3,9], padded [0,4,12]: sequence 0 has
    no queries, so dK/dV rows 0-3 must be exactly 0. Right before each backward a block of
    ``sentinel`` is allocated and freed so the caching allocator hands it to TE's
    workspace (deterministic trigger). Never raises: errors are reported.
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


def _torch_info() -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {
        "version": torch.__version__,
        "cuda": getattr(torch.version, "cuda", None),
        "cudnn": None,
    }
    try:
        if torch.backends.cudnn.is_available():
            v = torch.backends.cudnn.version()
            info["cudnn"] = _vstr(decode_cudnn_version(v)) if v else None
    except Exception as exc:
        info["cudnn_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _gpu_info() -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"available": False, "count": 0, "name": None, "capability": None}
    if not torch.cuda.is_available():
        return info
    info["available"] = True
    info["count"] = torch.cuda.device_count()
    dev = torch.cuda.current_device()
    info["name"] = torch.cuda.get_device_name(dev)
    info["capability"] = list(torch.cuda.get_device_capability(dev))
    return info


def _te_info() -> Dict[str, Any]:
    import importlib
    import importlib.util

    from .te_compat import get_te_version

    version = get_te_version()
    info: Dict[str, Any] = {
        "version": None if version is None else str(version),
        "imported": False,
        "cudnn": None,
        "error": None,
    }
    try:
        present = importlib.util.find_spec("transformer_engine") is not None
    except Exception:
        present = False
    if not present and version is None:
        info["error"] = "not installed"
        return info
    try:
        importlib.import_module("transformer_engine.pytorch")
        info["imported"] = True
    except Exception as exc:
        info["error"] = f"import transformer_engine.pytorch failed: {type(exc).__name__}: {exc}"
        return info
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        info["cudnn"] = _vstr(tuple(get_cudnn_version()))
    except Exception:
        try:
            import transformer_engine_torch as tex

            info["cudnn"] = _vstr(decode_cudnn_version(int(tex.get_cudnn_version())))
        except Exception as exc:
            info["cudnn_error"] = f"{type(exc).__name__}: {exc}"
    return info


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
    te_section = _section(_te_info)
    report["torch"] = _section(_torch_info)
    report["gpu"] = _section(_gpu_info)
    report["transformer_engine"] = te_section
    te = report["transformer_engine"]
    gpu = report["gpu"]
    if not gpu.get("available"):
        unchecked.append("GPU: torch sees no CUDA device")
    if not te.get("imported"):
        unchecked.append(f"Transformer Engine: {te.get('error') or 'not importable'}")
    elif te.get("cudnn") is None:
        unchecked.append("the cuDNN version Transformer Engine runs (TE did not report it)")

    libs = _section(mapped_cudnn_libraries)
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
    report["warnings"] = cudnn_library_warnings(libs, te_cudnn, torch_cudnn)

    report["fix"] = _section(_fix_info)
    capability = gpu.get("capability")
    v = verdict(capability, te_cudnn if te.get("imported") else None, head_dim)
    report["verdict"] = {"status": v.status, "reasons": list(v.reasons), "head_dim": head_dim}

    if not live:
        report["live_check"] = {"ran": False, "skipped": "--no-live"}
    elif not gpu.get("available") or not te.get("imported"):
        report["live_check"] = {"ran": False, "skipped": "needs a CUDA GPU and Transformer Engine"}
        unchecked.append("live check (needs a CUDA GPU and Transformer Engine)")
    else:
        report["live_check"] = live_check()
        if report["live_check"].get("error"):
            unchecked.append(f"live check failed: {report['live_check']['error']}")
    status, code, advice = decide(
        v.status, report["live_check"], bool(report["fix"].get("installed"))
    )
    report["unchecked"] = unchecked
    report["status"] = status
    report["exit_code"] = code
    report["advice"] = advice
    report["exit_codes"] = {str(k): v for k, v in EXIT_CODES.items()}
    return report


# ----------------------------------------------------------------------------- text


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
    row("TE_GQA_FIX_AUTOPATCH", fix.get("autopatch_env") or "unset")
    row("start-up file", fix.get("start_up_file") or "not installed (is te-gqa-fix pip-installed?)")
    if fix.get("autopatch_error"):
        row("autopatch error", fix["autopatch_error"])

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


def run(as_json: bool = False, live: bool = True, head_dim: Optional[int] = None) -> int:
    """The ``doctor`` command: print the report, return the exit code."""
    report = collect(live=live, head_dim=head_dim)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=False) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
    return int(report["exit_code"])
