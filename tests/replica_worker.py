"""A rank of a replica-group job, for tests/test_replica_groups_e2e.py.

Its group is a gloo process group of its own (RANK, WORLD_SIZE and MASTER_ADDR are the group's, as Phalanx sets them
for `phalanx submit --replicas`); each step all-reduces a counter in the group and reports it to trainlib. Each step
it writes its pid, group, generation and step to OUT/rank-PHALANX_RANK.json. The group stops together (exit 0) once
OUT/stop exists: the ranks agree on it in a collective, so none is left waiting for the others.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import trainlib


def main() -> int:
    out = Path(sys.argv[1])
    trainlib.init()
    dist.init_process_group("gloo")
    rank, group = int(os.environ["PHALANX_RANK"]), int(os.environ["REPLICA_GROUP_ID"])
    generation = int(os.environ["PHALANX_GENERATION"])
    step = 0
    while True:
        flags = torch.tensor([1.0, 1.0 if (out / "stop").exists() else 0.0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1] > 0:
            break
        trainlib.step(step)
        tmp = out / f".rank-{rank}.json"
        tmp.write_text(json.dumps({"pid": os.getpid(), "group": group, "generation": generation, "step": step,
                                   "group_size": dist.get_world_size(), "group_rank": dist.get_rank()}))
        tmp.replace(out / f"rank-{rank}.json")
        step += 1
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
