"""How te-gqa-fix tells its own wrapper from anyone else's function.

A leaf module (it imports nothing from the package), so that ``te_compat`` can peel our
wrapper off TE's function without importing ``wrapper``, which imports ``te_compat``.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["MARKER", "is_wrapper", "unwrap"]

MARKER = "__te_gqa_fix_wrapper__"


def is_wrapper(fn: object) -> bool:
    return bool(getattr(fn, MARKER, False))


def unwrap(fn: Callable) -> Callable:
    """Peel off our wrappers (never anyone else's)."""
    while is_wrapper(fn):
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn
