"""Failover under load: kill -9 of the leader with thousands of simulated agents (bench/loadgen.py) connected.

Three controllers on one etcd member (the controllers pinned to CPU 0, etcd and the load generator to CPU 1:
a 2-core machine cannot give three etcd members cores of their own). The generator's nodes follow the leader
as agents do, and park a session at each standby as agents do. The standbys run at nice 10: on a real control
plane they have machines of their own, and here the sessions parked at them must not take the leader's core
(the bench turns the new leader back to nice 0 as soon as it answers). For each N: grow to N sessions at the
leader, wait until both standbys hold N parked sessions, let it settle, wait until the fleet is whole (every
session open at the leader, none declared SUSPECT or DOWN for 3 s), kill -9 the leader, and time until a
new leader holds all N sessions again; then wait out the reconnect window and count node.state events to
SUSPECT or DOWN since the kill (goal 0: no live node declared DOWN because the controller was busy), and read
the new leader's heartbeat lag (p99 of its window). With --kills K the leader is killed K times per N: each killed
controller starts again as a standby, and the next kill waits until every node has parked a session at it.
The load generators collect no garbage (bench/loadgen.py --gc-off): a collection of one takeover's garbage stopped
a generator for seconds, and the leader rightly declared its nodes silent. Collections between kills, one
generator at a time, were no better: pauses of 1.4-4.1 s, growing kill after kill, and up to 2,405 nodes declared
before the next kill (not kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import signal
import time
from pathlib import Path

import grpc

from bench.capacity import Generator, _share, raise_fd_limit
from bench.common import Procs, etcd_store_toml, free_port, log, temp_root
from phalanx import etcdlocal, framed
from phalanx.v1 import control_pb2, control_pb2_grpc

SETTLE_S = 5.0
STANDBY_NICE = 10
QUIET_S = 3.0  # before the kill: no node declared SUSPECT or DOWN for this long, every session open
WHOLE_TIMEOUT_S = 120.0
# With the session port every node holds three connections of its own in the generator (its session and one
# parked at each standby), where gRPC puts 50 nodes on one: the nodes are split over processes, each within the
# open-file limit (20,000 here, and not raised by root either).
SESSION_GENERATORS = 2


class _Fleet:
    """The simulated nodes over one or more load generator processes, asked as one."""

    def __init__(self, gens: list[Generator]) -> None:
        self.gens = gens

    async def call(self, cmd: dict, timeout_s: float = 60.0) -> dict:
        if cmd["cmd"] == "grow":
            asked = [{**cmd, "total": _share(cmd["total"], i, len(self.gens))} for i in range(len(self.gens))]
        else:
            asked = [cmd] * len(self.gens)
        replies = await asyncio.gather(*(g.call(c, timeout_s) for g, c in zip(self.gens, asked, strict=True)))
        merged: dict = dict(replies[0])
        for reply in replies[1:]:
            for key, value in reply.items():
                if key == "errors":
                    merged[key] = merged.get(key, []) + value
                elif isinstance(value, (int, float)) and not isinstance(value, bool) and key in merged:
                    # times and lateness: the worst of the generators; counts: their sum
                    worst = key.endswith("_ms") or key in ("time", "id", "seconds")
                    merged[key] = max(merged[key], value) if worst else merged[key] + value
        return merged

    async def close(self) -> None:
        for gen in self.gens:
            await gen.close()


def renice(pid: int, nice: int) -> None:
    """Every thread of `pid` (Linux sets a nice value per thread; gRPC's poller threads do much of the work)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
WINDOW_S = 10.0  # after every node is back: longer than takeover_grace_s + down_after_s


def controller_toml(address: str, root: Path, name: str, etcd: str, session_port: int = 0) -> str:
    return (f'listen = "{address}"\nstate_db = "{root / (name + ".db")}"\n'
            + (f'session_listen = "{framed.session_address(address, session_port)}"\n' if session_port else "")
            + '[security]\ninsecure = true\n' + etcd_store_toml(etcd, name, address))


def _takeover_phases(log_path: Path, killed_at: float) -> dict:
    """From the new leader's log: seconds after the kill (wall clock) its store was loaded (and how many node
    records it read for it: a standby keeps them warm) and its take-up of the parked sessions began."""
    out: dict = {}
    for line in log_path.read_text(errors="replace").splitlines():
        if '"node records loaded"' not in line and '"taking up the sessions parked here"' not in line:
            continue
        with contextlib.suppress(ValueError, KeyError):
            entry = json.loads(line)
            after = datetime.datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp() - killed_at
            if after < 0:
                continue
            if entry["event"] == "node records loaded":
                out.update(nodes_loaded_after_kill_s=round(after, 3), node_records_read=entry["read"])
            else:
                out["take_up_began_after_kill_s"] = round(after, 3)
    return out


async def _ask(address: str, fn, timeout: float = 2.0):
    options = [("grpc.max_receive_message_length", 1 << 30)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        return await fn(control_pb2_grpc.ControlServiceStub(channel), timeout)


async def _leader(addresses: list[str]) -> tuple[str, str, int] | None:
    for address in addresses:
        try:
            r = await _ask(address, lambda s, t: s.ListControllers(control_pb2.ListControllersRequest(), timeout=t))
        except grpc.aio.AioRpcError:
            continue
        if r.leader:
            return r.leader, r.leader_address, r.epoch
    return None


async def _sessions(address: str) -> int:
    try:
        return (await _ask(address, lambda s, t: s.GetStats(control_pb2.GetStatsRequest(), timeout=t))).sessions
    except grpc.aio.AioRpcError:
        return -1


async def _last_seq(address: str) -> int:
    """The event log's last seq, in one call (the newest event), however long the log."""
    reply = await _ask(address, lambda s, t: s.ListEvents(control_pb2.ListEventsRequest(limit=1, newest=True),
                                                         timeout=t), timeout=60)
    return reply.events[-1].seq if reply.events else 0


async def _suspect_or_down(address: str, after_seq: int) -> tuple[int, int, int, list[str]]:
    """After `after_seq`: (node.state events that declare a node SUSPECT or DOWN, node.state events that name
    SUSPECT or DOWN at all (a node leaving SUSPECT too: one declared before the kill), the last seq, the messages
    of the first few of those)."""
    declared, named, seq, sample = 0, 0, after_seq, []
    while True:
        # pages of 2,000 with a generous deadline: the leader answers between thousands of heartbeats a second
        reply = await _ask(address, lambda s, t, after=seq: s.ListEvents(
            control_pb2.ListEventsRequest(after_seq=after, limit=2_000), timeout=t), timeout=60)
        if not reply.events:
            return declared, named, seq, sample
        states = [e for e in reply.events if e.kind == "node.state"]
        declared += sum(1 for e in states if e.fields.get("target") in ("SUSPECT", "DOWN"))
        named += sum(1 for e in states if "SUSPECT" in e.message or "DOWN" in e.message)
        sample += [e.message for e in states if "SUSPECT" in e.message or "DOWN" in e.message][: 3 - len(sample)]
        seq = reply.events[-1].seq


async def _wait(predicate, what: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if await predicate():
            return time.monotonic() - t0
        await asyncio.sleep(0.1)  # each poll costs the controllers a ListControllers and a GetStats
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class _Plane:
    """The three controllers of the bench, each pinned to CPU 0; the standbys at STANDBY_NICE."""

    def __init__(self, procs: Procs, root: Path, etcd: str, sport: int) -> None:
        self.procs, self.root, self.etcd, self.sport = procs, root, etcd, sport
        self.addresses = {f"c{i}": f"127.0.0.{i + 1 if sport else 1}:{free_port()}" for i in range(3)}
        self.pids: dict[str, int] = {}

    def spawn(self, name: str) -> None:
        self.pids[name] = self.procs.spawn(name, "controller.main", controller_toml(
            self.addresses[name], self.root, name, self.etcd, self.sport), cpu=0).pid

    async def leader(self) -> tuple[str, str, int] | None:
        return await _leader(list(self.addresses.values()))

    async def kill_leader(self, gen: _Fleet, n: int, settle_seq: int) -> tuple[dict, int]:
        """Wait until every node is parked at both standbys and the fleet is whole, kill -9 the leader, time the
        takeover and count what was declared; start the killed controller again as a standby. The step's figures,
        and the event log's last seq after the window."""
        name, address, epoch = await self.leader()
        standbys = [a for a in self.addresses.values() if a != address]
        t_park = time.monotonic()
        await _wait(lambda: _parked_at_least(standbys, n), f"{n} sessions parked at each standby", 600)
        parked_s = time.monotonic() - t_park
        parked = await _parked(standbys)
        log(f"failover at scale: {n} sessions parked at each standby after {parked_s:.0f} s ({parked})")
        whole_s = await _whole(address, n)
        log(f"failover at scale: the fleet whole at the leader (every session open, none declared for "
            f"{QUIET_S:g} s) after {whole_s:.0f} s" if whole_s >= 0 else
            f"failover at scale: the fleet never stayed whole for {QUIET_S:g} s within {WHOLE_TIMEOUT_S:g} s; "
            "killing the leader anyway")
        seq = await _last_seq(address)  # what the log holds before the kill: counted from here on
        # Nodes the leader declared before the kill, after the ramp, and whether the generator (all the nodes
        # in one process, on a core it shares with etcd) was late sending their heartbeats meanwhile: the
        # leader judges what it hears, and a generator behind its schedule is silent nodes to it.
        before, _, _, before_sample = await _suspect_or_down(address, settle_seq)
        sending = await gen.call({"cmd": "stats", "reset": True})  # from here on: after the kill
        log(f"failover at scale: before the kill the leader declared {before} nodes SUSPECT/DOWN "
            f"{before_sample[:1]}; the generator sent heartbeats up to {sending.get('late_max_ms', 0):.0f} ms "
            f"late (p99 {sending.get('late_p99_ms', 0):.0f} ms)")
        self.procs.kill(self.pids[name], signal.SIGKILL)
        t_kill, killed_at = time.monotonic(), time.time()
        others = [a for a in self.addresses.values() if a != address]
        reniced: set[str] = set()

        async def new_leader_with_all() -> bool:
            now = await _leader(others)
            if now and now[2] > epoch and now[0] not in reniced:
                reniced.add(now[0])
                renice(self.pids[now[0]], 0)
            return bool(now and now[2] > epoch and await _sessions(now[1]) >= n)

        back_s = await _wait(new_leader_with_all, f"a new leader with all {n} nodes", 300)
        new_name, new_address, _ = await _leader(others)
        await asyncio.sleep(WINDOW_S)
        down, named, seq, sample = await _suspect_or_down(new_address, seq)
        stats = await _ask(new_address, lambda s, t: s.GetStats(control_pb2.GetStatsRequest(), timeout=t))
        generated = await gen.call({"cmd": "stats", "reset": False})
        phases = _takeover_phases(self.procs.log_path(new_name), killed_at)
        step = {"nodes": n, "all_back_s": round(back_s, 2), "wrongly_suspect_or_down": down,
                "declared_before_kill": before, "generator_late_max_ms": sending.get("late_max_ms", 0),
                "parked_s": round(parked_s, 1), "parked_at_standbys": parked, "whole_before_kill_s": round(whole_s, 1),
                "state_events_naming_suspect_or_down": named, "naming_sample": sample,
                "taken_up_total": generated.get("taken_up", 0),
                # StandingBy messages naming a new leader on parked sessions: none when the winner held
                # as many sessions parked as the losing standby (controller/ha.py Standby._new_leader)
                "leader_named_total": generated.get("named", 0),
                # a node declared while its generator was late sending its heartbeats is the generator's
                # silence (one process for thousands of nodes, on a core shared with etcd), not the leader's
                "generator_late_max_after_ms": generated.get("late_max_ms", 0),
                "generator_late_p99_after_ms": generated.get("late_p99_ms", 0),
                # what the generators spent from just before the kill (CPU seconds, their slowest GC pause) and
                # the tasks they hold: the load they put on their core, kill after kill
                "generator_cpu_s": round(generated.get("cpu_s", 0) - sending.get("cpu_s", 0), 2),
                "generator_gc_pause_max_ms": generated.get("gc_pause_max_ms", 0),
                "generator_tasks": generated.get("tasks", 0), "generator_rss_mb": generated.get("rss_mb", 0),
                "lag_p99_ms": round(stats.heartbeat_lag_p99_ms, 1), "leader": f"{name} -> {new_name}",
                "since_kill_s": round(time.monotonic() - t_kill, 1),
                **phases}
        log(f"failover at scale: N={n}: every node back at {new_name} {back_s:.2f} s after the kill; "
            f"declared SUSPECT/DOWN: {down} (node.state events naming either: {named}); "
            f"heartbeat lag p99 {stats.heartbeat_lag_p99_ms:.0f} ms; the generator sent heartbeats up to "
            f"{generated.get('late_max_ms', 0):.0f} ms late after the kill (p99 "
            f"{generated.get('late_p99_ms', 0):.0f} ms); its CPU {step['generator_cpu_s']} s, GC pause max "
            f"{step['generator_gc_pause_max_ms']} ms, {step['generator_tasks']} tasks, {step['generator_rss_mb']} MB"
            + (f"; e.g. {sample}" if sample else "") + f"; the new leader {phases}")
        self.spawn(name)
        await asyncio.sleep(0.5)  # its threads started
        renice(self.pids[name], STANDBY_NICE)
        return step, seq


async def run(steps: list[int], session_port: bool = False, kills: int = 1) -> dict:
    """session_port: the nodes' sessions (and parked ones) in frames on the controllers' session port. An agent
    finds it at the same port on each controller's host, so here each controller has a loopback address of its
    own (127.0.0.1, .2, .3). kills: the leader is killed this many times per step; each killed controller is
    started again and stands by, and every node parks a session at it before the next kill."""
    out: dict = {"steps": [], "window_s": WINDOW_S, "transport": "session port" if session_port else "grpc"}
    raise_fd_limit()  # the generators and controllers (children) inherit it
    with temp_root("phalanx-failover-scale-") as d:
        root = Path(d)
        procs = Procs(root)
        members = etcdlocal.plan(root / "etcd", 1)
        etcdlocal.start(members[0], members)
        gen: _Fleet | None = None
        try:
            etcdlocal.wait_healthy(members)
            sport = free_port("") if session_port else 0
            plane = _Plane(procs, root, members[0].endpoint, sport)
            for name in plane.addresses:
                plane.spawn(name)
            await _wait(plane.leader, "a leader", 60)
            first, _, _ = await plane.leader()
            for name, pid in plane.pids.items():
                if name != first:
                    renice(pid, STANDBY_NICE)
            count = SESSION_GENERATORS if sport else 1
            gen = _Fleet([])
            for i in range(count):
                proc = await procs.spawn_piped(f"loadgen-{i}", "bench.loadgen", (
                    "--target", ",".join(plane.addresses.values()), "--per-channel", "50",
                    "--concurrency", str(256 // count), "--index", str(i), "--stride", str(count), "--gc-off",
                    *(("--session-port", str(sport)) if sport else ())), cpu=1)
                one = Generator(f"loadgen-{i}", proc)
                gen.gens.append(one)
                hello = await one.read(60.0)
                if hello.get("ok") != "ready":
                    raise RuntimeError(f"loadgen-{i} said {hello}")
                one.start()
            for n in steps:
                t0 = time.monotonic()
                await gen.call({"cmd": "stats", "reset": True})  # the generator's send lateness in the ramp
                ramp_seq = await _last_seq((await plane.leader())[1])
                await gen.call({"cmd": "grow", "total": n}, timeout_s=600)
                _, leader_address, _ = await plane.leader()
                await _wait(lambda a=leader_address, n=n: _sessions_at_least(a, n), f"{n} sessions", 600)
                ramp = await gen.call({"cmd": "stats", "reset": True})  # and from here on, in the settle
                in_ramp, _, _, _ = await _suspect_or_down(leader_address, ramp_seq)
                log(f"failover at scale: {n} nodes in session in {time.monotonic() - t0:.0f} s; the leader declared "
                    f"{in_ramp} SUSPECT/DOWN in the ramp, while the generator sent heartbeats up to "
                    f"{ramp.get('late_max_ms', 0):.0f} ms late (p99 {ramp.get('late_p99_ms', 0):.0f} ms); settling")
                settle_seq = await _last_seq(leader_address)
                await asyncio.sleep(SETTLE_S)
                for kill in range(1, kills + 1):
                    step, settle_seq = await plane.kill_leader(gen, n, settle_seq)
                    out["steps"].append({**step, "kill": kill, "declared_in_ramp": in_ramp,
                                         "generator_late_max_in_ramp_ms": ramp.get("late_max_ms", 0)})
        finally:
            if gen is not None:
                await gen.close()
            procs.close()
            etcdlocal.stop(members[0])
    return out


async def _whole(address: str, n: int) -> float:
    """Wait until the leader holds all `n` sessions and has declared no node SUSPECT or DOWN for QUIET_S: a kill
    amid a burst of declarations (the generator fell behind) would measure the burst's re-registrations, not the
    takeover. Seconds it took; -1 after WHOLE_TIMEOUT_S."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < WHOLE_TIMEOUT_S:
        seq = await _last_seq(address)
        await asyncio.sleep(QUIET_S)
        declared, _, _, _ = await _suspect_or_down(address, seq)
        if not declared and await _sessions(address) >= n:
            return time.monotonic() - t0
    return -1.0


async def _parked(addresses: list[str]) -> list[int]:
    """The sessions parked at each standby (-1: it did not answer)."""
    out = []
    for address in addresses:
        try:
            reply = await _ask(address, lambda s, t: s.ListControllers(control_pb2.ListControllersRequest(), timeout=t))
            out.append(reply.parked_sessions)
        except grpc.aio.AioRpcError:
            out.append(-1)
    return out


async def _parked_at_least(addresses: list[str], n: int) -> bool:
    return all(parked >= n for parked in await _parked(addresses))


async def _sessions_at_least(address: str, n: int) -> bool:
    return await _sessions(address) >= n
