"""te-gqa-fix's start-up hook: load a cuDNN measured right before torch, and patch
Transformer Engine as soon as it is imported, in every process (torchrun and each worker).

Python runs :func:`activate` at start-up from ``te_gqa_fix_autopatch.pth`` (an ``import``
line, for Pythons before 3.18) or from ``te_gqa_fix_autopatch.start`` (a PEP 829 entry
point, Python 3.15 and later; where both exist Python runs only the entry point). Either
way it runs once per process, and does nothing unless ``TE_GQA_FIX_AUTOPATCH`` or
``TE_GQA_FIX_CUDNN`` is on.

At import it uses the standard library alone, and lives outside the package: should
te-gqa-fix itself fail to import (a shadowing ``te_gqa_fix`` folder, a broken install), a
``strict`` setting still stops Transformer Engine's import with the reason (the ``.pth``
line does the same should this module itself be missing or fail). te-gqa-fix's
standard-library modules (settings, the cuDNN route) come in :func:`activate`; torch and
the fix proper only once ``transformer_engine.pytorch`` is imported. Where neither file is processed
(``python -S``), call :func:`te_gqa_fix.install` or :func:`enable`.
"""

from __future__ import annotations

import os
import sys

ENV_AUTOPATCH = "TE_GQA_FIX_AUTOPATCH"
ENV_CUDNN = "TE_GQA_FIX_CUDNN"
TARGET = "transformer_engine.pytorch"
PTH_NAME = "te_gqa_fix_autopatch.pth"
START_NAME = "te_gqa_fix_autopatch.start"
#: The off spellings of every setting (``te_gqa_fix.settings``; the ``.pth`` line repeats
#: them to decide without importing anything, and a test holds the three together).
OFF = ("", "0", "off", "false", "no", "disable", "disabled")

_MARKER = "__te_gqa_fix_import_hook__"
_CUDNN_MARKER = _MARKER + "cudnn"
_REFUSE_MARKER = _MARKER + "refuse"

#: What the hook did, for ``doctor``, ``te_gqa_fix.status()`` and tests (plain values).
_state: dict = dict(
    activated=False, fired=False, sites=None, error=None, activated_by=None, cudnn_route=False
)


def _log():
    import logging

    return logging.getLogger("te_gqa_fix")


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _setting(name: str) -> str:
    """The parsed value of ``name``; an unknown value is logged at ERROR and reads "off":
    a typo must neither pick a behaviour nor break a program that never uses TE."""
    from te_gqa_fix.settings import SettingError, get

    try:
        return get(name)
    except SettingError as exc:
        _log().error("%s; the start-up hook ignores it (off)", exc)
        return "off"


class RefuseImport:
    """``sys.meta_path`` finder that makes the import of ``names`` fail with ``reason``:
    what a ``strict`` setting does when the hook cannot do its work."""

    def __init__(self, names: tuple, reason: str) -> None:
        self.names = names
        self.reason = reason
        setattr(self, _REFUSE_MARKER, True)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            raise ImportError(self.reason)
        return None


def refuse(names: tuple, reason: str) -> None:
    """Make every later import of ``names`` raise ImportError(``reason``)."""
    sys.meta_path.insert(0, RefuseImport(names, reason))


def _fire(strict: bool) -> None:
    """Install the fix now (TE is imported); log a failure, or raise it when ``strict``.
    Either way the message names what asked for the fix: the variable as set, or
    :func:`enable` called from Python."""
    try:
        import te_gqa_fix

        sites = te_gqa_fix.install()
    except Exception as exc:
        _state["error"] = f"{type(exc).__name__}: {exc}"
        failed = f"the fix could not be installed after importing {TARGET} ({_state['error']})"
        asked = _state["activated_by"] or f"enable(strict={strict})"
        if strict:
            raise ImportError(f"{asked}: {failed}") from exc
        _log().warning(
            f"{asked}: {failed}; the program continues WITHOUT the fix (set "
            f"{ENV_AUTOPATCH}=strict to make this an error)",
            exc_info=True,
        )
        return
    _state.update(fired=True, sites=list(sites), error=None)


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
                from te_gqa_fix.cudnn_route import verify_te_cudnn

                verify_te_cudnn()  # logs a mismatch; raises ImportError when strict
            if self.patch:
                _fire(self.strict)

        try:  # an instance attribute keeps the loader's type (isinstance checks, resources)
            real_exec = loader.exec_module
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # no exec_module, or no instance attributes
            _log().warning(
                f"cannot hook the loader of {TARGET} ({loader!r}); {ENV_AUTOPATCH} cannot "
                "patch it, call te_gqa_fix.install() after importing it"
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
    from te_gqa_fix.cudnn_route import parse_setting, route
    from te_gqa_fix.errors import SetupError
    from te_gqa_fix.settings import shown

    given = f"{ENV_CUDNN}={shown(_raw(ENV_CUDNN))}"
    target, strict = parse_setting(setting)  # never off: activate installs no hook then
    try:
        route(target, strict, None, given)  # type: ignore[arg-type]
    except Exception as exc:
        if strict:  # the route's messages mostly name the setting first already
            said = str(exc)
            raise SetupError(said if said.startswith(given) else f"{given}: {said}") from exc
        _log().warning(
            f"{given} failed ({type(exc).__name__}: {exc}); Transformer Engine keeps the "
            "cuDNN it finds"
        )
    _remove(_CUDNN_MARKER)


def _strict_given() -> tuple:
    """The settings whose raw value asks for strict (``strict`` or ``strict:FOLDER``)."""
    return tuple(n for n in (ENV_AUTOPATCH, ENV_CUDNN) if _raw(n).lower().startswith("strict"))


def activate() -> None:
    """The start-up entry point: act on ``TE_GQA_FIX_CUDNN`` and ``TE_GQA_FIX_AUTOPATCH``,
    once per process. Raises only when a variable says ``strict`` and torch or TE is
    imported already (a start-up file never sees that)."""
    if _state["activated"]:
        return
    _state["activated"] = True
    if all(_raw(n).lower() in OFF for n in (ENV_AUTOPATCH, ENV_CUDNN)):
        return
    try:
        cudnn = _setting(ENV_CUDNN)
        mode = _setting(ENV_AUTOPATCH)
    except Exception as exc:  # te_gqa_fix shadowed or broken: it cannot do its work
        strict = _strict_given()
        what = " and ".join(f"{n}={_raw(n)}" for n in strict) or ENV_AUTOPATCH
        reason = (
            f"te-gqa-fix's start-up hook could not import te_gqa_fix ({type(exc).__name__}: {exc})"
        )
        _state["error"] = reason
        if strict:
            refuse((TARGET,), f"{what}: {reason}; Transformer Engine is not imported without it")
        sys.stderr.write(
            f"te_gqa_fix: {reason}; "
            + (
                "importing Transformer Engine will fail (strict)\n"
                if strict
                else "Transformer Engine runs WITHOUT the fix\n"
            )
        )
        return
    route = cudnn != "off"
    if route:
        _state["cudnn_route"] = True
        if not _hooks(_CUDNN_MARKER):
            sys.meta_path.insert(0, CudnnPreloadHook(cudnn))
    if mode != "off":
        _state["activated_by"] = f"{ENV_AUTOPATCH}={_raw(ENV_AUTOPATCH)}"
        enable(strict=mode == "strict")
    elif route:
        enable(patch=False)
    if route and any(name in sys.modules for name in CudnnPreloadHook.TRIGGERS):
        preload_cudnn(cudnn)  # torch came first (another start-up file?): report the refusal


def state() -> dict:
    """A copy of what the hook did (``fired``, ``sites``, ``error``, ``activated_by``...)."""
    return dict(_state)


def find_pth() -> str | None:
    """Path of the installed start-up file; None when no site folder holds it."""
    import site

    try:
        dirs = [*site.getsitepackages(), site.getusersitepackages()]
    except Exception:  # some embedded and virtualenv builds lack these
        dirs = []
    dirs += [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    paths = (os.path.join(d, PTH_NAME) for d in dirs if isinstance(d, str))
    return next((p for p in paths if os.path.isfile(p)), None)
