"""Fake context parallelism: gather the full batch, compute exactly, keep this rank's rows.

``fused_attn_bwd`` is imported by name, as TE's ``context_parallel.py`` does, so
``te_gqa_fix.install()`` must rebind it here for the post-pass to run.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_bwd


def get_thd_partitioned_indices(
    cu_seqlens_padded: torch.Tensor,
    total_tokens: int,
    cp_size: int,
    cp_rank: int,
    device: Optional[torch.device] = None,
    load_balancing_strategy: Any = None,
) -> torch.Tensor:
    """DualChunkSwap rows of ``cp_rank`` (int32, like TE's kernel)."""
    starts = cu_seqlens_padded.tolist()
    assert starts[-1] == total_tokens
    rows: List[int] = []
    for s, e in zip(starts[:-1], starts[1:]):
        c = (e - s) // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            rows.extend(range(s + chunk * c, s + (chunk + 1) * c))
    return torch.tensor(rows, dtype=torch.int32, device=device or cu_seqlens_padded.device)


def _exact(q, k, v, cu: Sequence[int], pad: Sequence[int], scale: float) -> torch.Tensor:
    """fp32 causal attention per sequence; padding rows of the output are 0."""
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    pieces = []
    for b in range(len(cu) - 1):
        n, s = cu[b + 1] - cu[b], pad[b]
        if n == 0:
            continue
        qb = q[s : s + n].float().transpose(0, 1)
        kb = k[s : s + n].float().repeat_interleave(g, 1).transpose(0, 1)
        vb = v[s : s + n].float().repeat_interleave(g, 1).transpose(0, 1)
        scores = (qb @ kb.transpose(-1, -2)) * scale
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        ob = torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ vb
        pieces.append((s, n, ob.transpose(0, 1)))
    for s, n, ob in pieces:
        out = out.index_copy(0, torch.arange(s, s + n, device=q.device), ob)
    return out


def _gather_full(x: torch.Tensor, idx: List[torch.Tensor], group, total: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in idx]
    dist.all_gather(parts, x.contiguous(), group=group)
    full = torch.zeros((total, *x.shape[1:]), dtype=x.dtype, device=x.device)
    for r, part in enumerate(parts):
        full.index_copy_(0, idx[r].long(), part)
    return full


def _local_offsets(cu: Sequence[int], pad: Sequence[int], cp: int, rank: int):
    lens, plens = [], []
    for b in range(len(cu) - 1):
        n, p = cu[b + 1] - cu[b], pad[b + 1] - pad[b]
        c = p // (2 * cp)
        mine = 0
        for chunk in (rank, 2 * cp - 1 - rank):
            mine += min(max(n - chunk * c, 0), c)
        lens.append(mine)
        plens.append(p // cp)
    acc = [0]
    for n in lens:
        acc.append(acc[-1] + n)
    pacc = [0]
    for p in plens:
        pacc.append(pacc[-1] + p)
    return acc, pacc


class FakeAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta: Dict[str, Any]):
        cu, pad = meta["cu"], meta["pad"]
        group, cp, rank = meta["group"], meta["cp"], meta["rank"]
        if cp > 1:
            cu_pad_t = torch.tensor(pad, dtype=torch.int32)
            idx = [get_thd_partitioned_indices(cu_pad_t, pad[-1], cp, r) for r in range(cp)]
            fq, fk, fv = (_gather_full(x, idx, group, pad[-1]) for x in (q, k, v))
            out = _exact(fq, fk, fv, cu, pad, meta["scale"]).index_select(0, idx[rank].long())
        else:
            idx = None
            out = _exact(q, k, v, cu, pad, meta["scale"])
        ctx.save_for_backward(q, k, v)
        ctx.meta, ctx.idx = meta, idx
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        meta, idx = ctx.meta, ctx.idx
        cu, pad, cp, rank = meta["cu"], meta["pad"], meta["cp"], meta["rank"]
        total = pad[-1]
        if cp > 1:
            fq, fk, fv, fdo = (_gather_full(x, idx, meta["group"], total) for x in (q, k, v, dout))
        else:
            fq, fk, fv, fdo = q, k, v, dout
        with torch.enable_grad():
            xs = [x.detach().float().requires_grad_() for x in (fq, fk, fv)]
            out = _exact(*xs, cu, pad, meta["scale"])
            grads = torch.autograd.grad(out, xs, fdo.float())
        if cp > 1:
            mine = idx[rank].long()
            grads = [g.index_select(0, mine) for g in grads]
            lcu, lpad = _local_offsets(cu, pad, cp, rank)
        else:
            lcu, lpad = list(cu), list(pad)
        dev = q.device
        dq, dk, dv, *_ = fused_attn_bwd(
            max(b - a for a, b in zip(lpad[:-1], lpad[1:])),
            max(b - a for a, b in zip(lpad[:-1], lpad[1:])),
            torch.tensor(lcu, dtype=torch.int32, device=dev),
            torch.tensor(lcu, dtype=torch.int32, device=dev),
            q,
            k,
            v,
            None,
            dout,
            q.dtype,
            [g.to(q.dtype) for g in grads],
            1,
            cu_seqlens_q_padded=torch.tensor(lpad, dtype=torch.int32, device=dev),
            cu_seqlens_kv_padded=torch.tensor(lpad, dtype=torch.int32, device=dev),
            attn_scale=meta["scale"],
            qkv_layout="thd_thd_thd",
            o_format="thd",
            do_format="thd",
            dqkv_layout="thd_thd_thd",
            attn_mask_type="padding_causal",
            window_size=(-1, 0),
            bottom_right_diagonal=False,
        )
        return dq, dk, dv, None
