"""The evidence harness's CPU tests import its scripts from evidence/ (not the library), and
the test suite's helpers (``fakes``, ``thd``) from tests/."""

from __future__ import annotations

import sys
from pathlib import Path

EVIDENCE = Path(__file__).resolve().parents[1]
TESTS = EVIDENCE.parent / "tests"
for _folder in (TESTS, EVIDENCE):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import torch  # noqa: E402

from fakes import background  # noqa: E402

torch.set_num_threads(1)  # as tests/conftest.py does, and why


def pytest_sessionfinish() -> None:
    """End the background jobs (the context-parallel dry run's torchrun) when these tests
    run without tests/conftest.py, which does the same."""
    background.stop_all()
