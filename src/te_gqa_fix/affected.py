"""The one rule: is THD + GQA attention affected on this GPU and cuDNN, and can the post-pass
repair it? A table of measurements (docs/validation.md): Hopper with cuDNN < 9.18 sums stale
workspace into dK/dV rows of sequences without queries (repairable), and at head dims above
128 is wrong on live rows too (unrepairable). Decided once per device and head dims.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Sequence, Tuple

from .cudnn import CUDNN_FIXED, ENV_CUDNN, FIXED, choose_fixed, find_wheel_builds, pip_hint
from .stack import runtime_facts

__all__ = [
    "CUDNN_FIXED",
    "HOPPER_MAJOR",
    "MAX_REPAIRABLE_HEAD_DIM",
    "MEASURED_CLEAN_ABOVE_128",
    "MEASURED_WRONG_ABOVE_128",
    "WRONG_ON_FIXED_CUDNN",
    "UnrepairableConfiguration",
    "Verdict",
    "cudnn_fixed",
    "cudnn_is_fixed",
    "head_dims_repairable",
    "passes_through",
    "remedy",
    "reset",
    "unrepairable",
    "verdict",
]

HOPPER_MAJOR = 9  # compute capability 9.x
MAX_REPAIRABLE_HEAD_DIM = 128
#: (q/k head dim, v head dim) above 128, measured on cuDNN 9.14 after a poisoned workspace
#: (tests/gpu/test_head_dim.py): clean on live rows, or wrong there (MHA, GQA and MQA alike).
#: Any other shape above 128 counts as wrong: the fallback serves it, exact either way.
MEASURED_CLEAN_ABOVE_128: FrozenSet[Tuple[int, int]] = frozenset({(192, 128)})
MEASURED_WRONG_ABOVE_128: FrozenSet[Tuple[int, int]] = frozenset(
    {(160, 160), (192, 192), (224, 224), (256, 256), (256, 128)}
)
#: Shapes measured wrong on live rows on cuDNN 9.19 as well: no cuDNN measured fixes them.
WRONG_ON_FIXED_CUDNN: FrozenSet[Tuple[int, int]] = frozenset({(256, 128)})


def _shapes(dims: FrozenSet[Tuple[int, int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}/{b}" for a, b in sorted(dims))


def _vstr(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def cudnn_is_fixed(cudnn_version: Optional[Sequence[int]]) -> bool:
    """True when this cuDNN is known to be fixed (9.18 or newer); False when older or unknown."""
    return cudnn_version is not None and tuple(int(x) for x in cudnn_version) >= CUDNN_FIXED


def head_dims_repairable(head_dim_qk: int, head_dim_v: Optional[int] = None) -> bool:
    """Whether the post-pass makes the result exact at these head dims on an affected cuDNN."""
    d_v = head_dim_qk if head_dim_v is None else head_dim_v
    if head_dim_qk <= MAX_REPAIRABLE_HEAD_DIM and d_v <= MAX_REPAIRABLE_HEAD_DIM:
        return True
    return (int(head_dim_qk), int(d_v)) in MEASURED_CLEAN_ABOVE_128


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

    ``cudnn_version`` is the cuDNN Transformer Engine runs (not torch's). ``head_dim`` is the
    q/k head dim and ``head_dim_v`` the v head dim (default: the same), both optional.
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
    shape = None if head_dim is None else (head_dim, head_dim if head_dim_v is None else head_dim_v)
    if cudnn_is_fixed(cud) and shape in WRONG_ON_FIXED_CUDNN:
        return Verdict(
            "unrepairable",
            (
                f"head dims {shape[0]}/{shape[1]} on {sm} are wrong on rows that receive "
                f"attention with cuDNN {_vstr(cud)} too (measured on 9.14 and 9.19): the exact "
                "fallback (TE_GQA_FIX_GUARD=fallback, the default) recomputes them",
            ),
        )
    if cudnn_is_fixed(cud):
        return Verdict(
            "not_affected",
            (f"cuDNN {_vstr(cud)} >= {FIXED} initialises the GQA workspace (9.19 measured clean)",),
        )
    base = (
        f"Hopper ({sm}) with cuDNN {_vstr(cud)} < {FIXED}: TE's fused_attn_bwd (THD layout, "
        "GQA/MQA) sums stale workspace into dK/dV rows of sequences without query tokens"
    )
    if head_dim is not None and not head_dims_repairable(head_dim, head_dim_v):
        shape = f"{head_dim}" if head_dim_v in (None, head_dim) else f"{head_dim}/{head_dim_v}"
        return Verdict(
            "unrepairable",
            (
                base,
                f"head dim {shape} on this cuDNN is wrong on rows that receive attention too "
                f"(measured wrong at {_shapes(MEASURED_WRONG_ABOVE_128)}): no post-pass can "
                "repair it; the exact fallback (TE_GQA_FIX_GUARD=fallback, the default) "
                f"recomputes it with FlashAttention-2, and cuDNN {FIXED} or newer fixes it "
                "(TE_GQA_FIX_CUDNN=auto loads an installed one)",
            ),
        )
    reasons = [base, "te-gqa-fix repairs it exactly (head dims up to 128, and q/k 192 with v 128)"]
    if head_dim is None:
        reasons.append(
            f"head dims above {MAX_REPAIRABLE_HEAD_DIM} (but q/k 192 with v 128) are wrong on "
            "live rows here: the exact fallback serves them (pass --head-dim to check)"
        )
    return Verdict("affected", tuple(reasons))


# ----------------------------------------------------------------- per process


class UnrepairableConfiguration(RuntimeError):
    """A THD backward whose gradient is wrong on live rows on this cuDNN (strict guard)."""


_fixed: Dict[Optional[int], bool] = {}
#: (device, d_qk, d_v) -> None (repairable) or why not
_decisions: Dict[Tuple[Optional[int], int, int], Optional[str]] = {}
_lock = threading.Lock()


def passes_through(device_index: Optional[int], d_qk: int, d_v: int) -> bool:
    """True when the cuDNN TE runs on this device is fixed and these head dims are not among
    the shapes it is still wrong at: nothing to repair, nothing to guard (cached lookups)."""
    return cudnn_fixed(device_index) and (d_qk, d_v) not in WRONG_ON_FIXED_CUDNN


def cudnn_fixed(device_index: Optional[int]) -> bool:
    """True when the cuDNN TE runs is known to be fixed (>= 9.18), for this CUDA device.

    False when it is older or unknown (no GPU, TE does not say): then the post-pass runs.
    """
    fixed = _fixed.get(device_index)
    if fixed is None:
        fixed = cudnn_is_fixed(runtime_facts(device_index).cudnn)
        _fixed[device_index] = fixed
    return fixed


def remedy() -> str:
    """How to get a fixed cuDNN here: the setting, where a fixed build is on disk already,
    or the ``pip install`` that brings one."""
    try:
        chosen = choose_fixed(find_wheel_builds())
    except Exception:  # a broken site folder must not turn a warning into a crash
        chosen = None
    if chosen is not None:
        return (
            f"set {ENV_CUDNN}=auto in the environment (cuDNN {chosen.version_str} is installed "
            f"at {chosen.lib_dir} but Transformer Engine does not use it)"
        )
    return f"{pip_hint()}, then set {ENV_CUDNN}=auto in the environment"


def unrepairable(device_index: Optional[int], d_qk: int, d_v: int) -> Optional[str]:
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
        fixed = cudnn_is_fixed(facts.cudnn)
        msg = (
            f"te_gqa_fix: Transformer Engine's THD attention backward with head dim {shape} on "
            f"sm{cap[0]}{cap[1]} with cuDNN {_vstr(facts.cudnn or ())} returns wrong gradients "
            "on rows that receive attention; a post-pass cannot repair this. "
            + ("No cuDNN measured so far fixes it." if fixed else f"Remedy: {remedy()}.")
        )
    with _lock:
        _decisions[key] = msg
    return msg


def reset() -> None:
    """Forget every decision (tests; or after the stack changed)."""
    with _lock:
        _fixed.clear()
        _decisions.clear()
