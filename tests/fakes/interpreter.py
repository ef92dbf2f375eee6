"""Run one check of a test file in a child process under the Triton interpreter.

``TRITON_INTERPRET`` is read when Triton is imported, so the kernel checks on CPU run in
a fresh process: the test file itself, as a script, with the check's name as argument.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_worker(test_file: str, check: str) -> subprocess.CompletedProcess:
    """``python test_file check`` with ``TRITON_INTERPRET=1`` and ``src``/``tests`` on the path."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH", "")) if p
    )
    return subprocess.run(
        [sys.executable, str(Path(test_file).resolve()), check],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=900,
    )
