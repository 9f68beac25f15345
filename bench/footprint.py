"""Benchmark 3: one agent (8 simulated GPUs, 1 Hz heartbeats): its RSS and CPU share, sampled with psutil."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import grpc
import psutil

from bench.common import Procs, agent_toml, controller_toml, free_port, log, temp_root, wait_node_up, wait_serving
from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc

NODE = "bench-footprint-0"
RSS_GOAL_MB = 60.0
CPU_GOAL_PCT = 1.0


async def run(warmup_s: float, sample_s: float) -> dict:
    with temp_root(prefix="phalanx-bench-footprint-") as tmp:
        root = Path(tmp)
        procs = Procs(root)
        try:
            return await _run(procs, root, warmup_s, sample_s)
        finally:
            procs.close()


async def _run(procs: Procs, root: Path, warmup_s: float, sample_s: float) -> dict:
    address = f"127.0.0.1:{free_port()}"
    controller = procs.spawn("controller", "controller.main", controller_toml(address, root))
    await wait_serving(address, procs, controller.pid, "controller")
    started_ns = time.time_ns()
    agent = procs.spawn("agent", "agent.main", agent_toml(NODE, address, root))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        await wait_node_up(stub, NODE, started_ns, agent.pid, procs, "agent")
        log(f"footprint: agent UP (pid {agent.pid}); warming up {warmup_s:g} s")
        await asyncio.sleep(warmup_s)
        p = psutil.Process(agent.pid)
        if p.children(recursive=True):
            log("footprint: note: the agent has child processes; only the agent itself is measured")
        before_node = await stub.GetNode(control_pb2.GetNodeRequest(name=NODE), timeout=5.0)
        cpu0 = p.cpu_times()
        t0 = time.monotonic()
        rss, uss = [], []
        log(f"footprint: sampling for {sample_s:g} s")
        next_at = t0
        while True:
            mem = p.memory_full_info()
            rss.append(mem.rss / 1e6)
            uss.append(mem.uss / 1e6)
            next_at += 1.0
            if next_at > t0 + sample_s + 1e-6:
                break
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        cpu1 = p.cpu_times()
        t1 = time.monotonic()
        after_node = await stub.GetNode(control_pb2.GetNodeRequest(name=NODE), timeout=5.0)
        state = after_node.state
    wall = t1 - t0
    cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    cpu_pct = 100.0 * cpu_s / wall
    # Heartbeats over the window, from the controller's side: the node's last heartbeat time moved by ~wall.
    result = {
        "warmup_s": warmup_s,
        "sampled_s": round(wall, 2),
        "samples": len(rss),
        "rss_mb_mean": round(statistics.fmean(rss), 1),
        "rss_mb_max": round(max(rss), 1),
        "uss_mb_max": round(max(uss), 1),
        "cpu_percent": round(cpu_pct, 3),
        "cpu_seconds": round(cpu_s, 3),
        "rss_goal_mb": RSS_GOAL_MB,
        "cpu_goal_percent": CPU_GOAL_PCT,
        "node_state_at_end": common_pb2.NodeState.Name(state),
        "last_heartbeat_advanced_s": round((after_node.last_heartbeat_unix_ns - before_node.last_heartbeat_unix_ns)
                                           / 1e9, 2),
        "note": "psutil on the agent process: RSS sampled every second; CPU = delta (user+system) / delta wall, "
                "as a percentage of one core.",
    }
    log(f"footprint: RSS max {result['rss_mb_max']} MB, CPU {result['cpu_percent']}% of one core")
    return result
