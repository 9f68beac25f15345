"""Is the job's checkpoint directory one directory for all its nodes?

A job's checkpoint directory must be the same directory on every node (a shared filesystem): rank 0
commits a step only once it sees every rank's shard. Given a path that each node resolves to a
directory of its own (each agent's default `checkpoint_dir` on its local disk, say), rank 0 would
wait for shards written elsewhere until its commit times out, and every restart would do the same.

So each rank drops a small marker at `trainlib.init()`::

    .ranks/g000000003/rank-00002.json      {"rank": 2, "node": "node-b", "host": ..., "pid": ...}

and rank 0, at its first save, looks for every rank's marker of its generation (waiting a while:
a shared filesystem may show another node's new file late). A rank whose marker it cannot see
writes into a directory rank 0 does not see: the job cannot checkpoint and no restart mends that.

Only the standard library: `announce` runs in `trainlib.init()`, before the script imports torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainlib._atomic import make_dirs_durable, read_json, write_json_atomic

RANKS_DIR = ".ranks"
_POLL_FIRST_S, _POLL_MAX_S = 0.01, 0.5


def generation_dir(root: Path, generation: int) -> Path:
    return root / RANKS_DIR / f"g{generation:09d}"


def announce(root: Path, generation: int, rank: int, node: str) -> None:
    """Drop this rank's marker for `generation` in `root` (durably: rank 0 may be on another node)."""
    directory = generation_dir(root, generation)
    make_dirs_durable(directory)
    write_json_atomic(directory / f"rank-{rank:05d}.json",
                      {"rank": rank, "node": node, "host": socket.gethostname(), "pid": os.getpid()})


def seen(root: Path, generation: int, world_size: int) -> dict[int, dict[str, Any]]:
    """The markers of `generation` visible here, by rank."""
    directory = generation_dir(root, generation)
    found = {}
    for r in range(world_size):
        marker = read_json(directory / f"rank-{r:05d}.json")
        if marker is not None:
            found[r] = marker
    return found


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def unshared_message(root: Path, node: str, world_size: int, local_world_size: int,
                     found: dict[int, dict[str, Any]], waited_s: float, rank: int = 0) -> str:
    """What a rank tells the user (and Phalanx) when some ranks' markers are not visible to it."""
    missing = [r for r in range(world_size) if r not in found]
    by_node: dict[str, list[int]] = {}
    for r, marker in sorted(found.items()):
        by_node.setdefault(str(marker.get("node") or marker.get("host") or "?"), []).append(r)
    visible = "; ".join(f"ranks {_ranks(rs)} on {n}" for n, rs in by_node.items())
    per_node = max(1, local_world_size)
    groups: dict[int, list[int]] = {}
    for r in missing:
        groups.setdefault(r // per_node, []).append(r)
    nodes = len(range(0, world_size, per_node))
    hidden = ", ".join(f"ranks {_ranks(rs)} (the job's node {g + 1} of {nodes})" for g, rs in groups.items())
    return (f"checkpoint directory {root} is not shared between the job's nodes: rank {rank} on {node} sees no "
            f"marker from {hidden} after {waited_s:g}s (it sees {visible or 'none'}); those ranks write their "
            f"checkpoints into a directory rank {rank} cannot see, so no checkpoint can ever be committed. Give the "
            f"job a directory every node mounts: phalanx submit --checkpoint-dir DIR")


def check(root: Path, generation: int, world_size: int, local_world_size: int, node: str, wait_s: float,
          monotonic: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
          rank: int = 0) -> str:
    """Wait up to `wait_s` for every rank's marker of `generation`; '' once all are visible, else why not. Every
    rank checks at its first save, so each one that cannot see the others says so itself (and none crashes in a
    collective first because another one left).

    Once all are visible, the markers of older generations are removed.
    """
    deadline = monotonic() + wait_s
    pause = _POLL_FIRST_S
    while True:
        found = seen(root, generation, world_size)
        if len(found) == world_size:
            _forget_older(root, generation)
            return ""
        if monotonic() >= deadline:
            return unshared_message(root, node, world_size, local_world_size, found, wait_s, rank)
        sleep(pause)
        pause = min(pause * 1.5, _POLL_MAX_S)


def _forget_older(root: Path, generation: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        for entry in (root / RANKS_DIR).iterdir():
            if entry.name.startswith("g") and entry.name[1:].isdigit() and int(entry.name[1:]) < generation:
                shutil.rmtree(entry, ignore_errors=True)
