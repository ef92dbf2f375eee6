"""The CPU suite's slow subprocesses, run on the second core while the other tests run.

A test module registers a starter under the name of the fixture that reads its result
(:data:`STARTERS`). ``tests/conftest.py`` starts a job as soon as a test that needs it is
collected, ends those no selected test needs when collection ends, and moves the tests that
read them to the end of the run; the fixture waits for its job (:func:`get`, which also
starts a job no hook started). A subprocess check stays what it was: only when it runs
moves.

No process of a job outlives it (issue #51). torchrun starts each worker in a session of
its own, so ending torchrun's process group leaves the workers running, adopted by PID 1.
So every job's environment carries a mark of its own (:data:`MARK`), which every
descendant inherits, and ending a job ends every process that carries its mark (read in
``/proc/PID/environ``), wherever it was reparented. A job ends when it is waited for, when
the session ends (:func:`stop_all`), at interpreter exit, on SIGTERM/SIGHUP, and, should
this process be killed outright, through a reaper process that does the same once the
pipe this process holds open reaches end of file.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

#: The environment variable whose value names the job a process belongs to.
MARK = "TEGQAFIX_TEST_JOB"  # not TE_GQA_FIX*: te-gqa-fix warns of unknown names

#: fixture name -> ``start(folder)``: begins the work and returns its :class:`Job`, or None
#: where it cannot run here (the fixture then skips)
STARTERS: Dict[str, Callable[[Path], Optional[Job]]] = {}
_JOBS: Dict[str, Optional[Job]] = {}

# The reaper: waits for end of file on stdin (this process gone, or the job over), then
# kills every process marked with its job's mark. Standard library only, no imports of ours.
_REAPER = """
import sys
sys.stdin.buffer.read()
sys.path[:0] = [sys.argv[2]]
from background import kill_marked
kill_marked(sys.argv[1])
"""


def marked(token: str) -> List[int]:
    """The processes whose environment says they belong to job ``token`` (Linux; elsewhere
    none can be read: an empty list)."""
    want = f"{MARK}={token}".encode()
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:  # gone, or not ours to read
            continue
    return found


def kill_marked(token: str) -> None:
    """SIGKILL every process of job ``token`` until none is left (a process forking while
    it is found is found on the next pass)."""
    for _ in range(50):
        pids = marked(token)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


#: How much lower a job runs than the tests (``nice``). The tests are the run's one long
#: chain, the jobs side work that only its last tests read. Each job runs in a session of
#: its own, and Linux schedules each session as one group (autogroup), the tests' as
#: another: at equal weights the eight jobs held 8/9 of the two cores while they ran and the
#: tests got a fifth of one (test_checks.py: 13 s for 3 s of work); once the jobs were done,
#: one core sat idle while the tests caught up (20 of 75 s). Lowered, the jobs run on what
#: the tests leave: the other core, and both while a test waits (suite: 81 s -> 70 s).
NICE = 10


def _lower(pid: int, nice: int) -> None:
    """Lower a job's process (just started) by ``nice``: its session's group, which is
    what counts between sessions where Linux groups them (autogroup), and the process, which
    counts elsewhere and is inherited by what it starts."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:  # no autogroup here
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:  # gone already: nothing to lower
        pass


class Job:
    """One subprocess and everything it starts, its output kept in files of ``folder``, run
    ``nice`` below the tests (:data:`NICE`)."""

    def __init__(
        self, cmd: List[str], folder: Path, timeout: float, nice: int = NICE, **popen: Any
    ) -> None:
        self.folder, self.timeout = folder, timeout
        self.token = uuid.uuid4().hex
        env = dict(popen.pop("env", None) or os.environ, **{MARK: self.token})
        self._files = [open(folder / name, "w+") for name in ("stdout.txt", "stderr.txt")]
        self._reaper: Optional[subprocess.Popen] = subprocess.Popen(
            [sys.executable, "-c", _REAPER, self.token, str(Path(__file__).parent)],
            stdin=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self._files[0], stderr=self._files[1],
                                     text=True, start_new_session=True, env=env, **popen)  # fmt: skip
        _lower(self.proc.pid, nice)
        _LIVE.append(self)

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
        """End the job's process and every process it started, wherever reparented."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its group, as it was started
        kill_marked(self.token)
        self.proc.wait()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:  # nothing is left: let it go
            reaper.stdin.close()  # type: ignore[union-attr]
            reaper.wait()
        if self in _LIVE:
            _LIVE.remove(self)


_LIVE: List[Job] = []  # every job not yet killed, whoever started it


def get(name: str) -> Optional[Job]:
    """The job of fixture ``name``, started now if no hook started it."""
    if name not in _JOBS:
        folder = Path(tempfile.mkdtemp(prefix=f"te_gqa_fix_{name}_"))
        _JOBS[name] = STARTERS[name](folder)
        if _JOBS[name] is None:
            shutil.rmtree(folder)
    return _JOBS[name]


def started() -> List[str]:
    """The fixture names whose jobs :func:`get` started (or found unable to run)."""
    return list(_JOBS)


def stop(name: str) -> None:
    """End the job of fixture ``name`` (and its processes), and remove it."""
    job = _JOBS.pop(name, None)
    if job is not None:
        job.kill()
        _remove(job)


def _remove(job: Job) -> None:
    """Close a job's output files and delete its folder."""
    for f in job._files:
        f.close()
    shutil.rmtree(job.folder, ignore_errors=True)


def stop_all() -> None:
    """End every job (and its processes), and remove the jobs :func:`get` started."""
    for job in list(_LIVE):
        job.kill()
    for job in filter(None, _JOBS.values()):
        _remove(job)
    _JOBS.clear()


def _on_signal(signum: int, frame: Any) -> None:
    """SIGTERM/SIGHUP: end the jobs, then die of the signal as before."""
    stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


atexit.register(stop_all)
for _sig in (signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(_sig) in (signal.SIG_DFL, None):  # never over someone else's handler
        try:
            signal.signal(_sig, _on_signal)
        except ValueError:  # imported outside the main thread: the reaper still acts
            pass
