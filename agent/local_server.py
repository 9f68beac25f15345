"""The agent's Unix-socket service for trainlib inside the ranks (LocalService).

Ranks report their step timings in batches; the agent folds them into one summary per rank per
heartbeat for the controller (straggler and hang detection). What the controller wants of a rank —
its job's pending checkpoint request, or word that its generation is stale — is pushed down each
rank's `Watch` stream the moment it changes, and carried on every report's reply as well (a rank
whose stream broke still learns it within half a second); the reply also hands the rank a slow=F fault
injected on its GPU (trainlib stretches its steps). A rank's "checkpoint committed" goes up to
the controller at once. A rank that says it stops for good (`fatal`) has the reason put on its rank
status, which every heartbeat carries.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from agent import snapshots as snaps
from agent import unix_socket
from phalanx import log
from phalanx.v1 import local_pb2, local_pb2_grpc, node_pb2

logger = log.get("local")


MAX_SAMPLES = 64  # per rank per heartbeat: enough for straggler statistics, bounded for the controller
TELL_RATE, TELL_BURST = 20.0, 200.0  # events a second a job's ranks may send through the agent, and a burst of
MAX_TELL_JOBS = 4096
NO_SNAPSHOTS = "this node keeps no snapshots (agent snapshot_dir is empty)"


@dataclass
class _Progress:
    last_step: int = 0
    steps: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    last_unix_ns: int = 0
    reports: int = 0
    saving: bool = False
    finished: bool = False
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))


@dataclass
class LocalState:
    """What the local service shares with the agent: progress to report, requests to hand out."""

    progress: dict[tuple[str, int, int], _Progress] = field(default_factory=dict)
    requests: dict[str, node_pb2.RequestCheckpoint] = field(default_factory=dict)  # job -> pending request
    due_ns: dict[str, int] = field(default_factory=dict)  # job -> when its pending request is due (Unix ns, here)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def ask(self, request: node_pb2.RequestCheckpoint, received_ns: int = 0) -> None:
        """Hand a checkpoint request, received at `received_ns` (this host's Unix ns; 0: unknown), to the job's
        ranks: pushed to their Watch streams at once."""
        self.requests[request.job] = request
        if received_ns:  # the ranks, on this host's clock, then know what is left of the deadline whenever they hear
            self.due_ns[request.job] = received_ns + int(max(request.deadline_s, 0.0) * 1e9)
        else:
            self.due_ns.pop(request.job, None)
        self.notify()

    def notify(self) -> None:
        """Something a rank may need to hear of changed (a request, a new generation): wake every watcher.
        Called on the event loop."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def next_change(self) -> asyncio.Event:
        """The event the next notify() sets."""
        return self._changed

    def drain(self) -> list[node_pb2.RankProgress]:
        """Progress since the last drain, one entry per rank that reported. A rank silent since then is
        forgotten (ended, or of an old generation): without that every rank ever seen stayed here."""
        out = []
        for key, p in sorted(self.progress.items()):
            job, generation, rank = key
            if not p.reports:
                del self.progress[key]
                continue
            out.append(node_pb2.RankProgress(job=job, generation=generation, rank=rank, last_step=p.last_step,
                                             steps=p.steps, mean_step_s=p.step_s / p.steps if p.steps else 0.0,
                                             mean_compute_s=p.compute_s / p.steps if p.steps else 0.0,
                                             last_step_unix_ns=p.last_unix_ns,
                                             compute_samples=p.samples, reports=p.reports, saving=p.saving,
                                             finished=p.finished))
            p.steps, p.step_s, p.compute_s, p.reports = 0, 0.0, 0.0, 0
            p.samples.clear()
        return out


class LocalService(local_pb2_grpc.LocalServiceServicer):
    def __init__(self, state: LocalState, current_generation: Callable[[str], int | None],
                 send: Callable[[node_pb2.AgentMessage], None],
                 fatal: Callable[[str, int, int, str], bool] = lambda job, generation, rank, reason: False,
                 snapshots: snaps.Snapshots | None = None, emit: Callable[..., None] = lambda *a, **k: None,
                 slow_factor: Callable[[str, int, int], float] = lambda job, generation, rank: 0.0,
                 park: Callable[..., str] | None = None) -> None:
        self._state = state
        self._current = current_generation
        self._send = send
        self._fatal = fatal  # (job, generation, rank, reason) -> whether that rank is known here
        self.watchers = 0  # Watch streams open now
        self._snapshots = snapshots  # None: this node keeps no snapshots
        self._emit = emit  # (kind, message, **labels) -> the controller's event log
        self._slow_factor = slow_factor  # (job, generation, rank) -> the slow=F injected on its GPU, or 0.0
        self._park = park  # Supervisor.park: (request, deliver) -> "" or why the rank cannot wait here
        self.own_sockets: set[str] = set()  # jobs served on a socket of their own (serve_job_socket)
        self._tells: dict[str, tuple[float, float]] = {}  # job -> (tokens left, when counted): Tell's rate per job

    async def Report(self, request: local_pb2.ReportRequest, context) -> local_pb2.ReportReply:
        key = (request.job, request.generation, request.rank)
        if request.fatal and not self._fatal(request.job, request.generation, request.rank, request.fatal):
            logger.warning("fatal report from a rank this agent does not run; ignored", job=request.job,
                           generation=request.generation, rank=request.rank, reason=request.fatal)
        p = self._state.progress.setdefault(key, _Progress())
        p.reports += 1
        p.saving = request.saving
        p.finished = request.finished
        for sample in request.steps:
            p.steps += 1
            p.step_s += sample.step_s
            p.compute_s += sample.compute_s
            p.last_step, p.last_unix_ns = sample.step, sample.end_unix_ns
            if sample.compute_s > 0:
                p.samples.append(sample.compute_s)
        return self._wanted(request.job, request.generation, request.rank)

    async def Watch(self, request: local_pb2.WatchRequest, context):
        """Push what the controller wants of this rank each time it changes, until the generation is stale."""
        sent = None
        self.watchers += 1
        try:
            while True:
                change = self._state.next_change()  # taken before reading: no change slips between read and wait
                wanted = self._wanted(request.job, request.generation, request.rank)
                if wanted != sent:
                    yield wanted
                    sent = wanted
                if wanted.stale:
                    return
                await change.wait()
        finally:
            self.watchers -= 1

    def _wanted(self, job: str, generation: int, rank: int) -> local_pb2.ReportReply:
        """What the controller wants of a rank: to stop (stale), or to checkpoint; and a slow=F fault on its GPU."""
        reply = local_pb2.ReportReply()
        current = self._current(job)
        if current is not None and generation < current:
            reply.stale = True
            return reply
        reply.slow_factor = self._slow_factor(job, generation, rank)
        pending = self._state.requests.get(job)
        if pending is not None and pending.generation == generation:
            reply.checkpoint.CopyFrom(local_pb2.CheckpointRequest(
                id=pending.request_id, deadline_s=pending.deadline_s, reason=pending.reason, pause=pending.pause,
                at_step=pending.at_step, no_in_memory=self._no_in_memory(job) if pending.pause else "",
                due_unix_ns=self._state.due_ns.get(job, 0)))
        return reply

    def _no_in_memory(self, job: str) -> str:
        """Why an eviction's checkpoint of `job` cannot be kept in host memory on this node, or ""."""
        return NO_SNAPSHOTS if self._snapshots is None else self._snapshots.replicator.no_peer(job)

    async def SnapshotTaken(self, request: local_pb2.SnapshotTakenRequest, context) -> local_pb2.SnapshotTakenReply:
        if self._snapshots is None:
            return local_pb2.SnapshotTakenReply(error=NO_SNAPSHOTS)
        try:
            key = snaps.Key.of(request)
        except snaps.SnapshotError as e:
            return local_pb2.SnapshotTakenReply(error=str(e))
        return local_pb2.SnapshotTakenReply(error=self._snapshots.taken(key, request.path, request.size, request.crc32))

    async def FetchSnapshot(self, request: local_pb2.FetchSnapshotRequest, context) -> local_pb2.FetchSnapshotReply:
        if self._snapshots is None:
            return local_pb2.FetchSnapshotReply(error=NO_SNAPSHOTS)
        try:
            held = await self._snapshots.fetch(snaps.Key.of(request), request.source)
            # a replica is the agent's (0600): a rank that runs as an account gets a copy of its own
            path = await asyncio.to_thread(self._snapshots.store.hand_over, held)
        except snaps.SnapshotError as e:
            return local_pb2.FetchSnapshotReply(error=str(e))
        except OSError as e:
            return local_pb2.FetchSnapshotReply(error=f"the snapshot cannot be handed to the rank: {e}")
        return local_pb2.FetchSnapshotReply(path=str(path), crc32=held.crc32)

    async def Tell(self, request: local_pb2.TellRequest, context) -> local_pb2.TellReply:
        """An event from a rank for the controller's log. At most TELL_RATE a second per job (a burst of TELL_BURST):
        the agent's outbox to the controller also carries every job's checkpoint acks and command results, which
        one job's flood must not push out. Beyond it the event is dropped (logged here once a second)."""
        if not self._tell_allowed(request.job):
            return local_pb2.TellReply()
        kind = request.kind if request.kind.replace("_", "").isalnum() else "trainlib"
        self._emit(kind[:64], request.message[:2000], job=request.job[:256], rank=str(request.rank))
        return local_pb2.TellReply()

    def _tell_allowed(self, job: str) -> bool:
        now = time.monotonic()
        if len(self._tells) > MAX_TELL_JOBS:  # job names are the caller's: the table stays bounded
            self._tells = {j: t for j, t in self._tells.items() if now - t[1] < TELL_BURST / TELL_RATE}
        tokens, then = self._tells.get(job, (TELL_BURST, now))
        tokens = min(TELL_BURST, tokens + (now - then) * TELL_RATE)
        allowed = tokens >= 1
        self._tells[job] = (tokens - 1 if allowed else tokens, now)
        if not allowed and int(now) != int(then):
            logger.warning("a job's events are dropped: more than the agent forwards", job=job[:256],
                           rate_per_s=TELL_RATE)
        return allowed

    async def Park(self, request: local_pb2.ParkRequest, context) -> local_pb2.ParkReply:
        """Hold a rank whose generation ended until the next one is launched here with it (its environment), or
        until none will be (exit)."""
        if self._park is None:
            return local_pb2.ParkReply(why="this agent does not keep ranks between generations")
        future: asyncio.Future = asyncio.get_running_loop().create_future()

        def deliver(env: dict[str, str] | None, why: str) -> bool:
            """Answer the rank; False if it is no longer waiting."""
            if future.done():
                return False
            future.set_result((env, why))
            return True
        refused = self._park(request, deliver)
        if refused:
            return local_pb2.ParkReply(why=refused)
        try:
            env, why = await future
        except asyncio.CancelledError:  # the rank went away (its process ended): nothing to hand it
            deliver(None, "the rank is gone")
            raise
        if env is None:
            return local_pb2.ParkReply(why=why)
        return local_pb2.ParkReply(rejoin=True, env=env)

    async def CheckpointDone(self, request: local_pb2.CheckpointDoneRequest, context) -> local_pb2.CheckpointDoneReply:
        """A rank committed the step a checkpoint request named: tell the controller. An in-memory commit (an
        eviction's) counts once the snapshot's replica is kept on the job's peer node, so that losing this node
        loses no step; until then the rank waits, and if none is kept it is told why (and saves durably). With
        `check_only` the rank only asks whether its replica is kept, before its ranks agree on how to commit."""
        if request.in_memory:
            why = await self._replicated(request)
            if why:
                logger.warning("in-memory checkpoint cannot be taken: the ranks save durably", job=request.job,
                               rank=request.rank, step=request.step, error=why)
            if why or request.check_only:
                return local_pb2.CheckpointDoneReply(error=why)
        logger.info("rank committed a checkpoint", job=request.job, rank=request.rank, step=request.step,
                    request_id=request.request_id, in_memory=request.in_memory)
        self._send(node_pb2.AgentMessage(checkpoint_ack=node_pb2.CheckpointAck(
            job=request.job, generation=request.generation, rank=request.rank, request_id=request.request_id,
            step=request.step, in_memory=request.in_memory)))
        return local_pb2.CheckpointDoneReply()

    async def _replicated(self, request: local_pb2.CheckpointDoneRequest) -> str:
        """"" when the rank's snapshot of the step it committed is kept here and on its peer node, else why not."""
        if self._snapshots is None:
            return NO_SNAPSHOTS
        try:
            key = snaps.Key.of(request)
        except snaps.SnapshotError as e:
            return str(e)
        wait_s = request.wait_s if 0 < request.wait_s < snaps.REPLICA_WAIT_S else snaps.REPLICA_WAIT_S  # NaN: ours
        return await self._snapshots.replicator.replicated(key, wait_s)


async def serve(path: Path, service: LocalService, group: str = "", agent_user_jobs: bool = True) -> grpc.aio.Server:
    """Listen on the Unix socket `path` (mode 0660). Raises OSError if it cannot."""
    server = await unix_socket.serve(
        path, lambda s: local_pb2_grpc.add_LocalServiceServicer_to_server(shared(service, agent_user_jobs), s), group)
    logger.info("local service for trainlib serving", socket=str(path))
    return server


# -- a job's own socket: only its account may speak for it -----------------------------------------------

class Scoped:
    """LocalService answering only the requests whose job `allows` admits; the others PERMISSION_DENIED, `why`."""

    def __init__(self, inner: LocalService, allows: Callable[[str], bool], why: Callable[[str], str]) -> None:
        self._inner, self._allows, self._why = inner, allows, why

    def __getattr__(self, name: str):
        method = getattr(self._inner, name)
        allows, why = self._allows, self._why
        if name == "Watch":
            async def stream(request, context):
                if not allows(request.job):
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, why(request.job))
                async for reply in method(request, context):
                    yield reply
            return stream

        async def unary(request, context):
            if not allows(request.job):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why(request.job))
            return await method(request, context)
        return unary


def shared(service: LocalService, agent_user_jobs: bool = True) -> Scoped:
    """The shared socket's service: every job but those with a socket of their own (they run as an account); none
    at all on a node that runs no ranks as the agent's user (any member of socket_group could speak for them)."""
    if not agent_user_jobs:
        return Scoped(service, lambda job: False,
                      lambda job: "this node runs no ranks as the agent's user (agent security.agent_user_ranks = "
                                  "false): every job's ranks speak through their own socket ($PHALANX_AGENT_SOCKET)")
    return Scoped(service, lambda job: job not in service.own_sockets,
                  lambda job: f"{job} runs as its own account: its ranks speak through its own socket "
                              "($PHALANX_AGENT_SOCKET), which only that account can open")


def serve_job_socket(path: Path, service: LocalService, job: str, uid: int, gid: int) -> grpc.aio.Server:
    """A job's own socket: only its account may speak for it. Owned by the job's account and mode 0600, the
    kernel lets only that account's processes (and root) connect, so another user's process cannot report
    progress, acknowledge a checkpoint or read requests for this job; every request on it must name the job.
    Bound now, served from the loop's next turn: a rank that connects before waits in the listen queue.
    Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        path.unlink()
    server = grpc.aio.server(options=unix_socket.SERVER_OPTIONS, interceptors=[unix_socket.RequestGuard()])
    scoped = Scoped(service, lambda asked: asked == job, lambda asked: f"this socket is {job}'s only, not {asked}'s")
    local_pb2_grpc.add_LocalServiceServicer_to_server(scoped, server)
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise OSError(f"cannot listen on unix socket {path}")
    os.chmod(path, 0o600)
    os.chown(path, uid, gid)
    asyncio.get_running_loop().create_task(server.start())
    service.own_sockets.add(job)
    logger.info("job socket for trainlib serving", job=job, socket=str(path), uid=uid)
    return server
