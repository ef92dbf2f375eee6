"""One context-parallel training step (THD + GQA) with te-gqa-fix installed.

    torchrun --nproc-per-node 2 examples/context_parallel.py     # any number of GPUs >= 2

Context parallelism splits every packed sequence across the CP ranks, so each attention
step sees sequences with no query tokens: exactly where cuDNN < 9.18 on Hopper sums stale
workspace into dK/dV (TE #2186). The fix is one call at start-up, before the model is
built, as a Megatron-Core training script would place it next to its other initialisation:
every TE call site of ``fused_attn_bwd`` (the P2P ring, all-gather and A2A paths included)
then goes through the wrapper. Nothing else in the training code changes.

Exit status 2 (one line on stderr naming it) where two CUDA GPUs, Transformer Engine or
torchrun's launch are missing.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import List

import torch
import torch.distributed as dist

import te_gqa_fix


def missing() -> List[str]:
    """What this example needs that this machine (or this launch) lacks."""
    out = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        out.append(f"two or more CUDA GPUs (found {gpus})")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # not installed, or a broken build
        out.append(f"Transformer Engine ({type(exc).__name__}: {' '.join(str(exc).split())})")
    if "LOCAL_RANK" not in os.environ:
        out.append("a torchrun launch (torchrun --nproc-per-node 2 examples/context_parallel.py)")
    return out


def main() -> int:
    lacking = missing()
    if lacking:
        print(f"context_parallel: needs {'; '.join(lacking)}", file=sys.stderr)
        return 2
    te_gqa_fix.install()  # once, at start-up, before any model is built

    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.dot_product_attention.context_parallel import (
        get_thd_partitioned_indices,
    )

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    cp_size, rank = dist.get_world_size(), dist.get_rank()  # from the launcher
    cp_ranks = list(range(cp_size))
    cp_group = dist.new_group(cp_ranks, backend="nccl")

    # The model: QKV projection, TE attention (THD, GQA 8/2) with CP, output projection.
    heads, groups, head_dim = 8, 2, 128
    hidden, dtype = heads * head_dim, torch.bfloat16
    qkv_proj = torch.nn.Linear(hidden, (heads + 2 * groups) * head_dim, bias=False)
    out_proj = torch.nn.Linear(hidden, hidden, bias=False)
    params = [*qkv_proj.to("cuda", dtype).parameters(), *out_proj.to("cuda", dtype).parameters()]
    for p in params:
        dist.broadcast(p.data, src=0)  # replicated weights across the CP group
    attn = te.DotProductAttention(
        heads, head_dim, num_gqa_groups=groups, qkv_format="thd", attn_mask_type="padding_causal"
    )
    attn.set_context_parallel_group(cp_group, cp_ranks, torch.cuda.Stream(), "p2p")
    opt = torch.optim.SGD(params, lr=1e-2)

    # A packed batch (TE #2186's lengths), each sequence padded to a multiple of 2 * cp_size.
    seqlens = [9, 8, 8, 12, 8, 12]
    padded = [-(-n // (2 * cp_size)) * (2 * cp_size) for n in seqlens]
    cu = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32, device="cuda")
    cu_padded = torch.tensor([0, *itertools.accumulate(padded)], dtype=torch.int32, device="cuda")
    total, n_tokens = sum(padded), sum(seqlens)
    gen = torch.Generator(device="cuda").manual_seed(0)  # the same batch on every rank
    x = torch.randn(total, hidden, device="cuda", dtype=dtype, generator=gen)
    target = torch.randn(total, hidden, device="cuda", dtype=dtype, generator=gen)
    real = torch.zeros(total, dtype=torch.bool, device="cuda")  # False on padding tokens
    for start, n in zip([0, *itertools.accumulate(padded)], seqlens):
        real[start : start + n] = True

    # This rank's tokens, split by TE's own THD partitioning (DualChunkSwap).
    mine = get_thd_partitioned_indices(cu_padded, total, cp_size, rank).long()
    x, target, real = x[mine], target[mine], real[mine]

    # One step. cu_seqlens* and max_seqlen* describe the global batch, as TE expects.
    q, k, v = qkv_proj(x).split([heads * head_dim, groups * head_dim, groups * head_dim], -1)
    q = q.reshape(-1, heads, head_dim).contiguous()
    k = k.reshape(-1, groups, head_dim).contiguous()
    v = v.reshape(-1, groups, head_dim).contiguous()
    ctx = attn(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    ctx = ctx.masked_fill(~real[:, None], 0.0)  # padding tokens carry nothing forward
    err = (out_proj(ctx).float() - target.float()).masked_fill(~real[:, None], 0.0)
    loss = err.square().sum() / (n_tokens * hidden)  # this rank's share of the global mean
    loss.backward()
    for p in params:
        dist.all_reduce(p.grad, group=cp_group)  # each CP rank saw different tokens
    opt.step()
    opt.zero_grad(set_to_none=True)

    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss, group=cp_group)
    counts = te_gqa_fix.call_counts()
    if rank == 0:
        # fixed > 0: TE's cuDNN backward ran and its zero-gradient rows were zeroed; skipped:
        # the cuDNN is fixed and the wrapper passed through; 0 calls: another TE backend ran.
        print(
            f"cp_size={cp_size} loss={total_loss.item():.4f} "
            f"cuDNN={'.'.join(map(str, te.get_cudnn_version()))} te-gqa-fix calls: "
            f"fixed {counts['fixed']}, skipped {counts['skipped']} of {counts['calls']}"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
