"""``te-gqa-fix plan``: which gradient rows the post-pass zeroes for a batch, and why.

Before trusting a fix that writes zeros into gradients, a user should be able to see
exactly which rows it will touch for their own batch layout (context-parallel steps,
padding, sliding windows). The rows come from :func:`te_gqa_fix.postpass.dead_row_masks`, the very
function the post-pass uses, so this report cannot drift from what the fix does; the
reason for each row comes from :func:`te_gqa_fix.masks.key_interval` and the offsets. A
row whose reason disagrees with the mask is reported as ``inconsistent`` (a bug to
report), never hidden. Runs on CPU; Transformer Engine is not needed.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .masks import KeySpan, check_mask_arguments, key_interval, key_span
from .postpass import dead_row_masks
from .validation import check_values

__all__ = [
    "Plan",
    "PlanInput",
    "Run",
    "SequencePlan",
    "build_plan",
    "check_input",
    "format_plan",
    "plan_from_json",
]

# Reason codes (stable: the JSON output and tests use them).
BEFORE_FIRST = "before_first"  # row before the first sequence's offset
PADDING = "padding"  # row after sequence b's valid tokens, before the next sequence
TAIL = "tail"  # row after the last sequence
NO_QUERIES = "no_queries"  # row of a sequence with no query tokens
OUTSIDE_WINDOW = "outside_window"  # KV row no query of its sequence attends
NO_KEYS = "no_keys"  # dQ row of a sequence with no keys
ATTENDED = "attended"  # KV row some query attends: kept
VALID_QUERY = "valid_query"  # dQ row of a valid query with keys: kept
INCONSISTENT = "inconsistent"  # reason and post-pass disagree (must never happen)

KEPT_CODES = (ATTENDED, VALID_QUERY)


@dataclass(frozen=True)
class PlanInput:
    """The batch description, with TE's argument names."""

    cu_seqlens_q: Tuple[int, ...]
    cu_seqlens_kv: Tuple[int, ...]
    cu_seqlens_q_padded: Optional[Tuple[int, ...]] = None
    cu_seqlens_kv_padded: Optional[Tuple[int, ...]] = None
    attn_mask_type: str = "padding_causal"
    window_size: Tuple[int, int] = (-1, -1)
    bottom_right_diagonal: Optional[bool] = None
    rows_q: Optional[int] = None
    rows_kv: Optional[int] = None


@dataclass(frozen=True)
class SequencePlan:
    index: int
    lq: int
    lk: int
    q_rows: Tuple[int, int]  # [start, stop) in the q buffer
    kv_rows: Tuple[int, int]  # [start, stop) in the kv buffer
    attended_keys: Tuple[int, int]  # [lo, hi) key positions some query attends


@dataclass(frozen=True)
class Run:
    """Consecutive rows with the same fate and reason: ``[start, stop)``."""

    start: int
    stop: int
    zeroed: bool
    code: str
    sequence: Optional[int]
    reason: str


@dataclass
class Plan:
    inputs: PlanInput
    mask_understood: bool
    span: Dict[str, Any]
    sequences: List[SequencePlan]
    rows_q: int
    rows_kv: int
    kv_codes: List[Tuple[str, Optional[int]]] = field(default_factory=list)
    q_codes: List[Tuple[str, Optional[int]]] = field(default_factory=list)
    kv_zeroed: List[bool] = field(default_factory=list)
    q_zeroed: List[bool] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return all(code != INCONSISTENT for code, _ in self.kv_codes + self.q_codes)

    def runs(self, side: str) -> List[Run]:
        codes = self.kv_codes if side == "kv" else self.q_codes
        zeroed = self.kv_zeroed if side == "kv" else self.q_zeroed
        out: List[Run] = []
        for row, ((code, seq), z) in enumerate(zip(codes, zeroed)):
            if out and out[-1].code == code and out[-1].sequence == seq and out[-1].zeroed == z:
                last = out[-1]
                out[-1] = Run(last.start, row + 1, z, code, seq, last.reason)
            else:
                out.append(Run(row, row + 1, z, code, seq, self._reason(side, code, seq)))
        return out

    def _reason(self, side: str, code: str, seq: Optional[int]) -> str:
        s = None if seq is None else self.sequences[seq]
        if code == BEFORE_FIRST:
            return "before the first sequence"
        if code == TAIL:
            return "tail: after the last sequence"
        assert s is not None
        if code == PADDING:
            valid = s.lk if side == "kv" else s.lq
            what = "keys" if side == "kv" else "query tokens"
            return f"padding after sequence {s.index} ({valid} valid {what})"
        if code == NO_QUERIES:
            if side == "q":
                return f"sequence {s.index} has no query tokens (padding rows)"
            return f"sequence {s.index} has no query tokens"
        if code == OUTSIDE_WINDOW:
            lo, hi = s.attended_keys
            return (
                f"outside the attended window of sequence {s.index} "
                f"(queries attend keys {_span_text(lo, hi)} of {s.lk})"
            )
        if code == NO_KEYS:
            return f"sequence {s.index} has no keys (dQ is 0)"
        if code == ATTENDED:
            return f"attended by sequence {s.index}"
        if code == VALID_QUERY:
            return f"query tokens of sequence {s.index}"
        return (
            f"INCONSISTENT in sequence {s.index}: the post-pass and the mask reasoning "
            "disagree (please report this batch)"
        )

    def to_dict(self) -> Dict[str, Any]:
        def side(name: str, rows: int, zeroed: List[bool]) -> Dict[str, Any]:
            codes = self.kv_codes if name == "kv" else self.q_codes
            return {
                "rows": rows,
                "zeroed_rows": [i for i, z in enumerate(zeroed) if z],
                "zeroed": sum(zeroed),
                "kept": rows - sum(zeroed),
                "row_codes": [c for c, _ in codes],
                "runs": [asdict(r) for r in self.runs(name)],
            }

        return {
            "inputs": asdict(self.inputs),
            "mask_understood": self.mask_understood,
            "span": self.span,
            "sequences": [asdict(s) for s in self.sequences],
            "dkv": side("kv", self.rows_kv, self.kv_zeroed),
            "dq": side("q", self.rows_q, self.q_zeroed),
            "consistent": self.consistent,
        }


def _span_text(lo: int, hi: int) -> str:
    if hi <= lo:
        return "none"
    return f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


def _lengths(cu: Sequence[int]) -> List[int]:
    return [b - a for a, b in zip(cu, cu[1:])]


def _t(values: Optional[Sequence[int]]) -> Optional[torch.Tensor]:
    return None if values is None else torch.tensor(list(values), dtype=torch.int32)


def _classify(
    row: int, offsets: Sequence[int], nseq: int
) -> Tuple[Optional[int], Optional[str], int]:
    """Sequence of a buffer row (the post-pass's rule: the last b with offsets[b] <= row),
    or the code of a row outside every sequence; plus the position in the sequence."""
    if row >= offsets[nseq]:
        return None, TAIL, 0
    if row < offsets[0]:
        return None, BEFORE_FIRST, 0
    b = bisect.bisect_right(offsets, row) - 1
    return b, None, row - offsets[b]


def _span_dict(span: KeySpan) -> Dict[str, Any]:
    return {
        "exact": span.exact,
        "causal": span.causal,
        "window_left": span.window_left,
        "window_right": span.window_right,
        "top_left": span.top_left,
        "bottom_right": span.bottom_right,
    }


def build_plan(inp: PlanInput) -> Plan:
    """Work out the plan; raises ValueError naming the field on input that cannot be right."""
    check_input(inp)
    cu_q, cu_kv = list(inp.cu_seqlens_q), list(inp.cu_seqlens_kv)
    pad_q = list(inp.cu_seqlens_q_padded) if inp.cu_seqlens_q_padded is not None else cu_q
    pad_kv = list(inp.cu_seqlens_kv_padded) if inp.cu_seqlens_kv_padded is not None else cu_kv
    if len(cu_q) < 1:
        raise ValueError("cu_seqlens_q: expected at least one offset (batch_size + 1)")
    for name, values in (
        ("cu_seqlens_kv", cu_kv),
        ("cu_seqlens_q_padded", pad_q),
        ("cu_seqlens_kv_padded", pad_kv),
    ):
        if len(values) != len(cu_q):
            raise ValueError(
                f"{name}: expected {len(cu_q)} offsets (as cu_seqlens_q), got {len(values)}"
            )
    rows_q = inp.rows_q if inp.rows_q is not None else pad_q[-1]
    rows_kv = inp.rows_kv if inp.rows_kv is not None else pad_kv[-1]
    for name, rows in (("rows_q", rows_q), ("rows_kv", rows_kv)):
        if rows < 0:  # only reachable from a negative last offset
            raise ValueError(f"{name}: expected a number of rows >= 0, got {rows}")
    t_cu_q, t_cu_kv = _t(cu_q), _t(cu_kv)
    t_pad_q, t_pad_kv = _t(inp.cu_seqlens_q_padded), _t(inp.cu_seqlens_kv_padded)
    assert t_cu_q is not None and t_cu_kv is not None
    check_values(rows_q, rows_kv, t_cu_q, t_cu_kv, t_pad_q, t_pad_kv)

    # None is TE's "no window"; check_input has vetted the rest.
    window = (-1, -1) if inp.window_size is None else tuple(inp.window_size)
    span = key_span(inp.attn_mask_type, window, inp.bottom_right_diagonal)
    # The rows: exactly what the post-pass computes.
    dead = dead_row_masks(
        t_cu_q,
        t_cu_kv,
        t_pad_q,
        t_pad_kv,
        rows_q=rows_q,
        rows_kv=rows_kv,
        attn_mask_type=inp.attn_mask_type,
        window_size=window,
        bottom_right_diagonal=inp.bottom_right_diagonal,
    )
    assert dead.q is not None
    kv_zeroed = [bool(x) for x in dead.kv.tolist()]
    q_zeroed = [bool(x) for x in dead.q.tolist()]

    lq, lk = _lengths(cu_q), _lengths(cu_kv)
    nseq = len(lq)
    sequences = [
        SequencePlan(
            index=b,
            lq=lq[b],
            lk=lk[b],
            q_rows=(pad_q[b], pad_q[b + 1]),
            kv_rows=(pad_kv[b], pad_kv[b + 1]),
            attended_keys=key_interval(lq[b], lk[b], span),
        )
        for b in range(nseq)
    ]

    def kv_code(row: int) -> Tuple[str, Optional[int]]:
        b, outside, j = _classify(row, pad_kv, nseq)
        if b is None:
            assert outside is not None
            return outside, None
        s = sequences[b]
        if j >= s.lk:
            return PADDING, b
        if s.lq == 0:
            return NO_QUERIES, b
        lo, hi = s.attended_keys
        return (ATTENDED if lo <= j < hi else OUTSIDE_WINDOW), b

    def q_code(row: int) -> Tuple[str, Optional[int]]:
        b, outside, i = _classify(row, pad_q, nseq)
        if b is None:
            assert outside is not None
            return outside, None
        s = sequences[b]
        if s.lq == 0:
            return NO_QUERIES, b
        if i >= s.lq:
            return PADDING, b
        if s.lk == 0:
            return NO_KEYS, b
        return VALID_QUERY, b

    def checked(code: Tuple[str, Optional[int]], zeroed: bool) -> Tuple[str, Optional[int]]:
        if (code[0] in KEPT_CODES) == zeroed:
            return INCONSISTENT, code[1]
        return code

    kv_codes = [checked(kv_code(r), kv_zeroed[r]) for r in range(rows_kv)]
    q_codes = [checked(q_code(r), q_zeroed[r]) for r in range(rows_q)]
    return Plan(
        inputs=PlanInput(
            cu_seqlens_q=tuple(cu_q),
            cu_seqlens_kv=tuple(cu_kv),
            cu_seqlens_q_padded=None if inp.cu_seqlens_q_padded is None else tuple(pad_q),
            cu_seqlens_kv_padded=None if inp.cu_seqlens_kv_padded is None else tuple(pad_kv),
            attn_mask_type=inp.attn_mask_type,
            window_size=(int(window[0]), int(window[1])),
            bottom_right_diagonal=inp.bottom_right_diagonal,
            rows_q=rows_q,
            rows_kv=rows_kv,
        ),
        mask_understood=span.exact,
        span=_span_dict(span),
        sequences=sequences,
        rows_q=rows_q,
        rows_kv=rows_kv,
        kv_codes=kv_codes,
        q_codes=q_codes,
        kv_zeroed=kv_zeroed,
        q_zeroed=q_zeroed,
    )


def _rows_text(start: int, stop: int) -> str:
    return f"row  {start}" if stop - start == 1 else f"rows {start}-{stop - 1}"


def _alignment(plan: Plan) -> str:
    s = plan.span
    if not s["exact"]:
        return "mask not modelled: every valid key of a sequence with queries is kept"
    how = []
    if s["top_left"]:
        how.append("top-left")
    if s["bottom_right"]:
        how.append("bottom-right")
    given = plan.inputs.bottom_right_diagonal
    source = "by mask name" if given is None else f"bottom_right_diagonal={given}"
    window = f"window ({s['window_left']}, {s['window_right']})"
    return f"{' + '.join(how)} diagonal ({source}), effective {window}"


def format_plan(plan: Plan) -> str:
    """Human-readable report: sequences, then runs of dK/dV and dQ rows with reasons."""
    inp = plan.inputs
    lines = [
        f"te-gqa-fix plan: {len(plan.sequences)} sequence(s), mask {inp.attn_mask_type}, "
        f"window {tuple(inp.window_size)}",
        f"  {_alignment(plan)}",
        "",
        f"{'seq':>4}  {'q tokens':>8}  {'q rows':>9}  {'keys':>5}  {'kv rows':>9}  attended keys",
    ]
    for s in plan.sequences:
        lo, hi = s.attended_keys
        att = _span_text(lo, hi)
        if hi > lo:
            att += f" (kv rows {_span_text(s.kv_rows[0] + lo, s.kv_rows[0] + hi)})"
        lines.append(
            f"{s.index:>4}  {s.lq:>8}  {_span_text(*s.q_rows):>9}  {s.lk:>5}  "
            f"{_span_text(*s.kv_rows):>9}  {att}"
        )
    for side, title, rows, zeroed in (
        ("kv", "dK/dV", plan.rows_kv, plan.kv_zeroed),
        ("q", "dQ", plan.rows_q, plan.q_zeroed),
    ):
        n = sum(zeroed)
        lines += ["", f"{title} rows ({rows}): {n} zeroed, {rows - n} kept"]
        for run in plan.runs(side):
            fate = "ZEROED" if run.zeroed else "kept  "
            lines.append(f"  {_rows_text(run.start, run.stop):<14} {fate}  {run.reason}")
    if not plan.consistent:
        lines += ["", "ERROR: some rows are INCONSISTENT (see above): please report this batch."]
    return "\n".join(lines)


def _int_list(value: Any, name: str) -> Tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise ValueError(f"{name}: expected a list of integers, got {value!r}")
    return tuple(value)


def _int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    return value


def check_input(inp: PlanInput) -> None:
    """Raise ``ValueError`` naming the field when a :class:`PlanInput` is malformed.

    The same rules as the public post-pass: a value of the wrong type is never coerced
    (``bool("false")`` is True), an unknown mask is an error, not the conservative set.
    """
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        _int_list(getattr(inp, name), name)
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if getattr(inp, name) is not None:
            _int_list(getattr(inp, name), name)
    check_mask_arguments(inp.attn_mask_type, inp.window_size, inp.bottom_right_diagonal)
    for name in ("rows_q", "rows_kv"):
        value = getattr(inp, name)
        if value is not None and _int(value, name) < 0:
            raise ValueError(f"{name}: expected a number of rows >= 0, got {value}")


def plan_from_json(text: str) -> PlanInput:
    """A :class:`PlanInput` from JSON with TE's names (``cu_seqlens_q``, ``cu_seqlens_kv``,
    optional ``cu_seqlens_q_padded``, ``cu_seqlens_kv_padded``, ``attn_mask_type``,
    ``window_size``, ``bottom_right_diagonal``, ``rows_q``, ``rows_kv``).

    Types are JSON's own: ``bottom_right_diagonal`` is ``true``/``false``/``null`` (the
    string ``"false"`` is an error, not True), ``attn_mask_type`` a string. Every error
    names the field.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--file: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--file: expected a JSON object, got {type(data).__name__}")
    known = {f for f in PlanInput.__dataclass_fields__}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key; expected some of {sorted(known)}")
    for req in ("cu_seqlens_q", "cu_seqlens_kv"):
        if data.get(req) is None:
            raise ValueError(f"{req}: required (a list of integers)")
    kw: Dict[str, Any] = {}
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if data.get(name) is not None:
            kw[name] = _int_list(data[name], name)
    if "attn_mask_type" in data:
        if not isinstance(data["attn_mask_type"], str):
            raise ValueError(
                f'attn_mask_type: expected a string such as "padding_causal", got '
                f"{json.dumps(data['attn_mask_type'])}"
            )
        kw["attn_mask_type"] = data["attn_mask_type"]
    if "window_size" in data:
        w = _int_list(data["window_size"], "window_size")
        if len(w) != 2:
            raise ValueError(f"window_size: expected [left, right], got {list(w)}")
        kw["window_size"] = w
    brd = data.get("bottom_right_diagonal")
    if brd is not None and not isinstance(brd, bool):
        raise ValueError(
            f"bottom_right_diagonal: expected true, false or null, got {json.dumps(brd)}"
        )
    if brd is not None:
        kw["bottom_right_diagonal"] = brd
    for name in ("rows_q", "rows_kv"):
        if data.get(name) is not None:
            kw[name] = _int(data[name], name)
    inp = PlanInput(**kw)
    check_input(inp)
    return inp
