"""Every example, run as a user runs it, on a machine without a GPU, Transformer Engine or
Megatron-Core: the CPU example runs and checks its rows (exit 0); every other one exits 2
with one line naming what it lacks (before: megatron_core.py and context_parallel.py ended
in an ImportError traceback, startup_patch.sh in doctor's whole report and a traceback).

The examples run in one background job (``fakes.background``) with CUDA hidden and a
``transformer_engine`` and a ``megatron`` that cannot be imported first on the path, so
the machine lacks all three wherever the suite runs; the Python ones in children forked
from one process that imported torch (:data:`RUN_ALL`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from fakes import background
from fakes.interpreter import ROOT, SRC, child_env

EXAMPLES = ROOT / "examples"
CPU_EXAMPLES = {"cpu_postpass.py": "cpu_postpass: the rows zeroed are the rows whose true"}
NAMES = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh"))

# Runs every example (side by side) and writes {name: {"rc", "out", "err"}} to argv[2]. Each
# Python example imports torch first: this process imports it once, then forks a child per
# example that runs it as `python example.py` would (its folder first on the path, its
# argv, __main__, its exit status, at exit what Python runs at exit) - one torch import for
# all of them, not one each. The shell example runs in bash.
RUN_ALL = """
import atexit, json, os, runpy, subprocess, sys, tempfile, traceback
from pathlib import Path
examples, out = Path(sys.argv[1]), Path(sys.argv[2])
os.chdir(examples.parent)
import torch  # noqa: F401  (before any fork: no thread started yet)


def run_example(path):
    sys.argv, sys.path[0] = [str(path)], str(path.parent)
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as exc:  # as Python exits on it
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


runs = {}
for name in json.loads(sys.argv[3]):
    path = examples / name
    files = [tempfile.TemporaryFile("w+") for _ in range(2)]
    if name.endswith(".sh"):
        runs[name] = (subprocess.Popen(["bash", str(path), "train.py"], stdout=files[0],
                                       stderr=files[1], text=True), files)
        continue
    pid = os.fork()
    if pid == 0:
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        run_example(path)
    runs[name] = (pid, files)
results = {}
for name, (run, files) in runs.items():
    if isinstance(run, int):
        rc = os.waitstatus_to_exitcode(os.waitpid(run, 0)[1])
    else:
        rc = run.wait(timeout=300)
    texts = []
    for f in files:
        f.seek(0)
        texts.append(f.read())
    results[name] = {"rc": rc, "out": texts[0], "err": texts[1]}
out.write_text(json.dumps(results))
"""


def _start(folder: Path) -> Optional[background.Job]:
    bare = folder / "bare"
    for package in ("transformer_engine", "megatron"):
        (bare / package).mkdir(parents=True)
        (bare / package / "__init__.py").write_text(
            f"raise ImportError('{package} is hidden by tests/test_examples.py')\n"
        )
    env = child_env(bare, SRC, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-c", RUN_ALL, str(EXAMPLES), str(folder / "results.json"),
           json.dumps(NAMES)]  # fmt: skip
    return background.Job(cmd, folder, timeout=600, env=env)


background.STARTERS["example_runs"] = _start


@pytest.fixture(scope="module")
def example_runs() -> Dict[str, dict]:
    job = background.get("example_runs")
    assert job is not None
    proc = job.wait()
    out = job.folder / "results.json"
    assert proc.returncode == 0 and out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_example_runs_or_names_what_it_lacks(name: str, example_runs: Dict[str, dict]) -> None:
    run = example_runs[name]
    said = run["out"] + run["err"]
    if name in CPU_EXAMPLES:
        assert run["rc"] == 0, said
        assert said.splitlines()[-1].startswith(CPU_EXAMPLES[name]), said
        return
    lines = [line for line in said.splitlines() if line.strip()]
    assert run["rc"] == 2 and len(lines) == 1, said
    assert lines[0].startswith(f"{Path(name).stem if name.endswith('.py') else name}: needs ")
    assert "GPU" in lines[0] and "Transformer Engine" in lines[0], lines[0]


def test_every_example_is_run() -> None:
    assert set(CPU_EXAMPLES) <= set(NAMES) and len(NAMES) >= 6, NAMES
