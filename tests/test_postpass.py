"""The PyTorch post-pass zeroes exactly the rows whose true gradient is 0.

* Against the brute-force oracle (``fakes/oracle.py``: every sequence's full mask matrix,
  from the definition): random ragged batches (q- and kv-empty sequences, padding gaps,
  rows before the first and after the last offset), every mask, windows, both diagonals,
  packed and separate layouts, NaN/Inf in the rows that must be cleared; and a real fp64
  attention backward, which checks the oracle itself.
* Every form of gradient the gate accepts (views of packed buffers, subclasses, TE FP8-like
  storages, tensors under no_grad or inference mode) is zeroed as a contiguous copy is.
* Impossible offsets: the call zeroes nothing; on CPU it raises at once, else the per-device
  error record raises at the next call or in ``check_offset_errors``; ``TE_GQA_FIX_VALIDATE``
  reads them before the kernel would run.
* Which implementation CUDA calls get, and the one warning when it is PyTorch (#53).

The gate's refusals and their messages: tests/test_checks.py. The Triton kernel:
tests/test_kernel.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import te_gqa_fix
from fakes.cuda_metadata import OnCuda
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
from fakes.te_outputs import FakeFloat8, FakeFloat8Storage, FakeTE, call_arguments
from te_gqa_fix import OffsetsError, _kernel, dead_row_masks, postpass, zero_dead_rows
from te_gqa_fix._te import MASKS as KNOWN_MASK_TYPES
from te_gqa_fix.checks import ARGUMENT_BITS
from te_gqa_fix.masks import key_bounds, key_span
from te_gqa_fix.wrapper import wrapper_for

ACCEPTED_MASKS = (*KNOWN_MASK_TYPES, "arbitrary")  # others are refused: test_checks.py
LAYOUTS = ("separate", "thd_t2hd", "thd_th2d")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POISON = (float("nan"), float("inf"), float("-inf"), 1000.0)
CPU = torch.device("cpu")

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- strategies
small = st.integers(0, 3)
#: The strategies a draw of :func:`raggeds` uses, made once: hypothesis checks every new
#: strategy object (what it draws from, whether it can be empty) at its first draw, which
#: cost more than the test itself when each draw made its own.
_LENGTHS = {n: st.one_of(st.just(0), st.integers(0, n)) for n in range(7)}
_GAP_LISTS = [st.lists(small, min_size=n, max_size=n) for n in range(7)]


@st.composite
def raggeds(draw: st.DrawFn, max_seqs: int = 6, max_len: int = 6) -> Ragged:
    n = draw(st.integers(0, max_seqs))
    length = _LENGTHS[max_len]
    pairs = [(draw(length), draw(length)) for _ in range(n)]
    gap_list = _GAP_LISTS[n]
    return make_ragged(
        pairs,
        padded=draw(st.booleans()),
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
def mask_args(draw: st.DrawFn, masks: Tuple[object, ...], bad: bool = True):
    """``(attn_mask_type, window_size, bottom_right_diagonal)`` as TE passes them.

    Causal masks get ``right`` in {-1, 0} (what TE's check_set_window_size leaves); ``right
    > 0`` with a causal mask is tested apart (a superset is kept). With ``bad``, malformed
    windows too: ``key_span`` (which the wrapper calls on what TE accepted) falls back to
    the conservative set, as the oracle does.
    """
    mask = draw(st.sampled_from(masks))
    kinds = ["window", "window", "window", "none", "default", *(["bad"] if bad else [])]
    kind = draw(st.sampled_from(kinds))
    left = draw(st.integers(-1, 6))
    right = draw(st.sampled_from([-1, 0]) if _is_causal(mask) else st.integers(-1, 6))
    windows = {"window": (left, right), "none": None, "default": (-1, -1)}
    bad_windows = st.sampled_from([(-2, 0), (0, -5), (1,), "wide"])
    window = windows[kind] if kind in windows else draw(bad_windows)
    return mask, window, draw(st.sampled_from([None, True, False]))


def _random_rows(shape: Tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)


def _poison_dead_rows(t: torch.Tensor, keep: List[bool]) -> None:
    for row, kept in enumerate(keep):
        if not kept:
            t[row] = POISON[row % len(POISON)]


def _make_grads(ragged: Ragged, layout: str, heads_q: int, heads_kv: int, head_dim: int,
                dtype: torch.dtype, keep_q: List[bool], keep_kv: List[bool], seed: int):  # fmt: skip
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
    checked["dq"] = dq
    return dq, dk, dv, checked


# ------------------------------------------------------------------ against the oracle
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
def test_zero_dead_rows_and_dead_row_masks_match_the_oracle(
    ragged: Ragged, masks, layout: str, with_dq: bool, dtype: torch.dtype, heads_kv: int,
    group: int, head_dim: int, seed: int,
) -> None:  # fmt: skip
    """dead_row_masks and zero_dead_rows give exactly the oracle's rows: kept bit for bit,
    the rest +0 whatever they held (NaN, Inf); dq=None leaves dq alone."""
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
    assert (dead.q is None) if not with_dq else (~dead.q).tolist() == keep_q  # type: ignore[union-attr]
    zero_dead_rows(dq if with_dq else None, dk, dv, *offsets, **args, impl="torch")
    for name, t in checked.items():
        if name == "dq" and not with_dq:
            assert torch.equal(bits(t), bits(before[name])), "dq=None must leave dq alone"
        else:
            assert_rows(t, before[name], keep_q if name == "dq" else keep_kv, name)


@settings(SETTINGS, max_examples=60)  # each example: all 81 (lq, lk) pairs
@given(masks=mask_args((*ACCEPTED_MASKS, "padding_bottom_right_typo", None)))
def test_key_bounds_are_the_attended_keys(masks) -> None:
    """``masks.key_bounds`` (the one Python statement of the rule) for every (lq, lk) up to
    8 at once: the keys some query attends, from the mask matrix (one interval: the hull
    where a causal name and the flag disagree). Masks the wrapper does not understand (TE
    accepted them) keep every key of a sequence with queries."""
    mask, window, brd = masks
    n = 9
    lq = torch.arange(n).repeat_interleave(n)
    lk = torch.arange(n).repeat(n)
    lo, hi = key_bounds(lq, lk, key_span(mask, window, brd))
    for a, b, low, high in zip(lq.tolist(), lk.tolist(), lo.tolist(), hi.tolist()):
        matrix = attention_matrix(a, b, mask, window, brd)
        attended = [j for j in range(b) if any(matrix[i][j] for i in range(a))]
        if attended and is_ambiguous(mask, window, brd):
            attended = list(range(attended[0], attended[-1] + 1))
        assert list(range(low, high)) == attended, (a, b, masks)


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
    # right = 0. The library keeps the declared (wider) window: more rows kept than
    # needed is allowed, fewer is not.
    for mask in ("padding_causal", "padding_causal_bottom_right", "causal"):
        _, true_keep = expected_keep(ragged, mask, (left, 0), brd)
        dead = dead_row_masks(*ragged.tensors(), rows_q=None, rows_kv=ragged.rows_kv,
                              attn_mask_type=mask, window_size=(left, right),
                              bottom_right_diagonal=brd)  # fmt: skip
        kept = (~dead.kv).tolist()
        assert all(k for k, t in zip(kept, true_keep) if t), (mask, kept, true_keep)


def test_hand_worked_example_padding_causal() -> None:
    # Sequences (lq, lk): (2, 3), (0, 2), (3, 0); one padding row after each sequence,
    # one row before the first, one after the last.
    ones = dict(gaps_q=[1, 1, 1], gaps_kv=[1, 1, 1], lead_q=1, lead_kv=1, tail_q=1, tail_kv=1)
    ragged = make_ragged([(2, 3), (0, 2), (3, 0)], **ones)
    # buffer offsets: q (1, 4, 5, 9), kv (1, 5, 8, 9), in 10 rows each
    F, T = False, True
    cases = {
        # top-left causal: the 2 queries of sequence 0 see keys 0..1 only
        "padding_causal": [F, T, T, F, F, F, F, F, F, F],
        # bottom-right causal: the last query sees all 3 keys
        "padding_causal_bottom_right": [F, T, T, T, F, F, F, F, F, F],
        "padding": [F, T, T, T, F, F, F, F, F, F],
        # the conservative set: every key of a sequence with queries
        "arbitrary": [F, T, T, T, F, F, F, F, F, F],
    }
    for mask, want_kv in cases.items():
        dead = dead_row_masks(*ragged.tensors(), rows_q=10, rows_kv=10, attn_mask_type=mask)
        assert (~dead.kv).tolist() == want_kv, mask
        # dQ: sequence 0's two queries; sequence 2 has queries but no keys.
        assert (~dead.q).tolist() == [F, T, T, F, F, F, F, F, F, F], mask  # type: ignore[union-attr]
        assert expected_keep(ragged, mask) == ([F, T, T, F, F, F, F, F, F, F], want_kv)


def test_hand_worked_example_sliding_window_alignments() -> None:
    # One sequence, lq = 2, lk = 6, window (1, 0): top-left query i sees [i-1, i];
    # bottom-right (s = 4) sees [i+3, i+4].
    cu_q, cu_kv, _, _ = make_ragged([(2, 6)], padded=False).tensors()
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
    assert (~dead.kv).tolist() == [T] * 6


def _reference_backward(ragged: Ragged, mask: object, window: object, brd: Optional[bool],
                        heads_q: int, heads_kv: int, head_dim: int, seed: int):  # fmt: skip
    """True dQ, dK, dV of masked GQA attention in fp64, laid out in the THD buffers."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    dq = torch.zeros(ragged.rows_q, heads_q, head_dim, **f64)
    dk = torch.zeros(ragged.rows_kv, heads_kv, head_dim, **f64)
    dv = torch.zeros(ragged.rows_kv, heads_kv, head_dim, **f64)
    pad_q, pad_kv = ragged.buffer_offsets("q"), ragged.buffer_offsets("kv")
    group = heads_q // heads_kv
    for b in range(ragged.nseq):
        lq, lk = ragged.lq[b], ragged.lk[b]
        q = torch.randn(lq, heads_q, head_dim, generator=gen, **f64).requires_grad_()
        k = torch.randn(lk, heads_kv, head_dim, generator=gen, **f64).requires_grad_()
        v = torch.randn(lk, heads_kv, head_dim, generator=gen, **f64).requires_grad_()
        d_o = torch.randn(lq, heads_q, head_dim, generator=gen, **f64)
        allowed = torch.tensor(attention_matrix(lq, lk, mask, window, brd), dtype=torch.bool)
        allowed = allowed.reshape(lq, lk)
        out = []
        for h in range(heads_q):
            scores = (q[:, h] @ k[:, h // group].T) / math.sqrt(head_dim)
            probs = torch.softmax(scores.masked_fill(~allowed, -1e300), dim=-1) * allowed
            out.append(probs @ v[:, h // group])  # a query with no key: 0
        if lq and lk:
            (torch.stack(out, dim=1) * d_o).sum().backward()
        for t, buf, start in ((q, dq, pad_q[b]), (k, dk, pad_kv[b]), (v, dv, pad_kv[b])):
            if t.grad is not None:
                buf[start : start + t.shape[0]] = t.grad
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
    true_dq, true_dk, true_dv = _reference_backward(
        ragged, mask, window, brd, heads_kv * group, heads_kv, 3, seed
    )
    nonzero = lambda t: (t != 0).flatten(1).any(dim=1)  # noqa: E731
    offsets = ragged.tensors()
    args = dict(attn_mask_type=mask, window_size=window, bottom_right_diagonal=brd)
    dead = dead_row_masks(*offsets, rows_q=ragged.rows_q, rows_kv=ragged.rows_kv, **args)
    # 1. The post-pass never zeroes a row whose true gradient is non-zero.
    assert not (dead.q & nonzero(true_dq)).any()  # type: ignore[operator]
    assert not (dead.kv & nonzero(true_dk)).any()
    assert not (dead.kv & nonzero(true_dv)).any()
    # 2. The oracle is tight: with random inputs dV is non-zero on exactly the key rows
    #    some query attends (so "kept" is not trivially "everything").
    _, attended_kv = expected_keep(ragged, mask, window, brd, exact_union=True)
    assert nonzero(true_dv).tolist() == attended_kv
    # 3. End to end: TE-like output (the true gradient on attended rows, stale garbage on
    #    the rows no query attends) comes out of the post-pass equal to the truth.
    keep_q, keep_kv = expected_keep(ragged, mask, window, brd)
    got = [t.clone() for t in (true_dq, true_dk, true_dv)]
    for t, keep in zip(got, (keep_q, keep_kv, keep_kv)):
        _poison_dead_rows(t, keep)
    zero_dead_rows(*got, *offsets, **args, impl="torch")
    # (by value: an unattended row's true gradient may be -0.0, the post-pass writes +0.0)
    for t, truth in zip(got, (true_dq, true_dk, true_dv)):
        assert torch.equal(t, truth)


# ------------------------------------------------------- no host read (CUDA-graph safe)
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
    for mask in ACCEPTED_MASKS:
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


# ------------------------------------------------- every form the gate accepts is zeroed
class _Plain(torch.Tensor):
    """A subclass that behaves as a tensor (as Megatron's and others' wrappers do)."""


def _set(**values: Any) -> Callable[[Dict[str, Any]], Any]:
    """An edit of the call's arguments; a callable value is called with them first."""
    return lambda a: a.update({k: v(a) if callable(v) else v for k, v in values.items()})


def _views(shape: Tuple[int, ...], pick: Callable[[torch.Tensor], Dict[str, Any]]):
    """Gradients picked from one new buffer of ``shape`` (the others stay separate)."""
    return lambda a: a.update(pick(torch.randn(shape)))


def _inference(a: Dict[str, Any]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.randn(a["dv"].shape)


def _fp8(storage: type) -> Callable[[Dict[str, Any]], Any]:
    return lambda a: storage(torch.randint(1, 255, (10, 2, 2), dtype=torch.uint8))


#: 4096 steps of the overlap search, no element shared (4097: refused, test_checks.py).
_INTERLEAVED_4096 = _views((20 * 4096 + 1,), lambda b: dict(
    dq=b.as_strided((5, 4096, 1), (2 * 4096, 2, 1)),
    dk=b.as_strided((10, 1, 4096), (2 * 4096, 1, 2), 1), dv=torch.randn(10, 1, 4096)))  # fmt: skip
NONE, NO_GRAD, INFERENCE = contextlib.nullcontext, torch.no_grad, torch.inference_mode
#: name -> (edit of the gradients, the context to call in)
ACCEPTED = {
    "t2hd_long": (_views((5000, 2, 2, 2), lambda b: dict(dk=b[:, 0], dv=b[:, 1])), NONE),
    "th2d": (_views((10, 2, 2, 2), lambda b: dict(dk=b[:, :, 0], dv=b[:, :, 1])), NONE),
    "t3hd": (_views((10, 3, 2, 2), lambda b: dict(dq=b[:5, 0], dk=b[:, 1], dv=b[:, 2])), NONE),
    "th3d": (_views((10, 2, 3, 2), lambda b: dict(dq=b[:5, :, 0], dk=b[:, :, 1],
                                                   dv=b[:, :, 2])), NONE),
    "heads_of_one_buffer": (_views((10, 8, 2), lambda b: dict(dq=b[:5, :4], dk=b[:, 4:6],
                                                              dv=b[:, 6:])), NONE),
    "adjacent": (_views((30, 2, 2), lambda b: dict(dk=b[:10].transpose(1, 2),
                                                   dq=b[10:20].view(5, 4, 2), dv=b[20:])), NONE),
    "heads_major_long": (_views((2, 2, 5000, 2), lambda b: dict(dk=b[:, 0].transpose(0, 1),
                                                                dv=b[:, 1].transpose(0, 1))), NONE),
    "mixed_live_dims": (_views((10, 4, 3), lambda b: dict(dq=b[:5, :, 2:3], dk=b[:, :1, :2],
                                                          dv=b[:, 1:2, :2])), NONE),
    "interleaved_4096": (_INTERLEAVED_4096, NONE),
    # Rows i at 2i + 3h (h < 2): rows overlap in no element, though their strides
    # interleave (before: refused by a sorted-stride rule).
    "rows_interleaved": (_set(dk=lambda a: torch.randn(40).as_strided((10, 2, 1), (2, 3, 1)),
                              dv=torch.randn(10, 2, 1), dq=torch.randn(5, 4, 1)), NONE),
    "empty_dq": (_set(cu_seqlens_q=torch.tensor([0, 0, 0, 0], dtype=torch.int32),
                      dq=torch.empty(0, 4, 2).as_strided((0, 4, 2), (8, 2**45, 1))),
                 NONE),  # no address, but a byte range over all others
    "one_row_overlapping_heads": (_set(cu_seqlens_q=torch.tensor([0, 1, 1, 1], dtype=torch.int32),
                                       dq=torch.randn(8).as_strided((1, 4, 2), (8, 1, 1))), NONE),
    "size_one_dim_any_stride": (_set(dk=torch.randn(40).as_strided((10, 1, 3), (4, 2, 1)),
                                     dv=torch.randn(10, 1, 3), dq=torch.randn(5, 1, 3)), NONE),
    "expanded_heads": (_set(dk=torch.randn(10, 1, 2).expand(10, 2, 2),
                            dq=torch.randn(5, 4, 1).expand(5, 4, 2)), NONE),
    "subclass": (_set(dk=lambda a: a["dk"].as_subclass(_Plain)), NONE),
    "parameter_no_grad": (_set(dv=lambda a: torch.nn.Parameter(a["dv"])), NO_GRAD),
    "leaf_no_grad": (_set(dq=lambda a: a["dq"].requires_grad_()), NO_GRAD),
    "nonleaf_no_grad": (_set(dk=lambda a: a["dk"].requires_grad_() * 1), NO_GRAD),
    "inference": (_set(dk=_inference), INFERENCE),
    "fp8": (_set(dk=_fp8(FakeFloat8)), NONE),  # TE's Float8Tensor: raw bytes, a shape
    "fp8_storage": (_set(dv=_fp8(FakeFloat8Storage)), NONE),  # Float8TensorStorage: size() only
}  # fmt: skip

_OFFS = dict(
    cu_seqlens_q=torch.tensor([0, 2, 2, 5], dtype=torch.int32),
    cu_seqlens_kv=torch.tensor([0, 3, 5, 6], dtype=torch.int32),
    cu_seqlens_q_padded=None,
    cu_seqlens_kv_padded=torch.tensor([1, 5, 7, 9], dtype=torch.int32),
)
_GRADS = ("dq", "dk", "dv")


def _good_call() -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    shapes = ((5, 4, 2), (10, 2, 2), (10, 2, 2))
    return dict({n: torch.randn(s, generator=gen) for n, s in zip(_GRADS, shapes)}, **_OFFS)


def _plain(t: Any) -> torch.Tensor:
    return getattr(t, "_data", t).detach().as_subclass(torch.Tensor)


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_every_form_the_gate_accepts_is_zeroed_as_a_contiguous_copy(case: str) -> None:
    edit, context = ACCEPTED[case]
    g = _good_call()
    edit(g)
    want = {n: _plain(g[n]).clone(memory_format=torch.contiguous_format) for n in _GRADS}
    zero_dead_rows(**{**g, **want})
    with context(), warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "masked_fill_ on expanded tensors"
        zero_dead_rows(**g)
    for name in _GRADS:
        assert torch.equal(bits(_plain(g[name])), bits(want[name])), name
    # Row 0 of dK lies before the first sequence; row 1 is a key of sequence 0 (kept
    # unless no sequence has queries).
    kept = g["cu_seqlens_q"][-1] == 0 or bool((want["dk"][1] != 0).any())
    assert bool((want["dk"][0] == 0).all()) and kept


# ------------------------------------------------------- impossible offsets, recorded
def _word(device: torch.device) -> Any:
    """The device's error word, as the Triton kernel writes it (slot 0)."""
    return postpass._record(device).words


def test_a_recorded_error_surfaces_at_the_next_call_and_is_cleared() -> None:
    # What the CUDA kernel does (OR the argument bits into the device's pinned word),
    # simulated on the CPU record: the next call raises naming the argument, before it
    # touches anything, and the record is cleared.
    call = _good_call()
    before = [bits(call[n]).clone() for n in _GRADS]
    _word(CPU)[0] = ARGUMENT_BITS["cu_seqlens_kv_padded"]
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_kv_padded: impossible offsets in an "
                       r"earlier te-gqa-fix post-pass call on cpu"):  # fmt: skip
        zero_dead_rows(**call, impl="torch")
    assert all(torch.equal(bits(call[n]), b) for n, b in zip(_GRADS, before))
    zero_dead_rows(**call, impl="torch")  # cleared: this one zeroes
    assert bool((call["dk"][0] == 0).all())
    # check_offset_errors: a device nothing was recorded on returns quietly (on a CPU-only
    # torch, CUDA too), the device that recorded raises, and so does "every device".
    _word(CPU)[0] = ARGUMENT_BITS["cu_seqlens_q"]
    for device in ("cuda", torch.device("cuda"), "cuda:1", "meta"):
        te_gqa_fix.check_offset_errors(device, synchronize=True)
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_q: impossible offsets in a te-gqa-fix"):
        te_gqa_fix.check_offset_errors("cpu")
    te_gqa_fix.check_offset_errors("cpu")  # cleared
    _word(CPU)[0] = ARGUMENT_BITS["cu_seqlens_q"] | ARGUMENT_BITS["cu_seqlens_kv"]
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_q, cu_seqlens_kv: "):
        te_gqa_fix.check_offset_errors()
    te_gqa_fix.check_offset_errors()  # cleared


def test_the_wrapper_surfaces_a_recorded_error() -> None:
    _, wrapped = FakeTE.with_wrapper("2.20")
    ragged = make_ragged([(2, 3), (0, 2)], gaps_kv=[1, 0])
    _word(CPU)[0] = ARGUMENT_BITS["cu_seqlens_kv"]
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_kv: impossible offsets in an earlier"):
        wrapped(**call_arguments("2.20", ragged))
    wrapped(**call_arguments("2.20", ragged))
    assert te_gqa_fix.call_counts()["fixed"] == 1


def test_impossible_offsets_mark_no_row_dead() -> None:
    """What the masks of a call with impossible offsets say (on CPU the call raises at once,
    writing nothing: test_checks.py's table; on CUDA its masks are used as they are): no
    row is dead, and the error bits name the offending arguments."""
    offsets = [_OFFS[n] for n in _OFFS]
    offsets[1] = torch.tensor([0, 3, 2, 6], dtype=torch.int32)
    for span in (key_span("padding_causal"), key_span("arbitrary")):
        dead = postpass._dead_rows(*offsets, 5, 10, span)
        bad = ARGUMENT_BITS["cu_seqlens_kv"] | ARGUMENT_BITS["cu_seqlens_kv_padded"]
        assert int(dead.errors) == bad  # type: ignore[arg-type]
        assert not bool(dead.kv.any()) and not bool(dead.q.any())  # type: ignore[union-attr]
    dead = postpass._dead_rows(offsets[0][:1], offsets[1][:1] - 1, None, None, 5, 10, span)
    assert int(dead.errors) == ARGUMENT_BITS["cu_seqlens_kv"]  # type: ignore[arg-type]
    assert not bool(dead.kv.any()) and not bool(dead.q.any())  # type: ignore[union-attr]


# ------------------------------------------------------- TE_GQA_FIX_VALIDATE
class _FakeLaunch:
    """A prepared kernel launch (as on CUDA) that records its runs, or fails."""

    def __init__(self, fail: bool = False) -> None:
        self.runs: List[int] = []
        self.fail = fail

    def run(self, dq: Any, dk: Any, dv: Any, offsets: tuple) -> None:
        self.runs.append(1)
        if self.fail:
            raise RuntimeError("compile failed")


def test_validate_reads_the_offsets_before_the_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA the kernel judges the offsets on the device (raised at the next call);
    # TE_GQA_FIX_VALIDATE=on reads them on the host first and raises in the call, before
    # the launch (its messages: test_checks.py's "validate" rows).
    launch = _FakeLaunch()
    monkeypatch.setattr(postpass, "prepare", lambda *args: launch)
    bad = _good_call()
    bad["cu_seqlens_kv_padded"] = torch.tensor([1, 5, 7, 12], dtype=torch.int32)
    for off in ("0", "off", ""):
        monkeypatch.setenv("TE_GQA_FIX_VALIDATE", off)
        zero_dead_rows(**bad)  # the device would judge (and record) them
    assert launch.runs == [1, 1, 1]
    for on in ("on", "1", "true"):
        monkeypatch.setenv("TE_GQA_FIX_VALIDATE", on)
        with pytest.raises(OffsetsError):  # the message: test_checks.py's "validate" rows
            zero_dead_rows(**bad)
    assert launch.runs == [1, 1, 1]
    zero_dead_rows(**_good_call())  # good offsets pass the host read
    assert launch.runs == [1, 1, 1, 1]


# ------------------------------------------------------- which implementation (#53)
def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> List[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


_INSTEAD = "the post-pass runs in PyTorch instead of its Triton kernel on CUDA"


def test_a_failing_kernel_falls_back_to_pytorch_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    launch = _FakeLaunch(fail=True)
    monkeypatch.setattr(postpass, "_no_kernel", None)
    monkeypatch.setattr(postpass, "prepare", lambda *args: launch)  # as on CUDA
    monkeypatch.setattr(postpass, "_kernel_available", lambda: True)
    ragged = make_ragged([(3, 5), (0, 4), (2, 2)], gaps_q=[1, 0, 1], gaps_kv=[0, 2, 1], tail_kv=1)
    keep_q, keep_kv = expected_keep(ragged, "padding_causal")
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        for _ in range(3):  # later calls go straight to PyTorch
            gen = torch.Generator().manual_seed(0)
            grads = [torch.randn(r, h, 2, generator=gen)
                     for r, h in ((ragged.rows_q, 2), (ragged.rows_kv, 1), (ragged.rows_kv, 1))]  # fmt: skip
            before = [t.clone() for t in grads]
            zero_dead_rows(*grads, *ragged.tensors(), impl="triton")
            for t, b, keep, name in zip(grads, before, (keep_q, keep_kv, keep_kv), _GRADS):
                assert_rows(t, b, keep, name)
    assert launch.runs == [1]
    why = "the Triton kernel failed (RuntimeError: compile failed)"
    assert postpass.implementation() == ("pytorch", why)
    said = _warnings(caplog, _INSTEAD)
    assert len(said) == 1 and why in said[0].getMessage()


def test_impl_torch_never_asks_for_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: Any) -> None:
        raise AssertionError("impl='torch' asked for a kernel launch")

    monkeypatch.setattr(postpass, "prepare", no_kernel)
    call = _good_call()
    zero_dead_rows(**call, impl="torch")
    assert bool((call["dk"][0] == 0).all())


def test_cpu_tensors_get_no_kernel_and_impl_triton_is_the_pytorch_post_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ref, call = _good_call(), _good_call()
    grads = [call[n] for n in _GRADS]
    offsets = tuple(call[n] for n in _OFFS)
    with caplog.at_level(logging.DEBUG, logger="te_gqa_fix"):
        assert postpass.prepare(*grads, offsets, key_span("padding_causal")) is None
        zero_dead_rows(**ref, impl="torch")
        zero_dead_rows(**call, impl="triton")
    for name in _GRADS:
        assert torch.equal(bits(call[name]), bits(ref[name])), name
    assert bool((call["dk"][0] == 0).all()) and not bool((call["dk"][1] == 0).all())
    assert not caplog.records, "a CPU call has no kernel to miss: nothing to say"


def _cuda_call(dtype: torch.dtype = torch.float32) -> Tuple[tuple, tuple]:
    """Gradients and offsets on a CUDA device without a GPU (only metadata is read)."""
    grads = tuple(OnCuda((r, h, 2), dtype) for r, h in ((5, 4), (10, 2), (10, 2)))
    offsets = (OnCuda((4,), torch.int32), OnCuda((4,), torch.int32), None, None)
    return grads, offsets


@pytest.fixture
def kernel_state(monkeypatch: pytest.MonkeyPatch):
    """The decision on Triton made anew in the test, and forgotten after it."""
    monkeypatch.setattr(postpass, "_no_kernel", None)
    postpass._kernel_available.cache_clear()
    yield
    postpass._kernel_available.cache_clear()


@pytest.mark.parametrize("cuda, builds", [(False, True), (True, False), (True, True)])
def test_cuda_calls_get_the_kernel_or_one_warning_saying_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kernel_state: None,
    cuda: bool, builds: bool,
) -> None:  # fmt: skip
    """Triton where CUDA is present and Triton builds the kernel; else the PyTorch post-pass,
    and CUDA calls say why in ONE warning per process (#53), however many calls. Tensors
    the kernel does not take get their own one warning."""

    def build() -> object:
        if not builds:
            raise RuntimeError("no libcuda")
        return object()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(_kernel, "build", build)
    monkeypatch.setattr(postpass, "_PLAIN", (*postpass._PLAIN, OnCuda))  # as plain ones
    grads, offsets = _cuda_call()
    span = key_span("padding_causal")
    why = {(False, True): "no CUDA device", (True, False): "Triton is unavailable "
           "(RuntimeError: no libcuda)", (True, True): None}[cuda, builds]  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="te_gqa_fix"):
        assert postpass.implementation() == (("triton", None) if why is None else ("pytorch", why))
        if why is not None:
            for _ in range(3):
                assert postpass.prepare(*grads, offsets, span) is None
        f64, _ = _cuda_call(torch.float64)  # not a dtype the kernel takes
        for _ in range(3):
            assert postpass.prepare(*f64, offsets, span) is None
        cpu = _good_call()  # CPU calls have no kernel to miss: they say nothing
        postpass.prepare(*(cpu[n] for n in _GRADS), tuple(cpu[n] for n in _OFFS), span)
    said = _warnings(caplog, _INSTEAD)
    if why is not None:
        assert len(said) == 1 and why in said[0].getMessage(), said
    else:
        assert (
            len(said) == 1 and "dq is a 3-D torch.float64 tensor on cuda:0" in said[0].getMessage()
        )
    assert all(r.levelno == logging.WARNING for r in caplog.records), caplog.records


# ------------------------------------------------------- mask arguments in the wrapper
def test_the_wrapper_keeps_the_conservative_set_for_masks_it_does_not_know(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # TE validated the call: a mask the wrapper does not model keeps every key of a
    # sequence with queries (the public API refuses such masks: test_checks.py), said once.
    fake, wrapped = FakeTE.with_wrapper("2.20")
    ragged = make_ragged([(2, 3), (0, 2)], gaps_kv=[1, 0])
    for mask, window in (("padding_casual", (-1, -1)), ("padding", (2**40, 0))):
        arguments = call_arguments("2.20", ragged, attn_mask_type=mask)
        arguments["window_size"] = window  # past int32: not understood either
        with caplog.at_level(logging.DEBUG, logger="te_gqa_fix"):
            for _ in range(2):
                fake.backend.reset()
                wrapped(**arguments)
                keep_q, keep_kv = expected_keep(ragged, "arbitrary")
                for name, keep in (("dq", keep_q), ("dk", keep_kv), ("dv", keep_kv)):
                    assert_rows(*fake.backend.outputs[name], keep, name)
    records = [r for r in caplog.records if "not understood" in r.getMessage()]
    assert len(records) == 2 and {r.levelno for r in records} == {logging.WARNING}
    assert te_gqa_fix.call_counts()["fixed"] == 4
