"""``install``/``uninstall``/``is_installed``/``patched`` against a fake ``transformer_engine``.

The fake (``fakes/te_package.py``) is imported from a temporary directory. Its original
``fused_attn_bwd`` raises ``AssertionError("patch did not take ...")`` when a consumer calls
it directly with the marker argument, so every consumer that still holds TE's function after
``install()`` fails loudly instead of silently skipping the fix. Its "stale" kernel returns
bit-exact stale values in every row, so a row the wrapper failed to zero is visible.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import te_gqa_fix
from fakes import te_package
from fakes.oracle import make_ragged
from fakes.te_outputs import assert_post_pass, call_arguments
from te_gqa_fix import SetupError, install, is_installed, patched, uninstall
from te_gqa_fix.wrapper import chain, is_wrapper

#: A sequence without queries (the bug's rows), padding between sequences, a leading row
#: and tail rows.
RAGGED = make_ragged(
    [(2, 4), (0, 3), (3, 2)], gaps_q=[1, 0, 1], gaps_kv=[0, 2, 1], lead_kv=1, tail_kv=2
)
PRELOADED = ("backends", "context_parallel", "framework")


def _arguments(marked: bool = True) -> Dict[str, Any]:
    backend = te_package.MUST_BE_PATCHED if marked else "F16_arbitrary_seqlen (fake)"
    return call_arguments("2.20", RAGGED, backend=backend)


def _import_te() -> Dict[str, Any]:
    """Import the fake TE and the framework module (consumers loaded before install)."""
    importlib.import_module("transformer_engine.pytorch")
    importlib.import_module("fake_framework.attn")
    return {
        "fused_attn": sys.modules[te_package.DEFINING],
        "cpp_extensions": sys.modules[te_package.REEXPORT],
        **{key: sys.modules[te_package.CONSUMERS[key]] for key in PRELOADED},
    }


def _name(key: str) -> str:
    """The name a site's module holds TE's function under."""
    return "te_fused_attn_bwd" if key == "framework" else "fused_attn_bwd"


def _sites(mods: Dict[str, Any]) -> set:
    return {f"{module.__name__}.{_name(key)}" for key, module in mods.items()}


def _holders(mods: Dict[str, Any]) -> Dict[str, Any]:
    """What each site currently holds under the name its module uses."""
    return {key: getattr(module, _name(key)) for key, module in mods.items()}


def _assert_fixed(out: List[Any]) -> None:
    assert out is te_package.BACKEND.returned
    assert_post_pass(te_package.BACKEND.outputs, RAGGED, "padding_causal", (-1, -1), None)


def _through_each_consumer(mods: Dict[str, Any]) -> None:
    """Each preloaded consumer's backward reaches TE through the wrapper: rows exact."""
    for key in PRELOADED:
        te_package.BACKEND.reset()
        _assert_fixed(mods[key].backward(_arguments()))
    assert te_package.DIRECT_CALLERS == []


def _records(caplog: pytest.LogCaptureFixture, level: int) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == "te_gqa_fix" and r.levelno == level]


# ------------------------------------------------------------------ install, uninstall


def test_install_rebinds_every_consumer_once(fake_te: Path) -> None:
    """Every site holding TE's function gets one wrapper; a second install rebinds nothing
    (no wrapper of a wrapper, so one post-pass per call)."""
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    assert not is_installed()
    sites = install()
    assert is_installed() and install() == [], "a second install must not rebind anything"
    assert sorted(sites) == sorted(_sites(mods))
    wrapper = mods["fused_attn"].fused_attn_bwd
    assert is_wrapper(wrapper) and wrapper.__wrapped__ is original
    assert all(fn is wrapper for fn in _holders(mods).values())
    _through_each_consumer(mods)
    assert te_gqa_fix.call_counts()["fixed"] == len(PRELOADED)


def test_uninstall_restores_exactly_the_originals(fake_te: Path) -> None:
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    install()
    assert sorted(uninstall()) == sorted(_sites(mods))
    assert not is_installed()
    assert all(fn is original for fn in _holders(mods).values())
    assert uninstall() == [], "uninstall when not installed is a no-op"
    # The original is back: consumers reach it directly again (and the fake says so).
    with pytest.raises(AssertionError, match="patch did not take"):
        mods["context_parallel"].backward(_arguments())


def test_consumer_imported_after_install(fake_te: Path) -> None:
    """A module imported after install() takes the wrapper from the rebound defining module;
    uninstall() gives it TE's function back too."""
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    install()
    late = importlib.import_module(te_package.CONSUMERS["late"])
    assert late.fused_attn_bwd is mods["fused_attn"].fused_attn_bwd
    _assert_fixed(late.backward(_arguments()))
    restored = uninstall()
    assert f"{te_package.CONSUMERS['late']}.fused_attn_bwd" in restored
    assert late.fused_attn_bwd is original
    with pytest.raises(AssertionError, match="patch did not take"):
        late.backward(_arguments())


def test_install_imports_te_itself(fake_te: Path) -> None:
    """Nothing imported beforehand: install() loads transformer_engine.pytorch (and so the
    consumers it imports) and patches them."""
    assert te_package.DEFINING not in sys.modules
    sites = install()
    assert f"{te_package.CONSUMERS['backends']}.fused_attn_bwd" in sites
    backends = sys.modules[te_package.CONSUMERS["backends"]]
    _assert_fixed(backends.backward(_arguments()))
    assert is_installed()


def test_a_module_under_two_names_is_one_site(
    fake_te: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A module listed twice in ``sys.modules`` (an alias such as ``__mp_main__``) holds
    each attribute once: install() names it once, and counts it once."""
    mods = _import_te()
    monkeypatch.setitem(sys.modules, "alias_of_backends", mods["backends"])
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        sites = install()
    assert sorted(sites) == sorted(_sites(mods))
    (said,) = _records(caplog, logging.INFO)
    assert f"{len(_sites(mods))} call sites" in said, said


def test_patched_context_manager(fake_te: Path) -> None:
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    with patched() as sites:
        assert is_installed() and sorted(sites) == sorted(_sites(mods))
        _assert_fixed(mods["backends"].backward(_arguments()))
        with patched() as inner:
            assert inner == [] and is_installed()
        assert is_installed(), "the inner block must not uninstall the outer one"
    assert not is_installed()
    assert all(fn is original for fn in _holders(mods).values())
    with pytest.raises(RuntimeError, match="boom"), patched():  # and on an error
        assert is_installed()
        raise RuntimeError("boom")
    assert not is_installed()
    assert mods["backends"].fused_attn_bwd is original


def test_install_inside_patched_lasts(fake_te: Path) -> None:
    """An explicit install() inside the block asks for a lasting patch: the exit keeps it;
    an install() before a block is kept too; uninstall() ends it."""
    mods = _import_te()
    with patched():
        install()
    assert is_installed()
    _assert_fixed(mods["backends"].backward(_arguments()))
    with patched():
        pass
    assert is_installed()
    uninstall()
    with patched():  # uninstall() ended it: a block alone is undone again
        pass
    assert not is_installed()


@pytest.mark.parametrize("installed_before", [True, False])
def test_install_after_a_reload_rebinds_every_site(fake_te: Path, installed_before: bool) -> None:
    """``importlib.reload`` makes a new fused_attn_bwd; every importer still holds the
    earlier one (or the wrapper of it). install() rebinds them all to the new one's wrapper;
    uninstall() gives them the new one."""
    mods = _import_te()
    if installed_before:
        install()
    fresh = importlib.reload(mods["fused_attn"]).fused_attn_bwd
    assert not is_installed(), "the defining module holds the new, unwrapped function"
    sites = install()
    assert is_installed() and sorted(sites) == sorted(_sites(mods))
    for key, fn in _holders(mods).items():
        assert is_wrapper(fn) and fn.__wrapped__ is fresh, key
    _through_each_consumer(mods)
    uninstall()
    assert all(fn is fresh for fn in _holders(mods).values())


def test_is_installed_only_for_the_function_defined_now(fake_te: Path) -> None:
    mods = _import_te()
    install()
    old_wrapper = mods["fused_attn"].fused_attn_bwd
    importlib.reload(mods["fused_attn"])
    install()
    assert is_installed()
    mods["fused_attn"].fused_attn_bwd = old_wrapper  # the wrapper of the earlier function
    assert not is_installed()


def test_install_without_symbol_raises_clear_error(
    fake_te: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken"
    te_package.write_fake_te(broken, signature=None)
    monkeypatch.syspath_prepend(str(broken))
    importlib.invalidate_caches()
    with pytest.raises(SetupError, match="has no attribute 'fused_attn_bwd'"):
        install()
    assert not is_installed()


@pytest.fixture
def no_te(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``transformer_engine`` unimportable, whether or not it is installed."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("transformer_engine", "transformer_engine_torch"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    import importlib.metadata as metadata

    def not_found(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_found)


def test_without_te_install_and_the_drop_in_say_how_to_install_it(no_te: None) -> None:
    """Without TE: install() and the drop-in raise an ImportError saying how to install it;
    the rest works (the post-pass on gradients the caller has)."""
    from te_gqa_fix import _te

    for call in (install, lambda: te_gqa_fix.fused_attn_bwd(1, 2, 3)):
        with pytest.raises(SetupError, match=r"pip install 'transformer-engine\[pytorch\]"):
            call()
    assert issubclass(SetupError, ImportError)
    assert te_gqa_fix.is_installed() is False and te_gqa_fix.uninstall() == []
    assert _te.te_version() is None and _te.te_cudnn_version() is None
    dk, dv = torch.full((4, 1, 1), 7.0), torch.full((4, 1, 1), 7.0)
    cu_q, cu_kv = (torch.tensor(x, dtype=torch.int32) for x in ([0, 0, 2], [0, 2, 4]))
    te_gqa_fix.zero_dead_rows(None, dk, dv, cu_q, cu_kv)
    assert dk.flatten().tolist() == dv.flatten().tolist() == [0.0, 0.0, 7.0, 7.0]


# ------------------------------------------------- another library's wrapper (issue 51)


def test_install_follows_another_librarys_wraps_wrapper(fake_te: Path) -> None:
    """After TE's callers imported TE's function by name, another library (a profiler, an
    NVTX shim) replaced it in TE's module with a ``functools.wraps`` wrapper. install()
    rebinds every site holding any link of that chain: TE's callers get exact rows, the
    wrapped site still runs the other library's wrapper, and uninstall() gives each site
    its own object back."""
    mods = _import_te()
    te_fn = mods["fused_attn"].fused_attn_bwd
    profiled: List[str] = []

    @functools.wraps(te_fn)
    def nvtx_range(*args: Any, **kwargs: Any) -> Any:
        profiled.append("range")
        return te_fn(*args, **kwargs)

    mods["fused_attn"].fused_attn_bwd = nvtx_range
    before = _holders(mods)
    assert sorted(install()) == sorted(_sites(mods))
    assert is_installed()
    _through_each_consumer(mods)  # backends and context_parallel held TE's own function
    assert profiled == []
    te_package.BACKEND.reset()
    _assert_fixed(mods["fused_attn"].fused_attn_bwd(**_arguments(marked=False)))
    assert profiled == ["range"], "the other library's wrapper no longer runs"
    assert chain(mods["fused_attn"].fused_attn_bwd)[1:] == [nvtx_range, te_fn]
    uninstall()
    after = _holders(mods)
    assert all(after[key] is before[key] for key in before), after
    assert not is_installed()


def test_a_call_site_that_hides_tes_function_is_not_installed(
    fake_te: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A call site of TE holding something whose ``__wrapped__`` chain does not reach TE's
    function (a plain lambda around it): install() cannot reach it, so is_installed() says
    False and one WARNING names the site."""
    mods = _import_te()
    te_fn = mods["fused_attn"].fused_attn_bwd
    mods["backends"].fused_attn_bwd = lambda *args, **kwargs: te_fn(*args, **kwargs)
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        install()
        install()
    assert not is_installed()
    (said,) = _records(caplog, logging.WARNING)
    assert f"{te_package.CONSUMERS['backends']}.fused_attn_bwd" in said, said
    assert te_package.CONSUMERS["context_parallel"] not in said, said


def test_te_call_sites_not_loaded_is_not_installed(
    tmp_path: Path, fake_te: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TE imported, but its call sites not loaded (a TE that moved them): te-gqa-fix cannot
    tell what TE calls, so is_installed() says False, with a WARNING naming them."""
    bare = tmp_path / "bare"
    te_package.write_fake_te(bare, consumers=False)
    monkeypatch.syspath_prepend(str(bare))
    importlib.invalidate_caches()
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        install()
    assert not is_installed()
    (said,) = _records(caplog, logging.WARNING)
    assert all(site in said for site in (te_package.CONSUMERS["backends"],
                                          te_package.CONSUMERS["context_parallel"])), said  # fmt: skip


# ---------------------------------------------------------------- logs (issue 53)


def test_install_logs_one_info_line_per_call_without_a_prefix(
    fake_te: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One INFO line per install() call, not one per site; messages carry no hand-written
    "te_gqa_fix: " prefix (the logger's name says it)."""
    mods = _import_te()
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        install()
        first = _records(caplog, logging.INFO)
        uninstall()
        install()
    assert len(first) == 1 and f"{len(_sites(mods))} call sites" in first[0], first
    said = _records(caplog, logging.INFO)
    assert len([m for m in said if m.startswith("installed")]) == 2, said
    assert not any(site in m for m in said for site in _sites(mods)), said
    assert not any(r.getMessage().startswith("te_gqa_fix") for r in caplog.records)


@pytest.mark.parametrize("via", ["install", "drop-in"])
@pytest.mark.parametrize("version", ["2.8.0", "2.20.2"])
def test_a_te_not_validated_on_a_gpu_is_warned_of_once(
    version: str,
    via: str,
    tmp_path: Path,
    fake_te: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TE 2.20 was validated on a GPU; another release gets one WARNING naming it, at the
    first install or the drop-in's first look at TE (later ones say nothing new)."""
    other = tmp_path / "other"
    te_package.write_fake_te(other, version=version)
    monkeypatch.syspath_prepend(str(other))
    importlib.invalidate_caches()
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        if via == "install":
            install()
            uninstall()
            install()
        else:
            for _ in range(2):
                with pytest.raises(TypeError):  # no arguments: TE's own call refuses it
                    te_gqa_fix.fused_attn_bwd()
    said = _records(caplog, logging.WARNING)
    if version == "2.20.2":
        assert said == []
    else:
        assert len(said) == 1 and version in said[0] and "2.20" in said[0], said


# ----------------------------------------------------------------------- the package

ROOT_API = {
    "__version__", "call_counts", "check_offset_errors", "dead_row_masks", "fused_attn_bwd",
    "install", "is_installed", "patched", "reset_call_counts", "status", "uninstall",
    "use_fixed_cudnn", "zero_dead_rows",
}  # fmt: skip
ROOT_ERRORS = {
    "TeGqaFixError", "InputError", "InputTypeError", "OffsetsError", "SettingError",
    "UnrepairableConfiguration", "SetupError", "CudnnRefused", "CudnnLoadError",
    "CudnnAlreadyLoaded",
}  # fmt: skip
#: Helpers public in their modules (``te_gqa_fix.<module>.<name>``), not at the root.
SUBMODULE_API = (
    "wrapper.wrapper_for wrapper.chain wrapper.Signature _te.te_version rules.judge rules.decide "
    "settings.per_call masks.key_span patch.installed_sites"
).split()


def test_root_exports_only_the_user_api() -> None:
    """The root is what users call, and the exceptions; helpers live in their modules."""
    assert set(te_gqa_fix.__all__) == ROOT_API | ROOT_ERRORS
    for name in ROOT_API - {"__version__"}:
        assert callable(getattr(te_gqa_fix, name)), name
    for name in ROOT_ERRORS:
        assert issubclass(getattr(te_gqa_fix, name), Exception), name
    for module, _, name in (path.rpartition(".") for path in SUBMODULE_API):
        assert name not in te_gqa_fix.__all__
        assert hasattr(importlib.import_module(f"te_gqa_fix.{module}"), name), name
    for gone in ("get_te_version", "autopatch", "make_wrapper"):
        with pytest.raises(AttributeError):
            getattr(te_gqa_fix, gone)


def _package_imports() -> Dict[str, set]:
    """Module -> the package modules it imports (dotted, relative to ``te_gqa_fix``; a
    subpackage's ``__init__`` is the subpackage's name): imports inside functions count
    too, and importing ``cli.doctor`` from outside ``cli`` imports ``cli`` first."""
    import ast

    pkg = Path(te_gqa_fix.__file__).parent
    paths = {
        ".".join(p.relative_to(pkg).with_suffix("").parts).removesuffix(".__init__"): p
        for p in pkg.rglob("*.py")
    }
    paths = {name: p for name, p in paths.items() if name not in ("__init__", "__main__")}

    def known(target: str) -> set:
        parts = target.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(paths)

    edges: Dict[str, set] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, *([node.module] if node.module else [])])
            elif (node.module or "").startswith("te_gqa_fix."):
                stem = node.module.partition(".")[2]  # type: ignore[union-attr]
            else:
                continue
            for alias in node.names:
                deps |= known(f"{stem}.{alias.name}".lstrip(".")) | known(stem)
        parts = name.split(".")
        edges[name] = deps - {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return edges


def test_package_has_no_import_cycle() -> None:
    """No module of the package imports one that imports it back (at any depth, counting
    imports inside functions and the ``cli`` subpackage)."""
    edges = _package_imports()
    assert {"wrapper", "patch", "rules", "_te", "cli.doctor", "cli"} <= set(edges)
    assert {"settings", "rules", "_te"} <= edges["wrapper"] and "wrapper" in edges["patch"]

    def reaches(start: str, goal: str, seen: set) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(m for m in edges if reaches(m, m, {m}))
    assert cycles == [], f"modules on an import cycle: {cycles}"
