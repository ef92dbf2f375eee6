"""The CPU suite's slow subprocesses, run on the second core while the other tests run.

A test module registers a starter under the name of the fixture that reads its result
(:data:`STARTERS`). When collection ends, ``tests/conftest.py`` starts every job a selected
test needs and moves those tests to the end of the run; the fixture waits for its job
(:func:`get`, which also starts a job no hook started). Jobs still running when the session
ends are killed. A subprocess check stays what it was: only when it runs moves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

#: fixture name -> ``start(folder)``: begins the work and returns its :class:`Job`, or None
#: where it cannot run here (the fixture then skips)
STARTERS: Dict[str, Callable[[Path], Optional[Job]]] = {}
_JOBS: Dict[str, Optional[Job]] = {}


class Job:
    """One subprocess (its own process group), its output kept in files of ``folder``."""

    def __init__(self, cmd: List[str], folder: Path, timeout: float, **popen: Any) -> None:
        self.folder, self.timeout = folder, timeout
        self._files = [open(folder / name, "w+") for name in ("stdout.txt", "stderr.txt")]
        self.proc = subprocess.Popen(cmd, stdout=self._files[0], stderr=self._files[1],
                                     text=True, start_new_session=True, **popen)  # fmt: skip

    def wait(self) -> subprocess.CompletedProcess:
        """What ``subprocess.run(..., capture_output=True, text=True)`` would have given."""
        try:
            self.proc.wait(timeout=self.timeout)
        finally:
            self.kill()
        for f in self._files:
            f.seek(0)
        out, err = (f.read() for f in self._files)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill(self) -> None:
        """Kill its process group while it runs (after, the group id may not be ours)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def get(name: str) -> Optional[Job]:
    """The job of fixture ``name``, started now if no hook started it."""
    if name not in _JOBS:
        folder = Path(tempfile.mkdtemp(prefix=f"te_gqa_fix_{name}_"))
        _JOBS[name] = STARTERS[name](folder)
        if _JOBS[name] is None:
            shutil.rmtree(folder)
    return _JOBS[name]


def stop_all() -> None:
    for job in filter(None, _JOBS.values()):
        job.kill()
        for f in job._files:
            f.close()
        shutil.rmtree(job.folder, ignore_errors=True)
    _JOBS.clear()
