#!/usr/bin/env python3
"""The stack one GPU build runs, as JSON: GPU, driver, torch, CUDA, TE and the cuDNN TE
runs. ``run_all.sh`` writes one per build, for the blocks whose outputs carry no stack of
their own (the examples). Imports torch and Transformer Engine only, never te_gqa_fix
(whose start-up hook, where installed, still picks TE's cuDNN as in the runs).

    python3 evidence/stack_probe.py --out stack-system.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from importlib import metadata
from typing import Any, Dict, List, Optional


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        return out.stdout.strip().splitlines()[0]
    except Exception:
        return None


def probe() -> Dict[str, Any]:
    stack: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu_kit_cudnn": os.environ.get("GPU_KIT_CUDNN", ""),
        "te_gqa_fix_cudnn": os.environ.get("TE_GQA_FIX_CUDNN", ""),
    }
    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            stack["te"] = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    try:  # TE first: its import picks the cuDNN it runs, before torch maps its own
        import transformer_engine.pytorch  # noqa: F401
        from transformer_engine.pytorch.utils import get_cudnn_version

        stack["cudnn_te"] = ".".join(str(int(x)) for x in get_cudnn_version())
    except Exception as exc:
        stack["te_error"] = f"{type(exc).__name__}: {exc}"[:300]
    import torch

    stack.update(torch=torch.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        stack.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            driver=_driver(),
        )
    return stack


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(a.out, "w") as f:
        json.dump(probe(), f)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
