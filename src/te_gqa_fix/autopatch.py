"""Zero-code activation: ``TE_GQA_FIX_AUTOPATCH=1`` patches TE in every process.

People who need this fix often run someone else's training script (Megatron-LM, NeMo, a
launcher) and cannot edit it. The wheel therefore ships a start-up file,
``te_gqa_fix_autopatch.pth``, that Python runs at interpreter start (``site``), in every
process: torchrun workers, multiprocessing children, the launcher itself. Its one line
reads the variable and, when it is unset or ``0``/``off``, does nothing else (it imports
nothing, not even this package). When it is set it puts an import hook on
``sys.meta_path`` that calls :func:`te_gqa_fix.install` right after
``transformer_engine.pytorch`` finishes importing; TE's own modules then call the fixed
``fused_attn_bwd``.

Values of ``TE_GQA_FIX_AUTOPATCH``:

* unset, ``0``, ``off``, ``false``, ``no``: off;
* ``1`` (or ``on``, ``yes``, ...): on; a failure to patch is logged as a warning on the
  ``te_gqa_fix`` logger and the program runs on without the fix;
* ``strict``: on, and a failure to patch makes ``import transformer_engine.pytorch``
  raise, so a job never silently trains without the fix.

The hook needs the ``site`` machinery (it is skipped by ``python -S`` / ``-I`` and by
embedded interpreters that do not process ``.pth`` files); there, call
:func:`te_gqa_fix.install` or :func:`enable` yourself. The hook itself lives in the
top-level module ``_te_gqa_fix_autopatch`` (standard library only, so that the start-up
file never imports torch); this module is its documented face.
"""

from __future__ import annotations

import os
import site
import sys
from typing import Any, Dict, List, Optional

from _te_gqa_fix_autopatch import (
    ENV_AUTOPATCH,
    PTH_NAME,
    TARGET,
    autopatch_mode,
    disable,
    enable,
    is_enabled,
)
from _te_gqa_fix_autopatch import state as _hook_state

__all__ = [
    "ENV_AUTOPATCH",
    "PTH_NAME",
    "TARGET",
    "autopatch_mode",
    "disable",
    "enable",
    "find_pth",
    "is_enabled",
    "status",
]


def _site_dirs() -> List[str]:
    dirs: List[str] = []
    try:
        dirs.extend(site.getsitepackages())
    except Exception:  # some embedded/virtualenv builds lack it
        pass
    try:
        user = site.getusersitepackages()
        if isinstance(user, str):
            dirs.append(user)
    except Exception:
        pass
    for entry in sys.path:
        if entry and entry.rstrip("/").endswith(("site-packages", "dist-packages")):
            dirs.append(entry)
    seen, unique = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            unique.append(d)
    return unique


def find_pth() -> Optional[str]:
    """Path of the installed start-up file, or None when it is in no site directory
    (running from a source tree through ``PYTHONPATH``, or an install that predates it)."""
    for d in _site_dirs():
        path = os.path.join(d, PTH_NAME)
        if os.path.isfile(path):
            return path
    return None


def status() -> Dict[str, Any]:
    """Where start-up activation stands in this process (for ``te-gqa-fix doctor``).

    Keys: ``env`` (the raw value or None), ``mode`` (off/on/strict), ``hook_enabled``,
    ``pth`` (path or None), ``fired`` (the hook installed the fix), ``sites``, ``error``
    (the last failure, if any), ``activated_by``.
    """
    out: Dict[str, Any] = {
        "env": os.environ.get(ENV_AUTOPATCH),
        "mode": autopatch_mode(),
        "hook_enabled": is_enabled(),
        "pth": find_pth(),
    }
    out.update(_hook_state())
    return out
