"""Both CPU dry runs of cp_check.py in one torchrun launch (test_cp_check_helpers.py): the
configuration given, then one configuration with TE_GQA_FIX=off, which the harness must
fail. The first makes and ends its own process group, as a run alone does; the second runs in
one made here (torchrun's store cannot hold a second ``init_process_group``).

    torchrun --standalone --nproc-per-node=2 cp_dry_runs.py OUT [cp_check.py's options]

writes OUT/on and OUT/off (cp_check.py's files) and, on rank 0, OUT/status.json: the exit
status of each run (cp_check.main's).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cp_check

if __name__ == "__main__":
    out, options = Path(sys.argv[1]), sys.argv[2:]
    status = [cp_check.main([*options, f"--out={out / 'on'}"])]
    os.environ["TE_GQA_FIX"] = "off"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init = f"file://{out / 'store'}"
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    off = ["--comm=p2p", "--heads=4/2", "--shapes=empty", f"--out={out / 'off'}"]
    status.append(cp_check.main([*options, *off]))
    torch.distributed.destroy_process_group()
    if rank == 0:
        (out / "status.json").write_text(json.dumps(status))
