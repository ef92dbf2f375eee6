"""The one rule: is THD + GQA attention affected on this GPU and cuDNN, and can the post-pass
repair it? It states what was measured (docs/validation.md), per cuDNN build, on Hopper:
whether rows of sequences without queries hold stale workspace (the post-pass repairs them),
and at which head dims above 128 rows that receive attention are wrong (no post-pass can
repair them; the exact fallback serves them). Decided once per device and head dims.

A cuDNN between two measured builds is judged by the older one's live rows, and its dead rows
get the post-pass (not measured clean); one newer than the newest measured build is judged
as that build, and ``doctor`` says it was not measured.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Sequence, Tuple

from .cudnn import CUDNN_FIXED, ENV_CUDNN, FIXED, choose_fixed, find_wheel_builds, pip_hint
from .versions import runtime_facts

__all__ = [
    "CUDNN_FIXED",
    "HOPPER_MAJOR",
    "MAX_REPAIRABLE_HEAD_DIM",
    "MEASURED",
    "NEWEST_CLEAN",
    "Measurement",
    "UnrepairableConfiguration",
    "Verdict",
    "clean_from",
    "cudnn_fixed",
    "cudnn_is_fixed",
    "measured_clean",
    "measurement_for",
    "passes_through",
    "remedy",
    "reset",
    "verdict",
    "why_unrepairable",
]

HOPPER_MAJOR = 9  # compute capability 9.x
#: Up to this head dim (q/k and v) every measured build is right on live rows.
MAX_REPAIRABLE_HEAD_DIM = 128
Shape = Tuple[int, int]  # (q/k head dim, v head dim)
_ABOVE_128: FrozenSet[Shape] = frozenset(
    {(160, 160), (192, 128), (192, 192), (224, 224), (256, 128), (256, 256)}
)


@dataclass(frozen=True)
class Measurement:
    """What ``tests/gpu/test_head_dim.py`` and ``test_sweep.py`` measured on one cuDNN build
    on Hopper, MHA, GQA and MQA alike, after a poisoned workspace.

    Attributes:
        cudnn: the build (major, minor, patch).
        stale_rows: rows of sequences without queries hold stale workspace (repairable).
        wrong: shapes above 128 wrong on rows that receive attention.
        clean: shapes above 128 right there. A shape in neither set counts as wrong.
    """

    cudnn: Tuple[int, int, int]
    stale_rows: bool
    wrong: FrozenSet[Shape]
    clean: FrozenSet[Shape]


#: The measured builds, oldest first.
MEASURED: Tuple[Measurement, ...] = (
    Measurement((9, 14, 0), True, _ABOVE_128 - {(192, 128)}, frozenset({(192, 128)})),
    Measurement((9, 19, 0), False, frozenset({(256, 128)}), _ABOVE_128 - {(256, 128)}),
    Measurement((9, 27, 0), False, frozenset(), _ABOVE_128),
)


def _shapes(dims: FrozenSet[Shape]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}/{b}" for a, b in sorted(dims)) or "none"


def _vstr(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


#: The newest measured build, right at every shape measured: what a remedy installs.
NEWEST_CLEAN = _vstr(MEASURED[-1].cudnn[:2])


def cudnn_is_fixed(cudnn_version: Optional[Sequence[int]]) -> bool:
    """True when this cuDNN has the stale-workspace fix (9.18 or newer); False when older or
    unknown. Not the same as right everywhere: see :func:`verdict`."""
    return cudnn_version is not None and tuple(int(x) for x in cudnn_version) >= CUDNN_FIXED


def measurement_for(cudnn_version: Sequence[int]) -> Tuple[Measurement, bool]:
    """The measurement that judges this cuDNN, and whether it is this build's own.

    Args:
        cudnn_version: (major, minor, patch); a patch release counts as its minor release.

    Returns:
        The newest measured build at or below it (the oldest, for an older cuDNN), and True
        where that build has the same major and minor version.
    """
    v = tuple(int(x) for x in cudnn_version)[:2]
    below = [m for m in MEASURED if m.cudnn[:2] <= v]
    m = below[-1] if below else MEASURED[0]
    return m, m.cudnn[:2] == v


@dataclass(frozen=True)
class Verdict:
    """``status``: ``affected``, ``not_affected``, ``unrepairable`` or ``unknown``."""

    status: str
    reasons: Tuple[str, ...]


def verdict(
    capability: Optional[Sequence[int]],
    cudnn_version: Optional[Sequence[int]],
    head_dim: Optional[int] = None,
    head_dim_v: Optional[int] = None,
) -> Verdict:
    """What the measured facts say for THD + GQA attention on this GPU and cuDNN.

    Args:
        capability: the GPU's compute capability; cudnn_version: the cuDNN Transformer
            Engine runs (not torch's); both None where unknown.
        head_dim: the q/k head dim; head_dim_v: the v head dim (default: the same). Without
            a head dim, the verdict is for head dims up to 128.

    Returns:
        A :class:`Verdict`: ``not_affected`` only where a measurement says clean.
    """
    if capability is None or cudnn_version is None:
        missing = []
        if capability is None:
            missing.append("the GPU's compute capability")
        if cudnn_version is None:
            missing.append("the cuDNN version Transformer Engine runs")
        return Verdict("unknown", (f"cannot tell without {' and '.join(missing)}",))
    cap = tuple(int(x) for x in capability)
    cud = tuple(int(x) for x in cudnn_version)
    sm = f"sm{cap[0]}{cap[1] if len(cap) > 1 else 0}"
    if cap[0] != HOPPER_MAJOR:
        return Verdict(
            "not_affected",
            (
                f"{sm} is not Hopper: the stale-workspace bug is known on Hopper (sm90) only; "
                "te-gqa-fix does no harm elsewhere",
            ),
        )
    m, own = measurement_for(cud)
    newest = cud[:2] > MEASURED[-1].cudnn[:2]
    judged = f"cuDNN {_vstr(cud)}" + (
        "" if own else f" (not measured; judged as the measured {_vstr(m.cudnn)})"
    )
    shape = None if head_dim is None else (head_dim, head_dim if head_dim_v is None else head_dim_v)
    if shape is not None and max(shape) > MAX_REPAIRABLE_HEAD_DIM and shape not in m.clean:
        measured = f"measured wrong there at {_shapes(m.wrong)}; clean at {_shapes(m.clean)}"
        return Verdict(
            "unrepairable",
            (
                f"head dims {shape[0]}/{shape[1]} on {sm} with {judged} are wrong on rows that "
                f"receive attention ({measured}): no post-pass can repair it; the exact "
                "fallback (TE_GQA_FIX_GUARD=fallback, the default) recomputes it with "
                f"FlashAttention-2, and cuDNN {_vstr(clean_from(*shape).cudnn)} was measured "
                f"right there ({ENV_CUDNN}=auto loads an installed one)",
            ),
        )
    stale_workspace = m.stale_rows or not cudnn_is_fixed(cud)
    if not (stale_workspace or not (own or newest)):
        scope = "head dims up to 128" if shape is None else f"head dims {shape[0]}/{shape[1]}"
        return Verdict(
            "not_affected",
            (
                f"{judged} initialises the GQA workspace and is right on live rows at {scope}"
                + (f"; wrong at {_shapes(m.wrong)} (the exact fallback serves those)" if m.wrong else ""),
            ),
        )  # fmt: skip
    why = (
        f"{judged} < {FIXED}: TE's fused_attn_bwd (THD layout, GQA/MQA) sums stale workspace "
        "into dK/dV rows of sequences without query tokens"
        if stale_workspace
        else f"{judged}: rows of sequences without query tokens were not measured clean here"
    )
    reasons = [
        f"Hopper ({sm}) with {why}",
        "te-gqa-fix repairs it exactly (the post-pass zeroes those rows)",
    ]
    if shape is None and m.wrong:
        reasons.append(
            f"head dims {_shapes(m.wrong)} are wrong on live rows here: the exact fallback "
            "serves them (pass --head-dim to check)"
        )
    return Verdict("affected", tuple(reasons))


# ----------------------------------------------------------------- per process


class UnrepairableConfiguration(RuntimeError):
    """A THD backward whose gradient is wrong on live rows on this cuDNN (strict guard)."""


_fixed: Dict[Optional[int], bool] = {}
#: (device, d_qk, d_v) -> None (repairable) or why not
_decisions: Dict[Tuple[Optional[int], int, int], Optional[str]] = {}
_lock = threading.Lock()


def measured_clean(
    capability: Optional[Sequence[int]],
    cudnn_version: Optional[Sequence[int]],
    head_dim: Optional[int] = None,
    head_dim_v: Optional[int] = None,
) -> bool:
    """True where a measurement on Hopper of this cuDNN says these head dims are clean (the
    arguments of :func:`verdict`). Elsewhere (another GPU, an unknown stack) False: the
    post-pass runs, harmless where nothing is wrong."""
    return (capability or (0,))[0] == HOPPER_MAJOR and (
        verdict(capability, cudnn_version, head_dim, head_dim_v).status == "not_affected"
    )


def passes_through(device_index: Optional[int], d_qk: int, d_v: int) -> bool:
    """:func:`measured_clean` for the cuDNN TE runs on this device: nothing to repair,
    nothing to guard. Asked once per call shape (the wrapper caches its decision)."""
    facts = runtime_facts(device_index)
    return measured_clean(facts.capability, facts.cudnn, d_qk, d_v)


def cudnn_fixed(device_index: Optional[int]) -> bool:
    """True when the cuDNN TE runs on this CUDA device has the stale-workspace fix (>= 9.18).

    False when it is older or unknown (no GPU, TE does not say).
    """
    fixed = _fixed.get(device_index)
    if fixed is None:
        fixed = cudnn_is_fixed(runtime_facts(device_index).cudnn)
        _fixed[device_index] = fixed
    return fixed


def clean_from(d_qk: int, d_v: int) -> Measurement:
    """The oldest measured build right at these head dims (dead and live rows), else the
    newest measured build."""
    for m in MEASURED:
        live = max(d_qk, d_v) <= MAX_REPAIRABLE_HEAD_DIM or (d_qk, d_v) in m.clean
        if live and not m.stale_rows:
            return m
    return MEASURED[-1]


def remedy(d_qk: int = MAX_REPAIRABLE_HEAD_DIM, d_v: Optional[int] = None) -> str:
    """How to get a cuDNN measured right at these head dims: the setting, where one is
    installed already, or the ``pip install`` that brings one."""
    want = clean_from(d_qk, d_qk if d_v is None else d_v).cudnn[:2]
    try:
        chosen = choose_fixed(find_wheel_builds())
    except Exception:  # a broken site folder must not turn a warning into a crash
        chosen = None
    if chosen is not None and tuple(chosen.version or ())[:2] >= want:
        return (
            f"set {ENV_CUDNN}=auto in the environment (cuDNN {chosen.version_str} is installed "
            f"at {chosen.lib_dir} but Transformer Engine does not use it)"
        )
    return (
        f"{pip_hint(NEWEST_CLEAN)}, the newest build measured right, then set {ENV_CUDNN}=auto "
        "in the environment"
    )


def why_unrepairable(device_index: Optional[int], d_qk: int, d_v: int) -> Optional[str]:
    """Why a THD backward at these head dims on this device is wrong beyond any post-pass
    (a message naming the configuration and the remedy), or None. Cached per key.

    Args:
        device_index: the CUDA device of the call (None: not CUDA, never unrepairable).
        d_qk, d_v: the q/k and v head dims.

    Returns:
        The message, or None when the post-pass makes the result exact (or nothing is wrong).
    """
    key = (device_index, d_qk, d_v)
    try:
        return _decisions[key]
    except KeyError:
        pass
    facts = runtime_facts(device_index)
    msg = None
    if verdict(facts.capability, facts.cudnn, d_qk, d_v).status == "unrepairable":
        cap = facts.capability or (0, 0)
        shape = f"{d_qk}" if d_qk == d_v else f"{d_qk} (q/k) / {d_v} (v)"
        msg = (
            f"te_gqa_fix: Transformer Engine's THD attention backward with head dim {shape} on "
            f"sm{cap[0]}{cap[1]} with cuDNN {_vstr(facts.cudnn or ())} returns wrong gradients "
            f"on rows that receive attention; a post-pass cannot repair this. Remedy: {remedy(d_qk, d_v)}."
        )
    with _lock:
        _decisions[key] = msg
    return msg


def reset() -> None:
    """Forget every decision (tests; or after the stack changed)."""
    with _lock:
        _fixed.clear()
        _decisions.clear()
