"""Start-up hook: load a fixed cuDNN before torch, and patch TE as soon as it is imported.

Runs from ``te_gqa_fix_autopatch.pth`` in every process where a setting is on, so it uses
the standard library and te-gqa-fix's stdlib-only modules (its logger, settings, cudnn):
torch and the fix proper come only once ``transformer_engine.pytorch`` is imported.
Public face: :mod:`te_gqa_fix.autopatch`.
"""

from __future__ import annotations

import os
import sys

from te_gqa_fix._logging import logger as _log

ENV_AUTOPATCH = "TE_GQA_FIX_AUTOPATCH"
ENV_CUDNN = "TE_GQA_FIX_CUDNN"
TARGET = "transformer_engine.pytorch"
PTH_NAME = "te_gqa_fix_autopatch.pth"

_MARKER = "__te_gqa_fix_import_hook__"
_CUDNN_MARKER = _MARKER + "cudnn"

#: What the hook did, for ``doctor`` and tests (plain values, no objects kept alive).
_state: dict = dict(fired=False, sites=None, error=None, activated_by=None, cudnn_route=False)


def _setting(name: str) -> str:
    """The parsed value of ``name``; an unknown value is logged at ERROR and reads "off":
    a typo must neither pick a behaviour nor break a program that never uses TE."""
    from te_gqa_fix.settings import SettingError, get

    try:
        return get(name)
    except SettingError as exc:
        _log.error("te_gqa_fix: %s; the start-up hook ignores it (off)", exc)
        return "off"


def _fire(strict: bool) -> None:
    """Install the fix now (TE is imported); log a failure, or raise it when ``strict``."""
    try:
        import te_gqa_fix

        sites = te_gqa_fix.install()
    except Exception as exc:
        _state["error"] = f"{type(exc).__name__}: {exc}"
        failed = f"the fix could not be installed after importing {TARGET} ({_state['error']})"
        if strict:
            raise ImportError(f"te_gqa_fix: {ENV_AUTOPATCH}=strict and {failed}") from exc
        _log.warning(
            f"te_gqa_fix: {ENV_AUTOPATCH} is set but {failed}; the program continues WITHOUT "
            f"the fix (set {ENV_AUTOPATCH}=strict to make this an error)",
            exc_info=True,
        )
        return
    _state.update(fired=True, sites=list(sites), error=None)
    _log.info(
        f"te_gqa_fix: installed by {ENV_AUTOPATCH} after {TARGET} was imported "
        f"({len(sites)} sites rebound)"
    )


class TEImportHook:
    """``sys.meta_path`` finder that, once ``transformer_engine.pytorch`` has executed, checks
    the cuDNN route and installs the fix. It never provides a module: it wraps the loader of
    the spec the finders behind it return."""

    def __init__(self, strict: bool, patch: bool) -> None:
        self.strict = strict
        self.patch = patch
        setattr(self, _MARKER, True)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        others = [f for f in sys.meta_path if getattr(f, "find_spec", None)]
        specs = (f.find_spec(fullname, path, target) for f in others if not getattr(f, _MARKER, 0))
        spec = next(filter(None, specs), None)
        if spec is None:
            return None
        loader = spec.loader

        def exec_module(module):
            try:
                real_exec(module)
            finally:
                try:  # back to the class's method: nothing of ours stays on TE's loader
                    del loader.exec_module
                except AttributeError:
                    pass
            if _state["cudnn_route"]:
                from te_gqa_fix.stack.cudnn import verify_te_cudnn

                verify_te_cudnn()  # logs a mismatch; raises ImportError when strict
            if self.patch:
                _fire(self.strict)

        try:  # an instance attribute keeps the loader's type (isinstance checks, resources)
            real_exec = loader.exec_module
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # no exec_module, or no instance attributes
            _log.warning(
                f"te_gqa_fix: cannot hook the loader of {TARGET} ({loader!r}); "
                f"{ENV_AUTOPATCH} cannot patch it, call te_gqa_fix.install() after importing it"
            )
        return spec


def _hooks(marker: str = _MARKER) -> list:
    return [f for f in sys.meta_path if getattr(f, marker, False)]


def _remove(marker: str) -> bool:
    """Take our hooks with ``marker`` off ``sys.meta_path``; True if there were any.

    ``sys.meta_path`` is rebound to a new list, never edited in place: a hook removes itself
    from inside ``find_spec``, while importlib iterates the old list, and an in-place removal
    would make that import skip the finder behind the hook."""
    hooks = _hooks(marker)
    if hooks:
        sys.meta_path = [f for f in sys.meta_path if not getattr(f, marker, False)]
    return bool(hooks)


def is_enabled() -> bool:
    """True when the import hook is on ``sys.meta_path``."""
    return bool(_hooks())


def enable(strict: bool = False, patch: bool = True) -> bool:
    """Put the import hook in place (once); install at once if TE is already imported.

    Args:
        strict: a failure to install raises ImportError instead of a warning.
        patch: False: the hook only checks the cuDNN route.

    Returns:
        True when this call installed the fix.
    """
    hooks = _hooks()
    for hook in hooks:
        hook.strict = strict
        hook.patch = hook.patch or patch
    if not hooks:
        sys.meta_path.insert(0, TEImportHook(strict=strict, patch=patch))
    te = sys.modules.get(TARGET)
    if patch and te is not None and not getattr(te.__spec__, "_initializing", False):
        from te_gqa_fix.patch import is_installed  # TE, and so torch, is loaded already

        if not _state["fired"] or not is_installed():
            _fire(strict)
            return bool(_state["fired"])
    return False


def disable() -> bool:
    """Remove the import hook; True if one was there. Does not uninstall the fix."""
    return _remove(_MARKER)


class CudnnPreloadHook:
    """``sys.meta_path`` finder that loads the chosen cuDNN right before the first import of
    ``torch`` or ``transformer_engine``, then steps aside. It never provides a module."""

    TRIGGERS = ("torch", "transformer_engine")

    def __init__(self, setting: str) -> None:
        self.setting = setting
        setattr(self, _CUDNN_MARKER, True)

    def find_spec(self, fullname, path=None, target=None):  # returns None: no spec
        if fullname in self.TRIGGERS:
            preload_cudnn(self.setting)


def preload_cudnn(setting: str) -> None:
    """Load the cuDNN that ``setting`` (TE_GQA_FIX_CUDNN's value) names, now, and remove the
    preload hook. A strict failure raises ImportError and keeps the hook, so that every
    import of torch or TE fails with the reason; otherwise a failure is logged."""
    from te_gqa_fix.settings import shown
    from te_gqa_fix.stack.cudnn import parse_setting, use_fixed_cudnn

    target, strict = parse_setting(setting)  # never off: activate installs no hook then
    try:
        use_fixed_cudnn(target, strict=strict)
    except Exception as exc:
        if strict:
            raise ImportError(f"te_gqa_fix: {ENV_CUDNN}={shown(setting)}: {exc}") from exc
        _log.warning(
            f"te_gqa_fix: {ENV_CUDNN}={shown(setting)} failed ({type(exc).__name__}: {exc}); "
            "Transformer Engine keeps the cuDNN it finds"
        )
    _remove(_CUDNN_MARKER)


def activate() -> None:
    """Entry point of the ``.pth`` line: act on ``TE_GQA_FIX_CUDNN`` and
    ``TE_GQA_FIX_AUTOPATCH``. Raises only when a variable says ``strict`` and torch or TE is
    imported already (a start-up file never sees that)."""
    cudnn = _setting(ENV_CUDNN)
    mode = _setting(ENV_AUTOPATCH)
    route = cudnn != "off"
    if route:
        _state["cudnn_route"] = True
        if not _hooks(_CUDNN_MARKER):
            sys.meta_path.insert(0, CudnnPreloadHook(cudnn))
    if mode != "off":
        _state["activated_by"] = f"{ENV_AUTOPATCH}={os.environ.get(ENV_AUTOPATCH, '')}"
        enable(strict=mode == "strict")
    elif route:
        enable(patch=False)
    if route and any(name in sys.modules for name in CudnnPreloadHook.TRIGGERS):
        preload_cudnn(cudnn)  # torch came first (another start-up file?): report the refusal


def state() -> dict:
    """A copy of what the hook did (``fired``, ``sites``, ``error``, ``activated_by``...)."""
    return dict(_state)
