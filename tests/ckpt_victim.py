"""Helper processes for tests/test_checkpoint.py.

`python tests/ckpt_victim.py serve ROOT` — the kill -9 victim, as a fork server so torch is imported
once (seconds) rather than once per kill. For each `go` line on stdin it forks a child that behaves
like a restarted rank: a new generation (claims it), `load_latest`, then saves steps N+1, N+2, ...
forever with contents that depend only on the step (`make_state`), printing `begin N` / `end N`
around each save. The server prints `child PID` after the fork and `dead PID STATUS` once the child
is gone — the test kills it with SIGKILL at a random moment.

`python tests/ckpt_victim.py dcp ROOT RANK WORLD PORT` — one rank of a gloo job on loopback that
saves a row-sharded DTensor with `save_sharded`, loads it back with `load_sharded`, and prints one
JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainlib.checkpoint import Checkpointer

DCP_STEP = 7
DCP_SHAPE = (64, 8)


def make_state(step: int) -> dict:
    """About 1 MiB whose every byte depends on `step` alone, so a loaded step can be checked exactly."""
    g = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)},
        "optim": {"count": torch.full((1000,), step, dtype=torch.int64), "lr": 1.0 / (step + 1)},
        "tags": [f"step-{step}", step * 3],
    }


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write(2), unbuffered: survives the kill, never duplicated by fork


def _child(root: str, generation: int) -> None:
    ck = Checkpointer(root, rank=0, world_size=1, generation=generation, keep=3)
    ck.claim_generation()
    loaded = ck.load_latest()
    step = loaded.step + 1 if loaded else 1
    while True:
        state = make_state(step)
        _say(f"begin {step}")
        ck.save(state, step)
        _say(f"end {step}")
        step += 1


def serve(root: str) -> None:
    torch.set_num_threads(1)  # no intra-op thread pool to break across fork
    make_state(0)
    generation = 0
    for line in sys.stdin:
        if line.strip() != "go":
            continue
        generation += 1
        pid = os.fork()
        if pid == 0:
            try:
                _child(root, generation)
            except BaseException as e:
                _say(f"error {type(e).__name__}: {e}")
            finally:
                os._exit(1)
        _say(f"child {pid}")
        _, status = os.waitpid(pid, 0)
        _say(f"dead {pid} {status}")


def _object_collectives_without_numpy() -> None:
    """torch's object collectives (DCP plans with them) decode received bytes via `tensor.numpy()`.

    The dev venv has no numpy (users' environments do), so decode with `tolist()` instead; the
    bytes and the pickle are the same.
    """
    import io

    import torch.distributed.distributed_c10d as c10d

    def _tensor_to_object(tensor: torch.Tensor, tensor_size: int, group: object) -> object:
        return c10d._unpickler(io.BytesIO(bytes(tensor.cpu()[:tensor_size].tolist()))).load()

    c10d._tensor_to_object = _tensor_to_object


def dcp_rank(root: str, rank: int, world: int, port: int) -> None:
    import datetime
    import importlib.util

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if importlib.util.find_spec("numpy") is None:
        _object_collectives_without_numpy()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(DCP_SHAPE[0] * DCP_SHAPE[1], dtype=torch.float32).reshape(DCP_SHAPE)
        ck = Checkpointer(root, rank=rank, world_size=world, generation=1, barrier=dist.barrier)
        if rank == 0:
            ck.claim_generation()
        dist.barrier()
        result = ck.save_sharded({"w": distribute_tensor(full, mesh, [Shard(0)]), "epoch": 3}, DCP_STEP)
        target = {"w": distribute_tensor(torch.zeros(DCP_SHAPE), mesh, [Shard(0)]), "epoch": 0}
        loaded = ck.load_sharded(target)
        _say(json.dumps({"rank": rank, "committed": result.committed, "step": loaded.step if loaded else None,
                         "equal": bool(torch.equal(target["w"].full_tensor(), full)), "epoch": target["epoch"],
                         "local_rows": target["w"].to_local().shape[0]}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "dcp":
        dcp_rank(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        sys.stdout.flush()
        os._exit(0)  # torch 2.13 gloo sometimes aborts in static destructors at exit
    else:
        sys.exit(f"usage: {sys.argv[0]} serve ROOT | dcp ROOT RANK WORLD PORT")
