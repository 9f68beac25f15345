"""The agent's session with the controller: register, open the session, heartbeat, reconnect.

Any end of the session (controller restart, network loss, a refusal) leads to the same path: wait a
jittered, growing delay and open a new session. An agent that has registered before resumes: it opens
the session with the incarnation it was given, and the controller, which knows the node from its store,
answers with its view of the node (SessionAccepted), with no registration to commit. That is what keeps a
takeover cheap: ten thousand agents come back with one stream each. A controller that does not know the
incarnation (the agent was declared DOWN, the store lost the node) refuses with FAILED_PRECONDITION, and
the agent registers at once: registering is the full resync, with the inventory. An inventory that the
controller does not hold (SessionAccepted says its CRC-32) goes up on the resumed session.

With several controllers (a control plane on etcd), the agent also parks a session at each standby: a
SessionOpen with `standby`, answered with StandingBy, the stream then held. The standby that wins the next
election answers the parked stream with SessionAccepted, and the session carries on there: after a takeover
the agent is in session with the new leader without opening anything. When the session with the leader ends
and a session is parked, the agent tries the old leader again for StandingBy.takeover_s (not the standbys,
which could only refuse) before it looks for the leader elsewhere, as before. Every wait (heartbeat cadence,
backoff, deadlines) is on the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import ssl
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from agent.backoff import Backoff
from phalanx import framed, log, tls
from phalanx.clock import Clock, RealClock, first_of, wait_for
from phalanx.leader import leader_hint
from phalanx.rpc import CLIENT_OPTIONS, DEFAULT_TIMEOUT_S, SESSION_KEEPALIVE
from phalanx.v1 import common_pb2, node_pb2, node_pb2_grpc

logger = log.get("link")

MAX_QUEUED = 1000  # messages kept for the controller while disconnected; the oldest go first
# First and longest wait before parking again at a controller that refused or is gone: not urgent (it is for the next
# takeover), and after a takeover every agent would otherwise try the dead leader at once.
PARK_RETRY_S = (5.0, 30.0)
EPOCH_RESET_S = 60.0  # older epochs from every controller reached for this long: the epochs started again


class RegisterAgain(Exception):
    """The controller did not resume the session (a stale incarnation, a node declared DOWN): register."""


@dataclass
class LinkState:
    """What the agent knows of its standing with the controller (for logs and later for ranks)."""

    connected: bool = False
    incarnation: int = 0
    state: int = common_pb2.NODE_STATE_UNSPECIFIED
    drain_reason: str = ""
    health: common_pb2.NodeHealth | None = None  # the controller's latest verdict on this node
    sessions: int = 0  # sessions opened (reconnects + 1)
    epoch: int = 0  # the newest leadership epoch seen: a controller with an older one was deposed


class Link:
    def __init__(
        self,
        node_name: str,
        controllers: str | list[str],
        inventory: Callable[[], common_pb2.NodeInventory],
        heartbeat: Callable[[float], Awaitable[node_pb2.Heartbeat]],
        backoff: Backoff,
        on_command: Callable[[node_pb2.Command], node_pb2.CommandResult] | None = None,
        credentials: grpc.ChannelCredentials | Callable[[], grpc.ChannelCredentials] | None = None,
        server_name: str = "",
        clock: Clock | None = None,
        session_port: int = 0,
        session_tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self.node_name = node_name
        # Every controller of the control plane; the session goes to the one that leads (a standby says which).
        self.controllers = [controllers] if isinstance(controllers, str) else list(controllers)
        self.controller = self.controllers[0]
        self._hinted = False  # the next session goes to the leader a standby named: no backoff before it
        self._inventory = inventory
        self._heartbeat = heartbeat  # builds one within the budget of seconds it is given
        self._clock = clock or RealClock()
        self._backoff = backoff
        self._on_command = on_command
        self._credentials = credentials  # None: plaintext (security.insecure)
        self._server_name = server_name
        self._session_port = session_port  # the session in frames on the controllers' session port; 0: gRPC
        self._session_tls = session_tls  # None: plaintext (security.insecure)
        faster = {key for key, _ in SESSION_KEEPALIVE}
        self._options = [*(o for o in CLIENT_OPTIONS if o[0] not in faster), *SESSION_KEEPALIVE,
                         *tls.controller_name_options(server_name)]
        self.state = LinkState()
        self._seq = 0
        self._outbox: deque[node_pb2.AgentMessage] = deque(maxlen=MAX_QUEUED)
        self._wake = asyncio.Event()
        self._beat_now = False
        self._commands_done = 0  # the newest command id of this session carried out (heartbeats say it)
        # Sessions parked at standbys that a new leader took up: (controller, channel, call, SessionAccepted).
        self._promoted: list[tuple[str, grpc.aio.Channel, object, node_pb2.ControllerMessage]] = []
        self._promotion = asyncio.Event()
        self._named = ""  # the new leader a standby named while the session was down: the next session goes there
        self._nudge = asyncio.Event()  # ... at once, without the backoff
        self._changed = asyncio.Event()  # replaced at every change of the session (see _notify)
        self._standing_by: dict[str, float] = {}  # controller -> its StandingBy.takeover_s, while parked there
        self._lost_at = 0.0  # when the last session that was open ended
        self._older_since: float | None = None  # since when every controller reached led an epoch older than seen
        self._older_last = 0.0  # the last time one did

    @property
    def heartbeats_sent(self) -> int:
        return self._seq

    def emit(self, kind: str, message: str, **fields: str) -> None:
        """Queue an event for the controller's log; sent at once, or on the next session."""
        self.send(node_pb2.AgentMessage(event=node_pb2.AgentEvent(kind=kind, message=message, fields=fields)))

    def beat_now(self) -> None:
        """Send the next heartbeat now, not at its time: something in it (a rank that ended) cannot wait."""
        self._beat_now = True
        self._wake.set()

    def send(self, message: node_pb2.AgentMessage) -> None:
        """Queue a message to go up now (not at the next heartbeat). Call from the event loop's thread."""
        self._outbox.append(message)
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        parking = [asyncio.create_task(self._park_at(c, stop), name=f"park-{c}") for c in self.controllers] \
            if len(self.controllers) > 1 else []
        try:
            await self._sessions(stop)
        finally:
            for task in parking:
                task.cancel()
            await asyncio.gather(*parking, return_exceptions=True)
            for _, channel, _, _ in self._promoted:
                await channel.close(grace=None)

    async def _sessions(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            promoted = self._promoted.pop(0) if self._promoted else None
            if not self._promoted:
                self._promotion.clear()
            self._nudge.clear()
            if self._named and promoted is None:
                self.controller, self._named = self._named, ""
            try:
                await self._session_or_promotion(stop, promoted)
            except RegisterAgain as e:  # the same controller, at once, registering this time
                logger.info("the controller does not take this session up again; registering",
                            controller=self.controller, details=str(e))
                continue
            except grpc.aio.AioRpcError as e:
                problem = tls.controller_name_problem(e.details(), self._server_name)  # not a controller
                level = logger.info if e.code() == grpc.StatusCode.UNAVAILABLE and not problem else logger.warning
                level("session ended", controller=self.controller, code=e.code().name, details=e.details(),
                      **({"problem": problem} if problem else {}))
                self._move_on(e)
            except (TimeoutError, ConnectionError, asyncio.InvalidStateError) as e:
                # InvalidStateError: a write raced the call's end (the controller went away, or a keepalive
                # ping went unanswered); the reader has the status, and the next session starts the same way
                logger.warning("session ended", controller=self.controller, error=repr(e))
                self._move_on(None)
            except Exception:
                logger.exception("session failed", controller=self.controller)
                self._move_on(None)
            finally:
                self.state.connected = False
                self._notify()
            if stop.is_set():
                break
            if self._promoted:  # a standby took this session up meanwhile
                continue
            if self._hinted:  # a standby named the leader: go there at once
                self._hinted = False
                continue
            delay = self._backoff.next()
            logger.debug("reconnecting", delay_s=round(delay, 3), parked=len(self._standing_by))
            try:  # a standby taking the session up, or naming the new leader, ends the wait
                await wait_for(self._clock, first_of(stop.wait(), self._promotion.wait(), self._nudge.wait()), delay)
            except TimeoutError:
                pass

    async def _session_or_promotion(self, stop: asyncio.Event, promoted) -> None:
        """A session; one being opened gives way to a session a standby took up meanwhile (it is the leader's)."""
        if promoted is not None:
            await self._session(stop, promoted)
            return
        session = asyncio.ensure_future(self._session(stop, None))
        taken = asyncio.ensure_future(self._promotion.wait())
        try:
            await asyncio.wait({session, taken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            taken.cancel()
            if not session.done():
                session.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await session
        if not session.cancelled():
            session.result()

    def _notify(self) -> None:
        """Wake whoever waits for the session to change (the parking tasks)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _channel(self, controller: str) -> grpc.aio.Channel:
        # A callable is asked each time: certificate files renewed meanwhile are taken up (tls.ReloadingIdentity)
        credentials = self._credentials() if callable(self._credentials) else self._credentials
        return (grpc.aio.insecure_channel(controller, options=self._options) if credentials is None
                else grpc.aio.secure_channel(controller, credentials, options=self._options))

    async def _session_call(self, controller: str, channel: grpc.aio.Channel):
        """A new NodeService.Session call to `controller`: on its gRPC channel, or on its session port."""
        if not self._session_port:
            return node_pb2_grpc.NodeServiceStub(channel).Session()
        return await framed.FramedCall.open(
            framed.session_address(controller, self._session_port),
            self._session_tls() if self._session_tls is not None else None, self._server_name, DEFAULT_TIMEOUT_S)

    async def _park_at(self, controller: str, stop: asyncio.Event) -> None:
        """Keep a session parked at `controller` while the session with the leader is elsewhere; hand it to the
        session loop if the controller takes it up (it leads now)."""
        backoff = Backoff(*PARK_RETRY_S)
        while not stop.is_set():
            changed = self._changed
            if not self._parkable(controller):
                await changed.wait()
                continue
            incarnation = self.state.incarnation
            channel = self._channel(controller)
            handed = False
            try:
                call = await self._session_call(controller, channel)
                await call.write(node_pb2.AgentMessage(open=node_pb2.SessionOpen(
                    node_name=self.node_name, incarnation=incarnation, standby=True)))
                first = await wait_for(self._clock, call.read(), DEFAULT_TIMEOUT_S)
                if first is not grpc.aio.EOF and first.WhichOneof("body") == "standing_by":
                    backoff.reset()
                    self._standing_by[controller] = first.standing_by.takeover_s
                    try:
                        first = await self._held(call, controller, incarnation)
                    finally:
                        self._standing_by.pop(controller, None)
                    if first is None:  # the session moved here, or to another incarnation: park again
                        call.cancel()
                        continue
                if first is grpc.aio.EOF or first.WhichOneof("body") != "accepted":
                    raise ConnectionError("the controller ended the parked session")
                logger.info("a parked session was taken up", controller=controller, epoch=first.accepted.epoch)
                self._promoted.append((controller, channel, call, first))
                handed = True
                self._promotion.set()
                await self._changed.wait()  # the session loop takes it up; park here again once it ends
            except asyncio.CancelledError:
                raise
            except Exception as e:  # refused (an older controller, a stale incarnation), gone, or broken
                logger.debug("could not park a session", controller=controller, error=str(e)[:200])
                try:
                    await wait_for(self._clock, stop.wait(), backoff.next())
                except TimeoutError:
                    pass
            finally:
                if not handed:
                    await channel.close(grace=None)

    def _parkable(self, controller: str) -> bool:
        """A session is parked at `controller` only while the agent is in session with another one."""
        s = self.state
        return s.connected and s.incarnation != 0 and controller != self.controller and \
            not any(c == controller for c, *_ in self._promoted)

    async def _held(self, call, controller: str, incarnation: int):
        """Wait on a parked session for the controller's next message; None if the session changes so that the
        parked one is no longer wanted here (it is now the leader's, or the agent registered again)."""
        if self.state.incarnation != incarnation:  # registered again during the handshake
            return None
        reading = asyncio.ensure_future(call.read())
        try:
            while True:
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait({reading, changed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if reading.done():
                    message = reading.result()
                    if message is grpc.aio.EOF or message.WhichOneof("body") != "standing_by":
                        return message
                    self._leader_named(controller, message.standing_by.leader)
                    reading = asyncio.ensure_future(call.read())
                    continue
                if self.state.incarnation != incarnation or (self.state.connected and controller == self.controller):
                    return None
        finally:
            if not reading.done():
                reading.cancel()

    def _leader_named(self, standby: str, leader: str) -> None:
        """A standby this agent is parked at saw another controller elected (StandingBy again, naming it). If the
        session is down and no session is parked at the new leader (that one it takes up), go there now rather than
        wait StandingBy.takeover_s for a take-up that cannot come from here."""
        if not leader or self.state.connected or leader in self._standing_by:
            return
        logger.info("a standby named the new leader", standby=standby, leader=leader)
        self._named = leader
        self._nudge.set()

    async def _session(self, stop: asyncio.Event, promoted=None) -> None:
        """One session: opened here, or (`promoted`) parked at a standby that has since taken it up as leader."""
        if promoted is None:
            channel = self._channel(self.controller)
        else:
            self.controller, channel, _, _ = promoted
        try:
            await self._session_on(channel, stop, promoted)
        finally:
            if self.state.connected:  # before the caller decides where to go next (_move_on)
                self._lost_at = self._clock.monotonic()

    async def _session_on(self, channel: grpc.aio.Channel, stop: asyncio.Event, promoted) -> None:
        if promoted is not None:
            _, _, call, first = promoted
        async with channel:
            registered = None
            if promoted is None:
                stub = node_pb2_grpc.NodeServiceStub(channel)
                resuming = self.state.incarnation != 0
                if not resuming:
                    inventory = self._inventory()
                    registered = await stub.Register(node_pb2.RegisterRequest(
                        node_name=self.node_name, inventory=inventory), timeout=DEFAULT_TIMEOUT_S)
                    self._check_epoch(registered.epoch)
                # No deadline on the session: it is meant to live as long as both ends do; keepalive
                # pings (phalanx.rpc) notice a dead peer instead.
                call = await self._session_call(self.controller, channel)
                first = await self._open(call, self.state.incarnation if resuming else registered.incarnation,
                                         resuming)
            else:
                resuming = True
            accepted = first.accepted
            if not accepted.heartbeat_interval_s:  # a controller from before resumes: it says only the incarnation
                if resuming:
                    self.state.incarnation = 0
                    raise RegisterAgain("the controller's SessionAccepted does not describe the node")
                accepted.MergeFrom(node_pb2.SessionAccepted(
                    heartbeat_interval_s=registered.heartbeat_interval_s, state=registered.state,
                    drain_reason=registered.drain_reason, epoch=registered.epoch))
            self._check_epoch(accepted.epoch)
            if resuming:
                self._resync_inventory(accepted.inventory_crc32)
            interval = accepted.heartbeat_interval_s
            self._accepted(accepted, interval, resumed=resuming)
            self._notify()
            self._commands_done = 0  # command ids count afresh in each session
            reader = asyncio.create_task(self._read(call))
            # A new leader takes up every parked session at once: their first heartbeats spread over an interval,
            # not all in the same instant (the takeover gave every node a reconnect window that covers it).
            first_in = random.random() * interval if promoted is not None else 0.0
            try:
                await self._heartbeats(call, interval, reader, stop, first_in)
            finally:
                reader.cancel()
                if stop.is_set():
                    await call.done_writing()
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()

    async def _open(self, call, incarnation: int, resuming: bool) -> node_pb2.ControllerMessage:
        """Send SessionOpen; the controller's first answer, SessionAccepted. A refused resume says to register."""
        try:
            try:
                await call.write(node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name=self.node_name,
                                                                                 incarnation=incarnation)))
            except asyncio.InvalidStateError:  # the call ended first (a standby's refusal): its status says why
                pass
            first = await wait_for(self._clock, call.read(), DEFAULT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if resuming and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.state.incarnation = 0
                raise RegisterAgain(e.details()) from None
            raise  # a standby's UNAVAILABLE names the leader (_move_on)
        if first is grpc.aio.EOF or first.WhichOneof("body") != "accepted":
            raise ConnectionError("controller closed the session before accepting it")
        return first

    def _check_epoch(self, epoch: int) -> None:
        """Refuse a controller that leads an older epoch than one seen: a deposed leader. Unless every controller
        reached has done so for EPOCH_RESET_S: a deposed leader stands down within its lease, so the epochs
        started again (etcd's data wiped, or the control plane moved to a single controller, epoch 0), and an
        agent that refused for ever would be lost to the fleet until restarted."""
        if epoch >= self.state.epoch:
            self._older_since = None
            return
        now = self._clock.monotonic()
        if self._older_since is None or now - self._older_last > EPOCH_RESET_S / 2:
            self._older_since = now  # afresh after a long spell with no controller's answer: not every one refused
        self._older_last = now
        if now - self._older_since < EPOCH_RESET_S:
            raise ConnectionError(f"controller {self.controller} leads epoch {epoch}, older than epoch "
                                  f"{self.state.epoch} seen before: a deposed leader; trying another")
        message = (f"the controllers' epochs started again: {self.controller} has led epoch {epoch}, older than "
                   f"{self.state.epoch}, for {now - self._older_since:.0f}s; following it (was the store reset?)")
        logger.warning(message, controller=self.controller, epoch=epoch, previous_epoch=self.state.epoch)
        self.emit("epoch_reset", message, epoch=str(epoch), previous_epoch=str(self.state.epoch))
        self.state.epoch, self._older_since = epoch, None

    def _resync_inventory(self, held_crc32: int) -> None:
        """On a resumed session: the inventory, first in the outbox, unless the controller holds this one."""
        inventory = self._inventory()
        if zlib.crc32(inventory.SerializeToString(deterministic=True)) != held_crc32:
            self._outbox.appendleft(node_pb2.AgentMessage(inventory=inventory))

    def _move_on(self, error: grpc.aio.AioRpcError | None) -> None:
        """After a failed or ended session: the leader a standby named, else the next controller of the list."""
        if len(self.controllers) == 1 and error is None:
            return
        if self._named:  # a standby named the new leader while this session was failing: go there next
            return
        hint = None
        if error is not None and error.code() == grpc.StatusCode.UNAVAILABLE:
            hint = leader_hint(error)
        if not hint and self._standing_by and \
                self._clock.monotonic() - self._lost_at < max(self._standing_by.values()):
            # Parked at a standby: if the leader is gone, that standby will take the session up once the lease
            # lapses. Meanwhile try the leader again (at the backoff's pace), not the standbys, which could only
            # refuse: a takeover is then not also a storm of refused sessions at them.
            return
        if hint and hint != self.controller:
            logger.info("following the leader", standby=self.controller, leader=hint)
            self.controller, self._hinted = hint, True
        elif len(self.controllers) > 1:
            i = self.controllers.index(self.controller) if self.controller in self.controllers else -1
            self.controller = self.controllers[(i + 1) % len(self.controllers)]

    def _accepted(self, reply: node_pb2.SessionAccepted, interval: float, resumed: bool) -> None:
        self._backoff.reset()
        self._named = ""  # in session: a leader named while it was down is news no longer
        # answers to the previous session's commands mean nothing to this one
        kept = [m for m in self._outbox if m.WhichOneof("body") != "result"]
        self._outbox.clear()
        self._outbox.extend(kept)
        s = self.state
        s.connected, s.incarnation = True, reply.incarnation
        if reply.epoch > s.epoch:
            if s.epoch:
                logger.info("a new leader", controller=self.controller, epoch=reply.epoch, previous_epoch=s.epoch)
            s.epoch = reply.epoch
        s.sessions += 1
        # The controller's verdict, if it has one; otherwise the node is judged afresh (a new registration, a
        # new leader), and the controller pushes every verdict but the first HEALTHY: one from before would
        # be stale (a GPU reset since, say).
        s.health = reply.health if reply.HasField("health") else None
        s.state, s.drain_reason = reply.state, reply.drain_reason
        if reply.HasField("revocations") and self._on_command is not None:  # for the node's own services
            self._on_command(node_pb2.Command(revocations=reply.revocations))
        logger.info("session resumed" if resumed else "session open", controller=self.controller,
                    incarnation=reply.incarnation, state=common_pb2.NodeState.Name(reply.state),
                    drain_reason=reply.drain_reason, heartbeat_interval_s=interval)

    async def _heartbeats(self, call, interval: float, reader: asyncio.Task, stop: asyncio.Event,
                          first_in: float = 0.0) -> None:
        clock = self._clock
        next_at = clock.monotonic() + first_in
        stopper = asyncio.create_task(stop.wait())
        promoted = asyncio.create_task(self._promotion.wait())  # a new leader took a parked session up: go there
        waker: asyncio.Task | None = None
        try:
            while not stop.is_set() and not reader.done() and not promoted.done():
                self._wake.clear()
                while self._outbox:  # events, XIDs, command results: as soon as they happen
                    await wait_for(clock, call.write(self._outbox[0]), DEFAULT_TIMEOUT_S)
                    self._outbox.popleft()
                if clock.monotonic() >= next_at or self._beat_now:
                    if self._beat_now:  # and the next one an interval after this one
                        self._beat_now, next_at = False, clock.monotonic()
                    heartbeat = await self._heartbeat(interval / 2)  # a slow collector may not hold it back longer
                    self._seq += 1
                    heartbeat.seq = self._seq
                    heartbeat.commands_done = self._commands_done
                    heartbeat.sent_unix_ns = clock.wall_ns()
                    await wait_for(clock, call.write(node_pb2.AgentMessage(heartbeat=heartbeat)), DEFAULT_TIMEOUT_S)
                    next_at += interval
                    if next_at < clock.monotonic():  # we were paused (SIGSTOP, overload): do not burst
                        next_at = clock.monotonic()
                if waker is None or waker.done():
                    waker = asyncio.create_task(self._wake.wait())
                tick = asyncio.create_task(clock.sleep(next_at - clock.monotonic()))
                try:
                    await asyncio.wait({reader, stopper, waker, tick, promoted}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    tick.cancel()
        finally:
            stopper.cancel()
            promoted.cancel()
            if waker is not None:
                waker.cancel()

    async def _read(self, call) -> None:
        while (message := await call.read()) is not grpc.aio.EOF:
            body = message.WhichOneof("body")
            if body == "command":
                self.send(node_pb2.AgentMessage(result=self._run(message.command)))
                self._commands_done = max(self._commands_done, message.command.id)
            elif body == "status":
                status = message.status
                self.state.state, self.state.drain_reason = status.state, status.drain_reason
                if status.HasField("health"):
                    self.state.health = status.health
                logger.info("controller changed this node", state=common_pb2.NodeState.Name(status.state),
                            drain_reason=status.drain_reason)
        code = await call.code()
        if code != grpc.StatusCode.OK:
            raise ConnectionError(f"controller ended the session: {code.name}: {await call.details()}")

    def _run(self, command: node_pb2.Command) -> node_pb2.CommandResult:
        """Carry out a command; any failure becomes a refusal with a reason, never a dead session."""
        if self._on_command is None:
            return node_pb2.CommandResult(id=command.id, ok=False, error="this agent takes no commands")
        if command.epoch < self.state.epoch:
            logger.warning("command from a deposed leader refused", command=command.WhichOneof("body"),
                           epoch=command.epoch, current_epoch=self.state.epoch)
            return node_pb2.CommandResult(id=command.id, ok=False, error=f"refused: epoch {command.epoch} is older "
                                          f"than the current leader's ({self.state.epoch})")
        try:
            result = self._on_command(command)
        except Exception as e:
            logger.exception("command failed", command=command.WhichOneof("body"))
            return node_pb2.CommandResult(id=command.id, ok=False, error=f"{type(e).__name__}: {e}")
        result.id = command.id
        return result

