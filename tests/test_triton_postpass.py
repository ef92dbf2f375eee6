"""The Triton post-pass against the PyTorch post-pass and a scalar reference.

On CPU the kernel runs under Triton's interpreter. ``TRITON_INTERPRET=1`` must be set
before Triton decorates a kernel and stays in force for the whole process, so those
checks run in a child process (this file run as a script, ``python
tests/test_triton_postpass.py <check>``): nothing leaks into the other tests. Each
check compares, byte for byte, the whole storage behind dQ/dK/dV (guard rows past the
end included) after the kernel with the storage after ``zero_dead_rows(impl="torch")``,
and the kernel's zeroed rows with a row-by-row Python reference built on
:func:`te_gqa_fix.masks.key_interval`. Every row of every buffer starts with a NaN in it
(and random values, more NaN and Inf elsewhere), so a dead row left alone or a live row
written cannot pass. Batches of more than 255 sequences, and a worker that caps the
offsets chunk at 2, run the kernel's loop over offset chunks; impossible offsets in a
later chunk must zero nothing.

The ``gpu`` tests run the compiled kernel on CUDA (same checks, plus no host sync and
CUDA-graph capture); they skip cleanly without CUDA or Triton.
"""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes.cuda_checks import capture, no_host_sync
from fakes.interpreter import run_worker
from te_gqa_fix import offset_errors, triton_postpass
from te_gqa_fix.masks import KNOWN_MASK_TYPES, KeySpan, key_interval, key_span
from te_gqa_fix.offset_errors import OffsetsError
from te_gqa_fix.postpass import _offset_error_bits, zero_dead_rows

LAYOUTS = ("separate", "t2hd", "th2d", "t3hd", "th3d", "transposed")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GUARD_ROWS = 2


# --------------------------------------------------------------------------- cases


@st.composite
def batches(draw: Any) -> Dict[str, Any]:
    """A random THD batch: q-empty and kv-empty sequences, gaps, tail rows, all masks."""
    nseq = draw(st.integers(0, 5))
    length = st.one_of(st.just(0), st.integers(0, 11))
    lq = [draw(length) for _ in range(nseq)]
    lk = [draw(length) for _ in range(nseq)]
    padded = draw(st.booleans())
    gap = st.integers(0, 3) if padded else st.just(0)
    gaps_q = [draw(gap) for _ in range(nseq)]
    gaps_kv = [draw(gap) for _ in range(nseq)]
    lead = draw(st.integers(0, 2)) if padded else 0
    layout = draw(st.sampled_from(LAYOUTS))
    h_kv = draw(st.integers(1, 3))
    group = 1 if layout in ("t3hd", "th3d") else draw(st.integers(1, 4))
    d = draw(st.sampled_from([1, 3, 8, 16, 24]))
    d_v = d if layout != "separate" else draw(st.sampled_from([d, 5, 16]))
    with_q = layout in ("t3hd", "th3d") or draw(st.booleans())
    mask = draw(st.sampled_from((*KNOWN_MASK_TYPES, "arbitrary")))
    window = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    if draw(st.booleans()):
        window = (-1, -1)
    return dict(
        lq=lq,
        lk=lk,
        padded=padded,
        gaps_q=gaps_q,
        gaps_kv=gaps_kv,
        lead=lead,
        tail_q=draw(st.integers(0, 4)),
        tail_kv=draw(st.integers(0, 4)),
        layout=layout,
        h_q=h_kv * group,
        h_kv=h_kv,
        d=d,
        d_v=d_v,
        with_q=with_q,
        dtype=draw(st.sampled_from(DTYPES)),
        mask=mask,
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
    dtype, layout = case["dtype"], case["layout"]
    h_q, h_kv, d, d_v = case["h_q"], case["h_kv"], case["d"], case["d_v"]
    g = GUARD_ROWS
    bases: List[torch.Tensor] = []

    def new(*shape: int) -> torch.Tensor:
        base = torch.empty(shape, dtype=dtype)
        _fill(base, gen)
        base = base.to(device)
        bases.append(base)
        return base

    dq: Optional[torch.Tensor] = None
    if layout in ("t3hd", "th3d"):
        rows = max(rows_q, rows_kv)
        if layout == "t3hd":
            buf = new(rows + g, 3, h_kv, d)
            dq, dk, dv = buf[:rows, 0], buf[:rows, 1], buf[:rows, 2]
        else:
            buf = new(rows + g, h_kv, 3, d)
            dq, dk, dv = buf[:rows, :, 0], buf[:rows, :, 1], buf[:rows, :, 2]
        return bases, dq, dk, dv
    if case["with_q"]:
        if layout == "transposed":
            dq = new(rows_q + g, d, h_q).transpose(1, 2)[:rows_q]
        else:
            dq = new(rows_q + g, h_q, d)[:rows_q]
    if layout == "t2hd":
        buf = new(rows_kv + g, 2, h_kv, d)
        dk, dv = buf[:rows_kv, 0], buf[:rows_kv, 1]
    elif layout == "th2d":
        buf = new(rows_kv + g, h_kv, 2, d)
        dk, dv = buf[:rows_kv, :, 0], buf[:rows_kv, :, 1]
    elif layout == "transposed":
        dk = new(rows_kv + g, d, h_kv).transpose(1, 2)[:rows_kv]
        dv = new(rows_kv + g, d, h_kv).transpose(1, 2)[:rows_kv]
    else:
        dk = new(rows_kv + g, h_kv, d)[:rows_kv]
        dv = new(rows_kv + g, h_kv, d_v)[:rows_kv]
    return bases, dq, dk, dv


def _bytes(bases: List[torch.Tensor]) -> List[torch.Tensor]:
    return [b.detach().cpu().reshape(-1).view(torch.uint8) for b in bases]


def _reference_dead(
    rows: int, cu: List[int], pad: List[int], other: List[int], span: KeySpan, side: str
) -> List[bool]:
    """Row-by-row reference, independent of the vectorised code: True = must be zero."""
    dead = []
    nseq = len(cu) - 1
    for t in range(rows):
        seq = None
        for b in range(nseq):
            if pad[b] <= t < pad[b + 1]:
                seq = b
        if seq is None:
            dead.append(True)
            continue
        pos = t - pad[seq]
        own, oth = cu[seq + 1] - cu[seq], other[seq + 1] - other[seq]
        if side == "q":
            dead.append(not (pos < own and oth > 0))
        else:
            lo, hi = key_interval(oth, own, span)
            dead.append(not (lo <= pos < hi))
    return dead


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(t.shape[0], t.shape[1] * t.shape[2])


def _row_is_zero(t: torch.Tensor) -> List[bool]:
    return [bool(x) for x in (_rows2d(t) == 0).all(dim=1)]


def _row_bytes(t: torch.Tensor) -> List[bytes]:
    return [bytes(row.tolist()) for row in _rows2d(t).view(torch.uint8)]


def run_case(case: Dict[str, Any], device: str, launch: Any) -> None:
    """Kernel (``launch``) vs ``zero_dead_rows(impl="torch")`` vs the row reference."""
    nseq = len(case["lq"])
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
    mask_args = dict(
        attn_mask_type=case["mask"],
        window_size=case["window"],
        bottom_right_diagonal=case["bottom_right"],
    )
    span = key_span(**mask_args)  # type: ignore[arg-type]

    bases_k, dq_k, dk_k, dv_k = _buffers(case, rows_q, rows_kv, device)
    bases_t, dq_t, dk_t, dv_t = _buffers(case, rows_q, rows_kv, device)
    before = [_row_bytes(t) if t is not None else None for t in (dq_k, dk_k, dv_k)]

    launch(dq_k, dk_k, dv_k, *offs, span)
    # The public post-pass takes int32 offsets only (TE's dtype); the kernel takes int64 too.
    offs32 = [None if o is None else o.to(torch.int32) for o in offs]
    zero_dead_rows(dq_t, dk_t, dv_t, *offs32, impl="torch", **mask_args)  # type: ignore[arg-type]

    got, want = _bytes(bases_k), _bytes(bases_t)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"buffer {i} differs from the PyTorch post-pass; case={case}"

    pad_q_eff = pad_q if case["padded"] else cu_q
    pad_kv_eff = pad_kv if case["padded"] else cu_kv
    dead_kv = _reference_dead(rows_kv, cu_kv, pad_kv_eff, cu_q, span, "kv")
    checks = [(dk_k, dead_kv, before[1]), (dv_k, dead_kv, before[2])]
    if dq_k is not None:
        dead_q = _reference_dead(rows_q, cu_q, pad_q_eff, cu_kv, span, "q")
        checks.append((dq_k, dead_q, before[0]))
    for t, dead, rows_before in checks:
        zero, rows_after = _row_is_zero(t), _row_bytes(t)
        for r in range(t.shape[0]):
            if dead[r]:
                assert zero[r], f"row {r} should be zero; nseq={nseq} case={case}"
            else:
                assert rows_after[r] == rows_before[r], f"live row {r} changed; case={case}"


def _launch_checked(dq, dk, dv, cu_q, cu_kv, pad_q, pad_kv, span) -> None:
    offsets = (cu_q, cu_kv, pad_q, pad_kv)
    why = triton_postpass._why_unsupported(dq, dk, dv, offsets, require_cuda=False)
    assert why is None, why
    triton_postpass._launch(dq, dk, dv, cu_q, cu_kv, pad_q, pad_kv, span)


def _launch_public(dq, dk, dv, cu_q, cu_kv, pad_q, pad_kv, span) -> None:
    assert triton_postpass.zero_dead_rows_triton(dq, dk, dv, cu_q, cu_kv, pad_q, pad_kv, span=span)


# Fixed cases: the seed script's shape, and a context-parallel step with q-empty sequences.
SEED_CASE = dict(
    lq=[0, 3], lk=[3, 6], padded=True, gaps_q=[4, 5], gaps_kv=[1, 2], lead=0, tail_q=0,
    tail_kv=0, layout="separate", h_q=2, h_kv=1, d=8, d_v=8, with_q=True,
    dtype=torch.float16, mask="padding_causal", window=(-1, -1), bottom_right=None, seed=1,
)  # fmt: skip
CP_CASE = dict(
    lq=[6, 0, 10, 2, 0, 8], lk=[12, 8, 20, 4, 6, 16], padded=True, gaps_q=[2, 4, 2, 2, 4, 0],
    gaps_kv=[0, 0, 0, 0, 2, 0], lead=0, tail_q=5, tail_kv=3, layout="t2hd", h_q=8, h_kv=2,
    d=16, d_v=16, with_q=True, dtype=torch.bfloat16, mask="padding_causal_bottom_right",
    window=(-1, -1), bottom_right=None, seed=2,
)  # fmt: skip
FIXED_CASES = {"seed": SEED_CASE, "cp": CP_CASE}


# --------------------------------------------------------------------------- worker
# Run in a child process with TRITON_INTERPRET=1 (see the module docstring).

INTERPRETER_EXAMPLES = 300


# Mask arguments the fixed grid runs through: both diagonals, windows on each side.
FIXED_MASKS = (
    ("padding_causal", (-1, -1), None),
    ("padding_causal_bottom_right", (-1, -1), None),
    ("padding_causal_bottom_right", (3, 0), None),
    ("padding", (2, 1), True),
    ("padding", (1, 3), False),
    ("causal", (-1, -1), True),
    ("arbitrary", (-1, -1), None),
)


def fixed_grid():
    """Every layout x every mask of FIXED_MASKS on the context-parallel batch."""
    for layout in LAYOUTS:
        for mask, window, bottom_right in FIXED_MASKS:
            case = dict(CP_CASE, layout=layout, mask=mask, window=window)
            case["bottom_right"] = bottom_right
            if layout in ("t3hd", "th3d"):
                case["h_q"] = case["h_kv"]
            if layout == "separate":
                case["d_v"] = 24
            yield case


def _use_path(path: str) -> None:
    """Make the kernel find kept rows by ``path``: "compare" (every sequence's interval,
    any batch size) or "search" (a binary search per row), whatever the default."""
    triton_postpass._COMPARE_MAX_OFFSETS = {"compare": 1 << 30, "search": 0}[path]
    triton_postpass._launch_plans.clear()  # plans hold the path (SEARCH); not in their key


def _paths_used() -> set:
    return {"search" if p.meta["SEARCH"] else "compare"
            for p in triton_postpass._launch_plans.values()}  # fmt: skip


def _check_fixed() -> None:
    for path in ("compare", "search"):
        _use_path(path)
        _check_fixed_cases()
        assert _paths_used() == {path}


def _check_fixed_cases() -> None:
    for name, case in FIXED_CASES.items():
        run_case(case, "cpu", _launch_checked)
        print(f"fixed case {name}: ok")
    for case in fixed_grid():
        run_case(case, "cpu", _launch_checked)
    # The kernel must actually zero something here, or the comparison proves little.
    # Seed batch: seq 0 (rows 0-3) has no queries; seq 1 has lq 3, lk 6 at rows 4-11.
    offs = [torch.tensor(x, dtype=torch.int32) for x in ([0, 0, 3], [0, 3, 9], [0, 4, 12])]
    live_keys = {"padding_causal": 3, "padding_causal_bottom_right": 6}
    for mask, n_live in live_keys.items():
        _, dq, dk, dv = _buffers(SEED_CASE, 12, 12, "cpu")
        _launch_checked(dq, dk, dv, offs[0], offs[1], offs[2], offs[2], key_span(mask))
        want_kv = [True] * 4 + [False] * n_live + [True] * (8 - n_live)
        assert _row_is_zero(dk) == want_kv, (mask, _row_is_zero(dk))
        assert _row_is_zero(dv) == want_kv, (mask, _row_is_zero(dv))
        assert _row_is_zero(dq) == [True] * 4 + [False] * 3 + [True] * 5, _row_is_zero(dq)


def many_case(nseq: int, seed: int, **changes: Any) -> Dict[str, Any]:
    """A batch of ``nseq`` short sequences: more offsets than one chunk (256) holds.

    Lengths include zeros on either side (q-empty and kv-empty sequences), padded
    segments have gaps, and there are leading and tail rows.
    """
    rng = random.Random(seed)
    case = dict(
        lq=[rng.choice((0, 0, 1, 2, 3)) for _ in range(nseq)],
        lk=[rng.choice((0, 1, 2, 4)) for _ in range(nseq)],
        padded=True,
        gaps_q=[rng.choice((0, 0, 1, 3)) for _ in range(nseq)],
        gaps_kv=[rng.choice((0, 0, 2)) for _ in range(nseq)],
        lead=2, tail_q=3, tail_kv=37, layout="t2hd", h_q=2, h_kv=1, d=3, d_v=3,
        with_q=True, dtype=torch.bfloat16, mask="padding_causal", window=(-1, -1),
        bottom_right=None, seed=seed, offset_dtype=torch.int64,
    )  # fmt: skip
    case.update(changes)
    if not case["padded"]:
        case.update(gaps_q=[0] * nseq, gaps_kv=[0] * nseq, lead=0)
    return case


#: (nseq, (BLOCK_T, BLOCK_C), changes): 256 offsets (one full chunk), 257 (the last
#: offset alone in the second chunk), 301 (two chunks); packed and separate layouts, dq
#: None, int32/int64 offsets, padded offsets given or not; the default launch parameters
#: and larger ones the sweep tries (fewer programs also keep the interpreter quick).
MANY = (
    (255, (64, 128), dict(layout="separate", offset_dtype=torch.int32)),
    (256, (64, 256), dict(layout="th2d")),
    (300, (32, 128), {}),
    (300, (128, 256), dict(layout="separate", with_q=False, padded=False)),
    (300, (128, 64), dict(layout="transposed", h_q=4, h_kv=2, offset_dtype=torch.int32)),
)


def _check_many() -> None:
    """MANY x FIXED_MASKS, then impossible offsets in the second chunk; both paths."""
    saved = triton_postpass.BLOCK_T, triton_postpass.BLOCK_C
    try:
        for path in ("compare", "search"):
            _use_path(path)
            for nseq, (block_t, block_c), changes in MANY:
                triton_postpass.BLOCK_T, triton_postpass.BLOCK_C = block_t, block_c
                for mask, window, bottom_right in FIXED_MASKS:
                    case = many_case(nseq, nseq, **changes, mask=mask, window=window)
                    case["bottom_right"] = bottom_right
                    run_case(case, "cpu", _launch_checked)
            chunks = {p.meta["OFF_CHUNKS"] for p in triton_postpass._launch_plans.values()}
            assert chunks == {1, 2} and _paths_used() == {path}, (chunks, _paths_used())
            triton_postpass.BLOCK_T = 128  # fewer programs: quicker under the interpreter
            _check_bad_chunks()
    finally:
        triton_postpass.BLOCK_T, triton_postpass.BLOCK_C = saved


def _check_bad_chunks(device: str = "cpu", launch: Any = None) -> None:
    """Impossible offsets only in the second chunk: bits as the PyTorch path's, no store."""
    launch = launch or _launch_checked
    nseq = 300
    case = many_case(nseq, 7)
    cu_q, pad_q = _offsets(case["lq"], case["gaps_q"], case["lead"])
    cu_kv, pad_kv = _offsets(case["lk"], case["gaps_kv"], case["lead"])
    rows_q, rows_kv = pad_q[-1] + 3, pad_kv[-1] + 3

    def decrease(x: List[int], i: int) -> List[int]:
        y = list(x)
        y[i] = y[i - 1] - 1
        return y

    def short(pad: List[int], cu: List[int], i: int) -> List[int]:
        # Segment i one row shorter than its valid length; later offsets shift with it.
        cut = (pad[i + 1] - pad[i]) - (cu[i + 1] - cu[i]) + 1
        return pad[: i + 1] + [v - cut for v in pad[i + 1 :]]

    def minus(x: List[int], i: int) -> List[int]:
        y = list(x)
        y[i] = -1
        return y

    i_long = next(i for i in range(260, nseq) if cu_kv[i + 1] > cu_kv[i])
    bad = [
        # (cu_q, cu_kv, pad_q, pad_kv, rows_q, rows_kv, with_q)
        (cu_q, decrease(cu_kv, 290), pad_q, pad_kv, rows_q, rows_kv, True),
        (cu_q, cu_kv, pad_q, short(pad_kv, cu_kv, i_long), rows_q, rows_kv, True),
        (minus(cu_q, nseq), cu_kv, pad_q, pad_kv, rows_q, rows_kv, True),
        (cu_q, cu_kv, pad_q, pad_kv, pad_q[-1] - 1, rows_kv, True),  # dQ too short
        (cu_q, cu_kv, pad_q, pad_kv, pad_q[-1] - 1, rows_kv, False),  # ... but no dQ: fine
        (cu_q, cu_kv, pad_q, pad_kv, rows_q, pad_kv[-1] - 1, True),
        (cu_q, cu_kv, None, None, cu_q[-1], cu_kv[-1] - 1, True),
        (cu_q, decrease(cu_kv, 270), None, None, rows_q, rows_kv, False),
    ]
    span = key_span("padding_causal_bottom_right", (4, 0))
    for i, (cq, ck, pq, pk, rq, rk, with_q) in enumerate(bad):
        for dtype in (torch.int32, torch.int64)[i % 2 :]:
            offset_errors._reset()
            offs = [
                None if x is None else torch.tensor(x, dtype=dtype, device=device)
                for x in (cq, ck, pq, pk)
            ]
            gen = torch.Generator().manual_seed(i)
            bases = [torch.empty(rq + GUARD_ROWS, 2, 3), torch.empty(rk + GUARD_ROWS, 2, 1, 3)]
            for b in bases:
                _fill(b, gen)
            bases = [b.to(device) for b in bases]
            before = _bytes(bases)
            dq = bases[0][:rq] if with_q else None
            dk, dv = bases[1][:rk, 0], bases[1][:rk, 1]
            launch(dq, dk, dv, *offs, span)
            if device != "cpu":
                torch.cuda.synchronize()
            i64 = [None if x is None else x.to(torch.int64) for x in offs]
            want = int(
                _offset_error_bits(
                    i64[0], i64[1], i64[0] if pq is None else i64[2],
                    i64[1] if pk is None else i64[3], pq is not None, pk is not None,
                    rq if with_q else None, rk,
                )
            )  # fmt: skip
            got = int(offset_errors.kernel_flag(dk.device)[0])
            assert got == want, (i, dtype, got, want)
            if i == 4:
                assert want == 0, "a short dQ buffer is no error when there is no dQ"
                continue
            assert want != 0, i
            after = _bytes(bases)
            assert all(torch.equal(a, b) for a, b in zip(after, before)), (i, "a store")
            with pytest.raises(OffsetsError):
                offset_errors.raise_pending(dk.device)
    offset_errors._reset()


def _check_random_chunked() -> None:
    """The random batches with offsets scanned 2 at a time (up to 3 chunks per program),
    kept rows by the interval compare: chunks that meet a program's rows and chunks that
    do not."""
    offset_errors._OFF_BLOCK_MAX = 2
    _use_path("compare")
    check = settings(
        max_examples=INTERPRETER_EXAMPLES // 2,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(given(case=batches())(_random_body))
    check()
    chunks = {p.meta["OFF_CHUNKS"] for p in triton_postpass._launch_plans.values()}
    assert max(chunks) == 3 and _paths_used() == {"compare"}, (chunks, _paths_used())


def _check_random_path(path: str) -> None:
    """The random batches with kept rows found by ``path``."""
    _use_path(path)
    settings(
        max_examples=INTERPRETER_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(given(case=batches())(_random_body))()
    assert _paths_used() == {path}, _paths_used()


def _random_body(case: Dict[str, Any]) -> None:
    run_case(case, "cpu", _launch_checked)


WORKER_CHECKS = {
    "fixed": _check_fixed,
    "many": _check_many,
    "random_compare": lambda: _check_random_path("compare"),
    "random_search": lambda: _check_random_path("search"),
    "random_chunked": _check_random_chunked,
}


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("check", sorted(WORKER_CHECKS))
def test_interpreter_matches_torch_postpass(check: str) -> None:
    pytest.importorskip("triton")
    proc = run_worker(__file__, check)
    assert proc.returncode == 0, f"worker {check!r} failed:\n{proc.stdout}\n{proc.stderr}"
    assert f"worker {check}: ok" in proc.stdout, proc.stdout


def test_import_does_not_import_triton() -> None:
    code = (
        "import sys, te_gqa_fix, te_gqa_fix.triton_postpass, te_gqa_fix.postpass\n"
        "assert 'triton' not in sys.modules, 'triton imported at package import'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_available_matches_environment() -> None:
    try:
        import triton  # noqa: F401

        has_triton = True
    except ImportError:
        has_triton = False
    expected = torch.cuda.is_available() and has_triton
    assert triton_postpass.available() is expected
    assert triton_postpass.available() is expected  # cached, same answer


def _small_case() -> Tuple[torch.Tensor, ...]:
    dq, dk, dv = torch.randn(12, 2, 8), torch.randn(12, 1, 8), torch.randn(12, 1, 8)
    offs = [torch.tensor(x, dtype=torch.int32) for x in ([0, 0, 3], [0, 3, 9], [0, 4, 12])]
    return dq, dk, dv, offs[0], offs[1], offs[2], offs[2]


def test_declines_cpu_tensors_and_leaves_them_untouched() -> None:
    dq, dk, dv, *offs = _small_case()
    copies = [t.clone() for t in (dq, dk, dv)]
    span = key_span("padding_causal")
    assert triton_postpass.zero_dead_rows_triton(dq, dk, dv, *offs, span=span) is False
    for t, c in zip((dq, dk, dv), copies):
        assert torch.equal(t, c)
    why = triton_postpass._why_unsupported(dq, dk, dv, tuple(offs), require_cuda=True)
    assert why is not None and "cpu" in why


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda t: t.to(torch.float64), "dtype"),
        (lambda t: t.to(torch.int32), "dtype"),
        (lambda t: t.as_subclass(_Subclass), "not a plain"),
        (lambda t: t[:, :1].expand(t.shape[0], 4, t.shape[2]), "zero-stride"),
        (lambda t: t.reshape(t.shape[0], -1), "2-D"),
    ],
)
def test_declines_what_it_does_not_handle(change: Any, needle: str) -> None:
    dq, dk, dv, *offs = _small_case()
    assert triton_postpass._why_unsupported(dq, dk, dv, tuple(offs), require_cuda=False) is None
    why = triton_postpass._why_unsupported(dq, change(dk), dv, tuple(offs), False)
    assert why is not None and needle in why, why
    bad_offsets = (offs[0].to(torch.int16), *offs[1:])
    assert "offsets" in str(triton_postpass._why_unsupported(dq, dk, dv, bad_offsets, False))


@pytest.mark.skipif(
    not hasattr(torch, "float8_e4m3fn"), reason="this torch build has no float8 dtype"
)
def test_declines_float8() -> None:
    dq, dk, dv, *offs = _small_case()
    why = triton_postpass._why_unsupported(dq, dk.to(torch.float8_e4m3fn), dv, tuple(offs), False)
    assert why is not None and "dtype" in why


def test_impl_triton_on_cpu_falls_back_to_torch() -> None:
    dq, dk, dv, *offs = _small_case()
    ref = [t.clone() for t in (dq, dk, dv)]
    zero_dead_rows(*ref, *offs, attn_mask_type="padding_causal", impl="torch")
    zero_dead_rows(dq, dk, dv, *offs, attn_mask_type="padding_causal", impl="triton")
    for t, r in zip((dq, dk, dv), ref):
        assert torch.equal(t, r)
    assert bool((dk[:4] == 0).all()) and not bool((dk[4:10] == 0).all())


# --------------------------------------------------------------------------- GPU


def _need_cuda_triton() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    assert triton_postpass.available()


@pytest.fixture(params=["compare", "search"])
def kept_path(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the kernel finds kept rows, whatever the default (restored afterwards)."""
    value = {"compare": 1 << 30, "search": 0}[request.param]
    monkeypatch.setattr(triton_postpass, "_COMPARE_MAX_OFFSETS", value)
    monkeypatch.setattr(triton_postpass, "_launch_plans", {})
    return request.param


@pytest.mark.gpu
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # kept_path holds for every example
    ],
)
@given(case=batches())
def test_gpu_kernel_matches_torch_postpass(kept_path: str, case: Dict[str, Any]) -> None:
    _need_cuda_triton()
    run_case(case, "cuda", _launch_public)


@pytest.mark.gpu
def test_gpu_fixed_cases(kept_path: str) -> None:
    _need_cuda_triton()
    for case in (*FIXED_CASES.values(), *fixed_grid()):
        run_case(case, "cuda", _launch_public)


@pytest.mark.gpu
def test_gpu_many_sequences_and_bad_later_chunk(kept_path: str) -> None:
    """More offsets than one chunk holds, on the compiled kernel (see _check_many)."""
    _need_cuda_triton()
    for nseq, _, changes in MANY:
        for mask, window, bottom_right in FIXED_MASKS:
            case = many_case(nseq, nseq, **changes, mask=mask, window=window)
            case["bottom_right"] = bottom_right
            run_case(case, "cuda", _launch_public)
    _check_bad_chunks("cuda", _launch_public)


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
    span = key_span("padding_causal_bottom_right")
    args = (dq, dk, dv, cu_q, cu_kv, pad_t, pad_t)

    assert triton_postpass.zero_dead_rows_triton(*args, span=span)  # compile outside
    torch.cuda.synchronize()
    with no_host_sync():
        assert triton_postpass.zero_dead_rows_triton(*args, span=span)
        zero_dead_rows(*args, attn_mask_type="padding_causal_bottom_right", impl="triton")

    graph, launched = capture(lambda: triton_postpass.zero_dead_rows_triton(*args, span=span))
    assert launched  # warmed up on the capture stream, then captured
    buf.fill_(float("nan"))
    dq.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    # Sequence 1 (lq 0) is wholly dead: rows pad[1] .. pad[2].
    assert bool((dk[pad[1] : pad[2]] == 0).all()) and bool((dv[pad[1] : pad[2]] == 0).all())
    # Sequence 0's attended keys (bottom-right causal: all 600) stay NaN.
    assert bool(dk[: lk[0]].isnan().all())
    assert bool((dq[pad[0] + lq[0] : pad[1]] == 0).all()) and bool(dq[: lq[0]].isnan().all())


if __name__ == "__main__":
    name = sys.argv[1]
    WORKER_CHECKS[name]()
    print(f"worker {name}: ok")
