"""Start-up activation (``TE_GQA_FIX_AUTOPATCH``, ``TE_GQA_FIX_CUDNN``): the shipped ``.pth``
line, the PEP 829 ``.start`` entry point beside it, and their hook ``_te_gqa_fix_autopatch``.

The one fake ``transformer_engine`` (``fakes.te_package``) has consumers that bind
``fused_attn_bwd`` by name, as TE does, and a backward that returns stale values (random,
NaN, Inf) in every dK/dV row: a call through the ``backends`` consumer shows whether the
rows that must be 0 were zeroed, i.e. whether TE's own call site was patched.

What is about process start-up runs in a fresh interpreter that processes no installed
start-up file (``python -S``), then a temporary site folder holding copies of the shipped
files the way ``site`` does: Pythons before 3.15 run the ``.pth`` import line
(``site.addsitedir``); under PEP 829 (3.15+) a matching ``.start`` file disables that line
and its entry point is resolved with ``pkgutil.resolve_name`` and called with no
arguments (emulated here on older Pythons). A torch-free TE stands in where only its
import matters. Everything else runs the same line in this process (``exec``, as ``site``
does).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.metadata
import inspect
import json
import logging
import os
import re
import shutil
import site
import subprocess
import sys
import types
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

import _te_gqa_fix_autopatch as boot
from fakes import background, te_package
from fakes.interpreter import (
    PTH,
    ROOT,
    SITE_FOLDERS,
    SRC,
    child_env,
    probed,
    run_code,
    run_pth_line,
)
from te_gqa_fix import cudnn_route, settings
from te_gqa_fix.errors import SetupError

TE = "transformer_engine.pytorch"
START = SRC / "te_gqa_fix_autopatch.start"  # PEP 829's file, beside the .pth in the wheel

# Seed batch, padding_causal (top-left): sequence 0 has no queries (rows 0-3: 0),
# sequence 1 has 3 queries and 6 keys, so keys 0-2 (rows 4-6) are attended and rows 7-11
# (keys 3-5 outside the causal window, then padding) must be 0. The fake TE returns stale
# (non-zero, NaN, Inf) values in every row; a row reads True when it is all zeros.
EXPECTED_FIXED_ROWS = [True] * 4 + [False] * 3 + [True] * 5


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
    if sys.modules.get("_te_gqa_fix_autopatch") is not None:
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


#: A child's ``process(folder, pep829)``: the site folder's start-up files, as this
#: Python's ``site`` processes them where it has the behaviour asked for, else as ``site``
#: does in the Pythons that have it (PEP 829, Python 3.15+: a ``.start`` file disables its
#: ``.pth``'s import lines, its entry points ``pkg.mod:callable`` are resolved with
#: ``pkgutil.resolve_name`` and called with no arguments, after every import line; an
#: error is printed and the next line runs).
PROCESS = """
import os, pkgutil, site, sys, traceback


def process(folder, pep829):
    if pep829 == (sys.version_info >= (3, 15)):
        site.addsitedir(folder)
        return
    names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    starts = {n[: -len(".start")] for n in names if n.endswith(".start")}

    def lines(name):
        with open(os.path.join(folder, name)) as f:
            return [ln.strip() for ln in f.read().splitlines()]

    for name in names:
        if name.endswith(".pth") and not (pep829 and name[: -len(".pth")] in starts):
            for line in lines(name):
                if line.startswith(("import ", "import\\t")):
                    try:
                        exec(line)
                    except Exception:
                        traceback.print_exc()
    for name in names if pep829 else ():
        if name.endswith(".start"):
            for line in lines(name):
                if not line or line.startswith("#"):
                    continue
                try:
                    assert ":" in line, f"not pkg.mod:callable: {line!r}"
                    entry = pkgutil.resolve_name(line)
                except Exception:
                    traceback.print_exc()
                    continue
                try:
                    entry()
                except Exception:
                    traceback.print_exc()
"""


def site_folder(tmp_path: Path) -> Path:
    """A site folder holding copies of the shipped ``.pth`` and ``.start`` files."""
    folder = tmp_path / "site_dir"
    folder.mkdir(exist_ok=True)
    for f in (PTH, START):
        shutil.copy(f, folder / f.name)
    return folder


def _child(
    code: str, tmp_path: Path, paths: Sequence[object], env: Optional[Dict[str, str]] = None
) -> tuple:
    """The command and environment of :func:`run_child`."""
    source = (
        PROCESS
        + f"SITE_DIR = {str(site_folder(tmp_path))!r}\n"
        + inspect.getsource(probe)
        + "import json\n"
        + code
    )
    env = {**child_env(**(env or {})), "PYTHONPATH": os.pathsep.join(map(str, paths))}
    return [sys.executable, "-S", "-c", source], env


def run_child(
    code: str, tmp_path: Path, paths: Sequence[object], env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """``code`` after :data:`PROCESS`, ``SITE_DIR`` (:func:`site_folder`) and ``probe``, in
    a fresh interpreter that processes no installed start-up file (``python -S``), with
    ``paths`` alone on PYTHONPATH (then the site folders), no TE_GQA_FIX* variable of this
    process but ``env``'s; it must exit 0."""
    (*_, source), env = _child(code, tmp_path, paths, env)
    return run_code(source, env, no_site=True)


def fake_te(tmp_path: Path) -> List[str]:
    """The fake TE (imports torch), as PYTHONPATH entries with ``src``."""
    return [*te_package.pythonpath(te_package.write_fake_te(tmp_path / "fake")), str(SRC)]


def bare_te(tmp_path: Path) -> Path:
    """A torch-free ``transformer_engine.pytorch`` that imports nothing: where only its
    import matters."""
    root = tmp_path / "bare_te"
    (root / "transformer_engine" / "pytorch").mkdir(parents=True)
    (root / "transformer_engine" / "__init__.py").write_text("")
    (root / "transformer_engine" / "pytorch" / "__init__.py").write_text("IMPORTED = True\n")
    return root


def import_te():
    return importlib.import_module(TE)


MODES = {"pep829": True, "pth": False}


# ----------------------------------------------------------------------------- fresh interpreters


@pytest.mark.parametrize("mode", list(MODES))
def test_every_setting_off_imports_nothing_and_leaves_te_untouched(
    tmp_path: Path, mode: str
) -> None:
    """Every off spelling of both variables, then unset: nothing of te-gqa-fix is imported
    (under PEP 829 the hook module itself, to call its entry point, which reads the two
    variables and returns), no hook is put in place, TE's import is left alone."""
    values = [*sorted(s for s, v in settings.SETTINGS[boot.ENV_AUTOPATCH][0].items() if v == "off")]
    values += [" OFF ", "Disabled", None]
    code = (
        f"for value in {values!r}:\n"
        f"    for name in ({boot.ENV_AUTOPATCH!r}, {boot.ENV_CUDNN!r}):\n"
        "        if value is None:\n            os.environ.pop(name, None)\n"
        "        else:\n            os.environ[name] = value\n"
        f"    process(SITE_DIR, {MODES[mode]})\n"
        "    assert 'te_gqa_fix' not in sys.modules, value\n"
        f"    assert ('_te_gqa_fix_autopatch' in sys.modules) is {MODES[mode]}, value\n"
        f"import {TE}\n"
        "print('PROBE' + json.dumps(probe()))\n"
    )
    code += f"loader = sys.modules[{TE!r}].__loader__\n"
    code += "print('LOADER', json.dumps('exec_module' in vars(loader)))\n"
    proc = run_child(code, tmp_path, [bare_te(tmp_path), SRC])
    out = probed(proc)
    assert "te_gqa_fix" not in out["imported"] and "torch" not in out["imported"]
    assert out["hooks"] == 0
    assert "LOADER false" in proc.stdout and proc.stderr == ""  # TE's loader untouched


#: The two ways Pythons read the start-up files, each in a child started when collection
#: ends (tests/fakes/background.py: they import torch): the hook activated by ``value``.
ACTIVATED = {"started_pep829": ("pep829", "1"), "started_pth": ("pth", "enabled")}


def _start_activated(name: str):
    mode, value = ACTIVATED[name]
    code = (
        "import _te_gqa_fix_autopatch as hook\n"
        "calls = []\n"
        "real = hook.activate\n"
        "hook.activate = lambda: calls.append(1) or real()\n"
        f"process(SITE_DIR, {MODES[mode]})\n"
        "early = [m for m in ('_te_gqa_fix_autopatch', 'te_gqa_fix.settings', "
        "'te_gqa_fix.wrapper', 'torch') if m in sys.modules]\n"
        "assert early == ['_te_gqa_fix_autopatch', 'te_gqa_fix.settings'], early\n"
        f"import {TE}\n"
        "print('PROBE' + json.dumps({**probe(), 'calls': len(calls)}))\n"
    )

    def start(folder: Path) -> background.Job:
        cmd, env = _child(code, folder, fake_te(folder), {boot.ENV_AUTOPATCH: value})
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *SITE_FOLDERS])
        return background.Job(cmd, folder, timeout=300, env=env)

    return start


for _name in ACTIVATED:
    background.STARTERS[_name] = _start_activated(_name)


@pytest.fixture(scope="module")
def started_pep829() -> subprocess.CompletedProcess:
    return background.get("started_pep829").wait()  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def started_pth() -> subprocess.CompletedProcess:
    return background.get("started_pth").wait()  # type: ignore[union-attr]


def _runs_once_and_patches(proc: subprocess.CompletedProcess) -> None:
    """Issue #53: the ``.start`` file names the same entry point as the ``.pth`` line; read
    either way, the hook runs exactly once (under PEP 829 the ``.start`` disables the
    line), imports only the standard-library hook and the settings at start-up (no torch),
    and installs the fix when TE is imported."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = probed(proc)
    assert out["calls"] == 1, proc.stderr
    assert out["hooks"] == 1 and out["state"]["activated"] is True
    assert out["defining_patched"] is True
    assert out["consumer_patched"] is True  # the by-name import in backends.py too
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS
    assert out["dv_rows"] == EXPECTED_FIXED_ROWS
    assert out["state"]["fired"] is True and out["state"]["error"] is None
    assert te_package.CONSUMERS["backends"] + ".fused_attn_bwd" in out["state"]["sites"]
    # TE's loader keeps its type, and the hook's override is gone after the import.
    assert out["loader_type"] == "SourceFileLoader"
    assert out["loader_exec_overridden"] is False
    assert proc.stderr == ""


def test_the_start_file_runs_the_hook_once_and_it_patches_at_te_import(
    started_pep829: subprocess.CompletedProcess,
) -> None:
    _runs_once_and_patches(started_pep829)


def test_the_pth_line_runs_the_hook_once_and_it_patches_at_te_import(
    started_pth: subprocess.CompletedProcess,
) -> None:
    _runs_once_and_patches(started_pth)


#: How the start-up can fail: what shadows te-gqa-fix first on the path (file -> text), and
#: whether ``src`` (the hook module and te_gqa_fix) is on the path behind it.
FAILURES = {
    "te_gqa_fix shadowed": ({"te_gqa_fix/__init__.py": ""}, True),  # another project's
    "te_gqa_fix broken": ({"te_gqa_fix/__init__.py": "raise RuntimeError('half installed')"}, True),
    "hook missing": ({}, False),
    "hook broken": ({"_te_gqa_fix_autopatch.py": "raise RuntimeError('half installed')"}, True),
    "hook failing": ({"_te_gqa_fix_autopatch.py": "def activate():\n    1 / 0\n"}, True),
}
#: what the message names as the cause
CAUSES = {
    "te_gqa_fix shadowed": "No module named 'te_gqa_fix.settings'",
    "te_gqa_fix broken": "RuntimeError: half installed",
    "hook missing": "No module named '_te_gqa_fix_autopatch'",
    "hook broken": "RuntimeError: half installed",
    "hook failing": "ZeroDivisionError: division by zero",
}
ATTEMPT_TE = (
    "for attempt in (1, 2):\n"
    "    try:\n"
    f"        import {TE}\n"
    "    except ImportError as exc:\n"
    "        print('RAISED', attempt, json.dumps(str(exc)))\n"
    "    else:\n"
    "        print('IMPORTED', attempt)\n"
)


#: (failure, setting, how the files are read): PEP 829 runs the entry point alone, so only
#: a hook module that imports can act on a failure there.
STRICT_CASES = [
    (f, s, mode)
    for f in FAILURES
    for s in ("TE_GQA_FIX_AUTOPATCH=strict", "TE_GQA_FIX_AUTOPATCH=1")
    for mode in MODES
    if mode == "pth" or not f.startswith("hook")
] + [(f, "TE_GQA_FIX_CUDNN=strict", "pth") for f in ("te_gqa_fix broken", "hook missing")]


@pytest.mark.parametrize("failure, setting, mode", STRICT_CASES)
def test_strict_holds_however_the_hook_fails(
    tmp_path: Path, failure: str, setting: str, mode: str
) -> None:
    """Issue #51 (3): te_gqa_fix shadowed or broken behind a working hook module, or the
    hook module itself missing, broken or failing (the ``.pth`` line's own fallback): with
    a strict setting every import of TE raises ImportError naming the setting and the
    cause; otherwise TE imports, without the fix, and one line says so, however often the
    start-up file runs (issue #53)."""
    files, with_src = FAILURES[failure]
    shadow = tmp_path / "shadow"
    for rel, text in {"_marker": "", **files}.items():
        (shadow / rel).parent.mkdir(parents=True, exist_ok=True)
        (shadow / rel).write_text(text)
    name, value = setting.split("=")
    paths = [shadow, bare_te(tmp_path), *([SRC] if with_src else [])]
    code = f"process(SITE_DIR, {MODES[mode]})\nprocess(SITE_DIR, {MODES[mode]})\n" + ATTEMPT_TE
    proc = run_child(code, tmp_path, paths, {name: value})
    said = proc.stderr.splitlines()
    assert len(said) == 1, proc.stderr
    if value == "strict":
        raised = [json.loads(ln.split(" ", 2)[2]) for ln in proc.stdout.splitlines()]
        assert len(raised) == 2, proc.stdout  # every import, not only the first
        for message in raised:
            assert message.startswith(setting) and CAUSES[failure] in message, message
        assert said[0].endswith("importing Transformer Engine will fail (strict)")
    else:
        assert "IMPORTED 1" in proc.stdout and "IMPORTED 2" in proc.stdout
        assert CAUSES[failure] in said[0] and said[0].endswith("runs WITHOUT the fix")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "setting, said",
    [("TE_GQA_FIX_AUTOPATCH=enable", None), ("TE_GQA_FIX_CUDNN=Disabled", None),
     ("TE_GQA_FIX_AUTOPATCH=enabel", "TE_GQA_FIX_AUTOPATCH='enabel' is not an accepted value"),
     ("TE_GQA_FIX_CUDNN=stirct", "TE_GQA_FIX_CUDNN='stirct' is not an accepted value")],
)  # fmt: skip
def test_one_message_per_process_when_the_start_up_file_runs_twice(
    tmp_path: Path, setting: str, said: Optional[str], mode: str
) -> None:
    """Issue #53: CPython processes a virtual environment's site folder twice; what the
    hook says (here a typo, logged at ERROR, the hook then off) it says once, and it puts
    one hook in place (``enable``, an on spelling of every setting)."""
    name, value = setting.split("=")
    code = (
        f"process(SITE_DIR, {MODES[mode]})\nprocess(SITE_DIR, {MODES[mode]})\n"
        "print('PROBE' + json.dumps(probe()))\n"
    )
    proc = run_child(code, tmp_path, [bare_te(tmp_path), SRC], {name: value})
    lines = proc.stderr.splitlines()
    if said is None:
        assert lines == []
        assert probed(proc)["hooks"] == (value == "enable")
    else:
        assert len(lines) == 1 and lines[0].startswith(said), proc.stderr
        assert lines[0].endswith("; the start-up hook ignores it (off)")
        assert probed(proc)["hooks"] == 0


# ----------------------------------------------------------------------------- in this process


@pytest.mark.parametrize(
    "value, te_first",
    [("1", False), ("on", False), ("Enabled", False), ("strict", False), ("1", True)],
)
def test_set_values_patch_at_te_import(
    fake_te: Path, hook, monkeypatch: pytest.MonkeyPatch, value: str, te_first: bool
) -> None:
    """At TE's import, or at once where TE was imported before the hook activated."""
    monkeypatch.setenv(boot.ENV_AUTOPATCH, value)
    if te_first:
        import_te()
    run_pth_line()
    assert boot.state()["activated_by"] == f"TE_GQA_FIX_AUTOPATCH={value}"
    finder = next(f for f in sys.meta_path if isinstance(f, boot.TEImportHook))
    assert sys.meta_path[0] is finder and finder.strict is (value == "strict")
    import_te()
    out = probe()
    assert out["consumer_patched"] is True and out["defining_patched"] is True
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS and out["dv_rows"] == EXPECTED_FIXED_ROWS
    assert out["loader_exec_overridden"] is False and out["state"]["fired"] is True
    assert te_package.CONSUMERS["backends"] + ".fused_attn_bwd" in out["state"]["sites"]


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


@pytest.mark.parametrize(
    "asked, te_first",
    [("TE_GQA_FIX_AUTOPATCH=1", False), ("TE_GQA_FIX_AUTOPATCH=strict", False),
     ("TE_GQA_FIX_AUTOPATCH=strict", True), ("enable(strict=True)", False),
     ("enable(strict=False)", False)],
)  # fmt: skip
def test_a_failure_is_logged_or_when_strict_raised(
    fake_te: Path, hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    asked: str, te_first: bool,
) -> None:  # fmt: skip
    """Strict raises at TE's import, or at once when TE came first (from enable); either
    way the message names what asked for the fix: the variable as set, or ``enable()``."""
    te_package.write_fake_te(fake_te, signature=None)  # fused_attn without fused_attn_bwd
    if te_first:
        import_te()
    strict = "strict" in asked.lower() and "False" not in asked
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"), (
        pytest.raises(ImportError, match=rf"^{re.escape(asked)}: the fix could not be installed")
        if strict else contextlib.nullcontext()
    ) as raised:  # fmt: skip
        if asked.startswith("enable"):
            boot.enable(strict=strict)
        else:
            monkeypatch.setenv(*asked.split("="))
            boot.activate()  # the start-up line reports its failure: test_strict_holds...
        assert import_te().__name__ == TE
    assert boot.state()["error"].startswith("SetupError")
    if strict:
        assert isinstance(raised.value.__cause__, ImportError)  # type: ignore[union-attr]
        return
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage().startswith(f"{asked}: the fix could not be installed")
    assert record.exc_info and "WITHOUT the fix" in record.getMessage()


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

    monkeypatch.setattr(
        cudnn_route, "_route", {**cudnn_route._route, "strict": True, "error": error}
    )
    monkeypatch.setitem(boot._state, "cudnn_route", route)
    boot.enable(patch=not route)
    with (
        pytest.raises(SetupError, match="a failure")
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
    monkeypatch.setattr(cudnn_route, "_route", dict(cudnn_route._route))
    folder = f"{'strict:' if strict else ''}{tmp_path / 'no-cudnn'}" + "/a" * (50_000 * long)
    monkeypatch.setenv(boot.ENV_CUDNN, folder)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"), (
        pytest.raises(SetupError, match=r"^TE_GQA_FIX_CUDNN='strict:.*expected a folder holding")
        if strict else contextlib.nullcontext()
    ) as raised:  # fmt: skip
        if how == "the hook's trigger":
            monkeypatch.setattr(boot.CudnnPreloadHook, "TRIGGERS", ("a_module_not_imported",))
            boot.activate()
            (preload,) = boot._hooks(boot._CUDNN_MARKER)
            assert preload.find_spec("json") is None and boot._hooks(boot._CUDNN_MARKER)
            assert cudnn_route.route_state()["setting"] is None  # json is no trigger
            assert preload.find_spec("a_module_not_imported") is None
        else:
            boot.activate()
    assert "expected a folder holding libcudnn.so.9" in cudnn_route.route_state()["error"]
    assert bool(boot._hooks(boot._CUDNN_MARKER)) is strict
    if not strict:
        assert "Transformer Engine keeps the cuDNN it finds" in caplog.text
    said = str(raised.value) if strict else caplog.text  # type: ignore[union-attr]
    assert len(said) < 1000 and said.count("/a/a") < 100  # a long value is not echoed
    assert said.count("TE_GQA_FIX_CUDNN=") == 1  # named once, not "X: X ..."


@pytest.mark.parametrize("value", ["strict", "1", " Enable "])
def test_route_errors_name_the_setting_as_given(
    hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    """Issue #53: ``TE_GQA_FIX_CUDNN=strict`` failing says TE_GQA_FIX_CUDNN='strict' (it
    said "=auto", what strict means), at torch's import and again at TE's; an on spelling
    is named as written too."""
    monkeypatch.setattr(cudnn_route, "find_wheel_builds", lambda search_path=None: [])
    monkeypatch.setattr(boot.CudnnPreloadHook, "TRIGGERS", ("a_module_not_imported",))
    monkeypatch.setenv(boot.ENV_CUDNN, value)
    given = f"TE_GQA_FIX_CUDNN={value.strip()!r}"
    boot.activate()
    (preload,) = boot._hooks(boot._CUDNN_MARKER)
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        if value == "strict":
            with pytest.raises(SetupError) as err:
                preload.find_spec("a_module_not_imported")
            said = str(err.value)
            with pytest.raises(SetupError, match=f"^{re.escape(given)} failed: "):
                cudnn_route.verify_te_cudnn()
        else:
            assert preload.find_spec("a_module_not_imported") is None
            said = caplog.text
    assert f"{given} found no cuDNN wheel it may load" in said
    assert "'auto'" not in said and "=auto" not in said, said
    assert cudnn_route.route_state()["setting"] == given


def test_an_unforeseen_route_error_is_logged_and_the_hook_goes(
    hook, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cudnn_route, "route", lambda *args: 1 / 0)
    monkeypatch.setenv(boot.ENV_CUDNN, "/x")
    with caplog.at_level(logging.WARNING, logger="te_gqa_fix"):
        boot.preload_cudnn("/x")
    assert "TE_GQA_FIX_CUDNN='/x' failed (ZeroDivisionError: division by zero)" in caplog.text


def test_the_start_up_files_read_the_same_names_and_off_values() -> None:
    """The .pth line decides alone whether to import anything: it reads exactly the hook's
    two variables, and its literal off values are the ones the settings and the hook read
    as off. The .start file names the hook's entry point and nothing else."""
    lines = [ln for ln in PTH.read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("import os, sys;")
    (names,) = set(re.findall(r"for n in (\('TE_GQA_FIX\w*', 'TE_GQA_FIX\w*'\))", lines[0]))
    assert eval(names) == (boot.ENV_AUTOPATCH, boot.ENV_CUDNN)
    (off,) = re.findall(r"not in (\([^)]*\))", lines[0])
    for name in (boot.ENV_AUTOPATCH, boot.ENV_CUDNN):
        spellings = settings.SETTINGS[name][0]
        assert set(eval(off)) == set(boot.OFF) == {s for s, v in spellings.items() if v == "off"}
    entries = [ln for ln in START.read_text().splitlines() if ln and not ln.startswith("#")]
    assert entries == ["_te_gqa_fix_autopatch:activate"]


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
def test_find_pth_in_a_site_folder(
    hook, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, folder: str
) -> None:
    (tmp_path / folder).mkdir()
    (tmp_path / folder / boot.PTH_NAME).write_text("")
    monkeypatch.setattr(site, "getsitepackages", lambda: 1 / 0)  # found in sys.path's too
    monkeypatch.setattr(sys, "path", [str(tmp_path), f"{tmp_path / folder}/"])
    assert boot.find_pth() == str(tmp_path / folder / boot.PTH_NAME)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert boot.find_pth() is None


# ----------------------------------------------------------------------------- the install
# (What the wheel ships, the start-up files byte for byte: tests/test_packaging.py.)


def _installed_here() -> Optional[importlib.metadata.Distribution]:
    """te-gqa-fix's installed distribution, where it is installed from this checkout."""
    try:
        dist = importlib.metadata.distribution("te-gqa-fix")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    return dist if url == ROOT.as_uri() else None


@pytest.mark.skipif(
    _installed_here() is None,
    reason="te-gqa-fix is not installed from this checkout (running via PYTHONPATH)",
)
def test_installed_distribution_ships_the_start_up_files() -> None:
    """That they work: the fresh-interpreter tests above."""
    dist = _installed_here()
    files = {str(f): f for f in (dist.files or [])}  # type: ignore[union-attr]
    for shipped in (PTH, START):
        assert shipped.name in files, (
            f"{shipped.name} is not among the installed files of te-gqa-fix: the install "
            f"predates it; reinstall (pip install -e .)"
        )
        installed = Path(files[shipped.name].locate())
        assert installed.read_text() == shipped.read_text()
    assert boot.find_pth() == str(Path(files[PTH.name].locate()))
