"""The controller's heartbeat path with a large job running: what the job manager spends on one node's heartbeat.

A job of N nodes x 8 ranks runs; each node's heartbeat reports its 8 ranks RUNNING and their progress (trainlib's
report), as an agent's does at every interval. In one process, no transport: the real JobManager
(`JobManager.observe`, which folds a heartbeat into the jobs) on the memory store, its record built as the lifecycle
builds a generation's. CPU seconds (time.process_time) per heartbeat, at two job sizes in one run: a heartbeat must
cost what the node reports, not what the job holds, or a fleet of N nodes beating once a second costs N^2 (at
16,384 nodes that would be many cores' worth). The figure that matters is the ratio of the two sizes' costs.
Then the same with in-memory snapshots on, as trainlib keeps them: each node also reports the 4 newest steps of its
own ranks and of its peer's (replicas), and the job's first node's heartbeat asks for the newest step every rank
holds twice over (once an interval: the step the agents pin), about a million snapshots at 16,384 nodes.
Then the job's record as stored (its rank table packed: controller/jobs/record.py): its size, and the CPU to pack
it (each commit) and to read it back (a restart, a takeover). Then a scheduler pass over a queue of pending jobs on a
fleet of that many nodes: one look at the fleet a pass, not one a job.
Then one scheduler step of the larger job (the executor's view, the lifecycle's decision), every node registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from types import SimpleNamespace

from bench.common import log
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb

SIZES, QUICK_SIZES = (1_000, 16_384), (500, 4_000)
PER_NODE = 8
ROUNDS = 3  # rounds over the sampled nodes' heartbeats
KEEP_STEPS = 4  # the steps a node reports of each rank it holds (agent/snapshots.py)
STEP = 100  # the ranks' newest step
SAMPLE = 2_000  # nodes whose heartbeats are timed, spread over the job (the code before this benchmark took ~0.1 s a
# heartbeat at 16,384 nodes: a round of every node would take half an hour)


def _manager():
    from controller.config import JobsConfig, LivenessConfig, RecoveryConfig
    from controller.jobs.manager import JobManager
    from controller.jobs.topology import flat
    from controller.nodes.registry import Registry
    from controller.obs.events import EventHub
    from controller.store.memory import MemoryStore
    from phalanx.clock import RealClock

    store, clock, hub = MemoryStore(), RealClock(), EventHub()
    registry = Registry(store, clock, LivenessConfig(), hub)
    return JobManager(store, registry, clock, hub, JobsConfig(), lambda: flat([]), RecoveryConfig())


@contextlib.contextmanager
def _in_rows():
    """The job's rank table in rows, as every table was before a large job's was held packed (phalanx/ranks.py)."""
    packed_from, ranktable.PACKED_FROM = ranktable.PACKED_FROM, 1 << 62
    try:
        yield
    finally:
        ranktable.PACKED_FROM = packed_from


def _job(nodes: list[str]):
    from controller.recovery import lifecycle
    from phalanx.v1 import common_pb2 as pb

    job = pb.Job(id="job-1", state=pb.JOB_STATE_RUNNING, generation=1, launched_generation=1,
                 spec=pb.JobSpec(command=["train"], nodes=len(nodes), ranks_per_node=PER_NODE))
    lifecycle.with_nodes(job, nodes, [])
    ranktable.set_span(job, 0, ranktable.count(job), pb.RANK_STATE_RUNNING)
    return job


def _heartbeats(nodes: list[str], sample: range, snapshots: bool = False) -> list:
    """Each sampled node's heartbeat: its ranks RUNNING, their progress, and (`snapshots`) the newest KEEP_STEPS
    steps of its own ranks and, as replicas, of the node before it (every rank is held on two nodes)."""
    from phalanx.v1 import common_pb2 as pb
    from phalanx.v1 import node_pb2

    beats = []
    for i in sample:
        name = nodes[i]
        ranks = range(i * PER_NODE, (i + 1) * PER_NODE)
        peer = (i - 1) % len(nodes)
        held = [node_pb2.SnapshotHeld(job="job-1", generation=1, rank=r, step=step, size=1 << 20, replica=replica)
                for replica, of in ((False, ranks), (True, range(peer * PER_NODE, (peer + 1) * PER_NODE)))
                for r in of for step in range(STEP - KEEP_STEPS + 1, STEP + 1)] if snapshots else []
        beats.append((SimpleNamespace(record=SimpleNamespace(name=name)), node_pb2.Heartbeat(
            ranks=[node_pb2.RankStatus(job="job-1", generation=1, rank=r, state=pb.RANK_STATE_RUNNING, pid=1000 + r)
                   for r in ranks],
            progress=[node_pb2.RankProgress(job="job-1", generation=1, rank=r, last_step=STEP, mean_step_s=1.0,
                                              steps=STEP) for r in ranks],
            snapshots=held)))
    return beats


def _per_heartbeat_us(n: int, snapshots: bool = False) -> dict[str, float]:
    """CPU per heartbeat of the sampled nodes; with `snapshots`, every node has reported its snapshots first, and
    the job's first node's heartbeat (which asks for the safe step) is timed on its own too."""
    from controller.recovery.entry import JobEntry

    nodes = [f"node-{i:05d}" for i in range(n)]
    jobs = _manager()
    job = _job(nodes)
    entry = jobs.entries[job.id] = JobEntry(job, 1, generation=job.generation)
    jobs.index(job)
    jobs.wake = lambda: None  # no executor runs here: the fold alone is measured
    every = n // SAMPLE if n >= SAMPLE else 1
    beats = _heartbeats(nodes, range(1, n, every), snapshots)  # (node 0's heartbeat is the safe step's)
    first = _heartbeats(nodes, range(1), snapshots)[0]
    for i in range(1, n) if snapshots else ():  # every node's snapshots known, as after an interval
        jobs.observe(*(_heartbeats(nodes, range(i, i + 1), True)[0]))
    jobs.observe(*first)  # the first progress report makes every rank's track
    assert len(entry.tracks) == n * PER_NODE, "every rank's progress followed"
    assert entry.safe == ((1, STEP) if snapshots else None), "the newest step, held twice over, found"
    gc.collect()
    started = time.process_time()
    for _ in range(ROUNDS):
        for node, beat in beats:
            assert not jobs.observe(node, beat)  # nothing stale: the reports are the generation's own
    took = time.process_time() - started
    assert not entry.missing, "every rank reported by its node"
    result = {"heartbeat_us": round(took / (ROUNDS * len(beats)) * 1e6, 1)}
    if snapshots:
        started = time.process_time()
        for _ in range(ROUNDS):
            assert not jobs.observe(*first)
        result["safe_step_us"] = round((time.process_time() - started) / ROUNDS * 1e6, 1)
    return result


def _step_ms(n: int) -> dict[str, float]:
    """One scheduler step of the running job of `n` nodes, every node registered and heard from (the real
    Registry and Executor): the executor's view of the job, then the lifecycle's decision on it. A step runs every
    jobs.schedule_interval_s and on news; it costs the job's size, once, not once per node."""
    from bench.loadgen import simulated_node
    from controller.recovery import lifecycle
    from controller.recovery.entry import JobEntry

    async def go() -> dict[str, float]:
        jobs = _manager()
        registry = jobs.registry
        await registry.load()
        nodes = [simulated_node(i) for i in range(n)]
        names = [name for name, _, _ in nodes]
        for i, (name, inventory, message) in enumerate(nodes):  # each beat as an agent's: its ranks running too
            message.heartbeat.ranks.extend(_heartbeats(names, range(i, i + 1))[0][1].ranks)
            registry.heartbeat(await registry.register(name, inventory, "ipv4:127.0.0.1:1"), message.heartbeat)
        job = _job(names)
        entry = JobEntry(job, 1, generation=job.generation)
        jobs.entries[job.id] = entry
        jobs.index(job)
        policy = jobs.policy()
        gc.collect()
        started = time.process_time()
        for _ in range(ROUNDS):
            view = jobs.executor.view(entry, False)
        viewed = time.process_time()
        for _ in range(ROUNDS):
            assert not lifecycle.plan(entry.job, lambda fleet: view, jobs.now(), policy)  # it trains on
        planned = time.process_time()
        return {"view_ms": round((viewed - started) / ROUNDS * 1e3, 1),
                "decision_ms": round((planned - viewed) / ROUNDS * 1e3, 1)}
    return asyncio.run(go())


QUEUED = 30  # pending jobs in the queue of the fleet-wide pass


def _queue_ms(n: int) -> dict[str, float]:
    """A scheduler pass over 1, then QUEUED, pending jobs that do not fit a fleet of `n` nodes (every node
    registered, connected and heard from): each step of a pending job sees the whole fleet. CPU per pass, once each
    job has said why it waits (no commit in the passes timed)."""
    from bench.loadgen import simulated_node
    from phalanx.v1 import common_pb2 as pb

    async def go(queued: int) -> float:
        jobs = _manager()
        registry = jobs.registry
        await registry.load()
        for name, inventory, message in (simulated_node(i) for i in range(n)):
            entry = await registry.register(name, inventory, "ipv4:127.0.0.1:1")
            registry.heartbeat(entry, message.heartbeat)
            entry.session, entry.judge_deferred = object(), False  # (connected: a candidate like any)
        for _ in range(queued):
            await jobs.submit(pb.JobSpec(command=["train"], nodes=n + 1, ranks_per_node=PER_NODE), "bench")
        await jobs.executor.run_pass()  # each says why it waits
        gc.collect()
        started = time.process_time()
        for _ in range(ROUNDS):
            await jobs.executor.run_pass()
        return round((time.process_time() - started) / ROUNDS * 1e3, 1)
    return {"one_ms": asyncio.run(go(1)), "queued_ms": asyncio.run(go(QUEUED)), "queued": QUEUED}


def _record(n: int) -> dict[str, float]:
    """The job's stored record (controller/jobs/record.py): its size in full and packed, and the CPU to pack it (each
    commit) and to read it back (a restart, a takeover)."""
    from controller.jobs import record

    job = _job([f"node-{i:05d}" for i in range(n)])
    for rank in ranktable.numbers(job):
        ranktable.set_pids(job, rank, 100_000 + rank, 90_000 + rank)
    full = pb.Job()  # the same table in rows, as an earlier release held it
    full.CopyFrom(job)
    full.ClearField("packed_ranks")
    full.ranks.extend(ranktable.rows(job))
    out = {"full_bytes": full.ByteSize()}
    for form, held in (("", job), ("rows_", full)):  # held packed; held in rows (packed as it is stored)
        started = time.process_time()
        for _ in range(ROUNDS):
            data = record.pack(held)
        packed = time.process_time()
        for _ in range(ROUNDS):
            record.unpack(data)
        read = time.process_time()
        out.update({f"{form}packed_bytes": len(data), f"{form}pack_ms": round((packed - started) / ROUNDS * 1e3, 1),
                    f"{form}unpack_ms": round((read - packed) / ROUNDS * 1e3, 1)})
    return out


def run(quick: bool = False) -> dict:
    from phalanx import log as phalanx_log
    phalanx_log.configure("warning")  # 16,384 registrations would log a line each
    small, large = QUICK_SIZES if quick else SIZES
    log(f"job-heartbeats: one job of {small:,} then {large:,} nodes x {PER_NODE} ranks, each node's heartbeat "
        "folded in (in process) ...")
    result = {"per_node": PER_NODE, "small_nodes": small, "large_nodes": large,
              "small_us": _per_heartbeat_us(small)["heartbeat_us"],
              "large_us": _per_heartbeat_us(large)["heartbeat_us"]}
    result["ratio"] = round(result["large_us"] / result["small_us"], 2)
    with _in_rows():
        result["large_rows_us"] = _per_heartbeat_us(large)["heartbeat_us"]
    log(f"job-heartbeats: {result['small_us']} us a heartbeat at {small:,} nodes, {result['large_us']} us at "
        f"{large:,} (x{result['ratio']} for a job {large / small:.1f} times larger; {result['large_rows_us']} us with "
        "its rank table in rows); with snapshots ...")
    result["snapshots"] = {"keep_steps": KEEP_STEPS, "small": _per_heartbeat_us(small, True),
                           "large": _per_heartbeat_us(large, True)}
    snap = result["snapshots"]
    snap["ratio"] = round(snap["large"]["heartbeat_us"] / snap["small"]["heartbeat_us"], 2)
    snap["safe_step_ratio"] = round(snap["large"]["safe_step_us"] / snap["small"]["safe_step_us"], 2)
    log(f"job-heartbeats: with snapshots, {snap['small']['heartbeat_us']} / {snap['large']['heartbeat_us']} us a "
        f"heartbeat (x{snap['ratio']}); the first node's, which asks for the safe step, "
        f"{snap['small']['safe_step_us']} / {snap['large']['safe_step_us']} us (x{snap['safe_step_ratio']})")
    result["record"] = rec = _record(large)
    log(f"job-heartbeats: the record of the job of {large:,} nodes: {rec['full_bytes'] / 1e6:.2f} MB in full, "
        f"{rec['packed_bytes'] / 1e6:.2f} MB as stored; held packed, written in {rec['pack_ms']} ms, read back in "
        f"{rec['unpack_ms']} ms (held in rows: {rec['rows_pack_ms']} / {rec['rows_unpack_ms']} ms)")
    result["queue"] = queue = _queue_ms(large)
    log(f"job-heartbeats: a pass over 1 / {QUEUED} pending jobs on a fleet of {large:,} nodes: {queue['one_ms']} / "
        f"{queue['queued_ms']} ms")
    result["step"] = _step_ms(large)
    with _in_rows():
        result["step_rows"] = _step_ms(large)
    log(f"job-heartbeats: a step of the job of {large:,} nodes: its view {result['step']['view_ms']} ms, the decision "
        f"{result['step']['decision_ms']} ms (its rank table in rows: {result['step_rows']['decision_ms']} ms)")
    return result


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(run("--quick" in sys.argv), indent=2))
