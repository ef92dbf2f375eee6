"""The CPU suite leaves no process behind (issue #51), interrupted or not.

torchrun starts each worker in a session of its own (torch.distributed.elastic's
``SubprocessHandler``: ``start_new_session=True``), so ending torchrun's process group,
as the suite did, left the workers running under PID 1 (about 200 MB each). The job
below does the same: its child starts a grandchild in a new session and sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from fakes import background

TESTS = Path(__file__).resolve().parent
SPAWN = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                          start_new_session=True)
open(sys.argv[1], "w").write(f"{worker.pid} {os.getpid()}")
time.sleep(300)
"""
SESSION = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from fakes import background
folder = Path(sys.argv[1])
background.Job([sys.executable, "-c", sys.argv[3], str(folder / "pid")], folder, timeout=300)
while not (folder / "pid").exists():
    time.sleep(0.05)
print("ready", flush=True)
time.sleep(300)
"""
needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)  # leave nothing behind, even when failing
            return False
        time.sleep(0.05)
    return True


def _wait_for(path: Path) -> List[int]:
    """The worker's and the job process's ids, once the job process wrote them."""
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return [int(x) for x in path.read_text().split()]


@needs_proc
def test_a_job_ends_every_process_it_started(tmp_path: Path) -> None:
    job = background.Job([sys.executable, "-c", SPAWN, str(tmp_path / "pid")], tmp_path, 60)
    pids = _wait_for(tmp_path / "pid")
    assert all(map(_alive, pids))
    job.kill()
    assert all([_gone(pid) for pid in pids]), "a worker in a session of its own outlived its job"
    for f in job._files:
        f.close()


HOWS = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, tuple]]:
    """One session a way of ending it, all started at once (each starts four Pythons: the
    session, the job's reaper, the job, its worker; side by side they are ready in the time
    of one): ``{how: (session, pids)}``.
    Whatever a test did not end is killed afterwards, and its worker with it."""
    started = {}
    try:
        for how in HOWS:
            folder = tmp_path_factory.mktemp(how)
            started[how] = (folder, subprocess.Popen(
                [sys.executable, "-c", SESSION, str(folder), str(TESTS), SPAWN],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))  # fmt: skip
        ready = {}
        for how, (folder, session) in started.items():
            assert session.stdout is not None and session.stdout.readline() == "ready\n"
            ready[how] = (session, _wait_for(folder / "pid"))
        yield ready
    finally:
        for folder, session in started.values():
            if session.poll() is None:
                session.kill()
            session.communicate()
            if (folder / "pid").exists() and (folder / "pid").read_text():
                for pid in _wait_for(folder / "pid"):
                    _gone(pid)  # the worker (killed when it outlived its session)


@needs_proc
@pytest.mark.parametrize("how", list(HOWS))
def test_an_interrupted_session_leaves_no_process(sessions: Dict[str, tuple], how: str) -> None:
    """The process that started the job is interrupted (Ctrl-C, a timeout's SIGTERM) or
    killed outright: the job's worker goes too."""
    session, pids = sessions[how]
    session.send_signal(HOWS[how])
    session.wait(timeout=30)
    ended = [_gone(pid) for pid in pids]  # each waited for (and killed when failing)
    assert all(ended), f"the job outlived a session ended by {HOWS[how].name}"
