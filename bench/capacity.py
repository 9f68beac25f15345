"""Benchmark 2: how many 1 Hz nodes one controller core sustains.

The controller runs alone on CPU 0; the load generator(s) (bench/loadgen.py) and this orchestrator
run on CPU 1. N is ramped through steps; each step is held after every session is open, and the
controller's own counters (ControlService.GetStats) are read at the start and end of the hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import time
from pathlib import Path

import grpc
import psutil

from bench import gcwrap
from bench.common import (
    Procs,
    controller_toml,
    etcd_store_toml,
    free_port,
    log,
    pin_this_process,
    process_running,
    secure_controller_toml,
    temp_root,
    wait_serving,
)
from phalanx import etcdlocal
from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc

GOAL_NODES = 10_000
LAG_P99_GOAL_MS = 100.0
RATE_GOAL = 0.95
LAG_WINDOW = 65_536  # controller/stats.py LagWindow size


class Generator:
    """One load-generator process, spoken to over its stdin/stdout (answers matched by id)."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self.ps = psutil.Process(proc.pid)
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self.nodes = 0  # nodes this generator has been told to run

    async def read(self, timeout_s: float) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError(f"load generator {self.name} exited")
        return json.loads(line)

    def start(self) -> None:
        self._reader = asyncio.create_task(self._dispatch())

    async def _dispatch(self) -> None:
        try:
            while line := await self.proc.stdout.readline():
                answer = json.loads(line)
                future = self._waiting.pop(answer.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(answer)
        finally:
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"load generator {self.name} exited"))

    async def call(self, cmd: dict, timeout_s: float = 60.0) -> dict:
        self._next_id += 1
        rid = self._next_id
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        self.proc.stdin.write((json.dumps({"id": rid, **cmd}) + "\n").encode())
        await self.proc.stdin.drain()
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._waiting.pop(rid, None)

    def cpu_seconds(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.write(b'{"cmd": "quit"}\n')
            await self.proc.stdin.drain()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 10)


def _share(total: int, index: int, count: int) -> int:
    """How many of the global ids 0..total-1 generator `index` owns (ids i with i % count == index)."""
    return max(0, (total - index + count - 1) // count)


def _cpu(ps: psutil.Process) -> float:
    t = ps.cpu_times()
    return t.user + t.system


async def _ramp(gens: list[Generator], n: int, stub, ctrl_ps: psutil.Process, timeout_s: float,
                chunk: int = 200, headroom_pct: float = 85.0) -> tuple[list[dict], str]:
    """Open sessions up to N in chunks, each started only once the controller has CPU to spare.

    Registering costs the controller far more than a heartbeat (a TCP connection, two RPCs, a SQLite
    commit), so an unpaced ramp on top of thousands of heartbeating nodes overloads it and the ramp,
    not the steady state, is what gets measured. Returns (the generators' last answers, why it was
    aborted or "").
    """
    t0 = time.monotonic()
    aborted = ""
    grown: list[dict] = []
    worst = {"register_max_ms": 0.0, "accept_max_ms": 0.0}
    cpu_max = 0.0
    current = sum(g.nodes for g in gens)
    last_log = t0
    while current < n:
        # Headroom: the controller's CPU over a short window, waiting (a little) for it to drop.
        for attempt in range(8):
            c0, w0 = _cpu(ctrl_ps), time.monotonic()
            await asyncio.sleep(0.5)
            ctl_pct = 100 * (_cpu(ctrl_ps) - c0) / (time.monotonic() - w0)
            if ctl_pct < headroom_pct or attempt == 7:
                break
        cpu_max = max(cpu_max, ctl_pct)
        size = chunk if ctl_pct < 60 else chunk // 2 if ctl_pct < headroom_pct else max(10, chunk // 8)
        target = min(n, current + size)
        remaining = timeout_s - (time.monotonic() - t0)
        grows = [asyncio.create_task(g.call({"cmd": "grow", "total": _share(target, i, len(gens))}, timeout_s=3600))
                 for i, g in enumerate(gens)]
        done, _ = await asyncio.wait(grows, timeout=max(1.0, remaining))
        if len(done) < len(grows):
            await asyncio.gather(*[g.call({"cmd": "stop_grow"}) for g in gens])
        grown = list(await asyncio.gather(*grows))
        for g, answer in zip(gens, grown, strict=True):
            g.nodes = answer["nodes"]
        current = target
        now = time.monotonic()
        stats = await asyncio.gather(*[g.call({"cmd": "stats", "reset": True}) for g in gens])
        bad = await stub.ListNodes(control_pb2.ListNodesRequest(
            states=[common_pb2.NODE_STATE_SUSPECT, common_pb2.NODE_STATE_DOWN]), timeout=30.0)
        open_now = sum(s["sessions_open"] for s in stats)
        late = max(s["late_p99_ms"] for s in stats)
        for s in stats:
            for key in worst:
                worst[key] = max(worst[key], s[key])
        if now - last_log >= 5.0 or current >= n:
            log(f"capacity:   ramp {now - t0:4.0f} s: {open_now}/{n} sessions open; controller CPU before the last "
                f"chunk {ctl_pct:.0f}%; {len(bad.nodes)} nodes SUSPECT/DOWN; generator send lateness p99 "
                f"{late:.0f} ms; Register p50 {max(s['register_p50_ms'] for s in stats):.0f} ms; session accept "
                f"p50/max {max(s['accept_p50_ms'] for s in stats):.0f}/{max(s['accept_max_ms'] for s in stats):.0f} ms")
            last_log = now
        if len(bad.nodes) > max(10, 0.01 * n):
            aborted = f"{len(bad.nodes)} nodes SUSPECT/DOWN after {now - t0:.0f} s of ramp"
        elif open_now < current and sum(s["open_failures"] for s in stats) > max(10, 0.01 * n):
            aborted = f"{sum(s['open_failures'] for s in stats)} nodes failed to open"
        elif current < n and now - t0 > timeout_s:
            aborted = f"only {open_now}/{n} sessions open after {timeout_s:g} s"
        if aborted:
            break
    for g in grown:
        g.update(worst)
        g["controller_cpu_max_pct"] = round(cpu_max, 1)
    return grown, aborted


async def _state_changes(stub, after: int) -> tuple[int, dict[str, int]]:
    """node.state events after `after`, counted by target; returns (last seq, counts)."""
    counts: dict[str, int] = {}
    while True:
        page = await stub.ListEvents(control_pb2.ListEventsRequest(after_seq=after, limit=10_000), timeout=30.0)
        if not page.events:
            return after, counts
        for event in page.events:
            if event.kind == "node.state":
                target = event.fields.get("target", "?")
                counts[target] = counts.get(target, 0) + 1
        after = page.events[-1].seq


async def run(steps: list[int], hold_s: float, settle_s: float, generators: int, per_channel: int,
              budget_s: float, max_hold_s: float | None = None, ramp_timeout_s: float = 60.0,
              open_concurrency: int = 16, gc_trace: bool = False, tls: bool = False, store: str = "sqlite",
              session_port: bool = False) -> dict:
    """tls: the controller on mutual TLS and each simulated node with its own certificate (as in production);
    otherwise plaintext. store "etcd": the controller leads a control plane of one on a local etcd member.
    session_port: the nodes' sessions in frames on the controller's session port (session_listen) rather than
    on gRPC; Register stays on gRPC."""
    with temp_root(prefix="phalanx-bench-capacity-") as tmp:
        root = Path(tmp)
        procs = Procs(root)
        before = os.sched_getaffinity(0)
        members = []
        try:
            pki = _make_pki(root / "pki", max(steps)) if tls else None
            extra = ""
            if store == "etcd":
                members = etcdlocal.plan(root / "etcd", 1)
                etcdlocal.start(members[0], members)
                etcdlocal.wait_healthy(members)
                extra = etcd_store_toml(members[0].endpoint, "bench")
            return await _run(procs, root, steps, hold_s, settle_s, generators, per_channel, budget_s,
                              max_hold_s if max_hold_s is not None else hold_s, ramp_timeout_s, open_concurrency,
                              gc_trace, pki, extra, session_port)
        finally:
            procs.close()
            for member in members:
                etcdlocal.stop(member)
            pin_this_process(before)


async def by_store(steps: list[int], hold_s: float, settle_s: float, per_channel: int, budget_s: float) -> dict:
    """The same capacity steps against a controller on SQLite and one leading on etcd, one after the other:
    heartbeats never touch the store, so CPU per heartbeat and lag should not differ."""
    out = {}
    for store in ("sqlite", "etcd"):
        log(f"capacity by store: {store} ...")
        out[store] = await run(steps, hold_s, settle_s, 1, per_channel, budget_s / 2, store=store)
    return out


def _make_pki(d: Path, nodes: int) -> Path:
    from phalanx import pki
    t0 = time.monotonic()
    pki.init_ca(d, cluster="bench")
    pki.issue(d, "controller", "controller", ("127.0.0.1",))
    pki.issue(d, "operator", "client")
    for gid in range(nodes):
        pki.issue(d, f"bench-{gid:05d}", "node")
    log(f"capacity: issued {nodes} node certificates in {time.monotonic() - t0:.1f} s")
    return d


def hold_for(n: int, hold_s: float, max_hold_s: float) -> float:
    """Hold long enough that the controller's lag window (last 65,536 heartbeats) covers only the hold."""
    return max(hold_s, min(max_hold_s, LAG_WINDOW / n + 1.0))


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def _busy(times) -> float:
    """CPU time spent running processes (user and system); interrupts are counted apart, see _irq."""
    return times.user + times.nice + times.system


def _irq(times) -> float:
    return times.irq + times.softirq


async def _run(procs: Procs, root: Path, steps: list[int], hold_s: float, settle_s: float, generators: int,
               per_channel: int, budget_s: float, max_hold_s: float, ramp_timeout_s: float,
               open_concurrency: int, gc_trace: bool, pki: Path | None = None, extra_config: str = "",
               session_port: bool = False) -> dict:
    t_begin = time.monotonic()
    credentials = None
    if pki is not None:
        credentials = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), (pki / "operator.key").read_bytes(),
                                                   (pki / "operator.crt").read_bytes())
    fd_limit = raise_fd_limit()
    # Each node session on its own TCP connection costs a descriptor in the controller and in a generator.
    max_nodes = (fd_limit - 1000) * per_channel
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        ctrl_cpu, gen_cpu = cpus[0], cpus[1]
        pin_this_process({gen_cpu})
        placement = f"controller on CPU {ctrl_cpu}; load generator(s) and this orchestrator on CPU {gen_cpu}"
    else:
        ctrl_cpu = gen_cpu = None
        placement = "only one CPU available: controller and generator share it (results are pessimistic)"
    log(f"capacity: {placement}")
    # What the rest of the machine is doing (other users' processes share these cores).
    before = psutil.cpu_times(percpu=True)
    await asyncio.sleep(2.0)
    after = psutil.cpu_times(percpu=True)
    background = [round(50.0 * (_busy(b) - _busy(a)), 1) for a, b in zip(before, after, strict=True)]
    log(f"capacity: background load before starting: {', '.join(f'CPU {i} {p:.0f}%' for i, p in enumerate(background))}"
        + ("  (busy machine: expect disturbed figures)" if max(background) > 10 else ""))
    address = f"127.0.0.1:{free_port()}"
    # --gc-trace: the same controller, run through bench/gcwrap.py, which logs its GC pauses.
    module = "bench.gcwrap" if gc_trace else "controller.main"
    port = free_port() if session_port else 0
    listen = f"127.0.0.1:{port}" if port else ""
    config = (controller_toml(address, root, listen) if pki is None
              else secure_controller_toml(address, root, pki, listen))
    controller = procs.spawn("controller", module, config + extra_config, cpu=ctrl_cpu)
    await wait_serving(address, procs, controller.pid, "controller", credentials=credentials)
    ctrl_ps = psutil.Process(controller.pid)
    gens = []
    for i in range(generators):
        name = f"loadgen-{i}"
        proc = await procs.spawn_piped(name, "bench.loadgen", (
            "--target", address, "--index", str(i), "--stride", str(generators), "--per-channel", str(per_channel),
            "--concurrency", str(max(1, open_concurrency // generators)),
            *(("--pki", str(pki)) if pki is not None else ()),
            *(("--session-port", str(port)) if port else ())),
            cpu=gen_cpu)
        gen = Generator(name, proc)
        try:
            hello = await gen.read(60.0)
        except (RuntimeError, TimeoutError):
            raise RuntimeError(f"{name} did not start; its log ends:\n{procs.tail(name)}") from None
        if hello.get("ok") != "ready":
            raise RuntimeError(f"{name} said {hello}")
        gen.start()
        gens.append(gen)
    log(f"capacity: controller on {address}" + (f", sessions on its session port {port}" if port else "")
        + f"; {generators} load generator process(es), "
        f"{per_channel} node session(s) per channel (TCP connection), {open_concurrency} nodes registering at once")
    results: list[dict] = []
    stopped_because = ""
    # ListNodes of thousands of SUSPECT nodes is large: let it through.
    options = [("grpc.max_receive_message_length", 1 << 30)]
    channel = (grpc.aio.insecure_channel(address, options=options) if credentials is None
               else grpc.aio.secure_channel(address, credentials, options=options))
    async with channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        seq = 0
        register_rate = 0.0  # nodes/s of the previous ramp, to predict the next one
        for n in steps:
            elapsed = time.monotonic() - t_begin
            have = results[-1]["nodes"] if results else 0
            if n > max_nodes:
                stopped_because = (f"step N={n} needs more connections than the open-file limit ({fd_limit}) allows "
                                   f"at {per_channel} sessions per connection")
                log(f"capacity: skipping step N={n} and beyond ({stopped_because})")
                break
            hold = hold_for(n, hold_s, max_hold_s)
            # Ramps slow down as N grows (registration competes with heartbeats): assume twice as slow.
            predicted = min(ramp_timeout_s, 2 * (n - have) / register_rate) if register_rate else 0.0
            predicted += settle_s + hold + 5
            if results and elapsed + predicted > budget_s:
                stopped_because = (f"time budget: step {n} would need ~{predicted:.0f} s more "
                                   f"({elapsed:.0f} s of {budget_s:.0f} s used)")
                log(f"capacity: skipping step N={n} and beyond ({stopped_because})")
                break
            log(f"capacity: step N={n}: opening {n - have} more node sessions ...")
            t_ramp = time.monotonic()
            wall_ramp = time.time()
            grown, ramp_aborted = await _ramp(gens, n, stub, ctrl_ps, ramp_timeout_s)
            ramp_s = time.monotonic() - t_ramp
            register_rate = (n - have) / ramp_s if ramp_s > 0 else 0.0
            open_now = sum(g["sessions_open"] for g in grown)
            failures = sum(g["open_failures"] for g in grown)
            log(f"capacity: step N={n}: {open_now} sessions open after {ramp_s:.1f} s "
                f"({register_rate:.0f} registrations/s, {failures} failed); settling {settle_s:g} s, "
                f"holding {hold:.0f} s")
            if not process_running(controller.pid):
                raise RuntimeError(f"the controller died; its log ends:\n{procs.tail('controller')}")
            if ramp_aborted:
                hold = hold_s
                log(f"capacity: step N={n}: ramp aborted ({ramp_aborted}); measuring {hold:g} s anyway, then stopping")
            await asyncio.sleep(settle_s)
            seq, ramp_changes = await _state_changes(stub, seq)
            # -- the measured window --
            g0 = await asyncio.gather(*[g.call({"cmd": "stats", "reset": True}) for g in gens])
            gcpu0 = sum(g.cpu_seconds() for g in gens)
            percpu0 = psutil.cpu_times(percpu=True)
            s0 = await stub.GetStats(control_pb2.GetStatsRequest(), timeout=30.0)
            t0 = time.monotonic()
            wall_hold = time.time()
            await asyncio.sleep(hold)
            s1 = await stub.GetStats(control_pb2.GetStatsRequest(), timeout=30.0)
            t1 = time.monotonic()
            percpu1 = psutil.cpu_times(percpu=True)
            gcpu1 = sum(g.cpu_seconds() for g in gens)
            g1 = await asyncio.gather(*[g.call({"cmd": "stats", "reset": True}) for g in gens])
            # -- after the window --
            bad = await stub.ListNodes(control_pb2.ListNodesRequest(
                states=[common_pb2.NODE_STATE_SUSPECT, common_pb2.NODE_STATE_DOWN]), timeout=60.0)
            seq, hold_changes = await _state_changes(stub, seq)
            step = _step_result(n, ramp_s, open_now, failures, s0, s1, t1 - t0, g0, g1, gcpu1 - gcpu0,
                                len(bad.nodes), hold_changes, settle_s)
            step["ramp_suspect_or_down_events"] = ramp_changes.get("SUSPECT", 0) + ramp_changes.get("DOWN", 0)
            if gc_trace:
                text = procs.log_path("controller").read_text(errors="replace")
                step["gc_hold"] = gcwrap.parse(text, wall_hold, time.time())
                step["gc_ramp"] = gcwrap.parse(text, wall_ramp, wall_hold)
                ramp_gc = step["gc_ramp"]["gc_pauses_over_20ms"]
                log(f"capacity: step N={n}: controller GC pauses >= 20 ms: ramp {ramp_gc} "
                    f"(longest {step['gc_ramp']['gc_pause_max_ms']:.0f} ms), hold "
                    f"{step['gc_hold']['gc_pauses_over_20ms']} (longest {step['gc_hold']['gc_pause_max_ms']:.0f} ms, "
                    f"{step['gc_hold']['gc_pause_total_ms']:.0f} ms in all)")
            step["ramp_aborted"] = ramp_aborted
            step["ramp_register_max_ms"] = max(g["register_max_ms"] for g in grown)
            step["ramp_session_accept_max_ms"] = max(g["accept_max_ms"] for g in grown)
            step["ramp_controller_cpu_max_pct"] = max(g.get("controller_cpu_max_pct", 0.0) for g in grown)
            if ramp_aborted:
                step["sustained"] = False
            if ctrl_cpu is not None:
                wall = t1 - t0
                cpu0_busy = 100.0 * (_busy(percpu1[ctrl_cpu]) - _busy(percpu0[ctrl_cpu])) / wall
                cpu1_busy = 100.0 * (_busy(percpu1[gen_cpu]) - _busy(percpu0[gen_cpu])) / wall
                step["controller_cpu_core_busy_pct"] = round(cpu0_busy, 1)
                step["generator_cpu_core_busy_pct"] = round(cpu1_busy, 1)
                step["controller_cpu_core_irq_pct"] = round(
                    100.0 * (_irq(percpu1[ctrl_cpu]) - _irq(percpu0[ctrl_cpu])) / wall, 1)
                step["generator_cpu_core_irq_pct"] = round(
                    100.0 * (_irq(percpu1[gen_cpu]) - _irq(percpu0[gen_cpu])) / wall, 1)
                # What ran on the controller's core besides the controller: other users of this machine.
                step["other_load_on_controller_core_pct"] = round(max(0.0, cpu0_busy - step["controller_cpu_pct"]), 1)
            results.append(step)
            log(f"capacity: step N={n}: received {step['achieved_hz']:.0f}/s of {n} target "
                f"(generator sent {step['generator_sent_hz']:.0f}/s), "
                f"controller CPU {step['controller_cpu_pct']:.0f}%, "
                f"{step['us_per_heartbeat']:.0f} us/heartbeat, lag p50/p99/max "
                f"{step['lag_p50_ms']:.1f}/{step['lag_p99_ms']:.1f}/{step['lag_max_ms']:.1f} ms, "
                f"generator CPU {step['generator_cpu_pct']:.0f}%, SUSPECT/DOWN events in ramp/hold "
                f"{step['ramp_suspect_or_down_events']}/{step['suspect_or_down_events']}, "
                f"now {step['suspect_or_down_now']}, "
                f"{'sustained' if step['sustained'] else 'NOT sustained'}")
            errors = [e for g in g1 for e in g["errors"]]
            if errors:
                log(f"capacity: generator errors (first few): {errors[:3]}")
            if step.get("other_load_on_controller_core_pct", 0) > 10:
                log(f"capacity: warning: {step['other_load_on_controller_core_pct']:.0f}% of the controller's core "
                    "went to other processes during this step; its figures are disturbed")
            if ramp_aborted:
                stopped_because = f"the ramp to N={n} was aborted: {ramp_aborted}"
                log(f"capacity: stopping the ramp: {stopped_because}")
                break
            if not step["sustained"] and (step["achieved_fraction"] < RATE_GOAL or step["controller_cpu_pct"] >= 90
                                          or step["suspect_or_down_now"] > 0.05 * n):
                stopped_because = (f"controller past its limit at N={n} (CPU {step['controller_cpu_pct']:.0f}%, "
                                   f"received {step['achieved_fraction']:.0%} of target, "
                                   f"{step['suspect_or_down_now']} nodes SUSPECT/DOWN)")
                log(f"capacity: stopping the ramp: {stopped_because}")
                break
        for g in gens:
            await g.close()
    summary = _summary(results, placement, generators, per_channel, hold_s, settle_s, stopped_because, steps,
                       max_hold_s)
    summary["background_cpu_pct_before"] = background
    summary["transport"] = "session port" if port else "grpc"
    return summary


def _step_result(n, ramp_s, open_now, failures, s0, s1, wall, g0, g1, gen_cpu_s, bad_now, changes,
                 settle_s) -> dict:
    dt = (s1.uptime_s - s0.uptime_s) or wall
    beats = s1.heartbeats_total - s0.heartbeats_total
    cpu = s1.process_cpu_seconds - s0.process_cpu_seconds
    achieved = beats / dt
    sent = sum(b["sent"] - a["sent"] for a, b in zip(g0, g1, strict=True))
    gen_dt = max(b["time"] - a["time"] for a, b in zip(g0, g1, strict=True))
    missed = sum(b["missed"] - a["missed"] for a, b in zip(g0, g1, strict=True))
    window_span = s1.heartbeat_lag_samples / achieved if achieved else 0.0
    suspects = changes.get("SUSPECT", 0) + changes.get("DOWN", 0)
    lag_ok = s1.heartbeat_lag_p99_ms < LAG_P99_GOAL_MS
    sustained = achieved >= RATE_GOAL * n and lag_ok and suspects == 0 and bad_now == 0
    return {
        "nodes": n,
        "ramp_s": round(ramp_s, 1),
        "sessions_open_generator": open_now,
        "open_failures": failures,
        "sessions_controller": s1.sessions,
        "nodes_controller": s1.nodes,
        "hold_s": round(dt, 2),
        "target_hz": n,
        "achieved_hz": round(achieved, 1),
        "achieved_fraction": round(achieved / n, 4),
        "generator_sent_hz": round(sent / gen_dt, 1) if gen_dt else 0.0,
        "generator_missed_slots": missed,
        "generator_late_p99_ms": max(g["late_p99_ms"] for g in g1),
        "generator_late_max_ms": max(g["late_max_ms"] for g in g1),
        "generator_cpu_pct": round(100.0 * gen_cpu_s / dt, 1),
        "generator_kept_up": bool(gen_dt) and sent / gen_dt >= RATE_GOAL * n
        and max(g["late_p99_ms"] for g in g1) < LAG_P99_GOAL_MS,
        "controller_cpu_pct": round(100.0 * cpu / dt, 1),
        "us_per_heartbeat": round(1e6 * cpu / beats, 1) if beats else None,
        "lag_p50_ms": round(s1.heartbeat_lag_p50_ms, 2),
        "lag_p99_ms": round(s1.heartbeat_lag_p99_ms, 2),
        "lag_max_ms": round(s1.heartbeat_lag_max_ms, 2),
        "lag_samples": s1.heartbeat_lag_samples,
        "lag_window_span_s": round(window_span, 1),
        "lag_window_includes_ramp": window_span > settle_s + dt + 1,
        "controller_rss_mb": round(s1.process_rss_bytes / 1e6, 1),
        "suspect_or_down_events": suspects,
        "suspect_or_down_now": bad_now,
        "sessions_ended_in_hold": sum(b["sessions_closed"] - a["sessions_closed"] for a, b in zip(g0, g1, strict=True)),
        "sessions_reopened_in_hold": sum(b["reconnects"] - a["reconnects"] for a, b in zip(g0, g1, strict=True)),
        "sessions_ended_total": sum(g["sessions_closed"] for g in g1),
        "status_messages_received": sum(g["status_messages"] for g in g1),
        "sustained": sustained,
    }


def _why_not(r: dict) -> str:
    """Why a step was not sustained, in words."""
    reasons = []
    if r.get("ramp_aborted"):
        reasons.append(f"ramp aborted: {r['ramp_aborted']}")
    if r["achieved_fraction"] < RATE_GOAL:
        reasons.append(f"received {r['achieved_fraction']:.0%} of the target rate")
    if r["lag_p99_ms"] >= LAG_P99_GOAL_MS:
        reasons.append(f"lag p99 {r['lag_p99_ms']:.0f} ms")
    if r.get("other_load_on_controller_core_pct", 0) > 10:
        reasons.insert(0, f"machine busy: other processes took {r['other_load_on_controller_core_pct']:.0f}% of the "
                       "controller's core")
    if r["suspect_or_down_events"] or r["suspect_or_down_now"]:
        reasons.append(f"{r['suspect_or_down_events']} SUSPECT/DOWN events in the hold, "
                       f"{r['suspect_or_down_now']} SUSPECT/DOWN at its end")
    reasons.append(f"controller CPU {r['controller_cpu_pct']:.0f}% in the hold"
                   + (f", up to {r['ramp_controller_cpu_max_pct']:.0f}% between ramp chunks"
                      if r.get("ramp_controller_cpu_max_pct") else ""))
    reasons.append(f"generator CPU {r['generator_cpu_pct']:.0f}%")
    return "; ".join(reasons)


def _summary(results, placement, generators, per_channel, hold_s, settle_s, stopped_because, steps,
             max_hold_s) -> dict:
    sustained = [r for r in results if r["sustained"]]
    largest = max((r["nodes"] for r in sustained), default=0)
    reached = max((r["nodes"] for r in results), default=0)
    # CPU cost per heartbeat from the largest sustained step (the most heartbeats, still healthy).
    basis = max(sustained, key=lambda r: r["nodes"]) if sustained else (results[-1] if results else None)
    us = basis["us_per_heartbeat"] if basis else None
    extrapolated = int(1e6 / us) if us else None
    first_bad = next((r for r in results if not r["sustained"]), None)
    why = _why_not(first_bad) if first_bad else ""
    if not results:
        limit = "no step ran"
    elif first_bad is None:
        limit = (f"not reached: every step up to N={reached:,} was sustained" +
                 (f" ({stopped_because})" if stopped_because else ""))
    elif first_bad["generator_cpu_pct"] >= 90 and first_bad["generator_sent_hz"] < RATE_GOAL * first_bad["target_hz"]:
        limit = f"the load generator at N={first_bad['nodes']:,} (its core saturated)"
    elif first_bad.get("other_load_on_controller_core_pct", 0) > 10:
        limit = f"not measurable here: at N={first_bad['nodes']:,} other processes shared the controller's core"
    elif max(first_bad["controller_cpu_pct"], first_bad.get("ramp_controller_cpu_max_pct", 0)) >= 90:
        limit = f"the controller's CPU at N={first_bad['nodes']:,}"
    else:
        limit = f"the controller's latency at N={first_bad['nodes']:,}, below full CPU"
    return {
        "placement": placement,
        "generators": generators,
        "sessions_per_channel": per_channel,
        "hold_s": hold_s,
        "max_hold_s": max_hold_s,
        "settle_s": settle_s,
        "steps_planned": steps,
        "steps": results,
        "largest_sustained_nodes": largest,
        "largest_reached_nodes": reached,
        "stopped_because": stopped_because,
        "us_per_heartbeat": us,
        "us_per_heartbeat_basis_nodes": basis["nodes"] if basis else None,
        "extrapolated_nodes_per_core": extrapolated,
        "limited_by": limit,
        "first_unsustained_step": first_bad["nodes"] if first_bad else None,
        "first_unsustained_why": why,
        "criteria": f"sustained = received >= {RATE_GOAL:.0%} of N heartbeats/s, lag p99 < {LAG_P99_GOAL_MS:g} ms, "
                    "no node.state SUSPECT/DOWN events during the step and none SUSPECT/DOWN at its end",
        "note": "Measured: per-step rates, CPU, lag and RSS from the controller's GetStats over the hold window. "
                "Extrapolated: nodes per core = 1e6 / (controller CPU microseconds per heartbeat), assuming cost "
                "stays linear in N (it includes the per-node liveness sweep, so it is per node-second at 1 Hz).",
    }
