"""The context-parallel part of the fake TE (``te_package.write_fake_te(context_parallel=True)``).

TE 2.20.2's names where ``cp_check.py`` and te-gqa-fix touch them: ``DotProductAttention``
(constructor, ``set_context_parallel_group``, THD forward), ``_attention_backends`` and
``get_thd_partitioned_indices`` (DualChunkSwap). The attention gathers the full batch from
the CP group, computes it exactly with ``te_gqa_fix.testing.reference_attention`` (the one
fp32 reference), keeps this rank's rows, and hands its gradients to ``fused_attn_bwd`` as
bound in TE's ``context_parallel`` module, so ``te_gqa_fix.install()`` must rebind it there
for the post-pass to run. It says nothing about the real TE.
"""

from __future__ import annotations

import math
import sys
from itertools import accumulate
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from thd import ThdBatch, reference_attention

from .te_package import CONSUMERS, Precomputed

_attention_backends: Dict[str, Any] = {
    "attention_params": None,
    "use_flash_attention": None,
    "flash_attention_backend": None,
    "use_fused_attention": None,
    "fused_attention_backend": None,
    "use_unfused_attention": None,
    "backend_selection_requires_update": False,
}


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


def _exact(q, k, v, d_o, cu: Sequence[int], pad: Sequence[int]) -> Dict[str, torch.Tensor]:
    """fp32 causal attention (self-attention, top-left) and its gradients; ``d_o`` None:
    the output alone (the forward's)."""
    tensors = {"q": q, "k": k, "v": v, "d_o": torch.zeros_like(q) if d_o is None else d_o}
    batch = ThdBatch.of_tensors(tensors, cu, cu, pad, pad, mask="padding_causal")
    with torch.enable_grad():
        return reference_attention(batch, torch.float32, str(q.device), grads=d_o is not None)


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
    return [0, *accumulate(lens)], [0, *accumulate(plens)]


class FakeAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta: Dict[str, Any]):
        cu, pad = meta["cu"], meta["pad"]
        group, cp, rank = meta["group"], meta["cp"], meta["rank"]
        if cp > 1:
            cu_pad_t = torch.tensor(pad, dtype=torch.int32)
            idx = [get_thd_partitioned_indices(cu_pad_t, pad[-1], cp, r) for r in range(cp)]
            fq, fk, fv = (_gather_full(x, idx, group, pad[-1]) for x in (q, k, v))
            out = _exact(fq, fk, fv, None, cu, pad)["o"]
            out = out.index_select(0, idx[rank].long())
        else:
            idx = None
            out = _exact(q, k, v, None, cu, pad)["o"]
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
        ref = _exact(fq, fk, fv, fdo, cu, pad)
        grads = [ref["dq"], ref["dk"], ref["dv"]]
        if cp > 1:
            mine = idx[rank].long()
            grads = [g.index_select(0, mine) for g in grads]
            lcu, lpad = _local_offsets(cu, pad, cp, rank)
        else:
            lcu, lpad = list(cu), list(pad)
        dev = q.device
        max_len = max(b - a for a, b in zip(lpad[:-1], lpad[1:]))
        # as TE's context_parallel.py does: the name bound in that module at call time
        fused_attn_bwd = sys.modules[CONSUMERS["context_parallel"]].fused_attn_bwd
        dq, dk, dv, *_ = fused_attn_bwd(
            max_len,
            max_len,
            torch.tensor(lcu, dtype=torch.int32, device=dev),
            torch.tensor(lcu, dtype=torch.int32, device=dev),
            q,
            k,
            v,
            None,
            dout,
            q.dtype,
            Precomputed(g.to(q.dtype) for g in grads),
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


class DotProductAttention(torch.nn.Module):
    """TE 2.20.2's constructor/forward names for THD + CP."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        num_gqa_groups: Optional[int] = None,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.kv_channels = kv_channels
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.cp_group = None
        self.cp_comm_type = "p2p"

    def set_context_parallel_group(
        self,
        cp_group: Any,
        cp_global_ranks: List[int],
        cp_stream: Any,
        cp_comm_type: str = "p2p",
        load_balancing_strategy: Any = None,
    ) -> None:
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_comm_type = cp_comm_type

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert self.qkv_format == "thd" and "padding" in self.attn_mask_type
        assert query_layer.shape[-2] == self.num_attention_heads
        assert key_layer.shape[-2] == self.num_gqa_groups
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_kv.dtype == torch.int32
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        rank = dist.get_rank(self.cp_group) if self.cp_group is not None else 0
        if cp > 1 and self.cp_comm_type == "a2a":
            assert self.num_attention_heads % cp == 0 and self.num_gqa_groups % cp == 0, (
                "cp_comm_type='a2a' requires num_heads % cp_size == 0 for Q, K, V."
            )
        pad = (cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q).tolist()
        assert max_seqlen_q >= max(b - a for a, b in zip(pad[:-1], pad[1:]))
        if cp > 1:
            assert all((b - a) % (2 * cp) == 0 for a, b in zip(pad[:-1], pad[1:]))
            assert query_layer.shape[0] * cp == pad[-1]
        _attention_backends.update(use_fused_attention=True, fused_attention_backend=1)
        meta = {
            "cu": cu_seqlens_q.tolist(),
            "pad": pad,
            "group": self.cp_group,
            "cp": cp,
            "rank": rank,
            "scale": 1.0 / math.sqrt(self.kv_channels),
        }
        out = FakeAttnFunc.apply(query_layer, key_layer, value_layer, meta)
        return out.view(out.shape[0], -1)
