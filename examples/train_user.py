"""A training script written the way users write them, on trainlib's public API: the loop with its hooks, then a
barrier, rank 0 saves the final model, the process group is destroyed, and `sys.exit(main())`. Nothing in it
knows how Phalanx ends a job: that the end (the barrier, the save, the teardown, the interpreter's exit) is no
hang is trainlib's and the controller's business (issue 40).

    phalanx submit --nodes 2 --ranks-per-node 2 --spares 1 -- python examples/train_user.py --steps 800

Deterministic: the final model's sha256, which rank 0 prints and writes beside the model, is the same for every
run of as many steps, however often it was interrupted and resumed. Runs alone too (one rank, ./checkpoints).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import trainlib


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--step-time", type=float, default=0.02, help="seconds of idle time per step (a GPU's work)")
    parser.add_argument("--snapshot", action="store_true", help="trainlib.snapshot() every step, as the README shows")
    parser.add_argument("--every", type=int, default=500, help="a durable checkpoint every N steps")
    args = parser.parse_args()

    ctx = trainlib.init()
    if ctx.world_size > 1:
        # 5 minutes: a rank started cold (importing torch: over a minute on a loaded 2-CPU host) may join ranks
        # started warm, which wait for it here; a hung rank is for Phalanx to find, not for this timeout
        dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world_size, timeout=timedelta(minutes=5))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    first = 0
    loaded = trainlib.load_latest()
    if loaded is not None:
        model.load_state_dict(loaded.state["model"])
        optimizer.load_state_dict(loaded.state["optimizer"])
        first = loaded.step + 1
        print(f"rank {ctx.rank}: resumed from step {loaded.step}", flush=True)
    for step in range(first, args.steps):
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :4])
        optimizer.zero_grad()
        loss.backward()
        time.sleep(args.step_time)
        trainlib.compute_done()
        if ctx.world_size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
        optimizer.step()
        trainlib.step(step)
        if args.snapshot:
            trainlib.snapshot(state, step)
        if trainlib.checkpoint_requested() or (step + 1) % args.every == 0:
            trainlib.save(state(), step)
        if ctx.rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} at {time.time():.3f}", flush=True)
    print(f"rank {ctx.rank} trained {args.steps} steps at {time.time():.3f}", flush=True)
    if ctx.world_size > 1:
        dist.barrier()
    if ctx.rank == 0:
        path = os.path.join(ctx.checkpoint_dir, "final.pt")
        torch.save(model.state_dict(), path)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        with open(path + ".sha256", "w") as f:
            f.write(digest + "\n")
        print(f"final model {digest}", flush=True)
    if ctx.world_size > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
