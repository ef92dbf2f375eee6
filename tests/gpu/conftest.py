"""GPU test fixtures: skip cleanly without CUDA or Transformer Engine; record results.

Tests here need a CUDA GPU and TE; they run on the GPU machine (see docs/validation.md
for the command). ``TE_GQA_FIX_RECORD=path.jsonl`` makes them append one JSON record per
case (and one describing the stack) for ``tools/validation_report.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from typing import Any, Dict, Optional, Tuple

import pytest
import torch

# The cuDNN backend must be the one under test: no flash-attn, no unfused fallback.
os.environ.setdefault("NVTE_FLASH_ATTN", "0")
os.environ.setdefault("NVTE_UNFUSED_ATTN", "0")
os.environ.setdefault("NVTE_FUSED_ATTN", "1")


def _te_or_reason() -> Tuple[Optional[Any], str]:
    if not torch.cuda.is_available():
        return None, "needs a CUDA GPU"
    try:
        import transformer_engine.pytorch as te_pt
    except Exception as exc:  # ImportError, or a broken extension build
        return None, f"needs Transformer Engine with PyTorch support ({exc})"
    return te_pt, ""


@pytest.fixture(scope="session")
def te():
    te_pt, reason = _te_or_reason()
    if te_pt is None:
        pytest.skip(reason)
    return te_pt


def cudnn_loaded_by_te() -> Tuple[int, int, int]:
    from transformer_engine.pytorch import get_cudnn_version

    return tuple(get_cudnn_version())  # type: ignore[return-value]


@pytest.fixture(scope="session")
def cudnn(te) -> Tuple[int, int, int]:
    return cudnn_loaded_by_te()


@pytest.fixture(scope="session")
def affected(te, cudnn) -> bool:
    """Known facts: Hopper with cuDNN older than 9.18 is affected (TE #2186)."""
    return torch.cuda.get_device_capability() == (9, 0) and tuple(cudnn) < (9, 18, 0)


def _mapped_cudnn() -> list:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudnn" in line}
    except OSError:
        return []
    return sorted(os.path.realpath(p) for p in paths)


def _torch_cudnn() -> str:
    # With the system cuDNN loaded by TE first, torch's own query can raise.
    try:
        return str(torch.backends.cudnn.version())
    except Exception as exc:
        return f"n/a ({type(exc).__name__})"


def stack_info() -> Dict[str, Any]:
    import transformer_engine

    try:
        driver = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except Exception:
        driver = "unknown"
    return {
        "kind": "stack",
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "te": getattr(transformer_engine, "__version__", "?"),
        "cudnn_te": ".".join(map(str, cudnn_loaded_by_te())),
        "cudnn_torch": _torch_cudnn(),
        "cudnn_files": _mapped_cudnn(),
        "gpu_kit_cudnn": os.environ.get("GPU_KIT_CUDNN", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


_RECORD = os.environ.get("TE_GQA_FIX_RECORD")


def _write(rec: Dict[str, Any]) -> None:
    if _RECORD:
        with open(_RECORD, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


@pytest.fixture(scope="session", autouse=True)
def _record_stack():
    te_pt, _ = _te_or_reason()
    if te_pt is not None:
        _write(stack_info())
    yield


@pytest.fixture
def record(request):
    """``record(**fields)`` appends one JSON line tagged with the test id."""

    def _rec(**fields: Any) -> None:
        fields.setdefault("kind", "case")
        fields["test"] = re.sub(r"^tests/gpu/", "", request.node.nodeid)
        _write(fields)

    return _rec


@pytest.fixture(autouse=True)
def _unpatched_after():
    yield
    import te_gqa_fix

    te_gqa_fix.uninstall()
