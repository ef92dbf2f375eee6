"""Per-process decisions from the stack facts: skip the post-pass where cuDNN is fixed, and
never stay silent where nothing after the call can repair the gradient.

Both are decided once per (device, head dims) from :func:`te_gqa_fix.stack.runtime_facts`
and the one rule in :mod:`te_gqa_fix.affected`, then served from a dict: no device work, no
host sync, so the wrapper can ask on every call, also inside CUDA-graph capture.

``TE_GQA_FIX_GUARD`` says what happens on a THD backward the post-pass cannot repair
(measured: Hopper, cuDNN < 9.18, head dims 192/256):

* unset / ``warn``: a WARNING once per configuration, naming it and the remedy;
* ``strict``: raise :class:`UnrepairableConfiguration` on every such call;
* ``off``: say nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Optional, Tuple

from ._logging import log_once
from .affected import cudnn_is_fixed, verdict
from .stack import runtime_facts

__all__ = [
    "ENV_GUARD",
    "UnrepairableConfiguration",
    "check_head_dims",
    "cudnn_fixed",
    "guard_mode",
    "remedy",
    "reset_guard",
]

ENV_GUARD = "TE_GQA_FIX_GUARD"


class UnrepairableConfiguration(RuntimeError):
    """A THD backward whose gradient is wrong on live rows on this cuDNN (strict guard)."""


def guard_mode() -> str:
    """``warn`` (default), ``strict`` or ``off``, from ``TE_GQA_FIX_GUARD``."""
    raw = os.environ.get(ENV_GUARD, "").strip().lower()
    if raw in ("off", "0", "false", "no", "disable", "disabled"):
        return "off"
    if raw == "strict":
        return "strict"
    return "warn"


_fixed: Dict[Optional[int], bool] = {}
# (device, d_qk, d_v) -> None (fine) or the message of an unrepairable configuration
_decisions: Dict[Tuple[Optional[int], int, int], Optional[str]] = {}
_lock = threading.Lock()


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
    from .cudnn import ENV_CUDNN, choose_fixed, find_wheel_builds, pip_hint

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


def _decide(device_index: Optional[int], d_qk: int, d_v: int) -> Optional[str]:
    facts = runtime_facts(device_index)
    v = verdict(facts.capability, facts.cudnn, d_qk, d_v)
    if v.status != "unrepairable":
        return None
    cap = facts.capability or (0, 0)
    cud = ".".join(map(str, facts.cudnn or ()))
    shape = f"{d_qk}" if d_qk == d_v else f"{d_qk} (q/k) / {d_v} (v)"
    return (
        f"te_gqa_fix: Transformer Engine's THD attention backward with head dim {shape} on "
        f"sm{cap[0]}{cap[1]} with cuDNN {cud} returns wrong gradients on rows that receive "
        f"attention (measured at head dims 192 and 256): the post-pass cannot repair this. "
        f"Remedy: {remedy()}"
    )


def check_head_dims(device_index: Optional[int], d_qk: int, d_v: int) -> None:
    """Warn once (or raise under ``TE_GQA_FIX_GUARD=strict``) for an unrepairable backward.

    Decided once per (device, head dims) and cached: later calls cost a dict lookup.
    """
    key = (device_index, d_qk, d_v)
    try:
        msg = _decisions[key]
    except KeyError:
        with _lock:
            msg = _decide(device_index, d_qk, d_v)
            _decisions[key] = msg
    if msg is None:
        return
    mode = guard_mode()
    if mode == "strict":
        raise UnrepairableConfiguration(msg)
    if mode == "warn":
        log_once(("unrepairable", key), logging.WARNING, "%s", msg)


def reset_guard() -> None:
    """Forget every decision (tests; or after the stack changed)."""
    with _lock:
        _fixed.clear()
        _decisions.clear()
