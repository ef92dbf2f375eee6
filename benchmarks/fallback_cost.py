#!/usr/bin/env python3
"""What the exact fallback costs next to TE's own backward: head dim 256, GQA 16/4, bf16,
8 packed causal sequences (padding_causal) at 8K and 32K tokens.

Rows, each a ratio to TE's ``fused_attn_bwd`` (deterministic=False) in the same run: TE with
deterministic=True; the fallback (``fallback.exact_backward``, fed TE's ``out`` and softmax
statistics) with one offsets tensor for q and kv (self-attention: one FlashAttention-2
backward) and with two (the top-left causal split into two calls, as TE's context-parallel
steps pass them), each not deterministic and deterministic; and the fallback recomputing
the forward (statistics of an unknown layout). CUDA events around each call after a warm-up;
medians over ``--reps``. A row that runs out of memory is recorded with its error.

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
        det = {n: dict(c, deterministic=True) for n, c in (("one", one), ("two", two))}
        recompute = dict(one, aux_ctx_tensors=[])  # statistics of no known layout
        variants = {
            "te": lambda c=two: te_fn(**c),
            "te_deterministic": lambda c=det["two"]: te_fn(**c),
            "fallback": lambda c=one: fallback.exact_backward(c),
            "fallback_deterministic": lambda c=det["one"]: fallback.exact_backward(c),
            "fallback_split": lambda c=two: fallback.exact_backward(c),
            "fallback_split_deterministic": lambda c=det["two"]: fallback.exact_backward(c),
            "fallback_recompute": lambda c=recompute: fallback.exact_backward(c),
        }
        base = None
        for variant, fn in variants.items():
            row = dict(workload=name, tokens=tokens, heads=list(HEADS), head_dim=D, nseq=NSEQ,
                       variant=variant)  # fmt: skip
            try:
                ms = timed(fn, args.reps)
                if variant.endswith("deterministic"):
                    a, b = fn(), fn()
                    row["bitwise_repeatable"] = all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
            except torch.OutOfMemoryError as exc:
                row["error"] = f"out of memory: {str(exc)[:80]}"
                torch.cuda.empty_cache()
                rows.append(row)
                continue
            base = ms if base is None else base
            rows.append(dict(row, ms=ms, x_te=ms / base))
        del batch, one, two, det, recompute, variants
        torch.cuda.empty_cache()
    meta = metadata()
    write(args.out, {"bench": "fallback", **meta, "rows": rows})
    print(f"cuDNN TE runs: {meta['stack'].get('cudnn_te')}")
    print(f"{'workload':8} {'variant':30} {'ms':>8} {'x TE':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:8} {r['variant']:30} {r['error']}")
        else:
            print(f"{r['workload']:8} {r['variant']:30} {r['ms']:8.3f} {r['x_te']:6.2f}")


if __name__ == "__main__":
    main()
