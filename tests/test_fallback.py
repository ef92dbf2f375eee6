"""The exact fallback (``te_gqa_fix.fallback``) on CPU: its mask mapping, its decision and,
end to end, its gradients with FlashAttention-2's varlen entry points replaced by a CPU
emulation of their semantics. After the post-pass they must equal the fp32 reference, and
be exactly 0 wherever the true gradient is. The split's row moves
(``te_gqa_fix.fallback._row_moves``): the PyTorch path against the rule written out row by
row, and the Triton kernel against the PyTorch path, byte for byte (under Triton's
interpreter in one child process, this file run as a script; compiled in the ``gpu`` test).
"""

from __future__ import annotations

import enum
import inspect
import itertools
import logging
import random
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from fakes.interpreter import interpreted_checks, worker_main
from te_gqa_fix import fallback
from te_gqa_fix._te import OFFSET_NAMES, FallbackArgs
from te_gqa_fix.errors import InputError
from te_gqa_fix.fallback._row_moves import move_rows
from te_gqa_fix.postpass import zero_dead_rows
from te_gqa_fix.wrapper import Signature
from thd import (
    ThdBatch,
    attention_mask,
    dead_masks,
    live_q_rows,
    make_batch,
    random_inputs,
    reference_attention,
    tolerance,
)

MASKS = (
    "padding",
    "no_mask",
    "padding_causal",
    "causal",
    "padding_causal_bottom_right",
    "causal_bottom_right",
)
WINDOWS = ((-1, -1), (-1, 0), (0, 0), (1, 0), (2, 1), (-1, 2), (3, -1), (0, -1), (9, 9))
LENGTHS = ((3, 5), (4, 4), (5, 3), (1, 4), (4, 1), (6, 2))


# ----------------------------------------------------------------- FlashAttention-2 on CPU
def _fa2_window(max_q: int, max_k: int, causal: bool, left, right, forward: bool):
    """The window FlashAttention-2's varlen entry points run with (flash_api.cpp)."""
    if forward and max_q == 1:
        causal = False
    if causal:
        right = 0
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    return left, right


def _fa2_allowed(lq: int, lk: int, left: int, right: int) -> torch.Tensor:
    """FlashAttention-2's mask of one segment: bottom-right aligned window."""
    i = torch.arange(lq).view(-1, 1)
    j = torch.arange(lk).view(1, -1)
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + lk - lq - left
    if right >= 0:
        ok &= j <= i + lk - lq + right
    return ok


def _segments_of(cu_q: torch.Tensor, cu_k: torch.Tensor, rows_q: int, rows_k: int):
    """Segment b: q rows ``[cu_q[b], cu_q[b+1])`` with k rows ``[cu_k[b], cu_k[b+1])``. The
    offsets must lie in their buffers, non-decreasing: FlashAttention-2 reads and writes
    those rows unchecked (a Python slice would clamp silently)."""
    q, k = cu_q.tolist(), cu_k.tolist()
    assert len(q) == len(k) >= 2, (q, k)
    for off, rows in ((q, rows_q), (k, rows_k)):
        assert off == sorted(off) and off[0] >= 0 and off[-1] <= rows, (
            f"FlashAttention-2 would touch rows outside a buffer of {rows}: {off}"
        )
    return list(zip(q[:-1], q[1:], k[:-1], k[1:]))


class FlashEmulation:
    """FlashAttention-2 varlen semantics in float64: per segment, bottom-right windows, GQA
    by repeat_interleave, logsumexp ``[h, total_q]``. Rows it never writes (outside every
    segment, or in a segment longer than ``max_q``/``max_k``) are NaN, as fresh memory may be."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self.rng: List[tuple] = []  # the backward's seed and offset

    def _flash_attention_forward(
        self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug, **kw
    ):
        self.calls.append("fwd")
        assert dropout_p == 0.0 and not debug
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention-2 takes one head dim"
        left, right = _fa2_window(max_q, max_k, is_causal, *_kw_window(kw), forward=True)
        group = q.shape[1] // k.shape[1]
        if max_q == 1 and group > 1 and max(_kw_window(kw)) < 0:
            # FlashAttention-2 then reshapes q as one query per segment (a decode step)
            assert q.shape[0] == cu_q.numel() - 1, "max_q == 1: q is not one row a segment"
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
        for a, e, ka, ke in _segments_of(cu_q, cu_k, q.shape[0], k.shape[0]):
            lq, lk = e - a, ke - ka
            if lq <= 0 or lq > max_q or lk > max_k:
                continue
            qs, ks, vs = _seg(q, a, e, 1), _seg(k, ka, ke, group), _seg(v, ka, ke, group)
            s = torch.einsum("ihd,jhd->hij", qs, ks) * kw["scale"]
            s = s.masked_fill(~_fa2_allowed(lq, lk, left, right), float("-inf"))
            m = torch.logsumexp(s, -1)
            m = m.masked_fill(m == float("-inf"), float("inf"))  # no key: lse +inf, out 0
            out[a:e] = torch.einsum("hij,jhd->ihd", torch.exp(s - m[..., None]), vs).to(q.dtype)
            lse[:, a:e] = m.float()
        return out, lse, torch.empty(2), torch.empty(()), torch.empty(0)

    def _flash_attention_backward(
        self, d_o, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, *rest, **kw
    ):
        self.calls.append("bwd")
        assert dropout_p == 0.0 and len(rest) == 2
        self.rng.append(rest)
        assert q.shape[-1] == v.shape[-1] == d_o.shape[-1] == out.shape[-1], "one head dim"
        assert out.shape == q.shape and d_o.shape == q.shape, (out.shape, q.shape)
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        left, right = _fa2_window(max_q, max_k, is_causal, *_kw_window(kw), forward=False)
        group = q.shape[1] // k.shape[1]
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        for a, e, ka, ke in _segments_of(cu_q, cu_k, q.shape[0], k.shape[0]):
            lq, lk = e - a, ke - ka
            if lq > max_q or lk > max_k:
                continue
            qs, dos, os_ = _seg(q, a, e, 1), _seg(d_o, a, e, 1), _seg(out, a, e, 1)
            ks, vs = _seg(k, ka, ke, group), _seg(v, ka, ke, group)
            m = lse[:, a:e].double()
            m = m.masked_fill(m == float("-inf"), 0.0)  # as the kernel reads -inf
            s = torch.einsum("ihd,jhd->hij", qs, ks) * kw["scale"]
            s = s.masked_fill(~_fa2_allowed(lq, lk, left, right), float("-inf"))
            p = torch.exp(s - m[..., None])
            dp = torch.einsum("ihd,jhd->hij", dos, vs)
            ds = p * (dp - (dos * os_).sum(-1).t()[..., None])
            dq[a:e] = (torch.einsum("hij,jhd->ihd", ds, ks) * kw["scale"]).to(q.dtype)
            dks = torch.einsum("hij,ihd->jhd", ds, qs) * kw["scale"]
            dvs = torch.einsum("hij,ihd->jhd", p, dos)
            dk[ka:ke] = dks.unflatten(1, (k.shape[1], group)).sum(2).to(k.dtype)
            dv[ka:ke] = dvs.unflatten(1, (k.shape[1], group)).sum(2).to(v.dtype)
        return dq, dk, dv


def _kw_window(kw: Dict[str, Any]):
    return kw.get("window_size_left"), kw.get("window_size_right")


def _seg(t: torch.Tensor, a: int, e: int, group: int) -> torch.Tensor:
    return t[a:e].double().repeat_interleave(group, dim=1)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> FlashEmulation:
    emu = FlashEmulation()
    monkeypatch.setattr(fallback, "_aten", emu)
    monkeypatch.setattr(fallback, "_device_reason", lambda dtype, device: None)
    return emu


# ----------------------------------------------------------------------------- calls
def _call(
    batch: ThdBatch,
    *,
    layout: str = "thd_thd_thd",
    padded: bool = True,
    one_offsets: bool = False,
    tight: bool = False,
    stats_rows: Optional[int] = None,
    **extra: Any,
) -> Dict[str, Any]:
    """TE 2.20's bound ``fused_attn_bwd`` arguments for the batch's CPU tensors. With
    ``stats_rows``, TE's forward output ``o`` and softmax statistics ``[stats_rows, h, 1]``
    (rows without a query of a sequence with keys hold NaN), else no statistics."""
    t = batch.tensors
    offsets = batch.offsets("cpu")
    if one_offsets:  # what TE gets when q and kv share their offsets (self-attention)
        assert batch.cu_q == batch.cu_kv and batch.pad_q == batch.pad_kv
        offsets["cu_seqlens_kv"] = offsets["cu_seqlens_q"]
        offsets["cu_seqlens_kv_padded"] = offsets["cu_seqlens_q_padded"]
    if not padded:
        offsets["cu_seqlens_q_padded"] = offsets["cu_seqlens_kv_padded"] = None
    q, k, v = t["q"], t["k"], t["v"]
    dim = 2 if layout in ("thd_th2d", "th3d") else 1
    if layout in ("thd_t2hd", "thd_th2d"):
        k, v = torch.stack((k, v), dim).unbind(dim)
    elif layout in ("t3hd", "th3d"):
        q, k, v = torch.stack((q, k, v), dim).unbind(dim)
    o, aux = torch.zeros_like(t["d_o"]), []
    if stats_rows is not None:
        ref = reference_attention(batch)
        stats = torch.full((stats_rows, batch.heads_q, 1), float("nan"))
        live = live_q_rows(batch)
        stats[: batch.rows_q][live] = ref["lse"][live].unsqueeze(-1)
        o, aux = ref["o"].to(batch.dtype), [stats, torch.zeros(2, dtype=torch.int64)]
    max_q, max_k = batch.max_seqlens()
    if tight:  # the least bound TE may pass: the longest valid sequence
        max_q, max_k = max(batch.lq, default=0), max(batch.lk, default=0)
    call = dict(
        max_seqlen_q=max_q, max_seqlen_kv=max_k, q=q, k=k, v=v, o=o, d_o=t["d_o"],
        fake_dtype=q.dtype, aux_ctx_tensors=aux, fused_attention_backend=None,
        s_quantizer=None, dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
        fast_zero_fill=True, qkv_layout=layout, o_format="thd", do_format="thd",
        dqkv_layout=layout, attn_bias_type="no_bias", attn_mask_type=batch.mask,
        softmax_type="vanilla", window_size=batch.window,
        bottom_right_diagonal=batch.bottom_right_diagonal, deterministic=False, cuda_graph=False,
        **offsets,
    )  # fmt: skip
    return {**call, **extra}


def _args(call: Dict[str, Any]) -> FallbackArgs:
    """The call's :class:`FallbackArgs` as the wrapper hands them over (absent names None)."""
    return FallbackArgs(**{name: call.get(name) for name in FallbackArgs._fields})


def _decide(call: Dict[str, Any]) -> Any:
    """The fallback's decision for a call (TE >= 2.12 where it has bottom_right_diagonal)."""
    return fallback.decide(_args(call), "bottom_right_diagonal" in call)


def _batch(
    lq, lk, heads=(4, 2), dim=8, seed=0, dtype=torch.float32, more_rows=(0, 0), **kw
) -> ThdBatch:
    """A batch with random inputs; ``more_rows`` adds rows at the end of q's, kv's buffer."""
    batch = make_batch(lq, lk, heads_q=heads[0], heads_kv=heads[1], head_dim=dim, dtype=dtype, **kw)
    batch.rows_q += more_rows[0]
    batch.rows_kv += more_rows[1]
    random_inputs(batch, device="cpu", seed=seed)
    return batch


def _check(batch: ThdBatch, call: Dict[str, Any], out: Sequence[Any]) -> None:
    """TE's return shape; after the post-pass, every row the fp32 reference's within the
    gradients' precision, and exactly 0 wherever the true gradient is 0."""
    assert len(out) == 5 and out[3] is None and out[4] is None
    dq, dk, dv = out[:3]
    assert dq.shape == call["q"].shape and dk.shape == call["k"].shape
    assert dv.shape == call["v"].shape and dq.dtype == call["q"].dtype
    pads = (call["cu_seqlens_q_padded"], call["cu_seqlens_kv_padded"])
    zero_dead_rows(
        dq, dk, dv, call["cu_seqlens_q"], call["cu_seqlens_kv"], *pads,
        attn_mask_type=batch.mask, window_size=batch.window,
        bottom_right_diagonal=batch.bottom_right_diagonal, impl="torch",
    )  # fmt: skip
    refs = {"fp32": reference_attention(batch)}
    if batch.dtype != torch.float32:
        refs["same"] = reference_attention(batch, batch.dtype)
    live_kv = _live_kv_rows(batch)
    for name, got, live in zip(GRADS, (dq, dk, dv), (live_q_rows(batch), live_kv, live_kv)):
        assert torch.isfinite(got).all(), name
        ref = refs["fp32"][name]
        if got.dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=name)
        else:  # flash-attention's bound: twice the same computation's error in the dtype
            err, same = ((t.float() - ref).abs().max().item() for t in (got, refs["same"][name]))
            bound = tolerance(same, ref.abs().max().item(), got.dtype)
            assert err <= bound, (name, err, bound)
        assert not got[~live].any(), (name, (~live).nonzero().flatten().tolist())


GRADS = ("dq", "dk", "dv")


def _live_kv_rows(batch: ThdBatch) -> torch.Tensor:
    """Key rows at least one query attends (elsewhere dK and dV are 0 by definition)."""
    live = torch.zeros(batch.rows_kv, dtype=torch.bool)
    for start, lq, lk in zip(batch.pad_kv, batch.lq, batch.lk):
        if lq and lk:
            live[start : start + lk] = attention_mask(lq, lk, batch).any(dim=0)
    return live


# ----------------------------------------------------------------------- mask mapping
def _expected_decline(mask: str, window, brd, one: bool) -> Optional[str]:
    if not mask.startswith("padding"):
        return "attn_mask_type"
    causal = "causal" in mask
    bottom_right = mask.endswith("bottom_right")
    if causal and window[1] > 0:
        return "window_size"
    if causal and brd is not None and brd != bottom_right:
        return "bottom_right_diagonal"
    right = 0 if causal else window[1]
    top_left = not (bottom_right if brd is None else brd)
    if top_left and (window[0], right) not in ((-1, -1), (-1, 0)) and not one:
        return "top-left"
    return None


def _fa2_mask(lq: int, lk: int, plan, max_q: int, max_k: int) -> torch.Tensor:
    """The mask FlashAttention-2 applies for the plan: one call, or top-left causal split
    in a causal square of n = min(lq, lk) and the queries from n on over every key."""
    window, split = plan
    if not split:
        return _fa2_allowed(lq, lk, *_fa2_window(max_q, max_k, False, *window, forward=False))
    n = min(lq, lk)
    out = torch.zeros(lq, lk, dtype=torch.bool)
    out[:n, :n] = _fa2_allowed(n, n, *_fa2_window(max_q, max_k, False, -1, 0, forward=False))
    out[n:] = _fa2_allowed(lq - n, lk, *_fa2_window(max_q, max_k, False, -1, -1, forward=False))
    return out


@pytest.mark.parametrize("mask", MASKS)
def test_mask_mapping_matches_brute_force(mask: str) -> None:
    """For every window, bottom_right_diagonal and lq <, =, > lk, with tight and TE-rounded
    bounds: FlashAttention-2's mask equals TE's, or the plan declines exactly where expected."""
    for window, brd, (lq, lk) in itertools.product(WINDOWS, (None, False, True), LENGTHS):
        for one, tight in itertools.product((False, True), (False, True)):
            if one and lq != lk:
                continue
            batch = make_batch(
                [lq], [lk], heads_q=1, heads_kv=1, head_dim=8, dtype=torch.float32,
                mask=mask, window=window, bottom_right_diagonal=brd,
            )  # fmt: skip
            offsets = batch.offsets("cpu")
            if one:
                offsets["cu_seqlens_kv"] = offsets["cu_seqlens_q"]
            bounds = (lq, lk) if tight else batch.max_seqlens()
            call = dict(
                offsets, attn_mask_type=mask, window_size=window, bottom_right_diagonal=brd,
                max_seqlen_q=bounds[0], max_seqlen_kv=bounds[1],
            )  # fmt: skip
            a = _args(call)
            plan = fallback._mask_reason(a, True)
            expected = _expected_decline(mask, window, brd, one)
            case = (mask, window, brd, lq, lk, one, tight)
            assert isinstance(plan, str) == (expected is not None), (case, plan)
            if expected is not None:
                assert expected in plan, (case, plan)
                continue
            got = _fa2_mask(lq, lk, plan, *fallback._bounds(a))
            assert torch.equal(got, attention_mask(lq, lk, batch)), (case, plan, got)


# ------------------------------------------------------------------------ end to end
LAYOUTS = [  # (lq, lk, gaps and lead/tail rows)
    ([5, 0, 7, 3, 0], [6, 4, 0, 3, 0], dict(gap_q=[2, 0, 3, 9, 1], gap_kv=[0, 5, 1, 0, 2])),
    ([9, 2, 0, 6], [3, 8, 5, 6], dict(gap_q=[0, 4, 2, 0], gap_kv=[3, 0, 0, 7], lead=4, tail=3)),
    ([4, 4, 1], [4, 4, 1], dict(gap_q=[12, 0, 1], gap_kv=[12, 0, 1], lead=2, tail=14)),
    ([9, 6, 3], [2, 1, 0], dict(gap_q=[0, 2, 0], gap_kv=[1, 0, 3])),  # lq > max lk + window
]
CASES = [  # (mask, window, bottom_right_diagonal)
    ("padding", (-1, -1), None),
    ("padding_causal", (-1, 0), None),
    ("padding_causal_bottom_right", (-1, 0), None),
    ("padding_causal_bottom_right", (3, 0), None),
    ("padding", (2, 1), True),
    ("padding", (-1, 0), None),
    ("padding", (4, -1), True),
    ("padding", (1, 3), True),
]


#: (heads_q, heads_kv): GQA, MQA, MHA.
HEADS = [(4, 2), (4, 1), (3, 3)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_exact_backward_matches_reference(emulated, case, layout) -> None:
    """Sequences without queries, without keys, without both; padding between sequences,
    before the first and after the last; TE-rounded and least bounds. Every layout and
    every case meets every head grouping (pairwise: layout + case picks the heads)."""
    lq, lk, kw = LAYOUTS[layout]
    mask, window, brd = case
    heads = HEADS[(layout + CASES.index(case)) % len(HEADS)]
    batch = _batch(lq, lk, heads, mask=mask, window=window, bottom_right_diagonal=brd, **kw)
    for tight, one in ((False, False), (True, False), (True, True)):
        if one and (batch.cu_q != batch.cu_kv or batch.pad_q != batch.pad_kv):
            continue
        call = _call(batch, tight=tight, one_offsets=one)
        _check(batch, call, fallback.exact_backward(call))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stats", [False, True], ids=["forward", "tes-statistics"])
def test_half_precision_within_its_tolerance(emulated, dtype, stats: bool) -> None:
    """TE's own dtypes: within their rounding of the fp32 reference, exact zeros kept."""
    lq, lk, kw = LAYOUTS[1]
    batch = _batch(lq, lk, dtype=dtype, mask="padding_causal", **kw)
    call = _call(batch, tight=True, stats_rows=batch.rows_q if stats else None)
    _check(batch, call, fallback.exact_backward(call))


def test_random_layouts(emulated) -> None:
    """Random sequence lengths (zero too), gaps, lead and tail rows, with padded offsets,
    without (None), and with the valid offsets passed as the padded ones (as
    DotProductAttention does without padding): every live row in its own sequence."""
    rng = random.Random(0)
    for case in range(24):
        n = rng.randint(1, 4)
        lq = [rng.choice([0, 0, 1, 2, 5, 9]) for _ in range(n)]
        lk = [rng.choice([0, 0, 1, 3, 7]) for _ in range(n)]
        packing = ("padded", "none", "valid-as-padded")[case % 3]
        kw: Dict[str, Any] = dict(lead=rng.choice([0, 3]), tail=rng.choice([0, 2]))
        if packing == "padded":
            kw.update(gap_q=[rng.choice([0, 1, 4]) for _ in range(n)])
            kw.update(gap_kv=[rng.choice([0, 2, 6]) for _ in range(n)])
        else:
            kw["lead"] = 0
        mask = rng.choice(["padding", "padding_causal", "padding_causal_bottom_right"])
        batch = _batch(lq, lk, mask=mask, seed=case, **kw)
        call = _call(batch, tight=bool(case % 2), padded=packing == "padded")
        if packing == "valid-as-padded":
            call["cu_seqlens_q_padded"] = call["cu_seqlens_q"]
            call["cu_seqlens_kv_padded"] = call["cu_seqlens_kv"]
        _check(batch, call, fallback.exact_backward(call))


@pytest.mark.parametrize(
    "mask, stats, padded",  # pairwise: each value of each with each of the others
    [("padding_causal", False, True), ("padding_causal", True, False),
     ("padding_causal_bottom_right", False, False), ("padding_causal_bottom_right", True, True)],
    ids=["tl-forward-padded", "tl-tes-statistics", "br-forward", "br-tes-statistics-padded"],
)  # fmt: skip
def test_impossible_offsets_stay_inside_the_buffers(emulated, mask, stats, padded) -> None:
    """Offsets TE should never pass (negative, decreasing, past the end): whatever the
    gradients, FlashAttention-2 and the row moves read and write inside the buffers (the
    emulation asserts every segment it is given)."""
    batch = _batch([5, 0, 3], [2, 6, 4], mask=mask, gap_q=[1, 2, 0], gap_kv=[0, 1, 3], tail=2)
    call = _call(batch, tight=True, padded=padded, stats_rows=batch.rows_q if stats else None)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        edit = {}
        for name in OFFSET_NAMES if padded else OFFSET_NAMES[:2]:
            lo = torch.randint(-20, 40, (4,), generator=gen, dtype=torch.int32)
            edit[name] = torch.sort(lo).values if name.endswith("padded") else lo
        fallback.exact_backward({**call, **edit})


@pytest.mark.parametrize("case, stats", [(CASES[1], False), (CASES[3], True)], ids=["tl", "br"])
def test_v_head_dim_below_q_is_zero_padded(emulated, case, stats: bool) -> None:
    """MLA-like shapes (v's head dim below q/k's): v, dO (and TE's o) padded with zeros."""
    lq, lk, kw = LAYOUTS[0]
    mask, window, brd = case
    batch = _batch(lq, lk, mask=mask, window=window, bottom_right_diagonal=brd, dim=16,
                   head_dim_v=8, **kw)  # fmt: skip
    call = _call(batch, stats_rows=batch.rows_q if stats else None)
    assert _decide(call).reuse_stats is stats
    _check(batch, call, fallback.exact_backward(call))


@pytest.mark.parametrize(
    "lq, lk", [([1, 0, 1], [3, 2, 4]), ([0, 0], [3, 2]), ([2, 3], [0, 0])], ids=["q1", "q0", "kv0"]
)
def test_least_max_seqlens(emulated, lq, lk) -> None:
    """A max_seqlen_q of 1 (FlashAttention-2 must not take its decode path) or 0, and a
    max_seqlen_kv of 0, are bounds like any other; one below 0 is refused."""
    batch = _batch(lq, lk, mask="padding", gap_q=[4, 0, 2][: len(lq)], tail=1)
    call = _call(batch, tight=True)
    _check(batch, call, fallback.exact_backward(call))
    name = "max_seqlen_kv" if any(lq) else "max_seqlen_q"
    with pytest.raises(ValueError, match="max_seqlen_q/max_seqlen_kv: expected ints >= 0"):
        fallback.exact_backward({**call, name: -1})


@pytest.mark.parametrize("window", [(-1, 0), (2, 0), (1, 3)])
def test_top_left_windows_with_one_offsets_tensor(emulated, window) -> None:
    """Self-attention (cu_seqlens_kv is cu_seqlens_q): top-left windows are exact in one call."""
    lens = [6, 0, 9, 3]
    mask = "padding" if window[1] > 0 else "padding_causal"
    batch = _batch(lens, lens, mask=mask, window=window, gap_q=[1, 2, 0, 5], gap_kv=[1, 2, 0, 5])
    call = _call(batch, one_offsets=True, tight=True)
    _check(batch, call, fallback.exact_backward(call))
    assert emulated.calls == ["fwd", "bwd"]


@pytest.mark.parametrize("kv", ["q's", "views", "own-padded", "unpadded", "valid-as-padded"])
def test_one_segmentation_only_where_q_and_kv_offsets_are_one_memory(emulated, kv) -> None:
    """cu_seqlens_kv in cu_seqlens_q's memory (or a view of it): one segmentation only when
    the padded offsets are one memory too, or both None; kv's own padding is honoured.
    Padded offsets None or the valid ones' memory (DotProductAttention's call without
    padding): the valid offsets are the segments; an equal copy takes the padded path."""
    gap_q = [0] * 4 if kv in ("unpadded", "valid-as-padded") else [1, 2, 0, 5]
    gap_kv = [3, 0, 2, 3] if kv == "own-padded" else gap_q
    batch = _batch([6, 0, 9, 3], [6, 0, 9, 3], mask="padding_causal", gap_q=gap_q, gap_kv=gap_kv)
    call = _call(batch, tight=True, padded=kv != "unpadded")
    same = (lambda t: t.view(-1)) if kv == "views" else (lambda t: t)
    call["cu_seqlens_kv"] = same(call["cu_seqlens_q"])
    if kv in ("q's", "views"):
        call["cu_seqlens_kv_padded"] = same(call["cu_seqlens_q_padded"])
    if kv == "valid-as-padded":
        call["cu_seqlens_q_padded"] = call["cu_seqlens_kv_padded"] = call["cu_seqlens_q"]
    plan = _decide(call)
    assert plan.one_segmentation is (kv != "own-padded")
    assert plan.back_to_back == (kv in ("unpadded", "valid-as-padded"),) * 2
    _check(batch, call, fallback.exact_backward(call))


@pytest.mark.parametrize(
    "more_rows, padded, stats",  # pairwise: each value of each with each of the others
    [((5, 0), True, False), ((5, 0), False, True), ((0, 5), True, True), ((0, 5), False, False)],
    ids=["q-longer-padded", "q-longer-tes-statistics", "kv-longer-padded-tes-statistics",
         "kv-longer"],
)  # fmt: skip
def test_one_offsets_tensor_for_buffers_of_other_row_counts(emulated, more_rows, padded, stats):
    """Issue #51 (8): q and kv share their offsets tensors, but their buffers have other row
    counts (a longer tail on one side). One segmentation would give FlashAttention-2 kv
    segments past kv's last row (q's buffer end): the fallback segments each side alone."""
    lens, gaps = [4, 0, 6, 3], [1, 0, 2, 0] if padded else 0
    batch = _batch(lens, lens, mask="padding_causal", gap_q=gaps, gap_kv=gaps, more_rows=more_rows)
    call = _call(batch, one_offsets=True, padded=padded, tight=True,
                 stats_rows=batch.rows_q if stats else None)  # fmt: skip
    assert call["q"].shape[0] != call["k"].shape[0]
    assert not _decide(call).one_segmentation
    _check(batch, call, fallback.exact_backward(call))


@pytest.mark.parametrize("packing", ["gaps", "back-to-back"])
@pytest.mark.parametrize("stats", [False, True], ids=["forward", "tes-statistics"])
def test_top_left_causal_across_two_offset_tensors(emulated, stats: bool, packing: str) -> None:
    """On TE's statistics one call, keys moved to their queries' rows (more queries than
    keys, fewer, none; NaN in every row whose true gradient is 0, which must not reach a
    real gradient); after a forward, two calls, each after its own forward. Back to back:
    the valid offsets passed as the padded ones, as DotProductAttention passes them."""
    gaps = dict(gap_q=[0, 3, 1, 2], gap_kv=[2, 2, 0, 1]) if packing == "gaps" else {}
    batch = _batch([7, 2, 0, 5], [3, 6, 4, 5], mask="padding_causal", **gaps)
    call = _call(batch, tight=True, stats_rows=batch.rows_q if stats else None)
    if packing == "back-to-back":
        call["cu_seqlens_q_padded"], call["cu_seqlens_kv_padded"] = (
            call["cu_seqlens_q"],
            call["cu_seqlens_kv"],
        )
        assert _decide(call).back_to_back == (True, True)
    dead = dead_masks(batch, "cpu")
    for name, rows in (("q", dead.q), ("k", dead.kv), ("v", dead.kv)):
        call[name] = call[name].masked_fill(rows.view(-1, 1, 1), float("nan"))
    _check(batch, call, fallback.exact_backward(call))
    assert emulated.calls == (["bwd"] if stats else ["fwd", "bwd"] * 2)
    if stats:  # no forward: the device's one seed and offset placeholder
        seed, offset = fallback._philox_placeholders(torch.device("cpu"))
        assert all(r[0] is seed and r[1] is offset for r in emulated.rng), emulated.rng


def test_no_padded_offsets(emulated) -> None:
    batch = _batch([5, 0, 3], [2, 6, 0], mask="padding_causal_bottom_right", tail=3)
    call = _call(batch, padded=False)
    _check(batch, call, fallback.exact_backward(call))


@pytest.mark.parametrize("layout", ["thd_t2hd", "thd_th2d", "t3hd", "th3d"])
def test_packed_layouts_come_back_as_views_of_one_buffer(emulated, layout) -> None:
    lens, gaps = [4, 0, 6], dict(gap_q=[1, 0, 2], gap_kv=[1, 0, 2], tail=2)
    heads = (2, 2) if layout in ("t3hd", "th3d") else (4, 2)
    batch = _batch(lens, lens, heads, mask="padding_causal_bottom_right", **gaps)
    call = _call(batch, layout=layout)
    out = fallback.exact_backward(call)
    packed = out[1:3] if layout.startswith("thd_") else out[:3]
    assert all(t._base is packed[0]._base for t in packed)
    _check(batch, call, out)


# ----------------------------------------------------------------------------- declines
def _half_call() -> Dict[str, Any]:
    return _call(_batch([3, 2], [3, 4], dtype=torch.bfloat16))


QKVO = ("q", "k", "v", "d_o")
#: An edit of the bf16 CPU call (a dict, or a function of the call giving one), then words
#: of the reason ``decide`` gives: each argument it cannot reproduce, else "not CUDA".
DECLINED = [
    ({}, "not CUDA"),
    (dict(dropout=0.1), "dropout"),
    (dict(attn_bias_type="post_scale_bias"), "attn_bias_type"),
    (dict(softmax_type="learnable"), "softmax_type"),
    (dict(dqkv_quantizer=object()), "FP8"),
    (dict(qkv_layout="bshd_bshd_bshd"), "qkv_layout"),
    (dict(dqkv_layout="sbh3d"), "dqkv_layout"),
    (dict(o_format="sbhd"), "o_format"),
    (dict(attn_mask_type="arbitrary"), "attn_mask_type"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(bottom_right_diagonal="yes", attn_mask_type="padding"), "bottom_right_diagonal"),
    (dict(cu_seqlens_kv_padded=None), "padded"),
    (dict(max_seqlen_q=None), "max_seqlen_q"),
    (dict(fake_dtype=torch.float16), "fake_dtype"),
    (dict(max_seqlen_q=True), "max_seqlen"),
    (
        lambda c: {**{n: c[n].float() for n in QKVO}, "fake_dtype": torch.float32},
        "dtype torch.float32",
    ),
    (lambda c: dict(v=c["v"][..., :4].contiguous()), "d_o [t, h_q, d_v]"),
    (lambda c: dict(k=c["k"][..., :4]), "k's must be q's"),
    (lambda c: dict(k=c["k"].half()), "k differs from q"),
    (lambda c: {n: c[n][:2] for n in OFFSET_NAMES}, "not CUDA"),  # the first sequence
    (dict(window_size=None), "not CUDA"),
    (lambda c: {n: c[n][..., :4] for n in QKVO}, "head dim"),
    (lambda c: dict(d_o=c["d_o"].half()), "d_o"),
    (dict(qkv_layout="t3hd", dqkv_layout="t3hd"), "t3hd"),
    (dict(qkv_layout="th3d", dqkv_layout="th3d"), "th3d"),
    (lambda c: dict(d_o=c["d_o"].to("meta")), "d_o differs from q in dtype or device"),
    (lambda c: {n: torch.cat((c[n],) * 2, -1) for n in ("v", "d_o")}, "v's <= q's"),
    (lambda c: {n: c[n][..., :6] for n in ("v", "d_o")}, "multiples of 8"),
]


@pytest.mark.parametrize("edit, words", DECLINED)
def test_a_declined_call_names_its_reason(edit: Any, words: str) -> None:
    """``decide`` names what the fallback cannot reproduce, and ``exact_backward`` refuses
    such a call with that reason."""
    call = _half_call()
    call.update(edit(call) if callable(edit) else edit)
    reason = _decide(call)
    assert isinstance(reason, str) and words in reason, reason
    with pytest.raises(ValueError) as err:
        fallback.exact_backward(call)
    assert str(err.value) == f"exact_backward cannot reproduce this call: {reason}"


#: Edits the input gate refuses before the fallback is asked (the wrapper checks q, k, v
#: and the offsets first; exact_backward does the same), then the argument it names: one
#: of its offsets, one of its tensors (each message: tests/test_checks.py).
GATED = [
    (dict(cu_seqlens_kv=torch.tensor([0, 3], dtype=torch.int32)), "cu_seqlens_kv"),
    (lambda c: {n: c[n][:, :1].repeat(1, 3, 1) for n in ("k", "v")}, "k"),  # TE's name
]


@pytest.mark.parametrize("edit, name", GATED)
def test_exact_backward_checks_its_inputs_as_the_wrapper_does(edit: Any, name: str) -> None:
    call = _half_call()
    call.update(edit(call) if callable(edit) else edit)
    with pytest.raises(InputError, match=f"^{name}: expected"):
        fallback.exact_backward(call)


def test_head_dim_reason() -> None:
    """The head dims the fallback serves (doctor asks with one dim, or q/k and v)."""
    accepted, declined = ((256,), (256, 128)), ((264,), (128, 256), (8, 0))
    assert all(fallback.head_dim_reason(*dims) is None for dims in accepted)
    assert all("head dims" in str(fallback.head_dim_reason(*dims)) for dims in declined)


@pytest.mark.parametrize(
    "cc, built, schema, device, words",
    [
        ((8, 0), True, "window_size_left", "cuda:1", None),
        ((7, 5), True, "window_size_left", "cuda", "compute capability 8.0"),
        ((8, 0), False, "window_size_left", "cuda", "no FlashAttention-2"),
        ((8, 0), None, "window_size_left", "cuda", None),  # a torch without the query
        ((8, 0), True, "scale", "cuda", "no FlashAttention-2 with window"),
    ],
)
def test_probe_device_reads_torch_and_the_gpu(monkeypatch, cc, built, schema, device, words):
    """FlashAttention-2 built, with window arguments, on the tensors' (or current) GPU 8.0+."""
    asked: List[int] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or cc)
    monkeypatch.delattr(torch.backends.cuda, "is_flash_attention_available")
    if built is not None:
        monkeypatch.setattr(
            torch.backends.cuda, "is_flash_attention_available", lambda: built, False
        )
    op = SimpleNamespace(default=SimpleNamespace(_schema=f"aten::f(Tensor a, *, SymInt? {schema})"))
    monkeypatch.setattr(fallback, "_aten", SimpleNamespace(_flash_attention_backward=op))
    reason = fallback._probe_device(torch.bfloat16, torch.device(device))
    assert reason is None if words is None else words in reason, reason
    read = words in (None, "compute capability 8.0")  # the build is known good
    assert asked == ([1 if device == "cuda:1" else 3] if read else []), asked


def test_te_2_8_arguments() -> None:
    """TE 2.8 .. 2.14 name the output dtype ``dqkv_dtype`` (a tex.DType) and have no formats."""

    DType = enum.Enum("DType", "kBFloat16 kFloat16")  # str(): as transformer_engine_torch's
    call = _half_call()
    for name in ("o_format", "do_format", "dqkv_layout", "bottom_right_diagonal", "cuda_graph"):
        del call[name]
    assert "not CUDA" in _decide({**call, "dqkv_dtype": DType.kBFloat16})
    assert "dqkv_dtype" in _decide({**call, "dqkv_dtype": DType.kFloat16})
    # Before TE 2.12 cuDNN gets no right bound for a non-causal mask: a window is not TE's rule.
    for window in ((-1, 0), (3, 2)):
        reason = _decide({**call, "attn_mask_type": "padding", "window_size": window})
        assert "TE < 2.12" in reason, reason


@pytest.mark.parametrize(
    "version, positional", [("2.8", True), ("2.20", False)], ids=["2.8-positional", "2.20"]
)  # each release and each way once: reading every release each way is test_wrapper.py's
def test_calls_picked_from_te_signatures(emulated, version: str, positional: bool) -> None:
    """What the wrapper hands over: TE's own signature read by name (keywords, or every
    argument positional as TE's call sites pass them), defaults applied (2.8 has
    ``dqkv_dtype`` and no formats, dqkv_layout or bottom_right_diagonal)."""
    from fakes.te_signatures import build_fake

    batch = _batch([5, 0, 3], [4, 2, 6], mask="padding_causal_bottom_right", gap_kv=[1, 0, 2])
    fake = build_fake(version, lambda arguments: arguments)
    params = inspect.signature(fake).parameters
    bound = fake(**{k: v for k, v in _call(batch, dqkv_dtype=torch.float32).items() if k in params})
    sig = Signature(fake)
    a = sig.pick_all([bound[n] for n in params], {}) if positional else sig.pick_all((), bound)
    recipe = fallback.decide(a, sig.has_right_bound)
    assert not isinstance(recipe, str), recipe
    _check(batch, bound, fallback.run(recipe, a))


# ------------------------------------------------------- TE's statistics, determinism
@pytest.mark.parametrize("extra_rows", [0, 7], ids=["rows_q", "te-2.10-larger"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4]], ids=["tl", "br", "win"])
def test_tes_statistics_replace_the_forward(emulated, case, extra_rows: int) -> None:
    """Issue 32: TE's ``o`` and ``aux_ctx_tensors[0]`` (``[t, h, 1]``, or more rows, as TE
    <= 2.10 allocates) feed FlashAttention-2's backward: no forward runs, and the result is
    the fp32 reference's. Statistics mapped to the wrong rows or heads fail here."""
    lq, lk, kw = LAYOUTS[1]
    mask, window, brd = case
    batch = _batch(lq, lk, (4, 2), mask=mask, window=window, bottom_right_diagonal=brd, **kw)
    call = _call(batch, tight=True, stats_rows=batch.rows_q + extra_rows)
    assert _decide(call).reuse_stats
    _check(batch, call, fallback.exact_backward(call))
    assert emulated.calls == ["bwd"]


@pytest.mark.parametrize(
    "edit",
    [
        lambda c, t, h: dict(aux_ctx_tensors=[torch.zeros(1, h, t, 1)]),  # [b, h, s, 1]: older
        lambda c, t, h: dict(aux_ctx_tensors=[torch.zeros(t, h, 1, dtype=torch.float64)]),
        lambda c, t, h: dict(aux_ctx_tensors=[torch.zeros(t - 1, h, 1)]),
        lambda c, t, h: dict(aux_ctx_tensors=[torch.zeros(t, h + 1, 1)]),
        lambda c, t, h: dict(aux_ctx_tensors=[]),
        lambda c, t, h: dict(o=c["o"][:-2]),  # issue #51 (8): TE's o of another call
        lambda c, t, h: dict(o=c["o"][:, :-1]),
        lambda c, t, h: dict(o=torch.cat((c["o"],) * 2, -1)),  # q's head dim, not v's
        lambda c, t, h: dict(o=c["o"].double()),
        lambda c, t, h: dict(o=None),
    ],
    ids=["stats-bhs1", "stats-float64", "stats-fewer-rows", "stats-other-heads", "no-stats",
         "o-fewer-rows", "o-other-heads", "o-head-dim", "o-float64", "no-o"],
)  # fmt: skip
def test_other_statistics_or_outputs_recompute_the_forward(emulated, edit) -> None:
    """TE's statistics or output in another layout than the call's q and v: FlashAttention-2
    recomputes the forward rather than read them, and the result is exact."""
    batch = _batch([5, 0, 3], [4, 2, 6], mask="padding_causal_bottom_right", gap_kv=[1, 0, 2])
    call = _call(batch, stats_rows=batch.rows_q)
    call.update(edit(call, batch.rows_q, batch.heads_q))
    assert not _decide(call).reuse_stats
    _check(batch, call, fallback.exact_backward(call))
    assert emulated.calls == ["fwd", "bwd"]


def _mode() -> Tuple[bool, bool, bool]:
    """torch's deterministic mode: on, warn-only, filling uninitialized memory."""
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


@pytest.mark.parametrize("before", [(False, False), (False, True), (True, True), (True, False)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_calls_run_in_torchs_deterministic_mode(
    emulated, monkeypatch: pytest.MonkeyPatch, deterministic: bool, before: Tuple[bool, bool]
) -> None:
    """Issue 32: ``deterministic=True`` is served, with FlashAttention-2's backward (alone)
    in torch's deterministic mode, not warn-only; the caller's mode comes back afterwards,
    also when the backward raises (no filling of memory it writes). A mode already on, and
    ``deterministic=False``, leave the caller's mode alone."""
    seen: List[Tuple[bool, bool, bool]] = []
    backward = emulated._flash_attention_backward

    def spy(*args: Any, **kw: Any) -> tuple:
        seen.append(_mode())
        return backward(*args, **kw)

    monkeypatch.setattr(emulated, "_flash_attention_backward", spy)
    batch = _batch([5, 0, 3], [4, 2, 6], mask="padding_causal", gap_kv=[1, 0, 2])
    call = _call(batch, deterministic=deterministic, stats_rows=batch.rows_q)
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    caller = _mode()
    inside = caller if not deterministic or before == (True, False) else (True, False, False)
    try:
        _check(batch, call, fallback.exact_backward(call))
        assert _mode() == caller
        assert seen == [inside]  # the split on TE's statistics: one call
        monkeypatch.setattr(emulated, "_flash_attention_backward", lambda *a, **k: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            fallback.exact_backward(call)
        assert _mode() == caller
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "version, available, deterministic",
    [("2.4.1+cu121", False, True), ("2.5.0", True, True),
     ("2.6.0a0+ecf3bae40a.nv25.01", True, True), ("2.13.0+cpu", True, True),
     ("2.4.1+cu121", False, False)],  # not asked: nothing said (where served: the test above)
    ids=["2.4", "2.5", "ngc-pre-release", "2.13", "2.4-not-asked"],
)  # fmt: skip
def test_deterministic_without_torch_support_is_served_and_said(
    emulated, monkeypatch, caplog: pytest.LogCaptureFixture, deterministic, version, available
) -> None:
    """FlashAttention-2 has a deterministic backward from torch 2.5 (NVIDIA's containers'
    pre-release builds included). Before, ``deterministic=True`` is served exactly, not in
    deterministic mode, and said once; otherwise nothing is said."""
    monkeypatch.setattr(torch, "__version__", version)
    batch = _batch([5, 0, 3], [4, 2, 6], mask="padding_causal_bottom_right")
    call = _call(batch, deterministic=deterministic)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        for _ in range(2):
            assert _decide(call).deterministic is (deterministic and available)
            _check(batch, call, fallback.exact_backward(call))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == (deterministic and not available), said
    assert all("not bitwise repeatable" in m and "exact" in m for m in said), said


def test_ready_keeps_loadable_tensors_and_copies_the_rest() -> None:
    """FlashAttention-2 needs a unit last stride and 16-byte aligned rows."""
    base = torch.zeros(6, 4, 8, dtype=torch.bfloat16)
    assert fallback._ready(base) is base
    heads_12 = torch.zeros(6, 4, 12, dtype=torch.bfloat16)[..., :8]  # 24-byte head stride
    shifted = base.view(-1)[4:].view(-1)[:184].view(23, 8)
    for bad in (base.transpose(1, 2), base[:, :, 1:], shifted, heads_12):
        got = fallback._ready(bad)
        assert got is not bad and got.is_contiguous() and torch.equal(got, bad)


# ------------------------------------------------------------------------ row moves
def _moves_case(seed: int, device: str = "cpu"):
    """Random sides: zero-length sequences, gaps, more or fewer rows on either side, a tail;
    two tensors of different head dims, the second a strided view (heads not adjacent)."""
    rnd = random.Random(seed)
    nseq = rnd.randint(1, 6)
    lens = [[rnd.choice([0, 1, 3, 5, 8]) for _ in range(nseq)] for _ in range(2)]
    sides, rows = [], []
    for side in range(2):
        cu, pad = [0], [rnd.randint(0, 2)]
        for n in lens[side]:
            cu.append(cu[-1] + n)
            pad.append(pad[-1] + n + rnd.randint(0, 3))
        padded = rnd.random() < 0.7 or pad[0] != 0
        i32 = dict(dtype=torch.int32, device=device)
        cu_t = torch.tensor(cu, **i32).repeat_interleave(2)[::2]  # a strided view
        sides.append((cu_t, torch.tensor(pad, **i32) if padded else None))
        rows.append((pad[-1] if padded else cu[-1]) + rnd.randint(0, 3))
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rows[1], 3, 5, generator=gen)
    b = torch.randn(rows[1], 3, 2, 4, generator=gen)[:, :, 1]  # head stride 8, dim 4
    return [a.to(device), b.to(device)], rows[0], sides[0], sides[1]


def _by_the_rule(tensors, rows: int, to, source) -> List[torch.Tensor]:
    """``move_rows``' rule, one row at a time in Python."""
    (cu_t, pad_t), (cu_s, pad_s) = to, source
    pad_t = cu_t if pad_t is None else pad_t
    pad_s = cu_s if pad_s is None else pad_s
    outs = [torch.zeros((rows, *t.shape[1:]), dtype=t.dtype) for t in tensors]
    for b in range(cu_t.numel() - 1):
        n = min(int(cu_t[b + 1] - cu_t[b]), int(cu_s[b + 1] - cu_s[b]))
        for p in range(n):
            for out, t in zip(outs, tensors):
                out[int(pad_t[b]) + p] = t[int(pad_s[b]) + p]
    return outs


@pytest.mark.parametrize("seed", range(12))
def test_row_moves_follow_the_rule(seed: int) -> None:
    tensors, rows, to, source = _moves_case(seed)
    got = move_rows(tensors, rows, to, source, impl="torch")
    want = _by_the_rule(tensors, rows, to, source)
    assert all(torch.equal(g, w) for g, w in zip(got, want)), seed


def _moves_on_impossible_offsets(impl: str) -> None:
    """Offsets no batch has: 2 rows of an empty buffer give zeros; descending and
    out-of-buffer offsets read and write inside the buffers."""
    i32 = dict(dtype=torch.int32)
    to, source = (torch.tensor([0, 3], **i32), None), (torch.tensor([0, 2], **i32), None)
    got = move_rows([torch.randn(0, 2, 3), torch.randn(0, 2, 3)], 4, to, source, impl=impl)
    assert all(g.shape == (4, 2, 3) and not g.any() for g in got)
    to = (torch.tensor([0, 9, 4], **i32), torch.tensor([0, -5, 2], **i32))
    source = (torch.tensor([0, 30, 31], **i32), torch.tensor([3, 20, 1], **i32))
    got = move_rows([torch.randn(6, 2, 3), torch.randn(6, 1, 2)], 5, to, source, impl=impl)
    assert [tuple(g.shape) for g in got] == [(5, 2, 3), (5, 1, 2)]


def test_row_moves_on_impossible_offsets() -> None:
    _moves_on_impossible_offsets("torch")


def _kernel_matches_torch(device: str, seeds: range) -> None:
    for seed in seeds:
        tensors, rows, to, source = _moves_case(seed, device)
        got = move_rows(tensors, rows, to, source, impl="triton")
        want = move_rows(tensors, rows, to, source, impl="torch")
        assert all(torch.equal(g, w) for g, w in zip(got, want)), seed


WORKER_CHECKS = {
    "matches_torch": lambda: _kernel_matches_torch("cpu", range(12)),
    "impossible_offsets": lambda: _moves_on_impossible_offsets("triton"),
}

row_moves_interpreted = interpreted_checks("row_moves_interpreted", __file__)


@pytest.mark.parametrize("check", list(WORKER_CHECKS))
def test_row_moves_kernel_under_the_interpreter(row_moves_interpreted: dict, check: str) -> None:
    result = row_moves_interpreted[check]
    assert result["ok"], f"{check} failed under the interpreter:\n{result['error']}"


@pytest.mark.gpu
def test_compiled_row_moves_kernel_matches_torch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    _kernel_matches_torch("cuda", range(40))


if __name__ == "__main__":
    worker_main(WORKER_CHECKS)
