"""The Triton kernel against the PyTorch post-pass and the brute-force oracle.

On CPU the kernel runs under Triton's interpreter, in one child process (this file run as a
script; see ``fakes/interpreter.py``). The interpreter's cost grows with rows x columns x
programs, so the checks use small batches and shrink the launch constants (:data:`PATHS`) to
reach every kernel path with them: offsets read once per program (``ONCE``) or in several
chunks, kept rows by interval compare or by a binary search per row (``SEARCH``), several row
blocks per sequence, column tiles split into shares and looped over.

Each check compares, byte for byte, the whole storage behind dQ/dK/dV (guard rows past the
end included) after the kernel with the storage after ``zero_dead_rows(impl="torch")``, and
the rows with the oracle (``fakes/oracle.py``). Every row starts with a NaN in it, so a dead
row left alone or a live row written cannot pass. Impossible offsets, in any chunk, must give
the PyTorch path's error bits and store nothing.

The ``gpu`` tests run the compiled kernel (same checks with the shipped constants and larger
batches, plus no host sync and CUDA-graph capture); they skip cleanly without CUDA or Triton.
"""

from __future__ import annotations

import importlib.util
import logging
import random
import sys
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import background
from fakes.cuda_checks import capture, no_host_sync
from fakes.interpreter import results, start_checks, worker_main
from fakes.oracle import (
    KNOWN,
    SAME_ROWS_OTHER_COUNTS,
    Ragged,
    assert_rows,
    bits,
    expected_keep,
    make_ragged,
)
from fakes.te_outputs import FakeTE, assert_post_pass, call_arguments
from te_gqa_fix import postpass
from te_gqa_fix.masks import KNOWN_MASK_TYPES, KeySpan, key_span
from te_gqa_fix.postpass import launch, offset_errors, zero_dead_rows
from te_gqa_fix.postpass.offset_errors import OffsetsError
from te_gqa_fix.validation import offset_error_bits, offset_faults

LAYOUTS = ("separate", "t2hd", "th2d", "t3hd", "th3d", "transposed")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GUARD_ROWS = 2

#: Launch constants per kernel path, so that small batches reach every part of it: BLOCK_T
#: 8 or 16 gives several row blocks per sequence and more units than programs; "once" also
#: splits the column tiles into shares (BLOCK_C 8, MAX_TILES 2) and loops over them, a part
#: of a unit that is the same on every path.
PATHS: Dict[str, Dict[str, int]] = {
    "default": {},  # the shipped constants
    "once": dict(BLOCK_T=8, BLOCK_C=8, MAX_TILES=2, COMPARE_MAX_OFFSETS=1 << 30),
    "chunks": dict(BLOCK_T=16, COMPARE_MAX_OFFSETS=1 << 30, OFF_BLOCK_MAX=2),
    "search": dict(BLOCK_T=16, COMPARE_MAX_OFFSETS=0),
}


def _path_of(plan: launch.KernelLaunch) -> str:
    return "search" if plan.meta["SEARCH"] else "once" if plan.meta["ONCE"] else "chunks"


@contextmanager
def kernel_path(name: str, **extra: int) -> Iterator[List[launch.KernelLaunch]]:
    """Inside, the launch constants of ``PATHS[name]`` (and ``extra``); yields the plans made
    inside, and checks on the way out that there were some and they took that path."""
    constants = {**PATHS[name], **extra}
    saved = {k: getattr(launch, k) for k in constants}
    plans: List[launch.KernelLaunch] = []
    make_plan = launch.prepare

    def recording(*args: Any) -> launch.KernelLaunch:
        plans.append(make_plan(*args))
        return plans[-1]

    for k, v in constants.items():
        setattr(launch, k, v)
    launch.prepare = recording  # type: ignore[assignment]
    try:
        yield plans
    finally:
        launch.prepare = make_plan  # type: ignore[assignment]
        for k, v in saved.items():
            setattr(launch, k, v)
    assert plans, "the kernel never ran"
    if name == "chunks":  # one or two offsets fit one chunk
        plans = [p for p in plans if p.scalars[0] >= 2]
    assert {_path_of(p) for p in plans} <= {"once" if name == "default" else name}


def kernel_zero(dq, dk, dv, offsets: tuple, span: KeySpan) -> None:
    """The kernel alone (any offset dtype it takes), through the one launch route. On CUDA
    the prepared launch first runs on same-layout copies (the launch that compiles), so the
    gradients themselves get a later launch, through the prepared launcher (asserted)."""
    kernel_launch = launch.prepare(dq, dk, dv, offsets, span)
    if dk.device.type != "cuda":
        launch.run_kernel(kernel_launch, dq, dk, dv, offsets)
        return
    assert launch.unsupported(dq, dk, dv, offsets) is None
    copies = [None if t is None else _same_layout(t) for t in (dq, dk, dv)]
    launch.run_kernel(kernel_launch, *copies, offsets)  # type: ignore[arg-type]
    launch.run_kernel(kernel_launch, dq, dk, dv, offsets)
    # One pointer alignment (the copies' is the gradients'), so the second launch used the
    # launcher the first one stored.
    launchers = [f.__name__ for f in kernel_launch.launchers.values()]
    assert launchers == ["launch_on_current_stream"], launchers


def _same_layout(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s sizes, strides and storage offset in a fresh storage (whose start
    the caching allocator aligns as it aligned ``t``'s)."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=t.device)  # fmt: skip
    return storage.as_strided(t.size(), t.stride(), t.storage_offset())


# --------------------------------------------------------------------------- cases


@st.composite
def batches(draw: Any, max_seqs: int = 5, max_len: int = 6) -> Dict[str, Any]:
    """A random THD batch: q-empty and kv-empty sequences, gaps, tail rows, all masks."""
    nseq = draw(st.integers(0, max_seqs))
    length = st.integers(0, max_len)
    padded = draw(st.booleans())
    gap = st.integers(0, 3) if padded else st.just(0)
    layout = draw(st.sampled_from(LAYOUTS))
    h_kv = draw(st.integers(1, 2))
    group = 1 if layout in ("t3hd", "th3d") else draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 3, 8, 12]))
    window = draw(st.sampled_from([(-1, -1), None]) | st.tuples(*[st.integers(-1, 4)] * 2))
    return dict(
        lq=[draw(length) for _ in range(nseq)],
        lk=[draw(length) for _ in range(nseq)],
        padded=padded,
        gaps_q=[draw(gap) for _ in range(nseq)],
        gaps_kv=[draw(gap) for _ in range(nseq)],
        lead=draw(st.integers(0, 2)) if padded else 0,
        tail_q=draw(st.integers(0, 3)),
        tail_kv=draw(st.integers(0, 3)),
        layout=layout,
        h_q=h_kv * group,
        h_kv=h_kv,
        d=d,
        d_v=d if layout != "separate" else draw(st.sampled_from([d, 5])),
        with_q=layout in ("t3hd", "th3d") or draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        mask=draw(st.sampled_from((*KNOWN_MASK_TYPES, "arbitrary"))),
        window=window,
        bottom_right=draw(st.sampled_from([None, True, False])),
        seed=draw(st.integers(0, 2**31 - 1)),
        offset_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
    )


def _offsets(lengths: List[int], gaps: List[int], lead: int) -> Tuple[List[int], List[int]]:
    cu, pad = [0], [lead]
    for n, g in zip(lengths, gaps):
        cu.append(cu[-1] + n)
        pad.append(pad[-1] + n + g)
    return cu, pad


def _fill(base: torch.Tensor, gen: torch.Generator) -> None:
    """Random values with NaN and Inf sprinkled everywhere (stale workspace can be anything),
    and a NaN in every row: a dead row the kernel skips can never pass as zeroed."""
    values = torch.randn(base.shape, generator=gen, dtype=torch.float32)
    pick = torch.rand(base.shape, generator=gen)
    values[pick < 0.1] = float("nan")
    values[pick > 0.95] = float("inf")
    flat = values.reshape(base.shape[0], -1)
    if flat.numel():
        col = torch.randint(flat.shape[1], (flat.shape[0],), generator=gen)
        flat[torch.arange(flat.shape[0]), col] = float("nan")
    base.copy_(values.to(base.dtype))


def _buffers(case: Dict[str, Any], rows_q: int, rows_kv: int, device: str):
    """(bases, dq, dk, dv): dQ/dK/dV as views of base buffers with GUARD_ROWS spare rows."""
    gen = torch.Generator().manual_seed(case["seed"])
    layout, h_q, h_kv, d = case["layout"], case["h_q"], case["h_kv"], case["d"]
    bases: List[torch.Tensor] = []

    def new(rows: int, *shape: int) -> torch.Tensor:
        """The first ``rows`` rows of a new base buffer."""
        base = torch.empty((rows + GUARD_ROWS, *shape), dtype=case["dtype"])
        _fill(base, gen)
        bases.append(base.to(device))
        return bases[-1][:rows]

    def packed(rows: int, n: int) -> Tuple[torch.Tensor, ...]:
        """``n`` views side by side in one buffer: [t, n, h, d] (t3hd, t2hd) or [t, h, n, d]."""
        if layout.startswith("th"):
            return new(rows, h_kv, n, d).unbind(2)
        return new(rows, n, h_kv, d).unbind(1)

    def separate(rows: int, heads: int, dim: int) -> torch.Tensor:
        if layout == "transposed":  # heads not adjacent
            return new(rows, dim, heads).transpose(1, 2)
        return new(rows, heads, dim)

    if layout in ("t3hd", "th3d"):
        return (bases, *packed(max(rows_q, rows_kv), 3))
    dq = separate(rows_q, h_q, d) if case["with_q"] else None
    if layout in ("t2hd", "th2d"):
        return (bases, dq, *packed(rows_kv, 2))
    d_v = d if layout == "transposed" else case["d_v"]
    return bases, dq, separate(rows_kv, h_kv, d), separate(rows_kv, h_kv, d_v)


def _bytes(bases: List[torch.Tensor]) -> List[torch.Tensor]:
    return [b.detach().cpu().reshape(-1).view(torch.uint8).clone() for b in bases]


def run_case(case: Dict[str, Any], device: str) -> None:
    """Kernel vs ``zero_dead_rows(impl="torch")`` (whole storage) vs the oracle (rows)."""
    cu_q, pad_q = _offsets(case["lq"], case["gaps_q"], case["lead"])
    cu_kv, pad_kv = _offsets(case["lk"], case["gaps_kv"], case["lead"])
    rows_q = pad_q[-1] + case["tail_q"]
    rows_kv = pad_kv[-1] + case["tail_kv"]
    if case["layout"] in ("t3hd", "th3d"):
        rows_q = rows_kv = max(rows_q, rows_kv)
    ints = dict(dtype=case.get("offset_dtype", torch.int32), device=device)
    offs = [torch.tensor(x, **ints) for x in (cu_q, cu_kv, pad_q, pad_kv)]
    if not case["padded"]:
        offs[2] = offs[3] = None  # type: ignore[call-overload]
    mask, window, brd = case["mask"], case["window"], case["bottom_right"]
    mask_args = dict(attn_mask_type=mask, window_size=window, bottom_right_diagonal=brd)

    bases_k, dq_k, dk_k, dv_k = _buffers(case, rows_q, rows_kv, device)
    bases_t, dq_t, dk_t, dv_t = _buffers(case, rows_q, rows_kv, device)
    before = [None if t is None else t.detach().cpu().clone() for t in (dq_k, dk_k, dv_k)]

    kernel_zero(dq_k, dk_k, dv_k, tuple(offs), key_span(**mask_args))  # type: ignore[arg-type]
    # The public post-pass takes int32 offsets only (TE's dtype); the kernel takes int64 too.
    offs32 = [None if o is None else o.to(torch.int32) for o in offs]
    zero_dead_rows(dq_t, dk_t, dv_t, *offs32, impl="torch", **mask_args)  # type: ignore[arg-type]
    for i, (a, b) in enumerate(zip(_bytes(bases_k), _bytes(bases_t))):
        assert torch.equal(a, b), f"buffer {i} differs from the PyTorch post-pass; case={case}"

    # A causal mask with a right window > 0 keeps the declared window: a documented superset
    # the oracle does not model (tests/test_oracle.py); the byte check above still holds.
    if mask in KNOWN and KNOWN[mask][0] and (window or (0, 0))[1] > 0:
        return
    pads = (pad_q, pad_kv) if case["padded"] else (cu_q, cu_kv)
    lengths = (tuple(case["lq"]), tuple(case["lk"]))
    keep_q, keep_kv = expected_keep(Ragged(*lengths, *pads, rows_q, rows_kv), mask, window, brd)
    for name, t, b, keep in (("dk", dk_k, before[1], keep_kv), ("dv", dv_k, before[2], keep_kv),
                             ("dq", dq_k, before[0], keep_q)):  # fmt: skip
        if t is not None:
            assert_rows(t.cpu(), b, keep, f"{name} case={case}")


# Fixed cases: the seed script's shape, rows wider than one shipped column tile (dK wider
# than dV too), and a context-parallel step with q-empty sequences and a kv-empty one.
SEED_CASE = dict(
    lq=[0, 3], lk=[3, 6], padded=True, gaps_q=[4, 5], gaps_kv=[1, 2], lead=0, tail_q=0,
    tail_kv=0, layout="separate", h_q=2, h_kv=1, d=8, d_v=8, with_q=True,
    dtype=torch.float16, mask="padding_causal", window=(-1, -1), bottom_right=None, seed=1,
)  # fmt: skip
WIDE_CASE = dict(SEED_CASE, layout="th2d", h_q=4, h_kv=2, d=64, d_v=64, mask="padding")
#: dK two column tiles wide, dV one (q/k head dim 128, v 64): each gets its own tile count.
WIDE_KEYS_CASE = dict(WIDE_CASE, layout="separate", d=128)
CP_CASE = dict(
    lq=[3, 0, 5, 1, 0, 4], lk=[6, 4, 10, 0, 3, 8], padded=True, gaps_q=[1, 2, 1, 1, 2, 0],
    gaps_kv=[0, 0, 0, 0, 2, 0], lead=0, tail_q=5, tail_kv=3, layout="t2hd", h_q=4, h_kv=2,
    d=8, d_v=8, with_q=True, dtype=torch.bfloat16, mask="padding_causal_bottom_right",
    window=(-1, -1), bottom_right=None, seed=2,
)  # fmt: skip

# Mask arguments: both diagonals, windows on each side (0: up to the diagonal), an explicit
# flag, the conservative set.
FIXED_MASKS = (
    ("padding_causal", (-1, -1), None),
    ("padding_causal_bottom_right", (-1, -1), None),
    ("padding_causal_bottom_right", (3, 0), None),
    ("padding", (0, 1), True),
    ("padding", (1, 3), False),
    ("causal", (-1, -1), True),
    ("arbitrary", (-1, -1), None),
)


def fixed_grid(full: bool) -> Iterator[Dict[str, Any]]:
    """CP_CASE in every layout under every mask of FIXED_MASKS: all pairs when ``full``,
    else one pass that meets each layout and each mask."""
    pairs = [(lay, m) for lay in LAYOUTS for m in FIXED_MASKS] if full else [
        (LAYOUTS[i % len(LAYOUTS)], m) for i, m in enumerate(FIXED_MASKS)]  # fmt: skip
    for layout, (mask, window, brd) in pairs:
        case = dict(CP_CASE, layout=layout, mask=mask, window=window, bottom_right=brd)
        if layout in ("t3hd", "th3d"):
            case["h_q"] = case["h_kv"]
        if layout == "separate":
            case["d_v"] = 5
        yield case


def many_case(nseq: int, seed: int, **changes: Any) -> Dict[str, Any]:
    """``nseq`` short sequences: q-empty and kv-empty ones, gaps, leading and tail rows."""
    rng = random.Random(seed)
    case = dict(
        lq=[rng.choice((0, 0, 1, 2, 3)) for _ in range(nseq)],
        lk=[rng.choice((0, 1, 2, 4)) for _ in range(nseq)],
        padded=True,
        gaps_q=[rng.choice((0, 0, 1, 3)) for _ in range(nseq)],
        gaps_kv=[rng.choice((0, 0, 2)) for _ in range(nseq)],
        lead=2, tail_q=3, tail_kv=5, layout="t2hd", h_q=2, h_kv=1, d=3, d_v=3,
        with_q=True, dtype=torch.bfloat16, mask="padding_causal", window=(-1, -1),
        bottom_right=None, seed=seed, offset_dtype=torch.int64,
    )  # fmt: skip
    case.update(changes)
    if not case["padded"]:
        case.update(gaps_q=[0] * nseq, gaps_kv=[0] * nseq, lead=0)
    return case


def check_fixed(device: str, grid: Iterator[Dict[str, Any]]) -> None:
    """The fixed cases, and rows the kernel must actually zero (or the comparison proves
    little). Seed batch: seq 0 (rows 0-3) has no queries; seq 1 has lq 3, lk 6 at rows 4-11."""
    for case in (SEED_CASE, WIDE_CASE, WIDE_KEYS_CASE, CP_CASE, *grid):
        run_case(case, device)
    # Offsets as strided views (every other element): the launch reads them contiguous.
    cu_q, cu_kv, pad = (torch.tensor(x, dtype=torch.int32, device=device).repeat_interleave(2)[::2]
                        for x in ([0, 0, 3], [0, 3, 9], [0, 4, 12]))  # fmt: skip
    for mask, n_live in {"padding_causal": 3, "padding_causal_bottom_right": 6}.items():
        _, dq, dk, dv = _buffers(SEED_CASE, 12, 12, device)
        kernel_zero(dq, dk, dv, (cu_q, cu_kv, pad, pad), key_span(mask))
        want_kv = [True] * 4 + [False] * n_live + [True] * (8 - n_live)
        for t, want in ((dk, want_kv), (dv, want_kv), (dq, [True] * 4 + [False] * 3 + [True] * 5)):
            assert (t == 0).flatten(1).all(dim=1).tolist() == want, mask


def bad_offset_cases(nseq: int, first_bad: int):
    """Impossible offsets at or after index ``first_bad`` (a later chunk when the offsets
    come in chunks), the last case negative up to there without a decrease: ``(cu_q, cu_kv,
    pad_q, pad_kv, rows_q, rows_kv, with_q)``. The fifth (a dQ buffer too short, but no dQ)
    is no error."""
    case = many_case(nseq, 7)
    cu_q, pad_q = _offsets(case["lq"], case["gaps_q"], case["lead"])
    cu_kv, pad_kv = _offsets(case["lk"], case["gaps_kv"], case["lead"])
    rows_q, rows_kv = pad_q[-1] + 3, pad_kv[-1] + 3

    def set_at(x: List[int], i: int, value: int) -> List[int]:
        return [*x[:i], value, *x[i + 1 :]]

    def short(pad: List[int], cu: List[int], i: int) -> List[int]:
        # Segment i one row shorter than its valid length; later offsets shift with it.
        cut = (pad[i + 1] - pad[i]) - (cu[i + 1] - cu[i]) + 1
        return pad[: i + 1] + [v - cut for v in pad[i + 1 :]]

    i_long = next(i for i in range(first_bad, nseq) if cu_kv[i + 1] > cu_kv[i])
    j = first_bad + 1
    below = [x - cu_kv[first_bad] - 1 for x in cu_kv]  # negative up to first_bad, no decrease
    return [
        (cu_q, set_at(cu_kv, j, cu_kv[j - 1] - 1), pad_q, pad_kv, rows_q, rows_kv, True),
        (cu_q, cu_kv, pad_q, short(pad_kv, cu_kv, i_long), rows_q, rows_kv, True),
        (set_at(cu_q, nseq, -1), cu_kv, pad_q, pad_kv, rows_q, rows_kv, True),
        (cu_q, cu_kv, pad_q, pad_kv, pad_q[-1] - 1, rows_kv, True),  # dQ too short
        (cu_q, cu_kv, pad_q, pad_kv, pad_q[-1] - 1, rows_kv, False),  # ... but no dQ: fine
        (cu_q, cu_kv, pad_q, pad_kv, rows_q, pad_kv[-1] - 1, True),
        (cu_q, cu_kv, None, None, cu_q[-1], cu_kv[-1] - 1, True),
        (cu_q, set_at(cu_kv, first_bad, cu_kv[first_bad - 1] - 1), None, None, rows_q, rows_kv,
         False),
        (cu_q, below, pad_q, pad_kv, rows_q, rows_kv, True),
    ]  # fmt: skip


def check_bad_offsets(nseq: int, first_bad: int, device: str = "cpu") -> None:
    """Each bad case (int32 and int64 offsets in turn): the kernel's bits are the PyTorch
    path's, nothing is stored, and the next :func:`offset_errors.raise_pending` raises."""
    span = key_span("padding_causal_bottom_right", (4, 0))
    for i, (cq, ck, pq, pk, rq, rk, with_q) in enumerate(bad_offset_cases(nseq, first_bad)):
        offset_errors._reset()
        dtype = (torch.int32, torch.int64)[i % 2]
        offs = [None if x is None else torch.tensor(x, dtype=dtype) for x in (cq, ck, pq, pk)]
        case = dict(seed=i, dtype=torch.float32, layout="t2hd", h_q=2, h_kv=1, d=3, with_q=True)
        bases, dq, dk, dv = _buffers(case, rq, rk, device)  # a dQ buffer, used or not
        before = _bytes(bases)
        dq = dq if with_q else None
        kernel_zero(dq, dk, dv, tuple(None if o is None else o.to(device) for o in offs), span)
        if device != "cpu":
            torch.cuda.synchronize()
        i64 = [None if x is None else x.to(torch.int64) for x in offs]
        faults = offset_faults(*i64, rq if with_q else None, rk)
        want = int(offset_error_bits(faults))
        assert int(offset_errors.kernel_flag(dk.device)[0]) == want, (i, dtype, want)
        if i == 4:
            assert want == 0, "a short dQ buffer is no error when there is no dQ"
            continue
        assert want != 0, i
        assert all(torch.equal(a, b) for a, b in zip(_bytes(bases), before)), (i, "a store")
        with pytest.raises(OffsetsError):
            offset_errors.raise_pending(dk.device)
    offset_errors._reset()


# --------------------------------------------------------------------------- worker
# Run in the child process with TRITON_INTERPRET=1 (see the module docstring).

WORKER = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _check_fixed(path: str) -> None:
    """The fixed cases. Every layout and mask with the shipped constants (the fewest units:
    the cheapest under the interpreter) and on the binary search (its own key bounds)."""
    grid = fixed_grid(full=False) if path in ("default", "search") else iter(())
    with kernel_path(path) as plans:
        check_fixed("cpu", grid)
    if path != "default":
        assert any(p.scalars[9] > 1 for p in plans), "no program ran several units"
    if path == "chunks":
        assert any(p.meta["OFF_CHUNKS"] >= 3 for p in plans), "never 3 chunks or more"
    if path == "once":  # dK/dV and dQ column tiles in shares of several tiles each
        assert any(p.scalars[7] > 1 and p.meta["NT_K"] > 1 for p in plans), "dK/dV"
        assert any(p.scalars[8] > 1 and p.meta["NT_Q"] > 1 for p in plans), "dQ"


def _examples(n: int, test: Callable[..., None], **strategies: Any) -> None:
    """``test`` on ``n`` examples drawn from ``strategies``."""
    settings(WORKER, max_examples=n)(given(**strategies)(test))()


def _check_random(path: str) -> None:
    with kernel_path(path):
        _examples(10, lambda case: run_case(case, "cpu"), case=batches())


def _check_bad_offsets(path: str) -> None:
    """Bad offsets from index 6 on: with chunks of 2 offsets, in the 4th chunk or later."""
    with kernel_path(path, BLOCK_T=32):  # errors are judged per unit: few units will do
        check_bad_offsets(nseq=9, first_bad=6)


@st.composite
def malformed(draw: Any) -> Dict[str, Any]:
    n = draw(st.integers(1, 6))
    offs = [draw(st.lists(st.integers(-3, 14), min_size=n, max_size=n)) for _ in range(4)]
    if draw(st.booleans()):  # often well formed, so both verdicts are exercised
        offs[0] = sorted(abs(x) for x in offs[0])
        offs[1] = sorted(abs(x) for x in offs[1])
        if draw(st.integers(0, 3)) == 0:  # impossible only by a negative first offset
            offs[draw(st.integers(0, 3))][0] = -1
    return dict(
        offs=offs,
        pad_q=draw(st.booleans()),
        pad_kv=draw(st.booleans()),
        rows_q=draw(st.integers(1, 14)),
        rows_kv=draw(st.integers(1, 14)),
        with_q=draw(st.booleans()),
        mask=draw(st.sampled_from(["padding_causal", "padding", "padding_causal_bottom_right"])),
    )


def _malformed_body(case: Dict[str, Any]) -> None:
    """Random, often impossible offsets: the kernel's verdict is the PyTorch path's, bit
    for bit, and a bad verdict stores nothing; a good one zeroes the PyTorch path's rows."""
    offset_errors._reset()
    cpu = torch.device("cpu")
    cu_q, cu_kv, pq, pk = (torch.tensor(x, dtype=torch.int32) for x in case["offs"])
    pad_q = pq if case["pad_q"] else None
    pad_kv = pk if case["pad_kv"] else None
    rows_q, rows_kv = case["rows_q"], case["rows_kv"]
    gen = torch.Generator().manual_seed(1)
    dq = torch.randn(rows_q, 2, 3, generator=gen) if case["with_q"] else None
    dk, dv = torch.randn(rows_kv, 1, 3, generator=gen), torch.randn(rows_kv, 1, 3, generator=gen)
    before = [None if t is None else t.clone() for t in (dq, dk, dv)]
    kernel_zero(dq, dk, dv, (cu_q, cu_kv, pad_q, pad_kv), key_span(case["mask"]))
    i64 = [None if t is None else t.to(torch.int64) for t in (cu_q, cu_kv, pad_q, pad_kv)]
    faults = offset_faults(*i64, rows_q if case["with_q"] else None, rows_kv)
    want = int(offset_error_bits(faults))
    assert int(offset_errors.kernel_flag(cpu)[0]) == want, (want, case)
    if want:
        for t, b in zip((dq, dk, dv), before):
            assert t is None or torch.equal(bits(t), bits(b)), "bad offsets: a store"
        with pytest.raises(OffsetsError):
            offset_errors.raise_pending(cpu)
        return
    twins = [None if b is None else b.clone() for b in before]
    zero_dead_rows(*twins, cu_q, cu_kv, pad_q, pad_kv, attn_mask_type=case["mask"], impl="torch")
    for t, twin in zip((dq, dk, dv), twins):
        assert t is None or torch.equal(bits(t), bits(twin)), case


def _check_malformed(path: str) -> None:
    with kernel_path(path, BLOCK_T=16):
        _examples(10, _malformed_body, case=malformed())


def _check_public_path() -> None:
    """``zero_dead_rows(impl="triton")`` reaching the interpreted kernel, against the
    oracle, with q and kv padded offsets that differ and an explicit bottom_right_diagonal:
    swapping arguments or dropping the flag on the way to the kernel fails here. Then
    impossible offsets through the kernel: nothing zeroed, raised at the next call."""
    reached: List[int] = []

    def cpu_kernel_plan(dq, dk, dv, offsets, span):  # prepare_kernel minus its CUDA gate
        reached.append(1)
        return launch.prepare(dq, dk, dv, offsets, span)

    real, postpass.prepare_kernel = postpass.prepare_kernel, cpu_kernel_plan  # type: ignore[assignment]
    try:
        _examples(
            12,
            _public_body,
            pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=4),
            gaps=st.lists(st.integers(0, 2), min_size=8, max_size=8),
            mask=st.sampled_from(["padding_causal", "padding_causal_bottom_right", "padding"]),
            window=st.tuples(st.integers(-1, 3), st.integers(-1, 3)),
            brd=st.sampled_from([None, True, False]),
            with_q=st.booleans(),
        )
        assert reached and not postpass._broken
        _public_bad_offsets()
        assert not postpass._broken
    finally:
        postpass.prepare_kernel = real  # type: ignore[assignment]


def _check_wrapper_sequence_counts() -> None:
    """The wrapper's kernel launches on calls of one shape whose batches hold 3, then 5
    sequences in the same rows, alternating: every call's rows match the oracle through the
    interpreted kernel (a launch prepared for another count zeroes live rows)."""
    real = postpass.prepare_kernel
    postpass.prepare_kernel = launch.prepare  # type: ignore[assignment]  # minus its CUDA gate
    try:
        fake, wrapped = FakeTE.with_wrapper("2.20")
        for ragged in (*SAME_ROWS_OTHER_COUNTS, *SAME_ROWS_OTHER_COUNTS):
            fake.backend.reset()
            wrapped(**call_arguments("2.20", ragged))
            assert_post_pass(fake.backend.outputs, ragged, "padding_causal", (-1, -1), None)
        assert not postpass._broken
    finally:
        postpass.prepare_kernel = real  # type: ignore[assignment]


def _public_body(pairs, gaps, mask, window, brd, with_q) -> None:
    n = len(pairs)
    if "causal" in mask and window[1] > 0:  # TE leaves right in {-1, 0} for causal
        window = (window[0], 0)
    ragged = make_ragged(pairs, gaps_q=gaps[:n], gaps_kv=gaps[4 : 4 + n], lead_q=1, tail_kv=2)
    keep_q, keep_kv = expected_keep(ragged, mask, window, brd)
    gen = torch.Generator().manual_seed(3)
    dq = torch.randn(ragged.rows_q, 4, 3, generator=gen)
    buf = torch.randn(ragged.rows_kv, 2, 2, 3, generator=gen)
    dk, dv = buf[:, 0], buf[:, 1]
    before = [t.clone() for t in (dq, dk, dv)]
    zero_dead_rows(dq if with_q else None, dk, dv, *ragged.tensors(), attn_mask_type=mask,
                   window_size=window, bottom_right_diagonal=brd, impl="triton")  # fmt: skip
    if with_q:
        assert_rows(dq, before[0], keep_q, "dq")
    else:
        assert torch.equal(dq, before[0])
    assert_rows(dk, before[1], keep_kv, "dk")
    assert_rows(dv, before[2], keep_kv, "dv")


def _public_bad_offsets() -> None:
    offset_errors._reset()
    i32 = dict(dtype=torch.int32)
    good = [torch.tensor(x, **i32) for x in ([0, 2, 2, 5], [0, 3, 5, 6], [1, 5, 7, 9])]
    bad_kv = torch.tensor([0, -3, 5, 6], **i32)
    dq, dk, dv = torch.randn(5, 4, 2), torch.randn(10, 2, 2), torch.randn(10, 2, 2)
    before = [t.clone() for t in (dq, dk, dv)]
    zero_dead_rows(dq, dk, dv, good[0], bad_kv, None, good[2], impl="triton")  # records only
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip((dq, dk, dv), before))
    with pytest.raises(OffsetsError, match=r"^cu_seqlens_kv\b.*: impossible offsets in an earlier"):
        zero_dead_rows(dq, dk, dv, good[0], good[1], None, good[2], impl="triton")
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip((dq, dk, dv), before))
    zero_dead_rows(dq, dk, dv, good[0], good[1], None, good[2], impl="triton")  # cleared
    assert bool((dk[0] == 0).all()) and torch.equal(dk[1], before[1][1])


def _check_cpu_imports_no_triton_or_te() -> None:
    """First in the worker, a fresh process: the package and the post-pass on CPU tensors
    (impl auto and triton) import no Triton, and the package no Transformer Engine (what it
    does without TE: tests/test_policy_and_errors.py). Nothing has imported either yet."""
    import te_gqa_fix.patch
    import te_gqa_fix.postpass.kernel
    import te_gqa_fix.stack.affected
    import te_gqa_fix.wrapper

    assert callable(te_gqa_fix.fused_attn_bwd) and callable(te_gqa_fix.install)
    assert te_gqa_fix.is_installed() is False and not any(te_gqa_fix.call_counts().values())
    offs = torch.tensor([0, 2, 5], dtype=torch.int32)
    for impl in ("auto", "triton"):
        zero_dead_rows(None, torch.ones(5, 1, 2), torch.ones(5, 1, 2), offs, offs, impl=impl)
    assert te_gqa_fix.postpass.kernel.tl is None and "triton" not in sys.modules, (
        "Triton imported on CPU"
    )
    te = sorted(m for m in sys.modules if m.split(".")[0] == "transformer_engine")
    assert te == [], f"te_gqa_fix imported {te}"


WORKER_CHECKS = {
    "cpu_imports_no_triton_or_te": _check_cpu_imports_no_triton_or_te,  # must stay first
    **{f"fixed_{p}": (lambda p=p: _check_fixed(p)) for p in PATHS},
    **{f"random_{p}": (lambda p=p: _check_random(p)) for p in ("once", "chunks", "search")},
    **{f"bad_offsets_{p}": (lambda p=p: _check_bad_offsets(p)) for p in ("chunks", "search")},
    **{f"malformed_{p}": (lambda p=p: _check_malformed(p)) for p in ("once", "chunks", "search")},
    "public_path": _check_public_path,
    "wrapper_sequence_counts": _check_wrapper_sequence_counts,
}


# --------------------------------------------------------------------------- tests


background.STARTERS["interpreter_results"] = lambda folder: (
    start_checks(__file__, folder) if importlib.util.find_spec("triton") else None
)


@pytest.fixture(scope="module")
def interpreter_results() -> Dict[str, dict]:
    job = background.get("interpreter_results")
    if job is None:
        pytest.skip("needs Triton (pip install triton)")
    return results(job)


@pytest.mark.parametrize("check", list(WORKER_CHECKS))
def test_interpreted_kernel(check: str, interpreter_results: Dict[str, dict]) -> None:
    result = interpreter_results[check]
    assert result["ok"], f"{check} failed under the interpreter:\n{result['error']}"


@pytest.mark.parametrize("cuda, builds", [(False, True), (True, True), (True, False)])
def test_available_is_cuda_and_a_triton_that_builds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cuda: bool, builds: bool
) -> None:
    """True with CUDA where Triton builds the kernel; False without CUDA (no build asked) or
    where the build raises anything (logged): the PyTorch post-pass. Decided once."""
    built: List[int] = []

    def build() -> object:
        built.append(1)
        if not builds:
            raise RuntimeError("no libcuda")
        return object()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(launch.kernel, "build", build)
    launch.available.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
            assert launch.available() is launch.available() is (cuda and builds)
    finally:
        launch.available.cache_clear()
    assert len(built) == int(cuda)
    assert ("no Triton (no libcuda)" in caplog.text) is (cuda and not builds)


def _small_case() -> Tuple[torch.Tensor, ...]:
    dq, dk, dv = torch.randn(12, 2, 8), torch.randn(12, 1, 8), torch.randn(12, 1, 8)
    offs = [torch.tensor(x, dtype=torch.int32) for x in ([0, 0, 3], [0, 3, 9], [0, 4, 12])]
    return dq, dk, dv, offs[0], offs[1], offs[2], offs[2]


def test_cpu_tensors_get_no_kernel_plan_and_impl_triton_falls_back_to_torch() -> None:
    dq, dk, dv, *offs = _small_case()
    assert postpass.prepare_kernel(dq, dk, dv, tuple(offs), key_span("padding_causal")) is None
    assert launch.unsupported(dq, dk, dv, tuple(offs)) == "device cpu"
    ref = [t.clone() for t in (dq, dk, dv)]
    zero_dead_rows(*ref, *offs, attn_mask_type="padding_causal", impl="torch")
    zero_dead_rows(dq, dk, dv, *offs, attn_mask_type="padding_causal", impl="triton")
    for t, r in zip((dq, dk, dv), ref):
        assert torch.equal(t, r)
    assert bool((dk[:4] == 0).all()) and not bool((dk[4:10] == 0).all())


def test_launch_reuses_the_launcher_per_pointer_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for kernel.build(): fn[grid](...) "compiles" (recorded) and returns a
    # compiled kernel whose run() records what each later launch gives it.
    dq, dk, dv, *offs = _small_case()
    shifted = torch.randn(12 * 8 + 2)[2:].view(12, 1, 8)  # 8 bytes past a 16-byte boundary
    plan = launch.prepare(dq, dk, dv, tuple(offs), key_span("padding_causal"))
    compiles: List[int] = []
    runs: List[Tuple[int, tuple]] = []

    def compile_and_run(*args: Any, **meta: Any) -> Any:
        compiles.append(args[1].data_ptr() % 16)
        n = len(compiles)
        run = lambda *a: runs.append((n, a))  # noqa: E731
        return type(
            "Compiled", (), {"function": "f", "packed_metadata": "m", "run": staticmethod(run)}
        )()

    fn = type("Fn", (), {"__getitem__": lambda *_: compile_and_run})()
    fn.arg_names = ["t"] * 8 + ["s"] * len(plan.scalars) + list(plan.meta)
    monkeypatch.setattr(launch.kernel, "build", lambda: fn)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    for dk_now in (dk, dk, shifted, shifted, dk):
        launch.run_kernel(plan, dq, dk_now, dv, tuple(offs))
    assert compiles == [0, 8] and [n for n, _ in runs] == [1, 2, 1], (compiles, runs)
    ptrs = [t.data_ptr() for t in (dq, dk, dv, *offs)]
    grid_and_handles = (*plan.grid, 77, "f", "m", None, None, None)
    assert runs[0][1] == (
        *grid_and_handles,
        *ptrs,
        plan.err_ptr,
        *plan.scalars,
        *plan.meta.values(),
    )


def test_the_c_launch_entry_is_taken_only_where_its_arguments_are_known() -> None:
    """Triton's C entry point directly on the releases whose arguments were read
    (``C_ENTRY_RELEASES``) and only when no scratch memory is needed; Triton's own launcher
    anywhere else. (Against the real launcher: ``tests/gpu/test_public_postpass_cuda.py``.)"""

    def compiled(**launcher: Any) -> SimpleNamespace:
        attrs = dict(
            launch=lambda *a: None, launch_cooperative_grid=False, launch_pdl=True,
            global_scratch_size=0, profile_scratch_size=0,
        )  # fmt: skip
        attrs.update(launcher)
        return SimpleNamespace(run=SimpleNamespace(**attrs), function=11, packed_metadata="m")

    c = compiled()
    entry, between = launch.launch_entry(c, "3.6.0")
    assert entry is c.run.launch
    assert between == (11, False, True, None, None, "m", None, None, None)
    assert launch.launch_entry(c, "3.5.1")[0] is c.run.launch
    own = (11, "m", None, None, None)
    for version in ("3.4.0", "3.9.0", "3.10.0", "4.6.0", "unreadable"):
        assert launch.launch_entry(c, version) == (c.run, own), version
    for launcher in (dict(global_scratch_size=64), dict(profile_scratch_size=8)):
        c = compiled(**launcher)
        assert launch.launch_entry(c, "3.6.0") == (c.run, own), launcher
    c = compiled()
    del c.run.profile_scratch_size  # a launcher of another shape
    assert launch.launch_entry(c, "3.6.0") == (c.run, own)


# --------------------------------------------------------------------------- GPU


def _need_cuda_triton() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    assert launch.available()


@pytest.fixture(params=list(PATHS))
def gpu_path(request: Any) -> Iterator[str]:
    _need_cuda_triton()
    with kernel_path(request.param):
        yield request.param


@pytest.mark.gpu
@settings(  # every path's constants compile their own kernels: the same cases on every build
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # gpu_path holds for every example
    ],
)
@given(case=batches(max_seqs=8, max_len=40))
def test_gpu_kernel_matches_torch_postpass(gpu_path: str, case: Dict[str, Any]) -> None:
    run_case(case, "cuda")


@pytest.mark.gpu
def test_gpu_fixed_cases(gpu_path: str) -> None:
    check_fixed("cuda", fixed_grid(full=True))


#: (nseq, changes): 255 sequences (256 offsets: one full chunk), 256 (the last offset alone
#: in a second chunk), 300; packed and separate layouts, no dQ, int32/int64 offsets.
MANY = (
    (255, dict(layout="separate", offset_dtype=torch.int32)),
    (256, dict(layout="th2d")),
    (300, {}),
    (300, dict(layout="separate", with_q=False, padded=False)),
    (300, dict(layout="transposed", h_q=4, h_kv=2, offset_dtype=torch.int32)),
)


@pytest.mark.gpu
@pytest.mark.parametrize("compare_max", [launch.COMPARE_MAX_OFFSETS, 1 << 30],
                         ids=["search", "compare"])  # fmt: skip
def test_gpu_many_sequences_and_bad_later_chunk(
    compare_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More offsets than one chunk of the shipped constants holds."""
    _need_cuda_triton()
    monkeypatch.setattr(launch, "COMPARE_MAX_OFFSETS", compare_max)
    for nseq, changes in MANY:
        for mask, window, brd in FIXED_MASKS:
            case = many_case(nseq, nseq, **changes, mask=mask, window=window)
            run_case(dict(case, bottom_right=brd), "cuda")
    check_bad_offsets(nseq=300, first_bad=260, device="cuda")


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda t: t.to(torch.float64), "float64"),
        (lambda t: t.as_subclass(_Subclass), "not a plain"),
        (lambda t: t[:, :1].expand(t.shape[0], 2, t.shape[2]), "zero-stride"),
        (lambda t: t.reshape(t.shape[0], -1), "2-D"),
        (lambda t: t.to("meta"), "meta"),
    ],
)
def test_kernel_declines_what_it_does_not_handle(change: Any, needle: str) -> None:
    """What the kernel takes, read from metadata (on CPU tensors: the CUDA check aside)."""
    dq, dk, dv, *offs = _small_case()
    cpu = torch.device("cpu")
    assert launch._unfit(dq, dk, dv, tuple(offs), cpu) is None
    assert launch._unfit(None, dk, dv, tuple(offs), cpu) is None  # no dQ: dK/dV alone
    one_head = dk.as_strided((12, 1, 8), (8, 0, 1))  # a stride of 0 on a size-1 dim is no expand
    assert launch._unfit(dq, one_head, dv, tuple(offs), cpu) is None
    why = launch._unfit(dq, change(dk), dv, tuple(offs), cpu)
    assert why is not None and needle in why, why
    for bad in (offs[0].to(torch.int16), offs[0].to("meta")):
        assert "offsets" in str(launch._unfit(dq, dk, dv, (bad, *offs[1:]), cpu))
    if hasattr(torch, "float8_e4m3fn"):
        assert "float8" in str(launch._unfit(dq, dk.to(torch.float8_e4m3fn), dv, tuple(offs), cpu))


def test_launch_sizing_reads_the_tensors_gpu_and_the_offsets_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SM count of the gradients' GPU (or the current one), and the compare path up to
    COMPARE_MAX_OFFSETS offsets, binary search beyond: both from metadata, on CPU."""
    asked: List[int] = []
    props = lambda i: asked.append(i) or SimpleNamespace(multi_processor_count=100 + i)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    sm_count = launch._sm_count.__wrapped__  # not the cache
    assert [sm_count(torch.device(d)) for d in ("cuda:1", "cuda", "cpu")] == [101, 103, 1]
    assert asked == [1, 3]
    _, dk, dv, *_ = _small_case()
    for n_offsets, search in ((launch.COMPARE_MAX_OFFSETS, False), (launch.COMPARE_MAX_OFFSETS + 1, True)):  # fmt: skip
        offs = (torch.zeros(n_offsets, dtype=torch.int32),) * 2 + (None, None)
        assert launch.prepare(None, dk, dv, offs, key_span("padding")).meta["SEARCH"] is search


@pytest.mark.gpu
def test_gpu_tensors_are_the_kernels() -> None:
    _need_cuda_triton()
    dq, dk, dv, *offs = (t.cuda() for t in _small_case())
    assert launch.unsupported(dq, dk, dv, tuple(offs)) is None
    # dK on CUDA: past the device check, the metadata checks still see dQ on the CPU.
    assert "on cpu" in str(launch.unsupported(dq.cpu(), dk, dv, tuple(offs)))


@pytest.mark.gpu
def test_gpu_no_sync_and_cuda_graph() -> None:
    """No host sync (sync debug mode 'error'), and a captured graph replays the zeroing."""
    _need_cuda_triton()
    dev = "cuda"
    rows, h_kv, d = 4096, 8, 128
    buf = torch.randn(rows, 2, h_kv, d, device=dev, dtype=torch.bfloat16)
    dq = torch.randn(rows, 4 * h_kv, d, device=dev, dtype=torch.bfloat16)
    dk, dv = buf[:, 0], buf[:, 1]
    lq, lk, gap = [512, 0, 1000, 0, 700], [600, 300, 1000, 200, 900], 16
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    cu_kv = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    pad = [0]
    for a, b in zip(lq, lk):
        pad.append(pad[-1] + max(a, b) + gap)
    pad_t = torch.tensor(pad, dtype=torch.int32, device=dev)
    args = (dq, dk, dv, cu_q, cu_kv, pad_t, pad_t)
    mask = "padding_causal_bottom_right"
    assert postpass.prepare_kernel(dq, dk, dv, args[3:], key_span(mask)) is not None

    zero_dead_rows(*args, attn_mask_type=mask, impl="triton")  # compile outside
    torch.cuda.synchronize()
    with no_host_sync():
        zero_dead_rows(*args, attn_mask_type=mask, impl="triton")

    graph, _ = capture(lambda: zero_dead_rows(*args, attn_mask_type=mask, impl="triton"))
    buf.fill_(float("nan"))
    dq.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not postpass._broken
    # Sequence 1 (lq 0) is wholly dead: rows pad[1] .. pad[2].
    assert bool((dk[pad[1] : pad[2]] == 0).all()) and bool((dv[pad[1] : pad[2]] == 0).all())
    # Sequence 0's attended keys (bottom-right causal: all 600) stay NaN.
    assert bool(dk[: lk[0]].isnan().all())
    assert bool((dq[pad[0] + lq[0] : pad[1]] == 0).all()) and bool(dq[: lq[0]].isnan().all())


if __name__ == "__main__":
    worker_main(WORKER_CHECKS)
