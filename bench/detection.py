"""Benchmark 1: how long after `kill -9` of an agent the controller publishes `node.state` -> DOWN."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from pathlib import Path

import grpc

from bench.common import (
    Procs,
    agent_toml,
    controller_toml,
    free_port,
    last_event_seq,
    log,
    temp_root,
    wait_node_up,
    wait_serving,
)
from phalanx.v1 import control_pb2, control_pb2_grpc

NODE = "bench-detect-0"
GOAL_S = 3.0
DOWN_AFTER_S = 3.0  # controller default (liveness.down_after_s); 1 s heartbeats, SUSPECT after 2 s


async def _watch_for_down(call, t_kill: float) -> tuple[float, float | None, control_pb2.Event]:
    """Read the stream until a DOWN for NODE; returns (seconds to DOWN, seconds to SUSPECT or None, event)."""
    suspect = None
    async for event in call:
        if event.kind != "node.state" or event.node != NODE:
            continue
        target = event.fields.get("target")
        if target == "SUSPECT" and suspect is None:
            suspect = time.monotonic() - t_kill
        if target == "DOWN":
            return time.monotonic() - t_kill, suspect, event
    raise RuntimeError("the WatchEvents stream ended before the DOWN event")


async def run(trials: int, seed: int | None = None) -> dict:
    rng = random.Random(seed)
    with temp_root(prefix="phalanx-bench-detect-") as tmp:
        root = Path(tmp)
        procs = Procs(root)
        try:
            return await _run(procs, root, trials, rng)
        finally:
            procs.close()


async def _run(procs: Procs, root: Path, trials: int, rng: random.Random) -> dict:
    address = f"127.0.0.1:{free_port()}"
    controller = procs.spawn("controller", "controller.main", controller_toml(address, root))
    await wait_serving(address, procs, controller.pid, "controller")
    log(f"detection: controller serving on {address}")
    agent_text = agent_toml(NODE, address, root)
    samples: list[dict] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        last_seq = 0
        agent_name = "agent"
        started_ns = time.time_ns()
        agent = procs.spawn(agent_name, "agent.main", agent_text)
        for trial in range(1, trials + 1):
            t_start = time.monotonic()
            await wait_node_up(stub, NODE, started_ns, agent.pid, procs, agent_name)
            up_s = time.monotonic() - t_start
            # Steady heartbeats for a moment, then a random phase of the 1 s heartbeat interval.
            await asyncio.sleep(1.0 + rng.random())
            last_seq = await last_event_seq(stub, last_seq)
            call = stub.WatchEvents(control_pb2.WatchEventsRequest(after_seq=last_seq, node=NODE))
            node = await stub.GetNode(control_pb2.GetNodeRequest(name=NODE), timeout=5.0)
            await asyncio.sleep(0.05)  # let the stream reach the server (the replay covers it anyway)
            kill_ns = time.time_ns()
            t_kill = time.monotonic()
            os.kill(agent.pid, signal.SIGKILL)
            silence_at_kill = (kill_ns - node.last_heartbeat_unix_ns) / 1e9
            try:
                seconds, suspect_s, event = await asyncio.wait_for(_watch_for_down(call, t_kill), 20.0)
            except TimeoutError:
                raise RuntimeError(f"no DOWN event for {NODE} within 20 s of the kill; controller log ends:\n"
                                   f"{procs.tail('controller')}") from None
            finally:
                call.cancel()
            procs.kill(agent.pid)  # reap
            procs.forget(agent.pid)
            sample = {
                "trial": trial,
                "seconds": round(seconds, 4),
                "controller_decided_s": round((event.time_unix_ns - kill_ns) / 1e9, 4),
                "suspect_s": None if suspect_s is None else round(suspect_s, 4),
                "silence_at_kill_s": round(silence_at_kill, 4),
                "expected_s": round(DOWN_AFTER_S - silence_at_kill, 4),
                "agent_up_s": round(up_s, 3),
            }
            samples.append(sample)
            last_seq = event.seq
            log(f"detection: trial {trial}/{trials}: DOWN after {seconds:.3f} s "
                f"(last heartbeat {silence_at_kill:.3f} s before the kill; SUSPECT after "
                f"{'-' if suspect_s is None else f'{suspect_s:.3f}'} s)")
            if trial < trials:
                started_ns = time.time_ns()
                agent = procs.spawn(agent_name, "agent.main", agent_text)
    values = [s["seconds"] for s in samples]
    return {
        "trials": len(values),
        "median_s": round(statistics.median(values), 4),
        "max_s": round(max(values), 4),
        "min_s": round(min(values), 4),
        "mean_s": round(statistics.fmean(values), 4),
        "goal_s": GOAL_S,
        "samples_s": values,
        "trial_details": samples,
        "note": "kill -9 of the agent to arrival of the node.state target=DOWN event on a WatchEvents stream "
                "(opened before the kill). Expected by design: down_after_s (3 s) minus the time since the last "
                "heartbeat, plus up to one liveness tick (0.1 s).",
    }
