"""The node registry: the controller's authoritative table of nodes, persisted through the store.

Memory changes only after the store has committed, so a failed write loses nothing and is retried
by whatever caused it (the next tick, the next heartbeat, the operator's next command). All writes
go through one lock, in order; the heartbeat path itself takes no lock and does no I/O.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import grpc

from controller import access
from controller.config import HealthConfig, LivenessConfig
from controller.errors import FailedPrecondition, NotFound, Unavailable
from controller.nodes import health, liveness
from controller.nodes.session import Session
from controller.nodes.states import DOWN, DRAINED, DRAINING, SUSPECT, UP, NodeState, check_transition, resting_state
from controller.obs.events import EventHub
from controller.obs.stats import DETECTION_BUCKETS_S, DETECTION_KINDS, LAG_BUCKETS_S, Buckets, LagWindow
from controller.store.base import EventRecord, NodeRecord, Store
from phalanx import log
from phalanx.clock import Clock, to_the_end
from phalanx.v1 import common_pb2, control_pb2, node_pb2

ADMIT_BATCH = 500  # registrations admitted in one store commit at most
# Nodes whose first judge a takeover deferred (Registry.defer_judging), judged this many between two turns of the
# event loop: a node's first judge (8 GPUs' histories started and judged) costs about 190 us, and ten thousand at
# once would hold the heartbeats up for seconds.
JUDGE_BATCH = 50
HELD_BACK_LOGGED_S = 0.5  # a controller this far behind at reading heartbeats says so (at most every 10 s)

logger = log.get("registry")


def inventory_bytes(inventory: common_pb2.NodeInventory) -> bytes:
    """How an inventory is stored: deterministic, so that its CRC-32 (SessionAccepted.inventory_crc32) is the
    agent's own for the same inventory."""
    return inventory.SerializeToString(deterministic=True)


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
    previous_seen: float = 0.0  # monotonic time of the heartbeat before the last one (0: none)
    last_heartbeat_at: float = 0.0  # monotonic time of the last heartbeat; unlike last_seen, only heartbeats set it
    health_digest: int = 0
    judge_deferred: bool = False  # its first heartbeat here is recorded and not judged yet (Registry.defer_judging)
    gpu_health: dict[int, health.GpuHistory] = field(default_factory=dict)
    verdict: health.Verdict = health.Verdict(health.HEALTHY)
    gpu_verdicts: dict[int, health.Verdict] = field(default_factory=dict)
    verdict_logged: health.Health = health.HEALTHY  # the level the event log last heard of
    queued_at: float | None = None  # the key of its entry in the registry's quiet queue (None: not queued)
    lag_floor: float = math.inf  # the lowest heartbeat lag it has shown (creeping up): its clock's offset and link
    # (the stored inventory it was read from, its GPU count, its labels): what placement reads of every node of the
    # fleet at each step that places (gpu_count, labels), parsed once per inventory rather than at each step
    _placed: tuple[bytes, int, dict[str, str]] | None = field(default=None, repr=False, compare=False)

    @property
    def running_ranks(self) -> int:
        return self.heartbeat.running_ranks if self.heartbeat is not None else 0

    def inventory(self) -> common_pb2.NodeInventory:
        return common_pb2.NodeInventory.FromString(self.record.inventory)

    def _placement_facts(self) -> tuple[bytes, int, dict[str, str]]:
        raw = self.record.inventory
        if self._placed is None or self._placed[0] is not raw:
            inventory = common_pb2.NodeInventory.FromString(raw)
            self._placed = (raw, len(inventory.gpus), dict(inventory.labels))
        return self._placed

    def gpu_count(self) -> int:
        """The GPUs its inventory lists."""
        return self._placement_facts()[1]

    def labels(self) -> dict[str, str]:
        """Its inventory's labels (a copy)."""
        return dict(self._placement_facts()[2])

    def health_action_needed(self) -> bool:
        """The verdict changed since the event log heard of it, or it calls for a drain not yet made."""
        return self.verdict.health is not self.verdict_logged or (
            self.verdict.health >= health.FAILING and not self.record.drain_reason)

    def health_proto(self) -> common_pb2.NodeHealth:
        return common_pb2.NodeHealth(
            node=self.record.name, health=self.health_pb(), reasons=self.verdict.reasons,
            gpus=[common_pb2.GpuVerdict(index=i, health=v.health.to_proto(), reasons=v.reasons)
                  for i, v in sorted(self.gpu_verdicts.items())],
            evaluated_unix_ns=self.last_heartbeat_ns)

    def health_pb(self) -> int:
        """Its verdict, or HEALTH_UNSPECIFIED ("-") while a takeover has not judged it yet."""
        return common_pb2.HEALTH_UNSPECIFIED if self.judge_deferred else self.verdict.health.to_proto()

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
            health=self.health_pb(),
        )
        if self.heartbeat is not None:
            node.host.CopyFrom(self.heartbeat.host)
            node.gpus.extend(self.heartbeat.gpus)
        return node


class Registry:
    def __init__(self, store: Store, clock: Clock, policy: LivenessConfig, hub: EventHub,
                 health_cfg: HealthConfig | None = None) -> None:
        self._store = store
        self._clock = clock
        self.policy = policy
        self.health_cfg = health_cfg or HealthConfig()
        self._hub = hub
        self._nodes: dict[str, NodeEntry] = {}
        self._lock = asyncio.Lock()
        self._registering: collections.deque = collections.deque()  # (name, inventory, peer, future) to admit
        self._admitting: asyncio.Task | None = None
        self._admitted_at = float("-inf")  # monotonic time of the last registrations admitted or session resumed
        self._heard: collections.deque = collections.deque()  # (entry, future): SUSPECT nodes heard from again
        self._resuming: asyncio.Task | None = None
        self.resumed_total = 0  # sessions resumed without registering again (agent/link.py)
        self._resumes_unlogged = 0
        self._resume_logged_at = float("-inf")
        self._resume_last = ("", "")  # (node, peer) of the newest resume
        # Nodes whose verdict time alone may still change (a rate or an XID in the window, a verdict not HEALTHY):
        # the only ones health_tick looks at. A node joins with each new GPU signal and leaves once it is quiet
        # and HEALTHY; looking at every GPU of 10,000 nodes each second took ~90 ms of the event loop.
        self._judging: set[str] = set()
        self._deferring = False  # a takeover's take-up: first judges wait (defer_judging)
        self._unheard: set[str] = set()  # nodes in session with this process that have sent no heartbeat yet
        self._deferred: collections.deque[NodeEntry] = collections.deque()
        self._judging_deferred: asyncio.Task | None = None
        # The liveness sweep runs ten times a second; looking at every node each time cost about 13 us per node-second
        # (a tenth of the controller's CPU at 10,000 nodes). It looks at two small sets instead. Every node that may
        # need a change is in one of them: `_quiet` queues the nodes by the last time they were heard from, as of
        # when they were queued (a heartbeat only moves `last_seen`; the node is queued again with the newer time
        # when its old entry comes up), and `_watched` holds the nodes looked at on every sweep until nothing calls
        # for it any more: silent, session lost, SUSPECT or DRAINING. A DOWN node leaves both: only a registration,
        # which makes a new entry, brings it back.
        self._quiet: list[tuple[float, int, NodeEntry]] = []
        self._queued = itertools.count()  # ties in the queue go in order, never to comparing entries
        self._watched: dict[str, NodeEntry] = {}
        self.backlog = liveness.Backlog(policy.tick_s, policy.heartbeat_interval_s, policy.down_after_s)
        self._held_logged = float("-inf")
        self.epoch = 0  # the leadership epoch (controller/ha.py); 0 without election
        self.leading: Callable[[], bool] = lambda: True  # whether this controller may act (its lease holds)
        self.lag = LagWindow()
        self.heartbeats_total = 0
        # Goes up at every change of what placement sees of a node (its record, session, health verdict, a judge
        # deferred or not, a node registered): the scheduler's look at the fleet holds until it does (executor)
        self.changes = 0
        self.lag_seconds = Buckets(LAG_BUCKETS_S)
        self.detection = {kind: Buckets(DETECTION_BUCKETS_S) for kind in DETECTION_KINDS}  # see controller.obs.metrics

    async def load(self, grace_s: float = 0.0) -> None:
        """Read every node from the store. Nodes get a full liveness window to reconnect, and `grace_s` more
        (a takeover: agents first have to notice that the old leader is gone)."""
        now = self._clock.monotonic() + grace_s
        for record in await self._store.load_nodes():
            self._nodes[record.name] = entry = NodeEntry(record=record, last_seen=now)
            self._track(entry)
        logger.info("registry loaded", nodes=len(self._nodes))

    @property
    def clock(self) -> Clock:
        """The controller's clock (sessions' command deadlines wait on it too)."""
        return self._clock

    def get(self, name: str) -> NodeEntry:
        try:
            return self._nodes[name]
        except KeyError:
            raise NotFound(f"no node named {name!r}; `phalanx nodes` lists the known ones") from None

    def find(self, name: str) -> NodeEntry | None:
        """Node `name`'s entry, or None where none is known."""
        return self._nodes.get(name)

    def entries_by_name(self) -> dict[str, NodeEntry]:
        return dict(self._nodes)

    def kick(self, name: str, code: grpc.StatusCode, message: str) -> bool:
        """End node `name`'s session now, if it has one (its agent sees `code` and `message`)."""
        entry = self._nodes.get(name)
        if entry is None or entry.session is None:
            return False
        entry.session.kick(code, message)
        return True

    def entries(self) -> list[NodeEntry]:
        return [self._nodes[name] for name in sorted(self._nodes)]

    @property
    def sessions(self) -> int:
        return sum(1 for e in self._nodes.values() if e.session is not None)

    # -- the agent side ----------------------------------------------------------------------

    async def register(self, name: str, inventory: common_pb2.NodeInventory, peer: str) -> NodeEntry:
        """Admit a node (a new one, or one coming back: a new incarnation). Registrations are admitted in batches,
        one store commit each: after a controller restart or a takeover every agent registers at once, and one
        commit per node, one at a time, would keep thousands waiting for seconds. A known node's silence counts
        from the moment its registration arrives, not from when it is admitted."""
        entry = self._nodes.get(name)
        if entry is not None:
            entry.last_seen = max(entry.last_seen, self._clock.monotonic())
        future: asyncio.Future[NodeEntry] = asyncio.get_running_loop().create_future()
        self._registering.append((name, inventory, peer, future))
        if self._admitting is None or self._admitting.done():
            self._admitting = asyncio.get_running_loop().create_task(self._admit())
        return await future

    async def _admit(self) -> None:
        while self._registering:
            batch, names = [], set()
            while self._registering and len(batch) < ADMIT_BATCH and self._registering[0][0] not in names:
                item = self._registering.popleft()
                if not item[3].done():  # its caller gave up (cancelled)
                    batch.append(item)
                    names.add(item[0])
            if not batch:
                continue
            try:
                async with self._lock:
                    entries = await self._register_batch(batch)
            except Exception as e:
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            self._admitted_at = self._clock.monotonic()
            for (*_, future), entry in zip(batch, entries, strict=True):
                if not future.done():
                    future.set_result(entry)
            await self._clock.sleep(0)  # heartbeats and sessions waiting on the loop go first, then the next batch

    async def _register_batch(self, batch: list) -> list[NodeEntry]:
        """One commit for a batch of registrations of different nodes. Lock held."""
        now_ns = self._clock.wall_ns()
        records, events = [], []
        for name, inventory, peer, _ in batch:
            entry = self._nodes.get(name)
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
            record = record.replace(incarnation=record.incarnation + 1, inventory=inventory_bytes(inventory))
            events.append(self._event("node.registered", f"node {name} registered from {peer} "
                                      f"(incarnation {record.incarnation}, {len(inventory.gpus)} GPUs)", name,
                                      peer=peer, incarnation=str(record.incarnation)))
            records.append(record)
        committed = await self._store.commit(nodes=records, events=events)
        # silence counts from when the registration was committed, not from before the fsync
        now = self._clock.monotonic()
        entries = []
        for (name, _, peer, _), record in zip(batch, committed.nodes, strict=True):
            old = self._nodes.get(name)
            if old is not None and old.session is not None:
                old.session.kick(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"superseded by a new registration of {name} from {peer}")
            entry = NodeEntry(record=record, last_seen=now, peer=peer)
            self._nodes[name] = entry
            self.changes += 1
            self._track(entry)
            entries.append(entry)
        if len(batch) == 1:
            logger.info("node registered", node=batch[0][0], peer=batch[0][2],
                        incarnation=entries[0].record.incarnation, state=str(entries[0].record.state))
        else:  # a storm of them (a restart, a takeover): one line per batch, each node in the event log
            logger.info("nodes registered", count=len(batch), first=batch[0][0], last=batch[-1][0],
                        waiting=len(self._registering))
        self._hub.publish(committed.events)
        return entries

    def in_session(self, name: str) -> bool:
        """The node has a session with this controller that has not ended."""
        entry = self._nodes.get(name)
        return entry is not None and entry.session is not None and not entry.session.closed.is_set()

    def attach(self, name: str, incarnation: int, session: Session) -> NodeEntry:
        entry = self._nodes.get(name)
        if entry is None:
            raise FailedPrecondition(f"node {name!r} is not registered; call Register first")
        if incarnation != entry.record.incarnation:
            raise FailedPrecondition(f"node {name!r}: incarnation {incarnation} is stale (current "
                                     f"{entry.record.incarnation}); register again")
        if entry.record.state is DOWN:
            raise FailedPrecondition(f"node {name!r} is DOWN; register again")
        if not self.leading():  # a deposed leader that has not stood by yet: it could commit nothing for the node
            raise Unavailable("this controller's leadership has lapsed; the agent should find the new leader")
        if entry.session is not None and entry.session is not session:
            entry.session.kick(grpc.StatusCode.FAILED_PRECONDITION, "replaced by a newer session")
        now = self._clock.monotonic()
        if entry.heartbeats == 0 and not entry.session_lost:  # the node's first session with this process (a
            self._admitted_at = now  # flapping one does not count): others coming back wait their turn
        if entry.session_lost or not entry.peer:  # not just registered: the agent resumed its session
            self._resumed(name, session.peer, now)
        if entry.heartbeats == 0:
            self._unheard.add(name)
        entry.session = session
        self.changes += 1
        entry.session_lost = False
        entry.peer = session.peer
        entry.last_seen = now
        if entry.queued_at is not None and entry.queued_at > now:  # loaded with a takeover's grace: silence counts
            self._queue(entry)  # from now (the queue's older entry is let go when it comes up)
        return entry

    def _resumed(self, name: str, peer: str, now: float) -> None:
        """Count a resumed session; log at most a line a second (after a takeover thousands resume at once)."""
        self.resumed_total += 1
        self._resumes_unlogged += 1
        self._resume_last = (name, peer)
        if now - self._resume_logged_at >= 1.0:
            self._log_resumes()

    def _log_resumes(self) -> None:
        name, peer = self._resume_last
        if self._resumes_unlogged == 1:
            logger.info("session resumed", node=name, peer=peer)
        else:
            logger.info("sessions resumed", count=self._resumes_unlogged, last=name)
        self._resume_logged_at, self._resumes_unlogged = self._clock.monotonic(), 0

    def detach(self, entry: NodeEntry, session: Session) -> None:
        if entry.session is session:
            entry.session = None
            self.changes += 1
            entry.session_lost = True
            self._forget_unheard(entry)
            self._watch(entry)

    def _forget_unheard(self, entry: NodeEntry) -> None:
        if self._nodes.get(entry.record.name) is entry:  # not a replaced entry's: the new one's may be unheard
            self._unheard.discard(entry.record.name)

    def unheard(self) -> int:
        """Nodes in session with this process that have not sent a heartbeat yet (a takeover paces itself by them:
        sessions taken up faster than their agents answer would be found silent)."""
        return len(self._unheard)

    def heartbeat(self, entry: NodeEntry, heartbeat: node_pb2.Heartbeat) -> bool:
        """Record a heartbeat (the hot path: no lock, no I/O). True if `settle` must follow: the node
        must leave SUSPECT, or its health verdict changed."""
        now = self._clock.monotonic()
        if entry.judge_deferred and heartbeat.health_digest != entry.health_digest:
            self._undefer(entry)  # a signal changed: judged now, from the heartbeat deferred (the rates' baseline)
        # The GPU counters' rates start from the previous heartbeat, not from a registration or a resumed session:
        # errors counted while a session was down must not look as if they all came in the last second.
        entry.previous_seen, entry.last_heartbeat_at, entry.last_seen = entry.last_heartbeat_at, now, now
        now_ns = self._clock.wall_ns()
        entry.heartbeat = heartbeat
        entry.last_heartbeat_ns = now_ns
        if not entry.heartbeats:
            self._forget_unheard(entry)
        entry.heartbeats += 1
        self.heartbeats_total += 1
        if heartbeat.sent_unix_ns:
            lag_s = (now_ns - heartbeat.sent_unix_ns) / 1e9
            self.lag.add(lag_s * 1e3)
            self.lag_seconds.observe(lag_s if lag_s > 0 else 0.0)  # below 0: the hosts' clocks disagree
            floor = entry.lag_floor + liveness.LAG_FLOOR_CREEP_S
            if lag_s < floor:
                floor = lag_s
            entry.lag_floor = floor
            self.backlog.heard(now, lag_s - floor)
        if (heartbeat.health_digest != entry.health_digest or not entry.gpu_health) and not entry.judge_deferred:
            entry.health_digest = heartbeat.health_digest
            # its first here; a drained node is judged at once (an operator may be about to undrain it)
            if self._deferring and entry.heartbeats == 1 and heartbeat.health_digest and not entry.record.drain_reason:
                entry.judge_deferred = True  # judged once the take-up is over (judge_deferred), or at a change
                self.changes += 1
                self._deferred.append(entry)
                return entry.record.state is SUSPECT
            self._judging.add(entry.record.name)
            window = self.health_cfg.window_s
            for gpu in heartbeat.gpus:
                entry.gpu_health.setdefault(gpu.index, health.GpuHistory()).observe(gpu, now, entry.previous_seen,
                                                                                    window)
            before = entry.verdict.health
            self._evaluate(entry, now)
            if entry.verdict.health > before and heartbeat.sent_unix_ns:
                self.detection["health"].observe(max(now_ns - heartbeat.sent_unix_ns, 0) / 1e9)
        return entry.record.state is SUSPECT or entry.health_action_needed()

    # -- a takeover's first judges ------------------------------------------------------------

    def defer_judging(self) -> None:
        """A new leader is taking sessions up (controller/api/node_service.py, ParkedSessions): a node's first
        heartbeat here is recorded and its health judged later, once every session is back (`judge_deferred`),
        unless its health signals change or it reports an XID first. The verdict of a node whose signals have
        not changed waits a few seconds; the sessions and the heartbeats of the nodes already back do not."""
        self._deferring = True

    def judge_deferred(self, after_s: float = 0.0) -> None:
        """The take-up is over: `after_s` from now (the first heartbeats of the sessions taken up last are still on
        their way for an interval) first judges are made as they come again, and the nodes whose first judge was
        deferred are judged, JUDGE_BATCH at a time."""
        if self._judging_deferred is None or self._judging_deferred.done():
            self._judging_deferred = asyncio.get_running_loop().create_task(self._judge_deferred(after_s),
                                                                            name="judge-deferred")

    async def _judge_deferred(self, after_s: float) -> None:
        await self._clock.sleep(after_s)
        self._deferring = False
        judged = 0
        try:
            while self._deferred and self.leading():  # a deposed leader leaves them to the next one
                now = self._clock.monotonic()
                acting = []
                for _ in range(min(JUDGE_BATCH, len(self._deferred))):
                    entry = self._deferred.popleft()
                    if entry.judge_deferred and self._nodes.get(entry.record.name) is entry:
                        self._undefer(entry)
                        self._evaluate(entry, now)
                        judged += 1
                        if entry.health_action_needed():
                            acting.append(entry)
                for entry in acting:
                    try:
                        await self.settle(entry)
                    except Exception as e:  # a failed commit: health_tick tries again (the node is in _judging)
                        logger.warning("could not act on a node's health", node=entry.record.name, error=str(e))
                await self._clock.sleep(0)  # the heartbeats waiting on the loop go first
        finally:
            while self._deferred and self.leading():  # an error above: none stays unjudged for want of this task
                self._undefer(self._deferred.popleft())  # (health_tick judges it: _undefer puts it in _judging)
        if judged:
            logger.info("judged the health of the nodes taken up", nodes=judged)

    def _undefer(self, entry: NodeEntry) -> None:
        """Start the histories of a node whose first judge was deferred, from the heartbeat deferred."""
        if not entry.judge_deferred:
            return
        entry.judge_deferred = False
        self.changes += 1
        self._judging.add(entry.record.name)
        if entry.heartbeat is not None:
            at, window = entry.last_heartbeat_at, self.health_cfg.window_s
            for gpu in entry.heartbeat.gpus:
                entry.gpu_health.setdefault(gpu.index, health.GpuHistory()).observe(gpu, at, at, window)

    async def settle(self, entry: NodeEntry) -> None:
        """What a heartbeat calls for beyond recording it: leave SUSPECT, act on a health verdict."""
        if entry.record.state is SUSPECT and entry.session is not None:
            await self._resume_heard(entry)
        if entry.health_action_needed():
            async with self._lock:
                if self._nodes.get(entry.record.name) is entry:
                    await self._act_on_health(entry)

    async def _resume_heard(self, entry: NodeEntry) -> None:
        """Take a SUSPECT node that was heard from again back to its resting state. Those heard from together go in
        one commit: a new leader may find thousands SUSPECT in the store (the old one's last word), and one commit
        each, one at a time under the lock, took it 40 s at 10,000 nodes, with the liveness sweep waiting its turn."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._heard.append((entry, future))
        if self._resuming is None or self._resuming.done():
            self._resuming = asyncio.get_running_loop().create_task(self._resume_batches())
        await future

    async def _resume_batches(self) -> None:
        while self._heard:
            batch = [self._heard.popleft() for _ in range(min(ADMIT_BATCH, len(self._heard)))]
            try:
                async with self._lock:
                    moves, seen = [], set()
                    for entry, _ in batch:
                        if entry.record.state is SUSPECT and entry.session is not None and id(entry) not in seen:
                            seen.add(id(entry))
                            moves.append((entry, resting_state(entry.record.drain_reason, entry.running_ranks),
                                          "heartbeat resumed"))
                    await self._transition(moves)
            except Exception as e:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for _, future in batch:
                if not future.done():
                    future.set_result(None)
            await self._clock.sleep(0)  # heartbeats waiting on the loop go first, then the next batch

    # -- GPU health --------------------------------------------------------------------------

    def _evaluate(self, entry: NodeEntry, now: float) -> None:
        host = entry.heartbeat.host if entry.heartbeat is not None else None
        before = entry.verdict.health
        entry.verdict, entry.gpu_verdicts = health.evaluate_node(entry.gpu_health, host, now, self.health_cfg)
        if entry.verdict.health is not before:
            self.changes += 1

    async def gpu_event(self, entry: NodeEntry, event: common_pb2.GpuEvent) -> None:
        """An XID from the node: logged, judged and acted on at once, not at the next heartbeat."""
        now = self._clock.monotonic()
        async with self._lock:
            if self._nodes.get(entry.record.name) is not entry:
                return
            self._undefer(entry)
            entry.gpu_health.setdefault(event.gpu_index, health.GpuHistory()).record_xid(
                event.xid, now, self.health_cfg.window_s)
            name = entry.record.name
            self._judging.add(name)
            logged = self._event("gpu.xid", f"node {name} GPU {event.gpu_index}: XID {event.xid}"
                                 f"{': ' + event.message if event.message else ''}", name,
                                 gpu=str(event.gpu_index), xid=str(event.xid))
            committed = await self._store.commit(events=[logged])
            self._hub.publish(committed.events)
            self._evaluate(entry, now)
            await self._act_on_health(entry)
        if event.time_unix_ns:
            self.detection["xid"].observe(max(self._clock.wall_ns() - event.time_unix_ns, 0) / 1e9)

    async def health_tick(self) -> None:
        """Re-judge nodes whose verdict time alone can change (rates leaving the window, recent XIDs)."""
        now = self._clock.monotonic()
        window = self.health_cfg.window_s
        for name in list(self._judging):
            entry = self._nodes.get(name)
            if entry is None or (entry.verdict.health is health.HEALTHY and entry.verdict_logged is health.HEALTHY
                                 and all(h.is_quiet(now, window) for h in entry.gpu_health.values())):
                self._judging.discard(name)
                continue
            self._evaluate(entry, now)
            if entry.health_action_needed():
                async with self._lock:
                    if self._nodes.get(entry.record.name) is entry:
                        await self._act_on_health(entry)

    async def _act_on_health(self, entry: NodeEntry) -> None:
        """Log a changed verdict; take a FAILING or FAILED node out of service. Lock held."""
        if not entry.health_action_needed():
            return
        verdict, name, record = entry.verdict, entry.record.name, entry.record
        why = verdict.reasons[0] if verdict.reasons else "no findings"
        events, writes = [], []
        if verdict.health is not entry.verdict_logged:
            events.append(self._event("node.health", f"node {name}: {entry.verdict_logged} -> {verdict.health}: "
                                      f"{why}", name, source=str(entry.verdict_logged), target=str(verdict.health),
                                      reason=why))
        if verdict.health >= health.FAILING and not record.drain_reason:
            new, drain_events = self._drained(entry, f"health {verdict.health}: {why}")
            writes.append((entry, new))
            events += drain_events
        await self._commit(writes, events)
        entry.verdict_logged = verdict.health
        if entry.session is not None:
            entry.session.push(node_pb2.ControllerMessage(status=node_pb2.NodeStatus(
                state=entry.record.state.to_proto(), drain_reason=entry.record.drain_reason,
                health=entry.health_proto())))

    async def update_inventory(self, entry: NodeEntry, inventory: common_pb2.NodeInventory) -> None:
        async with self._lock:
            if self._nodes.get(entry.record.name) is not entry:
                return
            record = entry.record.replace(inventory=inventory_bytes(inventory))
            event = self._event("node.inventory", f"node {record.name}: inventory changed "
                                f"({len(inventory.gpus)} GPUs)", record.name)
            await self._commit([(entry, record)], [event])

    async def agent_event(self, entry: NodeEntry, kind: str, message: str, fields: dict[str, str],
                          job: str = "") -> None:
        """Log a node's own event; with `job` (one the node has a part in), under that job too: `events --job`."""
        async with self._lock:
            event = self._event(f"agent.{kind}", message, entry.record.name, **fields)
            if job:
                event = replace(event, job=job)
            committed = await self._store.commit(events=[event])
            self._hub.publish(committed.events)

    # -- liveness --------------------------------------------------------------------------

    async def tick(self) -> list[liveness.Change]:
        """One liveness sweep. Decided again under the lock, so a heartbeat that won the race counts."""
        now = self._clock.monotonic()
        if self._resumes_unlogged and now - self._resume_logged_at >= 1.0:
            self._log_resumes()  # the end of a burst: its count since the last line
        behind = self.backlog.sweep(now)  # (its stalls: from the end of the last sweep, not counting its lock waits)
        if behind >= HELD_BACK_LOGGED_S and now - self._held_logged >= 10.0:
            self._held_logged = now
            logger.warning("liveness held back", behind_s=round(behind, 2),
                           detail="this controller is behind at reading heartbeats: that much silence is its own, "
                                  "not the nodes', and is not counted against them")
        if not self._decide_liveness(behind):
            self.backlog.swept(now)
            return []
        async with self._lock:
            changes = self._decide_liveness(behind)
            moves = [(self._nodes[c.name], c.target, c.reason) for c in changes]
            await self._transition(moves)
        now = self._clock.monotonic()
        for entry, target, reason in moves:
            if target is DOWN and entry.record.state is DOWN and entry.heartbeats:  # heard from by this process
                self.detection["node_down"].observe(now - entry.last_seen)
            if target is DOWN and entry.record.state is DOWN and entry.session is not None:
                entry.session.kick(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"node declared DOWN ({reason}); register again")
                entry.session = None
                self.changes += 1
                self._forget_unheard(entry)
        self.backlog.swept(now)
        return changes

    def _decide_liveness(self, behind: float = 0.0) -> list[liveness.Change]:
        """The changes liveness calls for now, not counting the last `behind` seconds of silence (Backlog)."""
        now = self._clock.monotonic()
        quiet_since = now - behind - self.policy.suspect_after_s
        # After a restart or a takeover every agent comes back at once, and admitting thousands takes this
        # controller seconds: while registrations keep being admitted, a node not yet back (loaded from the store,
        # or registered and still opening its session: no heartbeat yet) is waiting its turn, not dead. Once the
        # admissions pause for suspect_after_s, the silent ones are judged as any other.
        storm = now - self._admitted_at < self.policy.suspect_after_s
        quiet = self._quiet
        while quiet and quiet[0][0] <= quiet_since:
            queued_at, _, e = heapq.heappop(quiet)
            if e.queued_at != queued_at or self._nodes.get(e.record.name) is not e:
                continue  # queued again since (its older entry), or replaced by a new registration
            e.queued_at = None
            if e.last_seen > quiet_since:
                self._queue(e)  # heard from since it was queued
            else:
                self._watched[e.record.name] = e
        seen, draining = [], []
        for name, e in list(self._watched.items()):
            state = e.record.state
            silent = e.last_seen <= quiet_since
            if self._nodes.get(name) is not e or state is DOWN:
                del self._watched[name]
                continue
            if (silent or e.session_lost or state is SUSPECT) and not (storm and e.heartbeats == 0):
                seen.append(liveness.Seen(name, state, e.last_seen, e.session_lost))
            # no heartbeat yet (a restart, a takeover) is not "no ranks running": DRAINED says the node may go down
            if state is DRAINING and e.session is not None and e.heartbeat is not None and e.running_ranks == 0:
                draining.append(name)
            if not (silent or e.session_lost or state is SUSPECT or state is DRAINING):
                del self._watched[name]  # nothing calls for a look at every sweep: back in the queue
                if e.queued_at is None:
                    self._queue(e)
        changes = liveness.decide(seen, now, self.policy, behind) if seen else []
        if draining:
            named = {c.name for c in changes}
            changes += [liveness.Change(name, DRAINED, "no ranks left running") for name in draining
                        if name not in named]
        return changes

    def _track(self, entry: NodeEntry) -> None:
        """Put a new entry where the liveness sweep will find it."""
        self._queue(entry)
        if entry.record.state is SUSPECT or entry.record.state is DRAINING:
            self._watch(entry)

    def _watch(self, entry: NodeEntry) -> None:
        """Look at `entry` on every sweep, if it is still the node's entry: the session of an entry a registration
        replaced may end after the new one is watched, and must not take its place."""
        if self._nodes.get(entry.record.name) is entry:
            self._watched[entry.record.name] = entry

    def _queue(self, entry: NodeEntry) -> None:
        """Queue `entry` for the liveness sweep as last heard from at `entry.last_seen`."""
        entry.queued_at = entry.last_seen
        heapq.heappush(self._quiet, (entry.last_seen, next(self._queued), entry))

    # -- the operator side -----------------------------------------------------------------

    async def drain(self, name: str, reason: str) -> NodeEntry:
        async with self._lock:
            entry = self.get(name)
            new, events = self._drained(entry, reason)
            await self._commit([(entry, new)], events)
            return entry

    def _drained(self, entry: NodeEntry, reason: str) -> tuple[NodeRecord, list[EventRecord]]:
        """The record and events of draining `entry` for `reason` (not yet committed)."""
        record, name = entry.record, entry.record.name
        target = record.state
        if record.state in (UP, DRAINING):  # a DRAINED node stays so: drained again, it only takes the new reason
            target = resting_state(reason, entry.running_ranks)
        new = record.replace(drain_reason=reason)
        events = [self._event("node.drain", f"node {name} drained: {reason}", name, reason=reason)]
        if target is not record.state:
            check_transition(name, record.state, target)
            events.append(self._state_event(name, record.state, target, f"drain: {reason}"))
            new = new.replace(state=target, state_since_ns=self._clock.wall_ns())
        return new, events

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
            # Undrain says "fixed": forget past XIDs and counter movements. A fault still there drains it again.
            self._undefer(entry)
            for history in entry.gpu_health.values():
                history.forget()
            # and what is found next is news, logged as such: a fault still there is a node.health event again
            # (without this, whether the log said so hung on which heartbeat the next verdict came from)
            entry.verdict_logged = health.HEALTHY
            self._judging.add(name)
            with access.acting(""):  # a drain for a fault still there is the health policy's, not the operator's
                self._evaluate(entry, self._clock.monotonic())
                await self._act_on_health(entry)
            return entry

    # -- helpers ---------------------------------------------------------------------------

    async def _transition(self, moves: Iterable[tuple[NodeEntry, NodeState, str]]) -> None:
        """Apply state changes that are still legal and still needed, in commits of at most ADMIT_BATCH nodes (a
        fleet cut off at once is 10,000 changes: more than one etcd transaction holds). Lock held."""
        now_ns = self._clock.wall_ns()
        writes, events = [], []
        for entry, target, reason in moves:
            if self._nodes.get(entry.record.name) is not entry or entry.record.state is target:
                continue
            check_transition(entry.record.name, entry.record.state, target)
            writes.append((entry, entry.record.replace(state=target, state_since_ns=now_ns)))
            events.append(self._state_event(entry.record.name, entry.record.state, target, reason))
        for i in range(0, len(writes), ADMIT_BATCH):
            await self._commit(writes[i:i + ADMIT_BATCH], events[i:i + ADMIT_BATCH])

    async def _commit(self, writes: list[tuple[NodeEntry, NodeRecord]], events: list[EventRecord]) -> None:
        """Commit, and memory follows: to the end, the lock held, even if the caller (an RPC) is cancelled meanwhile
        (memory left at the replaced records' revisions would fail every later commit of those nodes)."""
        await to_the_end(self._commit_now(writes, events))

    async def _commit_now(self, writes: list[tuple[NodeEntry, NodeRecord]], events: list[EventRecord]) -> None:
        committed = await self._store.commit(nodes=[r for _, r in writes], events=events)
        self.changes += 1  # (a state, a drain, an inventory)
        for (entry, _), record in zip(writes, committed.nodes, strict=True):
            changed = (entry.record.state, entry.record.drain_reason) != (record.state, record.drain_reason)
            was, entry.record = entry.record.state, record
            if record.state is SUSPECT or record.state is DRAINING:
                self._watch(entry)
            elif was is DOWN and record.state is not DOWN and entry.queued_at is None:
                self._queue(entry)  # liveness let it go when it went DOWN
            if changed and entry.session is not None:
                entry.session.push(node_pb2.ControllerMessage(status=node_pb2.NodeStatus(
                    state=record.state.to_proto(), drain_reason=record.drain_reason, health=entry.health_proto())))
        for event in committed.events:
            logger.info(event.kind.replace(".", " "), kind=event.kind, node=event.node, detail=event.message,
                        fields=event.fields)
        self._hub.publish(committed.events)

    def _event(self, kind: str, message: str, node: str, /, **fields: str) -> EventRecord:
        """An event of this node; `fields` are free-form (positional-only parameters: a field may be named `kind`)."""
        return EventRecord(kind=kind, message=message, time_ns=self._clock.wall_ns(), node=node,
                           fields={**fields, **access.by(kind)})

    def _state_event(self, node: str, source: NodeState, target: NodeState, reason: str) -> EventRecord:
        return self._event("node.state", f"node {node}: {source} -> {target}: {reason}", node,
                           source=str(source), target=str(target), reason=reason)
