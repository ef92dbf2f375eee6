"""Fake ``DotProductAttention``: TE 2.20.2's constructor/forward names for THD + CP."""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .context_parallel import FakeAttnFunc

_attention_backends = {
    "attention_params": None,
    "use_flash_attention": None,
    "flash_attention_backend": None,
    "use_fused_attention": None,
    "fused_attention_backend": None,
    "use_unfused_attention": None,
    "backend_selection_requires_update": False,
}


class DotProductAttention(torch.nn.Module):
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
