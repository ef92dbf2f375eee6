"""The Triton post-pass kernel against the PyTorch post-pass and the brute-force oracle.

On CPU the kernel runs under Triton's interpreter, in one child process (this file run as a
script; see ``fakes/interpreter.py``), while the rest of the suite runs. The interpreter's
cost grows with rows x columns x programs, so the checks use small batches and shrink the
launch constants (:data:`PATHS`) to reach every kernel path with them: offsets read once per
program (``ONCE``) or in several chunks, kept rows by interval compare or by a binary search
per row (``SEARCH``), several row blocks per sequence, column tiles split into shares and
looped over.

Each check compares, byte for byte, the whole storage behind dQ/dK/dV (guard rows past the
end included) after the kernel with the storage after ``zero_dead_rows(impl="torch")``, and
the rows with the oracle (``fakes/oracle.py``). Every row starts with a NaN in it, so a dead
row left alone or a live row written cannot pass. Impossible offsets, in any chunk, must
store nothing and raise what the PyTorch path raises.

Where the kernel restates a rule of the Python code (``_key_bounds``: ``masks.key_bounds``;
``_read_offsets``' error bits: ``checks.offset_faults`` / ``offset_error_bits``), ONE
property test holds the restatement to the statement: ``restated_rules``.

The ``gpu`` tests run the compiled kernel (same checks with the shipped constants and larger
batches, plus no host sync and CUDA-graph capture); they skip cleanly without CUDA.
"""

from __future__ import annotations

import random
import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fakes.cuda_checks import capture, no_host_sync
from fakes.interpreter import interpreted_checks, worker_main
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
from te_gqa_fix import OffsetsError, _kernel, check_offset_errors, checks, postpass, zero_dead_rows
from te_gqa_fix._te import MASKS as KNOWN_MASK_TYPES
from te_gqa_fix.masks import KeySpan, key_bounds, key_span

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


def _path_of(launch: postpass.KernelLaunch) -> str:
    return "search" if launch.meta["SEARCH"] else "once" if launch.meta["ONCE"] else "chunks"


@contextmanager
def kernel_path(name: str, **extra: int) -> Iterator[List[postpass.KernelLaunch]]:
    """Inside, the launch constants of ``PATHS[name]`` (and ``extra``); yields the launches
    prepared inside, and checks on the way out that there were some and they took that path."""
    constants = {**PATHS[name], **extra}
    saved = {k: getattr(postpass, k) for k in constants}
    launches: List[postpass.KernelLaunch] = []
    launch_for = postpass._launch_for

    def recording(*args: Any) -> postpass.KernelLaunch:
        launches.append(launch_for(*args))
        return launches[-1]

    for k, v in constants.items():
        setattr(postpass, k, v)
    postpass._launch_for = recording  # type: ignore[assignment]
    try:
        yield launches
    finally:
        postpass._launch_for = launch_for  # type: ignore[assignment]
        for k, v in saved.items():
            setattr(postpass, k, v)
    assert launches, "the kernel never ran"
    if name == "chunks":  # one or two offsets fit one chunk
        launches = [p for p in launches if p.scalars[0] >= 2]
    assert {_path_of(p) for p in launches} <= {"once" if name == "default" else name}


def kernel_zero(dq, dk, dv, offsets: tuple, span: KeySpan) -> None:
    """The kernel alone (any offset dtype it takes), through the one launch route. On CUDA
    the prepared launch first runs on same-layout copies (the launch that compiles), so the
    gradients themselves get a later launch, through the bound launcher (asserted)."""
    launch = postpass._launch_for(dq, dk, dv, offsets, span)
    if dk.device.type != "cuda":
        launch.run(dq, dk, dv, offsets)
        return
    assert postpass._unfit(dq, dk, dv, offsets) is None
    copies = [None if t is None else _same_layout(t) for t in (dq, dk, dv)]
    launch.run(*copies, offsets)  # type: ignore[arg-type]
    launch.run(dq, dk, dv, offsets)
    # One pointer alignment (the copies' is the gradients'), so the second launch used the
    # launcher the first one stored.
    launchers = [f.__name__ for f in launch.launchers.values()]
    assert launchers == ["launch_on_current_stream"], launchers


def _same_layout(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s sizes, strides and storage offset in a fresh storage (whose start
    the caching allocator aligns as it aligned ``t``'s)."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=t.device)  # fmt: skip
    return storage.as_strided(t.size(), t.stride(), t.storage_offset())


def _reset_records() -> None:
    for rec in postpass._records.values():
        rec.clear()


def _names(exc: BaseException) -> str:
    return str(exc).split(":")[0]


def _raised(device: torch.device) -> Optional[str]:
    """The arguments a recorded error names (then cleared), or None."""
    try:
        check_offset_errors(device, synchronize=True)
    except OffsetsError as exc:
        return _names(exc)
    return None


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


def same_as_torch(case: Dict[str, Any], offs: List[Optional[torch.Tensor]], rows_q: int,
                  rows_kv: int, device: str) -> Tuple[list, Optional[str]]:  # fmt: skip
    """The kernel on one set of buffers, ``zero_dead_rows(impl="torch")`` on a twin set:
    the same bytes in the whole storage, and the same error (the arguments it names; the
    kernel's is recorded, raised by the next check). Returns the kernel's gradients (as
    they were before it ran) and the error."""
    _reset_records()
    mask = dict(attn_mask_type=case["mask"], window_size=case["window"],
                bottom_right_diagonal=case["bottom_right"])  # fmt: skip
    bases_k, dq_k, dk_k, dv_k = _buffers(case, rows_q, rows_kv, device)
    bases_t, dq_t, dk_t, dv_t = _buffers(case, rows_q, rows_kv, device)
    before = [None if t is None else t.detach().cpu().clone() for t in (dq_k, dk_k, dv_k)]
    stored = _bytes(bases_k)
    kernel_zero(dq_k, dk_k, dv_k, tuple(offs), key_span(**mask))
    kernel_error = _raised(dk_k.device)
    # The public post-pass takes int32 offsets only (TE's dtype); the kernel takes int64 too.
    offs32 = [None if o is None else o.to(torch.int32) for o in offs]
    try:
        zero_dead_rows(dq_t, dk_t, dv_t, *offs32, impl="torch", **mask)  # type: ignore[arg-type]
        torch_error = _raised(dk_t.device)  # on CUDA: recorded, not raised
    except OffsetsError as exc:
        torch_error = _names(exc)
    assert kernel_error == torch_error, (kernel_error, torch_error, case)
    for i, (a, b) in enumerate(zip(_bytes(bases_k), _bytes(bases_t))):
        assert torch.equal(a, b), f"buffer {i} differs from the PyTorch post-pass; case={case}"
    if kernel_error is not None:  # the PyTorch path stores nothing then: asserted, as bytes
        assert all(torch.equal(a, b) for a, b in zip(_bytes(bases_k), stored)), "a store"
    return [None if t is None else (t, b) for t, b in zip((dq_k, dk_k, dv_k), before)], kernel_error


def run_case(case: Dict[str, Any], device: str) -> None:
    """A well-formed batch: the kernel as the PyTorch post-pass (whole storage), and as the
    oracle (rows)."""
    cu_q, pad_q = _offsets(case["lq"], case["gaps_q"], case["lead"])
    cu_kv, pad_kv = _offsets(case["lk"], case["gaps_kv"], case["lead"])
    rows_q = pad_q[-1] + case["tail_q"]
    rows_kv = pad_kv[-1] + case["tail_kv"]
    if case["layout"] in ("t3hd", "th3d"):
        rows_q = rows_kv = max(rows_q, rows_kv)
    ints = dict(dtype=case.get("offset_dtype", torch.int32), device=device)
    offs: List[Optional[torch.Tensor]] = [
        torch.tensor(x, **ints) for x in (cu_q, cu_kv, pad_q, pad_kv)
    ]
    if not case["padded"]:
        offs[2] = offs[3] = None
    grads, error = same_as_torch(case, offs, rows_q, rows_kv, device)
    assert error is None, error
    mask, window, brd = case["mask"], case["window"], case["bottom_right"]
    # A causal mask with a right window > 0 keeps the declared window: a documented superset
    # the oracle does not model (tests/test_postpass.py); the byte check above still holds.
    if mask in KNOWN and KNOWN[mask][0] and (window or (0, 0))[1] > 0:
        return
    pads = (pad_q, pad_kv) if case["padded"] else (cu_q, cu_kv)
    lengths = (tuple(case["lq"]), tuple(case["lk"]))
    keep_q, keep_kv = expected_keep(Ragged(*lengths, *pads, rows_q, rows_kv), mask, window, brd)
    for name, got, keep in zip(("dq", "dk", "dv"), grads, (keep_q, keep_kv, keep_kv)):
        if got is not None:
            assert_rows(got[0].cpu(), got[1], keep, f"{name} case={case}")


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
#: The two for the "once" path's 8-element tiles, at 1/4 and 1/8 of the width: still dQ in
#: 4 shares and dK/dV in 2 of 2 tiles each, dV half of dK's tiles, more units than programs.
#: At full width they made 48 and 96 units, 4 of the interpreter's 20 s.
NARROW_WIDE_CASES = (dict(WIDE_CASE, d=16, d_v=16), dict(WIDE_KEYS_CASE, d=16, d_v=8))
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


def check_fixed(
    device: str, grid: Iterator[Dict[str, Any]], wide: tuple = (WIDE_CASE, WIDE_KEYS_CASE)
) -> None:
    """The fixed cases (``wide``: the wide ones), and rows the kernel must actually zero (or
    the comparison proves little). Seed batch: seq 0 (rows 0-3) has no queries; seq 1 has
    lq 3, lk 6 at rows 4-11."""
    for case in (SEED_CASE, *wide, CP_CASE, *grid):
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
    is no error. Then buffers without a row (an empty micro-batch, a context-parallel rank
    without tokens): their offsets are judged too, the last one is no error."""
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
        ([-1], [0], None, None, 0, 0, False),
        ([0, 2], [0, -1], None, None, 2, 0, True),
        ([0, 0], [0, 3], None, None, 0, 0, True),  # kv tokens, but an empty kv buffer
        ([0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], 0, 0, True),
    ]  # fmt: skip


def check_bad_offsets(nseq: int, first_bad: int, device: str = "cpu") -> None:
    """Each case (int32 and int64 offsets in turn): the kernel stores nothing and the next
    check raises naming what the PyTorch path names."""
    cases = bad_offset_cases(nseq, first_bad)
    for i, (cq, ck, pq, pk, rq, rk, with_q) in enumerate(cases):
        dtype = (torch.int32, torch.int64)[i % 2]
        offs = [None if x is None else torch.tensor(x, dtype=dtype, device=device)
                for x in (cq, ck, pq, pk)]  # fmt: skip
        case = dict(seed=i, dtype=torch.float32, layout="t2hd", h_q=2, h_kv=1, d=3,
                    with_q=with_q, mask="padding_causal_bottom_right", window=(4, 0),
                    bottom_right=None)  # fmt: skip
        _, error = same_as_torch(case, offs, rq, rk, device)
        assert (error is None) is (i in (4, len(cases) - 1)), (i, error)


# --------------------------------------------------------------------------- worker
# Run in the child process with TRITON_INTERPRET=1 (see the module docstring).

WORKER = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _examples(n: int, test: Callable[..., None], shrink: bool = True, **strategies: Any) -> None:
    """``test`` on ``n`` examples drawn from ``strategies`` (``shrink`` False: a failing
    example is reported as drawn, where each shrinking step would be a slow launch)."""
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    settings(WORKER, max_examples=n, phases=phases)(given(**strategies)(test))()


def _check_fixed(path: str) -> None:
    """The fixed cases. Every layout and mask with the shipped constants (the fewest units:
    the cheapest under the interpreter) and on the binary search (its own key bounds)."""
    grid = fixed_grid(full=False) if path in ("default", "search") else iter(())
    with kernel_path(path) as launches:
        check_fixed(
            "cpu", grid, NARROW_WIDE_CASES if path == "once" else (WIDE_CASE, WIDE_KEYS_CASE)
        )
    if path != "default":
        assert any(p.scalars[9] > 1 for p in launches), "no program ran several units"
    if path == "chunks":
        assert any(p.meta["OFF_CHUNKS"] >= 3 for p in launches), "never 3 chunks or more"
    if path == "once":  # dK/dV and dQ column tiles in shares of several tiles each
        assert any(p.scalars[7] > 1 and p.meta["NT_K"] > 1 for p in launches), "dK/dV"
        assert any(p.scalars[8] > 1 and p.meta["NT_Q"] > 1 for p in launches), "dQ"


def _check_random(path: str) -> None:
    with kernel_path(path):
        _examples(10, lambda case: run_case(case, "cpu"), case=batches())


def _check_bad_offsets(path: str) -> None:
    """Bad offsets from index 6 on: with chunks of 2 offsets, in the 4th chunk or later."""
    with kernel_path(path, BLOCK_T=32):  # errors are judged per unit: few units will do
        check_bad_offsets(nseq=9, first_bad=6)


@st.composite
def malformed(draw: Any) -> Dict[str, Any]:
    """Random offsets, often impossible: ``(offs, rows_q, rows_kv, case)``. Half of them
    are well formed (padded offsets with gaps) but for at most one small defect: the first
    offset -1, one offset one below the one before, or one padded segment one row short."""
    n = draw(st.integers(1, 6))
    offs = [draw(st.lists(st.integers(-3, 14), min_size=n, max_size=n)) for _ in range(4)]
    if draw(st.booleans()):
        for side in (0, 1):
            offs[side] = sorted(abs(x) for x in offs[side])
            gaps = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
            offs[side + 2] = [x + sum(gaps[: i + 1]) for i, x in enumerate(offs[side])]
        which, i = draw(st.integers(0, 3)), draw(st.integers(0, n - 1))
        defect = draw(st.sampled_from(["none", "negative", "decrease", "short"]))
        x = offs[which]
        if defect == "negative":
            x[0] = -1
        elif defect == "decrease" and i > 0:
            x[i] = x[i - 1] - 1
        elif defect == "short" and i > 0:  # segment i - 1 of a padded side one row short
            pad, cu = offs[2 + which % 2], offs[which % 2]
            cut = (pad[i] - pad[i - 1]) - (cu[i] - cu[i - 1]) + 1
            offs[2 + which % 2] = [*pad[:i], *(v - cut for v in pad[i:])]
    pad_q, pad_kv = draw(st.booleans()), draw(st.booleans())
    # Buffer rows around the last buffer offset half of the time: one row short, exact, or
    # one spare row (the end of the buffer is what the last offset is checked against).
    ends = (offs[2 if pad_q else 0][-1], offs[3 if pad_kv else 1][-1])
    rows_q, rows_kv = (max(0, end + draw(st.integers(-1, 1))) if draw(st.booleans())
                       else draw(st.integers(1, 14)) for end in ends)  # fmt: skip
    return dict(
        offs=offs,
        pad_q=pad_q,
        pad_kv=pad_kv,
        rows_q=rows_q,
        rows_kv=rows_kv,
        case=dict(seed=1, dtype=torch.float32, layout="separate", h_q=2, h_kv=1, d=3, d_v=3,
                  with_q=draw(st.booleans()), bottom_right=None, window=(-1, -1),
                  mask=draw(st.sampled_from(["padding_causal", "padding",
                                             "padding_causal_bottom_right"]))),
    )  # fmt: skip


def _malformed_body(draw: Dict[str, Any]) -> None:
    """Random, often impossible offsets through the whole kernel: what the PyTorch path
    does (bytes, and the error it raises)."""
    offs = [torch.tensor(x, dtype=torch.int32) for x in draw["offs"]]
    offs[2] = offs[2] if draw["pad_q"] else None
    offs[3] = offs[3] if draw["pad_kv"] else None
    same_as_torch(draw["case"], offs, draw["rows_q"], draw["rows_kv"], "cpu")


def _check_malformed(path: str) -> None:
    with kernel_path(path, BLOCK_T=16):
        _examples(6, _malformed_body, draw=malformed())


# ---- the kernel's restatements of Python rules, held to them (one property test)
tl: Any = None  # triton.language, set in the worker before the probe is decorated


def _probe(cu_q_ptr, cu_kv_ptr, pad_q_ptr, pad_kv_ptr, rows_q_ptr, rows_kv_ptr, err_ptr, lq_ptr,
           lk_ptr, lo_ptr, hi_ptr, nseq, window_left, window_right, EXACT: tl.constexpr,
           TOP_LEFT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, HAS_WL: tl.constexpr,
           HAS_WR: tl.constexpr, HAS_Q: tl.constexpr, CU_Q_BIT: tl.constexpr,
           CU_KV_BIT: tl.constexpr, PAD_Q_BIT: tl.constexpr, PAD_KV_BIT: tl.constexpr,
           OFF_BLOCK: tl.constexpr, OFF_CHUNKS: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """Program ``p``: the error bits ``_read_offsets`` gives over every chunk of offset set
    ``p`` (row ``p`` of each ``[sets, nseq + 1]`` offset tensor), ORed as the post-pass
    kernel ORs them. Program 0 also: ``_key_bounds`` of ``N`` (lq, lk) pairs."""
    p = tl.program_id(0)
    at = p * (nseq + 1)
    rows_q = tl.load(rows_q_ptr + p)
    rows_kv = tl.load(rows_kv_ptr + p)
    err = tl.zeros([OFF_BLOCK], dtype=tl.int32)
    for c in range(OFF_CHUNKS):
        err_c, _f_kv, _e_kv, _f_q, _e_q = _kernel._read_offsets_jit(
            cu_q_ptr + at, cu_kv_ptr + at, pad_q_ptr + at, pad_kv_ptr + at, c, nseq, rows_q,
            rows_kv, window_left, window_right, EXACT, TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR,
            True, HAS_Q, CU_Q_BIT, CU_KV_BIT, PAD_Q_BIT, PAD_KV_BIT, OFF_BLOCK,
        )  # fmt: skip
        err = err | err_c
    tl.store(err_ptr + p, tl.reduce(err, 0, _kernel._or_jit))
    if p == 0:
        i = tl.arange(0, N)
        lo, hi = _kernel._key_bounds_jit(
            tl.load(lq_ptr + i), tl.load(lk_ptr + i), window_left, window_right, EXACT,
            TOP_LEFT, BOTTOM_RIGHT, HAS_WL, HAS_WR,
        )  # fmt: skip
        tl.store(lo_ptr + i, lo)
        tl.store(hi_ptr + i, hi)


_PROBE: List[Any] = []
_RULE_MASKS = (*KNOWN_MASK_TYPES, "arbitrary", "padding_casual")
#: Every (lq, lk) up to 10 (padded to a power of two with (0, 0)).
_LQ = torch.arange(11).repeat_interleave(11)
_LK = torch.arange(11).repeat(11)
_LQ, _LK = (torch.cat((x, x.new_zeros(128 - x.numel()))) for x in (_LQ, _LK))


def _defects(offs: List[List[int]]) -> Iterator[List[List[int]]]:
    """``offs`` with each single small defect in turn: an offset of any argument -1 below
    the one before (the first: -1), or a padded segment one row shorter than its valid
    length."""
    for which, x in enumerate(offs):
        for i in range(len(x)):
            changed = [list(o) for o in offs]
            changed[which][i] = -1 if i == 0 else x[i - 1] - 1
            yield changed
            if which >= 2 and i > 0:
                pad, cu = x, offs[which - 2]
                cut = (pad[i] - pad[i - 1]) - (cu[i] - cu[i - 1]) + 1
                yield [*offs[:which], [*pad[:i], *(v - cut for v in pad[i:])], *offs[which + 1 :]]


def _rules_body(draw: Dict[str, Any], lengths: List[Tuple[int, int]], gaps: List[int],
                mask: str, window: Tuple[int, int], brd: Optional[bool], off_block: int) -> None:  # fmt: skip
    """One launch of the probe: the drawn offsets (often impossible), a well-formed batch of
    the same count with every single small defect and with buffers one row short, exact and
    one row long; the constants are those ``postpass._launch_for`` prepares (the span, and
    which argument each error bit names)."""
    n, with_q = len(draw["offs"][0]), draw["case"]["with_q"]
    cu = [[0], [0]]
    for lq, lk in lengths[: n - 1]:
        cu[0].append(cu[0][-1] + lq)
        cu[1].append(cu[1][-1] + lk)
    pads = [[x + sum(gaps[: i + 1]) for i, x in enumerate(c)] for c in cu]
    base = [*cu, *pads]
    ends = [(pads[0] if draw["pad_q"] else cu[0])[-1], (pads[1] if draw["pad_kv"] else cu[1])[-1]]
    sets = [(draw["offs"], draw["rows_q"], draw["rows_kv"])]
    sets += [(base, ends[0] + dq, ends[1] + dk) for dq in (-1, 0, 1) for dk in (-1, 0, 1)]
    sets += [(offs, *ends) for offs in _defects(base)]
    given = [True, True, draw["pad_q"], draw["pad_kv"]]
    stacked = [torch.tensor([o[k] for o, _, _ in sets]) if given[k] else None for k in range(4)]
    rows = [torch.tensor([r[k] for r in sets]).clamp(min=0) for k in (1, 2)]
    span = key_span(mask, window, brd)  # malformed arguments: the conservative span
    dk = torch.empty(1, 1, 1)
    saved = postpass.OFF_BLOCK_MAX
    postpass.OFF_BLOCK_MAX = off_block
    try:
        first = tuple(None if t is None else t[0] for t in stacked)
        launch = postpass._launch_for(dk if with_q else None, dk, dk, first, span)
    finally:
        postpass.OFF_BLOCK_MAX = saved
    meta = {k: launch.meta[k] for k in ("EXACT", "TOP_LEFT", "BOTTOM_RIGHT", "HAS_WL", "HAS_WR",
                                        "HAS_Q", "CU_Q_BIT", "CU_KV_BIT", "PAD_Q_BIT",
                                        "PAD_KV_BIT", "OFF_BLOCK", "OFF_CHUNKS")}  # fmt: skip
    window_left, window_right = launch.scalars[-2:]
    err = torch.zeros(len(sets), dtype=torch.int32)
    lo, hi = torch.zeros_like(_LQ), torch.zeros_like(_LQ)
    cu_q, cu_kv = stacked[0], stacked[1]
    pad_q = cu_q if stacked[2] is None else stacked[2]
    pad_kv = cu_kv if stacked[3] is None else stacked[3]
    _PROBE[0][(len(sets),)](cu_q, cu_kv, pad_q, pad_kv, rows[0], rows[1], err, _LQ, _LK, lo, hi,
                            n - 1, window_left, window_right, **meta, N=_LQ.numel())  # fmt: skip
    for j, (offs, _, _) in enumerate(sets):
        mine = [None if t is None else t[j] for t in stacked]
        faults = checks.offset_faults(*mine, int(rows[0][j]) if with_q else None, int(rows[1][j]))
        assert int(err[j]) == int(checks.offset_error_bits(faults)), (offs, sets[j], int(err[j]))
    want_lo, want_hi = key_bounds(_LQ, _LK, span)
    empty = (hi <= lo) & (want_hi <= want_lo)  # an empty interval: any bounds say it
    assert torch.equal(lo.where(~empty, 0), want_lo.where(~empty, 0)), span
    assert torch.equal(hi.where(~empty, 0), want_hi.where(~empty, 0)), span


def _check_restated_rules() -> None:
    global tl
    import triton
    import triton.language

    _kernel.build()
    tl = triton.language
    _PROBE.append(triton.jit(_probe))
    _examples(
        6,
        _rules_body,
        shrink=False,
        draw=malformed(),
        lengths=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=6, max_size=6),
        gaps=st.lists(st.integers(0, 2), min_size=7, max_size=7),
        mask=st.sampled_from(_RULE_MASKS),
        window=st.tuples(st.integers(-1, 5), st.integers(-1, 5)) | st.just((-3, 0)),
        brd=st.sampled_from([None, True, False]),
        off_block=st.sampled_from([2, 256]),
    )


# ---- the public entry points reaching the interpreted kernel
def _check_public_path() -> None:
    """``zero_dead_rows(impl="triton")`` reaching the interpreted kernel, against the
    oracle, with q and kv padded offsets that differ and an explicit bottom_right_diagonal:
    swapping arguments or dropping the flag on the way to the kernel fails here. Then
    impossible offsets through the kernel: nothing zeroed, raised at the next call."""
    reached: List[int] = []

    def cpu_prepare(*args: Any) -> postpass.KernelLaunch:  # prepare minus its CUDA gate
        reached.append(1)
        return postpass._launch_for(*args)

    real, postpass.prepare = postpass.prepare, cpu_prepare  # type: ignore[assignment]
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
        assert reached and postpass._no_kernel is None
        _public_bad_offsets()
        assert postpass._no_kernel is None
    finally:
        postpass.prepare = real  # type: ignore[assignment]


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
    _reset_records()
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


def _check_wrapper_sequence_counts() -> None:
    """The wrapper's kernel launches on calls of one shape whose batches hold 3, then 5
    sequences in the same rows, alternating: every call's rows match the oracle through the
    interpreted kernel (a launch prepared for another count zeroes live rows)."""
    real = postpass.prepare
    postpass.prepare = postpass._launch_for  # type: ignore[assignment]  # minus its CUDA gate
    try:
        fake, wrapped = FakeTE.with_wrapper("2.20")
        for ragged in (*SAME_ROWS_OTHER_COUNTS, *SAME_ROWS_OTHER_COUNTS):
            fake.backend.reset()
            wrapped(**call_arguments("2.20", ragged))
            assert_post_pass(fake.backend.outputs, ragged, "padding_causal", (-1, -1), None)
        assert postpass._no_kernel is None
    finally:
        postpass.prepare = real  # type: ignore[assignment]


def _check_cpu_imports_no_triton_or_te() -> None:
    """First in the worker, a fresh process: the package and the post-pass on CPU tensors
    (impl auto and triton) import no Triton, and the package no Transformer Engine (what it
    does without TE: tests/test_policy_and_errors.py). Nothing has imported either yet."""
    import te_gqa_fix
    import te_gqa_fix.patch
    import te_gqa_fix.wrapper

    assert callable(te_gqa_fix.fused_attn_bwd) and callable(te_gqa_fix.install)
    assert te_gqa_fix.is_installed() is False and not any(te_gqa_fix.call_counts().values())
    offs = torch.tensor([0, 2, 5], dtype=torch.int32)
    for impl in ("auto", "triton"):
        zero_dead_rows(None, torch.ones(5, 1, 2), torch.ones(5, 1, 2), offs, offs, impl=impl)
    assert _kernel.tl is None and "triton" not in sys.modules, "Triton imported on CPU"
    te = sorted(m for m in sys.modules if m.split(".")[0] == "transformer_engine")
    assert te == [], f"te_gqa_fix imported {te}"


WORKER_CHECKS = {
    "cpu_imports_no_triton_or_te": _check_cpu_imports_no_triton_or_te,  # must stay first
    "restated_rules": _check_restated_rules,
    **{f"fixed_{p}": (lambda p=p: _check_fixed(p)) for p in PATHS},
    **{f"random_{p}": (lambda p=p: _check_random(p)) for p in ("once", "chunks", "search")},
    **{f"bad_offsets_{p}": (lambda p=p: _check_bad_offsets(p)) for p in ("chunks", "search")},
    **{f"malformed_{p}": (lambda p=p: _check_malformed(p)) for p in ("chunks", "search")},
    "public_path": _check_public_path,
    "wrapper_sequence_counts": _check_wrapper_sequence_counts,
}


# --------------------------------------------------------------------------- tests
interpreter_results = interpreted_checks("interpreter_results", __file__)


@pytest.mark.parametrize("check", list(WORKER_CHECKS))
def test_interpreted_kernel(check: str, interpreter_results: Dict[str, dict]) -> None:
    result = interpreter_results[check]
    assert result["ok"], f"{check} failed under the interpreter:\n{result['error']}"


def _small_case() -> Tuple[torch.Tensor, ...]:
    dq, dk, dv = torch.randn(12, 2, 8), torch.randn(12, 1, 8), torch.randn(12, 1, 8)
    offs = [torch.tensor(x, dtype=torch.int32) for x in ([0, 0, 3], [0, 3, 9], [0, 4, 12])]
    return dq, dk, dv, offs[0], offs[1], offs[2], offs[2]


class _Subclass(torch.Tensor):
    pass


#: A change to dK, and why the kernel declines it.
DECLINED = {
    "float64": (lambda t: t.to(torch.float64), "dk is a 3-D torch.float64 tensor on cpu"),
    "subclass": (lambda t: t.as_subclass(_Subclass), "dk is a _Subclass, not a plain torch.Tensor"),
    "expanded": (lambda t: t[:, :1].expand(t.shape[0], 2, t.shape[2]), "dk is expanded (a zero stride)"),
    "2-D": (lambda t: t.reshape(t.shape[0], -1), "dk is a 2-D torch.float32 tensor on cpu"),
    "other device": (lambda t: t.to("meta"), "dq is a 3-D torch.float32 tensor on cpu"),
    **({"float8": (lambda t: t.to(torch.float8_e4m3fn), "dk is a 3-D torch.float8_e4m3fn tensor on cpu")}
       if hasattr(torch, "float8_e4m3fn") else {}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DECLINED))
def test_the_kernel_declines_what_it_does_not_handle(case: str) -> None:
    """What the kernel takes, read from metadata (CUDA aside: on CPU tensors); what it
    declines gets the PyTorch post-pass (tests/test_postpass.py)."""
    change, why = DECLINED[case]
    dq, dk, dv, *offs = _small_case()
    assert postpass._unfit(dq, dk, dv, tuple(offs)) is None
    assert postpass._unfit(None, dk, dv, tuple(offs)) is None  # no dQ: dK/dV alone
    one_head = dk.as_strided((12, 1, 8), (8, 0, 1))  # a stride of 0 on a size-1 dim is no expand
    assert postpass._unfit(dq, one_head, dv, tuple(offs)) is None
    assert postpass._unfit(dq, change(dk), dv, tuple(offs)) == why
    for bad, why in ((offs[0].to(torch.int16), "cu_seqlens_q is torch.int16 on cpu"),
                     (offs[0].to("meta"), "cu_seqlens_q is torch.int32 on meta")):  # fmt: skip
        assert postpass._unfit(dq, dk, dv, (bad, *offs[1:])) == why


# --------------------------------------------------------------------------- GPU
def _need_cuda_triton() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    assert postpass.implementation() == ("triton", None)


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
@pytest.mark.parametrize("compare_max", [postpass.COMPARE_MAX_OFFSETS, 1 << 30],
                         ids=["search", "compare"])  # fmt: skip
def test_gpu_many_sequences_and_bad_later_chunk(
    compare_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More offsets than one chunk of the shipped constants holds."""
    _need_cuda_triton()
    monkeypatch.setattr(postpass, "COMPARE_MAX_OFFSETS", compare_max)
    for nseq, changes in MANY:
        for mask, window, brd in FIXED_MASKS:
            case = many_case(nseq, nseq, **changes, mask=mask, window=window)
            run_case(dict(case, bottom_right=brd), "cuda")
    check_bad_offsets(nseq=300, first_bad=260, device="cuda")


@pytest.mark.gpu
def test_gpu_tensors_are_the_kernels() -> None:
    _need_cuda_triton()
    dq, dk, dv, *offs = (t.cuda() for t in _small_case())
    assert postpass.prepare(dq, dk, dv, tuple(offs), key_span("padding")) is not None
    # dK on CUDA: past the device check, the metadata checks still see dQ on the CPU.
    assert (
        postpass._unfit(dq.cpu(), dk, dv, tuple(offs)) == "dq is a 3-D torch.float32 tensor on cpu"
    )


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
    assert postpass.prepare(dq, dk, dv, args[3:], key_span(mask)) is not None

    zero_dead_rows(*args, attn_mask_type=mask, impl="triton")  # compile outside
    torch.cuda.synchronize()
    with no_host_sync():
        zero_dead_rows(*args, attn_mask_type=mask, impl="triton")

    graph, _ = capture(lambda: zero_dead_rows(*args, attn_mask_type=mask, impl="triton"))
    buf.fill_(float("nan"))
    dq.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert postpass._no_kernel is None
    # Sequence 1 (lq 0) is wholly dead: rows pad[1] .. pad[2].
    assert bool((dk[pad[1] : pad[2]] == 0).all()) and bool((dv[pad[1] : pad[2]] == 0).all())
    # Sequence 0's attended keys (bottom-right causal: all 600) stay NaN.
    assert bool(dk[: lk[0]].isnan().all())
    assert bool((dq[pad[0] + lq[0] : pad[1]] == 0).all()) and bool(dq[: lq[0]].isnan().all())


if __name__ == "__main__":
    worker_main(WORKER_CHECKS)
