"""Head dims above 128, where cuDNN < 9.18 on Hopper is wrong on live rows too.

``test_rule_matches_te`` measures TE's own backward (plus the post-pass) at each head dim and
checks the rule (``te_gqa_fix.rules.judge``) against it: exact exactly where the rule does
not say ``live_rows_wrong``. Through the wrapper every case must be exact: the post-pass where it repairs,
the exact fallback where the rule says it cannot, and on a fixed cuDNN TE itself.
"""

from __future__ import annotations

import logging

import pytest
import torch

import te_gqa_fix
from te_gqa_fix import rules
from te_gqa_fix.wrapper import unwrap, wrapper_for
from thd import (
    compare,
    exact,
    large_head_dim_batch,
    poison_allocator,
    random_inputs,
    references,
    te_backward,
    te_forward,
)

pytestmark = pytest.mark.gpu

#: (q/k head dim, v head dim): the measured table behind te_gqa_fix.rules.MEASURED.
SURVEY = [(160, 160), (192, 192), (224, 224), (256, 256), (192, 128), (256, 128), (128, 128)]
HEADS = [(8, 8), (8, 2), (8, 1)]


def _wrong_on_live_rows(capability, cudnn, d_qk: int, d_v: int) -> bool:
    """The rule says TE is wrong on rows that receive attention: no post-pass repairs it."""
    return rules.judge(capability, cudnn, d_qk, d_v).status == "live_rows_wrong"


def _case(te, dims, heads, seed):
    batch = large_head_dim_batch(dims[0], heads, head_dim_v=dims[1])
    random_inputs(batch, seed=seed)
    te_forward(batch)
    return batch, unwrap(te.cpp_extensions.fused_attn.fused_attn_bwd)


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dims", SURVEY, ids=[f"{a}-{b}" for a, b in SURVEY])
def test_rule_matches_te(te, capability, cudnn, dims, heads, record):
    """TE's backward + the post-pass, after a poisoned block: exact iff the rule says so."""
    batch, original = _case(te, dims, heads, seed=sum(dims) + heads[1])
    poison_allocator(1000.0)
    out = te_backward(batch, fn=original)
    te_gqa_fix.zero_dead_rows(
        out[0], out[1], out[2], **batch.offsets("cuda"), attn_mask_type=batch.mask
    )
    res = compare(batch, out, references(batch))
    status = rules.judge(capability, cudnn, *dims).status
    record(cudnn=".".join(map(str, cudnn)), d=dims[0], d_v=dims[1], heads=f"{heads[0]}/{heads[1]}",
           status=status, te_exact=exact(res), **res)  # fmt: skip
    assert exact(res) == (status != "live_rows_wrong"), (status, res)


@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dims", SURVEY, ids=[f"{a}-{b}" for a, b in SURVEY])
def test_wrapper_exact(te, capability, cudnn, dims, heads, record):
    """Through the wrapper, default settings: exact everywhere; the fallback runs exactly
    where the rule says the post-pass cannot repair."""
    batch, original = _case(te, dims, heads, seed=sum(dims) * 3 + heads[1])
    wrapper = wrapper_for(original)
    te_gqa_fix.reset_call_counts()
    poison_allocator(1000.0)
    res = compare(batch, te_backward(batch, fn=wrapper), references(batch))
    counts = te_gqa_fix.call_counts()
    unrepairable = _wrong_on_live_rows(capability, cudnn, *dims)
    record(cudnn=".".join(map(str, cudnn)), d=dims[0], d_v=dims[1], heads=f"{heads[0]}/{heads[1]}",
           fallback=counts["fallback"], exact=exact(res), **res)  # fmt: skip
    assert counts["fallback"] == int(unrepairable), counts
    assert exact(res), res


@pytest.mark.parametrize("mode", ["warn", "strict", "fallback"])
def test_guard_modes(te, capability, cudnn, mode, monkeypatch, caplog, record):
    """d 256 GQA: ``warn`` says so once and returns TE's result, ``strict`` raises,
    ``fallback`` logs once that it computes exactly; nothing at all on a cuDNN measured
    right there."""
    monkeypatch.setenv("TE_GQA_FIX_GUARD", mode)
    batch, original = _case(te, (256, 256), (8, 2), seed=7)
    wrapper = wrapper_for(original)
    expected = _wrong_on_live_rows(capability, cudnn, 256, 256)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        if mode == "strict" and expected:
            with pytest.raises(te_gqa_fix.UnrepairableConfiguration, match="head dim 256"):
                te_backward(batch, fn=wrapper)
            return
        te_backward(batch, fn=wrapper)
        te_backward(batch, fn=wrapper)
    torch.cuda.synchronize()
    hits = [r.getMessage() for r in caplog.records if "cannot repair" in r.getMessage()]
    record(cudnn=".".join(map(str, cudnn)), mode=mode, warned=len(hits), expected=expected)
    assert len(hits) == (1 if expected and mode != "strict" else 0), hits
    if hits:
        assert "TE_GQA_FIX_CUDNN=auto" in hits[0], hits[0]
        assert ("FlashAttention-2" in hits[0]) == (mode == "fallback"), hits[0]


@pytest.mark.parametrize("dims", [(256, 256), (256, 128)], ids=["256", "256-128"])
def test_wrapper_exact_with_the_torch_post_pass(te, capability, cudnn, dims, monkeypatch, record):
    """The same through the PyTorch post-pass (as after a kernel failure): still exact."""
    from te_gqa_fix import postpass

    monkeypatch.setattr(postpass, "_no_kernel", "the Triton kernel failed (forced by the test)")
    batch, original = _case(te, dims, (8, 2), seed=11)
    te_gqa_fix.reset_call_counts()
    poison_allocator(float("nan"))
    res = compare(batch, te_backward(batch, fn=wrapper_for(original)), references(batch))
    record(cudnn=".".join(map(str, cudnn)), d=dims[0], d_v=dims[1], exact=exact(res), **res)
    assert exact(res), res
