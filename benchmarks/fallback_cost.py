#!/usr/bin/env python3
"""What the exact fallback costs next to TE's own backward: head dim 256, GQA 16/4, bf16,
8 packed causal sequences (padding_causal) at 8K and 32K tokens.

Rows: TE's ``fused_attn_bwd`` on whatever cuDNN TE loads; ``fallback.exact_backward`` with
one offsets tensor for q and kv (self-attention: one FlashAttention-2 forward + backward),
and with two offsets tensors (top-left causal split in two calls, as TE's context-parallel
steps pass them). CUDA events around each call after a warm-up; medians over ``--reps``.

    python3 benchmarks/fallback_cost.py --out fallback_cost.json [--reps 20]
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List

import torch
from common import event_ms, median, metadata, write

from te_gqa_fix import fallback, patch
from te_gqa_fix.testing import make_batch, random_inputs, te_call, te_forward

WORKLOADS = {"8k": 8192, "32k": 32768}
HEADS, D, NSEQ = (16, 4), 256, 8


def timed(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return median([event_ms(fn) for _ in range(reps)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    te_fn = patch.find_original()
    rows: List[Dict[str, Any]] = []
    for name, tokens in WORKLOADS.items():
        n = tokens // NSEQ
        batch = make_batch(
            [n] * NSEQ, [n] * NSEQ, heads_q=HEADS[0], heads_kv=HEADS[1], head_dim=D,
            dtype=torch.bfloat16, mask="padding_causal",
        )  # fmt: skip
        random_inputs(batch, seed=0)
        te_forward(batch)
        two = te_call(batch)  # separate q and kv offsets tensors
        one = dict(two, cu_seqlens_kv=two["cu_seqlens_q"])
        one["cu_seqlens_kv_padded"] = one["cu_seqlens_q_padded"]
        for call in (one, two):
            assert fallback.why_not(call) is None, fallback.why_not(call)
        variants = {
            "te_fused_attn_bwd": lambda c=two: te_fn(**c),
            "fallback_recompute": lambda c=one: fallback.exact_backward(c),
            "fallback_split_two_calls": lambda c=two: fallback.exact_backward(c),
        }
        base = None
        for variant, fn in variants.items():
            ms = timed(fn, args.reps)
            base = ms if base is None else base
            rows.append(
                dict(workload=name, tokens=tokens, heads=list(HEADS), head_dim=D, nseq=NSEQ,
                     variant=variant, ms=ms, x_te=ms / base)
            )  # fmt: skip
        del batch, one, two, variants
        torch.cuda.empty_cache()
    meta = metadata()
    write(args.out, {"bench": "fallback", **meta, "rows": rows})
    print(f"cuDNN TE runs: {meta['stack'].get('cudnn_te')}")
    print(f"{'workload':8} {'variant':26} {'ms':>8} {'x TE':>6}")
    for r in rows:
        print(f"{r['workload']:8} {r['variant']:26} {r['ms']:8.3f} {r['x_te']:6.2f}")


if __name__ == "__main__":
    main()
