"""Brute-force oracle for the rows whose true gradient is 0.

Built from the definition, one full boolean ``[lq, lk]`` mask matrix per sequence, with
no shared code with ``te_gqa_fix.masks``/``postpass`` (no intervals, no searchsorted):
query ``i`` attends key ``j`` iff ``0 <= j < lk`` and ``j`` lies in
``[i + s - left, i + s + right]`` with ``s = lk - lq`` (bottom-right) or ``0`` (top-left),
causal masks force ``right = 0``, and ``-1`` is unbounded. A key row is kept iff some
query attends it; a dQ row iff it is a valid query of a sequence with ``lk > 0``. Rows
outside every sequence are never kept.

When a causal mask's name and an explicit ``bottom_right_diagonal`` disagree the
implementation keeps both alignments; :func:`attention_matrix` models that as the union of
the two masks. The implementation keeps one key interval per sequence, so in that case it
keeps the hull of the two alignments' key intervals (keys between them too: a superset,
never fewer rows); :func:`expected_keep` models that unless ``exact_union`` is set.
For non-causal masks the explicit flag decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

KNOWN = {
    # name -> (causal, bottom-right by name)
    "padding": (False, False),
    "no_mask": (False, False),
    "padding_causal": (True, False),
    "causal": (True, False),
    "padding_causal_bottom_right": (True, True),
    "causal_bottom_right": (True, True),
}


@dataclass(frozen=True)
class Ragged:
    """A THD batch: valid lengths and where each sequence starts in its buffer.

    ``pad_q``/``pad_kv`` None means the buffer offsets are the valid offsets (TE's rule
    when no padded offsets are passed). ``rows_q``/``rows_kv`` may exceed the last offset
    (tail rows that belong to no sequence).
    """

    lq: Tuple[int, ...]
    lk: Tuple[int, ...]
    pad_q: Optional[Tuple[int, ...]]
    pad_kv: Optional[Tuple[int, ...]]
    rows_q: int
    rows_kv: int

    @property
    def nseq(self) -> int:
        return len(self.lq)

    @staticmethod
    def cumulative(lengths: Sequence[int]) -> Tuple[int, ...]:
        out = [0]
        for n in lengths:
            out.append(out[-1] + n)
        return tuple(out)

    def buffer_offsets(self, side: str) -> Tuple[int, ...]:
        if side == "q":
            return self.pad_q if self.pad_q is not None else self.cumulative(self.lq)
        return self.pad_kv if self.pad_kv is not None else self.cumulative(self.lk)

    def tensors(self, device: str = "cpu"):
        """``(cu_q, cu_kv, pad_q, pad_kv)`` as TE passes them (int32, padded may be None)."""

        def t(values: Optional[Sequence[int]]) -> Optional[torch.Tensor]:
            if values is None:
                return None
            return torch.tensor(list(values), dtype=torch.int32, device=device)

        return (
            t(self.cumulative(self.lq)),
            t(self.cumulative(self.lk)),
            t(self.pad_q),
            t(self.pad_kv),
        )


def make_ragged(
    pairs: Sequence[Tuple[int, int]],
    *,
    padded: bool = True,
    gaps_q: Optional[Sequence[int]] = None,
    gaps_kv: Optional[Sequence[int]] = None,
    lead_q: int = 0,
    lead_kv: int = 0,
    tail_q: int = 0,
    tail_kv: int = 0,
) -> Ragged:
    """Build a :class:`Ragged` from ``(lq, lk)`` pairs with padding gaps, leading rows
    (before the first padded offset) and tail rows (after the last)."""
    lq = tuple(p[0] for p in pairs)
    lk = tuple(p[1] for p in pairs)
    n = len(pairs)
    if not padded:
        return Ragged(lq, lk, None, None, sum(lq) + tail_q, sum(lk) + tail_kv)
    gaps_q = [0] * n if gaps_q is None else list(gaps_q)
    gaps_kv = [0] * n if gaps_kv is None else list(gaps_kv)
    pad_q, pad_kv = [lead_q], [lead_kv]
    for b in range(n):
        pad_q.append(pad_q[-1] + lq[b] + gaps_q[b])
        pad_kv.append(pad_kv[-1] + lk[b] + gaps_kv[b])
    return Ragged(lq, lk, tuple(pad_q), tuple(pad_kv), pad_q[-1] + tail_q, pad_kv[-1] + tail_kv)


#: Two batches of the same rows, of 3 and of 5 sequences (a sequence without queries in
#: each, padding, tail rows): packed training batches of one token count differ in their
#: number of sequences from step to step, and so in the length of their offsets.
SAME_ROWS_OTHER_COUNTS = (
    make_ragged([(3, 5), (0, 4), (4, 4)], gaps_q=[1, 0, 2], gaps_kv=[1, 1, 0], tail_q=2, tail_kv=2),
    make_ragged([(1, 2), (0, 3), (2, 2), (1, 1), (2, 2)], tail_q=6, tail_kv=7),
)
assert len({(r.rows_q, r.rows_kv) for r in SAME_ROWS_OTHER_COUNTS}) == 1


def _window_or_none(window: object) -> Optional[Tuple[int, int]]:
    if window is None:
        return (-1, -1)
    try:
        left, right = int(window[0]), int(window[1])  # type: ignore[index]
    except (TypeError, ValueError, IndexError):
        return None
    if left < -1 or right < -1:
        return None
    return (left, right)


def attention_matrix(
    lq: int,
    lk: int,
    attn_mask_type: object,
    window_size: object = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
) -> List[List[bool]]:
    """The full ``[lq, lk]`` boolean mask, from the definition (``True`` = attends).

    An unknown mask type or malformed window gives the all-True matrix: the conservative
    set keeps every valid key of a sequence with queries.
    """
    window = _window_or_none(window_size)
    known = KNOWN.get(attn_mask_type) if isinstance(attn_mask_type, str) else None
    if known is None or window is None:
        return [[True] * lk for _ in range(lq)]
    causal, br_by_name = known
    left, right = window
    if causal:
        right = 0
    if bottom_right_diagonal is None:
        alignments = [br_by_name]
    elif bool(bottom_right_diagonal) == br_by_name:
        alignments = [br_by_name]
    elif causal:
        alignments = [False, True]  # ambiguous: the implementation keeps the union
    else:
        alignments = [bool(bottom_right_diagonal)]
    matrix = [[False] * lk for _ in range(lq)]
    for bottom_right in alignments:
        s = lk - lq if bottom_right else 0
        for i in range(lq):
            for j in range(lk):
                ok_left = left < 0 or j >= i + s - left
                ok_right = right < 0 or j <= i + s + right
                if ok_left and ok_right:
                    matrix[i][j] = True
    return matrix


def is_ambiguous(
    attn_mask_type: object, window_size: object, bottom_right_diagonal: Optional[bool]
) -> bool:
    """A causal mask whose name says one diagonal and an explicit flag the other."""
    known = KNOWN.get(attn_mask_type) if isinstance(attn_mask_type, str) else None
    if known is None or _window_or_none(window_size) is None or bottom_right_diagonal is None:
        return False
    causal, br_by_name = known
    return causal and bool(bottom_right_diagonal) != br_by_name


def expected_keep(
    ragged: Ragged,
    attn_mask_type: object,
    window_size: object = (-1, -1),
    bottom_right_diagonal: Optional[bool] = None,
    *,
    exact_union: bool = False,
) -> Tuple[List[bool], List[bool]]:
    """``(keep_q, keep_kv)``: per buffer row, whether its true gradient may be non-zero.

    ``exact_union`` False (default) models the implementation in the ambiguous case
    (hull of the two alignments' key intervals); True keeps only keys some query
    attends under either alignment.
    """
    hull = not exact_union and is_ambiguous(attn_mask_type, window_size, bottom_right_diagonal)
    keep_q = [False] * ragged.rows_q
    keep_kv = [False] * ragged.rows_kv
    pad_q = ragged.buffer_offsets("q")
    pad_kv = ragged.buffer_offsets("kv")
    for b in range(ragged.nseq):
        lq, lk = ragged.lq[b], ragged.lk[b]
        matrix = attention_matrix(lq, lk, attn_mask_type, window_size, bottom_right_diagonal)
        attended = [j for j in range(lk) if any(matrix[i][j] for i in range(lq))]
        if hull and attended:
            attended = list(range(min(attended), max(attended) + 1))
        for j in attended:
            row = pad_kv[b] + j
            if row < ragged.rows_kv:
                keep_kv[row] = True
        if lk > 0:
            for i in range(lq):
                row = pad_q[b] + i
                if row < ragged.rows_q:
                    keep_q[row] = True
    return keep_q, keep_kv


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float tensor (so NaN == NaN and -0.0 != +0.0)."""
    size = t.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.view(as_int)


def assert_rows(
    after: torch.Tensor, before: torch.Tensor, keep: Sequence[bool], name: str = "tensor"
) -> None:
    """Kept rows bit-identical to ``before``; every other row exactly +0 (all bits 0)."""
    assert after.shape[0] == len(keep), f"{name}: {after.shape[0]} rows, oracle has {len(keep)}"
    keep_t = torch.tensor(list(keep), dtype=torch.bool)
    assert torch.equal(bits(after)[keep_t], bits(before)[keep_t]), (
        f"{name}: a kept row changed (rows {[i for i, k in enumerate(keep) if k]})"
    )
    dead = ~keep_t
    zeroed = bits(after)[dead]
    assert bool((zeroed == 0).all()), (
        f"{name}: rows that must be 0 are not (rows "
        f"{[i for i, k in enumerate(keep) if not k and bool((bits(after)[i] != 0).any())]})"
    )
