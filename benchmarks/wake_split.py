#!/usr/bin/env python3
"""Where the wrapper's host time goes in TE's wake: its Python against its kernel launch.

Why: ``bench_postpass.py`` measures the wrapper around a stub of TE's function twice,
back to back (about 14 us) and with an untimed call of TE's own function before every
timed call (about twice that, as the paired overhead against TE reads). This splits
both into parts, each timed against the stub in the same interleaved rounds:

* ``wrapper``: the wrapper around the stub, post-pass forced (the fast lane; in C where
  ``te_gqa_fix.c_launch`` serves: its ``lane``, TE's call and ``serve`` included);
* ``wrapper_python_lane``: the same with the lane in Python (``triton_postpass._c_lane``
  unset), the kernel still launched from C through ``_run``;
* ``wrapper_python_launch``: the Python lane, the kernel launched from Python through
  Triton's C launcher (the wrapper before ``te_gqa_fix.c_launch``);
* ``wrapper_no_launch``: the C lane with a launch record of an empty grid: everything
  but the driver's ``cuLaunchKernel`` (without a C launch record: the Python lane with
  ``_run`` a no-op, its Python alone);
* ``launch``: ``triton_postpass._run`` alone on the same plan and gradients (the launch);
* ``launch_python``: the same, launched from Python;
* ``torch_op``: one tiny ``torch`` op on the GPU (the price of any launch from Python).

GPU machine, TE staged (``source .gpu-kit/env.sh``)::

    python3 benchmarks/wake_split.py --out DIR [--workloads llama8b-8k,mqa-32k]

Writes ``DIR/wake_split.json`` (medians and overheads in us, the stack, the command) and
prints a table. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "src", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_postpass as bp  # noqa: E402

from te_gqa_fix import c_launch, guard, triton_postpass  # noqa: E402
from te_gqa_fix.wrapper import wrapper_for  # noqa: E402


def split(wl: bp.Workload, te: bp.TE, rounds: int) -> Dict[str, Any]:
    dev, dtype = "cuda", getattr(torch, wl.dtype)
    common, kw = bp.backward_arguments(
        wl, te, lambda *shape: torch.randn(shape, device=dev, dtype=dtype), dev
    )
    cu_q, cu_kv, pad = (common[n] for n in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded"))
    pos, rest = bp.positional(te.original, kw)
    grads = te.original(*pos, **rest)
    stub = bp.make_stub(te.original, grads)
    wrapped = wrapper_for(stub)
    index = torch.cuda.current_device()
    guard._fixed[index] = False  # post-pass forced, also on a fixed cuDNN
    # This workload's plan is then the one plan made (a workload timed again would
    # otherwise find its plan from before, and another workload's plan last).
    triton_postpass._launch_plans.clear()
    for _ in range(3):  # decide, record, then the lane
        wrapped(*pos, **rest)
    torch.cuda.synchronize()
    plans = [p for p in triton_postpass._launch_plans.values() if p.fast is not None]
    assert len(plans) == 1, f"{len(plans)} armed launch plans, expected this workload's one"
    plan = plans[0]
    tensors = (grads[0], grads[1], grads[2], cu_q, cu_kv, pad, pad)
    tiny = torch.zeros(1, device=dev)
    run, lane = triton_postpass._run, triton_postpass._c_lane
    record = plan.c
    # The same record with an empty grid: the C launch does all but cuLaunchKernel.
    empty = None
    if record is not None:
        head = list(c_launch.HEADER.unpack_from(record))
        head[1] = 0
        empty = c_launch.HEADER.pack(*head) + record[c_launch.HEADER.size :]

    def real_launch(c_lane: bool = True, rec: Any = record) -> Callable[[], None]:
        def setup() -> None:
            triton_postpass._run = run  # type: ignore[assignment]
            triton_postpass._c_lane = lane if c_lane else None
            plan.c = rec

        return setup

    def no_launch() -> None:
        if empty is not None:
            real_launch(rec=empty)()
        else:  # the Python lane, _run a no-op
            triton_postpass._run = lambda plan, tensors: None  # type: ignore[assignment]

    def wrapper() -> Any:
        return wrapped(*pos, **rest)

    fns: Dict[str, Callable[[], Any]] = {
        "stub": lambda: stub(*pos, **rest),
        "wrapper": wrapper,
        "wrapper_python_lane": wrapper,
        "wrapper_python_launch": wrapper,
        "wrapper_no_launch": wrapper,
        "launch": lambda: run(plan, tensors),
        "launch_python": lambda: run(plan, tensors),
        "torch_op": lambda: tiny.add_(1),
    }
    prepare = {
        "wrapper_python_lane": real_launch(c_lane=False),
        "wrapper_python_launch": real_launch(c_lane=False, rec=None),
        "wrapper_no_launch": no_launch,
        "launch_python": real_launch(rec=None),
    }
    result: Dict[str, Any] = {
        "workload": wl.name, "c_launch_record": record is not None, "c_lane": lane is not None
    }  # fmt: skip
    launched_from_c, c_lane_calls = c_launch.launch_count(), c_launch.lane_count()
    since = bp.host_snapshot()
    try:
        for mode, before in (("back_to_back", None), ("after_te", lambda: te.original(*pos))):
            setups = {n: bp.then(prepare.get(n, real_launch()), before) for n in fns}
            timed = bp.time_host_group(fns, setups, rounds, warmup=5)
            result[mode] = {
                n: {"median_us": t["median_us"], "overhead_us": t.get("overhead_us")}
                for n, t in timed.items()
            }
    finally:
        real_launch()()
        stub.release()  # type: ignore[attr-defined]
        guard._fixed.pop(index, None)
    result["host_context"] = bp.host_context(since=since)
    result["launched_from_c"] = c_launch.launch_count() - launched_from_c
    result["c_lane_calls"] = c_launch.lane_count() - c_lane_calls
    return result


def main(argv: List[str] = sys.argv[1:]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--workloads", default="llama8b-8k,mqa-32k")
    p.add_argument("--rounds", type=int, default=150)
    args = p.parse_args(argv)
    te = bp.TE()
    workloads = bp.all_workloads("padding_causal_bottom_right")
    report: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in ["python3", *sys.argv]),
        "stack": bp.stack_info(),
        "results": [split(workloads[n], te, args.rounds) for n in args.workloads.split(",")],
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "wake_split.json").write_text(json.dumps(report, indent=1, default=str))
    names = [
        "wrapper", "wrapper_python_lane", "wrapper_python_launch", "wrapper_no_launch", "launch",
        "launch_python", "torch_op",
    ]  # fmt: skip
    print("| workload | mode | stub | " + " | ".join(f"{n} (over stub)" for n in names) + " |")
    for r in report["results"]:
        for mode in ("back_to_back", "after_te"):
            t = r[mode]
            cells = " | ".join(f"{t[n]['overhead_us']:.1f} us" for n in names)
            print(f"| {r['workload']} | {mode} | {t['stub']['median_us']:.1f} us | {cells} |")
        print(f"  {r['workload']}: C launch record {r['c_launch_record']}, "
              f"{r['launched_from_c']} launches from C; {r['host_context']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
