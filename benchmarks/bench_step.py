#!/usr/bin/env python3
"""What te-gqa-fix adds to a training step: TE's DotProductAttention forward + backward.

THD + GQA (32 query heads, 8 KV heads, d 128, bf16, padding_causal, cuDNN backend), a packed
batch of 8 sequences with padding, at each size, with the offsets passed two ways:

- ``one``: one offsets tensor (and one padded one) for queries and keys, as self-attention
  passes them; the wrapper leaves such a call to TE (nothing in it can need repair);
- ``two``: the keys' offsets a second tensor of the same values, so an affected stack runs
  the post-pass on every step (what any call with sequences of keys without queries costs).

Patched (``te_gqa_fix.install()``) and unpatched blocks alternate in one process, after
warm-up steps, in two modes:

- ``synced``: each step between CUDA events, then a sync (the step's own time);
- ``back-to-back``: the block's steps run with no sync between them, as a training loop runs
  them, between one pair of CUDA events: host work the GPU cannot hide shows here.

The thread runs on one CPU and Python's garbage collector runs between blocks, not inside
one, so that neither moves a block's time. The added time is the median over block pairs of
(patched block - unpatched block), with its 95% confidence interval (order statistics, no
assumption about the distribution), also as a % of the unpatched step.

    python3 benchmarks/bench_step.py --out step.json [--tokens 2048,8192,32768]
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from common import cumsum, event_ms, median, metadata, one_cpu, packed, write

import te_gqa_fix

HEADS, GROUPS, D = 32, 8, 128


MODES = ("synced", "back-to-back")
OFFSETS = ("one", "two")


def median_ci(xs: List[float]) -> Tuple[float, float]:
    """The 95% confidence interval of the median of ``xs``: the order statistics of ranks
    ``floor(n/2 - 0.98 sqrt(n))`` and ``ceil(1 + n/2 + 0.98 sqrt(n))`` (1-based; the
    binomial's normal approximation), clamped to the sample."""
    ys = sorted(xs)
    n = len(ys)
    half = 0.98 * math.sqrt(n)
    lo = max(1, math.floor(n / 2 - half))
    hi = min(n, math.ceil(1 + n / 2 + half))
    return ys[lo - 1], ys[hi - 1]


def block(step, patched: bool, steps: int, warmup: int, mode: str) -> Dict[str, Any]:
    """``warmup`` + ``steps`` steps with the fix installed or not: the time per step (ms;
    ``synced``: the median step, ``back-to-back``: the block's mean), the host's time per
    step (us) and the wrapper's call counts over the block."""
    (te_gqa_fix.install if patched else te_gqa_fix.uninstall)()
    before = te_gqa_fix.call_counts()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        ms, host_us = _timed(step, steps, mode)
    finally:
        gc.enable()
    calls = {k: v - before[k] for k, v in te_gqa_fix.call_counts().items()}
    return {"ms": ms, "host_us": host_us, "calls": calls}


def _timed(step, steps: int, mode: str) -> Tuple[float, float]:
    """``steps`` steps in ``mode``: (ms per step as the GPU saw it, host us per step)."""
    if mode == "synced":
        t0 = time.perf_counter()
        ms = median([event_ms(step) for _ in range(steps)])
        host_us = (time.perf_counter() - t0) / steps * 1e6
    else:
        torch.cuda.synchronize()
        t0 = time.perf_counter()

        def run() -> None:
            for _ in range(steps):
                step()

        ms = event_ms(run) / steps
        host_us = (time.perf_counter() - t0) / steps * 1e6
    return ms, host_us


def run_size(te: Any, tokens: int, offsets: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    batch = packed(tokens, q_empty=(), half=())  # self-attention: queries = keys
    i32 = dict(dtype=torch.int32, device="cuda")
    cu = torch.tensor(cumsum(batch["lk"]), **i32)
    pad = torch.tensor(batch["pad"], **i32)
    cu_kv, pad_kv = (cu, pad) if offsets == "one" else (cu.clone(), pad.clone())
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
            cu_seqlens_kv=cu_kv,
            cu_seqlens_q_padded=pad,
            cu_seqlens_kv_padded=pad_kv,
            max_seqlen_q=max_s,
            max_seqlen_kv=max_s,
        )
        out.backward(d_out.view(out.shape))

    rows = []
    for mode in args.modes.split(","):
        pairs = []
        # Objects alive now (torch, TE, the model) leave the collector's generations, so the
        # collection before each block scans only what the steps made: it stays short.
        gc.collect()
        gc.freeze()
        t_end = time.perf_counter() + args.seconds
        try:
            while len(pairs) < args.blocks and (len(pairs) < 10 or time.perf_counter() < t_end):
                # Alternate which arm runs first.
                order = (True, False) if len(pairs) % 2 else (False, True)
                pairs.append({p: block(step, p, args.steps, args.warmup, mode) for p in order})
        finally:
            gc.unfreeze()
        te_gqa_fix.uninstall()
        diffs = [p[True]["ms"] - p[False]["ms"] for p in pairs]
        step_ms = median([p[False]["ms"] for p in pairs])
        added_us = median(diffs) * 1e3
        ci_lo, ci_hi = median_ci(diffs)
        total = {
            p: {k: sum(x[p]["calls"][k] for x in pairs) for k in pairs[0][p]["calls"]}
            for p in (False, True)
        }
        rows.append({
            "tokens": tokens,
            "offsets": offsets,
            "mode": mode,
            "pairs": len(pairs),
            "step_ms": step_ms,
            "step_ms_patched": median([p[True]["ms"] for p in pairs]),
            "added_us": added_us,
            "added_pct": 100 * added_us / (step_ms * 1e3),
            "added_us_ci95": [ci_lo * 1e3, ci_hi * 1e3],
            "added_us_range": [min(diffs) * 1e3, max(diffs) * 1e3],
            "host_added_us": median([p[True]["host_us"] - p[False]["host_us"] for p in pairs]),
            "calls_patched": total[True],
            "calls_unpatched": total[False],
        })  # fmt: skip
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="step.json", help="the JSON file to write")
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--offsets", default=",".join(OFFSETS), help="one, two or both")
    ap.add_argument("--blocks", type=int, default=120, help="most block pairs per row")
    ap.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        help="a row stops adding pairs after this (>= 10 pairs)",
    )
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per block")
    ap.add_argument("--modes", default=",".join(MODES), help="synced, back-to-back or both")
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
            **{k: getattr(args, k) for k in ("blocks", "seconds", "steps", "warmup")},
        },
        "rows": [],
    }
    with one_cpu():
        for tokens in map(int, args.tokens.split(",")):
            for offsets in args.offsets.split(","):
                for row in run_size(te, tokens, offsets, args):
                    doc["rows"].append(row)
                    lo, hi = row["added_us_ci95"]
                    print(
                        f"{tokens} tokens, {offsets} offsets, {row['mode']}: step "
                        f"{row['step_ms']:.3f} ms, added {row['added_us']:+.1f} us "
                        f"({row['added_pct']:+.2f}%), 95% CI {lo:+.0f}..{hi:+.0f} over "
                        f"{row['pairs']} pairs, wrapper {row['calls_patched']}"
                    )
            torch.cuda.empty_cache()
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
