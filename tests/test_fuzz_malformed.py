"""Property: on random, often malformed metadata, ``zero_dead_rows`` and ``build_plan``
either raise ``ValueError``/``TypeError`` naming an argument (and change nothing), or give
exactly the brute-force oracle's rows. Never anything else (issue #13). That
``dead_row_masks`` is the same gate (the same error) is tests/test_bad_input.py's table.

Validity is decided here, independently of the library: a valid call must not raise, an
invalid one must raise, so "always raise" and "never check" both fail.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes.oracle import KNOWN, Ragged, assert_rows, bits, expected_keep
from te_gqa_fix import zero_dead_rows
from te_gqa_fix.cli.plan import PlanInput, build_plan
from te_gqa_fix.postpass import offset_errors

#: What an error may name first: the arguments of both entry points.
NAMES = tuple(
    "dq dk dv cu_seqlens_q cu_seqlens_kv cu_seqlens_q_padded cu_seqlens_kv_padded attn_mask_type "
    "window_size bottom_right_diagonal rows_q rows_kv".split()
)
MASKS = (*KNOWN, "arbitrary", "padding_casual", "", None, 3)
WINDOWS = ((-1, -1), (0, 0), (2, 0), (1, 3), None, (-5, 0), (1,), (1, 2, 3), "wide", (1.5, 0))
BRDS = (None, True, False, "false", 1)
FUZZ = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def offset_lists(draw: Any, n: int) -> List[int]:
    if draw(st.integers(0, 3)) == 0:  # plain random: mostly malformed
        return draw(st.lists(st.integers(-3, 16), min_size=n, max_size=n))
    start = draw(st.integers(0, 2))
    out = [start]
    for _ in range(n - 1):
        out.append(out[-1] + draw(st.integers(0, 4)))
    return out


@st.composite
def metadata(draw: Any) -> Dict[str, Any]:
    n = draw(st.integers(1, 5))
    lengths = [n] * 4
    if draw(st.integers(0, 9)) == 0:
        lengths[draw(st.integers(0, 3))] = draw(st.integers(0, 6))
    offs = [draw(offset_lists(k)) for k in lengths]
    h_kv = draw(st.integers(0, 3))
    return dict(
        offs=offs,
        pad_q=draw(st.booleans()),
        pad_kv=draw(st.booleans()),
        offs_dtype=draw(st.sampled_from([torch.int32] * 6 + [torch.int64, torch.float32])),
        rows_q=draw(st.integers(0, 16)),
        rows_kv=draw(st.integers(0, 16)),
        with_q=draw(st.booleans()),
        h_kv=h_kv,
        h_q=draw(st.sampled_from([h_kv, 2 * h_kv, 3 * h_kv, h_kv + 1])),
        h_v=draw(st.sampled_from([h_kv] * 4 + [h_kv + 1])),
        rows_v_delta=draw(st.sampled_from([0] * 8 + [1])),
        overlap=draw(st.sampled_from([None] * 6 + ["dq", "dk", "dv"])),
        mask=draw(st.sampled_from(MASKS)),
        window=draw(st.sampled_from(WINDOWS)),
        brd=draw(st.sampled_from(BRDS)),
        seed=draw(st.integers(0, 2**16)),
    )


def _offsets_valid(cu: Sequence[int], pad: Optional[Sequence[int]], rows: Optional[int]) -> bool:
    """TE's contract for one side, from the definition."""
    buf = cu if pad is None else pad
    for seq in (cu, buf):
        if any(x < 0 for x in seq) or any(b < a for a, b in zip(seq, seq[1:])):
            return False
    if any(buf[i + 1] - buf[i] < cu[i + 1] - cu[i] for i in range(len(cu) - 1)):
        return False
    return rows is None or buf[-1] <= rows


def _mask_valid(mask: object, window: object, brd: object) -> bool:
    mask_ok = isinstance(mask, str) and (mask in KNOWN or mask == "arbitrary")
    window_ok = window is None or (
        isinstance(window, tuple)
        and len(window) == 2
        and all(type(w) is int and w >= -1 for w in window)
    )
    return mask_ok and window_ok and (brd is None or isinstance(brd, bool))


def _oracle_ragged(cu_q: List[int], cu_kv: List[int], pad_q, pad_kv, rows_q: int, rows_kv: int):
    """The batch the offsets describe (padded offsets None: the valid ones)."""
    lengths = [tuple(b - a for a, b in zip(cu, cu[1:])) for cu in (cu_q, cu_kv)]
    pads = [tuple(cu if pad is None else pad) for cu, pad in ((cu_q, pad_q), (cu_kv, pad_kv))]
    return Ragged(*lengths, *pads, rows_q, rows_kv)


def _names_an_argument(exc: BaseException) -> bool:
    head = str(exc).split(":")[0]
    return any(name in [part.strip() for part in head.split(",")] for name in NAMES)


def _overlapping(rows: int, heads: int, d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(1, heads, d, generator=gen).expand(rows, heads, d)


@FUZZ
@given(case=metadata(), rows_given=st.booleans())
def test_post_pass_and_plan_raise_naming_an_argument_or_match_the_oracle(
    case: Dict[str, Any], rows_given: bool
) -> None:
    """One draw, both entry points: ``zero_dead_rows``, then ``build_plan`` (with the buffer
    sizes, or without: the last offsets)."""
    _zero_dead_rows_verdict(case)
    offset_errors._reset()
    _plan_verdict(case, rows_given)


def _zero_dead_rows_verdict(case: Dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    d = 2
    rows_q, rows_kv = case["rows_q"], case["rows_kv"]
    rows_v = rows_kv + case["rows_v_delta"]

    def grad(name: str, rows: int, heads: int) -> torch.Tensor:
        if case["overlap"] == name and rows > 1:
            return _overlapping(rows, heads, d, gen)
        return torch.randn(rows, heads, d, generator=gen)

    dq = grad("dq", rows_q, case["h_q"]) if case["with_q"] else None
    dk = grad("dk", rows_kv, case["h_kv"])
    dv = grad("dv", rows_v, case["h_v"])
    cu_q, cu_kv, pq, pk = case["offs"]
    pad_q = pq if case["pad_q"] else None
    pad_kv = pk if case["pad_kv"] else None

    def t(values: Optional[List[int]]) -> Optional[torch.Tensor]:
        return None if values is None else torch.tensor(values, dtype=case["offs_dtype"])

    before = [None if x is None else x.clone() for x in (dq, dk, dv)]
    n = len(cu_q)
    overlap = case["overlap"] is not None and (case["overlap"] != "dq" or case["with_q"])
    overlap = overlap and {"dq": rows_q, "dk": rows_kv, "dv": rows_v}[case["overlap"]] > 1
    valid = (
        case["offs_dtype"] == torch.int32
        and all(len(x) == n for x in (cu_kv, *(p for p in (pad_q, pad_kv) if p is not None)))
        and rows_v == rows_kv
        and case["h_kv"] > 0
        and case["h_v"] == case["h_kv"]
        and (not case["with_q"] or (case["h_q"] > 0 and case["h_q"] % case["h_kv"] == 0))
        and not overlap
        and _mask_valid(case["mask"], case["window"], case["brd"])
        and _offsets_valid(cu_q, pad_q, rows_q if case["with_q"] else None)
        and _offsets_valid(cu_kv, pad_kv, rows_kv)
    )
    try:
        zero_dead_rows(dq, dk, dv, *map(t, (cu_q, cu_kv, pad_q, pad_kv)),  # type: ignore[arg-type]
                       attn_mask_type=case["mask"], window_size=case["window"],
                       bottom_right_diagonal=case["brd"], impl="torch")  # fmt: skip
    except (ValueError, TypeError) as exc:
        assert not valid, f"valid input refused: {exc}"
        assert _names_an_argument(exc), f"error names no argument: {exc}"
        for x, b in zip((dq, dk, dv), before):
            assert x is None or torch.equal(bits(x), bits(b)), "refused call changed a gradient"
        return
    assert valid, "malformed input accepted"
    ragged = _oracle_ragged(cu_q, cu_kv, pad_q, pad_kv, rows_q, rows_kv)
    keep_q, keep_kv = expected_keep(ragged, case["mask"], case["window"], case["brd"])
    # The library keeps the declared window for a causal mask with right > 0 (a documented
    # superset); compare exactly only where the oracle and the library model the same set.
    if case["mask"] in KNOWN and KNOWN[case["mask"]][0] and (case["window"] or (0, 0))[1] > 0:
        return
    for name, x, b, keep in (("dk", dk, before[1], keep_kv), ("dv", dv, before[2], keep_kv),
                             ("dq", dq, before[0], keep_q)):  # fmt: skip
        if x is not None:
            assert_rows(x, b, keep, name)  # kept rows unchanged, dead rows zeroed


def _plan_verdict(case: Dict[str, Any], rows_given: bool) -> None:
    cu_q, cu_kv, pq, pk = case["offs"]
    pad_q = pq if case["pad_q"] else None
    pad_kv = pk if case["pad_kv"] else None
    rows_q = case["rows_q"] if rows_given else None
    rows_kv = case["rows_kv"] if rows_given else None
    offsets = [None if x is None else tuple(x) for x in (cu_q, cu_kv, pad_q, pad_kv)]
    inp = PlanInput(*offsets, case["mask"], case["window"], case["brd"], rows_q, rows_kv)
    n = len(cu_q)
    lengths_ok = all(len(x) == n for x in (cu_kv, *(p for p in (pad_q, pad_kv) if p is not None)))
    lengths_ok = lengths_ok and n >= 1
    eff_rows_q = rows_q if rows_q is not None else (pad_q or cu_q or [0])[-1]
    eff_rows_kv = rows_kv if rows_kv is not None else (pad_kv or cu_kv or [0])[-1]
    valid = (
        lengths_ok
        and _mask_valid(case["mask"], case["window"], case["brd"])
        and _offsets_valid(cu_q, pad_q, eff_rows_q)
        and _offsets_valid(cu_kv, pad_kv, eff_rows_kv)
    )
    try:
        plan = build_plan(inp)
    except (ValueError, TypeError) as exc:
        assert not valid, f"valid input refused: {exc}"
        assert _names_an_argument(exc), f"error names no field: {exc}"
        return
    assert valid, "malformed input accepted"
    assert plan.consistent
    ragged = _oracle_ragged(cu_q, cu_kv, pad_q, pad_kv, eff_rows_q, eff_rows_kv)
    keep_q, keep_kv = expected_keep(ragged, case["mask"], case["window"], case["brd"])
    if case["mask"] in KNOWN and KNOWN[case["mask"]][0] and (case["window"] or (0, 0))[1] > 0:
        return  # the documented superset (see above)
    assert [not z for z in plan.kv_zeroed] == keep_kv
    assert [not z for z in plan.q_zeroed] == keep_q
