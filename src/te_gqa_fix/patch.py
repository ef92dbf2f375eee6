"""Find Transformer Engine's ``fused_attn_bwd`` and reroute every call site to the wrapper.

TE's consumers import the function by name, so :func:`install` rebinds every loaded module
attribute that *is* the original (found by identity in ``sys.modules``); modules imported
later get the wrapper from the rebound defining module. TE is imported only when needed.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Iterator, List, Optional, Tuple

from ._logging import log_once, logger
from .stack import get_te_version
from .wrapper import is_wrapper, unwrap, wrapper_for

__all__ = [
    "find_original",
    "fused_attn_bwd",
    "get_te_version",
    "install",
    "is_installed",
    "patched",
    "uninstall",
]

FUSED_ATTN_MODULE = "transformer_engine.pytorch.cpp_extensions.fused_attn"
SYMBOL = "fused_attn_bwd"

INSTALL_HINT = (
    "te-gqa-fix needs NVIDIA Transformer Engine with its PyTorch extension for this: "
    "pip install 'transformer-engine[pytorch]>=2.8' (or use an NGC PyTorch container, which "
    "ships it); `import te_gqa_fix` itself works without it"
)


def import_fused_attn_module() -> ModuleType:
    """Import ``transformer_engine.pytorch`` and return the module defining fused_attn_bwd."""
    try:
        importlib.import_module("transformer_engine.pytorch")
        return importlib.import_module(FUSED_ATTN_MODULE)
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc


def find_original(module: Optional[ModuleType] = None) -> Callable:
    """TE's own ``fused_attn_bwd`` (unwrapped if our wrapper is installed there)."""
    module = import_fused_attn_module() if module is None else module
    fn = getattr(module, SYMBOL, None)
    if fn is None:
        raise ImportError(
            f"{module.__name__} has no attribute {SYMBOL!r}: this Transformer Engine "
            f"({get_te_version()}) is not one te-gqa-fix supports (2.8 to 2.20)"
        )
    return unwrap(fn)


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


def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for TE's ``fused_attn_bwd`` (TE 2.8 to 2.20, positional or keyword).

    Calls the installed TE's function through the wrapper and returns what it returns,
    with every row whose true gradient is 0 zeroed in place; no host sync.

    Raises:
        ImportError: Transformer Engine is missing (the message says how to install it).
    """
    return wrapper_for(find_original())(*args, **kwargs)
