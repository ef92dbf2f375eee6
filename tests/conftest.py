"""Shared fixtures for the CPU suite: a clean te-gqa-fix state around every test, and the
fixtures more than one test file uses (a fake TE package, doctor's probes, the start-up hook).

te-gqa-fix keeps a little process-wide state on purpose (log-once keys, call counters,
the wrappers and their call-shape caches, the guard's per-device decisions, the patch
registry, the post-pass's recorded offset errors); each test starts from none of it and
from no ``TE_GQA_FIX*`` variable in the environment, so tests cannot leak into each other.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import runpy
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest
import torch

import te_gqa_fix
from te_gqa_fix import _logging, patch, postpass, settings, wrapper

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # ``fakes`` is imported by name (also from the fake TE package)
    sys.path.insert(0, _HERE)

from fakes import background, te_package  # noqa: E402


def _import_without_assertion_rewriting(name: str) -> None:
    """Import ``name`` with pytest's assertion rewriting off for it. pytest rewrites every
    module of a distribution that registers a pytest plugin, hypothesis's ~100 among them,
    and with PYTHONDONTWRITEBYTECODE set (as on the project's machines) it caches nothing:
    1.3 s of every run, before any test, for asserts that are hypothesis's internal
    invariants, not tests. The tests' own modules are rewritten as before."""
    rewriters = [h for h in sys.meta_path if type(h).__name__ == "AssertionRewritingHook"]
    for hook in rewriters:
        sys.meta_path.remove(hook)
    try:
        importlib.import_module(name)
    finally:
        sys.meta_path[:0] = rewriters


_import_without_assertion_rewriting("hypothesis.strategies")

# One intra-op thread: the tests' tensors are small, and the background jobs (below) and
# other processes hold the other core, so torch's pool of one thread a core made every
# small op wait for a descheduled thread (a softmax of 4 x 9 x 9: 3 us alone, 8 ms so).
torch.set_num_threads(1)

# What is alive once torch and the package are imported, again once collection is over
# (the test modules, the items), and after each test file (what its tests left: caches,
# imported modules) mostly lives for the whole session: out of the collector's sight
# (gc.freeze), a full collection no longer walks it. It walked up to ~400,000 objects each
# time, some 20 times a run and 5 more at exit (pytest's unraisable-exception check): 6-9 s
# of the main process. What each file's tests make is collected as before, and what they
# leave unreachable is collected before it is frozen.
gc.freeze()
# At exit, back in sight for the interpreter's last collection: extension modules that check
# for leaks at exit (nanobind's, in Triton) count a frozen object as leaked.
atexit.register(gc.unfreeze)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]):
    result = yield
    if nextitem is None or nextitem.path != item.path:  # the file's fixtures are gone too
        gc.collect()
        gc.freeze()
    return result


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("TE_GQA_FIX"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(wrapper, "_wrappers", {})
    monkeypatch.setattr(wrapper, "_drop_in", None)
    monkeypatch.setattr(wrapper, "_stack", {})
    monkeypatch.setattr(patch, "_lasting", False)
    monkeypatch.setattr(settings, "_per_call", {})
    _reset()
    yield
    _reset()


def _reset() -> None:
    _logging._reset_log_once()
    te_gqa_fix.reset_call_counts()
    for rec in postpass._records.values():
        rec.clear()


@pytest.fixture
def fake_te(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fake ``transformer_engine`` (and ``fake_framework``) importable from ``tmp_path``.

    Whatever was in ``sys.modules`` under those names before is put back afterwards, and
    the patch is uninstalled.
    """
    saved = {name: sys.modules[name] for name in te_package.loaded_fake_modules()}
    for name in saved:
        del sys.modules[name]
    te_package.write_fake_te(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    te_package.BACKEND.reset()
    te_package.DIRECT_CALLERS.clear()
    try:
        yield tmp_path
    finally:
        # uninstall() walks every attribute of every loaded module (~2,400 by then: 50 ms)
        # even when there is nothing to restore; where install() left no site and no TE
        # function (never installed, or uninstalled already) it would change nothing.
        if patch._sites or patch._te_function is not None:
            patch.uninstall()
        for name in te_package.loaded_fake_modules():
            del sys.modules[name]
        sys.modules.update(saved)
        te_package.BACKEND.reset()
        te_package.DIRECT_CALLERS.clear()


@pytest.fixture
def doctor_probes(monkeypatch: pytest.MonkeyPatch) -> Callable[..., List[str]]:
    """``doctor_probes(te_cudnn, installed=False, live=None, fallback_declines=None)`` makes
    ``doctor`` see one Hopper GPU, TE 2.20.2 running cuDNN ``te_cudnn``, torch with cuDNN
    9.19.0, no cuDNN mapped or on disk, the fix installed or not, and the exact fallback
    declining with ``fallback_declines`` (None: serving); it returns the list its live
    check (returning ``live``, default: bug seen and fixed) appends "live" to."""
    from te_gqa_fix import cudnn_route, fallback
    from te_gqa_fix.cli import doctor

    def probes(
        te_cudnn: str,
        installed: bool = False,
        live: Optional[dict] = None,
        fallback_declines: Optional[str] = None,
    ) -> List[str]:
        calls: List[str] = []
        gpu = {"available": True, "count": 1, "name": "Fake H200", "capability": [9, 0]}
        monkeypatch.setattr(doctor, "gpu_info", lambda: dict(gpu))
        te = {"version": "2.20.2", "imported": True, "cudnn": te_cudnn, "error": None}
        monkeypatch.setattr(doctor, "te_info", lambda: dict(te))
        torch_info = {"version": "2.11.0", "cuda": "13.0", "cudnn": "9.19.0"}
        monkeypatch.setattr(doctor, "torch_info", lambda: dict(torch_info))
        monkeypatch.setattr(cudnn_route, "mapped_cudnn_libraries", lambda: [])
        monkeypatch.setattr(cudnn_route, "find_builds", lambda: [])
        monkeypatch.setattr(fallback, "head_dim_reason", lambda d, d_v=None: fallback_declines)
        live_result = live or {"ran": True, "bug_observed": True, "fix_ok": True}
        monkeypatch.setattr(
            doctor, "live_check", lambda large_head_dim=False: calls.append("live") or live_result
        )
        monkeypatch.setattr(patch, "is_installed", lambda: installed)
        return calls

    return probes


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch):
    """The start-up hook module with a fresh record and ``sys.meta_path``, both put back
    afterwards."""
    import _te_gqa_fix_autopatch as boot
    from te_gqa_fix import cudnn_route

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    boot.disable()  # in case this interpreter started with TE_GQA_FIX_AUTOPATCH set,
    boot._remove(boot._CUDNN_MARKER)  # or TE_GQA_FIX_CUDNN
    boot._remove(boot._REFUSE_MARKER)
    monkeypatch.setattr(boot, "_state", runpy.run_path(boot.__file__)["_state"])
    assert not any(boot.state().values()), boot.state()  # a new process's: nothing done yet
    cudnn_route._reset_route()
    return boot


# Slow subprocesses (tests/fakes/background.py): each starts as soon as a test that reads
# it is collected, on the core collection leaves idle (the job of test_kernel.py, the run's
# longest, some 2 s sooner than at the end of collection), and is read by tests that run
# last, so that the jobs use the second core meanwhile. A job no selected test reads (-k,
# -m) is ended when collection is over.


def _jobs(item: pytest.Item) -> list:
    return [name for name in getattr(item, "fixturenames", ()) if name in background.STARTERS]


def pytest_itemcollected(item: pytest.Item) -> None:
    if not item.config.option.collectonly:
        for name in _jobs(item):
            background.get(name)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: bool(_jobs(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        needed = {name for item in session.items for name in _jobs(item)}
        for name in set(background.started()) - needed:
            background.stop(name)
        for name in needed:
            background.get(name)
    gc.freeze()  # see gc.freeze() above


def pytest_sessionfinish() -> None:
    background.stop_all()
