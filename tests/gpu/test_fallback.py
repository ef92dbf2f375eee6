"""The exact fallback on the GPU: ``fallback.exact_backward`` called directly on TE-shaped THD
input (the arguments TE's ``fused_attn_bwd`` binds, TE's forward output and statistics among
them), then the post-pass, against fp32 with the repository's tolerance rule, at head dims
192, 256 and 256/128 where cuDNN is wrong on live rows; ``deterministic`` both ways (True:
two calls bitwise equal). Also one CUDA-graph capture and replay, the forward recompute for
statistics of an unknown layout, and a declined call raising through the wrapper."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch

from te_gqa_fix import UnrepairableConfiguration, fallback, rules
from te_gqa_fix._te import FallbackArgs
from te_gqa_fix.postpass import zero_dead_rows
from thd import (
    ThdBatch,
    compare,
    dead_masks,
    exact,
    live_q_rows,
    make_batch,
    random_inputs,
    references,
    te_backward,
    te_call,
    te_forward,
)

pytestmark = pytest.mark.gpu

# Zero-length sequences on both sides, padding between sequences, lead and tail rows.
LQ, LK = [40, 0, 64, 30, 7, 33], [48, 30, 0, 12, 64, 33]
GAPS = dict(gap_q=[2, 0, 4, 1, 0, 3], gap_kv=[0, 2, 0, 4, 5, 3], lead=5, tail=3)
SELF = [40, 0, 64, 20, 33]  # self-attention: one offsets tensor for q and kv
SELF_GAPS = dict(gap_q=[2, 0, 4, 1, 3], gap_kv=[2, 0, 4, 1, 3], lead=5, tail=3)
CASES = {  # name -> (mask, window, self-attention)
    "padding": ("padding", (-1, -1), False),
    "causal": ("padding_causal", (-1, 0), False),  # top-left, lq != lk: the two-call split
    "causal_br": ("padding_causal_bottom_right", (-1, 0), False),
    "window_br": ("padding_causal_bottom_right", (16, 0), False),
    "window_self": ("padding_causal", (16, 0), True),  # top-left window, one offsets tensor
}
HEADS = {"gqa": (8, 2), "mqa": (8, 1), "mha": (8, 8)}


DIMS = {"192": (192, 192), "256": (256, 256), "256-128": (256, 128)}


def _batch(case: str, heads, dims, seed: int = 0) -> ThdBatch:
    mask, window, one = CASES[case]
    lq, lk, gaps = (SELF, SELF, SELF_GAPS) if one else (LQ, LK, GAPS)
    batch = make_batch(
        lq, lk, heads_q=heads[0], heads_kv=heads[1], head_dim=dims[0], head_dim_v=dims[1],
        dtype=torch.bfloat16, mask=mask, window=window, **gaps,
    )  # fmt: skip
    random_inputs(batch, seed=seed)
    try:
        te_forward(batch)  # the fallback takes its output and softmax statistics
    except Exception as exc:
        pytest.skip(f"TE's forward refuses this configuration: {exc}")
    return batch


def _declined(call: Dict[str, Any]) -> Optional[str]:
    """Why the fallback declines this call (None: it serves it), as the wrapper asks."""
    recipe = fallback.decide(
        FallbackArgs(**{name: call.get(name) for name in FallbackArgs._fields}),
        "bottom_right_diagonal" in call,
    )
    return recipe if isinstance(recipe, str) else None


def _self_attention(call: Dict[str, Any]) -> None:
    """One offsets tensor for q and kv, as TE gets it for self-attention."""
    call["cu_seqlens_kv"] = call["cu_seqlens_q"]
    call["cu_seqlens_kv_padded"] = call["cu_seqlens_q_padded"]


def postpass(batch: ThdBatch, call: Dict[str, Any], out: List[Any]) -> None:
    zero_dead_rows(
        out[0], out[1], out[2], call["cu_seqlens_q"], call["cu_seqlens_kv"],
        call["cu_seqlens_q_padded"], call["cu_seqlens_kv_padded"],
        attn_mask_type=batch.mask, window_size=batch.window,
        bottom_right_diagonal=batch.bottom_right_diagonal,
    )  # fmt: skip


def _check(batch: ThdBatch, call: Dict[str, Any], out: List[Any]) -> Dict[str, float]:
    postpass(batch, call, out)
    res = compare(batch, out, references(batch))
    # Queries that attend no key (no rule zeroes them) must come back 0, as their gradient.
    dead = dead_masks(batch)
    keyless = ~live_q_rows(batch).cuda() & ~dead.q
    res["dq_keyless_max"] = out[0][keyless].float().abs().max().item() if keyless.any() else 0.0
    return res


class _Counting:
    """torch's FlashAttention-2 entry points, counting the forward calls."""

    def __init__(self) -> None:
        self.forwards = 0

    def _flash_attention_forward(self, *args: Any, **kwargs: Any):
        self.forwards += 1
        return torch.ops.aten._flash_attention_forward(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch.ops.aten, name)


# (heads, variant): every head layout plainly; packed k/v and deterministic=True with GQA.
VARIANTS = [(h, "thd_thd_thd") for h in HEADS] + [("gqa", "thd_t2hd"), ("gqa", "deterministic")]


@pytest.mark.parametrize("heads, variant", VARIANTS, ids=[f"{h}-{v}" for h, v in VARIANTS])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dims", list(DIMS))
def test_exact_backward_matches_fp32(te, cudnn, dims, heads, case, variant, record, monkeypatch):
    batch = _batch(case, HEADS[heads], DIMS[dims], seed=DIMS[dims][0])
    extra: Dict[str, Any] = {"deterministic": variant == "deterministic"}
    if variant == "thd_t2hd":  # k and v as views of one packed buffer
        t = batch.tensors
        if t["k"].shape == t["v"].shape:
            t["k"], t["v"] = torch.stack((t["k"], t["v"]), 1).unbind(1)
            extra.update(qkv_layout=variant, dqkv_layout=variant)
    call = te_call(batch, **extra)
    if CASES[case][2]:
        _self_attention(call)
    assert _declined(call) is None, _declined(call)
    counting = _Counting()
    monkeypatch.setattr(fallback, "_aten", counting)
    out = fallback.exact_backward(call)
    assert counting.forwards == 0, "TE's statistics should replace the forward"
    assert len(out) == 5 and out[3] is None and out[4] is None
    if "qkv_layout" in extra:
        assert out[1]._base is out[2]._base and out[1]._base is not None
    again = [t.clone() for t in fallback.exact_backward(call)[:3]]
    bitwise = all(torch.equal(a, b) for a, b in zip(out[:3], again))
    res = _check(batch, call, out)
    try:  # context for the record: TE's own backward on this cuDNN, without the post-pass
        te_res = compare(batch, te_backward(batch, **extra), references(batch))
        theirs = dict(
            te_exact=exact(te_res), te_dq_err=te_res["dq_err"], te_dk_err=te_res["dk_err"]
        )
    except Exception as exc:
        theirs = dict(te_error=f"{type(exc).__name__}: {exc}"[:200])
    record(
        cudnn=".".join(map(str, cudnn)), d=dims, heads=heads, case=case, layout=variant,
        deterministic=extra["deterministic"], bitwise_repeatable=bitwise, exact=exact(res),
        **theirs, **res,
    )  # fmt: skip
    assert exact(res) and res["dq_keyless_max"] == 0.0, res
    if extra["deterministic"]:
        assert bitwise, "deterministic=True: two calls differ"


def test_statistics_of_another_layout_recompute_the_forward(te, record, monkeypatch):
    """TE's statistics in a layout not known (``[b, h, s, 1]`` of older cuDNN, here faked
    by a 4-D tensor): the forward is recomputed, and the result is exact."""
    batch = _batch("causal_br", HEADS["gqa"], DIMS["256"], seed=9)
    call = te_call(batch)
    call["aux_ctx_tensors"] = [
        call["aux_ctx_tensors"][0].unsqueeze(0),
        *call["aux_ctx_tensors"][1:],
    ]
    counting = _Counting()
    monkeypatch.setattr(fallback, "_aten", counting)
    out = fallback.exact_backward(call)
    res = _check(batch, call, out)
    record(forwards=counting.forwards, exact=exact(res), **res)
    assert counting.forwards == 1 and exact(res), res


def test_declined_call_raises_under_the_default_guard(te, capability, cudnn, record):
    """Where the rule says q/k 256 with v 128 is wrong (9.14, 9.19), a call with dropout,
    which the fallback cannot replay, raises under the default guard before TE runs, naming
    the reason. A cuDNN measured right there (9.27) has nothing to refuse."""
    from te_gqa_fix import fused_attn_bwd

    if rules.judge(capability, cudnn, 256, 128).status != "live_rows_wrong":
        pytest.skip("this cuDNN is measured right at q/k 256, v 128: the guard refuses nothing")
    batch = _batch("causal_br", HEADS["gqa"], DIMS["256-128"], seed=4)
    with pytest.raises(UnrepairableConfiguration, match="dropout") as err:
        te_backward(batch, fn=fused_attn_bwd, dropout=0.1)
    record(message=str(err.value)[:300])


def test_cuda_graph_capture_and_replay(te, record):
    """No host sync in an eager call (sync debug mode "error"); a captured call replays to
    the eager result (dK/dV bitwise; dQ accumulates with atomics, so within bf16)."""
    batch = _batch("causal", HEADS["gqa"], DIMS["256"], seed=3)  # the split: two calls
    call = te_call(batch)
    for _ in range(2):
        fallback.exact_backward(call)  # warm-up: kernels, allocator, cached checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = fallback.exact_backward(call)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    eager = [t.clone() for t in eager[:3]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fallback.exact_backward(call)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fallback.exact_backward(call)
    graph.replay()
    torch.cuda.synchronize()
    replay = [t.clone() for t in captured[:3]]
    for out in (eager, replay):
        postpass(batch, call, out)
    res = _check(batch, call, replay)
    same_kv = all(torch.equal(a, b) for a, b in zip(eager[1:], replay[1:]))
    dq_diff = (eager[0].float() - replay[0].float()).abs().max().item()
    record(exact=exact(res), same_dk_dv=same_kv, dq_diff=dq_diff, **res)
    assert exact(res), res
    assert same_kv
    torch.testing.assert_close(replay[0], eager[0], rtol=1.6e-2, atol=1e-3)
