"""The rule: what te-gqa-fix does with a THD attention backward on this GPU and cuDNN.

Two steps, each a function of plain facts (standard library only: the cuDNN route reads
the table before torch exists):

- :func:`judge`: what was measured (``docs/validation.md``) says about a GPU, the cuDNN TE
  runs, and head dims: right, rows of sequences without queries stale (the post-pass
  repairs them), or rows that receive attention wrong (no post-pass can: the exact
  fallback serves them).
- :func:`decide`: for one call shape, pass through, zero (TE then the post-pass), fall
  back (FlashAttention-2 then the post-pass), or raise. Flat filters, each logging at
  DEBUG why it decided.

Only a build measured right passes through. A cuDNN that was not measured keeps the
post-pass and is judged on live rows by the newest measured build below it (the oldest
measured build where none is below, or where the version cannot be read on Hopper).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import FrozenSet, NamedTuple, Optional, Sequence, Tuple

__all__ = [
    "CUDNN_FIXED",
    "HOPPER_MAJOR",
    "MAX_REPAIRABLE_HEAD_DIM",
    "MEASURED",
    "Action",
    "CallShape",
    "Measurement",
    "Verdict",
    "decide",
    "judge",
    "measurement_for",
    "newest_right",
    "pip_hint",
    "version_text",
]

_log = logging.getLogger("te_gqa_fix")

HOPPER_MAJOR = 9  # compute capability 9.x
#: The first cuDNN that initialises the GQA workspace on Hopper (upstream, TE #2186).
CUDNN_FIXED: Tuple[int, int, int] = (9, 18, 0)
#: Up to this head dim (q/k and v) every measured build is right on live rows.
MAX_REPAIRABLE_HEAD_DIM = 128
Shape = Tuple[int, int]  # (q/k head dim, v head dim)
_ABOVE_128: FrozenSet[Shape] = frozenset(
    {(160, 160), (192, 128), (192, 192), (224, 224), (256, 128), (256, 256)}
)


@dataclass(frozen=True)
class Measurement:
    """What the GPU tests measured on one cuDNN build on Hopper (MHA, GQA and MQA alike,
    after a poisoned workspace; sequences without queries, without keys, and without both,
    in the middle of a batch and at its end).

    Attributes:
        cudnn: the build (major, minor, patch).
        stale_rows: rows whose true gradient is 0 hold stale workspace (the post-pass
            repairs them).
        wrong: shapes above 128 wrong on rows that receive attention.
        clean: shapes above 128 right there. A shape in neither set counts as wrong.
        zero_length_wrong: sequences without queries or keys make rows that receive
            attention wrong (NaN): no post-pass repairs that, and the route never loads it.
    """

    cudnn: Tuple[int, int, int]
    stale_rows: bool
    wrong: FrozenSet[Shape]
    clean: FrozenSet[Shape]
    zero_length_wrong: bool = False

    @property
    def right_at_every_shape(self) -> bool:
        """Right at every shape measured, above 128 included (a build "measured right"
        without more words is right up to head dim 128: :func:`judge` without head dims)."""
        return not (self.stale_rows or self.wrong or self.zero_length_wrong)


#: The measured builds, oldest first.
MEASURED: Tuple[Measurement, ...] = (
    Measurement((9, 14, 0), True, _ABOVE_128 - {(192, 128)}, frozenset({(192, 128)})),
    Measurement((9, 19, 0), False, frozenset({(256, 128)}), _ABOVE_128 - {(256, 128)}),
    Measurement((9, 20, 0), False, frozenset({(256, 128)}), _ABOVE_128 - {(256, 128)}),
    Measurement((9, 24, 1), False, frozenset({(256, 128)}), _ABOVE_128 - {(256, 128)}),
    Measurement((9, 27, 0), False, frozenset(), _ABOVE_128),
    Measurement((9, 28, 1), False, frozenset(), _ABOVE_128),
)


def measurement_for(cudnn: Optional[Sequence[int]]) -> Tuple[Measurement, bool]:
    """The measurement that judges this cuDNN, and whether it is this build's own.

    Args:
        cudnn: (major, minor, patch), or None where unknown; a patch release counts as its
            minor release.

    Returns:
        The newest measured build at or below it (the oldest, for an older or unknown
        cuDNN), and True where that build has the same major and minor version.
    """
    if cudnn is None:
        return MEASURED[0], False
    v = tuple(int(x) for x in cudnn)[:2]
    below = [m for m in MEASURED if m.cudnn[:2] <= v]
    m = below[-1] if below else MEASURED[0]
    return m, m.cudnn[:2] == v


def newest_right(d_qk: int = MAX_REPAIRABLE_HEAD_DIM, d_v: Optional[int] = None) -> Measurement:
    """The newest measured build right at these head dims (dead and live rows), else the
    newest measured build: what a remedy asks for."""
    shape = (d_qk, d_qk if d_v is None else d_v)
    ok = [m for m in MEASURED if not (m.stale_rows or m.zero_length_wrong) and _live_ok(m, shape)]
    return (ok or list(MEASURED))[-1]


def version_text(v: Sequence[int]) -> str:
    """``(9, 14, 0)`` -> ``"9.14.0"``."""
    return ".".join(str(x) for x in v)


def pip_hint(minimum: Sequence[int]) -> str:
    """The ``pip install`` that brings a cuDNN of at least ``minimum`` (major, minor)."""
    at_least = version_text(tuple(minimum)[:2])
    return f"pip install 'nvidia-cudnn-cu12>={at_least}' (CUDA 12) or 'nvidia-cudnn-cu13>={at_least}' (CUDA 13)"


def _live_ok(m: Measurement, shape: Shape) -> bool:
    return max(shape) <= MAX_REPAIRABLE_HEAD_DIM or shape in m.clean


class Verdict(NamedTuple):
    """What the measurements say for one GPU, cuDNN and pair of head dims.

    Attributes:
        status: ``unknown`` (no GPU capability: not CUDA, or not known), ``not_hopper``
            (the bug is known on Hopper only), ``right`` (this build was measured right
            here), ``stale_rows`` (rows whose true gradient is 0 may hold stale workspace:
            the post-pass makes the result exact), ``live_rows_wrong`` (rows that receive
            attention are wrong: no post-pass can repair them).
        judged_as: the measurement that judged it (None for ``unknown``/``not_hopper``).
        measured: ``judged_as`` is this build's own measurement.
        cudnn_known: the cuDNN version was read.
    """

    status: str
    judged_as: Optional[Measurement]
    measured: bool
    cudnn_known: bool


def judge(
    capability: Optional[Sequence[int]],
    cudnn: Optional[Sequence[int]],
    d_qk: Optional[int] = None,
    d_v: Optional[int] = None,
) -> Verdict:
    """What the measured facts say for THD attention on this GPU and cuDNN.

    Args:
        capability: the GPU's compute capability (None: unknown, or not CUDA).
        cudnn: the cuDNN Transformer Engine runs (not torch's); None where unknown.
        d_qk, d_v: the q/k and v head dims (d_v default: d_qk); None: head dims up to 128.

    Returns:
        A :class:`Verdict`. ``right`` only where this build's own measurement says so; an
        unknown cuDNN on Hopper is judged as the oldest measured build.
    """
    if capability is None:
        return Verdict("unknown", None, False, cudnn is not None)
    if int(capability[0]) != HOPPER_MAJOR:
        return Verdict("not_hopper", None, False, cudnn is not None)
    m, own = measurement_for(cudnn)
    known = cudnn is not None
    if d_qk is not None:
        shape = (int(d_qk), int(d_qk if d_v is None else d_v))
        if not _live_ok(m, shape):
            return Verdict("live_rows_wrong", m, own, known)
    if m.zero_length_wrong:
        return Verdict("live_rows_wrong", m, own, known)
    fixed = known and tuple(int(x) for x in cudnn)[:3] >= CUDNN_FIXED  # type: ignore[union-attr]
    if own and fixed and not m.stale_rows:
        return Verdict("right", m, own, known)
    return Verdict("stale_rows", m, own, known)


class CallShape(NamedTuple):
    """What :func:`decide` reads of one call shape (besides the verdict and settings).

    Attributes:
        kv_thd: k and v are THD (the stale workspace is a THD path).
        gqa: more query heads than KV heads (or heads unreadable: the gate refuses those).
        shared_offsets: queries and keys share their offsets tensors (self-attention): every
            sequence has as many queries as keys, so no key row can lack queries.
        filled_by_te: the gradients are fp16/bf16, which TE zero-fills before cuDNN writes.
    """

    kv_thd: bool
    gqa: bool
    shared_offsets: bool
    filled_by_te: bool


class Action(NamedTuple):
    """What the wrapper does with a call shape.

    Attributes:
        run: ``te`` (TE's backward), ``fallback`` (the exact FlashAttention-2 backward),
            ``raise`` (:class:`~te_gqa_fix.errors.UnrepairableConfiguration`), or ``warn``
            (TE's backward, known wrong on live rows, logged once).
        zero: the post-pass runs on the gradients.
        why: one line, for the log and for ``doctor``.
    """

    run: str
    zero: bool
    why: str


def decide(verdict: Verdict, call: CallShape, policy: str, guard: str) -> Action:
    """The action for one call shape, in TE's ``get_attention_backend`` style: each filter
    says at DEBUG why it decided.

    Args:
        verdict: :func:`judge` for the call's device and head dims.
        call: the call's :class:`CallShape`.
        policy: ``TE_GQA_FIX`` (``auto``, ``always``, ``off``).
        guard: ``TE_GQA_FIX_GUARD`` (``fallback``, ``warn``, ``strict``, ``off``).

    Returns:
        The :class:`Action`.
    """
    # Filter: the policy is off.
    if policy == "off":
        return _decided(Action("te", False, "TE_GQA_FIX=off"))
    # Filter: k and v are not THD (the stale workspace is a THD path).
    if not call.kv_thd:
        return _decided(Action("te", False, "k and v are not THD"))
    # Filter: a measurement says TE is right here.
    if policy == "auto" and verdict.status == "right":
        return _decided(Action("te", False, "this cuDNN was measured right at these head dims"))
    # The post-pass: GQA calls whose key rows can lack queries (and every call for always).
    self_attention = call.shared_offsets and call.filled_by_te
    zero = policy == "always" or (call.gqa and not self_attention)
    # Filter: rows that receive attention are wrong: no post-pass repairs them.
    if verdict.status == "live_rows_wrong":
        why = "TE is wrong on rows that receive attention here"
        if guard == "fallback":
            return _decided(Action("fallback", True, f"{why}: the exact fallback"))
        if guard == "strict":
            return _decided(Action("raise", False, f"{why}: TE_GQA_FIX_GUARD=strict"))
        run = "warn" if guard == "warn" else "te"
        return _decided(Action(run, zero, f"{why}: TE_GQA_FIX_GUARD={guard}"))
    # Filter: the post-pass has nothing to repair.
    if not zero:
        why = (
            "one offsets tensor for queries and keys"
            if call.gqa
            else "as many KV heads as query heads"
        )
        return _decided(Action("te", False, why))
    return _decided(
        Action("te", True, f"rows whose true gradient is 0 may be stale ({verdict.status})")
    )


def _decided(action: Action) -> Action:
    _log.debug("decided %s%s: %s", action.run, " + post-pass" if action.zero else "", action.why)
    return action
