"""The ``te-gqa-fix`` command (also ``python -m te_gqa_fix``): ``doctor`` and ``plan``."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from .. import __version__

__all__ = ["build_parser", "fallback_coverage", "main"]

#: plan's options, by TE's argument names; all are read as text and parsed by plan itself.
_PLAN_OPTIONS = {
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


#: The head dims TE's fused attention takes on the cuDNN backend (the one this fix is
#: about): 1..256; TE runs larger head dims on other backends, which the bug does not touch.
HEAD_DIMS = range(1, 257)
#: An integer as plan and doctor accept it: ASCII digits, an optional leading "-" (no "_",
#: no "+", no other scripts' digits, which ``int()`` would take).
INTEGER = re.compile(r"-?[0-9]+")


def head_dim(text: str) -> int:
    """``--head-dim``'s value: an integer in :data:`HEAD_DIMS`; argparse names the option."""
    if not INTEGER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected an integer head dim, got {text!r}")
    value = int(text)
    if value not in HEAD_DIMS:
        raise argparse.ArgumentTypeError(
            f"expected a head dim in {HEAD_DIMS.start}..{HEAD_DIMS.stop - 1} (what TE's fused "
            f"attention takes on cuDNN), got {value}"
        )
    return value


def fallback_coverage() -> List[str]:
    """What the exact fallback covers, in a few lines; none where torch cannot be imported."""
    try:
        from ..fallback import coverage
    except ImportError:
        return []
    return list(coverage())


def build_parser() -> argparse.ArgumentParser:
    """The ``te-gqa-fix`` argument parser (``doctor`` and ``plan``)."""
    from .doctor import EXIT_CODES

    parser = argparse.ArgumentParser(
        prog="te-gqa-fix",
        description="Diagnose and plan te-gqa-fix's repair of Transformer Engine's fused "
        "attention backward (THD + GQA on Hopper with cuDNN < 9.18).",
    )
    parser.add_argument("--version", action="version", version=f"te-gqa-fix {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,plan}")
    raw = argparse.RawDescriptionHelpFormatter
    doctor = sub.add_parser(
        "doctor",
        help="check whether this stack is affected and whether the fix is active",
        description="Versions, GPU, the cuDNN TE really runs (and the files mapped) next to "
        "torch's, every TE_GQA_FIX_* setting, whether te-gqa-fix is active, a verdict and, "
        "with a GPU and TE, a live run of the seed case without and with the fix.",
        epilog="exit codes:\n" + "\n".join(f"  {k}  {v}" for k, v in EXIT_CODES.items()),
        formatter_class=raw,
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument("--no-live", action="store_true", help="skip the live GPU check")
    doctor.add_argument(
        "--head-dim", type=head_dim, metavar="D", help="your model's head dim (1..256)"
    )
    plan = sub.add_parser(
        "plan",
        help="show which dK/dV/dQ rows the post-pass zeroes for a batch, and why",
        description="Which gradient rows te-gqa-fix's post-pass zeroes for a THD batch, with "
        "the reason for each run of rows. Runs on CPU; Transformer Engine is not needed.",
        epilog="exit codes:\n  0  done\n  1  internal inconsistency (please report)\n"
        "  2  bad input\n\nJSON input (--file): an object with TE's names: "
        + ", ".join(dest for dest, _, _ in _PLAN_OPTIONS.values()),
        formatter_class=raw,
    )
    for flag, (dest, metavar, text) in _PLAN_OPTIONS.items():
        plan.add_argument(flag, dest=dest, metavar=metavar, help=text)
    plan.add_argument("--file", help="read the batch from a JSON file ('-' for stdin)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``te-gqa-fix`` console script.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code.
    """
    parser = build_parser()
    # A value that starts with "-" (``--window -1,-1``) would read as an option: join it.
    joined: List[str] = []
    for arg in sys.argv[1:] if argv is None else argv:
        if joined and joined[-1] in _PLAN_OPTIONS and arg.startswith("-"):
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    args = parser.parse_args(joined)
    if args.command == "doctor":
        from .doctor import run

        return run(as_json=args.json, live=not args.no_live, head_dim=args.head_dim)
    if args.command != "plan":
        parser.print_help()
        return 2
    from .plan import build_plan, format_plan, plan_from_json, plan_input

    flags = {dest: getattr(args, dest) for dest, _, _ in _PLAN_OPTIONS.values()}
    if not args.file and (args.cu_seqlens_q is None or args.cu_seqlens_kv is None):
        parser.error("plan: give --cu-seqlens-q and --cu-seqlens-kv, or --file")
    try:
        base = None
        if args.file:
            text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
            base = plan_from_json(text)
        plan = build_plan(plan_input(flags, base))
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"te-gqa-fix plan: error: {exc}\n")
        return 2
    out = json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan)
    sys.stdout.write(out + "\n")
    return 0 if plan.consistent else 1
