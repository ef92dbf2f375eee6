"""Reroute every TE call site of ``fused_attn_bwd`` through the wrapper.

TE's consumers import the function by name (``from ..cpp_extensions import
fused_attn_bwd`` in ``backends.py`` and ``context_parallel.py``), so rebinding the
defining module alone would miss them. :func:`install` therefore rebinds every loaded
module attribute that *is* the original, found by identity in ``sys.modules`` (no
hard-coded list: a framework's own module that imported it is covered too). Modules
imported later pick up the wrapper from the rebound defining module.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from types import ModuleType
from typing import Callable, Iterator, List, Optional, Tuple

from ._logging import log_once, logger
from ._marker import is_wrapper
from .te_compat import SYMBOL, find_original, import_fused_attn_module
from .wrapper import wrapper_for

__all__ = ["install", "is_installed", "patched", "uninstall"]

_lock = threading.RLock()
# (module, attribute) -> what it held before we rebound it
_sites: List[Tuple[ModuleType, str]] = []
_original: Optional[Callable] = None
_wrapper: Optional[Callable] = None


def _module_items(mod: ModuleType):
    try:
        return list(vars(mod).items())
    except TypeError:  # modules without a __dict__ (rare C shims)
        return []


_OWN_PACKAGE = __name__.rpartition(".")[0]


def _holders(target: Callable) -> Iterator[Tuple[ModuleType, str]]:
    """Every (module, attribute) that holds ``target``, except our own bookkeeping
    (``_original``/``_wrapper`` here are references, not call sites)."""
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, ModuleType):
            continue
        if name == _OWN_PACKAGE or name.startswith(_OWN_PACKAGE + "."):
            continue
        for attr, value in _module_items(mod):
            if value is target:
                yield mod, attr


def install() -> List[str]:
    """Patch TE; return the ``module.attribute`` sites rebound by this call.

    Imports ``transformer_engine.pytorch`` (so its consumers are loaded), then rebinds
    the original in every module that holds it. Calling it again only picks up sites
    loaded since; it never wraps a wrapper. Raises ImportError when TE or the symbol is
    missing.
    """
    global _original, _wrapper
    with _lock:
        module = import_fused_attn_module()
        original = find_original(module)
        if _original is not None and original is not _original:
            # TE was reloaded under us: restore what we know, start over.
            uninstall()
        wrapper = wrapper_for(original)
        rebound: List[str] = []
        for mod, attr in _holders(original):
            setattr(mod, attr, wrapper)
            _sites.append((mod, attr))
            site = f"{mod.__name__}.{attr}"
            rebound.append(site)
            log_once(("site", site), 20, "te_gqa_fix: patched %s", site)
        if not is_wrapper(getattr(module, SYMBOL)):
            raise RuntimeError(f"te_gqa_fix: failed to patch {module.__name__}.{SYMBOL}")
        _original, _wrapper = original, wrapper
        return rebound


def uninstall() -> List[str]:
    """Restore exactly the originals at every site we patched (and any module that
    copied the wrapper since). Returns the sites restored; a no-op when not installed."""
    global _original, _wrapper
    with _lock:
        if _original is None or _wrapper is None:
            return []
        original, wrapper = _original, _wrapper  # locals: the loop must not see rebinding
        restored: List[str] = []
        seen = set()
        for mod, attr in list(_sites) + list(_holders(wrapper)):
            key = (id(mod), attr)
            if key in seen:
                continue
            seen.add(key)
            if getattr(mod, attr, None) is wrapper:
                setattr(mod, attr, original)
                restored.append(f"{mod.__name__}.{attr}")
        _sites.clear()
        logger.info("te_gqa_fix: uninstalled from %d sites", len(restored))
        _original, _wrapper = None, None
        return restored


def is_installed() -> bool:
    """True when TE's defining module currently holds our wrapper (no TE import)."""
    mod = sys.modules.get("transformer_engine.pytorch.cpp_extensions.fused_attn")
    return mod is not None and is_wrapper(getattr(mod, SYMBOL, None))


@contextlib.contextmanager
def patched() -> Iterator[List[str]]:
    """``with te_gqa_fix.patched():`` installs for the block; uninstalls on exit only
    if it was not installed before (nesting and a prior ``install()`` are respected)."""
    was_installed = is_installed()
    sites = install()
    try:
        yield sites
    finally:
        if not was_installed:
            uninstall()
