"""``te_gqa_fix.status()`` inside a process that installed the fix, on the real stack.

``te-gqa-fix doctor`` answers from a process of its own; ``status()`` is the answer inside
the training process. Here, after ``install()`` and one backward through TE's own module,
it must say the fix is installed at TE's call sites, name the cuDNN TE runs, the rule's
verdict for this GPU, which post-pass CUDA calls get, and what the call did. The record
(``kind="status"``) puts it on the validation page per build (issue #53).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import te_gqa_fix
from thd import poison_allocator, random_inputs, seed_batch, te_backward, te_forward

pytestmark = pytest.mark.gpu


def test_status_after_install(te, cudnn, capability, verdict, passes_through, record):
    sites = te_gqa_fix.install()
    te_gqa_fix.reset_call_counts()
    batch = seed_batch(second_call=True)
    random_inputs(batch, seed=2)
    te_forward(batch)
    poison_allocator(1000.0)
    te_backward(batch)  # TE's own module function: the installed wrapper
    torch.cuda.synchronize()
    status = te_gqa_fix.status()
    text = str(status)
    record(kind="status", text=text, **status.as_dict())
    assert status.installed and status.unreached == [], status
    assert set(sites) <= set(status.sites) and status.sites, (sites, status.sites)
    assert status.te_imported and status.cudnn == ".".join(map(str, cudnn)), status
    assert status.gpu == f"sm{capability[0]}{capability[1]}"
    assert status.verdict == verdict.status
    assert status.postpass in ("triton", "pytorch"), status
    if importlib.util.find_spec("triton") is not None:
        assert status.postpass == "triton", status.postpass_why
    else:
        assert status.postpass_why, status  # why CUDA calls get PyTorch, said
    assert status.calls["calls"] == 1, status.calls
    assert status.calls["skipped" if passes_through else "fixed"] == 1, status.calls
    for said in ("ACTIVE", status.cudnn, status.postpass, status.verdict):
        assert said in text, (said, text)
