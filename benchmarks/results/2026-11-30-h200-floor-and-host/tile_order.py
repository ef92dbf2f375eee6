"""Column tiles of a program cyclic (``split + i * n_split``, the kernel's order) or blocked
(``split * N_TILES + i``), under six launch settings, interleaved, on the benchmark's
workloads; and whether both write the same bytes. A copy of the kernel module with the
one line changed is loaded by ``sweep_kernel.load_kernel_module``. ``tile_order.json`` was
measured on the kernel of commit 03e9009 (one program per row block and share).

    PYTHONPATH=$PWD/src OUT=... python3 benchmarks/results/2026-11-30-h200-floor-and-host/tile_order.py
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]
import bench_postpass as bp  # noqa: E402
import sweep_kernel as sk  # noqa: E402

from te_gqa_fix import triton_postpass as tp  # noqa: E402

src = (ROOT / "src/te_gqa_fix/triton_postpass.py").read_text()
old = "        tile = split + i * n_split\n"
assert old in src
blocked_src = src.replace(old, "        tile = split * N_TILES + i\n")
path = Path(tempfile.mkdtemp()) / "triton_postpass_blocked.py"
path.write_text(blocked_src)
tpb = sk.load_kernel_module(str(path))

rows = []
for name, wl in bp.all_workloads("padding_causal_bottom_right").items():
    if name == "seed":
        continue
    span, nbytes, offs, (dq, dk, dv) = sk._buffers(wl)
    fns = {}
    for mod, tag in ((tp, "cyc"), (tpb, "blk")):
        for bt, mt, pps in ((32, 8, 8), (32, 4, 8), (16, 4, 8), (32, 2, 8), (64, 8, 8), (32, 8, 4)):

            def call(mod=mod, bt=bt, mt=mt, pps=pps, bufs=(dq, dk, dv, *offs), span=span):
                mod.BLOCK_T, mod._MAX_TILES, mod._PROGRAMS_PER_SM = bt, mt, pps
                mod.zero_dead_rows_triton(*bufs, span=span)

            fns[f"{tag}_bt{bt}_mt{mt}_pps{pps}"] = call
    ref = dq.clone(), dk.clone(), dv.clone()
    outs = []
    for mod in (tp, tpb):
        a, b, c = ref[0].clone(), ref[1].clone(), ref[2].clone()
        mod.BLOCK_T, mod._MAX_TILES, mod._PROGRAMS_PER_SM = 32, 8, 8
        mod.zero_dead_rows_triton(a, b, c, *offs, span=span)
        outs.append((a, b, c))
    same = all(torch.equal(x, y) for x, y in zip(*outs))
    t = bp.time_device_group(fns, 150, 5)
    row = {
        "workload": name,
        "mb": nbytes / 1e6,
        "same_bytes": same,
        **{k: v["median_us"] for k, v in t.items()},
    }
    rows.append(row)
    print(
        name,
        f"same={same}",
        " ".join(f"{k}={v:.1f}" for k, v in row.items() if isinstance(v, float) and k != "mb"),
        flush=True,
    )
out = Path(os.environ.get("OUT", ".")) / "tile_order.json"
out.write_text(json.dumps(rows, indent=1))
