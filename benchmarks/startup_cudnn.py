#!/usr/bin/env python3
"""What ``TE_GQA_FIX_CUDNN=auto`` adds to a process's start-up (needs the installed hook).

Fresh interpreters, alternating unset and ``auto``, time ``import torch`` and
``import transformer_engine.pytorch``: the import itself, measured inside the child, and the
whole process (start to exit), median of ``--repeat``; each child also reports the cuDNN TE
runs.

    python3 benchmarks/startup_cudnn.py --out startup.json [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from common import median, metadata, write

CHILD = r"""
import json, time
t0 = time.perf_counter()
import {module}
t1 = time.perf_counter()
te = None
if "{module}" == "transformer_engine.pytorch":
    import transformer_engine_torch as tex
    te = int(tex.get_cudnn_version())
print("CHILD" + json.dumps({{"import_s": t1 - t0, "te_cudnn": te}}))
"""


def one(module: str, setting: str) -> Dict[str, Any]:
    """One fresh interpreter: its wall time and what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TE_GQA_FIX")}
    if setting != "unset":
        env["TE_GQA_FIX_CUDNN"] = setting
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(module=module)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.perf_counter() - t0
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD")]
    if proc.returncode != 0 or not line:
        raise RuntimeError(proc.stderr[-2000:])
    return {**json.loads(line[0][len("CHILD") :]), "process_s": wall}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="startup.json", help="the JSON file to write")
    args = ap.parse_args(argv)
    rows = []
    for module in ("torch", "transformer_engine.pytorch"):
        one(module, "unset")  # warm the file cache
        samples: Dict[str, List[Dict[str, Any]]] = {"unset": [], "auto": []}
        for _ in range(args.repeat):
            for setting in samples:
                samples[setting].append(one(module, setting))
        row: Dict[str, Any] = {"module": module}
        for what in ("import", "process"):
            ms = {s: 1e3 * median([x[f"{what}_s"] for x in v]) for s, v in samples.items()}
            row[what] = {**ms, "added": ms["auto"] - ms["unset"]}
            print(f"{module} ({what}): unset {ms['unset']:.0f} ms, auto {ms['auto']:.0f} ms")
        row["te_cudnn"] = {s: v[-1]["te_cudnn"] for s, v in samples.items()}
        rows.append(row)
    write(args.out, {"bench": "startup", **metadata(), "repeat": args.repeat, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
