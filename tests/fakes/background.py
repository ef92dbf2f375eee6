"""The CPU suite's slow subprocesses, run on the second core while the other tests run.

A test module registers a starter under the name of the fixture that reads its result
(:func:`register`). When collection ends, ``tests/conftest.py`` starts every job a
selected test needs and moves those tests to the end of the run; the fixture then waits
for its job (:func:`get`, which also starts a job no hook started). Jobs still running when
the session ends are killed. A subprocess check stays what it was: only when it runs moves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

#: fixture name -> starter: ``start(folder)`` begins the work and returns its :class:`Job`,
#: or None where it cannot run here (the fixture then skips)
Starter = Callable[[Path], Optional["Job"]]
_STARTERS: Dict[str, Starter] = {}
_JOBS: Dict[str, Optional[Job]] = {}


class Job:
    """One subprocess (its own process group), its output kept in files of ``folder``."""

    def __init__(self, cmd: List[str], folder: Path, timeout: float, **popen: Any) -> None:
        self.folder = folder
        self.timeout = timeout
        self._files = [open(folder / name, "w+") for name in ("stdout.txt", "stderr.txt")]
        self.proc = subprocess.Popen(cmd, stdout=self._files[0], stderr=self._files[1],
                                     text=True, start_new_session=True, **popen)  # fmt: skip
        self._done: Optional[subprocess.CompletedProcess] = None

    def wait(self) -> subprocess.CompletedProcess:
        """What ``subprocess.run(..., capture_output=True, text=True)`` would have given."""
        if self._done is None:
            try:
                self.proc.wait(timeout=self.timeout)
            finally:
                self.kill()
            for f in self._files:
                f.seek(0)
            out, err = (f.read() for f in self._files)
            self._done = subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                                     out, err)  # fmt: skip
        return self._done

    def kill(self) -> None:
        """Kill its process group while it runs (after, the group id may not be ours)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for f in self._files:
            f.flush()


def register(name: str) -> Callable[[Starter], Starter]:
    """Decorator: ``start`` is the job behind fixture ``name``."""

    def decorate(start: Starter) -> Starter:
        _STARTERS[name] = start
        return start

    return decorate


def needed(fixturenames: Iterable[str]) -> List[str]:
    return [name for name in fixturenames if name in _STARTERS]


def get(name: str) -> Optional[Job]:
    """The job of fixture ``name``, started now if no hook started it."""
    if name not in _JOBS:
        folder = Path(tempfile.mkdtemp(prefix=f"te_gqa_fix_{name}_"))
        _JOBS[name] = _STARTERS[name](folder)
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
