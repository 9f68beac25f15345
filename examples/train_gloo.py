"""A small data-parallel training job on CPU with gloo: what Phalanx's tests and demo launch.

Reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), trains a tiny model on
deterministic data for --steps steps with gradients averaged across ranks, and has rank 0 write
the final parameters' checksum to --out. Runs alone too (world size 1).
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of 'compute' per step")
    parser.add_argument("--out", default="", help="rank 0 writes the final checksum here")
    parser.add_argument("--exit-code", type=int, default=0, help="rank 1 exits with this code at the end (tests)")
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1234 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=generator)
        y = x[:, :4].sum(dim=1, keepdim=True).repeat(1, 4)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if args.step_time:
            time.sleep(args.step_time)
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    digest = hashlib.sha256(repr([p.detach().tolist() for p in model.parameters()]).encode()).hexdigest()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write(digest + "\n")
    print(f"rank {rank}/{world} done: {digest[:16]}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return args.exit_code if rank == 1 else 0


if __name__ == "__main__":
    sys.exit(main())
