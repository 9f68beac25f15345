"""The node registry: the controller's authoritative table of nodes, persisted through the store.

Memory changes only after the store has committed, so a failed write loses nothing and is retried
by whatever caused it (the next tick, the next heartbeat, the operator's next command). All writes
go through one lock, in order; the heartbeat path itself takes no lock and does no I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from controller import liveness
from controller.config import LivenessConfig
from controller.errors import FailedPrecondition, NotFound
from controller.events import EventHub
from controller.states import DOWN, DRAINED, DRAINING, SUSPECT, UP, NodeState, check_transition, resting_state
from controller.stats import LagWindow
from controller.store.base import EventRecord, NodeRecord, Store
from phalanx import log
from phalanx.clock import Clock
from phalanx.v1 import common_pb2, control_pb2, node_pb2

logger = log.get("registry")


class Session:
    """The controller's half of one agent session: commands waiting to go down, and a kill switch."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.outbox: asyncio.Queue[node_pb2.ControllerMessage | None] = asyncio.Queue()  # None: closed
        self.closed = asyncio.Event()
        self.close_code = grpc.StatusCode.OK
        self.close_message = ""

    def push(self, message: node_pb2.ControllerMessage) -> None:
        self.outbox.put_nowait(message)

    def kick(self, code: grpc.StatusCode, message: str) -> None:
        if not self.closed.is_set():
            self.close_code, self.close_message = code, message
            self.closed.set()
            self.outbox.put_nowait(None)


@dataclass
class NodeEntry:
    record: NodeRecord
    last_seen: float  # monotonic
    session: Session | None = None
    heartbeat: node_pb2.Heartbeat | None = None
    last_heartbeat_ns: int = 0
    peer: str = ""
    heartbeats: int = 0
    session_lost: bool = False  # had a session with this controller process, and it ended

    @property
    def running_ranks(self) -> int:
        return self.heartbeat.running_ranks if self.heartbeat is not None else 0

    def inventory(self) -> common_pb2.NodeInventory:
        return common_pb2.NodeInventory.FromString(self.record.inventory)

    def to_proto(self) -> control_pb2.Node:
        node = control_pb2.Node(
            name=self.record.name,
            state=self.record.state.to_proto(),
            drain_reason=self.record.drain_reason,
            incarnation=self.record.incarnation,
            inventory=self.inventory(),
            last_heartbeat_unix_ns=self.last_heartbeat_ns,
            state_since_unix_ns=self.record.state_since_ns,
            peer=self.peer,
            connected=self.session is not None,
            running_ranks=self.running_ranks,
        )
        if self.heartbeat is not None:
            node.host.CopyFrom(self.heartbeat.host)
            node.gpus.extend(self.heartbeat.gpus)
        return node


class Registry:
    def __init__(self, store: Store, clock: Clock, policy: LivenessConfig, hub: EventHub) -> None:
        self._store = store
        self._clock = clock
        self.policy = policy
        self._hub = hub
        self._nodes: dict[str, NodeEntry] = {}
        self._lock = asyncio.Lock()
        self.lag = LagWindow()
        self.heartbeats_total = 0

    async def load(self) -> None:
        """Read every node from the store. Nodes get a full liveness window to reconnect."""
        now = self._clock.monotonic()
        for record in await self._store.load_nodes():
            self._nodes[record.name] = NodeEntry(record=record, last_seen=now)
        logger.info("registry loaded", nodes=len(self._nodes))

    def get(self, name: str) -> NodeEntry:
        try:
            return self._nodes[name]
        except KeyError:
            raise NotFound(f"no node named {name!r}; `phalanx nodes` lists the known ones") from None

    def entries(self) -> list[NodeEntry]:
        return [self._nodes[name] for name in sorted(self._nodes)]

    @property
    def sessions(self) -> int:
        return sum(1 for e in self._nodes.values() if e.session is not None)

    # -- the agent side ----------------------------------------------------------------------

    async def register(self, name: str, inventory: common_pb2.NodeInventory, peer: str) -> NodeEntry:
        async with self._lock:
            now, now_ns = self._clock.monotonic(), self._clock.wall_ns()
            entry = self._nodes.get(name)
            events = []
            if entry is None:
                record = NodeRecord(name=name, state=UP, state_since_ns=now_ns)
                events.append(self._event("node.state", f"node {name} joined: UP", name, source="NEW", target="UP"))
            else:
                record = entry.record
                if entry.session is not None:
                    events.append(self._event("node.superseded", f"node {name}: session from {entry.peer} replaced "
                                              f"by a new registration from {peer}", name, peer=peer))
                target = record.state
                if record.state in (SUSPECT, DOWN):
                    target = resting_state(record.drain_reason, 0)
                if target is not record.state:
                    check_transition(name, record.state, target)
                    events.append(self._state_event(name, record.state, target, f"registered from {peer}"))
                    record = record.replace(state=target, state_since_ns=now_ns)
            record = record.replace(incarnation=record.incarnation + 1, inventory=inventory.SerializeToString())
            events.append(self._event("node.registered", f"node {name} registered from {peer} "
                                      f"(incarnation {record.incarnation}, {len(inventory.gpus)} GPUs)", name,
                                      peer=peer, incarnation=str(record.incarnation)))
            committed = await self._store.commit(nodes=[record], events=events)
            old = self._nodes.get(name)
            if old is not None and old.session is not None:
                old.session.kick(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"superseded by a new registration of {name} from {peer}")
            entry = NodeEntry(record=committed.nodes[0], last_seen=now, peer=peer)
            self._nodes[name] = entry
            self._hub.publish(committed.events)
            logger.info("node registered", node=name, peer=peer, incarnation=entry.record.incarnation,
                        state=str(entry.record.state))
            return entry

    def attach(self, name: str, incarnation: int, session: Session) -> NodeEntry:
        entry = self._nodes.get(name)
        if entry is None:
            raise FailedPrecondition(f"node {name!r} is not registered; call Register first")
        if incarnation != entry.record.incarnation:
            raise FailedPrecondition(f"node {name!r}: incarnation {incarnation} is stale (current "
                                     f"{entry.record.incarnation}); register again")
        if entry.record.state is DOWN:
            raise FailedPrecondition(f"node {name!r} is DOWN; register again")
        if entry.session is not None and entry.session is not session:
            entry.session.kick(grpc.StatusCode.FAILED_PRECONDITION, "replaced by a newer session")
        entry.session = session
        entry.session_lost = False
        entry.peer = session.peer
        entry.last_seen = self._clock.monotonic()
        return entry

    def detach(self, entry: NodeEntry, session: Session) -> None:
        if entry.session is session:
            entry.session = None
            entry.session_lost = True

    def heartbeat(self, entry: NodeEntry, heartbeat: node_pb2.Heartbeat) -> bool:
        """Record a heartbeat (the hot path: no lock, no I/O). True if the node must leave SUSPECT."""
        entry.last_seen = self._clock.monotonic()
        now_ns = self._clock.wall_ns()
        entry.heartbeat = heartbeat
        entry.last_heartbeat_ns = now_ns
        entry.heartbeats += 1
        self.heartbeats_total += 1
        if heartbeat.sent_unix_ns:
            self.lag.add((now_ns - heartbeat.sent_unix_ns) / 1e6)
        return entry.record.state is SUSPECT

    async def recover(self, entry: NodeEntry) -> None:
        """A SUSPECT node was heard from again."""
        async with self._lock:
            current = self._nodes.get(entry.record.name)
            if current is not entry or entry.record.state is not SUSPECT or entry.session is None:
                return
            target = resting_state(entry.record.drain_reason, entry.running_ranks)
            await self._transition([(entry, target, "heartbeat resumed")])

    async def update_inventory(self, entry: NodeEntry, inventory: common_pb2.NodeInventory) -> None:
        async with self._lock:
            if self._nodes.get(entry.record.name) is not entry:
                return
            record = entry.record.replace(inventory=inventory.SerializeToString())
            event = self._event("node.inventory", f"node {record.name}: inventory changed "
                                f"({len(inventory.gpus)} GPUs)", record.name)
            await self._commit([(entry, record)], [event])

    async def agent_event(self, entry: NodeEntry, kind: str, message: str, fields: dict[str, str]) -> None:
        async with self._lock:
            event = self._event(f"agent.{kind}", message, entry.record.name, **fields)
            committed = await self._store.commit(events=[event])
            self._hub.publish(committed.events)

    # -- liveness --------------------------------------------------------------------------

    async def tick(self) -> list[liveness.Change]:
        """One liveness sweep. Decided again under the lock, so a heartbeat that won the race counts."""
        if not self._decide_liveness():
            return []
        async with self._lock:
            changes = self._decide_liveness()
            moves = [(self._nodes[c.name], c.target, c.reason) for c in changes]
            await self._transition(moves)
        for entry, target, reason in moves:
            if target is DOWN and entry.record.state is DOWN and entry.session is not None:
                entry.session.kick(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"node declared DOWN ({reason}); register again")
                entry.session = None
        return changes

    def _decide_liveness(self) -> list[liveness.Change]:
        now = self._clock.monotonic()
        seen = (liveness.Seen(e.record.name, e.record.state, e.last_seen, e.session_lost)
                for e in self._nodes.values())
        changes = liveness.decide(seen, now, self.policy)
        named = {c.name for c in changes}
        changes += [liveness.Change(e.record.name, DRAINED, "no ranks left running")
                    for e in self._nodes.values()
                    if e.record.state is DRAINING and e.record.name not in named
                    and e.session is not None and e.running_ranks == 0]
        return changes

    # -- the operator side -----------------------------------------------------------------

    async def drain(self, name: str, reason: str) -> NodeEntry:
        async with self._lock:
            entry = self.get(name)
            record = entry.record
            target = record.state
            if record.state in (UP, DRAINING, DRAINED):
                target = resting_state(reason, entry.running_ranks)
            new = record.replace(drain_reason=reason)
            events = [self._event("node.drain", f"node {name} drained: {reason}", name, reason=reason)]
            if target is not record.state:
                check_transition(name, record.state, target)
                events.append(self._state_event(name, record.state, target, f"drain: {reason}"))
                new = new.replace(state=target, state_since_ns=self._clock.wall_ns())
            await self._commit([(entry, new)], events)
            return entry

    async def undrain(self, name: str) -> NodeEntry:
        async with self._lock:
            entry = self.get(name)
            record = entry.record
            if not record.drain_reason:
                raise FailedPrecondition(f"node {name} is not drained (state {record.state})")
            new = record.replace(drain_reason="")
            events = [self._event("node.undrain", f"node {name} undrained (was: {record.drain_reason})", name)]
            if record.state in (DRAINING, DRAINED):
                check_transition(name, record.state, UP)
                events.append(self._state_event(name, record.state, UP, "undrain"))
                new = new.replace(state=UP, state_since_ns=self._clock.wall_ns())
            await self._commit([(entry, new)], events)
            return entry

    # -- helpers ---------------------------------------------------------------------------

    async def _transition(self, moves: Iterable[tuple[NodeEntry, NodeState, str]]) -> None:
        """Apply state changes that are still legal and still needed, in one commit. Lock held."""
        now_ns = self._clock.wall_ns()
        writes, events = [], []
        for entry, target, reason in moves:
            if self._nodes.get(entry.record.name) is not entry or entry.record.state is target:
                continue
            check_transition(entry.record.name, entry.record.state, target)
            writes.append((entry, entry.record.replace(state=target, state_since_ns=now_ns)))
            events.append(self._state_event(entry.record.name, entry.record.state, target, reason))
        if writes:
            await self._commit(writes, events)

    async def _commit(self, writes: list[tuple[NodeEntry, NodeRecord]], events: list[EventRecord]) -> None:
        committed = await self._store.commit(nodes=[r for _, r in writes], events=events)
        for (entry, _), record in zip(writes, committed.nodes, strict=True):
            changed = (entry.record.state, entry.record.drain_reason) != (record.state, record.drain_reason)
            entry.record = record
            if changed and entry.session is not None:
                entry.session.push(node_pb2.ControllerMessage(status=node_pb2.NodeStatus(
                    state=record.state.to_proto(), drain_reason=record.drain_reason)))
        for event in committed.events:
            logger.info(event.message, kind=event.kind, node=event.node, fields=event.fields)
        self._hub.publish(committed.events)

    def _event(self, kind: str, message: str, node: str, **fields: str) -> EventRecord:
        return EventRecord(kind=kind, message=message, time_ns=self._clock.wall_ns(), node=node, fields=fields)

    def _state_event(self, node: str, source: NodeState, target: NodeState, reason: str) -> EventRecord:
        return self._event("node.state", f"node {node}: {source} -> {target}: {reason}", node,
                           source=str(source), target=str(target), reason=reason)
