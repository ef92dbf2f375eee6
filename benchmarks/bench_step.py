#!/usr/bin/env python3
"""What te-gqa-fix adds to a training step: TE's DotProductAttention forward + backward.

THD + GQA (32 query heads, 8 KV heads, d 128, bf16, padding_causal, cuDNN backend), a packed
batch of 8 sequences with padding, at each size. Patched (``te_gqa_fix.install()``) and
unpatched blocks alternate in one process; each step is timed with CUDA events (then a
sync), after warm-up steps. The added time is the median over block pairs of (patched
block's median - unpatched block's median), also as a % of the unpatched step.

    python3 benchmarks/bench_step.py --out step.json [--tokens 2048,8192,32768]
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional

import torch
from common import cumsum, event_ms, median, metadata, packed, write

import te_gqa_fix
from te_gqa_fix.wrapper import call_counts

HEADS, GROUPS, D = 32, 8, 128


def block(step, patched: bool, steps: int, warmup: int) -> Dict[str, Any]:
    """``warmup`` + ``steps`` steps with the fix installed or not: the timed steps' median
    (ms) and the wrapper's call counts over the block."""
    (te_gqa_fix.install if patched else te_gqa_fix.uninstall)()
    before = call_counts()
    for _ in range(warmup):
        step()
    times = [event_ms(step) for _ in range(steps)]
    return {"ms": median(times), "calls": {k: v - before[k] for k, v in call_counts().items()}}


def run_size(te: Any, tokens: int, args: argparse.Namespace) -> Dict[str, Any]:
    batch = packed(tokens, q_empty=(), half=())  # self-attention: queries = keys
    i32 = dict(dtype=torch.int32, device="cuda")
    cu = torch.tensor(cumsum(batch["lk"]), **i32)
    pad = torch.tensor(batch["pad"], **i32)
    max_s = max(b - a for a, b in zip(batch["pad"], batch["pad"][1:]))
    dpa = te.DotProductAttention(
        HEADS, D, num_gqa_groups=GROUPS, qkv_format="thd", attn_mask_type="padding_causal",
        attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    q = torch.randn(tokens, HEADS, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (
        torch.randn(tokens, GROUPS, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        for _ in range(2)
    )
    d_out = torch.randn(tokens, HEADS * D, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        q.grad = k.grad = v.grad = None
        out = dpa(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=pad,
            cu_seqlens_kv_padded=pad,
            max_seqlen_q=max_s,
            max_seqlen_kv=max_s,
        )
        out.backward(d_out.view(out.shape))

    pairs = []
    for r in range(args.blocks):
        order = (True, False) if r % 2 else (False, True)  # alternate which block runs first
        res = {p: block(step, p, args.steps, args.warmup) for p in order}
        pairs.append(res)
    te_gqa_fix.uninstall()
    diffs = [p[True]["ms"] - p[False]["ms"] for p in pairs]
    step_ms = median([p[False]["ms"] for p in pairs])
    added_us = median(diffs) * 1e3
    total = {
        p: {k: sum(x[p]["calls"][k] for x in pairs) for k in pairs[0][p]["calls"]}
        for p in (False, True)
    }
    return {
        "tokens": tokens,
        "step_ms": step_ms,
        "step_ms_patched": median([p[True]["ms"] for p in pairs]),
        "added_us": added_us,
        "added_pct": 100 * added_us / (step_ms * 1e3),
        "added_us_range": [min(diffs) * 1e3, max(diffs) * 1e3],
        "calls_patched": total[True],
        "calls_unpatched": total[False],
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="step.json", help="the JSON file to write")
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--blocks", type=int, default=30, help="block pairs per size")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per block")
    args = ap.parse_args(argv)
    import transformer_engine.pytorch as te

    doc = {
        "bench": "step",
        **metadata(),
        "config": {
            "heads": f"{HEADS}/{GROUPS}",
            "d": D,
            "dtype": "bf16",
            "mask": "padding_causal",
            **{k: getattr(args, k) for k in ("blocks", "steps", "warmup")},
        },
        "rows": [],
    }
    for tokens in map(int, args.tokens.split(",")):
        row = run_size(te, tokens, args)
        doc["rows"].append(row)
        print(
            f"{tokens} tokens: step {row['step_ms']:.3f} ms, added {row['added_us']:+.1f} us "
            f"({row['added_pct']:+.2f}%), wrapper {row['calls_patched']}"
        )
        torch.cuda.empty_cache()
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
