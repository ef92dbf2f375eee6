"""The original report, adapted to the installed TE: reproduced unpatched, exact patched.

Two calls as in the report (cu_seqlens_q [0,1,3] then [0,0,3]; kv [0,3,9]; padded
[0,4,12]; 2 query heads, 1 KV head, d 8, fp16). A freed block of a finite sentinel right
before the backward makes the stale workspace deterministic: on affected stacks the KV
rows of the q-empty sequence read sentinel x group size.
"""

from __future__ import annotations

import pytest
import torch

import te_gqa_fix
from te_gqa_fix.rules import CUDNN_FIXED
from te_gqa_fix.wrapper import unwrap, wrapper_for
from thd import (
    compare,
    corrupted,
    exact,
    poison_allocator,
    random_inputs,
    references,
    seed_batch,
    te_backward,
    te_forward,
)

pytestmark = pytest.mark.gpu

SENTINEL = 1000.0


def _run(fn, second_call: bool, poison: bool):
    batch = seed_batch(second_call=second_call)
    random_inputs(batch, seed=1 + int(second_call))
    te_forward(batch)
    if poison:
        poison_allocator(SENTINEL)
    out = te_backward(batch, fn=fn)
    torch.cuda.synchronize()
    return batch, out


def test_seed_unpatched_shows_bug_where_affected(te, cudnn, affected, record):
    from transformer_engine.pytorch.cpp_extensions import fused_attn

    original = unwrap(fused_attn.fused_attn_bwd)
    _run(original, second_call=False, poison=False)  # the report's first call
    batch, out = _run(original, second_call=True, poison=True)
    res = compare(batch, out, references(batch))
    rows = torch.cat([out[1][0:4].flatten(), out[2][0:4].flatten()]).float()
    record(
        cudnn=".".join(map(str, cudnn)),
        affected=affected,
        patched=False,
        rows0_3_max=rows.abs().max().item(),
        corrupted=corrupted(res),
        **res,
    )
    if affected:
        # The seed's workspace is small (< 1 MiB), so it comes from the allocator's small
        # pool rather than the poisoned 1 GiB block: what it holds is stale, not the
        # sentinel (8.95 on the H200). The sweep's larger shapes read sentinel x group.
        assert corrupted(res), "expected stale workspace in rows 0-3 on an affected stack"
    elif cudnn >= CUDNN_FIXED:
        assert not corrupted(res), "cuDNN >= 9.18 should not show the bug"


@pytest.mark.parametrize("second_call", [False, True])
def test_seed_patched_is_exact(te, cudnn, second_call, record):
    wrapper = wrapper_for(unwrap(te.cpp_extensions.fused_attn.fused_attn_bwd))
    _run(wrapper, second_call=False, poison=True)
    batch, out = _run(wrapper, second_call=second_call, poison=True)
    res = compare(batch, out, references(batch))
    record(cudnn=".".join(map(str, cudnn)), patched=True, second_call=second_call, **res)
    if second_call:
        assert torch.count_nonzero(out[1][0:4]) == 0
        assert torch.count_nonzero(out[2][0:4]) == 0
    assert exact(res), res


def test_seed_drop_in_is_exact(te, cudnn, record):
    """``te_gqa_fix.fused_attn_bwd`` itself (no patch), the way a framework would call it."""
    batch, out = _run(te_gqa_fix.fused_attn_bwd, second_call=True, poison=True)
    res = compare(batch, out, references(batch))
    record(cudnn=".".join(map(str, cudnn)), patched="drop-in", **res)
    assert exact(res), res
