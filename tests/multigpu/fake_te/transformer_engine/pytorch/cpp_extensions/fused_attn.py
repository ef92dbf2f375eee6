"""Fake ``fused_attn_bwd`` with TE 2.20.2's signature (argument names and order).

The "kernel" is the exact gradient, handed in through ``aux_ctx_tensors`` by the fake
attention. Like cuDNN < 9.18 on Hopper with GQA, it then adds a never-written workspace
(1000 per query head, so 1000 x group size) to dK/dV rows that no query attends: here
the padding rows of the call (``FAKE_TE_STALE=0`` turns that off). MHA stays clean.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

import torch

SENTINEL = 1000.0


def _dead_kv_rows(rows: int, cu: torch.Tensor, padded: Optional[torch.Tensor]) -> List[int]:
    starts = (padded if padded is not None else cu).tolist()
    lens = (cu[1:] - cu[:-1]).tolist()
    live = set()
    for start, n in zip(starts[:-1], lens):
        live.update(range(start, start + n))
    return [r for r in range(rows) if r not in live]


def fused_attn_bwd(
    max_seqlen_q: int,
    max_seqlen_kv: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    fake_dtype: torch.dtype,
    aux_ctx_tensors: List[torch.Tensor],
    fused_attention_backend: Any,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    s_quantizer: Any = None,
    dp_quantizer: Any = None,
    dqkv_quantizer: Any = None,
    attn_scale: Optional[float] = None,
    dropout: float = 0.0,
    fast_zero_fill: bool = True,
    qkv_layout: str = "sbh3d",
    o_format: str = "sbhd",
    do_format: str = "sbhd",
    dqkv_layout: str = "sbh3d",
    qkv_scale_inv_format: Optional[str] = None,
    do_scale_inv_format: Optional[str] = None,
    attn_bias_type: str = "no_bias",
    attn_mask_type: str = "padding",
    softmax_type: str = "vanilla",
    window_size: Tuple[int, int] = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
    deterministic: bool = False,
    cuda_graph: bool = False,
) -> Tuple[Optional[torch.Tensor], ...]:
    dq, dk, dv = (t.clone() for t in aux_ctx_tensors[:3])
    group = q.shape[-2] // k.shape[-2]
    if group > 1 and os.environ.get("FAKE_TE_STALE", "1") != "0":
        dead = _dead_kv_rows(dk.shape[0], cu_seqlens_kv, cu_seqlens_kv_padded)
        if dead:
            idx = torch.tensor(dead, dtype=torch.long, device=dk.device)
            dk.index_fill_(0, idx, SENTINEL * group)
            dv.index_fill_(0, idx, SENTINEL * group)
    return dq, dk, dv, None, None
