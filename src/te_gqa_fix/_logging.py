"""One logger for the package, and log-once helpers.

The wrapper sits in the hot path of every attention backward; anything it wants to
say about a call it does not understand must be said once, not once per step.
"""

from __future__ import annotations

import logging
import threading
from typing import Hashable

logger = logging.getLogger("te_gqa_fix")

_seen: set[Hashable] = set()
_seen_lock = threading.Lock()


def log_once(key: Hashable, level: int, msg: str, *args: object) -> bool:
    """Log ``msg`` at ``level`` the first time ``key`` is seen; return whether it logged."""
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.log(level, msg, *args)
    return True


def _reset_log_once() -> None:
    """Forget what was logged (tests only)."""
    with _seen_lock:
        _seen.clear()
