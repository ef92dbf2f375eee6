"""The post-pass on CPU: which gradient rows te-gqa-fix zeroes in the original report's batch.

No GPU and no Transformer Engine needed. The batch of TE issue #2448's second call: two
sequences packed THD with GQA 2:1 (2 query heads, 1 KV head), head dim 8, mask
``padding_causal``; cu_seqlens_q [0,0,3] (sequence 0 has no query tokens), cu_seqlens_kv
[0,3,9], padded offsets [0,4,12] for queries and keys. On an affected stack TE leaves stale
workspace in the dK/dV rows whose true gradient is 0; here every row starts stale (1000.0),
``te_gqa_fix.zero_dead_rows`` zeroes in place the rows whose true gradient is 0, and
``te-gqa-fix plan`` (the same as ``te_gqa_fix.cli.main(["plan", ...])``) says which rows
those are and why. The two must agree, and agree with the rows worked out by hand below.

    python examples/cpu_postpass.py          # exit 0: the rows agree; 1: they do not
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import List

import torch

import te_gqa_fix
from te_gqa_fix.cli import main as te_gqa_fix_cli

CU_Q, CU_KV, PADDED = [0, 0, 3], [0, 3, 9], [0, 4, 12]
HEADS_Q, HEADS_KV, HEAD_DIM, ROWS = 2, 1, 8, 12
MASK = "padding_causal"
# By hand: sequence 0 (rows 0-3) has no queries, so none of its rows has a gradient; row 3
# is padding. Sequence 1 (rows 4-11) has 3 queries and 6 keys; top-left causal, its queries
# attend keys 0-2 (rows 4-6) only, keys 3-5 (rows 7-9) none; rows 10-11 are padding. Its
# query rows 4-6 are live; 7-11 are padding.
EXPECTED_KV = [0, 1, 2, 3, 7, 8, 9, 10, 11]
EXPECTED_Q = [0, 1, 2, 3, 7, 8, 9, 10, 11]


def zeroed(t: torch.Tensor) -> List[int]:
    """The rows of ``t`` that are all 0."""
    return [i for i in range(t.shape[0]) if bool((t[i] == 0).all())]


def plan(*extra: str) -> str:
    """``te-gqa-fix plan`` for the batch, in this process; its output."""
    args = ["plan", "--cu-seqlens-q", ",".join(map(str, CU_Q)), "--cu-seqlens-kv",
            ",".join(map(str, CU_KV)), "--padded-q", ",".join(map(str, PADDED)),
            "--padded-kv", ",".join(map(str, PADDED)), "--mask", MASK, *extra]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = te_gqa_fix_cli(args)
    if code != 0:
        raise SystemExit(f"cpu_postpass: te-gqa-fix plan exited with {code}")
    return out.getvalue()


def main() -> int:
    i32 = dict(dtype=torch.int32)
    offsets = [torch.tensor(o, **i32) for o in (CU_Q, CU_KV, PADDED, PADDED)]
    # Gradients as TE leaves them on an affected stack, at their worst: every row stale.
    dq = torch.full((ROWS, HEADS_Q, HEAD_DIM), 1000.0)
    dk = torch.full((ROWS, HEADS_KV, HEAD_DIM), 1000.0)
    dv = torch.full((ROWS, HEADS_KV, HEAD_DIM), 1000.0)
    te_gqa_fix.zero_dead_rows(dq, dk, dv, *offsets, attn_mask_type=MASK)
    got = {"dK/dV": zeroed(dk), "dQ": zeroed(dq)}
    print(plan())
    planned = json.loads(plan("--json"))
    said = {"dK/dV": planned["dkv"]["zeroed_rows"], "dQ": planned["dq"]["zeroed_rows"]}
    failures = []
    if zeroed(dv) != got["dK/dV"]:
        failures.append(f"dK and dV zeroed different rows: {got['dK/dV']} and {zeroed(dv)}")
    for side, want, t in (("dK/dV", EXPECTED_KV, dk), ("dQ", EXPECTED_Q, dq)):
        print(f"{side} rows zeroed by zero_dead_rows: {got[side]}")
        if not got[side] == said[side] == want:
            failures.append(f"{side}: zeroed {got[side]}, plan says {said[side]}, expected {want}")
        kept = [i for i in range(ROWS) if i not in got[side]]
        if not bool((t[kept] == 1000.0).all()):
            failures.append(f"{side}: a row with a gradient was changed")
    if failures:
        print("WRONG:\n  " + "\n  ".join(failures))
        return 1
    print("cpu_postpass: the rows zeroed are the rows whose true gradient is 0; the rest kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
