"""``te-gqa-fix plan``: which gradient rows the post-pass zeroes for a batch, and why.

The rows come from :func:`te_gqa_fix.postpass.dead_row_masks`, each row's reason from the
mask's key interval and the offsets; a row where the two disagree is ``inconsistent``.
Runs on CPU; Transformer Engine is not needed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import checks
from .._te import OFFSET_NAMES
from ..masks import key_bounds, key_span
from ..postpass import dead_row_masks

#: An integer as plan and doctor accept it: ASCII digits, an optional leading "-" (no "_",
#: no "+", no other scripts' digits, which ``int()`` would take).
INTEGER = re.compile(r"-?[0-9]+")

#: plan's options, by TE's argument names; all are read as text and parsed by plan itself.
OPTIONS = {
    "--cu-seqlens-q": ("cu_seqlens_q", "0,0,3", "cumulative valid query lengths"),
    "--cu-seqlens-kv": ("cu_seqlens_kv", "0,3,9", "cumulative valid key lengths"),
    "--padded-q": ("cu_seqlens_q_padded", "0,4,12", "buffer offsets (default: the valid ones)"),
    "--padded-kv": ("cu_seqlens_kv_padded", "0,4,12", "buffer offsets (default: the valid ones)"),
    "--mask": ("attn_mask_type", "TYPE", "attn_mask_type (default padding_causal)"),
    "--window": ("window_size", "L,R", "window_size (default -1,-1)"),
    "--bottom-right-diagonal": ("bottom_right_diagonal", "true|false", "default: by mask name"),
    "--rows-q": ("rows_q", "N", "rows of the dQ buffer (default: the last offset)"),
    "--rows-kv": ("rows_kv", "N", "rows of the dK/dV buffers (default: the last offset)"),
}

__all__ = [
    "Plan",
    "PlanInput",
    "add_parser",
    "build_plan",
    "format_plan",
    "plan_from_json",
    "plan_input",
    "run",
]

#: plan lists every row; 2**22 rows per buffer already make about 100 MB of JSON.
MAX_ROWS = 1 << 22

#: Each row's code (stable: the JSON output and tests use it) -> the reason it is given.
_REASONS = {
    "before_first": "before the first sequence",
    "tail": "tail: after the last sequence",
    "padding": "padding after sequence {b} ({valid} valid {what})",
    "no_queries": "sequence {b} has no query tokens{rows}",
    "outside_window": "outside the attended window of sequence {b} (queries attend keys {keys})",
    "no_keys": "sequence {b} has no keys (dQ is 0)",
    "attended": "attended by sequence {b}",  # kept
    "valid_query": "query tokens of sequence {b}",  # kept
    "inconsistent": "INCONSISTENT in sequence {b}: the post-pass and the mask reasoning "
    "disagree (please report this batch)",  # must never happen
}
KEPT_CODES = ("attended", "valid_query")
Codes = List[Tuple[str, Optional[int]]]


@dataclass(frozen=True)
class PlanInput:
    """The batch description, with TE's argument names."""

    cu_seqlens_q: Tuple[int, ...]
    cu_seqlens_kv: Tuple[int, ...]
    cu_seqlens_q_padded: Optional[Tuple[int, ...]] = None
    cu_seqlens_kv_padded: Optional[Tuple[int, ...]] = None
    attn_mask_type: str = "padding_causal"
    window_size: Optional[Tuple[int, int]] = (-1, -1)
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


_NO_SEQUENCE = SequencePlan(0, 0, 0, (0, 0), (0, 0), (0, 0))  # rows outside every sequence


@dataclass
class Plan:
    """Each row's code (with its sequence) and fate, per side (``kv``: dK/dV, ``q``: dQ)."""

    inputs: PlanInput  # as checked: offsets as tuples, rows and window filled in
    span: Dict[str, Any]
    sequences: List[SequencePlan]
    kv_codes: Codes
    q_codes: Codes
    kv_zeroed: List[bool]
    q_zeroed: List[bool]

    @property
    def consistent(self) -> bool:
        return all(code != "inconsistent" for code, _ in self.kv_codes + self.q_codes)

    def runs(self, side: str) -> List[Run]:
        """Consecutive rows of ``side`` (``kv`` or ``q``) with one code, sequence and fate."""
        codes, zeroed = getattr(self, f"{side}_codes"), getattr(self, f"{side}_zeroed")
        out, start = [], 0
        for (code, b, z), group in itertools.groupby(zip(codes, zeroed), lambda t: (*t[0], t[1])):
            stop = start + sum(1 for _ in group)
            s = self.sequences[b] if b is not None else _NO_SEQUENCE
            reason = _REASONS[code].format(
                b=b,
                valid=s.lk if side == "kv" else s.lq,
                what="keys" if side == "kv" else "query tokens",
                rows=" (padding rows)" if side == "q" else "",
                keys=f"{_span_text(*s.attended_keys)} of {s.lk}",
            )
            out.append(Run(start, stop, z, code, b, reason))
            start = stop
        return out

    def to_dict(self) -> Dict[str, Any]:
        """The plan as JSON-ready values (``row_codes`` and ``zeroed_rows`` row by row)."""
        out = {
            "inputs": asdict(self.inputs),
            "span": self.span,
            "sequences": [asdict(s) for s in self.sequences],
        }
        for key, side in (("dkv", "kv"), ("dq", "q")):
            zeroed, rows = getattr(self, f"{side}_zeroed"), getattr(self.inputs, f"rows_{side}")
            out[key] = {
                "rows": rows,
                "zeroed_rows": [i for i, z in enumerate(zeroed) if z],
                "zeroed": sum(zeroed),
                "kept": rows - sum(zeroed),
                "row_codes": [c for c, _ in getattr(self, f"{side}_codes")],
                "runs": [asdict(r) for r in self.runs(side)],
            }
        return {**out, "consistent": self.consistent, "fallback": list(_coverage())}


def _span_text(lo: int, hi: int) -> str:
    return "none" if hi <= lo else f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


def _all_ints(values: Any) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in values)


def _ints(value: Any, name: str) -> Tuple[int, ...]:
    """Offsets as plan holds them: integers (never bools) that fit TE's int32."""
    if not isinstance(value, (list, tuple)) or not _all_ints(value):
        raise ValueError(f"{name}: expected a list of integers, got {value!r}")
    bad = [x for x in value if not -(2**31) <= x < 2**31]
    if bad:
        raise ValueError(f"{name}: offset {bad[0]} does not fit in int32 (TE's offsets are int32)")
    return tuple(value)


def _rows(value: Any, name: str) -> int:
    """A row count plan can list: an integer in ``[0, MAX_ROWS]``."""
    if not _all_ints([value]):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected a number of rows >= 0, got {value}")
    if value > MAX_ROWS:
        raise ValueError(f"{name}: expected at most {MAX_ROWS} rows (plan lists each), got {value}")
    return value


def _integer(text: str) -> int:
    """An ASCII decimal integer (optional leading "-", spaces around): ``int()`` alone
    would also take ``1_0``, ``+3`` and other scripts' digits."""
    if not INTEGER.fullmatch(text.strip(" \t")):
        raise ValueError(text)
    return int(text)


def _parse_text(name: str, text: str) -> Any:
    """One command-line value, parsed for field ``name``; errors name the field."""
    try:
        if name in OFFSET_NAMES or name == "window_size":
            return tuple(_integer(x) for x in text.strip().strip("[]").split(","))
        if name in ("rows_q", "rows_kv"):
            return _integer(text)
        if name == "bottom_right_diagonal":
            return {"true": True, "false": False}[text.strip().lower()]
    except (KeyError, ValueError):
        what = "an integer" if name.startswith("rows") else "comma-separated integers (0,0,3)"
        what = "true or false" if name == "bottom_right_diagonal" else what
        raise ValueError(f"{name}: expected {what}, got {text!r}") from None
    return text


def plan_input(flags: Dict[str, Optional[str]], base: Optional[PlanInput] = None) -> PlanInput:
    """A :class:`PlanInput` from plan's command-line text.

    Args:
        flags: TE's argument names -> the option's text (None: not given).
        base: what the options override (from ``--file``).

    Returns:
        The input; raises ``ValueError`` naming the field for text that does not parse.
    """
    data = asdict(base) if base is not None else {}
    data.update({k: _parse_text(k, v) for k, v in flags.items() if v is not None})
    return PlanInput(**data)


def plan_from_json(text: str) -> PlanInput:
    """A :class:`PlanInput` from a JSON object with TE's names.

    Args:
        text: the JSON; types are JSON's own (``bottom_right_diagonal`` is true/false/null).

    Returns:
        The input; every error is a ``ValueError`` that names the field.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--file: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError("--file: JSON nested too deeply (plan takes flat lists)") from None
    if not isinstance(data, dict):
        raise ValueError(f"--file: expected a JSON object, got {type(data).__name__}")
    known = sorted(PlanInput.__dataclass_fields__)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key; expected some of {known}")
    for name in OFFSET_NAMES[:2]:
        data.setdefault(name, None)  # required: build_plan names it
    if "attn_mask_type" in data and not isinstance(data["attn_mask_type"], str):
        got = json.dumps(data["attn_mask_type"])
        raise ValueError(f'attn_mask_type: expected a string such as "padding_causal", got {got}')
    brd = data.get("bottom_right_diagonal")
    if brd is not None and not isinstance(brd, bool):
        got = json.dumps(brd)
        raise ValueError(f"bottom_right_diagonal: expected true, false or null, got {got}")
    return PlanInput(**data)  # offsets, rows and window: build_plan checks them, as for any input


def build_plan(inp: PlanInput) -> Plan:
    """Work out the plan.

    Args:
        inp: the batch; checked against plan's limits (int32 offsets, at most
            :data:`MAX_ROWS` rows), then the post-pass's gate, before any row-sized allocation.

    Returns:
        The plan; raises ``ValueError`` naming the field on input that cannot be right.
    """
    offsets = [
        None if getattr(inp, n) is None and i > 1 else _ints(getattr(inp, n), n)
        for i, n in enumerate(OFFSET_NAMES)
    ]
    checks.mask_arguments(inp.attn_mask_type, inp.window_size, inp.bottom_right_diagonal)
    rows = []
    for side, name in enumerate(("rows_q", "rows_kv")):
        given = getattr(inp, name)
        if given is None:  # the buffer ends at the last offset (buffer offsets, else valid)
            j = side + 2 if offsets[side + 2] is not None else side
            name, given = OFFSET_NAMES[j], max((offsets[j] or (0,))[-1], 0)
        rows.append(_rows(given, name))
    tensors = [None if o is None else torch.tensor(o, dtype=torch.int32) for o in offsets]
    sizes = dict(rows_q=rows[0], rows_kv=rows[1])
    checks.offsets(*tensors, **sizes)
    checks.offset_values(*rows, *tensors)
    window = (-1, -1) if inp.window_size is None else tuple(map(int, inp.window_size))
    mask = dict(attn_mask_type=inp.attn_mask_type, bottom_right_diagonal=inp.bottom_right_diagonal)
    span = key_span(window_size=window, **mask)
    dead = dead_row_masks(*tensors, **sizes, window_size=window, **mask)
    assert dead.q is not None
    inputs = replace(inp, **dict(zip(OFFSET_NAMES, offsets)), window_size=window, **sizes)
    cu_q, cu_kv = offsets[0], offsets[1]
    pad_q, pad_kv = offsets[2] or cu_q, offsets[3] or cu_kv
    kv: Codes = [("before_first", None)] * pad_kv[0]
    q: Codes = [("before_first", None)] * pad_q[0]
    sequences = []
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        lo, hi = _key_interval(lq, lk, span)
        s = SequencePlan(b, lq, lk, (pad_q[b], pad_q[b + 1]), (pad_kv[b], pad_kv[b + 1]), (lo, hi))
        sequences.append(s)
        room_q = pad_q[b + 1] - pad_q[b]
        if lq == 0:
            kv += [("no_queries", b)] * lk
            q += [("no_queries", b)] * room_q
        else:
            kv += [("outside_window", b)] * lo + [("attended", b)] * (hi - lo)
            kv += [("outside_window", b)] * (lk - hi)
            q += [("no_keys" if lk == 0 else "valid_query", b)] * lq
            q += [("padding", b)] * (room_q - lq)
        kv += [("padding", b)] * (pad_kv[b + 1] - pad_kv[b] - lk)
    kv += [("tail", None)] * (rows[1] - pad_kv[-1])
    q += [("tail", None)] * (rows[0] - pad_q[-1])
    kv_zeroed, q_zeroed = dead.kv.tolist(), dead.q.tolist()
    kv, q = _checked(kv, kv_zeroed), _checked(q, q_zeroed)
    return Plan(inputs, asdict(span), sequences, kv, q, kv_zeroed, q_zeroed)


def _checked(codes: Codes, zeroed: List[bool]) -> Codes:
    """``codes``, with ``inconsistent`` where the post-pass disagrees with a row's code."""
    return [
        ("inconsistent", b) if (code in KEPT_CODES) == z else (code, b)
        for (code, b), z in zip(codes, zeroed)
    ]


def _alignment(plan: Plan) -> str:
    s = plan.span
    if not s["exact"]:
        return "mask not modelled: every valid key of a sequence with queries is kept"
    how = " + ".join(k.replace("_", "-") for k in ("top_left", "bottom_right") if s[k])
    given = plan.inputs.bottom_right_diagonal
    source = "by mask name" if given is None else f"bottom_right_diagonal={given}"
    return f"{how} diagonal ({source}), effective window ({s['window_left']}, {s['window_right']})"


def format_plan(plan: Plan) -> str:
    """Human-readable report: sequences, then runs of dK/dV and dQ rows with reasons."""
    inp = plan.inputs
    lines = [
        f"te-gqa-fix plan: {len(plan.sequences)} sequence(s), mask {inp.attn_mask_type}, "
        f"window {inp.window_size}",
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
    for side, title in (("kv", "dK/dV"), ("q", "dQ")):
        rows, n = getattr(inp, f"rows_{side}"), sum(getattr(plan, f"{side}_zeroed"))
        lines += ["", f"{title} rows ({rows}): {n} zeroed, {rows - n} kept"]
        for run in plan.runs(side):
            span = _span_text(run.start, run.stop)
            where = f"row  {span}" if run.stop - run.start == 1 else f"rows {span}"
            lines.append(f"  {where:<14} {'ZEROED' if run.zeroed else 'kept  '}  {run.reason}")
    if not plan.consistent:
        lines += ["", "ERROR: some rows are INCONSISTENT (see above): please report this batch."]
    coverage = _coverage()
    if coverage:
        lines += ["", "exact fallback (TE_GQA_FIX_GUARD=fallback):", *(f"  {c}" for c in coverage)]
    return "\n".join(lines)


def _coverage() -> Sequence[str]:
    from ..fallback import coverage

    return coverage()


def _key_interval(lq: int, lk: int, span: Any) -> Tuple[int, int]:
    """:func:`te_gqa_fix.masks.key_bounds` for one sequence of ``lq`` queries and ``lk``
    keys, as ints; ``(0, 0)`` where no key is attended."""
    lo, hi = (int(x) for x in key_bounds(torch.tensor([lq]), torch.tensor([lk]), span))
    return (lo, hi) if hi > lo else (0, 0)


def add_parser(sub: Any) -> None:
    """``plan``'s subcommand and options on ``sub`` (argparse's subparsers)."""
    plan = sub.add_parser(
        "plan",
        help="show which dK/dV/dQ rows the post-pass zeroes for a batch, and why",
        description="Which gradient rows te-gqa-fix's post-pass zeroes for a THD batch, with "
        "the reason for each run of rows. Runs on CPU; Transformer Engine is not needed.",
        epilog="exit codes:\n  0  done\n  1  internal inconsistency (please report)\n"
        "  2  bad input\n\nJSON input (--file): an object with TE's names: "
        + ", ".join(dest for dest, _, _ in OPTIONS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, (dest, metavar, text) in OPTIONS.items():
        plan.add_argument(flag, dest=dest, metavar=metavar, help=text)
    plan.add_argument("--file", help="read the batch from a JSON file ('-' for stdin)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")


def join_negative_values(argv: Sequence[str]) -> List[str]:
    """``argv`` with a value that starts with "-" joined to its option (``--window -1,-1``
    would read as an option otherwise)."""
    joined: List[str] = []
    for arg in argv:
        if joined and joined[-1] in OPTIONS and arg.startswith("-"):
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    return joined


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``plan`` command: print the plan (text or JSON); return the exit code."""
    flags = {dest: getattr(args, dest) for dest, _, _ in OPTIONS.values()}
    if args.file == "":
        parser.error("plan: --file: expected a path, or '-' for stdin; got an empty string")
    if args.file is None and (args.cu_seqlens_q is None or args.cu_seqlens_kv is None):
        parser.error("plan: give --cu-seqlens-q and --cu-seqlens-kv, or --file")
    try:
        base = None
        if args.file is not None:
            text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
            base = plan_from_json(text)
        plan = build_plan(plan_input(flags, base))
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"te-gqa-fix plan: error: {exc}\n")
        return 2
    out = json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan)
    sys.stdout.write(out + "\n")
    return 0 if plan.consistent else 1
