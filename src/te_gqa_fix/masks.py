"""Which keys a query can see: TE's mask types and sliding windows, reduced to intervals.

In a sequence of ``lq`` queries and ``lk`` keys, query ``i`` attends key ``j`` in ``[i + s -
left, i + s + right] & [0, lk)`` (``s = lk - lq`` bottom-right, 0 top-left; causal: right 0),
so the attended keys form one interval ``[lo, hi)``: outside it the true dK/dV is exactly 0.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from ._logging import log_once
from ._te import MASKS


@dataclass(frozen=True)
class KeySpan:
    """How to compute the attended key interval of each sequence.

    ``exact`` False means the mask is not understood: keep every valid key of a sequence
    that has at least one query (the conservative set, exact for the bug's rows).
    ``top_left``/``bottom_right`` say which diagonal alignments to keep (both: superset).
    """

    exact: bool
    causal: bool
    window_left: int
    window_right: int
    top_left: bool
    bottom_right: bool


CONSERVATIVE = KeySpan(
    exact=False, causal=False, window_left=-1, window_right=-1, top_left=True, bottom_right=False
)


#: TE mask names whose attended keys te-gqa-fix does not model: the conservative set
#: (every valid key of a sequence with queries) is exact for them.
CONSERVATIVE_MASK_TYPES: Tuple[str, ...] = ("arbitrary",)


#: The widest window side accepted: TE's sequence lengths are int32, so a wider one would
#: mean the same as this one (and could overflow the int64 bounds arithmetic near 2**63).
WINDOW_MAX = 2**31 - 1


def window_pair(window_size: Optional[Sequence[int]]) -> Optional[Tuple[int, int]]:
    """``(left, right)`` for TE's ``window_size`` (None: unbounded), or None when malformed
    (not two ints, or a side outside ``-1 .. WINDOW_MAX``)."""
    if window_size is None:
        return (-1, -1)
    if isinstance(window_size, (str, bytes)):
        return None
    try:
        if len(window_size) != 2:
            return None
        left, right = (operator.index(window_size[0]), operator.index(window_size[1]))
    except (TypeError, ValueError, IndexError):
        return None
    if isinstance(window_size[0], bool) or isinstance(window_size[1], bool):
        return None
    if not (-1 <= left <= WINDOW_MAX and -1 <= right <= WINDOW_MAX):
        return None
    return (left, right)


def key_span(
    attn_mask_type: Optional[str],
    window_size: Optional[Sequence[int]] = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
) -> KeySpan:
    """Reduce TE's mask arguments to a :class:`KeySpan`.

    Args:
        attn_mask_type, window_size, bottom_right_diagonal: TE's mask arguments;
            ``bottom_right_diagonal`` None means "by mask name" (every TE before 2.10).

    Returns:
        The span. Arguments it does not understand give :data:`CONSERVATIVE`, logged once
        at WARNING (the public functions refuse them first: ``checks.mask_arguments``).
    """
    if attn_mask_type in CONSERVATIVE_MASK_TYPES:
        return CONSERVATIVE
    known = MASKS.get(attn_mask_type) if isinstance(attn_mask_type, str) else None
    window = window_pair(window_size)
    brd_ok = bottom_right_diagonal is None or isinstance(bottom_right_diagonal, bool)
    if known is None or window is None or not brd_ok:
        log_once(
            ("mask", repr(attn_mask_type), repr(window_size), repr(bottom_right_diagonal)),
            logging.WARNING,
            "attn_mask_type=%r window_size=%r bottom_right_diagonal=%r not "
            "understood; zeroing only rows outside sequences and rows of sequences without "
            "queries (exact for every mask)",
            attn_mask_type,
            window_size,
            bottom_right_diagonal,
        )
        return CONSERVATIVE
    causal, br_by_name = known
    left, right = window
    if causal and right == -1:
        right = 0
    br = br_by_name if bottom_right_diagonal is None else bottom_right_diagonal
    # A causal name and a flag that say different diagonals: keep both (a superset).
    top_left, bottom_right = (True, True) if causal and br != br_by_name else (not br, br)
    return KeySpan(True, causal, left, right, top_left, bottom_right)


def key_bounds(lq: Any, lk: Any, span: KeySpan) -> Tuple[Any, Any]:
    """The attended key interval ``[lo, hi)`` of each sequence: the one statement of the rule
    in Python (``kernel._key_bounds`` restates it in Triton; the tests hold both to one
    brute-force oracle of the mask's definition).

    Args:
        lq, lk: int tensors of per-sequence query and key counts (any device, no sync).
        span: the mask's :class:`KeySpan`.

    Returns:
        ``(lo, hi)`` tensors; ``hi <= lo`` where no key is attended (no query, no key, or an
        empty window).
    """
    zero = lk * 0
    if not span.exact:
        return zero, lk.where(lq > 0, zero)
    los, his = [], []
    for use, s in ((span.top_left, zero), (span.bottom_right, lk - lq)):
        if not use:
            continue
        lo = zero if span.window_left < 0 else (s - span.window_left).clamp(min=0)
        hi = lk if span.window_right < 0 else lk.minimum(lq + s + span.window_right)
        nonempty = hi > lo
        # An empty interval must not widen the union of the two alignments.
        los.append(lo.where(nonempty, lk))
        his.append(hi.where(nonempty, zero))
    lo, hi = los[0], his[0]
    for extra_lo, extra_hi in zip(los[1:], his[1:]):
        lo, hi = lo.minimum(extra_lo), hi.maximum(extra_hi)
    return lo, hi.where(lq > 0, zero)
