#!/usr/bin/env python3
"""What ``TE_GQA_FIX_CUDNN=auto`` adds to a process's start-up (GPU machine, installed hook).

Fresh interpreters, side by side and alternating (unset, auto, unset, auto, ...), timing
``import torch`` and ``import transformer_engine.pytorch`` from process start to the end of
the import (wall clock, median of ``--repeat``). With ``auto`` the start-up hook discovers
the fixed cuDNN among the environment's wheels and loads its libraries right before torch;
torch then finds ``libcudnn.so.9`` already loaded. Each child also reports the cuDNN TE runs.

    source .gpu-kit/env.sh && python3 benchmarks/startup_cudnn.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

CHILD = r"""
import time, json, sys
t0 = time.perf_counter()
import {module}
t1 = time.perf_counter()
te = None
if "{module}" == "transformer_engine.pytorch":
    import transformer_engine_torch as tex
    te = int(tex.get_cudnn_version())
print("CHILD" + json.dumps({{"import_s": t1 - t0, "te_cudnn": te}}))
"""


def one(module: str, setting: str) -> Dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TE_GQA_FIX")}
    if setting != "unset":
        env["TE_GQA_FIX_CUDNN"] = setting
    code = CHILD.format(module=module)
    # -X importtime is not used: the hook's own work happens inside the import of torch.
    import time

    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    wall = time.perf_counter() - t0
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(proc.stderr[-2000:])
    out = json.loads(line[0][len("CHILD") :])
    out["process_s"] = wall
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=os.environ.get("OUT", "startup-out"))
    args = ap.parse_args()
    rows: List[Dict[str, object]] = []
    for module in ("torch", "transformer_engine.pytorch"):
        samples: Dict[str, List[Dict[str, float]]] = {"unset": [], "auto": []}
        one(module, "unset")  # warm the file cache once
        for _ in range(args.repeat):
            for setting in ("unset", "auto"):
                samples[setting].append(one(module, setting))
        med = {
            s: {
                "import_ms": 1e3 * statistics.median(x["import_s"] for x in v),
                "process_ms": 1e3 * statistics.median(x["process_s"] for x in v),
                "te_cudnn": v[-1].get("te_cudnn"),
            }
            for s, v in samples.items()
        }
        rows.append(
            {
                "import": module,
                **{f"{s}_{k}": val for s, m in med.items() for k, val in m.items()},
                "added_ms": med["auto"]["process_ms"] - med["unset"]["process_ms"],
            }
        )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from te_gqa_fix.stack import stack_summary

    result = {"command": "python3 benchmarks/startup_cudnn.py", "repeat": args.repeat,
              "stack": stack_summary(), "rows": rows}  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "startup.json").write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['import']:<28} unset {r['unset_process_ms']:8.1f} ms  auto "
            f"{r['auto_process_ms']:8.1f} ms  added {r['added_ms']:+7.1f} ms  "
            f"(TE cuDNN unset {r['unset_te_cudnn']}, auto {r['auto_te_cudnn']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
