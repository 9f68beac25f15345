"""Issue 3 benchmarks: injected XID -> controller verdict and drain; the cost of one collector sweep."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

from bench.common import Procs, agent_toml, controller_toml, free_port, log, temp_root, wait_node_up, wait_serving
from phalanx.v1 import control_pb2, control_pb2_grpc

NODE = "bench-health-0"
GOAL_S = 1.0
REPO = Path(__file__).resolve().parent.parent


async def _until(call, node: str, kind: str) -> control_pb2.Event:
    async for event in call:
        if event.node == node and event.kind == kind:
            return event
    raise RuntimeError(f"the event stream ended before {kind}")


async def run(trials: int) -> dict:
    with temp_root(prefix="phalanx-bench-health-") as tmp:
        root = Path(tmp)
        procs = Procs(root)
        try:
            return await _run(procs, root, trials)
        finally:
            procs.close()


async def _run(procs: Procs, root: Path, trials: int) -> dict:
    address = f"127.0.0.1:{free_port()}"
    controller = procs.spawn("controller", "controller.main", controller_toml(address, root))
    await wait_serving(address, procs, controller.pid, "controller")
    agent = procs.spawn("agent", "agent.main", 'nvrx_socket = ""\n' + agent_toml(NODE, address, root))
    samples = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        await wait_node_up(stub, NODE, 0, agent.pid, procs, "agent")
        await asyncio.sleep(1.5)  # a first verdict
        for trial in range(1, trials + 1):
            gpu = (trial - 1) % 8
            last = (await stub.ListEvents(control_pb2.ListEventsRequest(node=NODE, limit=10_000), timeout=5)).events
            call = stub.WatchEvents(control_pb2.WatchEventsRequest(after_seq=last[-1].seq if last else 0, node=NODE))
            t0_ns = time.time_ns()
            t0 = time.monotonic()
            await stub.InjectFault(control_pb2.InjectFaultRequest(node=NODE, gpu_index=gpu, fault="xid=79"),
                                   timeout=5)
            try:
                xid = await asyncio.wait_for(_until(call, NODE, "gpu.xid"), 10)
                drained = await asyncio.wait_for(_until(call, NODE, "node.drain"), 10)
            finally:
                call.cancel()
            seen = time.monotonic() - t0
            samples.append({
                "trial": trial, "gpu": gpu,
                "inject_to_drain_event_s": round(seen, 4),
                "controller_xid_to_drain_ms": round((drained.time_unix_ns - xid.time_unix_ns) / 1e6, 3),
                "inject_to_drain_committed_s": round((drained.time_unix_ns - t0_ns) / 1e9, 4),
                "reason": drained.fields.get("reason", ""),
            })
            log(f"health: trial {trial}/{trials}: XID 79 on GPU {gpu} -> drained {seen * 1000:.0f} ms after the "
                f"inject call (controller: {samples[-1]['controller_xid_to_drain_ms']:.1f} ms from XID to drain)")
            await stub.InjectFault(control_pb2.InjectFaultRequest(node=NODE, gpu_index=gpu, fault="clear"), timeout=5)
            await asyncio.sleep(1.2)  # a heartbeat without the lost flag
            await stub.UndrainNode(control_pb2.UndrainNodeRequest(name=NODE), timeout=5)
            for _ in range(50):
                node = await stub.GetNode(control_pb2.GetNodeRequest(name=NODE), timeout=5)
                if node.state == 1 and node.health == 1:  # UP, HEALTHY
                    break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{NODE} did not come back UP and HEALTHY after trial {trial}")
    values = [s["inject_to_drain_event_s"] for s in samples]
    decide = [s["controller_xid_to_drain_ms"] for s in samples]
    return {
        "trials": len(values),
        "median_s": round(statistics.median(values), 4),
        "max_s": round(max(values), 4),
        "controller_decision_median_ms": round(statistics.median(decide), 3),
        "controller_decision_max_ms": round(max(decide), 3),
        "goal_s": GOAL_S,
        "what": "wall time from the InjectFault call (CLI -> controller -> agent -> simulated NVML event -> agent "
                "-> controller) to the node.drain event arriving on a WatchEvents stream",
        "samples": samples,
    }


def _per_call_us(fn, iterations: int, repeats: int = 5) -> float:
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iterations):
            fn()
        best.append((time.perf_counter() - t0) / iterations * 1e6)
    return round(statistics.median(best), 2)


def sweep(iterations: int = 2000) -> dict:
    """Cost of one collector sweep of 8 GPUs, and of the controller's verdict on an 8-GPU node."""
    sys.path.insert(0, str(REPO))
    from agent.collectors.nvml import NvmlBackend
    from agent.collectors.sim import SimBackend
    from agent.main import health_digest
    from controller.config import HealthConfig
    from controller.nodes.health import GpuHistory, evaluate_node
    from phalanx.v1 import common_pb2
    from tests.fake_pynvml import FakeNvml

    sim = SimBackend(8, "bench")
    nvml = NvmlBackend(FakeNvml(8))
    nvml.sample()  # the first sweep learns which NVLinks exist
    gpus = sim.sample()
    host = common_pb2.HostTelemetry(checkpoint_free_bytes=500 << 30, checkpoint_total_bytes=1 << 40)
    histories = {}
    for g in gpus:
        histories[g.index] = GpuHistory()
        histories[g.index].observe(g, 0.0, 0.0, 60.0)
    cfg = HealthConfig()
    result = {
        "sim_sample_us": _per_call_us(sim.sample, iterations),
        "nvml_sample_fake_driver_us": _per_call_us(nvml.sample, iterations // 4),
        "health_digest_us": _per_call_us(lambda: health_digest(gpus, host), iterations),
        "controller_verdict_8_gpus_us": _per_call_us(lambda: evaluate_node(histories, host, 1.0, cfg), iterations),
        "note": "NVML against tests/fake_pynvml (every query a Python call; the real driver's own time per query "
                "is not included: no GPU on this machine)",
    }
    nvml.close()
    log(f"health: sweep of 8 GPUs: sim {result['sim_sample_us']} us, NVML code path "
        f"{result['nvml_sample_fake_driver_us']} us, digest {result['health_digest_us']} us, "
        f"controller verdict {result['controller_verdict_8_gpus_us']} us")
    return result
