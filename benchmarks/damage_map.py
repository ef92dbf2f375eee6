#!/usr/bin/env python3
"""Which rows TE's backward leaves non-zero where the true gradient is 0, by kind of row.

Why: the post-pass zeroes every dQ/dK/dV row whose true gradient is 0 (te_gqa_fix.postpass).
At Llama 8K in the benchmark, 69% of those bytes are dQ rows, and the device goal there
(issue 12: 10 us) lies 0.4 us above a contiguous fill of all of them. TE zero-fills THD
dQ/dK/dV before calling cuDNN (bf16/fp16), so a row cuDNN never writes is already 0.
This maps, on the cuDNN TE actually runs, which kinds of zero-gradient rows come back
non-zero from TE's own ``fused_attn_bwd`` (not wrapped) after a poisoned workspace:

* dK/dV: valid rows of a sequence without queries (the reported bug); valid rows no query
  attends (masks, sliding windows); padding rows of a sequence; rows before the first
  or after the last sequence;
* dQ: valid rows of a sequence without keys; padding rows; rows before/after.

The union of the kinds is checked against ``te_gqa_fix.postpass.dead_row_masks`` for every
batch (``--selftest`` does that on the CPU), so the map covers exactly the rows the
post-pass writes. GPU machine, TE staged (``source .gpu-kit/env.sh``)::

    python3 benchmarks/damage_map.py --out DIR [--batch main|no-keys]

Writes ``DIR/damage_map.json`` (per case and kind: the largest |value|, NaN counted as
inf, and the number of rows of that kind, 0 where the batch has none; the stack, the
command) and prints a table. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import itertools
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from te_gqa_fix import reproduce
from te_gqa_fix.postpass import dead_row_masks

KV_KINDS = ("q-empty sequence", "unattended key", "padding", "outside sequences")
Q_KINDS = ("no keys", "padding", "outside sequences")

#: ``main``: one sequence without queries, one without keys or queries (zero length), one
#: whose few queries attend few keys (bottom-right masks, windows), padding gaps between
#: sequences and tail rows after the last. ``no-keys``: a sequence with queries and no
#: keys (its dQ rows' true gradient is 0; nothing for cuDNN to attend), padding and tail.
BATCHES: Dict[str, Dict[str, Any]] = {
    "main": dict(
        lq=[40, 0, 64, 20, 0, 7, 0],
        lk=[48, 30, 64, 20, 25, 50, 0],
        gap_q=[2, 0, 4, 1, 3, 0, 2],
        gap_kv=[0, 2, 0, 4, 1, 3, 2],
        tail=5,
    ),
    "no-keys": dict(
        lq=[16, 12, 20, 9],
        lk=[20, 0, 24, 9],
        gap_q=[1, 3, 0, 2],
        gap_kv=[2, 1, 4, 0],
        tail=3,
    ),
}
MASKS: List[Tuple[str, Tuple[int, int]]] = [
    ("padding", (-1, -1)),
    ("padding_causal", (-1, 0)),
    ("padding_causal_bottom_right", (-1, 0)),
    ("padding_causal", (8, 0)),
]
HEADS = [(8, 2), (16, 1), (8, 8)]
HEAD_DIMS = [64, 128]
POISONS = [1000.0, float("nan")]


def kinds(batch: reproduce.ThdBatch) -> Dict[str, Dict[str, torch.Tensor]]:
    """Boolean row masks (CPU) of each kind of zero-gradient row, for dK/dV and dQ."""
    kv = {k: torch.zeros(batch.rows_kv, dtype=torch.bool) for k in KV_KINDS}
    q = {k: torch.zeros(batch.rows_q, dtype=torch.bool) for k in Q_KINDS}
    for b, (lq, lk) in enumerate(zip(batch.lq, batch.lk)):
        sk, sq = batch.pad_kv[b], batch.pad_q[b]
        if lk:
            if lq == 0:
                kv["q-empty sequence"][sk : sk + lk] = True
            else:
                attended = reproduce.attention_mask(lq, lk, batch).any(dim=0)
                kv["unattended key"][sk : sk + lk] = ~attended
        kv["padding"][sk + lk : batch.pad_kv[b + 1]] = True
        if lq and not lk:
            q["no keys"][sq : sq + lq] = True
        q["padding"][sq + lq : batch.pad_q[b + 1]] = True
    for side, pad, rows in ((kv, batch.pad_kv, batch.rows_kv), (q, batch.pad_q, batch.rows_q)):
        side["outside sequences"][: pad[0]] = True
        side["outside sequences"][pad[-1] : rows] = True
    return {"kv": kv, "q": q}


def check_union(batch: reproduce.ThdBatch) -> None:
    """The kinds together are exactly the rows the post-pass zeroes (raises if not)."""
    k = kinds(batch)
    dead = dead_row_masks(
        **batch.offsets("cpu"),
        rows_q=batch.rows_q,
        rows_kv=batch.rows_kv,
        attn_mask_type=batch.mask,
        window_size=batch.window,
        bottom_right_diagonal=batch.bottom_right_diagonal,
    )
    for side, want in (("kv", dead.kv), ("q", dead.q)):
        union = torch.stack(list(k[side].values())).any(dim=0)
        if not torch.equal(union, want.cpu()):
            rows = (union != want.cpu()).nonzero().flatten().tolist()
            raise AssertionError(f"{side}: kinds differ from dead_row_masks at rows {rows}")


def make(
    mask: str, window: Tuple[int, int], heads: Tuple[int, int], d: int, name: str = "main"
) -> reproduce.ThdBatch:
    spec = BATCHES[name]
    return reproduce.make_batch(
        spec["lq"], spec["lk"], heads_q=heads[0], heads_kv=heads[1], head_dim=d,
        dtype=torch.bfloat16, gap_q=spec["gap_q"], gap_kv=spec["gap_kv"],
        tail=spec["tail"], mask=mask, window=window,
    )  # fmt: skip


def largest(t: torch.Tensor, rows: torch.Tensor) -> float:
    sel = t[rows.to(t.device)]
    if not sel.numel():
        return 0.0
    return float(sel.float().abs().nan_to_num(float("inf")).max().item())


def run_case(
    batch: reproduce.ThdBatch, poison: float, seed: int
) -> Tuple[Dict[str, Dict[str, float]], Dict[str, Dict[str, int]]]:
    """TE's own backward on ``batch`` after a poisoned workspace: per gradient and kind,
    the largest |value| left, and the number of rows of that kind."""
    fa = reproduce._fused_attn()
    original = fa.fused_attn_bwd
    if hasattr(original, "__wrapped__"):
        raise RuntimeError("TE's fused_attn_bwd is wrapped: run without te-gqa-fix installed")
    reproduce.random_inputs(batch, "cuda", seed=seed)
    reproduce.te_forward(batch, "cuda")
    reproduce.poison_allocator(poison)
    dq, dk, dv = reproduce.te_backward(batch, original, "cuda")[:3]
    torch.cuda.synchronize()
    k = kinds(batch)
    out: Dict[str, Dict[str, float]] = {"dq": {}, "dk": {}, "dv": {}}
    for name in Q_KINDS:
        out["dq"][name] = largest(dq, k["q"][name])
    for name in KV_KINDS:
        out["dk"][name] = largest(dk, k["kv"][name])
        out["dv"][name] = largest(dv, k["kv"][name])
    rows = {"dq": {n: int(m.sum()) for n, m in k["q"].items()}}
    rows["dk"] = rows["dv"] = {n: int(m.sum()) for n, m in k["kv"].items()}
    return out, rows


def stack() -> Dict[str, Any]:
    from te_gqa_fix.stack import stack_summary

    return stack_summary()


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    p.add_argument("--batch", choices=sorted(BATCHES), default="main")
    p.add_argument("--selftest", action="store_true", help="CPU: the kinds against the post-pass")
    args = p.parse_args(argv)
    cases = list(itertools.product(MASKS, HEADS, HEAD_DIMS))
    names = sorted(BATCHES) if args.selftest else [args.batch]
    for name in names:
        for (mask, window), heads, d in cases:
            check_union(make(mask, window, heads, d, name))
    if args.selftest:
        n = len(cases) * len(names)
        print(f"selftest: the kinds cover exactly the post-pass's rows in {n} batches")
        return 0
    results = []
    for i, (((mask, window), heads, d), poison) in enumerate(itertools.product(cases, POISONS)):
        batch = make(mask, window, heads, d, args.batch)
        case = dict(mask=mask, window=list(window), heads=list(heads), head_dim=d)
        try:
            found, rows = run_case(batch, poison, seed=i)
        except Exception as exc:  # a shape TE refuses is a finding too: recorded, not fatal
            results.append(dict(case, poison=str(poison), error=repr(exc)[:400]))
            print(f"{mask:28s} {window!s:9s} {heads} d{d:<3d} {poison!s:6s} error: {exc!r:.200}")
            continue
        results.append(dict(case, poison=str(poison), max_abs=found, rows=rows))
        nonzero = {g: [k for k, v in kv.items() if v != 0.0] for g, kv in found.items()}
        print(f"{mask:28s} {window!s:9s} {heads} d{d:<3d} {poison!s:6s} non-zero: {nonzero}")
    summary = {
        g: {
            k: max([r["max_abs"][g][k] for r in results if "max_abs" in r], default=None)
            for k in (Q_KINDS if g == "dq" else KV_KINDS)
        }
        for g in ("dq", "dk", "dv")
    }
    record = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        stack=stack(),
        batch=dict(name=args.batch, **BATCHES[args.batch]),
        fused_attn_bwd=str(inspect.signature(reproduce._fused_attn().fused_attn_bwd))[:80],
        summary_max_abs=summary,
        cases=results,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "damage_map.json").write_text(json.dumps(record, indent=1) + "\n")
    print("largest |value| over every case, by kind:", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
