"""Shared fixtures for the CPU suite: a clean te-gqa-fix state around every test.

te-gqa-fix keeps a little process-wide state on purpose (log-once keys, call counters,
the wrappers and their call-shape caches, the guard's per-device decisions, the patch
registry, the post-pass's recorded offset errors); each test starts from none of it and
from no ``TE_GQA_FIX*`` variable in the environment, so tests cannot leak into each other.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

import te_gqa_fix
from te_gqa_fix import _logging, patch, wrapper
from te_gqa_fix.postpass import offset_errors
from te_gqa_fix.stack import affected

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # ``fakes`` is imported by name (also from the fake TE package)
    sys.path.insert(0, _HERE)

from fakes import background, te_package  # noqa: E402


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("TE_GQA_FIX"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(wrapper, "_wrappers", {})
    monkeypatch.setattr(patch, "_lasting", False)
    _logging._reset_log_once()
    te_gqa_fix.reset_call_counts()
    affected.reset()
    offset_errors._reset()
    yield
    _logging._reset_log_once()
    te_gqa_fix.reset_call_counts()
    affected.reset()
    offset_errors._reset()


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
        patch.uninstall()
        patch._sites.clear()
        patch._original = None
        patch._wrapper = None
        for name in te_package.loaded_fake_modules():
            del sys.modules[name]
        sys.modules.update(saved)
        te_package.BACKEND.reset()
        te_package.DIRECT_CALLERS.clear()


# Slow subprocesses (tests/fakes/background.py): started once collection is over, read by
# tests that run last, so that they use the second core meanwhile.


def _jobs(item: pytest.Item) -> list:
    return [name for name in getattr(item, "fixturenames", ()) if name in background.STARTERS]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: bool(_jobs(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        for name in {name for item in session.items for name in _jobs(item)}:
            background.get(name)


def pytest_sessionfinish() -> None:
    background.stop_all()
