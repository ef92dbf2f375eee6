"""Command line: ``te-gqa-fix doctor`` and ``te-gqa-fix plan`` (also ``python -m te_gqa_fix``).

* ``doctor``: is this stack affected (GPU, the cuDNN TE really runs, the files mapped),
  is the fix active, and, with a GPU and TE, a live run of the seed case with and without
  the fix. Exit codes: 0 healthy, 1 affected and the fix not active, 2 usage error,
  3 cannot check, 4 broken beyond repair.
* ``plan``: for a batch layout (cu_seqlens, padded offsets, mask, window), which dK/dV and
  dQ rows the post-pass zeroes and why. CPU only, TE not needed. Exit codes: 0 done,
  1 internal inconsistency (a bug to report), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from . import __version__

# Options whose value may start with "-" (``--window -1,-1``, ``--cu-seqlens-q -1,0,3``):
# argparse would read such a value as an option, so it is rewritten to ``--window=-1,-1``.
# Offsets are included so a negative one reaches the check that names it (exit 2).
_SIGNED_LIST_OPTIONS = (
    "--window",
    "--cu-seqlens-q",
    "--cu-seqlens-kv",
    "--padded-q",
    "--padded-kv",
    "--rows-q",
    "--rows-kv",
)


def _join_signed_values(argv: Sequence[str]) -> List[str]:
    out: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _SIGNED_LIST_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def _int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.replace(" ", "").strip("[]").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers (e.g. 0,0,3), got {text!r}"
        ) from None


def _window(text: str) -> List[int]:
    values = _int_list(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (e.g. -1,-1), got {text!r}")
    return values


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    from .doctor import EXIT_CODES

    parser = argparse.ArgumentParser(
        prog="te-gqa-fix",
        description="Diagnose and plan the te-gqa-fix post-pass for Transformer Engine's "
        "fused attention backward (THD + GQA on Hopper with cuDNN < 9.18).",
    )
    parser.add_argument("--version", action="version", version=f"te-gqa-fix {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,plan}")

    codes = "\n".join(f"  {k}  {v}" for k, v in EXIT_CODES.items())
    doctor = sub.add_parser(
        "doctor",
        help="check whether this stack is affected and whether the fix is active",
        description="Versions, GPU, the cuDNN Transformer Engine really runs (and the cuDNN "
        "files mapped into the process) next to torch's, whether te-gqa-fix is active, a "
        "verdict from the known facts and, with a GPU and TE, a live run of the seed case "
        "without and with the fix.",
        epilog="exit codes:\n" + codes,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument(
        "--no-live", action="store_true", help="skip the live GPU check (facts only)"
    )
    doctor.add_argument(
        "--head-dim",
        type=int,
        default=None,
        metavar="D",
        help="your model's attention head dim (above 128 an affected cuDNN cannot be repaired)",
    )

    plan = sub.add_parser(
        "plan",
        help="show which dK/dV/dQ rows the post-pass zeroes for a batch, and why",
        description="Which gradient rows te-gqa-fix's post-pass zeroes for a THD batch, with "
        "the reason for each run of rows. Offsets are TE's: cumulative valid lengths "
        "(--cu-seqlens-*) and where each sequence starts in the buffer (--padded-*; default: "
        "the valid offsets). Runs on CPU; Transformer Engine is not needed.",
        epilog="exit codes:\n  0  done\n  1  internal inconsistency (please report)\n"
        "  2  bad input\n\nJSON input (--file): an object with TE's names: cu_seqlens_q, "
        "cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, attn_mask_type, "
        "window_size, bottom_right_diagonal, rows_q, rows_kv.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--cu-seqlens-q", type=_int_list, metavar="0,0,3")
    plan.add_argument("--cu-seqlens-kv", type=_int_list, metavar="0,3,9")
    plan.add_argument("--padded-q", type=_int_list, metavar="0,4,12", help="cu_seqlens_q_padded")
    plan.add_argument("--padded-kv", type=_int_list, metavar="0,4,12", help="cu_seqlens_kv_padded")
    plan.add_argument(
        "--mask",
        default=None,
        metavar="TYPE",
        help="attn_mask_type (default padding_causal): padding, no_mask, padding_causal, "
        "causal, padding_causal_bottom_right, causal_bottom_right, or arbitrary (keep every "
        "valid key of a sequence with queries); anything else is an error",
    )
    plan.add_argument(
        "--window", type=_window, default=None, metavar="L,R", help="window_size (default -1,-1)"
    )
    plan.add_argument(
        "--bottom-right-diagonal",
        type=_bool,
        default=None,
        metavar="true|false",
        help="TE's bottom_right_diagonal (default: by mask name)",
    )
    plan.add_argument("--rows-q", type=int, default=None, help="rows of the dQ buffer")
    plan.add_argument("--rows-kv", type=int, default=None, help="rows of the dK/dV buffers")
    plan.add_argument(
        "--file", metavar="FILE", help="read the batch from a JSON file ('-' for stdin)"
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def _plan_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .plan import PlanInput, build_plan, format_plan, plan_from_json

    try:
        if args.file:
            if args.file == "-":
                text = sys.stdin.read()
            else:
                with open(args.file) as f:
                    text = f.read()
            inp = plan_from_json(text)
            overrides = {
                "cu_seqlens_q": args.cu_seqlens_q,
                "cu_seqlens_kv": args.cu_seqlens_kv,
                "cu_seqlens_q_padded": args.padded_q,
                "cu_seqlens_kv_padded": args.padded_kv,
                "attn_mask_type": args.mask,
                "window_size": args.window,
                "bottom_right_diagonal": args.bottom_right_diagonal,
                "rows_q": args.rows_q,
                "rows_kv": args.rows_kv,
            }
            data = {**inp.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
            inp = PlanInput(**data)
        else:
            if args.cu_seqlens_q is None or args.cu_seqlens_kv is None:
                parser.error("plan: give --cu-seqlens-q and --cu-seqlens-kv, or --file")
            inp = PlanInput(
                cu_seqlens_q=tuple(args.cu_seqlens_q),
                cu_seqlens_kv=tuple(args.cu_seqlens_kv),
                cu_seqlens_q_padded=None if args.padded_q is None else tuple(args.padded_q),
                cu_seqlens_kv_padded=None if args.padded_kv is None else tuple(args.padded_kv),
                attn_mask_type=args.mask or "padding_causal",
                window_size=tuple(args.window or (-1, -1)),  # type: ignore[arg-type]
                bottom_right_diagonal=args.bottom_right_diagonal,
                rows_q=args.rows_q,
                rows_kv=args.rows_kv,
            )
        plan = build_plan(inp)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"te-gqa-fix plan: error: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(plan.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(format_plan(plan) + "\n")
    return 0 if plan.consistent else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``te-gqa-fix`` console script; returns the exit code."""
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_join_signed_values(raw))
    if args.command == "doctor":
        from .doctor import run

        return run(as_json=args.json, live=not args.no_live, head_dim=args.head_dim)
    if args.command == "plan":
        return _plan_command(args, parser)
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
