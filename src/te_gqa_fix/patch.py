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
from types import FunctionType, ModuleType
from typing import Any, Callable, Iterator, List, Optional, Tuple

from ._logging import log_once, logger
from .stack.versions import get_te_version
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
# (module, attribute) sites we rebound, each holding _wrapper; uninstall gives them _original
_sites: List[Tuple[ModuleType, str]] = []
_original: Optional[Callable] = None
_wrapper: Optional[Callable] = None
# True once install() was called explicitly: a patched() block then leaves the patch on.
_lasting = False


def _module_items(mod: ModuleType):
    try:
        return list(vars(mod).items())
    except TypeError:  # modules without a __dict__ (rare C shims)
        return []


_OWN_PACKAGE = __name__.rpartition(".")[0]


def _holders(target: Callable) -> Iterator[Tuple[ModuleType, str]]:
    """Every (module, attribute) that holds ``target``, except our own bookkeeping
    (``_original``/``_wrapper`` here are references, not call sites)."""
    return _holders_of(lambda value: value is target)


def _holders_of(match: Callable[[Any], bool]) -> Iterator[Tuple[ModuleType, str]]:
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, ModuleType):
            continue
        if name == _OWN_PACKAGE or name.startswith(_OWN_PACKAGE + "."):
            continue
        for attr, value in _module_items(mod):
            if match(value):
                yield mod, attr


def _earlier_definition(value: Any, original: Callable) -> bool:
    """Whether ``value`` is, or is our wrapper of, a function an earlier run of the defining
    module's code made (``importlib.reload`` makes a new one; importers keep the old)."""
    if type(value) is not FunctionType:  # never run an arbitrary object's __getattr__
        return False
    fn = unwrap(value) if is_wrapper(value) else value
    if fn is original or type(fn) is not FunctionType:
        return False
    code, now = getattr(fn, "__code__", None), getattr(original, "__code__", None)
    return (
        code is not None
        and now is not None
        and getattr(fn, "__module__", None) == getattr(original, "__module__", None)
        and getattr(fn, "__qualname__", None) == getattr(original, "__qualname__", None)
        and code.co_filename == now.co_filename
    )


def _install() -> List[str]:
    global _original, _wrapper
    with _lock:
        module = import_fused_attn_module()
        original = find_original(module)
        wrapper = wrapper_for(original)
        reloaded = _original is not None and original is not _original
        old = (_original, _wrapper)

        def stale(value: Any) -> bool:
            # What a call site holds when the module was reloaded (before or since install).
            if value is wrapper:
                return False
            return (
                value is original
                or any(value is x for x in old if x is not None)
                or _earlier_definition(value, original)
            )

        if reloaded:
            _sites.clear()  # every site is found again below; uninstall restores `original`
        rebound: List[str] = []
        for mod, attr in list(_holders_of(stale)):
            setattr(mod, attr, wrapper)
            _sites.append((mod, attr))
            site = f"{mod.__name__}.{attr}"
            rebound.append(site)
            log_once(("site", site, id(original)), 20, "te_gqa_fix: patched %s", site)
        if getattr(module, SYMBOL) is not wrapper:
            raise RuntimeError(f"te_gqa_fix: failed to patch {module.__name__}.{SYMBOL}")
        _original, _wrapper = original, wrapper
        return rebound


def install() -> List[str]:
    """Patch TE; return the ``module.attribute`` sites rebound by this call.

    Imports ``transformer_engine.pytorch`` (so its consumers are loaded), then rebinds
    the original in every module that holds it. Calling it again only picks up sites
    loaded since; it never wraps a wrapper. After ``importlib.reload`` of TE's module,
    sites still holding the earlier function (or our wrapper of it) are rebound to the
    wrapper of the new one. The patch lasts: a ``patched()`` block that this call runs
    inside leaves it installed on exit.

    Raises:
        ImportError: TE or the symbol is missing.
    """
    global _lasting
    with _lock:
        rebound = _install()
        _lasting = True
        return rebound


def uninstall() -> List[str]:
    """Restore TE's function at every site we patched (and any module that copied the
    wrapper since): exactly what each held, or after a reload the current definition.
    Returns the sites restored; a no-op when not installed."""
    global _original, _wrapper, _lasting
    with _lock:
        _lasting = False
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
    """True when TE's defining module holds our wrapper of the function it defines now:
    the one :func:`install` wrapped, not one from before an ``importlib.reload`` (no TE
    import)."""
    mod = sys.modules.get(FUSED_ATTN_MODULE)
    fn = getattr(mod, SYMBOL, None) if mod is not None else None
    if not is_wrapper(fn):
        return False
    with _lock:
        return _original is None or unwrap(fn) is _original


@contextlib.contextmanager
def patched() -> Iterator[List[str]]:
    """``with te_gqa_fix.patched():`` installs for the block; uninstalls on exit only if it
    was not installed before and no :func:`install` inside the block asked for a lasting
    patch (nesting and a prior or inner ``install()`` are respected)."""
    with _lock:
        was_installed = is_installed()
        sites = _install()
    try:
        yield sites
    finally:
        with _lock:
            if not was_installed and not _lasting:
                uninstall()


def fused_attn_bwd(*args: Any, **kwargs: Any) -> Any:
    """Drop-in for TE's ``fused_attn_bwd`` (TE 2.8 to 2.20, positional or keyword).

    Calls the installed TE's function through the wrapper and returns what it returns,
    with every row whose true gradient is 0 zeroed in place; no host sync.

    Raises:
        ImportError: Transformer Engine is missing (the message says how to install it).
    """
    return wrapper_for(find_original())(*args, **kwargs)
