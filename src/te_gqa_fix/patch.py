"""Reroute every call site of Transformer Engine's ``fused_attn_bwd`` to the wrapper.

TE's callers import the function by name, so :func:`install` rebinds every loaded module
attribute that holds it, found by identity in ``sys.modules``; modules imported later get
the wrapper from the rebound defining module. Another library may have wrapped TE's
function with ``functools.wraps`` (a profiler, an NVTX shim) after TE's callers imported
it: :func:`install` follows ``__wrapped__`` from the defining module's attribute down to
TE's own function, and rebinds every site holding any link of that chain that does not
already reach the wrapper. It then checks that DotProductAttention's and the
context-parallel call sites reach it; where it cannot be sure, it says so
(:func:`is_installed` is False, and a WARNING).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from types import FunctionType, ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from . import _te
from ._logging import log_once, logger
from ._te import CALL_SITES, FUSED_ATTN_MODULE, SYMBOL, missing_symbol
from .errors import SetupError
from .wrapper import chain, is_wrapper, wrapper_for

__all__ = [
    "install",
    "installed_sites",
    "is_installed",
    "patched",
    "uninstall",
    "unreached_call_sites",
]

_lock = threading.RLock()
#: (module, attribute) -> what it held before install() rebound it to a wrapper.
_sites: Dict[Tuple[int, str], Tuple[ModuleType, str, Any, Callable]] = {}
#: TE's own function (the end of the chain) at the last install.
_te_function: Optional[Callable] = None
#: True once install() was called explicitly: a patched() block then leaves the patch on.
_lasting = False

_OWN_PACKAGE = __name__.rpartition(".")[0]
_NONE = object()  # matches no module attribute


def _reaches_wrapper(fn: object) -> bool:
    """Whether calling ``fn`` runs a te-gqa-fix wrapper (ours is in its chain)."""
    return any(is_wrapper(x) for x in chain(fn))


def _module_items(mod: ModuleType) -> List[Tuple[str, Any]]:
    try:
        return list(vars(mod).items())
    except TypeError:  # modules without a __dict__ (rare C shims)
        return []


def _holders(match: Callable[[Any], bool]) -> Iterator[Tuple[ModuleType, str, Any]]:
    """Every (module, attribute, value) whose value matches, outside this package; a module
    listed under two names (``__main__`` and ``__mp_main__``) once."""
    seen = set()
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, ModuleType) or id(mod) in seen:
            continue
        seen.add(id(mod))
        if name == _OWN_PACKAGE or name.startswith(_OWN_PACKAGE + "."):
            continue
        for attr, value in _module_items(mod):
            if match(value):
                yield mod, attr, value


def _earlier_definition(value: Any, te_function: Callable) -> bool:
    """Whether ``value`` is a function an earlier run of the defining module's code made
    (``importlib.reload`` makes a new one; importers keep the old), or a wrapper of one."""
    if type(value) is not FunctionType:  # never run an arbitrary object's __getattr__
        return False
    fn = chain(value)[-1]
    if type(fn) is not FunctionType or fn is te_function:
        return False
    code, now = getattr(fn, "__code__", None), getattr(te_function, "__code__", None)
    return (
        code is not None
        and now is not None
        and getattr(fn, "__module__", None) == getattr(te_function, "__module__", None)
        and getattr(fn, "__qualname__", None) == getattr(te_function, "__qualname__", None)
        and code.co_filename == now.co_filename
    )


def unreached_call_sites() -> List[str]:
    """TE's own call sites (:data:`te_gqa_fix._te.CALL_SITES`) that do not call the wrapper:
    loaded but holding something whose chain has no te-gqa-fix wrapper, or not loaded at
    all although TE is (then te-gqa-fix cannot tell what TE calls)."""
    if _te.TE_PYTORCH not in sys.modules:
        return []
    out = []
    for name in CALL_SITES:
        mod = sys.modules.get(name)
        if mod is None or not _reaches_wrapper(getattr(mod, SYMBOL, None)):
            out.append(f"{name}.{SYMBOL}")
    return out


def _install() -> List[str]:
    global _te_function
    module = _te.fused_attn_module()
    held = getattr(module, SYMBOL, None)
    if held is None:
        raise missing_symbol(module)
    links = chain(held)
    te_function = links[-1]
    if is_wrapper(te_function):  # a wrapper of nothing readable: not ours to follow
        raise SetupError(f"{FUSED_ATTN_MODULE}.{SYMBOL} wraps nothing te-gqa-fix can read")
    if _te_function is not None and te_function is not _te_function:
        _sites.clear()  # TE's module was reloaded: every site is found again below
    # A link is reached when the wrapper lies at or below it in the chain.
    unreached = {id(x): x for i, x in enumerate(links) if not any(map(is_wrapper, links[i:]))}

    def stale(value: Any) -> bool:
        return id(value) in unreached or _earlier_definition(value, te_function)

    rebound: List[str] = []
    for mod, attr, value in list(_holders(stale)):
        restore = value if id(value) in unreached else te_function
        new = wrapper_for(restore)
        setattr(mod, attr, new)
        _sites[(id(mod), attr)] = (mod, attr, restore, new)
        rebound.append(f"{mod.__name__}.{attr}")
    if not _reaches_wrapper(getattr(module, SYMBOL)):
        raise SetupError(f"failed to patch {FUSED_ATTN_MODULE}.{SYMBOL}")
    _te_function = te_function
    if rebound:
        logger.info("installed: %d call sites of %s rebound", len(rebound), SYMBOL)
    missing = unreached_call_sites()
    if missing:
        log_once(
            ("unreached", tuple(missing)),
            logging.WARNING,
            "installed, but these call sites of Transformer Engine do not call te-gqa-fix's "
            "wrapper: %s (something replaced the function there with an object that does not "
            "name what it wraps in __wrapped__, or TE moved its call sites); their gradients "
            "are not repaired. is_installed() says False until they do",
            ", ".join(missing),
        )
    _te.warn_if_unvalidated()
    return rebound


def install() -> List[str]:
    """Patch TE; return the ``module.attribute`` sites rebound by this call.

    Imports ``transformer_engine.pytorch`` (so its callers are loaded), then rebinds every
    site that holds TE's function, or another library's ``functools.wraps`` wrapper of it,
    without reaching te-gqa-fix's wrapper. Calling it again only picks up sites loaded
    since; it never wraps a wrapper twice. After ``importlib.reload`` of TE's module, sites
    still holding the earlier function (or a wrapper of it) get the wrapper of the new
    one. The patch lasts: a ``patched()`` block that this call runs inside leaves it
    installed on exit.

    Returns:
        The sites rebound (``module.attribute``).

    Raises:
        SetupError: TE or the function is missing (an ImportError).
    """
    global _lasting
    with _lock:
        rebound = _install()
        _lasting = True
        return rebound


def uninstall() -> List[str]:
    """Give every site :func:`install` rebound what it held before (after a reload, TE's
    current function), where it still holds the wrapper; a module imported since that took
    a wrapper from a rebound module gets what that module held. A no-op when not installed.

    Returns:
        The sites restored.
    """
    global _te_function, _lasting
    with _lock:
        _lasting = False
        restored: List[str] = []
        held: Dict[int, Tuple[Callable, Any]] = {}  # id(wrapper) -> (wrapper, what it replaced)
        for mod, attr, before, new in _sites.values():
            held[id(new)] = (new, before)
            if getattr(mod, attr, None) is new:
                setattr(mod, attr, before)
                restored.append(f"{mod.__name__}.{attr}")
        # A module imported since took a wrapper from a rebound module: it goes back too.
        for mod, attr, value in list(_holders(lambda v: held.get(id(v), (_NONE,))[0] is v)):
            setattr(mod, attr, held[id(value)][1])
            restored.append(f"{mod.__name__}.{attr}")
        _sites.clear()
        _te_function = None
        if restored:
            logger.info("uninstalled from %d call sites", len(restored))
        return restored


def is_installed() -> bool:
    """True when TE's defining module calls the wrapper of the function it defines now
    (not one from before an ``importlib.reload``) and so do DotProductAttention's and the
    context-parallel call sites (no TE import).

    Returns:
        Whether every call of TE's backward gets the fix.
    """
    mod = sys.modules.get(FUSED_ATTN_MODULE)
    held = getattr(mod, SYMBOL, None) if mod is not None else None
    links = chain(held)
    if not any(map(is_wrapper, links)):
        return False
    with _lock:
        if _te_function is not None and links[-1] is not _te_function:
            return False
    return not unreached_call_sites()


def installed_sites() -> List[str]:
    """The ``module.attribute`` sites :func:`install` rebound that still hold the wrapper."""
    with _lock:
        return [
            f"{m.__name__}.{a}" for m, a, _, new in _sites.values() if getattr(m, a, None) is new
        ]


@contextlib.contextmanager
def patched() -> Iterator[List[str]]:
    """``with te_gqa_fix.patched():`` installs for the block; uninstalls on exit only if it
    was not installed before and no :func:`install` inside the block asked for a lasting
    patch (nesting and a prior or inner ``install()`` are respected).

    Returns:
        A context manager yielding the sites rebound on entry.
    """
    with _lock:
        was_installed = bool(_sites)
        sites = _install()
    try:
        yield sites
    finally:
        with _lock:
            if not was_installed and not _lasting:
                uninstall()
