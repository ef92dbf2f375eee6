"""Device time of the Triton post-pass by workload and batch size (the table in README.md).

Run from the repository root on a CUDA machine (no TE needed):
``PYTHONPATH=$PWD/src python3 benchmarks/results/2026-11-30-h200-sweep-quick-kernel-v2/nseq_bench.py
TAG [COMPARE_MAX ...]``: each COMPARE_MAX is set as ``_COMPARE_MAX_OFFSETS`` in turn (0 =
binary search per row, a large value = interval compare at every batch size); none =
the module default. ``many-N``: N equal sequences in 32K tokens, llama heads, every 4th
sequence without queries.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_postpass as bp

from te_gqa_fix import triton_postpass as tp
from te_gqa_fix.masks import key_span

MASK = "padding_causal_bottom_right"
SPAN = key_span(MASK)


def run(wl: bp.Workload, tag: str, bw: dict) -> None:
    i32 = dict(dtype=torch.int32, device="cuda")
    offs = [torch.tensor(x, **i32) for x in (wl.cu(wl.lq), wl.cu(wl.lk), wl.pad, wl.pad)]
    dq = torch.randn(wl.rows, wl.h_q, wl.d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(wl.rows, 2, wl.h_kv, wl.d, device="cuda", dtype=torch.bfloat16)
    dk, dv = kv[:, 0], kv[:, 1]
    dead_kv, dead_q = bp.dead_rows(wl, SPAN)
    nbytes = dead_kv * wl.h_kv * wl.d * 4 + dead_q * wl.h_q * wl.d * 2
    bound = nbytes / (bw["copy_traffic_GBps"] * 1e3)

    def kernel() -> None:
        tp.zero_dead_rows_triton(dq, dk, dv, *offs, span=SPAN)

    t = bp.time_device(kernel, 200, 10)["median_us"]
    print(f"{tag:6s} {wl.name:13s} {t:7.2f} us bound {bound:6.2f} x{t / bound:.2f}", flush=True)


def many(nseq: int, rows: int = 32768) -> bp.Workload:
    n = rows // nseq
    lk = [n - 4] * nseq
    lq = [0 if b % 4 == 1 else n - 4 for b in range(nseq)]
    pad = [b * n for b in range(nseq + 1)]
    return bp.Workload(f"many-{nseq}", 32, 8, 128, "bfloat16", MASK, lq, lk, pad, rows)


def main() -> None:
    bw = bp.bandwidth(5)
    wls = bp.all_workloads(MASK)
    todo = [wls[n] for n in ["llama8b-8k", "llama8b-32k", "llama8b-128k", "mqa-8k", "mqa-32k"]]
    todo += [many(n) for n in (64, 255, 1000)]
    for m in sys.argv[2:] or [None]:
        if m is not None:
            tp._COMPARE_MAX_OFFSETS = int(m)
            tp._launch_plans.clear()
        for wl in todo:
            run(wl, f"{sys.argv[1]}{'' if m is None else m}", bw)


if __name__ == "__main__":
    main()
