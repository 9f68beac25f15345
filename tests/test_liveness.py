"""Liveness decisions and the registry under a fake clock: no sleeps, virtual time only."""

import asyncio

import pytest

from controller.config import LivenessConfig
from controller.errors import FailedPrecondition, NotFound, Unavailable
from controller.nodes.liveness import Change, Seen, decide
from controller.nodes.registry import Registry
from controller.nodes.session import Session
from controller.nodes.states import DOWN, DRAINED, DRAINING, SUSPECT, UP
from controller.obs.events import EventHub
from controller.store.memory import MemoryStore
from phalanx.clock import FakeClock
from phalanx.v1 import common_pb2, node_pb2

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

POLICY = LivenessConfig()  # 1 s heartbeats, SUSPECT after 2 s, DOWN after 3 s


def test_decide_thresholds():
    now = 100.0
    nodes = [
        Seen("fresh", UP, now - 0.5, False),
        Seen("late", UP, now - 2.0, False),
        Seen("silent", UP, now - 3.0, False),
        Seen("suspect-silent", SUSPECT, now - 3.5, False),
        Seen("already-down", DOWN, now - 100, False),
        Seen("drained-late", DRAINED, now - 2.5, False),
        Seen("lost", UP, now - 0.1, True),
    ]
    assert decide(nodes, now, POLICY) == [
        Change("late", SUSPECT, "no heartbeat for 2.0s"),
        Change("silent", DOWN, "no heartbeat for 3.0s (limit 3s)"),
        Change("suspect-silent", DOWN, "no heartbeat for 3.5s (limit 3s)"),
        Change("drained-late", SUSPECT, "no heartbeat for 2.5s"),
        Change("lost", SUSPECT, "session lost"),
    ]


def test_decide_respects_configured_thresholds():
    policy = LivenessConfig(heartbeat_interval_s=5, suspect_after_s=10, down_after_s=30, tick_s=1)
    assert decide([Seen("n", UP, 0.0, False)], 9.9, policy) == []
    assert decide([Seen("n", UP, 0.0, False)], 29.9, policy)[0].target is SUSPECT
    assert decide([Seen("n", SUSPECT, 0.0, False)], 30.0, policy)[0].target is DOWN


def inventory(gpus: int = 2) -> common_pb2.NodeInventory:
    return common_pb2.NodeInventory(hostname="h", gpu_backend=common_pb2.GPU_BACKEND_KIND_SIM,
                                    gpus=[common_pb2.GpuInfo(index=i) for i in range(gpus)])


class World:
    def __init__(self, store=None):
        self.clock = FakeClock()
        self.store = store or MemoryStore()
        self.hub = EventHub()
        self.registry = Registry(self.store, self.clock, POLICY, self.hub)

    async def join(self, name: str):
        entry = await self.registry.register(name, inventory(), "ipv4:127.0.0.1:1")
        session = Session("ipv4:127.0.0.1:1")
        self.registry.attach(name, entry.record.incarnation, session)
        return entry, session

    async def beat(self, entry, ranks: int = 0):
        if self.registry.heartbeat(entry, node_pb2.Heartbeat(running_ranks=ranks)):
            await self.registry.settle(entry)

    async def advance(self, seconds: float, step: float = 0.1):
        """Move virtual time, ticking liveness the way the controller's loop does."""
        start, steps = self.clock.monotonic(), round(seconds / step)
        for k in range(1, steps + 1):
            self.clock.advance(start + seconds * k / steps - self.clock.monotonic())
            await self.registry.tick()

    def state(self, name):
        return self.registry.get(name).record.state

    async def kinds(self):
        return [(e.kind, e.fields.get("target")) for e in await self.store.list_events()]


def run(coro):
    return asyncio.run(coro)


def test_silent_node_goes_suspect_then_down_then_recovers_on_register():
    async def go():
        w = World()
        entry, session = await w.join("n1")
        assert w.state("n1") is UP
        await w.advance(1.9)
        assert w.state("n1") is UP
        await w.advance(0.2)
        assert w.state("n1") is SUSPECT
        await w.advance(0.9)
        assert w.state("n1") is DOWN
        assert session.closed.is_set() and "DOWN" in session.close_message
        # The stale session cannot come back; the agent must register again.
        with pytest.raises(FailedPrecondition):
            w.registry.attach("n1", entry.record.incarnation, Session("p"))
        entry2, _ = await w.join("n1")
        assert entry2.record.incarnation == entry.record.incarnation + 1
        assert w.state("n1") is UP
        assert ("node.state", "DOWN") in await w.kinds()
    run(go())


def test_heartbeats_keep_a_node_up_and_a_late_one_recovers_from_suspect():
    async def go():
        w = World()
        entry, _ = await w.join("n1")
        for _ in range(10):
            await w.advance(1.0)
            await w.beat(entry)
        assert w.state("n1") is UP
        await w.advance(2.5)
        assert w.state("n1") is SUSPECT
        await w.beat(entry)
        assert w.state("n1") is UP
        await w.advance(2.9)  # silence counts from the last heartbeat, not from SUSPECT
        assert w.state("n1") is SUSPECT
        await w.advance(0.1)
        assert w.state("n1") is DOWN
    run(go())


def test_lost_session_is_suspect_at_once_and_down_after_the_silence_limit():
    async def go():
        w = World()
        entry, session = await w.join("n1")
        await w.beat(entry)
        w.registry.detach(entry, session)
        await w.advance(0.1)
        assert w.state("n1") is SUSPECT
        await w.advance(2.8)
        assert w.state("n1") is SUSPECT
        await w.advance(0.1)
        assert w.state("n1") is DOWN
    run(go())


def test_drain_survives_down_and_reregistration_and_undrain_returns_to_up():
    async def go():
        w = World()
        _entry, _ = await w.join("n1")
        await w.registry.drain("n1", "bad fan")
        assert w.state("n1") is DRAINED
        await w.advance(3.0)
        assert w.state("n1") is DOWN
        assert w.registry.get("n1").record.drain_reason == "bad fan"
        await w.join("n1")
        assert w.state("n1") is DRAINED
        await w.registry.undrain("n1")
        assert w.state("n1") is UP and w.registry.get("n1").record.drain_reason == ""
        with pytest.raises(FailedPrecondition, match="not drained"):
            await w.registry.undrain("n1")
    run(go())


def test_drain_with_running_ranks_waits_in_draining():
    async def go():
        w = World()
        entry, session = await w.join("n1")
        await w.beat(entry, ranks=4)
        await w.registry.drain("n1", "maintenance")
        assert w.state("n1") is DRAINING
        await w.advance(0.5)
        await w.beat(entry, ranks=4)
        await w.advance(0.5)
        assert w.state("n1") is DRAINING
        await w.beat(entry, ranks=0)
        await w.advance(0.1)
        assert w.state("n1") is DRAINED
        # the agent was told each change
        states = []
        while not session.outbox.empty():
            states.append(session.outbox.get_nowait().status.state)
        assert states == [common_pb2.NODE_STATE_DRAINING, common_pb2.NODE_STATE_DRAINED]
    run(go())


def test_a_drained_node_drained_again_while_it_reports_ranks_keeps_its_state_and_takes_the_reason():
    """Found by the RPC fuzzer under load: a DRAINED node whose heartbeat reports running ranks (stale ones being
    fenced) was moved back to DRAINING by a second drain, a transition the state table forbids: INTERNAL."""
    async def go():
        w = World()
        entry, _ = await w.join("n1")
        await w.registry.drain("n1", "bad fan")
        assert w.state("n1") is DRAINED
        await w.beat(entry, ranks=2)
        await w.registry.drain("n1", "bad fan, and a PSU")
        assert w.state("n1") is DRAINED and w.registry.get("n1").record.drain_reason == "bad fan, and a PSU"
    run(go())


def test_drain_unknown_node_is_not_found():
    async def go():
        w = World()
        with pytest.raises(NotFound, match="no node named 'ghost'"):
            await w.registry.drain("ghost", "x")
    run(go())


def test_restart_gives_every_node_a_full_window_to_reconnect():
    async def go():
        store = MemoryStore()
        w = World(store)
        await w.join("n1")
        await w.join("n2")
        await w.registry.drain("n2", "bad fan")
        # a new controller process over the same store, an hour later
        w2 = World(store)
        w2.clock.advance(3600)
        await w2.registry.load()
        assert w2.state("n1") is UP and w2.state("n2") is DRAINED
        await w2.advance(1.9)
        assert w2.state("n1") is UP  # no "session lost": it never had a session with this process
        _entry, _ = await w2.join("n1")
        await w2.advance(1.2)
        assert w2.state("n1") is UP
        # n1 was admitted 1.2 s ago: others may still be waiting their turn; n2 is judged once admissions pause
        assert w2.state("n2") is DRAINED
        await w2.advance(1.0)
        assert w2.state("n2") is DOWN
        assert w2.registry.get("n2").record.drain_reason == "bad fan"
    run(go())


def test_nodes_not_back_yet_are_not_declared_while_others_are_still_being_admitted():
    """A takeover or restart brings every agent back at once; admitting them takes time. A node loaded from the
    store is not judged while registrations keep being admitted; once they pause, it is."""
    async def go():
        store = MemoryStore()
        w = World(store)
        for i in range(6):
            await w.join(f"n{i}")
        w2 = World(store)
        await w2.registry.load()
        back = []

        async def advance(seconds: float) -> None:  # the nodes that are back heartbeat every half second
            for _ in range(round(seconds / 0.5)):
                await w2.advance(0.5)
                for entry in back:
                    await w2.beat(entry)

        for i in range(5):  # one admission every 1.5 s: 7.5 s in all, far past down_after_s
            await advance(1.5)
            back.append((await w2.join(f"n{i}"))[0])
        assert w2.state("n5") is UP  # still waiting its turn, as far as anyone can tell
        await advance(2.5)  # admissions paused for suspect_after_s: n5 is judged
        assert w2.state("n5") in (SUSPECT, DOWN)
        await advance(1.5)
        assert w2.state("n5") is DOWN
        assert all(w2.state(f"n{i}") is UP for i in range(5))
    run(go())


def test_a_node_registered_but_not_yet_heartbeating_waits_its_turn_while_admissions_go_on():
    """In a storm, a node whose Register was admitted but whose session (and first heartbeat) is still on its
    way through a busy controller is not declared; once admissions pause it is judged as any other."""
    async def go():
        store = MemoryStore()
        w = World(store)
        for i in range(5):
            await w.join(f"n{i}")
        w2 = World(store)
        await w2.registry.load()
        await w2.registry.register("n4", inventory(), "ipv4:127.0.0.1:1")  # registered; no session, no heartbeat
        back = []
        for i in range(4):  # one admission every 1.5 s: 6 s in all, far past down_after_s
            for _ in range(3):
                await w2.advance(0.5)
                for entry in back:
                    await w2.beat(entry)
            back.append((await w2.join(f"n{i}"))[0])
        assert w2.state("n4") is UP
        for _ in range(5):  # admissions paused for suspect_after_s, and more: n4 is judged
            await w2.advance(0.5)
            for entry in back:
                await w2.beat(entry)
        assert w2.state("n4") is DOWN
        assert all(w2.state(f"n{i}") is UP for i in range(4))
    run(go())


def test_the_health_tick_rejudges_a_node_as_each_xid_leaves_the_window():
    async def go():
        w = World()
        entry, _ = await w.join("n1")
        await w.registry.gpu_event(entry, common_pb2.GpuEvent(gpu_index=0, xid=63))
        assert entry.verdict.health.name == "DEGRADED"
        w.clock.advance(30)
        await w.registry.health_tick()
        assert entry.verdict.health.name == "DEGRADED"  # XID 63 is still in the 60 s window
        w.clock.advance(31)
        await w.registry.health_tick()
        assert entry.verdict.health.name == "HEALTHY"
        kinds = [(e.kind, e.fields.get("target")) for e in await w.store.list_events() if e.kind == "node.health"]
        assert kinds == [("node.health", "DEGRADED"), ("node.health", "HEALTHY")]
        await w.registry.gpu_event(entry, common_pb2.GpuEvent(gpu_index=1, xid=63))  # a new signal: judged again
        assert entry.verdict.health.name == "DEGRADED"
        w.clock.advance(61)
        await w.registry.health_tick()
        assert entry.verdict.health.name == "HEALTHY"
    run(go())


def test_a_second_registration_supersedes_the_first_session():
    async def go():
        w = World()
        _, first = await w.join("n1")
        _, second = await w.join("n1")
        assert first.closed.is_set() and "superseded" in first.close_message
        assert not second.closed.is_set()
        assert ("node.superseded", None) in await w.kinds()
    run(go())


def test_a_failed_store_write_changes_nothing_and_is_retried():
    class FlakyStore(MemoryStore):
        fail = False

        async def commit(self, **kw):
            if self.fail:
                from controller.errors import StoreError
                raise StoreError("disk full")
            return await super().commit(**kw)

    async def go():
        store = FlakyStore()
        w = World(store)
        await w.join("n1")
        store.fail = True
        w.clock.advance(3.0)
        with pytest.raises(Exception, match="disk full"):
            await w.registry.tick()
        assert w.state("n1") is UP  # memory follows the store, never leads it
        store.fail = False
        await w.registry.tick()
        assert w.state("n1") is DOWN
    run(go())


def test_a_resumed_session_keeps_the_node_and_its_gpu_rates_count_from_the_last_heartbeat():
    """A session that broke and was resumed (same controller, same incarnation): no new registration, and
    errors counted while it was down are spread over the time since the last heartbeat, not put in one second
    (10 corrected ECC errors over 3.5 s are DEGRADED, about 170/min; in one second they would be FAILING)."""
    async def go():
        w = World()
        entry, session = await w.join("n1")

        def beat(sbe: int) -> node_pb2.Heartbeat:
            return node_pb2.Heartbeat(gpus=[common_pb2.GpuTelemetry(index=0, ecc_sbe_volatile=sbe)],
                                      health_digest=sbe + 1)

        w.registry.heartbeat(entry, beat(0))
        w.registry.detach(entry, session)  # the session broke
        await w.advance(2.5)
        assert w.state("n1") is SUSPECT
        incarnation = entry.record.incarnation
        resumed = w.registry.attach("n1", incarnation, Session("ipv4:127.0.0.1:2"))
        assert resumed is entry and w.registry.resumed_total == 1
        w.clock.advance(1.0)
        if w.registry.heartbeat(entry, beat(10)):
            await w.registry.settle(entry)
        assert entry.verdict.health.name == "DEGRADED", entry.verdict.reasons
        assert w.state("n1") is UP and entry.record.incarnation == incarnation
        assert [k for k, _ in await w.kinds()].count("node.registered") == 1
    run(go())


def test_a_deposed_leader_takes_no_session_up_and_leaves_the_current_one_alone():
    async def go():
        w = World()
        entry, session = await w.join("n1")
        w.registry.leading = lambda: False  # its lease lapsed; it has not stood by yet
        with pytest.raises(Unavailable, match="leadership has lapsed"):
            w.registry.attach("n1", entry.record.incarnation, Session("ipv4:127.0.0.1:2"))
        assert entry.session is session and not session.closed.is_set() and w.registry.resumed_total == 0
    run(go())


def test_a_draining_node_that_resumes_after_a_restart_stays_draining_until_a_heartbeat_says_no_ranks():
    """After a restart or a takeover the controller has not heard the node's heartbeat yet: no heartbeat is not
    'no ranks running', and DRAINED (safe to take down) must wait for one that says so."""
    async def go():
        w = World()
        entry, _ = await w.join("n1")
        await w.beat(entry, ranks=4)
        await w.registry.drain("n1", "maintenance")
        again = World(w.store)  # the controller restarted on the same store
        await again.registry.load()
        resumed = again.registry.attach("n1", entry.record.incarnation, Session("ipv4:127.0.0.1:2"))
        await again.advance(0.5)
        assert again.state("n1") is DRAINING
        await again.beat(resumed, ranks=4)
        await again.advance(0.3)
        assert again.state("n1") is DRAINING
        await again.beat(resumed, ranks=0)
        await again.advance(0.1)
        assert again.state("n1") is DRAINED
    run(go())


def full_sweep(registry: Registry, now: float) -> set[Change]:
    """What the liveness sweep must decide, by looking at every node (as it did before it kept an index)."""
    quiet_since = now - POLICY.suspect_after_s
    storm = now - registry._admitted_at < POLICY.suspect_after_s
    seen, draining = [], []
    for e in registry._nodes.values():
        state = e.record.state
        if (e.last_seen <= quiet_since or e.session_lost or state is SUSPECT) and not (storm and e.heartbeats == 0):
            seen.append(Seen(e.record.name, state, e.last_seen, e.session_lost))
        if state is DRAINING and e.session is not None and e.heartbeat is not None and e.running_ranks == 0:
            draining.append(e.record.name)
    changes = decide(seen, now, POLICY)
    named = {c.name for c in changes}
    return set(changes) | {Change(n, DRAINED, "no ranks left running") for n in draining if n not in named}


@pytest.mark.parametrize("seed", range(12))
def test_the_indexed_sweep_decides_what_a_look_at_every_node_would(seed):
    """The sweep looks only at queued and watched nodes; under random joins, heartbeats, lost and resumed sessions,
    drains, undrains, restarts with a takeover's grace and silences, it decides exactly what a full scan does."""
    import random

    async def go():
        rng = random.Random(seed)
        store = MemoryStore()
        w = World(store)
        names = [f"n{i}" for i in range(8)]
        sessions: dict[str, tuple] = {}  # name -> (entry, session) of the open session
        stale: list[tuple] = []  # (entry, session) of sessions a new registration replaced, not yet ended
        checked = 0
        for _ in range(400):
            op = rng.random()
            name = rng.choice(names)
            reg = w.registry
            entry = reg._nodes.get(name)
            if op < 0.15:
                if name in sessions:  # registered again while its session is open: that one ends later
                    stale.append(sessions[name])
                sessions[name] = await w.join(name)
            elif op < 0.18 and stale:
                reg.detach(*stale.pop(rng.randrange(len(stale))))
            elif op < 0.45 and name in sessions and not sessions[name][1].closed.is_set():
                await w.beat(sessions[name][0], ranks=rng.choice([0, 0, 2]))
            elif op < 0.52 and name in sessions:
                reg.detach(*sessions.pop(name))
            elif op < 0.58 and entry is not None and entry.session is None and entry.record.state is not DOWN:
                session = Session("ipv4:127.0.0.1:3")
                sessions[name] = (reg.attach(name, entry.record.incarnation, session), session)
            elif op < 0.63 and entry is not None:
                await reg.drain(name, "maintenance")
            elif op < 0.67 and entry is not None and entry.record.drain_reason:
                await reg.undrain(name)
            elif op < 0.69:  # a new controller on the same store, as after a takeover
                clock = w.clock
                w = World(store)
                w.clock.advance(clock.monotonic() - w.clock.monotonic() + 1.0)
                await w.registry.load(grace_s=rng.choice([0.0, 1.5, 4.0]))
                sessions.clear()
                stale.clear()
            else:
                w.clock.advance(rng.choice([0.1, 0.1, 0.3, 0.7, 1.3]))
            expected = full_sweep(w.registry, w.clock.monotonic())
            assert set(w.registry._decide_liveness()) == expected
            checked += bool(expected)
            await w.registry.tick()
        assert checked > 10  # the walk made the sweep decide something, many times over
    run(go())


def _falling_behind(world: World, entries: dict, silent: str, seconds: float, growth: float,
                    behind_s: float = 0.0, catchup: float = 1.0) -> list:
    """Ten nodes beat once a second, staggered; from now on, for `behind_s`, the controller reads each heartbeat
    later than the one before (its queue grows by `growth` seconds a second), then catches up (the queue shrinks
    by `catchup` seconds a second), and `silent` sends nothing any more. Ticks on time. Returns the node.state
    changes the registry made, as (time since start, name, target)."""
    def delay(since: float) -> float:
        peak = growth * min(since, behind_s)
        return max(0.0, peak - catchup * max(0.0, since - behind_s))

    async def go():
        start, clock = world.clock.monotonic(), world.clock
        sends = sorted((start + k + i / 10, name) for k in range(int(seconds) + 1)
                       for i, name in enumerate(entries) if name != silent)
        arrivals = sorted((sent + delay(sent - start), sent, name) for sent, name in sends)
        made = []
        t = start
        while t < start + seconds:
            t = round(t + 0.1, 6)
            while arrivals and arrivals[0][0] <= t:
                at, sent, name = arrivals.pop(0)
                clock.advance(at - clock.monotonic())
                sent_ns = clock.wall_ns() - int((at - sent) * 1e9)
                if world.registry.heartbeat(entries[name], node_pb2.Heartbeat(sent_unix_ns=sent_ns)):
                    await world.registry.settle(entries[name])
            clock.advance(t - clock.monotonic())
            made += [(round(t - start, 1), c.name, c.target) for c in await world.registry.tick()]
        return made
    return go


def _ten_nodes_beating(world: World, offset_ns: int = 0):
    """Ten nodes whose heartbeats are read at once for a few seconds (every node's lag floor); their clocks run
    `offset_ns` behind the controller's."""
    async def go():
        entries = {f"n{i}": (await world.join(f"n{i}"))[0] for i in range(10)}
        for _ in range(3):
            for name in entries:
                world.clock.advance(0.1)
                world.registry.heartbeat(entries[name],
                                         node_pb2.Heartbeat(sent_unix_ns=world.clock.wall_ns() - offset_ns))
                await world.registry.tick()
        return entries
    return go


def test_a_controller_falling_behind_at_reading_heartbeats_declares_no_node_it_still_hears_from():
    """Its queue grows by 1.2 s every second for 3 s (a storm it cannot keep up with), then drains: the gaps between
    the heartbeats it reads from each node pass suspect_after_s, but they are its own backlog, which the heartbeats'
    lag over each node's floor shows. The node that really went silent is still declared, once silent that long on
    top."""
    async def go():
        w = World()
        entries = await _ten_nodes_beating(w)()
        made = await _falling_behind(w, entries, silent="n9", seconds=14.0, growth=1.2, behind_s=3.0,
                                     catchup=0.8)()
        assert {name for _, name, _ in made} == {"n9"}, made
        assert [target for _, _, target in made] == [SUSPECT, DOWN]
        assert made[0][0] > POLICY.suspect_after_s + 0.5  # later than on time, by the backlog
        assert w.registry.backlog.allowance == 0.0  # caught up
    run(go())


def test_without_a_backlog_a_silent_node_is_declared_on_time():
    async def go():
        w = World()
        entries = await _ten_nodes_beating(w)()
        made = await _falling_behind(w, entries, silent="n9", seconds=4.0, growth=0.0)()
        assert [(name, target) for _, name, target in made] == [("n9", SUSPECT), ("n9", DOWN)]
        assert 2.0 <= made[0][0] <= 2.1 and 3.0 <= made[1][0] <= 3.1  # on the first sweep past each limit
        assert w.registry.backlog.allowance == 0.0
    run(go())


def test_a_few_nodes_with_stepped_clocks_do_not_hold_liveness_back():
    """Lag is counted over each node's own floor, and the backlog is the lower median of the last second's: every
    node's clock 5 s behind the controller's (every heartbeat looks 5 s late), and two nodes of ten whose clocks
    then jumped back by a minute more, change nothing, and a silent node is declared on time."""
    offset = 5 * 10**9

    async def go():
        w = World()
        entries = await _ten_nodes_beating(w, offset)()
        w.clock.advance(0.05)
        made = []
        start = w.clock.monotonic()
        for tick in range(1, 41):
            for i, name in enumerate(entries):
                if name != "n9" and tick % 10 == i:
                    skew = offset + (60 * 10**9 if name in ("n0", "n1") else 0)
                    w.registry.heartbeat(entries[name], node_pb2.Heartbeat(sent_unix_ns=w.clock.wall_ns() - skew))
            w.clock.advance(start + tick * 0.1 - w.clock.monotonic())
            made += [(c.name, c.target) for c in await w.registry.tick()]
        assert made == [("n9", SUSPECT), ("n9", DOWN)]
        assert w.registry.backlog.allowance < 0.01
    run(go())


def test_a_stalled_sweep_charges_the_stall_to_no_node():
    """The loop ran no sweep for 2.5 s and read nothing meanwhile: the first sweep after it must not declare the
    nodes whose heartbeats are still waiting to be read; a node silent since before the stall is declared once the
    stall has been made up."""
    async def go():
        w = World()
        entries = await _ten_nodes_beating(w)()
        w.clock.advance(0.1)
        assert await w.registry.tick() == []
        w.clock.advance(2.5)  # stalled
        assert await w.registry.tick() == []
        assert w.registry.backlog.allowance == pytest.approx(2.4)  # all of it but one sweep interval
        for name in entries:  # the heartbeats that waited, read now
            if name != "n9":
                w.registry.heartbeat(entries[name], node_pb2.Heartbeat(sent_unix_ns=w.clock.wall_ns() - 10**9))
        made = []
        for _ in range(40):
            w.clock.advance(0.1)
            made += [(c.name, c.target) for c in await w.registry.tick()]
            for name in entries:
                if name != "n9":
                    w.registry.heartbeat(entries[name], node_pb2.Heartbeat(sent_unix_ns=w.clock.wall_ns()))
        assert made == [("n9", SUSPECT), ("n9", DOWN)]
    run(go())


class CountingStore(MemoryStore):
    """A memory store that counts its commits and the most node records one of them held."""

    def __init__(self) -> None:
        super().__init__()
        self.commits = self.largest = 0

    async def commit(self, nodes=(), events=(), **kw):
        self.commits += 1
        self.largest = max(self.largest, len(nodes))
        return await super().commit(nodes=nodes, events=events, **kw)


def test_a_fleet_cut_off_and_heard_from_again_goes_in_few_commits_of_bounded_size():
    """1,200 nodes silent at once go SUSPECT, then DOWN, in commits of at most ADMIT_BATCH records (one commit of
    10,000 was larger than an etcd transaction may be, and the sweep failed on it for ever); heard from again, those
    still SUSPECT go back UP together, not in a commit each under the lock (40 s at 10,000 nodes)."""
    from controller.nodes.registry import ADMIT_BATCH

    async def go():
        store = CountingStore()
        w = World(store)
        joined = [await w.join(f"n{i:04d}") for i in range(1200)]
        await w.advance(2.0)
        assert all(w.state(e.record.name) is SUSPECT for e, _ in joined)
        assert store.largest == ADMIT_BATCH
        store.commits = 0
        await asyncio.gather(*(w.beat(e) for e, _ in joined))
        assert all(w.state(e.record.name) is UP for e, _ in joined)
        assert store.commits <= 3 and store.largest <= ADMIT_BATCH
    run(go())


def test_a_sweep_that_waits_for_the_lock_is_not_a_stalled_loop():
    """A sweep whose changes wait for the registry's lock (commits ahead of it: a takeover's thousands) ends late,
    but the loop ran meanwhile, heartbeats were read: the next sweep counts its gap from the end of this one, and
    forgives nothing (counted from its start, a 3 s wait made a 3 s 'stall', and at 10,000 nodes a 30 s one)."""
    async def go():
        w = World()
        await w.join("n1")
        await w.advance(1.9)
        async with w.registry._lock:
            w.clock.advance(0.1)
            tick = asyncio.create_task(w.registry.tick())  # n1 is silent 2 s: a change, waiting for the lock
            await asyncio.sleep(0)
            w.clock.advance(3.0)
        await tick
        assert w.state("n1") in (SUSPECT, DOWN)
        w.clock.advance(0.1)
        await w.registry.tick()
        assert w.registry.backlog.allowance == 0.0
    run(go())


def _gpu_beat(dbe: int = 0, sbe: int = 0, gpus: int = 2) -> node_pb2.Heartbeat:
    return node_pb2.Heartbeat(gpus=[common_pb2.GpuTelemetry(index=i, ecc_dbe_volatile=dbe if i == 0 else 0,
                                                            ecc_sbe_volatile=sbe if i == 0 else 0)
                                    for i in range(gpus)], health_digest=1000 * dbe + sbe + 1)


async def _taken_up(names=("n1",)):
    """A new leader on the store of an old one, taking the nodes' sessions up with their first judges deferred."""
    w = World()
    joined = {name: (await w.join(name))[0] for name in names}
    leader = World(w.store)
    await leader.registry.load()
    leader.registry.defer_judging()
    entries = {name: leader.registry.attach(name, joined[name].record.incarnation, Session("ipv4:127.0.0.1:2"))
               for name in names}
    return leader, entries


def test_a_takeover_defers_the_first_judge_of_an_unchanged_node_until_every_session_is_back():
    async def go():
        leader, entries = await _taken_up(("n1", "n2"))
        for entry in entries.values():
            assert not leader.registry.heartbeat(entry, _gpu_beat())
            assert not entry.gpu_verdicts and not entry.gpu_health  # recorded, not judged
            assert entry.to_proto().health == common_pb2.HEALTH_UNSPECIFIED  # shown as not judged ("-")
        leader.clock.advance(1.0)
        assert not leader.registry.heartbeat(entries["n1"], _gpu_beat())  # unchanged signals: still deferred
        assert not entries["n1"].gpu_verdicts
        leader.registry.judge_deferred()
        await leader.registry._judging_deferred
        for entry in entries.values():
            assert sorted(entry.gpu_verdicts) == [0, 1] and entry.verdict.health.name == "HEALTHY"
        # after the take-up a first heartbeat is judged at once again
        fresh = await leader.join("n3")
        leader.registry.heartbeat(fresh[0], _gpu_beat())
        assert sorted(fresh[0].gpu_verdicts) == [0, 1]
    run(go())


def test_a_deferred_node_whose_signals_change_is_judged_at_once_with_its_deferred_heartbeat_as_the_baseline():
    """Uncorrectable ECC errors counted between the deferred heartbeat and the next are a rate (FAILED, drained)
    at once, not a first reading waiting for the take-up to end."""
    async def go():
        leader, entries = await _taken_up()
        entry = entries["n1"]
        leader.registry.heartbeat(entry, _gpu_beat(dbe=0))
        leader.clock.advance(1.0)
        if leader.registry.heartbeat(entry, _gpu_beat(dbe=3)):
            await leader.registry.settle(entry)
        assert entry.verdict.health.name == "FAILED", entry.verdict.reasons
        assert entry.record.drain_reason and not entry.judge_deferred
        # the rate counts from the deferred reading: one corrected error in a second (60/min), neither the 500
        # counted before it (no baseline of 0) nor none at all (no history starting at the second heartbeat)
        leader2, entries2 = await _taken_up()
        e2 = entries2["n1"]
        leader2.registry.heartbeat(e2, _gpu_beat(sbe=500))
        leader2.clock.advance(1.0)
        leader2.registry.heartbeat(e2, _gpu_beat(sbe=501))
        assert e2.verdict.reasons == ("GPU 0: corrected ECC errors rising: 60/min",), e2.verdict.reasons
    run(go())


def test_an_xid_on_a_deferred_node_is_judged_at_once_with_every_gpu():
    async def go():
        leader, entries = await _taken_up()
        entry = entries["n1"]
        leader.registry.heartbeat(entry, _gpu_beat())
        await leader.registry.gpu_event(entry, common_pb2.GpuEvent(gpu_index=1, xid=79))
        assert entry.verdict.health.name == "FAILED" and sorted(entry.gpu_verdicts) == [0, 1]
        assert entry.record.drain_reason
        assert not entry.judge_deferred  # nothing left for the deferred judges: the XID judged it
    run(go())


def test_the_registry_counts_the_sessions_not_heard_from_yet():
    async def go():
        w = World()
        entry, _ = await w.join("n1")
        other, other_session = await w.join("n2")
        assert w.registry.unheard() == 2
        await w.beat(entry)
        assert w.registry.unheard() == 1
        w.registry.detach(other, other_session)  # went away before its first heartbeat
        assert w.registry.unheard() == 0
        w.registry.attach("n1", entry.record.incarnation, Session("ipv4:127.0.0.1:2"))  # heard from before
        assert w.registry.unheard() == 0
    run(go())


def test_a_failed_commit_while_judging_the_deferred_nodes_leaves_none_unjudged_and_is_retried():
    """A store error acting on one deferred node's verdict (an etcd timeout under a takeover's load) must not end
    the judging of the others, nor leave that node undrained: the health tick tries it again."""
    from controller.errors import StoreError

    async def go():
        leader, entries = await _taken_up(("n1", "n2", "n3"))
        lost = node_pb2.Heartbeat(gpus=[common_pb2.GpuTelemetry(index=0, lost=True)], health_digest=7)
        for entry in entries.values():
            leader.registry.heartbeat(entry, lost)
        commit, calls = leader.store.commit, [0]

        async def flaky(**kw):
            calls[0] += 1
            if calls[0] == 1:
                raise StoreError("etcd timed out")
            return await commit(**kw)

        leader.store.commit = flaky
        leader.registry.judge_deferred()
        await leader.registry._judging_deferred
        assert all(not e.judge_deferred and e.verdict.health.name == "FAILED" for e in entries.values())
        assert sum(bool(e.record.drain_reason) for e in entries.values()) == 2  # the first commit failed
        await leader.registry.health_tick()
        assert all(e.record.drain_reason for e in entries.values())
    run(go())


def test_a_drained_node_is_judged_at_once_by_a_new_leader():
    """An operator may be about to undrain it once it looks healthy: its health must be the real one."""
    async def go():
        w = World()
        entry, _ = await w.join("n1")
        await w.registry.drain("n1", "health FAILING: GPU 0: row remap pending")
        leader = World(w.store)
        await leader.registry.load()
        leader.registry.defer_judging()
        taken = leader.registry.attach("n1", entry.record.incarnation, Session("ipv4:127.0.0.1:2"))
        leader.registry.heartbeat(taken, node_pb2.Heartbeat(
            gpus=[common_pb2.GpuTelemetry(index=0, remap_pending=True)], health_digest=5))
        assert not taken.judge_deferred and taken.to_proto().health == common_pb2.HEALTH_FAILING
    run(go())


def test_what_placement_reads_of_a_node_follows_its_inventory():
    """A node's GPU count and labels, read of every node of the fleet at each step that places, are parsed once per
    inventory: a changed inventory is read anew, and a caller's change to the labels it got changes nothing."""
    async def go():
        w = World()
        entry, _ = await w.join("n1")
        assert entry.gpu_count() == 2 and entry.labels() == {}
        entry.labels()["switch"] = "mine"  # a copy
        assert entry.labels() == {}
        changed = inventory(4)
        changed.labels["switch"] = "leaf-7"
        await w.registry.update_inventory(entry, changed)
        entry = w.registry.get("n1")
        assert entry.gpu_count() == 4 and entry.labels() == {"switch": "leaf-7"}

    run(go())
