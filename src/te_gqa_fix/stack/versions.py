"""Facts about the running stack: torch, the GPU, Transformer Engine and the cuDNN it runs.

TE is imported before torch is asked for its cuDNN, as in training: asking torch first maps
torch's copy and can make TE's import fail on a mix of builds.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import subprocess
from importlib import metadata
from typing import Any, Dict, NamedTuple, Optional, Tuple

from packaging.version import InvalidVersion, Version

from .cudnn import decode_cudnn_version, mapped_cudnn_libraries, te_cudnn_version, version_str

__all__ = [
    "RuntimeFacts",
    "get_te_version",
    "gpu_info",
    "release",
    "runtime_facts",
    "stack_summary",
    "te_info",
]


def release(version: str) -> Tuple[int, ...]:
    """The major and minor release of a version string: ``"2.6.0a0+git"`` -> ``(2, 6)``;
    ``()`` for anything unreadable (which compares below every release)."""
    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return ()


def torch_info() -> Dict[str, Any]:
    """torch's version, CUDA and own cuDNN (``cudnn_error`` where torch's query raises)."""
    import torch

    info: Dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": None}
    try:
        v = torch.backends.cudnn.is_available() and torch.backends.cudnn.version()
        info["cudnn"] = version_str(decode_cudnn_version(v)) if v else None
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


def get_te_version() -> Optional[Version]:
    """The installed TE distribution's version, or None when there is none; never raises."""
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return Version(metadata.version(dist))
        except Exception:  # not installed, or a broken metadata entry
            continue
    return None


def te_info() -> Dict[str, Any]:
    """TE's version, whether ``transformer_engine.pytorch`` imports, and the cuDNN it runs."""
    version = get_te_version()
    info = {"version": version and str(version), "imported": False, "cudnn": None, "error": None}
    try:
        importlib.import_module("transformer_engine.pytorch")
        info.update(imported=True, cudnn=version_str(te_cudnn_version()))
    except Exception as exc:
        absent = isinstance(exc, ModuleNotFoundError) and exc.name == "transformer_engine"
        error = f"import transformer_engine.pytorch failed: {type(exc).__name__}: {exc}"
        info["error"] = "not installed" if absent and version is None else error
    return info


def _driver() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return "unknown"


def stack_summary() -> Dict[str, Any]:
    """The stack line every GPU result is recorded with.

    Returns:
        GPU, driver, torch, TE, TE's and torch's cuDNN, the cuDNN files mapped, both cuDNN
        settings, and the date (UTC).
    """
    te = te_info()  # first: TE picks its cuDNN before torch is asked
    tor = torch_info()
    gpu = gpu_info()
    cap = gpu.get("capability")
    return {
        "gpu": gpu.get("name"),
        "gpu_count": gpu.get("count"),
        "capability": None if cap is None else ".".join(map(str, cap)),
        "driver": _driver() if gpu.get("available") else None,
        "torch": tor.get("version"),
        "cuda": tor.get("cuda"),
        "te": te.get("version"),
        "cudnn_te": te.get("cudnn"),
        "cudnn_torch": tor.get("cudnn"),
        "cudnn_files": sorted({os.path.realpath(x.path) for x in mapped_cudnn_libraries() or []}),
        "gpu_kit_cudnn": os.environ.get("GPU_KIT_CUDNN", ""),
        "te_gqa_fix_cudnn": os.environ.get("TE_GQA_FIX_CUDNN", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class RuntimeFacts(NamedTuple):
    """What the wrapper needs about one device: its ``capability`` and the ``cudnn`` TE runs
    (None where unknown)."""

    capability: Optional[Tuple[int, int]]
    cudnn: Optional[Tuple[int, int, int]]


@functools.cache  # threads racing on a first probe store the same facts
def runtime_facts(device_index: Optional[int] = None) -> RuntimeFacts:
    """The facts for a CUDA device index (None: not CUDA, nothing known), probed once per
    process with host-side reads only (no device work, no sync), then a cache lookup."""
    if device_index is None:
        return RuntimeFacts(None, None)
    capability: Any = None
    try:
        import torch

        if torch.cuda.is_available():
            capability = tuple(torch.cuda.get_device_capability(device_index))
    except Exception:
        pass
    return RuntimeFacts(capability, te_cudnn_version())
