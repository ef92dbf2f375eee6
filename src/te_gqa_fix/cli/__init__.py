"""The ``te-gqa-fix`` command (also ``python -m te_gqa_fix``): ``doctor`` and ``plan``.

An optional layer: nothing in a training process imports it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .. import __version__
from . import doctor, plan

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``te-gqa-fix`` argument parser (``doctor`` and ``plan``)."""
    parser = argparse.ArgumentParser(
        prog="te-gqa-fix",
        description="Diagnose and plan te-gqa-fix's repair of Transformer Engine's fused "
        "attention backward (THD + GQA on Hopper with cuDNN < 9.18).",
    )
    parser.add_argument("--version", action="version", version=f"te-gqa-fix {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,plan}")
    doctor.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``te-gqa-fix`` console script.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 2 for a usage error (no command included: the usage goes to stderr).
    """
    parser = build_parser()
    args = parser.parse_args(plan.join_negative_values(sys.argv[1:] if argv is None else argv))
    if args.command == "doctor":
        return doctor.run(args)
    if args.command == "plan":
        return plan.run(args, parser)
    parser.print_usage(sys.stderr)
    sys.stderr.write("te-gqa-fix: error: give a command: doctor or plan (--help says more)\n")
    return 2
