"""Start-up activation (``TE_GQA_FIX_AUTOPATCH``): the shipped ``.pth`` line and its hook.

The one fake ``transformer_engine`` (``fakes.te_package``) has consumers that bind
``fused_attn_bwd`` by name, as TE does, and a backward that returns stale values (random,
NaN, Inf) in every dK/dV row: a call through the ``backends`` consumer shows whether the
rows that must be 0 were zeroed, i.e. whether TE's own call site was patched.

What is about process start-up runs in a fresh interpreter, through ``site.addsitedir`` on a
copy of ``src/te_gqa_fix_autopatch.pth`` (the line runs exactly as site-packages runs it):
that an unset or off variable imports nothing, and that a set one patches TE at its import.
Everything else runs the same line in this process (``exec``, as ``site`` does).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.metadata
import inspect
import logging
import re
import shutil
import site
import sys
import types
from pathlib import Path
from typing import Dict, Optional

import pytest

import _te_gqa_fix_autopatch as boot
from fakes import te_package
from fakes.interpreter import PTH, SRC, child_env, probed, run_code, run_pth_line
from te_gqa_fix import autopatch, settings

TE = "transformer_engine.pytorch"

# Seed batch, padding_causal (top-left): sequence 0 has no queries (rows 0-3: 0),
# sequence 1 has 3 queries and 6 keys, so keys 0-2 (rows 4-6) are attended and rows 7-11
# (keys 3-5 outside the causal window, then padding) must be 0. The fake TE returns stale
# (non-zero, NaN, Inf) values in every row; a row reads True when it is all zeros.
EXPECTED_FIXED_ROWS = [True] * 4 + [False] * 3 + [True] * 5
UNPATCHED_ROWS = [False] * 12


def probe() -> dict:
    """What this process sees: what te-gqa-fix imported, its hooks, and (TE imported)
    whether TE's own call sites reach the fix. Self-contained: fresh interpreters run its
    source."""
    import inspect
    import sys

    fa = sys.modules.get("transformer_engine.pytorch.cpp_extensions.fused_attn")
    be = sys.modules.get("transformer_engine.pytorch.attention.dot_product_attention.backends")
    out = {
        "imported": [
            m for m in ("_te_gqa_fix_autopatch", "te_gqa_fix", "torch") if m in sys.modules
        ],
        "hooks": sum(1 for f in sys.meta_path if getattr(f, "__te_gqa_fix_import_hook__", False)),
    }
    if "_te_gqa_fix_autopatch" in sys.modules:
        out["state"] = sys.modules["_te_gqa_fix_autopatch"].state()
    if fa is None or be is None:
        return out
    import torch

    out["defining_patched"] = bool(getattr(fa.fused_attn_bwd, "__te_gqa_fix_wrapper__", False))
    out["consumer_patched"] = bool(getattr(be.fused_attn_bwd, "__te_gqa_fix_wrapper__", False))
    i32 = dict(dtype=torch.int32)
    q, k = torch.randn(12, 2, 8), torch.randn(12, 1, 8)
    arguments = {n: p.default for n, p in inspect.signature(fa.fused_attn_bwd).parameters.items()}
    arguments.update(
        max_seqlen_q=64, max_seqlen_kv=64, cu_seqlens_q=torch.tensor([0, 0, 3], **i32),
        cu_seqlens_kv=torch.tensor([0, 3, 9], **i32), q=q, k=k, v=k.clone(), o=q.clone(),
        d_o=q.clone(), fake_dtype=torch.float16, aux_ctx_tensors=[],
        fused_attention_backend="F16_arbitrary_seqlen",
        cu_seqlens_q_padded=torch.tensor([0, 4, 12], **i32),
        cu_seqlens_kv_padded=torch.tensor([0, 4, 12], **i32),
        qkv_layout="thd_thd_thd", dqkv_layout="thd_thd_thd",
        attn_mask_type="padding_causal", window_size=(-1, 0),
    )  # fmt: skip
    grads = be.backward(arguments)  # TE's consumer: every argument positional
    out["dk_rows"] = [bool((grads[1][r] == 0).all()) for r in range(12)]
    out["dv_rows"] = [bool((grads[2][r] == 0).all()) for r in range(12)]
    loader = sys.modules["transformer_engine.pytorch"].__loader__
    out["loader_type"] = type(loader).__name__
    out["loader_exec_overridden"] = "exec_module" in vars(loader)
    return out


def _installed_distribution() -> Optional[importlib.metadata.Distribution]:
    try:
        return importlib.metadata.distribution("te-gqa-fix")
    except importlib.metadata.PackageNotFoundError:
        return None


INSTALLED = _installed_distribution() is not None


def run_fresh(
    code: str, tmp_path: Path, env: Optional[Dict[str, str]] = None, pth_dir: bool = True
) -> dict:
    """Run ``code``, then :func:`probe`, in a fresh interpreter with the fake TE and ``src``
    importable; ``{pth_dir}`` in ``code`` names a folder holding a copy of the ``.pth`` file.
    TE_GQA_FIX* variables of this process are dropped; ``env`` adds the test's own."""
    fake = te_package.write_fake_te(tmp_path / "fake")
    pdir = tmp_path / "site_dir"
    if pth_dir:
        pdir.mkdir(exist_ok=True)
        shutil.copy(PTH, pdir / PTH.name)
    source = code.replace("{pth_dir}", repr(str(pdir))) + "\n" + inspect.getsource(probe)
    source += "import json\nprint('PROBE' + json.dumps(probe()))\n"
    return probed(run_code(source, child_env(*te_package.pythonpath(fake), SRC, **(env or {}))))


def import_te():
    return importlib.import_module(TE)


# ----------------------------------------------------------------------------- fresh interpreters


def test_unset_or_off_imports_nothing_and_leaves_te_untouched(tmp_path: Path) -> None:
    """Every off spelling of both variables, then unset: the line imports nothing, puts no
    hook in place, and TE's stale rows reach the caller."""
    values = [*sorted(settings.SETTINGS[boot.ENV_AUTOPATCH][0]), " OFF ", None]
    values = [v for v in values if v is None or settings.parse(boot.ENV_AUTOPATCH, v) == "off"]
    code = (
        "import os, site, sys\n"
        f"for value in {values!r}:\n"
        f"    for name in ({boot.ENV_AUTOPATCH!r}, {boot.ENV_CUDNN!r}):\n"
        "        if value is None:\n            os.environ.pop(name, None)\n"
        "        else:\n            os.environ[name] = value\n"
        "    site.addsitedir({pth_dir})\n"
        "    assert not [m for m in ('_te_gqa_fix_autopatch', 'te_gqa_fix') if m in sys.modules], value\n"
        f"import {TE}\n"
    )
    out = run_fresh(code, tmp_path)
    assert out["imported"] == ["torch"]  # TE's own; nothing of te-gqa-fix
    assert out["hooks"] == 0
    assert out["defining_patched"] is False and out["consumer_patched"] is False
    assert out["dk_rows"] == UNPATCHED_ROWS  # TE's stale rows reach the caller
    assert out["loader_exec_overridden"] is False


def test_set_patches_when_te_is_imported_later(tmp_path: Path) -> None:
    """Through the installed start-up file at interpreter start where te-gqa-fix is
    installed (``pip install -e .``), else through ``site.addsitedir`` on a copy."""
    code = (
        ("import sys\n" if INSTALLED else "import site, sys\nsite.addsitedir({pth_dir})\n")
        + "early = [m for m in ('_te_gqa_fix_autopatch', 'te_gqa_fix.settings', "
        "'te_gqa_fix.wrapper', 'torch') if m in sys.modules]\n"
        "assert early == ['_te_gqa_fix_autopatch', 'te_gqa_fix.settings'], early\n"
        f"import {TE}\n"
    )
    out = run_fresh(code, tmp_path, {boot.ENV_AUTOPATCH: "1"}, pth_dir=not INSTALLED)
    # At start-up only the stdlib hook and the settings (no torch); the fix comes with TE.
    assert out["hooks"] == 1
    assert out["defining_patched"] is True
    assert out["consumer_patched"] is True  # the by-name import in backends.py too
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS
    assert out["dv_rows"] == EXPECTED_FIXED_ROWS
    assert out["state"]["fired"] is True and out["state"]["error"] is None
    assert te_package.CONSUMERS["backends"] + ".fused_attn_bwd" in out["state"]["sites"]
    # TE's loader keeps its type, and the hook's override is gone after the import.
    assert out["loader_type"] == "SourceFileLoader"
    assert out["loader_exec_overridden"] is False


# ----------------------------------------------------------------------------- in this process


@pytest.mark.parametrize(
    "value, te_first", [("1", False), ("on", False), ("strict", False), ("1", True)]
)
def test_set_values_patch_at_te_import(
    fake_te: Path, hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    value: str, te_first: bool,
) -> None:  # fmt: skip
    """At TE's import, or at once where TE was imported before the hook activated."""
    monkeypatch.setenv(boot.ENV_AUTOPATCH, value)
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        if te_first:
            import_te()
        run_pth_line()
        assert boot.state()["activated_by"] == f"TE_GQA_FIX_AUTOPATCH={value}"
        finder = next(f for f in sys.meta_path if isinstance(f, boot.TEImportHook))
        assert sys.meta_path[0] is finder and finder.strict is (value == "strict")
        import_te()
    assert f"was imported ({len(boot.state()['sites'])} sites rebound)" in caplog.text
    out = probe()
    assert out["consumer_patched"] is True and out["defining_patched"] is True
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS and out["dv_rows"] == EXPECTED_FIXED_ROWS
    assert out["loader_exec_overridden"] is False and out["state"]["fired"] is True


def test_activation_is_idempotent(fake_te: Path, hook, monkeypatch: pytest.MonkeyPatch) -> None:
    """And enable() says whether it installed the fix."""
    import te_gqa_fix
    from te_gqa_fix import wrapper

    monkeypatch.setenv(boot.ENV_AUTOPATCH, "1")
    run_pth_line()
    run_pth_line()  # the same site dir processed twice
    boot.activate()
    assert boot.enable() is False  # TE not imported yet
    import_te()
    assert boot.enable() is False  # TE imported, already installed: nothing new
    fa = sys.modules[te_package.DEFINING]
    assert not wrapper.is_wrapper(fa.fused_attn_bwd.__wrapped__)  # never a wrapper of a wrapper
    out = probe()
    assert out["hooks"] == 1
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS
    te_gqa_fix.uninstall()
    assert boot.enable() is True and te_gqa_fix.is_installed()


@pytest.mark.parametrize("value, te_first", [("1", False), ("strict", False), ("strict", True)])
def test_a_failure_is_logged_or_when_strict_raised(
    fake_te: Path, hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    value: str, te_first: bool,
) -> None:  # fmt: skip
    """Strict raises at TE's import, or at once when TE came first (from enable)."""
    te_package.write_fake_te(fake_te, signature=None)  # fused_attn without fused_attn_bwd
    if te_first:
        import_te()
    monkeypatch.setenv(boot.ENV_AUTOPATCH, value)
    if value == "strict":
        with pytest.raises(ImportError, match=r"^te_gqa_fix: TE_GQA_FIX_AUTOPATCH=strict and") as e:
            run_pth_line()
            import_te()
        assert isinstance(e.value.__cause__, ImportError)
        return
    run_pth_line()
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        assert import_te().__name__ == TE
    assert boot.state()["error"].startswith("ImportError")
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "could not be installed" in record.getMessage() and record.exc_info
    assert "WITHOUT the fix" in record.getMessage()


@pytest.mark.parametrize("first, then", [(True, False), (False, True), (True, True)])
def test_a_later_enable_never_turns_patching_off(hook, first: bool, then: bool) -> None:
    """``enable(patch=False)`` (the cuDNN route's own call) after ``enable()`` keeps the
    patch; either order gives one hook that patches; the last ``strict`` holds."""
    boot.enable(patch=first)
    boot.enable(patch=then, strict=True)
    (only,) = boot._hooks()
    assert only.patch is True and only.strict is True


@pytest.mark.parametrize("route, error", [(True, None), (True, "a failure"), (False, "a failure")])
def test_the_hook_does_what_it_was_enabled_for(
    fake_te: Path, hook, monkeypatch: pytest.MonkeyPatch, route: bool, error: Optional[str]
) -> None:
    """The route's hook (patch=False) checks the route at TE's import and patches nothing;
    the patch's hook patches and leaves a route it did not start alone (here: a strict
    use_fixed_cudnn() that failed in code, its error caught there)."""
    from te_gqa_fix import patch
    from te_gqa_fix.stack import cudnn

    monkeypatch.setattr(cudnn, "_route", {**cudnn._route, "strict": True, "error": error})
    monkeypatch.setitem(boot._state, "cudnn_route", route)
    boot.enable(patch=not route)
    with (
        pytest.raises(ImportError, match="a failure")
        if route and error
        else contextlib.nullcontext()
    ):
        import_te()
    assert patch.is_installed() is not route


@pytest.mark.parametrize("initializing", [True, False, None])
def test_enable_while_te_is_importing_waits_for_the_hook(
    hook, monkeypatch: pytest.MonkeyPatch, initializing: bool
) -> None:
    """TE in sys.modules but still executing (an import cycle, another start-up file): the
    fix must come from the hook once TE is complete, never from enable() on half a module."""
    fired: list = []
    monkeypatch.setattr(boot, "_fire", lambda strict: fired.append(strict))
    module = types.ModuleType(TE)
    module.__spec__ = importlib.machinery.ModuleSpec(TE, None)
    if initializing is not None:  # None: a spec importlib never ran (no _initializing)
        module.__spec__._initializing = initializing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, TE, module)
    boot.enable()
    assert fired == ([] if initializing else [False]) and boot.is_enabled()


def test_the_preload_hook_leaves_the_finders_behind_it_their_turn(
    hook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It removes itself from inside find_spec: the finder right behind it must still be
    asked for that import (an in-place removal made importlib skip it), and activating
    twice leaves one preload hook."""
    monkeypatch.setenv(boot.ENV_CUDNN, "/no/such/folder")
    monkeypatch.setattr(boot.CudnnPreloadHook, "TRIGGERS", ("te_gqa_fix_no_such_module",))
    monkeypatch.setattr(boot, "preload_cudnn", lambda setting: boot._remove(boot._CUDNN_MARKER))
    boot.activate()
    boot.activate()
    assert len(boot._hooks(boot._CUDNN_MARKER)) == 1 and boot.state()["cudnn_route"] is True
    # ahead of every finder; the route's import hook checks the route and never patches
    assert sys.meta_path[:2] == boot._hooks() + boot._hooks(boot._CUDNN_MARKER)
    assert boot._hooks()[0].patch is False
    asked: list = []
    behind = types.SimpleNamespace(find_spec=lambda name, *a: asked.append(name))
    i = sys.meta_path.index(boot._hooks(boot._CUDNN_MARKER)[0])
    sys.meta_path.insert(i + 1, behind)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("te_gqa_fix_no_such_module")
    assert asked == ["te_gqa_fix_no_such_module"] and not boot._hooks(boot._CUDNN_MARKER)


@pytest.mark.parametrize("long", [False, True], ids=["", "100k-chars"])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("how", ["torch imported before the hook", "the hook's trigger"])
def test_the_preload_runs_once_then_removes_its_hook(
    hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path,
    how: str, strict: bool, long: bool,
) -> None:  # fmt: skip
    """torch is imported in this process, as after a start-up file that imports it: the
    route runs at once and reports why it loads nothing; otherwise the hook runs it at the
    first import of torch. Either way a failure is logged and the hook goes (strict: raised,
    and the hook stays, so that every later import fails too)."""
    cudnn = importlib.import_module("te_gqa_fix.stack.cudnn")
    cudnn._reset_route()
    monkeypatch.setattr(cudnn, "_route", dict(cudnn._route))
    folder = f"{'strict:' if strict else ''}{tmp_path / 'no-cudnn'}" + "/a" * (50_000 * long)
    monkeypatch.setenv(boot.ENV_CUDNN, folder)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"), (
        pytest.raises(ImportError, match=r"TE_GQA_FIX_CUDNN='strict:.*expected a folder holding")
        if strict else contextlib.nullcontext()
    ) as raised:  # fmt: skip
        if how == "the hook's trigger":
            monkeypatch.setattr(boot.CudnnPreloadHook, "TRIGGERS", ("a_module_not_imported",))
            boot.activate()
            (preload,) = boot._hooks(boot._CUDNN_MARKER)
            assert preload.find_spec("json") is None and boot._hooks(boot._CUDNN_MARKER)
            assert cudnn.route_state()["setting"] is None  # json is no trigger
            assert preload.find_spec("a_module_not_imported") is None
        else:
            boot.activate()
    assert "expected a folder holding libcudnn.so.9" in cudnn.route_state()["error"]
    assert bool(boot._hooks(boot._CUDNN_MARKER)) is strict
    if not strict:
        assert "Transformer Engine keeps the cuDNN it finds" in caplog.text
    said = str(raised.value) if strict else caplog.text  # type: ignore[union-attr]
    assert len(said) < 1000 and said.count("/a/a") < 100  # a long value is not echoed


def test_an_unforeseen_route_error_is_logged_and_the_hook_goes(
    hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("te_gqa_fix.stack.cudnn.use_fixed_cudnn", lambda target, strict: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        boot.preload_cudnn("/x")
    assert "TE_GQA_FIX_CUDNN='/x' failed (ZeroDivisionError: division by zero)" in caplog.text


def test_pth_line_reads_two_variables_and_their_off_values() -> None:
    """The .pth line decides alone whether to import anything: it reads exactly the hook's
    two variables, and its literal off values are the ones the settings read as off."""
    lines = [ln for ln in PTH.read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("import os;")
    names = re.findall(r'environ\.get\("(\w+)"', lines[0])
    assert names == [boot.ENV_AUTOPATCH, boot.ENV_CUDNN]
    tuples = re.findall(r"in (\([^)]*\))", lines[0])
    assert len(tuples) == 2
    for name, literal in zip(names, tuples):
        spellings = settings.SETTINGS[name][0]
        assert set(eval(literal)) == {s for s, v in spellings.items() if v == "off"}


def test_hook_ignores_other_imports_and_can_be_disabled(
    hook, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One hook however often enabled: test_activation_is_idempotent."""
    assert not boot.is_enabled()
    boot.enable()
    (ours,) = boot._hooks()
    assert ours.find_spec("json") is None and ours.find_spec("transformer_engine") is None
    assert ours.find_spec(TE, [str(tmp_path)]) is None  # no finder behind has it
    spec = importlib.machinery.ModuleSpec(TE, types.SimpleNamespace())  # no exec_module
    sys.meta_path.append(types.SimpleNamespace(find_spec=lambda *a: spec))
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        assert ours.find_spec(TE) is spec
    assert f"cannot hook the loader of {TE}" in caplog.text
    other = sys.meta_path[-1]
    assert boot.disable() is True
    assert not boot.is_enabled() and other in sys.meta_path  # only ours taken off
    before = sys.meta_path
    assert boot.disable() is False and sys.meta_path is before  # nothing to take off: untouched


@pytest.mark.parametrize("folder", ["site-packages", "dist-packages"])
def test_public_module_reports_status(
    hook, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, folder: str
) -> None:
    (tmp_path / folder).mkdir()
    (tmp_path / folder / boot.PTH_NAME).write_text("")
    monkeypatch.setattr(site, "getsitepackages", lambda: 1 / 0)  # found in sys.path's too
    monkeypatch.setattr(sys, "path", [str(tmp_path), f"{tmp_path / folder}/"])
    boot.enable(patch=False)
    st = autopatch.status()
    assert st["hook_enabled"] is True and st["fired"] is False
    assert st["pth"] == str(tmp_path / folder / boot.PTH_NAME)
    assert set(st) >= {"pth", "sites", "error", "activated_by", "cudnn_route"}
    assert autopatch.enable is boot.enable and autopatch.disable is boot.disable


@pytest.mark.skipif(
    not INSTALLED,
    reason="te-gqa-fix is not installed (running from a source tree via PYTHONPATH)",
)
def test_installed_distribution_ships_the_start_up_file() -> None:
    """That it works at interpreter start: test_set_patches_when_te_is_imported_later."""
    dist = _installed_distribution()
    files = {str(f): f for f in (dist.files or [])}  # type: ignore[union-attr]
    assert boot.PTH_NAME in files, (
        f"{boot.PTH_NAME} is not among the installed files of te-gqa-fix: the install "
        f"predates it; reinstall (pip install -e .)"
    )
    installed = Path(files[boot.PTH_NAME].locate())
    assert installed.is_file()
    assert installed.read_text() == PTH.read_text()
    assert autopatch.find_pth() == str(installed)
