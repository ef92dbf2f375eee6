"""Start-up activation (``TE_GQA_FIX_AUTOPATCH``), tested in fresh interpreters.

Each test runs a subprocess with the one fake ``transformer_engine`` (``fakes.te_package``)
written to a temp dir: ``pytorch/__init__.py`` imports ``cpp_extensions`` and the attention
consumers that bind ``fused_attn_bwd`` by name, as TE does. The fake backward returns
stale values (random, NaN, Inf) in every dK/dV row, so a call through the ``backends``
consumer shows whether the rows that must be 0 were zeroed, i.e. whether TE's own call site
was patched.

The shipped start-up file is exercised for real: the subprocess calls
``site.addsitedir`` on a temp dir holding a copy of ``src/te_gqa_fix_autopatch.pth``, which
runs its line exactly as site-packages would. One test checks that the installed
distribution contains that file and that it works at interpreter start.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

import _te_gqa_fix_autopatch as boot
import te_gqa_fix.autopatch
from fakes import te_package

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PTH = SRC / boot.PTH_NAME
FUSED_ATTN = "transformer_engine.pytorch.cpp_extensions.fused_attn"
BACKENDS = "transformer_engine.pytorch.attention.dot_product_attention.backends"


def write_fake_te(root: Path, broken: bool = False) -> Path:
    """The one fake TE (``fakes.te_package``); ``broken``: its ``fused_attn`` module lacks
    ``fused_attn_bwd``, so ``te_gqa_fix.install()`` must fail."""
    return te_package.write_fake_te(root, signature=None if broken else "2.20")


_PROBE = """
import json, sys

def _probe():
    out = {
        "te_gqa_fix_imported": "te_gqa_fix" in sys.modules,
        "boot_imported": "_te_gqa_fix_autopatch" in sys.modules,
        "hooks": sum(1 for f in sys.meta_path if getattr(f, "__te_gqa_fix_import_hook__", False)),
    }
    fa = sys.modules.get("@FUSED_ATTN@")
    be = sys.modules.get("@BACKENDS@")
    if fa is not None and be is not None:
        out["defining_patched"] = bool(getattr(fa.fused_attn_bwd, "__te_gqa_fix_wrapper__", False))
        out["consumer_patched"] = bool(getattr(be.fused_attn_bwd, "__te_gqa_fix_wrapper__", False))
        import inspect, torch
        i32 = dict(dtype=torch.int32)
        q = torch.randn(12, 2, 8)
        k = torch.randn(12, 1, 8)
        arguments = {
            n: p.default for n, p in inspect.signature(fa.fused_attn_bwd).parameters.items()
        }
        arguments.update(
            max_seqlen_q=64, max_seqlen_kv=64, cu_seqlens_q=torch.tensor([0, 0, 3], **i32),
            cu_seqlens_kv=torch.tensor([0, 3, 9], **i32), q=q, k=k, v=k.clone(), o=q.clone(),
            d_o=q.clone(), fake_dtype=torch.float16, aux_ctx_tensors=[],
            fused_attention_backend="F16_arbitrary_seqlen",
            cu_seqlens_q_padded=torch.tensor([0, 4, 12], **i32),
            cu_seqlens_kv_padded=torch.tensor([0, 4, 12], **i32),
            qkv_layout="thd_thd_thd", dqkv_layout="thd_thd_thd",
            attn_mask_type="padding_causal", window_size=(-1, 0),
        )
        grads = be.backward(arguments)  # TE's consumer: every argument positional
        dk, dv = grads[1], grads[2]
        out["dk_rows"] = [bool((dk[r] == 0).all()) for r in range(12)]
        out["dv_rows"] = [bool((dv[r] == 0).all()) for r in range(12)]
        out["loader_type"] = type(sys.modules["transformer_engine.pytorch"].__loader__).__name__
        out["loader_exec_overridden"] = "exec_module" in vars(
            sys.modules["transformer_engine.pytorch"].__loader__)
    if out["boot_imported"]:
        out["state"] = sys.modules["_te_gqa_fix_autopatch"].state()
    print("PROBE" + json.dumps(out))
""".replace("@FUSED_ATTN@", FUSED_ATTN).replace("@BACKENDS@", BACKENDS)

# Seed batch, padding_causal (top-left): sequence 0 has no queries (rows 0-3: 0),
# sequence 1 has 3 queries and 6 keys, so keys 0-2 (rows 4-6) are attended and rows 7-11
# (keys 3-5 outside the causal window, then padding) must be 0. The fake TE returns stale
# (non-zero, NaN, Inf) values in every row; a row reads True when it is all zeros.
EXPECTED_FIXED_ROWS = [True] * 4 + [False] * 3 + [True] * 5
UNPATCHED_ROWS = [False] * 12


def run_python(
    code: str,
    tmp_path: Path,
    env: Optional[Dict[str, str]] = None,
    broken: bool = False,
    pth_dir: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the fake TE and ``src`` importable.

    ``{pth_dir}`` in ``code`` is replaced by a directory holding a copy of the shipped
    start-up file (for ``site.addsitedir``). TE_GQA_FIX* variables of this process are
    dropped; ``env`` adds the test's own.
    """
    fake = write_fake_te(tmp_path / ("fake_broken" if broken else "fake"), broken=broken)
    pdir = tmp_path / "site_dir"
    if pth_dir:
        pdir.mkdir(exist_ok=True)
        shutil.copy(PTH, pdir / PTH.name)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TE_GQA_FIX")}
    full_env["PYTHONPATH"] = os.pathsep.join(
        [*te_package.pythonpath(fake), str(SRC)]
        + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
    )
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code.replace("{pth_dir}", repr(str(pdir)))],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def probe_output(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0][len("PROBE") :])


ADDSITE = "import site; site.addsitedir({pth_dir})\n"
IMPORT_TE = "import transformer_engine.pytorch\n"


@pytest.mark.parametrize("value", [None, "", "0", "off", "false"])
def test_unset_or_off_imports_nothing_and_leaves_te_untouched(
    tmp_path: Path, value: Optional[str]
) -> None:
    env = {} if value is None else {boot.ENV_AUTOPATCH: value}
    proc = run_python(ADDSITE + IMPORT_TE + _PROBE + "_probe()\n", tmp_path, env)
    out = probe_output(proc)
    assert out["te_gqa_fix_imported"] is False
    assert out["boot_imported"] is False
    assert out["hooks"] == 0
    assert out["defining_patched"] is False
    assert out["consumer_patched"] is False
    assert out["dk_rows"] == UNPATCHED_ROWS  # TE's stale rows reach the caller
    assert out["loader_exec_overridden"] is False


@pytest.mark.parametrize("value", ["1", "on", "strict"])
def test_set_patches_when_te_is_imported_later(tmp_path: Path, value: str) -> None:
    code = (
        ADDSITE
        + "import sys\n"
        + "before = ('te_gqa_fix' in sys.modules, '_te_gqa_fix_autopatch' in sys.modules)\n"
        + "print('BEFORE', before)\n"
        + IMPORT_TE
        + _PROBE
        + "_probe()\n"
    )
    proc = run_python(code, tmp_path, {boot.ENV_AUTOPATCH: value})
    out = probe_output(proc)
    # Only the stdlib hook is loaded at start-up; te_gqa_fix (and torch) come with TE.
    assert "BEFORE (False, True)" in proc.stdout
    assert out["hooks"] == 1
    assert out["defining_patched"] is True
    assert out["consumer_patched"] is True  # the by-name import in backends.py too
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS
    assert out["dv_rows"] == EXPECTED_FIXED_ROWS
    assert out["state"]["fired"] is True
    assert out["state"]["error"] is None
    assert BACKENDS + ".fused_attn_bwd" in out["state"]["sites"]
    # TE's loader keeps its type, and the hook's override is gone after the import.
    assert out["loader_type"] == "SourceFileLoader"
    assert out["loader_exec_overridden"] is False


def test_te_imported_before_the_hook_activates(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        + IMPORT_TE
        + "assert 'te_gqa_fix' not in sys.modules\n"
        + f"os.environ[{boot.ENV_AUTOPATCH!r}] = '1'\n"
        + ADDSITE
        + _PROBE
        + "_probe()\n"
    )
    out = probe_output(run_python(code, tmp_path))
    assert out["consumer_patched"] is True
    assert out["defining_patched"] is True
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS
    assert out["state"]["fired"] is True


def test_activation_is_idempotent(tmp_path: Path) -> None:
    code = (
        ADDSITE
        + ADDSITE  # the same site dir processed twice
        + "import _te_gqa_fix_autopatch as b; b.activate(); b.enable()\n"
        + IMPORT_TE
        + "b.enable()\n"  # TE imported, already installed: nothing new
        + "import importlib, te_gqa_fix.wrapper as w\n"
        + f"fa = importlib.import_module({FUSED_ATTN!r})\n"
        + "assert not w.is_wrapper(fa.fused_attn_bwd.__wrapped__)  # never a wrapper of a wrapper\n"
        + _PROBE
        + "_probe()\n"
    )
    out = probe_output(run_python(code, tmp_path, {boot.ENV_AUTOPATCH: "1"}))
    assert out["hooks"] == 1
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS


def test_failure_is_logged_and_the_program_continues(tmp_path: Path) -> None:
    code = (
        ADDSITE
        + IMPORT_TE
        + "import transformer_engine.pytorch as tp\n"
        + "print('IMPORTED', tp.__name__)\n"
        + "import _te_gqa_fix_autopatch as b\n"
        + "print('ERROR', b.state()['error'])\n"
    )
    proc = run_python(code, tmp_path, {boot.ENV_AUTOPATCH: "1"}, broken=True)
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED transformer_engine.pytorch" in proc.stdout
    assert "ERROR ImportError" in proc.stdout
    assert "could not be installed" in proc.stderr  # the warning reaches stderr by default
    assert "WITHOUT the fix" in proc.stderr


def test_strict_turns_a_failure_into_an_import_error(tmp_path: Path) -> None:
    code = (
        ADDSITE
        + "try:\n    import transformer_engine.pytorch\n"
        + "except ImportError as exc:\n    print('RAISED', exc)\n"
        + "else:\n    print('NOT RAISED')\n"
    )
    proc = run_python(code, tmp_path, {boot.ENV_AUTOPATCH: "strict"}, broken=True)
    assert proc.returncode == 0, proc.stderr
    assert "RAISED te_gqa_fix: TE_GQA_FIX_AUTOPATCH=strict" in proc.stdout
    assert "NOT RAISED" not in proc.stdout


def test_strict_with_te_already_imported_raises_from_enable(tmp_path: Path) -> None:
    code = (
        IMPORT_TE
        + "import _te_gqa_fix_autopatch as b\n"
        + "try:\n    b.enable(strict=True)\n"
        + "except ImportError as exc:\n    print('RAISED', type(exc.__cause__).__name__)\n"
    )
    proc = run_python(code, tmp_path, broken=True)
    assert "RAISED ImportError" in proc.stdout, proc.stdout + proc.stderr


def test_pth_line_matches_the_off_values_of_the_hook() -> None:
    """The .pth line decides alone whether to import anything: it must agree with
    :func:`autopatch_mode` (TE_GQA_FIX_AUTOPATCH) and :func:`te_gqa_fix.cudnn.parse_setting`
    (TE_GQA_FIX_CUDNN) on which values mean off, and read exactly those two variables."""
    import re

    from te_gqa_fix.cudnn import parse_setting

    lines = [ln for ln in PTH.read_text().splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("import os;")
    assert re.findall(r'environ\.get\("(\w+)"', lines[0]) == [boot.ENV_AUTOPATCH, boot.ENV_CUDNN]
    tuples = re.findall(r"in (\([^)]*\))", lines[0])
    assert len(tuples) == 2
    for literal in tuples:
        pth_off = eval(literal)  # the literal tuple in the line
        assert tuple(pth_off) == boot.OFF_VALUES
        for value in pth_off:
            assert boot.autopatch_mode(value) == "off"
            assert parse_setting(value) == (None, False)
    assert boot.autopatch_mode("1") == "on"
    assert boot.autopatch_mode(" Strict ") == "strict"


def test_hook_ignores_other_imports_and_can_be_disabled() -> None:
    saved = list(sys.meta_path)
    try:
        boot.disable()  # in case this interpreter started with TE_GQA_FIX_AUTOPATCH set
        assert not boot.is_enabled()
        boot.enable()
        boot.enable()
        hooks = [f for f in sys.meta_path if getattr(f, "__te_gqa_fix_import_hook__", False)]
        assert len(hooks) == 1 and sys.meta_path[0] is hooks[0]
        assert hooks[0].find_spec("json") is None
        assert hooks[0].find_spec("transformer_engine") is None
        assert boot.disable() is True
        assert not boot.is_enabled()
        assert boot.disable() is False
    finally:
        sys.meta_path[:] = saved


def test_public_module_reports_status(monkeypatch: pytest.MonkeyPatch) -> None:
    from te_gqa_fix import autopatch

    monkeypatch.setenv(autopatch.ENV_AUTOPATCH, "strict")
    st = autopatch.status()
    assert st["env"] == "strict" and st["mode"] == "strict"
    assert set(st) >= {"hook_enabled", "pth", "fired", "sites", "error", "activated_by"}


def _installed_distribution() -> Optional[importlib.metadata.Distribution]:
    try:
        return importlib.metadata.distribution("te-gqa-fix")
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.skipif(
    _installed_distribution() is None,
    reason="te-gqa-fix is not installed (running from a source tree via PYTHONPATH)",
)
def test_installed_distribution_ships_the_start_up_file(tmp_path: Path) -> None:
    dist = _installed_distribution()
    assert dist is not None
    files = {str(f): f for f in (dist.files or [])}
    assert boot.PTH_NAME in files, (
        f"{boot.PTH_NAME} is not among the installed files of te-gqa-fix: the install "
        f"predates it; reinstall (pip install -e .)"
    )
    installed = Path(files[boot.PTH_NAME].locate())
    assert installed.is_file()
    assert installed.read_text() == PTH.read_text()
    assert te_gqa_fix.autopatch.find_pth() == str(installed)
    # And it works at interpreter start, with no addsitedir.
    code = IMPORT_TE + _PROBE + "_probe()\n"
    out = probe_output(run_python(code, tmp_path, {boot.ENV_AUTOPATCH: "1"}, pth_dir=False))
    assert out["consumer_patched"] is True
    assert out["dk_rows"] == EXPECTED_FIXED_ROWS
