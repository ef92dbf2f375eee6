"""What the benchmarks share: the packed batch, the run's metadata, CUDA-event timing."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

ROOT = Path(__file__).resolve().parents[1]
# This tree's library, the test harness (tests/thd.py: TE called by argument name) and the
# evidence harness's stack record (evidence/stack_probe.py).
for _folder in (ROOT / "evidence", ROOT / "tests", ROOT / "src"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# The cuDNN backend is the one under test: no flash-attn, no unfused fallback.
os.environ["NVTE_FLASH_ATTN"] = "0"
os.environ["NVTE_UNFUSED_ATTN"] = "0"
os.environ["NVTE_FUSED_ATTN"] = "1"

#: Sequence lengths as fractions of the buffer (context-parallel-style step).
FRACTIONS = (0.22, 0.08, 0.18, 0.05, 0.15, 0.12, 0.10, 0.10)


def packed(tokens: int, q_empty=(1, 4), half=(3,), mult: int = 4) -> Dict[str, List[int]]:
    """A THD batch of 8 sequences in ``tokens`` rows: key lengths ``lk``, query lengths
    ``lq`` (0 for ``q_empty``, half for ``half``), padded offsets ``pad`` (a multiple of
    ``mult``, sequences 2 and 5 with an extra gap); about 3% tail rows after the last one."""
    lk, lq, pad = [], [], [0]
    for b, f in enumerate(FRACTIONS):
        n = max(1, int(f * tokens * 0.97) - 1 - (b % 3))
        lk.append(n)
        lq.append(0 if b in q_empty else (n // 2 if b in half else n))
        pad.append(pad[-1] + -(-n // mult) * mult + (mult if b in (2, 5) else 0))
    assert pad[-1] <= tokens, (tokens, pad[-1])
    return {"lq": lq, "lk": lk, "pad": pad}


def cumsum(lengths: List[int]) -> List[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def by_name(fn: Callable, **kwargs: Any) -> Dict[str, Any]:
    """The keyword arguments ``fn``'s signature has (TE's changes between releases)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def event_ms(fn: Callable[[], Any]) -> float:
    """One call between two CUDA events, then a sync: its time as the GPU saw it."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@contextlib.contextmanager
def one_cpu() -> Iterator[None]:
    """Run the calling thread on one CPU (the last it may use), so that host timings are
    not spread over migrations between cores; where affinity cannot be set, a no-op."""
    get = getattr(os, "sched_getaffinity", None)
    cpus = sorted(get(0)) if get else []
    if not cpus:
        yield
        return
    os.sched_setaffinity(0, {cpus[-1]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def median(xs: List[float]) -> float:
    return statistics.median(xs)


def cpu_model() -> str:
    """The host CPU's model name (host timings depend on it), or ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def metadata() -> Dict[str, Any]:
    """Date, command and stack (``evidence/stack_probe.py``'s, Triton, the SM count, the
    host CPU)."""
    import torch

    import stack_probe

    stack = stack_probe.probe()
    try:
        import triton

        stack["triton"] = triton.__version__
    except ImportError:
        stack["triton"] = None
    if torch.cuda.is_available():
        stack["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    stack["cpu"] = cpu_model()
    env = {k: os.environ.get(k, "") for k in ("GPU_KIT_CUDNN", "TE_GQA_FIX_CUDNN")}
    route = env["TE_GQA_FIX_CUDNN"] not in ("", "0", "off")
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(
            [f"{k}={shlex.quote(v)}" for k, v in env.items() if v]
            + ["python3", *map(shlex.quote, sys.argv)]
        ),
        # The GPU kit's name for the cuDNN TE runs (evidence/builds.sh).
        "build": "route" if route else env["GPU_KIT_CUDNN"],
        "stack": stack,
    }


def write(path: str, doc: Dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {path}")
