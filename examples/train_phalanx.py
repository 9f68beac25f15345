"""The same small gloo training job as train_gloo.py, written against trainlib: resumes from the newest
in-memory snapshot or complete checkpoint, snapshots every step, checkpoints when Phalanx asks (and every
--every steps), reports step times.

Runs alone too: outside Phalanx trainlib is a no-op shim and checkpoints go to ./checkpoints.
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


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data for (step, rank): a resumed run sees exactly what an uninterrupted one saw."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).repeat(1, 4)


def checksum(model: torch.nn.Module) -> str:
    """The model's parameters' sha256: two runs that trained the same steps on the same data agree on it."""
    return hashlib.sha256(repr([p.detach().tolist() for p in model.parameters()]).encode()).hexdigest()


def until(path: str, world_size: int) -> bool:
    """Whether any rank sees `path`: every rank learns it at the same step (one more all-reduce a step)."""
    seen = torch.tensor([1.0 if os.path.exists(path) else 0.0])
    if world_size > 1:
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of idle time per step")
    parser.add_argument("--work", type=int, default=0, help="extra CPU work per step (matmuls of 256x256, ~0.3 ms "
                        "each): compute that a rank stopped in bursts (slow-bursts=F) really takes longer for")
    parser.add_argument("--every", type=int, default=0, help="also checkpoint every N steps (0 = only on request)")
    parser.add_argument("--steps-after-resume", type=int, default=0,
                        help="a run that resumed from a checkpoint stops this many steps after it, or at --steps if "
                        "sooner (0 = at --steps): with a large --steps, the run ends only once a recovery happened")
    parser.add_argument("--no-snapshots", action="store_true", help="no in-memory snapshots: a restart resumes from "
                        "the newest durable checkpoint")
    parser.add_argument("--state-mb", type=int, default=0, help="carry this many MB of untrained state per rank "
                        "in every checkpoint and snapshot (for benchmarks: the cost of saving a large model)")
    parser.add_argument("--out", default="", help="rank 0 writes the final checksum here")
    parser.add_argument("--until-file", default="", help="the run ends after the first step at which this file "
                        "exists, every rank agreeing on the step (or at --steps): a run that ends by an event")
    parser.add_argument("--digests", default="", help="rank 0 appends 'STEPS DIGEST' here after every step: the "
                        "model's checksum after each number of steps trained (tests' reference of uninterrupted runs)")
    parser.add_argument("--out-steps", default="", help="rank 0 writes the number of steps the model was trained "
                        "for here (what an uninterrupted run needs as --steps to end with the same model)")
    parser.add_argument("--print-every", type=int, default=10, help="rank 0 prints the loss every N steps")
    parser.add_argument("--hang-at", type=int, default=-1, help="for tests: rank 1 stops at this step, once (a file "
                        "hung-at-STEP in the checkpoint directory remembers it), as a rank stuck in a collective would")
    parser.add_argument("--slow-node", default="", help="for tests: the rank on this node ($PHALANX_NODE) computes "
                        "--slow-factor times longer each step (a throttled GPU, under torchrun)")
    parser.add_argument("--slow-factor", type=float, default=1.5)
    parser.add_argument("--rejoin", action="store_true", help="run the training under trainlib.run: a rank that "
                        "survives a failure rejoins the next generation in this process instead of a new one")
    args = parser.parse_args()
    return trainlib.run(train, args) if args.rejoin else train(args)


def train(args: argparse.Namespace) -> int:
    ctx = trainlib.init()  # before init_process_group: it sets the NCCL watchdog defaults
    if ctx.world_size > 1:
        # 5 minutes: a rank started cold (importing torch: over a minute on a loaded 2-CPU host) may join ranks
        # started warm, which wait for it here; a hung rank is for Phalanx to find, not for this timeout
        dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world_size, timeout=timedelta(minutes=5))
    torch.set_num_threads(1)  # ranks share the machine's cores; one thread each keeps them from fighting
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scratch = torch.ones(256, 256)
    ballast = torch.zeros(args.state_mb << 18)  # float32: 4 bytes each
    first = 0

    def training_state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                **({"ballast": ballast} if args.state_mb else {})}

    loaded = trainlib.load_latest()
    if loaded is not None:
        model.load_state_dict(loaded.state["model"])
        optimizer.load_state_dict(loaded.state["optimizer"])
        if args.state_mb:
            ballast.copy_(loaded.state["ballast"])
        first = loaded.step + 1
        print(f"rank {ctx.rank}: resumed from step {loaded.step} (generation {ctx.generation})", flush=True)
    steps = args.steps
    if loaded is not None and args.steps_after_resume:
        steps = min(steps, first + args.steps_after_resume)  # every rank resumed from the same step: same end
    digests = open(args.digests, "a") if ctx.rank == 0 and args.digests else None  # noqa: SIM115 - closed below
    slow = bool(args.slow_node) and os.environ.get("PHALANX_NODE") == args.slow_node
    for step in range(first, steps):
        if step == args.hang_at and ctx.rank == 1 and not os.path.exists(marker := os.path.join(
                ctx.checkpoint_dir, f"hung-at-{step}")):
            open(marker, "w").close()
            time.sleep(3600)  # the reporter goes on; the step does not
        x, y = batch(step, ctx.rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if args.step_time:
            time.sleep(args.step_time * (args.slow_factor if slow else 1.0))
        for _ in range(args.work):
            torch.mm(scratch, scratch)
        trainlib.compute_done()
        if ctx.world_size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world_size
        optimizer.step()
        trainlib.step(step)
        if not args.no_snapshots:
            trainlib.snapshot(training_state, step)
        if trainlib.checkpoint_requested() or (args.every and (step + 1) % args.every == 0):
            trainlib.save(training_state(), step)
            print(f"rank {ctx.rank}: checkpointed step {step}", flush=True)
        if ctx.rank == 0 and step % args.print_every == 0:
            print(f"step {step} loss {loss.item():.4f} at {time.time():.3f}", flush=True)
        if digests is not None:
            digests.write(f"{step + 1} {checksum(model)}\n")
        if args.until_file and until(args.until_file, ctx.world_size):
            steps = step + 1
            break
    if digests is not None:
        digests.close()
    digest = checksum(model)
    if ctx.rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write(digest + "\n")
    if ctx.rank == 0 and args.out_steps:
        with open(args.out_steps, "w") as f:
            f.write(f"{steps}\n")
    print(f"rank {ctx.rank}/{ctx.world_size} done: {digest[:16]}", flush=True)
    if ctx.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
