"""Start-up hook of te-gqa-fix: patch Transformer Engine as soon as it is imported.

Shipped next to ``te_gqa_fix`` as a top-level module because it runs from the
``te_gqa_fix_autopatch.pth`` start-up file, before any user code: importing the
``te_gqa_fix`` package here would import torch in every Python process (pip included)
and before later ``.pth`` files have extended ``sys.path``. So this module uses the
standard library only, and imports ``te_gqa_fix`` (and through it torch) only once
``transformer_engine.pytorch`` has finished importing, when torch is loaded anyway.

How it works: :func:`activate` (called by the ``.pth`` line when ``TE_GQA_FIX_AUTOPATCH``
is set) puts a :class:`TEImportHook` first on ``sys.meta_path``. The hook ignores every
import but ``transformer_engine.pytorch``; for that one it asks the other finders for the
real spec and wraps its loader's ``exec_module`` so that, right after TE's own
``__init__`` (which loads every consumer of ``fused_attn_bwd``) has run, it calls
``te_gqa_fix.install()``. If TE is already imported when the hook is enabled, the fix is
installed at once. A failure is logged on the ``te_gqa_fix`` logger and the program goes
on without the fix, unless ``TE_GQA_FIX_AUTOPATCH=strict``, which turns it into an
ImportError of ``transformer_engine.pytorch``.

``TE_GQA_FIX_CUDNN`` (``auto``, ``strict``, a folder, ``strict:FOLDER``; see
:mod:`te_gqa_fix.cudnn`) is read here too: a :class:`CudnnPreloadHook` on ``sys.meta_path``
loads the chosen fixed cuDNN right before the first import of ``torch`` or
``transformer_engine`` (processes that never import them pay nothing), and once
``transformer_engine.pytorch`` is imported the TE import hook checks that TE runs that build.

Public API: :mod:`te_gqa_fix.autopatch` (re-exports what users need).
"""

from __future__ import annotations

import os
import sys

ENV_AUTOPATCH = "TE_GQA_FIX_AUTOPATCH"
ENV_CUDNN = "TE_GQA_FIX_CUDNN"
TARGET = "transformer_engine.pytorch"
PTH_NAME = "te_gqa_fix_autopatch.pth"

# Kept in sync with the .pth line (a test checks it): these leave everything untouched.
OFF_VALUES = ("", "0", "off", "false", "no", "disable", "disabled")
STRICT_VALUES = ("strict",)

_MARKER = "__te_gqa_fix_import_hook__"

# What happened, for `te-gqa-fix doctor` and tests (plain values, no objects kept alive).
_state: dict = {
    "fired": False,
    "sites": None,
    "error": None,
    "activated_by": None,
    "cudnn_route": False,
}


def autopatch_mode(value: str | None = None) -> str:
    """``"off"``, ``"on"`` or ``"strict"`` for a value of ``TE_GQA_FIX_AUTOPATCH``.

    ``None`` reads the environment. Empty, ``0``, ``off``, ``false``, ``no`` mean off;
    ``strict`` means on and raise on failure; anything else (``1``, ``on``, ``yes``) on.
    """
    raw = os.environ.get(ENV_AUTOPATCH, "") if value is None else value
    raw = raw.strip().lower()
    if raw in OFF_VALUES:
        return "off"
    if raw in STRICT_VALUES:
        return "strict"
    return "on"


def _log():
    import logging

    return logging.getLogger("te_gqa_fix")


def _te_fully_imported() -> bool:
    mod = sys.modules.get(TARGET)
    if mod is None:
        return False
    spec = getattr(mod, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def _fire(strict: bool) -> None:
    """Install the fix now (TE is imported). Logs, or raises when ``strict``."""
    try:
        import te_gqa_fix

        sites = te_gqa_fix.install()
    except Exception as exc:
        _state["error"] = f"{type(exc).__name__}: {exc}"
        if strict:
            raise ImportError(
                f"te_gqa_fix: {ENV_AUTOPATCH}=strict and the fix could not be installed "
                f"after importing {TARGET}: {exc}"
            ) from exc
        _log().warning(
            "te_gqa_fix: %s is set but the fix could not be installed after importing %s "
            "(%s: %s); the program continues WITHOUT the fix (set %s=strict to make this "
            "an error)",
            ENV_AUTOPATCH,
            TARGET,
            type(exc).__name__,
            exc,
            ENV_AUTOPATCH,
            exc_info=True,
        )
        return
    _state["fired"] = True
    _state["sites"] = list(sites)
    _state["error"] = None
    _log().info(
        "te_gqa_fix: installed by %s after %s was imported (%d sites rebound)",
        ENV_AUTOPATCH,
        TARGET,
        len(sites),
    )


def _after_te_import(hook: TEImportHook) -> None:
    """Right after ``transformer_engine.pytorch`` ran: check the cuDNN route, then patch."""
    if _state["cudnn_route"]:
        from te_gqa_fix.cudnn import verify_te_cudnn

        verify_te_cudnn()  # logs a mismatch once; raises ImportError when strict
    if hook.patch:
        _fire(hook.strict)


class TEImportHook:
    """``sys.meta_path`` finder that installs the fix once ``transformer_engine.pytorch``
    has been executed. It never provides a module itself: it delegates to the finders
    behind it and only wraps the loader of the spec they return."""

    def __init__(self, strict: bool = False, patch: bool = True) -> None:
        self.strict = strict
        self.patch = patch
        setattr(self, _MARKER, True)

    def __repr__(self) -> str:
        return f"<te_gqa_fix import hook for {TARGET} strict={self.strict}>"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        for finder in list(sys.meta_path):
            if getattr(finder, _MARKER, False):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return self._wrap(spec)
        return None

    def _wrap(self, spec):
        loader = spec.loader
        real_exec = getattr(loader, "exec_module", None)
        if real_exec is None:
            _log().warning(
                "te_gqa_fix: the loader of %s (%r) has no exec_module; %s cannot patch it, "
                "call te_gqa_fix.install() after importing it",
                TARGET,
                loader,
                ENV_AUTOPATCH,
            )
            return spec
        hook = self

        def exec_module(module):
            try:
                real_exec(module)
            finally:
                # Back to the class's method: nothing of ours stays on TE's loader.
                try:
                    del loader.exec_module
                except AttributeError:
                    pass
            _after_te_import(hook)

        try:
            # An instance attribute keeps the loader's type (isinstance checks, resources).
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            spec.loader = _LoaderProxy(loader, exec_module)
        return spec


class _LoaderProxy:
    """Fallback for loaders that refuse attributes: delegate all but ``exec_module``."""

    def __init__(self, loader, exec_module) -> None:
        self._loader = loader
        self.exec_module = exec_module

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _hooks():
    return [f for f in sys.meta_path if getattr(f, _MARKER, False)]


def is_enabled() -> bool:
    """True when the import hook is on ``sys.meta_path``."""
    return bool(_hooks())


def enable(strict: bool = False, patch: bool = True) -> bool:
    """Put the import hook in place (once); install at once if TE is already imported.

    ``patch`` False puts the hook in place only for the cuDNN check (TE_GQA_FIX_CUDNN set,
    TE_GQA_FIX_AUTOPATCH off). Returns True when the fix was installed by this call.
    """
    hooks = _hooks()
    if hooks:
        for hook in hooks:
            hook.strict = strict
            hook.patch = hook.patch or patch
    else:
        sys.meta_path.insert(0, TEImportHook(strict=strict, patch=patch))
    if not patch:
        return False
    if _te_fully_imported():
        # TE (and so torch) is loaded: importing te_gqa_fix costs nothing new here.
        from te_gqa_fix.patch import is_installed

        if not _state["fired"] or not is_installed():
            _fire(strict)
            return bool(_state["fired"])
    elif TARGET in sys.modules:
        _log().info(
            "te_gqa_fix: %s is being imported right now; the hook cannot wrap it, call "
            "te_gqa_fix.install() once it is imported",
            TARGET,
        )
    return False


def disable() -> bool:
    """Remove the import hook; True if one was there. Does not uninstall the fix."""
    hooks = _hooks()
    for hook in hooks:
        sys.meta_path.remove(hook)
    return bool(hooks)


class CudnnPreloadHook:
    """``sys.meta_path`` finder that loads the chosen cuDNN right before the first import of
    ``torch`` or ``transformer_engine``, then steps aside. It never provides a module."""

    TRIGGERS = ("torch", "transformer_engine")

    def __init__(self, setting: str) -> None:
        self.setting = setting
        setattr(self, _MARKER + "cudnn", True)

    def __repr__(self) -> str:
        return f"<te_gqa_fix cuDNN preload for {ENV_CUDNN}={self.setting!r}>"

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.TRIGGERS:
            try:
                preload_cudnn(self.setting)
            except ImportError:
                # strict: stay in place, so every later import of torch or TE fails too
                raise
            _remove_cudnn_hooks()
        return None


def _remove_cudnn_hooks() -> None:
    for finder in [f for f in sys.meta_path if getattr(f, _MARKER + "cudnn", False)]:
        sys.meta_path.remove(finder)


def preload_cudnn(setting: str) -> None:
    """Load the cuDNN ``setting`` names (TE_GQA_FIX_CUDNN's value) now, per its strictness.

    Strict failures raise ImportError (from a meta-path hook: the import of torch or TE
    fails with the reason); otherwise they are logged once and the program goes on.
    """
    from te_gqa_fix.cudnn import parse_setting, use_fixed_cudnn

    target, strict = parse_setting(setting)
    if target is None:
        return
    try:
        use_fixed_cudnn(target, strict=strict)
    except Exception as exc:
        if strict:
            raise ImportError(f"te_gqa_fix: {ENV_CUDNN}={setting}: {exc}") from exc
        _log().warning(
            "te_gqa_fix: %s=%s failed (%s: %s); Transformer Engine keeps the cuDNN it finds",
            ENV_CUDNN,
            setting,
            type(exc).__name__,
            exc,
        )


def activate() -> None:
    """Entry point of the ``.pth`` line: act on ``TE_GQA_FIX_CUDNN`` and
    ``TE_GQA_FIX_AUTOPATCH``.

    Never raises unless a variable says ``strict`` (and then only when the fix cannot
    be installed on a TE that is already imported, which a start-up file never sees).
    """
    cudnn_setting = os.environ.get(ENV_CUDNN, "").strip()
    route = cudnn_setting.lower() not in OFF_VALUES
    if route:
        _state["cudnn_route"] = True
        if not any(getattr(f, _MARKER + "cudnn", False) for f in sys.meta_path):
            sys.meta_path.insert(0, CudnnPreloadHook(cudnn_setting))
    mode = autopatch_mode()
    if mode != "off":
        _state["activated_by"] = f"{ENV_AUTOPATCH}={os.environ.get(ENV_AUTOPATCH, '')}"
        enable(strict=mode == "strict")
    elif route:
        enable(patch=False)
    if route and any(name in sys.modules for name in CudnnPreloadHook.TRIGGERS):
        # torch came first (another start-up file?): try now; this reports the refusal
        # (strict: raises, after the patch hook above is already in place).
        preload_cudnn(cudnn_setting)
        _remove_cudnn_hooks()


def state() -> dict:
    """A copy of what the hook did: ``fired``, ``sites``, ``error``, ``activated_by``."""
    return dict(_state)
