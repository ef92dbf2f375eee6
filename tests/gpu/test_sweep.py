"""Exactness sweep on the real kernel: heads, head dims, dtypes, masks, windows, layouts.

Every layout has padding gaps and tail rows, and sequences without queries, without keys,
or without either, in the middle of the batch and at its end (issue #54); each case runs
with TE's ``deterministic`` off and on (its backward then takes other cuDNN algorithms and
workspace). Per case: an unpatched call after a poisoned block (recorded: was it
corrupted?), then patched calls with and without poisoning, all of which must be exact:
live rows within the dtype-derived bound, dead rows exactly 0.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from te_gqa_fix.wrapper import unwrap, wrapper_for
from thd import (
    compare,
    corrupted,
    exact,
    make_batch,
    poison_allocator,
    random_inputs,
    references,
    te_backward,
    te_forward,
)

pytestmark = pytest.mark.gpu

HEADS = [(2, 1), (8, 2), (32, 8), (16, 1), (8, 8)]
DIMS_DTYPES = [(64, torch.float16), (128, torch.bfloat16), (64, torch.bfloat16),
               (128, torch.float16)]  # fmt: skip
MASKS = {
    "padding": ("padding", (-1, -1)),
    "padding_causal": ("padding_causal", (-1, -1)),
    "padding_causal_bottom_right": ("padding_causal_bottom_right", (-1, -1)),
    "sliding_window": ("padding_causal_bottom_right", (24, 0)),
}
LAYOUTS = {
    # lq, lk, q gaps, kv gaps; lq <= lk wherever lk > 0 so every query has a key. Each
    # layout has its kind of empty sequence in the middle and at the end.
    "q_empty": (  # no queries: sequences 1, 3 and 5 (the last)
        [37, 0, 64, 0, 20, 0],
        [50, 33, 64, 17, 20, 9],
        [1, 2, 0, 3, 0, 5],
        [3, 0, 5, 2, 1, 0],
    ),
    "kv_empty": (  # no keys (queries that attend nothing): sequences 2 and 5 (the last)
        [37, 0, 9, 64, 5, 7],
        [50, 33, 0, 64, 17, 0],
        [1, 2, 3, 0, 3, 2],
        [3, 0, 2, 5, 2, 1],
    ),
    "both_empty": (  # neither: sequences 1 and 4 (the last); no queries: sequence 3
        [37, 0, 64, 0, 0],
        [50, 0, 64, 17, 0],
        [1, 3, 0, 3, 0],
        [3, 0, 5, 2, 4],
    ),
}
DETERMINISTIC = [False, True]
#: Every mask x layout x deterministic x heads once (120 cases), the head dim and dtype
#: turning over so each of their four pairings meets every heads layout six times.
CASES = [
    (heads, *DIMS_DTYPES[(s + h) % len(DIMS_DTYPES)], mask, layout, det)
    for s, (mask, layout, det) in enumerate(itertools.product(MASKS, LAYOUTS, DETERMINISTIC))
    for h, heads in enumerate(HEADS)
]


def _id(case):
    (hq, hkv), d, dtype, mask, layout, det = case
    return f"h{hq}-{hkv}_d{d}_{str(dtype)[6:]}_{mask}_{layout}_{'det' if det else 'nondet'}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_sweep(te, cudnn, affected, case, record):
    (hq, hkv), d, dtype, mask_name, layout, det = case
    mask, window = MASKS[mask_name]
    lq, lk, gq, gk = LAYOUTS[layout]
    batch = make_batch(
        lq,
        lk,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        dtype=dtype,
        gap_q=gq,
        gap_kv=gk,
        tail=7,
        mask=mask,
        window=window,
    )
    random_inputs(batch, seed=zlib.crc32(_id(case).encode()))
    te_forward(batch)
    refs = references(batch)
    original = unwrap(te.cpp_extensions.fused_attn.fused_attn_bwd)
    wrapper = wrapper_for(original)

    poison_allocator(1000.0)
    unpatched = compare(batch, te_backward(batch, fn=original, deterministic=det), refs)
    results = []
    for poison in (False, True, True, False):  # several calls in a row
        if poison:
            poison_allocator(1000.0)
        results.append(compare(batch, te_backward(batch, fn=wrapper, deterministic=det), refs))
    torch.cuda.synchronize()
    worst = {k: max(r[k] for r in results) for k in results[0]}
    record(
        cudnn=".".join(map(str, cudnn)),
        affected=affected,
        heads=f"{hq}/{hkv}",
        d=d,
        dtype=str(dtype)[6:],
        mask=mask_name,
        layout=layout,
        deterministic=det,
        unpatched_corrupted=corrupted(unpatched),
        unpatched_dk_dead_max=unpatched["dk_dead_max"],
        unpatched_dv_dead_max=unpatched["dv_dead_max"],
        patched_exact=all(exact(r) for r in results),
        **worst,
    )
    for r in results:
        assert exact(r), r
    if hq == hkv:
        # MHA writes dK/dV directly: correct even unpatched
        assert not corrupted(unpatched), unpatched


#: Three batches of the same rows with 6, 3 and 12 sequences (sequences without queries,
#: padding, tail rows), as packed training batches of one token count come step after step.
SAME_ROWS = [
    (
        ([37, 0, 64, 0, 20, 1], [50, 33, 64, 17, 20, 9]),
        dict(gap_q=[1, 2, 0, 3, 0, 4], gap_kv=[3, 0, 5, 2, 1, 0], tail=7),
    ),
    (([60, 0, 50], [70, 40, 77]), dict(gap_q=[3, 0, 2], gap_kv=0, tail=24)),
    (
        ([10, 0, 12, 5, 0, 9, 11, 0, 7, 8, 20, 3], [12, 9, 12, 6, 4, 9, 14, 5, 7, 10, 20, 3]),
        dict(gap_q=1, gap_kv=[5] * 10 + [4, 4], tail=42),
    ),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondet", "det"])
@pytest.mark.parametrize("d", [128, 256])
def test_sequence_counts_in_one_call_shape(te, cudnn, affected, d, deterministic, record):
    """One wrapper, calls of one shape whose batches hold 6, 3, 12, then 6 sequences in the
    same rows: each call exact, through the post-pass (d 128) or the fallback where cuDNN is
    wrong on live rows (d 256 on an affected build). A launch prepared for another number
    of sequences would zero live rows or leave stale ones."""
    original = unwrap(te.cpp_extensions.fused_attn.fused_attn_bwd)
    wrapper = wrapper_for(original)
    batches = []
    for (lq, lk), layout in SAME_ROWS:
        batch = make_batch(
            lq, lk, heads_q=8, heads_kv=2, head_dim=d, dtype=torch.bfloat16, **layout
        )
        random_inputs(batch, seed=len(lq) * d)
        te_forward(batch)
        batches.append(batch)
    assert len({(b.rows_q, b.rows_kv) for b in batches}) == 1
    results = []
    for batch in (*batches, batches[0]):
        poison_allocator(1000.0)
        out = te_backward(batch, fn=wrapper, deterministic=deterministic)
        results.append(compare(batch, out, references(batch)))
    worst = {k: max(r[k] for r in results) for k in results[0]}
    record(cudnn=".".join(map(str, cudnn)), affected=affected, d=d, deterministic=deterministic,
           sequences=[len(b.lq) for b in batches], exact=all(map(exact, results)), **worst)  # fmt: skip
    for r in results:
        assert exact(r), r
