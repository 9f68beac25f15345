"""NodeService: registration and the long-lived agent session. Thin: unpack, call the registry, pack."""

from __future__ import annotations

import asyncio
import collections
import zlib
from collections.abc import Awaitable, Callable

import grpc

from controller import validation
from controller.api import auth
from controller.api.rpc import status_for, unary
from controller.credentials import Credentials
from controller.errors import AlreadyInSession, ControllerError, FailedPrecondition, InvalidArgument
from controller.jobs.manager import JobManager
from controller.nodes.registry import NodeEntry, Registry
from controller.nodes.session import Session
from phalanx import log
from phalanx.clock import Clock, RealClock
from phalanx.errors import BadRequest
from phalanx.v1 import node_pb2, node_pb2_grpc

logger = log.get("node-service")

OPEN_TIMEOUT_S = 10.0  # an agent that connects must say who it is within this time
# A new leader takes parked sessions up this many at a time, then lets the event loop see to everything else
# (the heartbeats of the nodes already back) for a moment, longer while the loop runs late: ten thousand at
# once would hold the loop for seconds, and the heartbeats of the nodes already back would go unread until
# they looked dead.
TAKE_BATCH = 100
TAKE_PAUSE_S = 0.02
# ... and takes no more while this many sessions taken up have not been heard from (no first heartbeat yet; an agent
# sends it at a random point of its first interval): agents slower to answer than the leader takes them up would
# be found silent, then DOWN, and register again (bench/run.py failover-scale, 10,000 nodes whose generator fell
# 0.7 s behind: 25 s until all were back, 1,837 declared). It waits at most TAKE_WAIT_MAX_S a batch, so that
# sessions that never send a heartbeat cannot hold the others back for long.
TAKE_AHEAD = 3000
TAKE_WAIT_MAX_S = 1.0
# The take-up rate a parked session's StandingBy.takeover_s allows for, from its place in the queue (first
# parked, first taken up): a leader taking over on a core busy with the heartbeats of the nodes already back
# (8,000 here) took 700 a second, and an agent that gave up waiting opened a session of its own, which costs
# the leader more than the take-up it replaced (bench/run.py failover-scale, 8,000 nodes on a shared 2-core
# machine: 91 s until all were back, 3,401 taken up, against 5.0 s and all 8,000 with this window).
TAKE_RATE = 500.0
# A standby that sees another controller elected tells its parked sessions (StandingBy again, naming the leader),
# this long after the election and at the take-up's pace: an agent not parked at the new leader (it came back to
# the control plane, or that controller did, since it last parked there) then goes there at once instead of
# waiting StandingBy.takeover_s for a take-up that cannot come; the winner's own take-up goes first.
NAME_DELAY_S = 0.5


class _Parked:
    """A parked session's handler waits on `wake`: its turn to be taken up (`taken`), or a new leader to name."""

    __slots__ = ("taken", "wake")

    def __init__(self) -> None:
        self.taken = False
        self.wake = asyncio.Event()


async def read_open(context: grpc.aio.ServicerContext) -> node_pb2.AgentMessage | None:
    """A session's first message (None: the agent closed the stream first)."""
    try:
        first = await asyncio.wait_for(context.read(), OPEN_TIMEOUT_S)
    except TimeoutError:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no SessionOpen within {OPEN_TIMEOUT_S:g}s")
    return None if first is grpc.aio.EOF else first


class ParkedSessions:
    """A standby's end of parked sessions. An agent in session with the leader also opens one here, with
    `standby` in its SessionOpen; the standby answers StandingBy and holds the stream, at the cost of an idle
    HTTP/2 stream. If this controller wins the election, `take` hands every parked stream to the new leader's
    NodeService, which accepts it as if it had just been opened: a takeover then costs each agent one message
    each way, where it used to cost a new connection, a new stream and a refusal naming the leader first. If
    this controller stops standing by without leading, `release` refuses them all (they park elsewhere). If another
    controller is elected meanwhile, `name_leader` sends each parked session StandingBy again, naming it."""

    def __init__(self, name: str, refuse: Callable[[grpc.aio.ServicerContext], Awaitable[None]],
                 leader: Callable[[], str], takeover_s: float, clock: Clock | None = None) -> None:
        self._name = name
        self._clock = clock or RealClock()  # the take-up's pacing
        self._takeover_s = takeover_s
        self._refuse = refuse  # ends a call with the standby's UNAVAILABLE naming the leader
        self._leader = leader  # the leader's address, or ""
        self._decided = False
        self._serve: Callable[[grpc.aio.ServicerContext, node_pb2.AgentMessage], Awaitable[None]] | None = None
        self._waiters: collections.deque[_Parked] = collections.deque()
        self._releasing: asyncio.Task | None = None
        self._naming: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        first = await read_open(context)
        if first is None:
            return
        if self._decided:  # between the election and the switch to the leader's methods
            await self._finish(context, first)
            return
        if first.WhichOneof("body") != "open" or not first.open.standby or not first.open.incarnation:
            await self._refuse(context)  # a session to open now, or one the agent has no incarnation to resume
        try:
            auth.require_node(validation.node_name(first.open.node_name))
        except ControllerError as e:
            await context.abort(status_for(e), str(e))
        await context.write(self._standing_by(len(self._waiters)))
        if self._decided:  # decided during the write: the release may have gone by already
            await self._finish(context, first)
            return
        parked = _Parked()
        self._waiters.append(parked)
        try:
            while True:
                await parked.wake.wait()
                parked.wake.clear()
                if parked.taken:
                    break
                try:
                    await context.write(self._standing_by(0))  # name_leader: another controller leads now
                except ConnectionError:  # the agent went away (the session port finds out on a write)
                    return
        finally:
            if not parked.taken:  # the agent went away (or the server stops)
                self._waiters.remove(parked)
        await self._finish(context, first)

    def _standing_by(self, queued: int) -> node_pb2.ControllerMessage:
        return node_pb2.ControllerMessage(standing_by=node_pb2.StandingBy(
            controller=self._name, leader=self._leader(), takeover_s=self._takeover_s + queued / TAKE_RATE))

    def name_leader(self) -> None:
        """Another controller was elected: tell every parked session where it is (NAME_DELAY_S from now, at the
        take-up's pace), unless this controller leads or stopped standing by meanwhile."""
        if self._decided:
            return
        if self._naming is not None:
            self._naming.cancel()
        self._naming = asyncio.get_running_loop().create_task(self._name_all(), name="name-leader")

    async def _name_all(self) -> None:
        await self._clock.sleep(NAME_DELAY_S)  # (cancelled if this controller leads or stops standing by: _decide)
        for i, parked in enumerate(list(self._waiters)):
            parked.wake.set()
            if i % TAKE_BATCH == TAKE_BATCH - 1:
                await self._clock.sleep(TAKE_PAUSE_S)

    async def _finish(self, context: grpc.aio.ServicerContext, first: node_pb2.AgentMessage) -> None:
        if self._serve is None:
            await self._refuse(context)
        await self._serve(context, first)

    def take(self, serve: Callable[[grpc.aio.ServicerContext, node_pb2.AgentMessage], Awaitable[None]],
             done: Callable[[], None] | None = None, unheard: Callable[[], int] | None = None) -> None:
        """This controller leads: every parked session (and any parking from now on) is served by `serve`,
        TAKE_BATCH at a time, while fewer than TAKE_AHEAD sessions are `unheard` from; `done` is called once every
        session parked at the election has had its turn."""
        self._serve = serve
        self._decide(done, unheard)

    def release(self) -> None:
        """This controller stops standing by without leading: the parked sessions are refused."""
        self._decide(None, None)

    def _decide(self, done: Callable[[], None] | None, unheard: Callable[[], int] | None) -> None:
        self._decided = True
        if self._naming is not None:
            self._naming.cancel()
        self._releasing = asyncio.get_running_loop().create_task(self._release(done, unheard), name="parked-sessions")

    async def _release(self, done: Callable[[], None] | None, unheard: Callable[[], int] | None) -> None:
        try:
            await self._release_all(unheard)
        finally:
            if done is not None:
                done()

    async def _release_all(self, unheard: Callable[[], int] | None) -> None:
        clock = self._clock
        while self._waiters:
            deadline = clock.monotonic() + TAKE_WAIT_MAX_S
            while unheard is not None and unheard() >= TAKE_AHEAD and clock.monotonic() < deadline:
                await clock.sleep(TAKE_PAUSE_S)
            for _ in range(min(TAKE_BATCH, len(self._waiters))):
                parked = self._waiters.popleft()
                parked.taken = True
                parked.wake.set()
            asked = clock.monotonic()
            await clock.sleep(TAKE_PAUSE_S)
            late = clock.monotonic() - asked - TAKE_PAUSE_S  # how far behind the loop runs: the work the batch made
            if late > TAKE_PAUSE_S:
                await clock.sleep(2 * late)


class NodeService(node_pb2_grpc.NodeServiceServicer):
    def __init__(self, registry: Registry, jobs: JobManager, credentials: Credentials | None = None) -> None:
        self._credentials = credentials
        self._registry = registry
        self._jobs = jobs

    @unary
    async def Register(self, request: node_pb2.RegisterRequest, context: grpc.aio.ServicerContext):
        name = validation.node_name(request.node_name)
        auth.require_node(name)
        if not request.HasField("inventory"):
            raise InvalidArgument("inventory is missing")
        validation.inventory(request.inventory)
        entry = await self._registry.register(name, request.inventory, context.peer())
        return node_pb2.RegisterResponse(
            incarnation=entry.record.incarnation,
            heartbeat_interval_s=self._registry.policy.heartbeat_interval_s,
            state=entry.record.state.to_proto(),
            drain_reason=entry.record.drain_reason,
            epoch=self._registry.epoch,
        )

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        if (first := await read_open(context)) is not None:
            await self.serve(context, first)

    async def serve(self, context: grpc.aio.ServicerContext, first: node_pb2.AgentMessage) -> None:
        """The session whose first message was `first`: opened here, or parked at this controller while it stood
        by (ParkedSessions). A SessionOpen with `standby` is answered as any other: this controller leads."""
        session = Session(context.peer(), self._registry.epoch, self._registry.leading, self._registry.clock)
        try:
            if first.WhichOneof("body") != "open":
                raise InvalidArgument("the first session message must be `open` (SessionOpen)")
            name = validation.node_name(first.open.node_name)
            auth.require_node(name)
            if first.open.standby and self._registry.in_session(name):
                # a parked session taken up (or parked here) after the agent opened one itself: that one stays
                raise AlreadyInSession(f"node {name!r} is in session with this controller already")
            entry = self._registry.attach(name, first.open.incarnation, session)
        except ControllerError as e:
            await context.abort(status_for(e), str(e))
        registry = self._registry
        accepted = node_pb2.SessionAccepted(
            incarnation=entry.record.incarnation, heartbeat_interval_s=registry.policy.heartbeat_interval_s,
            state=entry.record.state.to_proto(), drain_reason=entry.record.drain_reason, epoch=registry.epoch,
            inventory_crc32=zlib.crc32(entry.record.inventory))
        if self._credentials is not None and auth.current_peer() is not None:  # its snapshot port checks peers too
            accepted.revocations.CopyFrom(self._credentials.node_revocations())
        if entry.heartbeats and not entry.judge_deferred:  # judged here: the agent keeps the verdict (none is
            accepted.health.CopyFrom(entry.health_proto())  # pushed if unchanged)
        reader = None
        try:  # from here on, however the call ends, the node's session ends with it
            await context.write(node_pb2.ControllerMessage(accepted=accepted))
            with log.bound(node=name):  # every line of this session, and the tasks it starts, names the node
                reader = asyncio.create_task(self._read(context, entry, session))
            while (message := await session.next_message()) is not None:
                await context.write(message)
        finally:
            if reader is not None:
                reader.cancel()
            self._registry.detach(entry, session)
        if session.close_code is not grpc.StatusCode.OK:
            await context.abort(session.close_code, session.close_message)

    async def _read(self, context: grpc.aio.ServicerContext, entry: NodeEntry, session: Session) -> None:
        registry = self._registry
        settling: asyncio.Task | None = None
        fencing: asyncio.Task | None = None
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                body = message.WhichOneof("body")
                if body == "heartbeat":
                    if len(message.heartbeat.gpus) > validation.MAX_GPUS:
                        raise InvalidArgument(f"heartbeat carries {len(message.heartbeat.gpus)} GPUs; "
                                              f"the limit is {validation.MAX_GPUS}")
                    if registry.heartbeat(entry, message.heartbeat):
                        self._jobs.wake()  # a new health verdict is news for the jobs on the node now
                        if settling is None or settling.done():
                            # off the reader: a commit waiting for the registry lock must not stop this
                            # node's heartbeats from being read (which would make it look silent)
                            settling = asyncio.create_task(registry.settle(entry))
                    if self._jobs.observe(entry, message.heartbeat) and (fencing is None or fencing.done()):
                        # off the reader too: the stop's answer comes back on this very stream, and the
                        # node's heartbeats must go on being read while it is on its way
                        fencing = asyncio.create_task(self._jobs.fence(entry, message.heartbeat))
                elif body == "inventory":
                    validation.inventory(message.inventory)
                    await registry.update_inventory(entry, message.inventory)
                elif body == "event":
                    validation.request_size(message)
                    event = message.event
                    if not event.kind or not event.kind.replace("_", "").replace("-", "").isalnum():
                        raise InvalidArgument(f"event kind {event.kind[:40]!r} must be a non-empty word")
                    job = event.fields.get("job", "")  # about a job (a snapshot restored...): filed under it
                    await registry.agent_event(entry, event.kind, event.message, dict(event.fields),
                                               job if self._jobs.involves(job, entry.record.name) else "")
                elif body == "gpu_event":
                    if message.gpu_event.gpu_index >= validation.MAX_GPUS:
                        raise InvalidArgument(f"gpu_event.gpu_index {message.gpu_event.gpu_index} is out of range")
                    await registry.gpu_event(entry, message.gpu_event)
                    self._jobs.wake()
                elif body == "checkpoint_ack":
                    self._jobs.checkpoint_ack(entry.record.name, message.checkpoint_ack)
                elif body == "result":
                    session.resolve(message.result)
                elif body == "open":
                    raise InvalidArgument("the session is already open")
                else:
                    raise InvalidArgument("empty session message")
            session.kick(grpc.StatusCode.OK, "")
        except (ControllerError, BadRequest) as e:
            logger.warning("session ended", node=entry.record.name, peer=session.peer, error=str(e))
            session.kick(status_for(e), str(e))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            session.kick(grpc.StatusCode.OK, e.details() or "")
        except Exception as e:
            logger.exception("session failed", node=entry.record.name, peer=session.peer)
            session.kick(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    @unary
    async def RenewCertificate(self, request: node_pb2.RenewCertificateRequest, context):
        peer = auth.current_peer()
        if self._credentials is None or peer is None or peer.via != "certificate":
            raise FailedPrecondition("renewal is for a node's certificate on mutual TLS")
        if not request.csr_pem or len(request.csr_pem) > 16 * 1024:
            raise InvalidArgument("csr_pem must be a certificate signing request of at most 16384 bytes")
        pem = context.auth_context().get("x509_pem_cert") or [b""]
        cert, not_after_ns = await self._credentials.renew(peer.name, request.csr_pem, context.peer(), pem[0])
        return node_pb2.RenewCertificateResponse(cert_pem=cert, not_after_unix_ns=not_after_ns)
