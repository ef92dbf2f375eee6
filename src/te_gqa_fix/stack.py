"""Facts about the stack this process runs: torch, the GPU, Transformer Engine and the cuDNN
it really runs.

One collector for every consumer: ``doctor`` (the report), the wrapper (its per-process
runtime facts: pass through on a fixed cuDNN, guard what the post-pass cannot repair), the
GPU tests, the benchmark and the context-parallel checks (the stack line of every result).

Order matters on machines with two cuDNN builds: Transformer Engine is imported before torch
is asked for its cuDNN, as in a training process (asking torch first maps torch's copy and
can make TE's import fail on a mix of builds).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import subprocess
import threading
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

from .cudnn import decode_cudnn_version, mapped_cudnn_libraries, te_cudnn_version

__all__ = [
    "RuntimeFacts",
    "gpu_info",
    "reset_runtime_facts",
    "runtime_facts",
    "stack_summary",
    "te_cudnn_version",
    "te_info",
    "torch_info",
]


def _vstr(v) -> Optional[str]:
    return None if v is None else ".".join(str(x) for x in v)


def torch_info() -> Dict[str, Any]:
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
    except Exception as exc:  # with TE's system cuDNN loaded first, torch's query can raise
        info["cudnn_error"] = f"{type(exc).__name__}: {exc}"
    return info


def gpu_info() -> Dict[str, Any]:
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


def te_info() -> Dict[str, Any]:
    """TE's version, whether ``transformer_engine.pytorch`` imports, and the cuDNN it runs."""
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
    cud = te_cudnn_version()
    if cud is None:
        info["cudnn_error"] = "Transformer Engine did not report its cuDNN version"
    info["cudnn"] = _vstr(cud)
    return info


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return "unknown"


def stack_summary() -> Dict[str, Any]:
    """The stack line every GPU result is committed with: GPU, driver, torch, TE, the cuDNN
    TE runs and torch's, the cuDNN files mapped, the GPU kit's choice, and the date (UTC)."""
    te = te_info()  # first: TE picks its cuDNN before torch is asked
    tor = torch_info()
    gpu = gpu_info()
    libs = mapped_cudnn_libraries() or []
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
        "cudnn_files": sorted({os.path.realpath(lib.path) for lib in libs}),
        "gpu_kit_cudnn": os.environ.get("GPU_KIT_CUDNN", ""),
        "te_gqa_fix_cudnn": os.environ.get("TE_GQA_FIX_CUDNN", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------- hot path


@dataclass(frozen=True)
class RuntimeFacts:
    """What the wrapper needs to know about the stack, learned once per device.

    ``capability`` of the device and the ``cudnn`` TE runs (``None`` where unknown).
    """

    capability: Optional[Tuple[int, int]]
    cudnn: Optional[Tuple[int, int, int]]

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


_facts: Dict[Optional[int], RuntimeFacts] = {}
_facts_lock = threading.Lock()


def _probe_capability(device_index: Optional[int]) -> Optional[Tuple[int, int]]:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device() if device_index is None else device_index
        return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]
    except Exception:
        return None


def _probe(device_index: Optional[int]) -> RuntimeFacts:
    return RuntimeFacts(capability=_probe_capability(device_index), cudnn=te_cudnn_version())


def runtime_facts(device_index: Optional[int] = None) -> RuntimeFacts:
    """The facts for a CUDA device index (None: a non-CUDA call), probed once, then cached.

    Host-side reads only (TE's cuDNN version, the device's compute capability): no device
    work, no sync; the first call per device costs a few microseconds, later ones a dict
    lookup.
    """
    facts = _facts.get(device_index)
    if facts is None:
        with _facts_lock:
            facts = _facts.get(device_index)
            if facts is None:
                facts = (
                    _probe(device_index) if device_index is not None else RuntimeFacts(None, None)
                )
                _facts[device_index] = facts
    return facts


def reset_runtime_facts() -> None:
    """Forget the cached facts (tests; or after loading another cuDNN by hand)."""
    with _facts_lock:
        _facts.clear()
