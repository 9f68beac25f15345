"""Data-parallel training across replica groups with torchft, under Phalanx.

    phalanx submit --nodes 4 --replicas 2 --spares 1 -- python examples/train_ft.py --steps 2000

Each replica group is a process group of its own (Phalanx sets RANK, WORLD_SIZE and MASTER_ADDR to the group's, and
REPLICA_GROUP_ID, NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE). A step averages the gradients across the groups in the
quorum (torchft's manager), then inside the group (its own gloo group); torchft commits the step only if every group
in the quorum took it. When a group fails, Phalanx stops it and the others go on with one
group fewer (that group's samples of the steps it misses are skipped); its replacement fetches the model and the
optimizer from a healthy group over the network and joins at a step boundary.

A toy model (a linear regression on seeded batches: each step's batch depends on the step, the group and the rank,
so a run is reproducible); `--every N` saves a durable checkpoint with trainlib every N steps (the model, the
optimizer and torchft's manager: a whole-job restart resumes from it). `--out DIR` writes, for each step a rank
commits, the digest of its parameters and the groups in the quorum (DIR/rank-PHALANX_RANK.jsonl), each step it
took but could not commit and must take again (DIR/retaken-RANK.jsonl: usually, a group in its quorum failed
during it), and the final loss on a fixed test set (DIR/loss-RANK.txt).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torchft import Manager, Optimizer, ProcessGroupGloo

import trainlib

FEATURES = 32
TRUE_W = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)  # what the model should learn


def batch(step: int, group: int, rank: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1_000_003 + group * 1_009 + rank)
    x = torch.randn(size, FEATURES, generator=g)
    return x, x @ TRUE_W + 0.01 * torch.randn(size, 1, generator=g)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--until-full", type=int, default=0, metavar="K", help="after --steps, go on until the last K "
                   "steps committed had every group in the quorum (every group sees the same quorums, so all stop at "
                   "the same step): a run with a fault ends with its groups together again")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps (a slower model)")
    p.add_argument("--out", type=Path, help="where to write each committed step's digest and the final loss")
    p.add_argument("--every", type=int, default=0, help="a durable checkpoint every N steps (trainlib.save: each "
                   "group writes its own copy, in the job's checkpoint directory/group-G); 0: none")
    args = p.parse_args()

    trainlib.init()
    dist.init_process_group("gloo")  # the group's own process group; torchft's manager uses its store
    group, rank = int(os.environ.get("REPLICA_GROUP_ID", "0")), dist.get_rank()
    job_rank = int(os.environ.get("PHALANX_RANK", rank))
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optimizer": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, replica_id=f"{os.environ.get('PHALANX_JOB', 'local')}-group{group}",
                      timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=30))
    optimizer = Optimizer(manager, inner)  # its zero_grad starts each step's quorum
    loaded = trainlib.load_latest() if args.every else None  # (the group's own copy; a group that joins others
    if loaded is not None:  # further on takes their state from them at its first quorum all the same)
        load_state_dict(loaded.state)
        manager.load_state_dict(loaded.state["manager"])
    log = open(args.out / f"rank-{job_rank}.jsonl", "a") if args.out else None  # noqa: SIM115
    retaken = open(args.out / f"retaken-{job_rank}.jsonl", "a") if args.out else None  # noqa: SIM115
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    full = 0  # steps in a row committed with every group
    while manager.current_step() < args.steps or (args.until_full and full < args.until_full):
        optimizer.zero_grad()  # starts the step's quorum
        manager.wait_quorum()  # (a group that joins has the others' step, and their state, once it is formed)
        step = manager.current_step()
        x, y = batch(step, group, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        trainlib.compute_done()  # the step's own work ends here: what Phalanx's straggler rule compares across ranks
        for param in model.parameters():
            # across the groups in the quorum first (torchft pairs each group's rank r with the others' rank r, and
            # zeroes the gradient of a rank that is taking a healthy group's state), then inside the group: every
            # rank of every group ends with the same gradient, whichever ranks were recovering
            manager.allreduce(param.grad).wait()
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
        if manager.should_commit():  # every group in the quorum took this step (else it is taken again)
            inner.step()
            trainlib.step(step)
            full = full + 1 if manager.num_participants() == groups else 0
            if (args.every and (step + 1) % args.every == 0) or trainlib.checkpoint_requested():
                trainlib.save({**state_dict(), "manager": manager.state_dict()}, step)
            if log is not None:
                log.write(json.dumps({"step": step, "digest": digest(model), "groups": manager.num_participants(),
                                      "time": time.time(), "pid": os.getpid(), "group": group}) + "\n")
                log.flush()
        elif retaken is not None:  # the step's work is lost: the loop takes it again
            retaken.write(json.dumps({"step": step, "groups": manager.num_participants(), "time": time.time(),
                                      "pid": os.getpid(), "group": group}) + "\n")
            retaken.flush()
        if args.step_time:
            time.sleep(args.step_time)
    if args.out:
        x, y = batch(10**9, 0, 0, size=4096)
        with torch.no_grad():
            (args.out / f"loss-{job_rank}.txt").write_text(f"{torch.nn.functional.mse_loss(model(x), y).item():.6f}")
    manager.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
