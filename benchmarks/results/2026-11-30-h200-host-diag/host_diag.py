"""Why the benchmark's direct host overhead (15-16 us) read above sweep_kernel --host's
(10.4-12.1 us in an earlier session): the same measurement on the fake TE, on one GPU
machine, without and with Transformer Engine imported, plus whether the direct launch
was taken (the general launch path counted) and whether a Triton launch hook was set.

    source .gpu-kit/env.sh
    python3 benchmarks/results/2026-11-30-h200-host-diag/host_diag.py
    DIAG_TE=1 python3 benchmarks/results/2026-11-30-h200-host-diag/host_diag.py
"""

import os
import sys

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks"), str(ROOT / "tests")]
if os.environ.get("DIAG_TE") == "1":
    import transformer_engine.pytorch  # noqa

    print("TE imported", flush=True)
import bench_postpass as bp  # noqa: E402
import sweep_kernel as sk  # noqa: E402

from te_gqa_fix import triton_postpass as tp  # noqa: E402

calls = {"general": 0}
real = tp._run_general


def counting(plan, tensors):
    calls["general"] += 1
    return real(plan, tensors)


tp._run_general = counting
wl = bp.all_workloads("padding_causal_bottom_right")["llama8b-8k"]
out = sk.host_overhead(wl, n=2000)
print(
    "fast_ok",
    tp._fast_ok,
    "hooks_clear",
    tp._hooks_clear(),
    "general calls",
    calls["general"],
    flush=True,
)
try:
    from triton import knobs

    print(
        "enter hook calls",
        getattr(knobs.runtime.launch_enter_hook, "calls", None),
        "exit",
        getattr(knobs.runtime.launch_exit_hook, "calls", None),
    )
except Exception as e:
    print("knobs", e)
