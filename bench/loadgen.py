"""Load generator for the capacity benchmark: many simulated agents in one process (grpc.aio on uvloop).

Each simulated node does what agent/link.py does: Register (inventory: SIM backend, 8 GPUs), open a
Session stream, send SessionOpen, read SessionAccepted, then one Heartbeat (host telemetry, 8 GPU
entries, seq, sent_unix_ns) per second, while a reader drains what the controller sends down; when
the session ends (refused, kicked, broken) it backs off (jittered, 0.2 s doubling to 5 s) and opens
the session again with its incarnation (a resume), registering only if the controller refuses that.
With several controllers each node also parks a session at every other one, as the agent does: a standby
that becomes the leader takes it up, and the node carries on there (after its session ends, it waits the
StandingBy's takeover_s for that before it opens one itself).
With --session-port the sessions (parked ones too) go to the controllers' session port in frames, as an agent
with `session_port` set does; Register stays on gRPC (with --pki on a channel of its own, closed once the node
has registered: the node's only connection that stays open is its session).
Phases are spread evenly over the second (golden-ratio sequence over the global node index).

Driven over stdin/stdout, one JSON object per line:
  {"id": 1, "cmd": "grow", "total": N}   open nodes until this process has N; answers when all are open
  {"id": 2, "cmd": "stats", "reset": b}  counters (and heartbeat send lateness since the last reset)
  {"id": 3, "cmd": "stop_grow"}          cancel the nodes of a grow that are not open yet
  {"cmd": "quit"}
Answers carry the command's id; "grow" runs in the background while other commands are answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import resource
import sys
import time
from pathlib import Path

import grpc

from agent.backoff import Backoff
from agent.collectors.sim import SimBackend

try:  # the agent's digest of the health signals (the controller re-judges health only when it changes)
    from agent.main import health_digest
except ImportError:  # an agent without one
    health_digest = None
from phalanx import framed
from phalanx.leader import leader_hint
from phalanx.rpc import CLIENT_OPTIONS
from phalanx.v1 import common_pb2, node_pb2, node_pb2_grpc

GOLDEN = (math.sqrt(5) - 1) / 2
GPUS = 8
# agent/config.py [reconnect] defaults: a session that ends is opened again after a jittered backoff.
RECONNECT_INITIAL_S = 0.2
RECONNECT_MAX_S = 5.0


class _Parking:
    """One simulated node's sessions parked at standbys, and the ones a new leader took up."""

    def __init__(self) -> None:
        self.target = ""  # the controller of the node's open session ("" while none is open)
        self.promoted: list[tuple[str, object]] = []
        self.promotion = asyncio.Event()
        self.standing_by: dict[str, float] = {}
        self._changed = asyncio.Event()

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self) -> None:
        await self._changed.wait()


def simulated_node(gid: int) -> tuple[str, common_pb2.NodeInventory, node_pb2.AgentMessage]:
    """Node `gid`'s name, inventory and heartbeat: what agent/main.py Agent.heartbeat() builds, from the same
    simulated GPU backend; sampled once (the controller's cost does not depend on the values, and a healthy
    node's digest is stable)."""
    name = f"bench-{gid:05d}"
    sim = SimBackend(GPUS, name, seed=gid)
    inventory = common_pb2.NodeInventory(
        hostname=name, cpu_count=128, memory_total_bytes=2 * 1024**4, gpu_backend=common_pb2.GPU_BACKEND_KIND_SIM,
        gpus=sim.inventory(), labels={"rack": f"rack-{gid // 32}"}, agent_version="bench",
        checkpoint_dir="/var/lib/phalanx/checkpoints", agent_pid=100_000 + gid)
    host = common_pb2.HostTelemetry(
        cpu_percent=3.5, memory_used_bytes=40 * 1024**3, memory_available_bytes=1900 * 1024**3,
        load1=1.2, load5=1.1, load15=1.0, checkpoint_free_bytes=30 * 1024**4, checkpoint_total_bytes=60 * 1024**4)
    gpus = sim.sample()
    message = node_pb2.AgentMessage(heartbeat=node_pb2.Heartbeat(host=host, gpus=gpus, running_ranks=0))
    if health_digest is not None:
        message.heartbeat.health_digest = health_digest(gpus, host)
    return name, inventory, message


class Gen:
    def __init__(self, target: str, index: int, stride: int, per_channel: int, concurrency: int,
                 pki: str = "", session_port: int = 0, gc_off: bool = False) -> None:
        # Several controllers (a highly available control plane): every node goes to the one this process believes
        # leads; a standby's answer names the leader (phalanx-leader), and an unreachable one passes the turn on.
        self.targets = [t for t in target.split(",") if t]
        self.target = self.targets[0]
        self._by_target: dict[str, list[tuple[grpc.aio.Channel, node_pb2_grpc.NodeServiceStub]]] = {}
        self.pki = Path(pki) if pki else None  # mutual TLS: each node its own channel and certificate
        self.session_port = session_port  # sessions in frames on the controllers' session port (0: on gRPC)
        self._contexts: dict[str, object] = {}  # per node: its client TLS context for the session port (~26 KiB)
        self.index = index  # this process is generator `index` of `stride`; it owns global ids index, index+stride, ...
        self.stride = stride
        self.per_channel = per_channel
        self.sem = asyncio.Semaphore(concurrency)
        self.channels: list[tuple[grpc.aio.Channel, node_pb2_grpc.NodeServiceStub]] = []
        self.nodes = 0  # started (or failed) so far
        self.sessions_open = 0
        self.sessions_closed = 0
        self.open_failures = 0
        self.write_errors = 0
        self.status_messages = 0
        self.sent = 0
        self.missed = 0
        self.late: list[float] = []
        self.register_s: list[float] = []  # Register round trips
        self.accept_s: list[float] = []  # Session call to SessionAccepted (what liveness waits on after Register)
        self.reconnects = 0  # sessions opened again after one ended (as the agent does)
        self.resumes = 0  # sessions opened with the incarnation of an earlier registration
        self.reconnect_failures = 0
        self.parked = 0  # sessions parked at standbys now
        self.taken_up = 0  # parked sessions a new leader took up
        self.named = 0  # StandingBy messages naming a new leader on parked sessions
        self.tasks: set[asyncio.Task] = set()
        self.opening: dict[asyncio.Task, asyncio.Future] = {}  # nodes whose first open is under way
        self.errors: list[str] = []
        if gc_off:
            # No garbage collections in this process. A takeover ends thousands of its sessions at once, and their
            # objects (calls, tasks, tracebacks: 670,000 at 8,000 nodes) are cycles with long-lived ones, which only
            # a collection of the older generations frees: one stopped the process for 2.3 s, its nodes'
            # heartbeats were that late, and the controller rightly found them silent (bench/run.py failover-scale
            # --kills, from the third kill). In a ramp to 10,000 nodes, the collections made the heartbeats up to
            # 1.2 s late, and the leader declared 700-6,500 nodes; without them, 57 ms and none. Real agents are a
            # process each. The garbage stays: "rss_mb" (the peak) shows what it holds, about 14 kB per node per
            # takeover.
            gc.disable()
        self.gc_pauses: list[float] = []  # seconds each collection took since the last reset (the loop stands still)
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_pauses.append(time.perf_counter() - self._gc_start)

    def _secure_channel(self, name: str, target: str) -> grpc.aio.Channel:
        creds = grpc.ssl_channel_credentials((self.pki / "ca.crt").read_bytes(),
                                             (self.pki / f"{name}.key").read_bytes(),
                                             (self.pki / f"{name}.crt").read_bytes())
        return grpc.aio.secure_channel(target, creds, options=[*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])

    def _stub(self, local: int, name: str, target: str = "") -> node_pb2_grpc.NodeServiceStub:
        target = target or self.target
        if self.pki is not None:  # a certificate names one node: one channel (TCP + TLS session) per node
            channel = self._secure_channel(name, target)
            self.channels.append((channel, node_pb2_grpc.NodeServiceStub(channel)))
            return self.channels[-1][1]
        i = local // self.per_channel
        channels = self._by_target.setdefault(target, [])
        while len(channels) <= i:
            # A local subchannel pool: each channel has its own TCP connection (the global pool would
            # let channels with the same target and options share one).
            options = [*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            channel = grpc.aio.insecure_channel(target, options=options)
            channels.append((channel, node_pb2_grpc.NodeServiceStub(channel)))
            self.channels.append(channels[-1])
        return channels[i][1]

    async def _session(self, local: int, name: str, target: str, stub: node_pb2_grpc.NodeServiceStub | None = None):
        """A new NodeService.Session call to `target`: on gRPC (`stub`'s channel, else the node's), or on the
        session port (agent/link.py's _session_call)."""
        if not self.session_port:
            return (stub or self._stub(local, name, target)).Session()
        context = None
        if self.pki is not None:
            context = self._contexts.get(name)
            if context is None:
                context = self._contexts[name] = framed.client_context(
                    str(self.pki / "ca.crt"), str(self.pki / f"{name}.crt"), str(self.pki / f"{name}.key"))
        return await framed.FramedCall.open(framed.session_address(target, self.session_port), context,
                                            timeout_s=60)

    async def _register(self, local: int, name: str, inventory: common_pb2.NodeInventory,
                        stub: node_pb2_grpc.NodeServiceStub | None) -> node_pb2.RegisterResponse:
        request = node_pb2.RegisterRequest(node_name=name, inventory=inventory)
        if stub is not None:
            return await stub.Register(request, timeout=60)
        if self.pki is None:
            return await self._stub(local, name).Register(request, timeout=60)
        channel = self._secure_channel(name, self.target)  # the session goes elsewhere: this node's only call here
        try:
            return await node_pb2_grpc.NodeServiceStub(channel).Register(request, timeout=60)
        finally:
            await channel.close(grace=None)

    def _follow(self, tried: str, e: BaseException) -> None:
        """After a failed open at `tried`: the leader a standby named, else the next controller."""
        if len(self.targets) < 2 or tried != self.target:
            return
        hint = leader_hint(e) if isinstance(e, grpc.aio.AioRpcError) else None
        if hint:
            self.target = hint
        elif isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE:
            self.target = self.targets[(self.targets.index(tried) + 1) % len(self.targets)] \
                if tried in self.targets else self.targets[0]

    def _error(self, what: str, e: BaseException) -> None:
        if len(self.errors) < 20:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e)
            code = e.code().name if isinstance(e, grpc.aio.AioRpcError) else type(e).__name__
            self.errors.append(f"{what}: {code}: {detail}"[:300])

    async def grow(self, total: int) -> dict:
        """Start nodes until this process runs `total`; answers once each has tried to open its session."""
        t0 = time.monotonic()
        firsts = []
        for local in range(self.nodes, total):
            first: asyncio.Future = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._node(local, first))
            self.tasks.add(task)
            self.opening[task] = first
            firsts.append(first)
        self.nodes = max(self.nodes, total)
        if firsts:
            await asyncio.gather(*firsts)
        if gc.isenabled():  # (--gc-off: none)
            gc.collect()
        gc.freeze()  # the nodes just made live for the rest of the run: keep them out of later collections
        return {"ok": "grown", "nodes": self.nodes, "sessions_open": self.sessions_open,
                "open_failures": self.open_failures, "seconds": round(time.monotonic() - t0, 3)}

    async def _node(self, local: int, first: asyncio.Future) -> None:
        """One simulated agent: agent/link.py's loop (register, open, heartbeat; on any end, back off, again)."""
        gid = self.index + local * self.stride
        name, inventory, message = simulated_node(gid)
        phase = (gid * GOLDEN) % 1.0
        backoff = Backoff(RECONNECT_INITIAL_S, RECONNECT_MAX_S)
        incarnation = [0]  # as agent/link.py: a node that registered before resumes its session with it
        node = _Parking()
        parks: list[asyncio.Task] = []
        parked_with = 0  # the incarnation the parked sessions were opened with
        try:
            while True:
                taken_up = bool(node.promoted)
                if taken_up:
                    node.target, call = node.promoted.pop(0)
                    self.taken_up += 1
                else:
                    call = await self._open(name, local, inventory, first.done(), incarnation, node)
                if not first.done():
                    first.set_result(call is not None)
                    self.opening.pop(asyncio.current_task(), None)
                if call is not None:
                    if len(self.targets) > 1 and parked_with != incarnation[0]:
                        # the first session, or one after registering again: as agent/link.py, park (again) with
                        # this incarnation (no new leader would take up a session parked with an older one)
                        for task in parks:
                            task.cancel()
                        parks = [asyncio.create_task(self._park(name, local, t, incarnation, node))
                                 for t in self.targets]
                        parked_with = incarnation[0]
                    backoff.reset()
                    self.sessions_open += 1
                    node.changed()
                    # agent/link.py: a session taken up by a new leader sends its first heartbeat at its time,
                    # not at once (every parked session is taken up in the same instant)
                    beat = asyncio.create_task(self._beat(call, message, phase, at_once=not taken_up))
                    try:
                        await self._read(call, node.promotion)
                    finally:
                        beat.cancel()
                        self.sessions_open -= 1
                        node.target = ""
                        node.changed()
                    self.sessions_closed += 1
                    if not node.promoted and node.standing_by:  # a standby will take the session up: wait for it
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(node.promotion.wait(), max(node.standing_by.values()))
                if node.promoted:
                    continue
                await asyncio.sleep(backoff.next())
        finally:
            for task in parks:
                task.cancel()
            if not first.done():
                first.set_result(False)

    async def _park(self, name: str, local: int, target: str, incarnation: list[int], node: _Parking) -> None:
        """agent/link.py's parked session at `target` while the node's session is elsewhere; a call the
        controller takes up goes to the node's loop."""
        backoff = Backoff(5.0, 30.0)  # agent/link.py PARK_RETRY_S
        while True:
            if not node.target or target == node.target or not incarnation[0]:  # parked only beside a session
                await node.wait()
                continue
            call = None  # a parked call not handed to the node's loop: closed if this task is cancelled
            try:
                call = await self._session(local, name, target)
                await call.write(node_pb2.AgentMessage(open=node_pb2.SessionOpen(
                    node_name=name, incarnation=incarnation[0], standby=True)))
                reply = await asyncio.wait_for(call.read(), 60)
                if reply is not grpc.aio.EOF and reply.WhichOneof("body") == "standing_by":
                    backoff.reset()
                    node.standing_by[target] = reply.standing_by.takeover_s
                    self.parked += 1
                    try:
                        reply = await call.read()
                        while reply is not grpc.aio.EOF and reply.WhichOneof("body") == "standing_by":
                            # a standby naming a new leader: these nodes are parked at every standby, so the
                            # winner takes each up (agent/link.py goes to the leader named only if not parked there)
                            self.named += 1
                            reply = await call.read()
                    finally:
                        node.standing_by.pop(target, None)
                        self.parked -= 1
                if reply is grpc.aio.EOF or reply.WhichOneof("body") != "accepted":
                    raise ConnectionError("the parked session ended")
                node.promoted.append((target, call))
                call = None
                node.promotion.set()
                while target != node.target:  # until the node's loop has taken it up
                    await node.wait()
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                raise
            except Exception as e:
                self._error(f"park {name}", e)
                await asyncio.sleep(backoff.next())

    async def _open(self, name: str, local: int, inventory: common_pb2.NodeInventory, again: bool,
                    incarnation: list[int], node: _Parking):
        """Register (unless the node resumes with its incarnation) and open the session; the call once
        SessionAccepted has come, else None. A refused resume registers at once, as agent/link.py does."""
        async with self.sem:
            # where the session opens is known only now: the leader may have been learnt while this node waited
            # for its turn (a node.target set before the wait left its parked session at that controller undone)
            target = node.target = self.target
            # gRPC sessions go on the channel Register used (with --pki, one per node); framed ones have their own
            stub = self._stub(local, name) if not self.session_port else None
            try:
                while True:
                    t0 = time.monotonic()
                    resuming = bool(incarnation[0])
                    if not resuming:
                        reply = await self._register(local, name, inventory, stub)
                        incarnation[0] = reply.incarnation
                        self.register_s.append(time.monotonic() - t0)
                    else:
                        self.resumes += 1
                    t1 = time.monotonic()
                    call = await self._session(local, name, target, stub)
                    try:
                        await call.write(node_pb2.AgentMessage(open=node_pb2.SessionOpen(
                            node_name=name, incarnation=incarnation[0])))
                    except asyncio.InvalidStateError:  # refused before the write: read() raises its status
                        pass
                    try:
                        first = await asyncio.wait_for(call.read(), 60)
                    except grpc.aio.AioRpcError as e:
                        if e.code() != grpc.StatusCode.FAILED_PRECONDITION or not resuming:
                            raise
                        incarnation[0] = 0  # not resumed: register at once (only after a refused resume)
                        continue
                    break
                if first is grpc.aio.EOF or first.WhichOneof("body") != "accepted":
                    raise ConnectionError("controller closed the session before accepting it")
                self.accept_s.append(time.monotonic() - t1)
                if again:
                    self.reconnects += 1
                return call
            except (grpc.aio.AioRpcError, TimeoutError, ConnectionError) as e:
                if again:
                    self.reconnect_failures += 1
                else:
                    self.open_failures += 1
                self._error(f"{'reopen' if again else 'open'} {name}", e)
                self._follow(target, e)
                return None

    async def _beat(self, call, message: node_pb2.AgentMessage, phase: float, at_once: bool = True) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = message.heartbeat
        now = loop.time()
        next_at = math.floor(now) + phase
        if next_at < now:
            next_at += 1.0
        try:
            # agent/link.py sends its first heartbeat as soon as the session is open, then one an interval apart;
            # here the later ones keep this node's phase, so the generator's load stays spread over the second
            if at_once:
                heartbeat.seq += 1
                heartbeat.sent_unix_ns = time.time_ns()
                await call.write(message)
                self.sent += 1
            while True:
                delay = next_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                now = loop.time()
                self.late.append(now - next_at)
                heartbeat.seq += 1
                heartbeat.sent_unix_ns = time.time_ns()
                await call.write(message)
                self.sent += 1
                next_at += 1.0
                now = loop.time()
                if next_at < now:  # behind by a whole interval: skip the missed slots, keep the phase
                    skipped = math.ceil(now - next_at)
                    self.missed += skipped
                    next_at += skipped
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.write_errors += 1
            self._error("heartbeat write", e)

    async def _read(self, call, promotion: asyncio.Event | None = None) -> None:
        """Drain what the controller sends down until the session ends (or a parked one is taken up)."""
        if promotion is not None:
            promotion.clear()
            reading = asyncio.ensure_future(self._read(call))
            promoted = asyncio.ensure_future(promotion.wait())
            try:
                await asyncio.wait({reading, promoted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                reading.cancel()
                promoted.cancel()
            if promoted.done():  # the node goes on where its parked session was taken up
                call.cancel()
            return
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                if message.WhichOneof("body") == "status":
                    self.status_messages += 1
            code = await call.code()
            if code != grpc.StatusCode.OK:
                self._error("session", ConnectionError(f"{code.name}: {await call.details()}"))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._error("session read", e)

    def stop_opening(self) -> None:
        """Give up on nodes whose first session is not open yet (their Register or SessionOpen is cancelled)."""
        for task, first in list(self.opening.items()):
            task.cancel()
            if not first.done():
                first.set_result(False)
        self.opening.clear()

    def stats(self, reset: bool) -> dict:
        late, reg, acc = sorted(self.late), sorted(self.register_s), sorted(self.accept_s)
        pauses = self.gc_pauses
        if reset:
            self.late, self.register_s, self.accept_s, self.gc_pauses = [], [], [], []
        n = len(late)

        def q(f: float, data: list[float] = late) -> float:
            return round(1e3 * data[min(len(data) - 1, int(f * len(data)))], 2) if data else 0.0

        return {"ok": "stats", "time": time.monotonic(), "sent": self.sent, "missed": self.missed,
                "sessions_open": self.sessions_open, "sessions_closed": self.sessions_closed,
                "open_failures": self.open_failures, "write_errors": self.write_errors,
                "reconnects": self.reconnects, "reconnect_failures": self.reconnect_failures,
                "status_messages": self.status_messages, "channels": len(self.channels),
                "late_samples": n, "late_p50_ms": q(0.5), "late_p99_ms": q(0.99), "late_max_ms": q(1.0),
                "opened": len(acc), "resumes": self.resumes, "parked": self.parked, "taken_up": self.taken_up,
                "named": self.named,
                "cpu_s": round(time.process_time(), 3), "tasks": len(asyncio.all_tasks()),
                "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "gc_collections": len(pauses), "gc_pause_max_ms": round(1e3 * max(pauses, default=0.0), 1),
                "gc_paused_s": round(sum(pauses), 3),
                "register_p50_ms": q(0.5, reg), "register_max_ms": q(1.0, reg),
                "accept_p50_ms": q(0.5, acc), "accept_max_ms": q(1.0, acc),
                "errors": list(self.errors)}

    async def close(self) -> None:
        self.stop_opening()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel, _ in self.channels:
            await channel.close(grace=None)


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    gen = Gen(args.target, args.index, args.stride, args.per_channel, args.concurrency, args.pki, args.session_port,
              args.gc_off)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    reply({"ok": "ready"})
    growing: asyncio.Task | None = None

    async def grow(rid, total: int) -> None:
        try:
            reply({"id": rid, **await gen.grow(total)})
        except asyncio.CancelledError:
            reply({"id": rid, "ok": "grown", "cancelled": True, "nodes": gen.nodes,
                   "sessions_open": gen.sessions_open, "open_failures": gen.open_failures})
            raise

    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            rid = cmd.get("id")
            if cmd["cmd"] == "grow":  # runs in the background; "stats" and "stop_grow" are answered meanwhile
                growing = asyncio.create_task(grow(rid, int(cmd["total"])))
            elif cmd["cmd"] == "stop_grow":
                gen.stop_opening()
                if growing is not None:
                    growing.cancel()
                    await asyncio.gather(growing, return_exceptions=True)
                reply({"id": rid, "ok": "stopped"})
            elif cmd["cmd"] == "stats":
                reply({"id": rid, **gen.stats(bool(cmd.get("reset")))})
            elif cmd["cmd"] == "quit":
                break
            else:
                reply({"id": rid, "ok": "error", "error": f"unknown command {cmd['cmd']!r}"})
    finally:
        if growing is not None:
            growing.cancel()
        await gen.close()
        reply({"ok": "bye"})


def cli() -> None:
    # Tens of thousands of long-lived tasks and messages: fewer, cheaper collections (and see gc.freeze above),
    # so the generator's own pauses do not show up as heartbeat lag.
    gc.set_threshold(50_000, 20, 100)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--per-channel", type=int, default=50, help="node sessions per channel (TCP connection)")
    parser.add_argument("--concurrency", type=int, default=64, help="nodes registering/opening at once")
    parser.add_argument("--pki", default="", help="mutual TLS: a directory with ca.crt and NODE.crt/NODE.key per node")
    parser.add_argument("--session-port", type=int, default=0,
                        help="sessions in frames on this port of each controller's host (its session_listen)")
    parser.add_argument("--gc-off", action="store_true",
                        help="no garbage collections (failover-scale: a takeover's garbage is hundreds of thousands "
                        "of objects, and collecting it stops every node in the process for seconds)")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # uvloop is Linux/macOS only
        asyncio.run(main(args))
    else:
        uvloop.run(main(args))


if __name__ == "__main__":
    cli()
