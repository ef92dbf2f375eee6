"""GPU test fixtures: skip cleanly without CUDA or Transformer Engine; record results.

Tests here need a CUDA GPU and TE; they run on the GPU machine (see docs/validation.md
for the command). ``TE_GQA_FIX_RECORD=path.jsonl`` makes them append one JSON record per
case (and one describing the stack: ``te_gqa_fix.stack.versions.stack_summary``) for
``tests/gpu/report.py``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, Optional, Tuple

import pytest
import torch

from te_gqa_fix.stack.affected import verdict
from te_gqa_fix.stack.versions import stack_summary, te_cudnn_version

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
def affected(capability, cudnn) -> bool:
    """The one rule (te_gqa_fix.stack.affected): Hopper with cuDNN older than 9.18 (TE #2186)."""
    return verdict(capability, cudnn).status == "affected"


_RECORD = os.environ.get("TE_GQA_FIX_RECORD")


def _write(rec: Dict[str, Any]) -> None:
    if _RECORD:
        with open(_RECORD, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


@pytest.fixture(scope="session", autouse=True)
def _record_stack():
    te_pt, _ = _te_or_reason()
    if te_pt is not None:
        _write({"kind": "stack", **stack_summary()})
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
