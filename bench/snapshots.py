"""Issue 11 benchmark: what in-memory snapshots cost a training step, and how fast a peer hands one back.

- Overhead: the same CPU-bound step (matmuls, ~60 ms on one thread) with and without trainlib's
  snapshotter, at 10 MB, 100 MB and 1 GB of state per rank, measured in one run as a ratio of mean step
  times. The snapshotter writes into a tmpfs directory (/dev/shm) and tunes its interval to its 3 % budget;
  the steady state is measured, once that interval has settled, over whole intervals (each with its copy),
  and the interval it chose is reported. The steps of the tuning itself (a copy at 1, 2, 4, ... steps while
  the interval grows) are reported apart.
- Peer restore: a 1 GB snapshot read from one agent's bulk port (its SnapshotService hands out the ticket; a
  process of its own, as on another node) into another's store over loopback (the path a rank on a spare
  takes), CRC-checked on arrival, in GB/s (the median of PEER_TRIALS), and the same over the gRPC stream it
  falls back to; and a replica the other way, pulled by the peer from this side's bulk port, and put by stream.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import log

SIZES_MB = (10, 100, 1000)
PEER_TRIALS = 3  # peer restores, median reported: the first on a fresh tmpfs runs slower
STEP_S = 0.06
SETTLED = 1  # copies that left the interval as it was: it has stopped growing
MAX_STEADY_STEPS = 600  # steps a size may take to settle and be measured over two whole intervals (~36 s)


class _Agent:
    """Stands in for the agent's SnapshotTaken: says yes."""

    def __call__(self, request):
        from phalanx.v1 import local_pb2
        return local_pb2.SnapshotTakenReply()


def _state(mb: int):
    import torch
    return {"model": {f"w{i}": torch.randn(mb * 1_000_000 // 4 // 10) for i in range(10)}, "step": 0}


def _work(a, b, until: float) -> None:
    import torch
    while time.perf_counter() < until:
        torch.mm(a, b)


def overhead(mb: int, steps: int, max_steps: int = MAX_STEADY_STEPS) -> dict:
    """Mean step time with the snapshotter against without, in steady state: the snapshotter first runs until its
    interval has settled (a copy left it unchanged), then whole intervals are measured, each with its copy.
    Where an interval is longer than `max_steps / 2`, `steps` after the warm-up are measured (at most one copy in
    them) and the figure to read is the amortized one: the copy's time over the interval's steps."""
    import torch

    from trainlib._snapshot import Snapshotter
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    state = _state(mb)
    root = Path(tempfile.mkdtemp(prefix="phalanx-bench-snap-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        clock = {"step": 0, "last": time.perf_counter()}

        def run(snapshotter: Snapshotter | None, n: int) -> float:
            """`n` steps from the current step; their mean time."""
            started = clock["last"] = time.perf_counter()
            for _ in range(n):
                _work(a, a, time.perf_counter() + STEP_S)  # the step's compute, by the clock: a fixed amount of work
                now = time.perf_counter()
                if snapshotter is not None:
                    snapshotter.offer(state, clock["step"], now - clock["last"])
                clock["step"] += 1
                clock["last"] = now
            if snapshotter is not None:
                snapshotter.wait()
            return (time.perf_counter() - started) / n

        before = run(None, steps)
        snapshotter = Snapshotter(root, "bench", 1, 0, _Agent())
        settled, interval, taken = 0, 0, 0
        while settled < SETTLED and clock["step"] < max_steps:
            run(snapshotter, 1)
            if snapshotter.taken != taken:
                taken = snapshotter.taken
                settled, interval = (settled + 1, interval) if snapshotter.interval == interval else \
                    (0, snapshotter.interval)
        warmup = clock["step"]
        interval = snapshotter.interval
        steady = interval * 2 <= max_steps
        window = interval * max(2, -(-steps // interval)) if steady else steps
        if steady:  # start at a step a copy is due at: the window holds exactly window / interval copies
            run(snapshotter, -clock["step"] % interval)
        with_snapshots = run(snapshotter, window)
        baseline = (before + run(None, steps)) / 2  # either side of it: a machine that drifts meanwhile counts half
        amortized = snapshotter.copy_s / (snapshotter.interval * baseline)
        return {"state_mb": mb, "step_ms": round(baseline * 1e3, 2), "step_with_snapshots_ms":
                round(with_snapshots * 1e3, 2), "overhead_pct": round((with_snapshots / baseline - 1) * 100, 2),
                "amortized_pct": round(amortized * 100, 2), "steps": window, "steady": steady,
                "warmup_steps": warmup, "interval_steps": snapshotter.interval,
                "copy_ms": round(snapshotter.copy_s * 1e3, 2), "taken": snapshotter.taken,
                "skipped_busy_writer": snapshotter.skipped, "error": snapshotter.disabled}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# The peer agent, in a process of its own as on another node: holds a snapshot of `mb` MB (rank 0) and serves
# its SnapshotService until its stdin closes; prints the address it serves at.
PEER = """
import asyncio, sys, zlib
from pathlib import Path
from agent import bulk, snapshots as snaps

async def main():
    root, mb = Path(sys.argv[1]), int(sys.argv[2])
    store = snaps.SnapshotStore(root, budget_bytes=4 * mb * 1_000_000)
    key = snaps.Key("bench", 1, 0, 7)
    path = store.path(snaps.OWN, key)
    path.parent.mkdir(parents=True)
    block, crc = bytes(range(256)) * 4096, 0
    with open(path, "wb") as f:
        for _ in range(mb * 1_000_000 // len(block)):
            f.write(block)
            crc = zlib.crc32(block, crc)
    store.accept_own(key, str(path), path.stat().st_size, crc)
    server, address = await snaps.serve("127.0.0.1:0", snaps.SnapshotService(
        store, lambda *a, **k: None, bulk_server=bulk.BulkServer("127.0.0.1"),
        puller=snaps.Replicator(store, lambda *a, **k: None)))
    print(address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)

asyncio.run(main())
"""


async def peer_restore(mb: int) -> dict:
    """Get a snapshot from a peer agent (another process, as on another node) and Put one back to it."""
    import os
    import subprocess
    import sys

    from agent import bulk
    from agent import snapshots as snaps
    root = Path(tempfile.mkdtemp(prefix="phalanx-bench-peer-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    repo = str(Path(__file__).resolve().parent.parent)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(root / "peer"), str(mb)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=repo,
                            env={**os.environ, "PYTHONPATH": repo})
    try:
        address = peer.stdout.readline().strip()
        if not address:
            raise RuntimeError("the peer agent did not start")
        here = snaps.SnapshotStore(root / "here", budget_bytes=4 * mb * 1_000_000)
        key = snaps.Key("bench", 1, 0, 7)
        fetcher = snaps.Replicator(here, lambda *x, **k: None)
        started = time.perf_counter()
        fetched = await fetcher.fetch_bulk(address, key)  # as a restore does (fetch falls back to the stream)
        get_s = time.perf_counter() - started
        if fetched is None:
            raise RuntimeError("the peer agent serves no bulk port")
        started = time.perf_counter()
        await fetcher.fetch_stream(address, key)  # what a restore falls back to, for the ratio
        stream_s = time.perf_counter() - started
        c_key = snaps.Key("bench", 1, 1, 7)  # another rank's, so the peer holds it as a new replica
        c_path = here.path(snaps.OWN, c_key)
        c_path.parent.mkdir(parents=True)
        shutil.copyfile(fetched.path, c_path)
        held = here.accept_own(c_key, str(c_path), fetched.size, fetched.crc32)
        # this side serves its snapshots as an agent does, so that the peer can pull the replica from its bulk port
        here_bulk = bulk.BulkServer("127.0.0.1")
        here_server, here_address = await snaps.serve("127.0.0.1:0", snaps.SnapshotService(
            here, lambda *x, **k: None, bulk_server=here_bulk))
        pusher = snaps.Replicator(here, lambda *x, **k: None)
        pusher.own_port = int(here_address.rsplit(":", 1)[1])
        started = time.perf_counter()
        await pusher._send(address, held)
        put_s = time.perf_counter() - started
        while here_bulk.transfers:  # its thread counts the file just after the peer has it all
            await asyncio.sleep(0.005)
        if here_bulk.served != 1:
            raise RuntimeError("the peer did not pull the replica from the bulk port")
        streamer = snaps.Replicator(here, lambda *x, **k: None)  # no bulk port: Put by stream, for the ratio
        started = time.perf_counter()
        await streamer._send(address, held)
        put_stream_s = time.perf_counter() - started
        await here_server.stop(None)
        here_bulk.close()
        for replicator in (fetcher, pusher, streamer):
            await replicator.close()
        return {"size_mb": round(fetched.size / 1e6), "get_gbps": round(fetched.size / get_s / 1e9, 2),
                "stream_gbps": round(fetched.size / stream_s / 1e9, 2),
                "put_gbps": round(fetched.size / put_s / 1e9, 2),
                "put_stream_gbps": round(fetched.size / put_stream_s / 1e9, 2),
                "replicated": pusher.sent == 1 and streamer.sent == 1}
    finally:
        peer.stdin.close()
        peer.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)


async def run(quick: bool = False) -> dict:
    results = []
    for mb in SIZES_MB[:2] if quick else SIZES_MB:
        steps = 60 if quick else 150
        log(f"snapshots: {mb} MB of state, steps of ~{STEP_S * 1e3:.0f} ms without, then with snapshots once their "
            "interval has settled ...")
        r = overhead(mb, steps)
        log(f"snapshots: {mb} MB: {r['overhead_pct']:+.1f} % step time over {r['steps']} steps "
            f"({'steady state' if r['steady'] else 'not whole intervals: read the amortized figure, '}"
            f"{'' if r['steady'] else format(r['amortized_pct'], '+.1f') + ' %'}), every {r['interval_steps']} "
            f"step(s) after {r['warmup_steps']} of tuning, copy {r['copy_ms']} ms")
        results.append(r)
    size = 200 if quick else 1000
    log(f"snapshots: peer restore of {size} MB over loopback, {PEER_TRIALS} times ...")
    trials = [await peer_restore(size) for _ in range(PEER_TRIALS)]
    peer = {**trials[0], "get_gbps": statistics.median(t["get_gbps"] for t in trials),
            "put_gbps": statistics.median(t["put_gbps"] for t in trials),
            "stream_gbps": statistics.median(t["stream_gbps"] for t in trials),
            "put_stream_gbps": statistics.median(t["put_stream_gbps"] for t in trials),
            "replicated": all(t["replicated"] for t in trials),
            "get_gbps_each": [t["get_gbps"] for t in trials], "put_gbps_each": [t["put_gbps"] for t in trials]}
    log(f"snapshots: peer restore {peer['get_gbps']} GB/s from the bulk port (median; each {peer['get_gbps_each']}),"
        f" {peer['stream_gbps']} GB/s as a gRPC stream; replica {peer['put_gbps']} GB/s pulled from the bulk port, "
        f"{peer['put_stream_gbps']} GB/s put by stream")
    return {"overhead": results, "peer": peer, "budget_pct": 3.0, "restore_goal_gbps": 1.0}
