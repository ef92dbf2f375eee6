"""The post-pass zeroes exactly the rows a brute-force oracle says have zero gradient.

The oracle (``fakes/oracle.py``) builds every sequence's full boolean mask matrix from
the definition; these tests compare it with ``zero_dead_rows``/``dead_row_masks`` over
random ragged batches (q- and kv-empty sequences, padding gaps, rows before the first
and after the last offset), every mask type plus unknown ones, windows, both diagonal
alignments, packed and separate layouts, with NaN/Inf in the rows that must be cleared.
A real fp64 attention backward checks the oracle itself: rows with non-zero gradient are
exactly the rows it keeps, and the post-pass never zeroes one of them.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import te_gqa_fix
from fakes.oracle import (
    KNOWN,
    Ragged,
    assert_rows,
    attention_matrix,
    bits,
    expected_keep,
    is_ambiguous,
    make_ragged,
)
from fakes.te_outputs import FakeTE, call_arguments
from te_gqa_fix import zero_dead_rows
from te_gqa_fix.masks import KNOWN_MASK_TYPES, key_interval, key_span
from te_gqa_fix.postpass import dead_row_masks
from te_gqa_fix.postpass.offset_errors import OffsetsError
from te_gqa_fix.wrapper import wrapper_for

ACCEPTED_MASKS = (*KNOWN_MASK_TYPES, "arbitrary")  # others are refused: test_bad_input.py
MASKS = (*ACCEPTED_MASKS, "padding_bottom_right_typo", None)
LAYOUTS = ("separate", "thd_t2hd", "thd_th2d")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POISON = (float("nan"), float("inf"), float("-inf"), 1000.0)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- strategies

small = st.integers(0, 3)


@st.composite
def raggeds(draw: st.DrawFn, max_seqs: int = 6, max_len: int = 6) -> Ragged:
    n = draw(st.integers(0, max_seqs))
    length = st.one_of(st.just(0), st.integers(0, max_len))
    pairs = [(draw(length), draw(length)) for _ in range(n)]
    padded = draw(st.booleans())
    gap_list = st.lists(small, min_size=n, max_size=n)
    return make_ragged(
        pairs,
        padded=padded,
        gaps_q=draw(gap_list),
        gaps_kv=draw(gap_list),
        lead_q=draw(small),
        lead_kv=draw(small),
        tail_q=draw(small),
        tail_kv=draw(small),
    )


def _is_causal(mask: object) -> bool:
    return isinstance(mask, str) and mask in KNOWN and KNOWN[mask][0]


@st.composite
def mask_args(draw: st.DrawFn, masks: Tuple[object, ...] = MASKS, bad: bool = True):
    """``(attn_mask_type, window_size, bottom_right_diagonal)`` as TE passes them.

    Causal masks get ``right`` in {-1, 0} (what TE's check_set_window_size leaves);
    ``right > 0`` with a causal mask is tested separately (the library keeps a superset).
    With ``bad``, a few malformed windows are drawn too: ``key_span`` must fall back to the
    conservative set, which the oracle models the same way (the public API refuses them:
    tests/test_bad_input.py's ``SHARED`` rows).
    """
    mask = draw(st.sampled_from(masks))
    kinds = ["window", "window", "window", "none", "default", *(["bad"] if bad else [])]
    kind = draw(st.sampled_from(kinds))
    left = draw(st.integers(-1, 6))
    right = draw(st.sampled_from([-1, 0]) if _is_causal(mask) else st.integers(-1, 6))
    windows = {"window": (left, right), "none": None, "default": (-1, -1)}
    bad = st.sampled_from([(-2, 0), (0, -5), (1,), "wide"])
    window = windows[kind] if kind in windows else draw(bad)
    brd = draw(st.sampled_from([None, True, False]))
    return mask, window, brd


def _random_rows(shape: Tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)


def _poison_dead_rows(t: torch.Tensor, keep: List[bool]) -> None:
    for row, kept in enumerate(keep):
        if not kept:
            t[row] = POISON[row % len(POISON)]


def _make_grads(
    ragged: Ragged,
    layout: str,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    keep_q: List[bool],
    keep_kv: List[bool],
    seed: int,
):
    """dq, dk, dv (views of one buffer for packed layouts) and the tensors to check."""
    gen = torch.Generator().manual_seed(seed)
    dq = _random_rows((ragged.rows_q, heads_q, head_dim), dtype, gen)
    _poison_dead_rows(dq, keep_q)
    if layout == "thd_t2hd":
        buf = _random_rows((ragged.rows_kv, 2, heads_kv, head_dim), dtype, gen)
        dk, dv = buf[:, 0], buf[:, 1]
        checked = {"dkv": buf}
    elif layout == "thd_th2d":
        buf = _random_rows((ragged.rows_kv, heads_kv, 2, head_dim), dtype, gen)
        dk, dv = buf[:, :, 0], buf[:, :, 1]
        checked = {"dkv": buf}
    else:
        dk = _random_rows((ragged.rows_kv, heads_kv, head_dim), dtype, gen)
        dv = _random_rows((ragged.rows_kv, heads_kv, head_dim), dtype, gen)
        checked = {"dk": dk, "dv": dv}
    for t in checked.values():
        _poison_dead_rows(t, keep_kv)
    if layout != "separate":  # the views really alias the buffer
        assert dk._base is checked["dkv"] and dv._base is checked["dkv"]
    checked["dq"] = dq
    return dq, dk, dv, checked


# ------------------------------------------------------------------ the main property


@SETTINGS
@given(
    ragged=raggeds(),
    masks=mask_args(ACCEPTED_MASKS, bad=False),
    layout=st.sampled_from(LAYOUTS),
    with_dq=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    heads_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_zero_set_and_dead_row_masks_match_brute_force_oracle(
    ragged: Ragged,
    masks,
    layout: str,
    with_dq: bool,
    dtype: torch.dtype,
    heads_kv: int,
    group: int,
    head_dim: int,
    seed: int,
) -> None:
    """On mask arguments the public API accepts (the others: test_bad_input.py's SHARED),
    dead_row_masks and zero_dead_rows give exactly the oracle's rows: kept bit for bit,
    the rest +0 whatever they held; dq=None leaves dq alone."""
    mask, window, brd = masks
    keep_q, keep_kv = expected_keep(ragged, mask, window, brd)
    dq, dk, dv, checked = _make_grads(
        ragged, layout, heads_kv * group, heads_kv, head_dim, dtype, keep_q, keep_kv, seed
    )
    before = {name: t.clone() for name, t in checked.items()}
    offsets = ragged.tensors()
    args = dict(attn_mask_type=mask, window_size=window, bottom_right_diagonal=brd)
    rows = dict(rows_q=ragged.rows_q if with_dq else None, rows_kv=ragged.rows_kv)
    dead = dead_row_masks(*offsets, **rows, **args)
    assert dead.kv.dtype == torch.bool and (~dead.kv).tolist() == keep_kv
    if with_dq:
        assert dead.q is not None and (~dead.q).tolist() == keep_q
    else:
        assert dead.q is None
    zero_dead_rows(dq if with_dq else None, dk, dv, *offsets, **args, impl="torch")

    for name, t in checked.items():
        if name == "dq" and not with_dq:
            assert torch.equal(bits(t), bits(before[name])), "dq=None must leave dq alone"
            continue
        keep = keep_q if name == "dq" else keep_kv
        # Kept rows bit for bit; zeroed rows exactly +0, whatever was there (NaN, Inf).
        assert_rows(t, before[name], keep, name)


@SETTINGS
@given(
    lq=st.integers(0, 8),
    lk=st.integers(0, 8),
    masks=mask_args(),
)
def test_key_interval_is_the_set_of_attended_keys(lq: int, lk: int, masks) -> None:
    mask, window, brd = masks
    matrix = attention_matrix(lq, lk, mask, window, brd)
    attended = [j for j in range(lk) if any(matrix[i][j] for i in range(lq))]
    if attended and is_ambiguous(mask, window, brd):  # one interval: the hull
        attended = list(range(attended[0], attended[-1] + 1))
    lo, hi = key_interval(lq, lk, key_span(mask, window, brd))
    assert list(range(lo, hi)) == attended


@SETTINGS
@given(
    ragged=raggeds(),
    left=st.integers(-1, 6),
    right=st.integers(1, 6),
    brd=st.sampled_from([None, True, False]),
)
def test_causal_mask_with_positive_right_window_keeps_a_superset(
    ragged: Ragged, left: int, right: int, brd: Optional[bool]
) -> None:
    # A causal mask cuts every query at its diagonal, so the true attended set is that of
    # right = 0. The library keeps the declared (wider) window there: more rows kept than
    # needed is allowed, fewer is not.
    for mask in ("padding_causal", "padding_causal_bottom_right", "causal"):
        _, true_keep = expected_keep(ragged, mask, (left, 0), brd)
        dead = dead_row_masks(*ragged.tensors(), rows_q=None, rows_kv=ragged.rows_kv,
                              attn_mask_type=mask, window_size=(left, right),
                              bottom_right_diagonal=brd)  # fmt: skip
        kept = (~dead.kv).tolist()
        assert all(k for k, t in zip(kept, true_keep) if t), (mask, kept, true_keep)


# ------------------------------------------------------------- hand-worked examples


def test_hand_worked_example_padding_causal() -> None:
    # Sequences (lq, lk): (2, 3), (0, 2), (3, 0); one padding row after each sequence,
    # one row before the first, one after the last.
    ones = dict(gaps_q=[1, 1, 1], gaps_kv=[1, 1, 1], lead_q=1, lead_kv=1, tail_q=1, tail_kv=1)
    ragged = make_ragged([(2, 3), (0, 2), (3, 0)], **ones)
    # buffer offsets: q (1, 4, 5, 9), kv (1, 5, 8, 9), in 10 rows each
    cu_q, cu_kv, pad_q, pad_kv = ragged.tensors()
    F, T = False, True
    cases = {
        # top-left causal: the 2 queries of sequence 0 see keys 0..1 only
        "padding_causal": [F, T, T, F, F, F, F, F, F, F],
        # bottom-right causal: the last query sees all 3 keys
        "padding_causal_bottom_right": [F, T, T, T, F, F, F, F, F, F],
        "padding": [F, T, T, T, F, F, F, F, F, F],
    }
    for mask, want_kv in cases.items():
        dead = dead_row_masks(
            cu_q, cu_kv, pad_q, pad_kv, rows_q=10, rows_kv=10, attn_mask_type=mask
        )
        assert (~dead.kv).tolist() == want_kv, mask
        # dQ: sequence 0's two queries; sequence 2 has queries but no keys.
        assert (~dead.q).tolist() == [F, T, T, F, F, F, F, F, F, F], mask
        assert expected_keep(ragged, mask) == ([F, T, T, F, F, F, F, F, F, F], want_kv)


def test_hand_worked_example_sliding_window_alignments() -> None:
    # One sequence, lq = 2, lk = 6, window (1, 0): top-left query i sees [i-1, i];
    # bottom-right (s = 4) sees [i+3, i+4].
    ragged = make_ragged([(2, 6)], padded=False)
    cu_q, cu_kv, _, _ = ragged.tensors()
    F, T = False, True
    for brd, want in (
        (False, [T, T, F, F, F, F]),
        (True, [F, F, F, T, T, T]),
        (None, [T, T, F, F, F, F]),  # padding: top-left by name
    ):
        dead = dead_row_masks(cu_q, cu_kv, rows_q=None, rows_kv=6, attn_mask_type="padding",
                              window_size=(1, 0), bottom_right_diagonal=brd)  # fmt: skip
        assert (~dead.kv).tolist() == want, brd
    # Causal name vs explicit flag disagree: both alignments are kept. Queries attend keys
    # {0, 1} (top-left) or {3, 4, 5} (bottom-right); key 2 is attended by neither, but
    # the library keeps one interval per sequence, the hull [0, 6): a superset.
    union = attention_matrix(2, 6, "padding_causal", (1, 0), True)
    assert [any(col) for col in zip(*union)] == [T, T, F, T, T, T]
    dead = dead_row_masks(cu_q, cu_kv, rows_q=None, rows_kv=6, attn_mask_type="padding_causal",
                          window_size=(1, 0), bottom_right_diagonal=True)  # fmt: skip
    assert (~dead.kv).tolist() == [T, T, T, T, T, T]


# ------------------------------------------------------------- no host read (graph safe)


_HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
               "aten::_unique2", "aten::unique_consecutive")  # fmt: skip


class _NoHostRead(TorchDispatchMode):
    """Fails on an op that reads a tensor value on the host (``.item()``, ``bool(t)``) or
    whose output shape depends on values (boolean indexing, nonzero): a sync on CUDA, and
    an error inside CUDA-graph capture."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        bool_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        assert name not in _HOST_READS and not bool_index, f"host read: {func}"
        return func(*args, **(kwargs or {}))


def _read(*args: object, **kwargs: object) -> None:
    raise AssertionError("host read")


def test_the_post_pass_and_the_wrapper_read_no_value_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What lets the PyTorch path and the wrapper run inside CUDA-graph capture: shape-driven
    # device ops only, impossible offsets included (judged on the device, recorded without a
    # read). Tensor.tolist, .numpy and .cpu read without a dispatched op: trapped too.
    for name in ("tolist", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, _read)
    with pytest.raises(AssertionError, match="host read"), _NoHostRead():
        bool(torch.ones(1) > 0)  # the checks can fail
    with pytest.raises(AssertionError, match="host read"):
        torch.ones(1).tolist()
    ragged = make_ragged([(2, 3), (0, 2), (3, 0)], gaps_q=[1, 0, 1], gaps_kv=[1, 1, 0], tail_kv=2)
    offsets = ragged.tensors()
    bad = (offsets[0], torch.tensor([0, 3, 1, 5], dtype=torch.int32), *offsets[2:])
    dq = torch.randn(ragged.rows_q, 2, 2)
    dk, dv = torch.randn(ragged.rows_kv, 1, 2), torch.randn(ragged.rows_kv, 1, 2)
    rows = dict(rows_q=ragged.rows_q, rows_kv=ragged.rows_kv)
    for mask in (*KNOWN_MASK_TYPES, "arbitrary"):
        with _NoHostRead():
            zero_dead_rows(dq, dk, dv, *offsets, attn_mask_type=mask, window_size=(2, 0),
                           impl="torch")  # fmt: skip
            dead_row_masks(*offsets, **rows, attn_mask_type=mask, window_size=(1, 0))
    with pytest.raises(OffsetsError), _NoHostRead():  # raised from the host word, not a read
        zero_dead_rows(dq, dk, dv, *bad, impl="torch")
    fake = FakeTE("2.20")
    arguments = call_arguments("2.20", ragged, attn_mask_type="padding_causal_bottom_right",
                               window_size=(1, 0))  # fmt: skip
    with _NoHostRead():
        wrapper_for(fake.fn)(**arguments)
    assert te_gqa_fix.call_counts()["fixed"] == 1


# ------------------------------------------------- against a real fp64 attention backward


def _reference_backward(
    ragged: Ragged,
    mask: object,
    window: object,
    brd: Optional[bool],
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    seed: int,
):
    """True dQ, dK, dV of masked GQA attention in fp64, laid out in the THD buffers."""
    gen = torch.Generator().manual_seed(seed)
    dq = torch.zeros(ragged.rows_q, heads_q, head_dim, dtype=torch.float64)
    dk = torch.zeros(ragged.rows_kv, heads_kv, head_dim, dtype=torch.float64)
    dv = torch.zeros(ragged.rows_kv, heads_kv, head_dim, dtype=torch.float64)
    pad_q, pad_kv = ragged.buffer_offsets("q"), ragged.buffer_offsets("kv")
    group = heads_q // heads_kv
    for b in range(ragged.nseq):
        lq, lk = ragged.lq[b], ragged.lk[b]
        q = torch.randn(lq, heads_q, head_dim, generator=gen, dtype=torch.float64)
        k = torch.randn(lk, heads_kv, head_dim, generator=gen, dtype=torch.float64)
        v = torch.randn(lk, heads_kv, head_dim, generator=gen, dtype=torch.float64)
        d_o = torch.randn(lq, heads_q, head_dim, generator=gen, dtype=torch.float64)
        for t in (q, k, v):
            t.requires_grad_(True)
        allowed = torch.tensor(
            attention_matrix(lq, lk, mask, window, brd), dtype=torch.bool
        ).reshape(lq, lk)
        out = []
        for h in range(heads_q):
            kh = h // group
            scores = (q[:, h] @ k[:, kh].T) / math.sqrt(head_dim)
            scores = scores.masked_fill(~allowed, -1e300)
            probs = torch.softmax(scores, dim=-1) * allowed  # a query with no key: 0
            out.append(probs @ v[:, kh])
        if lq and lk:
            loss = (torch.stack(out, dim=1) * d_o).sum()
            loss.backward()
        for t in (q, k, v):
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        dq[pad_q[b] : pad_q[b] + lq] = q.grad
        dk[pad_kv[b] : pad_kv[b] + lk] = k.grad
        dv[pad_kv[b] : pad_kv[b] + lk] = v.grad
    return dq, dk, dv


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ragged=raggeds(max_seqs=4, max_len=5),
    masks=mask_args(ACCEPTED_MASKS, bad=False),
    heads_kv=st.integers(1, 2),
    group=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_rows_with_nonzero_true_gradient_are_never_zeroed(
    ragged: Ragged, masks, heads_kv: int, group: int, seed: int
) -> None:
    mask, window, brd = masks
    heads_q, head_dim = heads_kv * group, 3
    true_dq, true_dk, true_dv = _reference_backward(
        ragged, mask, window, brd, heads_q, heads_kv, head_dim, seed
    )
    nonzero = lambda t: (t != 0).flatten(1).any(dim=1)  # noqa: E731
    offsets = ragged.tensors()
    args = dict(attn_mask_type=mask, window_size=window, bottom_right_diagonal=brd)
    dead = dead_row_masks(*offsets, rows_q=ragged.rows_q, rows_kv=ragged.rows_kv, **args)
    # 1. The post-pass never zeroes a row whose true gradient is non-zero.
    assert not (dead.q & nonzero(true_dq)).any()
    assert not (dead.kv & nonzero(true_dk)).any()
    assert not (dead.kv & nonzero(true_dv)).any()
    # 2. The oracle is tight: with random inputs dV is non-zero on exactly the key rows
    #    some query attends (so "kept" is not trivially "everything").
    _, attended_kv = expected_keep(ragged, mask, window, brd, exact_union=True)
    assert nonzero(true_dv).tolist() == attended_kv
    # 3. End to end: TE-like output (true gradient on attended rows, stale garbage on
    #    the rows no query attends) comes out of the post-pass equal to the truth.
    keep_q, keep_kv = expected_keep(ragged, mask, window, brd)
    got_q, got_k, got_v = true_dq.clone(), true_dk.clone(), true_dv.clone()
    for got, keep in ((got_q, keep_q), (got_k, keep_kv), (got_v, keep_kv)):
        _poison_dead_rows(got, keep)
    zero_dead_rows(got_q, got_k, got_v, *offsets, **args, impl="torch")
    # (by value: an unattended row's true gradient may be -0.0, the post-pass writes +0.0)
    assert torch.equal(got_q, true_dq)
    assert torch.equal(got_k, true_dk)
    assert torch.equal(got_v, true_dv)
