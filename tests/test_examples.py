"""Every example, run as a user runs it, on a machine without a GPU, Transformer Engine or
Megatron-Core: the CPU example runs and checks its rows (exit 0); every other one exits 2
with one line naming what it lacks (before: megatron_core.py and context_parallel.py ended
in an ImportError traceback, startup_patch.sh in doctor's whole report and a traceback).

The examples run in one background job (``fakes.background``) with CUDA hidden and a
``transformer_engine`` and a ``megatron`` that cannot be imported first on the path, so
the machine lacks all three wherever the suite runs.
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

# Runs every example (side by side) and writes {name: {"rc", "out", "err"}} to argv[2].
RUN_ALL = """
import json, subprocess, sys
from pathlib import Path
examples, out = Path(sys.argv[1]), Path(sys.argv[2])
procs = {}
for name in json.loads(sys.argv[3]):
    path = examples / name
    cmd = ["bash", str(path), "train.py"] if name.endswith(".sh") else [sys.executable, str(path)]
    procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=examples.parent)
results = {}
for name, p in procs.items():
    stdout, stderr = p.communicate(timeout=300)
    results[name] = {"rc": p.returncode, "out": stdout, "err": stderr}
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
