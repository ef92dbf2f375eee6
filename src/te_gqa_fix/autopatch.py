"""Zero-code activation: ``TE_GQA_FIX_AUTOPATCH=1`` (or ``strict``) patches TE in every process.

The wheel's ``te_gqa_fix_autopatch.pth`` runs the stdlib hook ``_te_gqa_fix_autopatch`` at
start-up; where ``.pth`` files are not processed (``python -S``) call :func:`enable`.
"""

from __future__ import annotations

import os
import site
import sys
from typing import Any, Dict, Optional

from _te_gqa_fix_autopatch import PTH_NAME, disable, enable, is_enabled, state

__all__ = ["PTH_NAME", "disable", "enable", "find_pth", "is_enabled", "status"]


def find_pth() -> Optional[str]:
    """Path of the installed start-up file; None when no site folder holds it."""
    try:
        dirs = [*site.getsitepackages(), site.getusersitepackages()]
    except Exception:  # some embedded and virtualenv builds lack these
        dirs = []
    dirs += [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    paths = (os.path.join(d, PTH_NAME) for d in dirs if isinstance(d, str))
    return next((p for p in paths if os.path.isfile(p)), None)


def status() -> Dict[str, Any]:
    """Where start-up activation stands in this process (for ``te-gqa-fix doctor``).

    Returns:
        ``hook_enabled``, ``pth`` (path or None), and the hook's :func:`state`.
    """
    return {"hook_enabled": is_enabled(), "pth": find_pth(), **state()}
