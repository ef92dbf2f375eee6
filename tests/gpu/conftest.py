"""GPU test fixtures: skip cleanly without CUDA or Transformer Engine; record results.

Tests here need a CUDA GPU and TE; they run on the GPU machine (``evidence/run_validation.sh``).
``GPU_TESTS_RECORD=path.jsonl`` makes them append one JSON record per case, and one
describing the stack (``evidence/stack_probe.py``'s), for ``evidence/validation_report.py``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import pytest
import torch

from fakes.scripts import load_script
from te_gqa_fix import rules
from te_gqa_fix._te import te_cudnn_version

# The cuDNN backend must be the one under test: no flash-attn, no unfused fallback.
os.environ.setdefault("NVTE_FLASH_ATTN", "0")
os.environ.setdefault("NVTE_UNFUSED_ATTN", "0")
os.environ.setdefault("NVTE_FUSED_ATTN", "1")

STACK_PROBE = Path(__file__).resolve().parents[2] / "evidence" / "stack_probe.py"


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


@pytest.fixture(scope="session")
def capability(te) -> Tuple[int, int]:
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


@pytest.fixture(scope="session")
def cudnn(te) -> Tuple[int, int, int]:
    """The cuDNN Transformer Engine runs (not torch's)."""
    version = te_cudnn_version()
    if version is None:
        pytest.fail("Transformer Engine did not report its cuDNN version")
    return version


@pytest.fixture(scope="session")
def verdict(capability, cudnn) -> rules.Verdict:
    """The rule (:func:`te_gqa_fix.rules.judge`) for this GPU and cuDNN, head dims <= 128."""
    return rules.judge(capability, cudnn)


@pytest.fixture(scope="session")
def affected(verdict, cudnn) -> bool:
    """TE leaves stale workspace in rows of sequences without queries here, unpatched:
    Hopper with a cuDNN older than the upstream fix (9.18, TE #2186)."""
    return verdict.status in ("stale_rows", "live_rows_wrong") and cudnn < rules.CUDNN_FIXED


@pytest.fixture(scope="session")
def passes_through(verdict) -> bool:
    """The wrapper leaves TE's calls untouched here under the default policy: this cuDNN
    was measured right on this GPU (an unmeasured build keeps the post-pass)."""
    return verdict.status == "right"


_RECORD = os.environ.get("GPU_TESTS_RECORD")


def _write(rec: Dict[str, Any]) -> None:
    if _RECORD:
        with open(_RECORD, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


@pytest.fixture(scope="session", autouse=True)
def _record_stack():
    te_pt, _ = _te_or_reason()
    if te_pt is not None and _RECORD:
        probe = load_script("te_gqa_fix_evidence_stack_probe", STACK_PROBE)
        _write({"kind": "stack", **probe.probe()})
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
