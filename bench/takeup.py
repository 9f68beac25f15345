"""Issue 12 microbenchmark: what a new leader's event loop spends per node taking a parked session up.

In one process, no transport: the real NodeService.serve, Registry and JobManager on the memory store, a node
per parked session with 8 simulated GPUs (bench/loadgen.py's heartbeat). The registry of a leader that had
every node registered is loaded by a new one (a takeover), which then serves each session's SessionOpen and its
first heartbeat, twice in one run: with the first health judge inline (as before a takeover deferred it), and
deferred (Registry.defer_judging), whose judges are then timed on their own. CPU seconds of the process
(time.process_time) per node; the controller's GC thresholds (controller/main.py). What the transport adds (the
session port's frames or gRPC) is in the `tls` and `capacity` benchmarks, not here.
"""

from __future__ import annotations

import asyncio
import gc
import time

from bench.common import log

NODES, QUICK_NODES = 8000, 2000


class _Context:
    """The part of a servicer context NodeService.serve uses: the first heartbeat, then nothing more."""

    def __init__(self, first) -> None:
        self._messages = [first]
        self._idle = asyncio.get_running_loop().create_future()

    async def read(self):
        if self._messages:
            return self._messages.pop()
        return await self._idle

    async def write(self, message) -> None:
        message.SerializeToString()  # what the transport's encoder does

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code, details: str = "") -> None:
        raise RuntimeError(f"{code}: {details}")


def _nodes(n: int) -> list:
    from bench.loadgen import simulated_node
    return [simulated_node(i) for i in range(n)]


def _controller(store):
    from controller.api.node_service import NodeService
    from controller.config import JobsConfig, LivenessConfig, RecoveryConfig
    from controller.jobs.manager import JobManager
    from controller.jobs.topology import flat
    from controller.nodes.registry import Registry
    from controller.obs.events import EventHub
    from phalanx.clock import RealClock

    clock, hub = RealClock(), EventHub()
    registry = Registry(store, clock, LivenessConfig(), hub)
    jobs = JobManager(store, registry, clock, hub, JobsConfig(),
                      lambda: flat(e.record.name for e in registry.entries()), RecoveryConfig())
    return registry, jobs, NodeService(registry, jobs)


async def _takeover(store, nodes: list, incarnations: dict, defer: bool) -> dict:
    from phalanx.v1 import node_pb2

    registry, jobs, service = _controller(store)
    await registry.load()
    await jobs.load()
    heard = asyncio.Event()
    beats = [0]
    record = registry.heartbeat

    def counted(entry, heartbeat):
        changed = record(entry, heartbeat)
        beats[0] += 1
        if beats[0] == len(nodes):
            heard.set()
        return changed

    registry.heartbeat = counted
    gc.collect()
    if defer:
        registry.defer_judging()
    started = time.process_time()
    sessions = [asyncio.create_task(service.serve(_Context(beat), node_pb2.AgentMessage(open=node_pb2.SessionOpen(
        node_name=name, incarnation=incarnations[name], standby=True)))) for name, _, beat in nodes]
    await heard.wait()
    took = time.process_time() - started
    result = {"takeup_and_first_heartbeat_us": round(took / len(nodes) * 1e6, 1)}
    if defer:
        started = time.process_time()
        registry.judge_deferred()
        await registry._judging_deferred
        result["deferred_judge_us"] = round((time.process_time() - started) / len(nodes) * 1e6, 1)
        result["judged"] = sum(1 for e in registry.entries() if e.gpu_verdicts)
    for task in sessions:
        task.cancel()
    await asyncio.gather(*sessions, return_exceptions=True)
    return result


async def _run(n: int) -> dict:
    from controller.store.memory import MemoryStore

    nodes = _nodes(n)
    store = MemoryStore()
    old, _, _ = _controller(store)
    await old.load()
    incarnations = {}
    for name, inventory, _ in nodes:
        incarnations[name] = (await old.register(name, inventory, "ipv4:127.0.0.1:1")).record.incarnation
    inline = await _takeover(store, nodes, incarnations, defer=False)
    deferred = await _takeover(store, nodes, incarnations, defer=True)
    return {"nodes": n, "gpus_per_node": 8, "inline": inline, "deferred": deferred}


def run(quick: bool = False) -> dict:
    from phalanx import log as phalanx_log
    n = QUICK_NODES if quick else NODES
    log(f"takeup: {n} parked sessions taken up in process, first judge inline, then deferred ...")
    thresholds = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)  # the controller's (controller/main.py)
    phalanx_log.configure("warning")  # 8,000 registrations would log a line each
    try:
        result = asyncio.run(_run(n))
    finally:
        gc.set_threshold(*thresholds)
    i, d = result["inline"], result["deferred"]
    log(f"takeup: {n} nodes: take-up + first heartbeat {i['takeup_and_first_heartbeat_us']} us inline, "
        f"{d['takeup_and_first_heartbeat_us']} us with the judge deferred (then {d['deferred_judge_us']} us per "
        f"deferred judge, {d['judged']} judged)")
    return result


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
