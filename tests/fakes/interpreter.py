"""Child Python processes of the CPU tests: code run in a fresh interpreter, and a test
file's kernel checks in one child process under the Triton interpreter.

``TRITON_INTERPRET`` is read when Triton decorates a kernel, and Tritons without
triton-lang/triton#8735 leave ``triton.language`` patched after an interpreted run, which
breaks compiled kernels later in the same process. So the checks run in a fresh process: the test file itself, as a script
that calls :func:`worker_main`, all its checks in one go (one torch and Triton import).
"""

from __future__ import annotations

import importlib.util
import json
import os
import site
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import pytest

from . import background

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PTH = SRC / "te_gqa_fix_autopatch.pth"  # the start-up file the wheel puts in site-packages


def child_env(*paths: object, drop: tuple = ("TE_GQA_FIX",), **env: str) -> Dict[str, str]:
    """This process's environment for a child: no variable whose name starts with one of
    ``drop``, ``paths`` first on ``PYTHONPATH`` (then what it held), then ``env``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    path = [*map(str, paths), out.get("PYTHONPATH", "")]
    return {**out, "PYTHONPATH": os.pathsep.join(p for p in path if p), **env}


#: This interpreter's site folders, for children that start without ``site`` (``-S``).
SITE_FOLDERS = [
    p
    for p in (*site.getsitepackages(), site.getusersitepackages())
    if isinstance(p, str) and os.path.isdir(p)
]


def python_command(
    code: str, env: Dict[str, str], *, no_site: bool = False
) -> Tuple[List[str], Dict[str, str]]:
    """The command and environment of :func:`run_code` (for a background job too)."""
    cmd = [sys.executable, *(["-S"] if no_site else []), "-c", code]
    if no_site:
        path = [env.get("PYTHONPATH", ""), *SITE_FOLDERS]
        env = {**env, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    return cmd, env


def run_code(
    code: str, env: Dict[str, str], cwd: Optional[Path] = None, *, no_site: bool = False
) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter with ``env`` (:func:`child_env`); it must
    exit 0. ``no_site``: ``python -S``, the site folders after ``env``'s PYTHONPATH, so that
    no start-up file installed in them runs (the code processes the ones it means to)."""
    cmd, env = python_command(code, env, no_site=no_site)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def probed(proc: subprocess.CompletedProcess) -> dict:
    """What a child printed as JSON on its one line that starts with ``PROBE``."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0][len("PROBE") :])


def run_pth_line() -> None:
    """Run the shipped start-up line in this process, as ``site`` does."""
    (line,) = [ln for ln in PTH.read_text().splitlines() if ln.startswith("import")]
    exec(line, {})


def start_checks(test_file: str, out_dir: Path) -> background.Job:
    """Start ``python test_file OUT`` with ``TRITON_INTERPRET=1`` (its results:
    :func:`results`)."""
    env = child_env(SRC, ROOT / "tests", TRITON_INTERPRET="1")
    cmd = [sys.executable, str(Path(test_file).resolve()), str(out_dir / "results.json")]
    # test_kernel.py's checks are the run's longest job, one process, and the last tests
    # wait for it: half as far below the tests as the other jobs, it ends with them, not
    # 10 s after (other jobs are several processes and end sooner).
    nice = background.NICE // 2
    return background.Job(cmd, out_dir, timeout=600, nice=nice, env=env, cwd=str(ROOT))


def results(job: background.Job) -> Dict[str, dict]:
    """``{check: {"ok", "error", "seconds"}}`` as the worker wrote it. Raises AssertionError
    when the worker crashed."""
    proc, out = job.wait(), job.folder / "results.json"
    assert proc.returncode == 0 and out.exists(), f"worker died:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def interpreted_checks(name: str, test_file: str) -> Callable[[], Dict[str, dict]]:
    """The module fixture ``name``: ``test_file``'s checks run under the interpreter as the
    background job ``name`` (:func:`start_checks`), their :func:`results` (skipped without
    Triton). Bind it in the test file under the same name."""
    background.STARTERS[name] = lambda folder: (
        start_checks(test_file, folder) if importlib.util.find_spec("triton") else None
    )

    @pytest.fixture(scope="module", name=name)
    def checks_run() -> Dict[str, dict]:
        job = background.get(name)
        if job is None:
            pytest.skip("needs Triton (pip install triton)")
        return results(job)

    return checks_run


def worker_main(checks: Mapping[str, Callable[[], None]]) -> None:
    """The child's side: run every check, record pass/fail and traceback, write JSON."""
    results = {}
    for name, check in checks.items():
        start, cpu = time.perf_counter(), time.process_time()
        try:
            check()
            results[name] = {"ok": True, "error": ""}
        except BaseException:  # every failure is reported, the next check still runs
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        results[name]["cpu"] = round(time.process_time() - cpu, 2)
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
