"""``install``/``uninstall``/``patched`` against a fake ``transformer_engine`` package.

The fake (``fakes/te_package.py``) is imported from a temporary directory. Its original
``fused_attn_bwd`` raises ``AssertionError("patch did not take ...")`` when a consumer
calls it directly with the marker argument, so every consumer that still holds the
original after ``install()`` fails loudly instead of silently skipping the fix.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

import te_gqa_fix
from fakes import te_package
from fakes.oracle import make_ragged
from fakes.te_outputs import assert_post_pass, call_arguments
from te_gqa_fix import install, is_installed, patched, uninstall
from te_gqa_fix.wrapper import is_wrapper, wrapper_for

RAGGED = make_ragged(
    [(2, 4), (0, 3), (3, 2)], gaps_q=[1, 0, 1], gaps_kv=[0, 2, 1], lead_kv=1, tail_kv=2
)
PRELOADED = ("backends", "context_parallel", "framework")


def _arguments() -> Dict[str, Any]:
    return call_arguments("2.20", RAGGED, backend=te_package.MUST_BE_PATCHED)


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


def _holders(mods: Dict[str, Any]) -> Dict[str, Any]:
    """What each site currently holds under the name its module uses."""
    return {key: getattr(module, _name(key)) for key, module in mods.items()}


def _assert_fixed(out: List[Any]) -> None:
    assert out is te_package.BACKEND.returned
    assert_post_pass(te_package.BACKEND.outputs, RAGGED, "padding_causal", (-1, -1), None)


def test_install_rebinds_every_consumer(fake_te: Path) -> None:
    """Once: a second install rebinds nothing (no wrapper of a wrapper, one post-pass)."""
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    assert not is_installed()

    sites = install()

    assert is_installed() and install() == [], "a second install must not rebind anything"
    assert set(sites) == {f"{module.__name__}.{_name(key)}" for key, module in mods.items()}, sites
    holders = _holders(mods)
    wrapper = holders["fused_attn"]
    assert is_wrapper(wrapper) and wrapper.__wrapped__ is original
    for key, fn in holders.items():
        assert fn is wrapper, key
    for key in PRELOADED:
        te_package.BACKEND.reset()
        out = mods[key].backward(_arguments())  # the marker now passes: through the wrapper
        _assert_fixed(out)
    assert te_package.DIRECT_CALLERS == []
    assert te_gqa_fix.call_counts()["fixed"] == len(PRELOADED)


def test_uninstall_restores_exactly_the_originals(fake_te: Path) -> None:
    mods = _import_te()
    before = _holders(mods)
    original = before["fused_attn"]
    install()
    restored = uninstall()
    assert not is_installed()
    assert len(restored) == 5, restored
    after = _holders(mods)
    for key in before:
        assert after[key] is before[key] is original, key
    assert uninstall() == [], "uninstall when not installed is a no-op"
    # The original is back: consumers reach it directly again (and the fake says so).
    with pytest.raises(AssertionError, match="patch did not take"):
        mods["context_parallel"].backward(_arguments())


def test_consumer_imported_after_install(fake_te: Path) -> None:
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    install()
    late = importlib.import_module(te_package.CONSUMERS["late"])
    assert late.fused_attn_bwd is mods["fused_attn"].fused_attn_bwd
    out = late.backward(_arguments())
    _assert_fixed(out)
    restored = uninstall()
    assert f"{te_package.CONSUMERS['late']}.fused_attn_bwd" in restored
    assert late.fused_attn_bwd is original
    with pytest.raises(AssertionError, match="patch did not take"):
        late.backward(_arguments())


def test_install_imports_te_itself(fake_te: Path) -> None:
    # Nothing imported beforehand: install() loads transformer_engine.pytorch (and so the
    # consumers it imports) and patches them.
    assert te_package.DEFINING not in sys.modules
    sites = install()
    assert f"{te_package.CONSUMERS['backends']}.fused_attn_bwd" in sites
    backends = sys.modules[te_package.CONSUMERS["backends"]]
    _assert_fixed(backends.backward(_arguments()))


def test_patched_context_manager(fake_te: Path) -> None:
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    with patched() as sites:
        assert is_installed() and len(sites) == 5
        _assert_fixed(mods["backends"].backward(_arguments()))
        with patched() as inner:
            assert inner == [] and is_installed()
        assert is_installed(), "the inner block must not uninstall the outer one"
    assert not is_installed()
    for key, fn in _holders(mods).items():
        assert fn is original, key
    with pytest.raises(RuntimeError, match="boom"), patched():  # and on an error
        assert is_installed()
        raise RuntimeError("boom")
    assert not is_installed()
    assert mods["backends"].fused_attn_bwd is original


def test_install_inside_patched_lasts(fake_te: Path) -> None:
    # An explicit install() inside the block asks for a lasting patch: the exit keeps it.
    mods = _import_te()
    with patched():
        install()
    assert is_installed()
    _assert_fixed(mods["backends"].backward(_arguments()))
    with patched():  # and a later block leaves it too
        pass
    assert is_installed()
    uninstall()
    with patched():  # uninstall() ended it: a block alone is undone again
        pass
    assert not is_installed()


@pytest.mark.parametrize("installed_before", [True, False])
def test_install_after_a_reload_rebinds_every_site(fake_te: Path, installed_before: bool) -> None:
    # importlib.reload makes a new fused_attn_bwd; every importer still holds the earlier
    # one (or our wrapper of it). install() must rebind them all to the new one's wrapper.
    mods = _import_te()
    if installed_before:
        install()
    fresh = importlib.reload(mods["fused_attn"]).fused_attn_bwd
    assert not is_installed(), "the defining module holds the new, unwrapped function"
    sites = install()
    assert is_installed() and len(sites) == 5, sites
    for key, fn in _holders(mods).items():
        assert is_wrapper(fn) and fn.__wrapped__ is fresh, key
    for key in PRELOADED:
        te_package.BACKEND.reset()
        _assert_fixed(mods[key].backward(_arguments()))
    uninstall()
    assert all(fn is fresh for fn in _holders(mods).values())


def test_is_installed_only_for_the_function_defined_now(fake_te: Path) -> None:
    mods = _import_te()
    install()
    old_wrapper = mods["fused_attn"].fused_attn_bwd
    importlib.reload(mods["fused_attn"])
    install()
    mods["fused_attn"].fused_attn_bwd = old_wrapper  # our wrapper, of the earlier function
    assert not is_installed()


def test_each_site_logged_once(fake_te: Path, caplog: pytest.LogCaptureFixture) -> None:
    _import_te()
    with caplog.at_level(logging.INFO, logger="te_gqa_fix"):
        install()
        uninstall()
        install()
    site = f"{te_package.CONSUMERS['backends']}.fused_attn_bwd"
    assert len([r for r in caplog.records if r.getMessage().endswith(site)]) == 1


def test_drop_in_function_uses_installed_te(fake_te: Path) -> None:
    mods = _import_te()
    original = mods["fused_attn"].fused_attn_bwd
    out = te_gqa_fix.fused_attn_bwd(**_arguments())  # reaches TE through the wrapper
    _assert_fixed(out)
    # Positional, like TE's own call sites.
    te_package.BACKEND.reset()
    args = _arguments()
    order = list(inspect.signature(original).parameters)
    _assert_fixed(te_gqa_fix.fused_attn_bwd(*[args[n] for n in order]))
    assert te_gqa_fix.call_counts()["fixed"] == 2
    # It shares the wrapper install() puts in place: no wrapper of a wrapper, one post-pass.
    install()
    assert mods["fused_attn"].fused_attn_bwd is wrapper_for(original)
    te_package.BACKEND.reset()
    _assert_fixed(te_gqa_fix.fused_attn_bwd(**_arguments()))
    assert te_gqa_fix.call_counts()["calls"] == 3
    assert te_package.DIRECT_CALLERS == []


def test_install_without_symbol_raises_clear_error(
    fake_te: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "broken"
    te_package.write_fake_te(broken, signature=None)
    monkeypatch.syspath_prepend(str(broken))
    importlib.invalidate_caches()
    with pytest.raises(ImportError, match="has no attribute 'fused_attn_bwd'"):
        install()
    assert not is_installed()


ROOT_API = {
    "__version__", "call_counts", "check_offset_errors", "dead_row_masks", "fused_attn_bwd",
    "get_te_version", "install", "is_installed", "patched", "reset_call_counts", "uninstall",
    "use_fixed_cudnn", "zero_dead_rows",
}  # fmt: skip
#: Helpers public in their submodules (``te_gqa_fix.<module>.<name>``), not at the root.
SUBMODULE_API = (
    "masks.key_interval masks.KNOWN_MASK_TYPES settings.get settings.SettingError "
    "stack.affected.why_unrepairable wrapper.wrapper_for patch.find_original"
).split()


def test_root_exports_only_the_user_api() -> None:
    """The root is what users call; helpers live (public) in their submodules."""
    assert set(te_gqa_fix.__all__) == ROOT_API
    for name in ROOT_API - {"__version__"}:
        assert callable(getattr(te_gqa_fix, name)), name
    for module, _, name in (path.rpartition(".") for path in SUBMODULE_API):
        assert name not in te_gqa_fix.__all__
        assert hasattr(importlib.import_module(f"te_gqa_fix.{module}"), name), name
    with pytest.raises(AttributeError):
        te_gqa_fix.make_wrapper  # noqa: B018  - the uncached constructor is private now


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
    assert {"wrapper", "cli.doctor", "cli"} <= set(edges)
    assert {"settings", "stack.affected"} <= edges["wrapper"] and "wrapper" in edges["patch"]

    def reaches(start: str, goal: str, seen: set) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(m for m in edges if reaches(m, m, {m}))
    assert cycles == [], f"modules on an import cycle: {cycles}"
