"""The agent's heartbeat survives a collector that fails or blocks: the node stays alive, the trouble is told once.
The link's loops (heartbeat cadence, reconnect backoff) run in virtual time."""

from __future__ import annotations

import asyncio
import random
import threading
import zlib

import grpc
import pytest

from agent import config as agent_config
from agent.backoff import Backoff
from agent.collectors.sim import SimBackend
from agent.link import Link
from agent.main import Agent
from phalanx import faults
from phalanx.clock import FakeClock
from phalanx.v1 import common_pb2, node_pb2, node_pb2_grpc

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def run(test):
    """Each test is a coroutine run on a fresh event loop."""
    def wrapper(tmp_path):
        asyncio.run(test(tmp_path))
    wrapper.__name__ = test.__name__
    return wrapper


class FlakyBackend(SimBackend):
    """Simulated GPUs whose sweep can fail, or block (a driver call that hangs) until released."""

    def __init__(self) -> None:
        super().__init__(2, "node-f", seed=1)
        self.fail: Exception | None = None
        self.block = False
        self.release = threading.Event()
        self.blocked = threading.Event()  # a blocking sweep has begun on its thread
        self.calls = 0

    def sample(self):
        self.calls += 1
        if self.block:
            self.blocked.set()
            self.release.wait(60)  # bounded only so that a failing test cannot hang the run
        if self.fail is not None:
            raise self.fail
        return super().sample()


def make_agent(tmp_path, backend, clock):
    cfg = agent_config.AgentConfig(node_name="node-f", state_dir=str(tmp_path / "state"), snapshot_dir="",
                                   checkpoint_dir=str(tmp_path), nvrx_socket="")
    agent = Agent(cfg, backend, clock=clock)
    events = []
    agent.link.emit = lambda kind, message, **fields: events.append((kind, message, fields))
    return agent, events


@run
async def test_a_failing_gpu_collector_sends_its_last_reading_and_says_so_once(tmp_path):
    backend = FlakyBackend()
    agent, events = make_agent(tmp_path, backend, FakeClock())
    good = await agent.heartbeat(1.0)  # the clock stands still: each heartbeat waits for its collectors
    assert len(good.gpus) == 2 and not events
    backend.fail = OverflowError("int too large to convert")
    for _ in range(3):
        beat = await agent.heartbeat(1.0)
        assert list(beat.gpus) == list(good.gpus) and beat.host.ByteSize() > 0
    assert events == [("collector_failed", "the gpu collector on node-f failed: OverflowError: int too large to "
                       "convert", {"collector": "gpu"})]
    backend.fail = ValueError("another")
    await agent.heartbeat(1.0)
    assert events[-1][0] == "collector_failed" and "ValueError: another" in events[-1][1]
    backend.fail = None
    assert len((await agent.heartbeat(1.0)).gpus) == 2
    assert events[-1] == ("collector_recovered", "the gpu collector on node-f works again", {"collector": "gpu"})
    assert len(events) == 3


@run
async def test_a_full_state_disk_does_not_silence_the_node(tmp_path):
    """Issue 39 (and 41): the supervisor's bookkeeping ran unguarded inside the heartbeat, so one persistent error
    (a full state disk, which a tenant's rank logs can cause) broke every heartbeat and every tenant's session on
    the node flapped. The heartbeat goes up; the failure is said once, and its end is logged."""
    agent, events = make_agent(tmp_path, FlakyBackend(), FakeClock())
    full = OSError(28, "No space left on device")

    def failing():
        raise full
    agent.supervisor.poll = failing
    for _ in range(3):
        beat = await agent.heartbeat(1.0)
        assert len(beat.gpus) == 2
    assert [kind for kind, _, _ in events] == ["rank_bookkeeping_failing"] and "No space left" in events[0][1]
    # the watch for ranks that end (every 0.1 s) goes on too, asking for a heartbeat with what is known
    beats = []
    agent.link.beat_now = lambda: beats.append(1)
    watch = asyncio.ensure_future(agent._watch_ranks())
    try:
        for _ in range(3):
            agent.clock.advance(0.1)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert not watch.done() and len(beats) >= 2
    finally:
        watch.cancel()
    del agent.supervisor.poll  # the disk has room again
    await agent.heartbeat(1.0)
    assert not agent._tending_failed and len(events) == 1


class FakeCall:
    """The session's stream as the heartbeat loop sees it: what it writes is kept."""

    def __init__(self) -> None:
        self.heartbeats: list[node_pb2.Heartbeat] = []
        self.wrote = asyncio.Event()

    async def write(self, message: node_pb2.AgentMessage) -> None:
        if message.HasField("heartbeat"):
            self.heartbeats.append(message.heartbeat)
        self.wrote.set()

    async def heartbeat_number(self, n: int) -> node_pb2.Heartbeat:
        while len(self.heartbeats) < n:
            self.wrote.clear()
            await self.wrote.wait()
        return self.heartbeats[n - 1]


@run
async def test_heartbeats_keep_their_cadence_while_a_gpu_query_blocks(tmp_path):
    clock = FakeClock()
    backend = FlakyBackend()
    agent, events = make_agent(tmp_path, backend, clock)
    good = await agent.heartbeat(0.5)
    backend.block = True
    call, stop = FakeCall(), asyncio.Event()
    controller = asyncio.get_running_loop().create_future()  # the controller's end: never closes here
    beats = asyncio.create_task(agent.link._heartbeats(call, 1.0, controller, stop))
    try:
        await clock.run_for(5.0)
        # one every second, each as soon as its collectors' budget (half the interval) ran out
        assert [(b.seq, b.sent_unix_ns - clock.wall_ns()) for b in call.heartbeats] == \
            [(seq, int((seq - 5.5) * 1e9)) for seq in range(1, 6)]
        assert all(list(b.gpus) == list(good.gpus) for b in call.heartbeats)  # the last good reading
        # the sweep was handed to a thread at the first beat; on a busy machine that thread may start it only now
        assert await asyncio.to_thread(backend.blocked.wait, 60)
        assert backend.calls == 2  # the blocked call is waited for again, never started twice
        assert [e for e in events if e[2] == {"collector": "gpu"}] == [
            ("collector_slow", "the gpu collector on node-f has not answered within 0.5s", {"collector": "gpu"})]
        backend.block = False
        backend.release.set()
        sixth = await asyncio.wait_for(call.heartbeat_number(6), 60)  # the clock stands still: it waits for the GPUs
        assert sixth.seq == 6 and len(sixth.gpus) == 2 and backend.calls == 2
        assert [e for e in events if e[2] == {"collector": "gpu"}][-1] == (
            "collector_recovered", "the gpu collector on node-f works again", {"collector": "gpu"})
    finally:
        backend.release.set()
        stop.set()
        await beats


@run
async def test_reconnects_wait_the_jittered_backoff_on_the_clock(tmp_path):
    clock = FakeClock()
    attempts = []

    async def session(stop, promoted=None):
        attempts.append(clock.monotonic())
        raise ConnectionError("controller unreachable")

    link = Link("node-f", "127.0.0.1:1", inventory=None, heartbeat=None,
                backoff=Backoff(1.0, 8.0, random.Random(3)), clock=clock)
    link._session = session
    stop = asyncio.Event()
    task = asyncio.create_task(link.run(stop))
    await clock.run_for(60.0)
    twin = Backoff(1.0, 8.0, random.Random(3))
    expected = [1000.0]
    while (at := expected[-1] + twin.next()) <= 1060.0:
        expected.append(at)
    assert attempts == expected and len(attempts) > 8
    stop.set()
    await task  # a stop ends the wait at once, with no time passing
    assert clock.monotonic() == 1060.0 and len(attempts) == len(expected)


@run
async def test_a_jobs_snapshots_are_reported_and_given_back_once_it_has_left_the_node_for_ten_minutes(tmp_path):
    import zlib

    from agent import snapshots as snaps
    clock = FakeClock()
    cfg = agent_config.AgentConfig(node_name="node-f", state_dir=str(tmp_path / "state"), nvrx_socket="",
                                   snapshot_dir=str(tmp_path / "snap"), checkpoint_dir=str(tmp_path),
                                   snapshot_idle_s=300.0)  # snapshot_idle_s: ten minutes by default
    agent = Agent(cfg, SimBackend(2, "node-f", seed=1), clock=clock)
    agent.link.emit = lambda *a, **k: None
    key = snaps.Key("job-9", 1, 0, 5)
    path = agent.snapshots.store.path(snaps.OWN, key)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"state")
    assert agent.snapshots.taken(key, str(path), 5, zlib.crc32(b"state")) == ""
    assert [(s.job, s.step) for s in (await agent.heartbeat(1.0)).snapshots] == [("job-9", 5)]
    clock.advance(300.0 - 1)
    assert len((await agent.heartbeat(1.0)).snapshots) == 1  # unchanged, but not for long enough
    clock.advance(2)
    assert not (await agent.heartbeat(1.0)).snapshots and not path.exists()  # its memory is given back


class ResumingController(node_pb2_grpc.NodeServiceServicer):
    """A controller that ends each session after its first heartbeat; it resumes the next one, but refuses
    the third."""

    def __init__(self) -> None:
        self.registered = 0  # the incarnation it gave last
        self.opens: list[tuple[int, bool]] = []  # (incarnation, accepted)
        self.inventories: list[int] = []  # GPUs in each inventory sent on a session
        self.held = b""  # the inventory it holds, as the real one stores it
        self.done = asyncio.Event()

    async def Register(self, request, context):
        self.registered += 1
        self.held = request.inventory.SerializeToString(deterministic=True)
        return node_pb2.RegisterResponse(incarnation=self.registered, heartbeat_interval_s=0.05, epoch=3,
                                         state=common_pb2.NODE_STATE_UP)

    async def Session(self, request_iterator, context):
        first = await context.read()
        # the third session is refused, as a controller refuses a node it declared DOWN meanwhile
        accept = first.open.incarnation == self.registered and len(self.opens) != 2
        self.opens.append((first.open.incarnation, accept))
        if not accept:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "incarnation is stale; register again")
        await context.write(node_pb2.ControllerMessage(accepted=node_pb2.SessionAccepted(
            incarnation=first.open.incarnation, heartbeat_interval_s=0.05, epoch=3, state=common_pb2.NODE_STATE_UP,
            inventory_crc32=zlib.crc32(self.held))))
        while (message := await context.read()) is not grpc.aio.EOF:
            if message.WhichOneof("body") == "inventory":
                self.inventories.append(len(message.inventory.gpus))
                self.held = message.inventory.SerializeToString(deterministic=True)
            elif message.WhichOneof("body") == "heartbeat":
                break
        if len(self.opens) >= 5:
            self.done.set()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")


@run
async def test_a_reconnecting_agent_resumes_its_session_and_registers_only_when_refused(tmp_path):
    server = grpc.aio.server()
    fake = ResumingController()
    node_pb2_grpc.add_NodeServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    gpus = [2]

    def inventory():
        return common_pb2.NodeInventory(gpus=[common_pb2.GpuInfo(index=i) for i in range(gpus[0])])

    async def heartbeat(budget):
        if fake.opens and len(fake.opens) == 1:
            gpus[0] = 3  # the inventory changes while the first session is up: the resumed one says so
        return node_pb2.Heartbeat()

    link = Link("node-r", f"127.0.0.1:{port}", inventory=inventory, heartbeat=heartbeat,
                backoff=Backoff(0.01, 0.02, random.Random(1)))
    stop = asyncio.Event()
    task = asyncio.create_task(link.run(stop))
    try:
        await asyncio.wait_for(fake.done.wait(), 60)
        # the second session resumed with incarnation 1 and no registration; the third, resumed again,
        # was refused and the agent registered at once (incarnation 2); the fifth resumed that
        assert fake.opens[:5] == [(1, True), (1, True), (1, False), (2, True), (2, True)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await server.stop(0)
    assert fake.registered == 2
    # sent once: on the first resumed session, where the controller held the 2-GPU one; not on the fifth,
    # where the controller's CRC-32 matched
    assert fake.inventories == [3]
    assert link.state.incarnation == 2 and link.state.epoch == 3


@run
async def test_a_gpu_event_sends_the_readings_that_move_with_it_at_once_and_a_storm_of_them_no_faster(tmp_path):
    clock = FakeClock()
    backend = SimBackend(2, "node-f", seed=1)
    agent, _ = make_agent(tmp_path, backend, clock)
    agent.watch_gpu_events(asyncio.get_running_loop())
    call, stop = FakeCall(), asyncio.Event()
    controller = asyncio.get_running_loop().create_future()
    beats = asyncio.create_task(agent.link._heartbeats(call, 1.0, controller, stop))
    try:
        first = await asyncio.wait_for(call.heartbeat_number(1), 60)
        assert not any(g.remap_pending for g in first.gpus)
        backend.inject(1, faults.parse("remap-pending"))  # XID 63, as from NVML's event thread
        # the clock stands still: this heartbeat is not the next one due, it is sent for the event
        second = await asyncio.wait_for(call.heartbeat_number(2), 60)
        assert [g.remap_pending for g in second.gpus] == [False, True]
        assert clock.monotonic() == 1000.0
    finally:
        stop.set()
        await beats
    # An XID storm spread over a second (one every 50 ms): a heartbeat is asked for at the first and then once
    # every 0.25 s, not once per XID. (Heartbeats asked for before one is sent fold into it, so the storm is
    # counted where the agent asks for them.)
    asked: list[float] = []
    agent.link.beat_now = lambda: asked.append(clock.monotonic())
    await clock.run_for(1.0)  # past the last event-sent heartbeat's gap
    start = clock.monotonic()
    for _ in range(20):
        backend.inject(0, faults.parse("xid=13"))
        await clock.run_for(0.05)
    await clock.run_for(0.3)
    assert [round(t - start, 2) for t in asked] == [0.0, 0.25, 0.5, 0.75, 1.0]


@run
async def test_a_reading_in_flight_when_the_gpu_changed_is_read_again_before_it_is_reported(tmp_path):
    backend = FlakyBackend()
    agent, _ = make_agent(tmp_path, backend, FakeClock())
    backend.block = True
    reading = asyncio.ensure_future(agent._gpu.read(60.0))
    while backend.calls == 0:
        await asyncio.sleep(0.01)
    backend.inject(0, faults.parse("remap-pending"))  # after the sweep in flight read the GPUs
    agent._gpu.stale()
    backend.block = False
    backend.release.set()
    gpus = await asyncio.wait_for(reading, 60)
    assert gpus[0].remap_pending and backend.calls == 2


def test_a_lost_leader_is_tried_again_while_a_session_is_parked():
    """Parked at a standby, the agent waits for a standby to take its session up (trying the old leader meanwhile,
    not the standbys, which could only refuse, whether or not it is parked at every one of them: a controller that
    is down would otherwise send every agent round the list at every takeover), for takeover_s; then round the
    list."""
    clock = FakeClock()
    link = Link("node-p", ["a:1", "b:1", "c:1"], inventory=None, heartbeat=None,
                backoff=Backoff(1.0, 8.0, random.Random(3)), clock=clock)
    link._lost_at = clock.monotonic()
    link._standing_by = {"b:1": 7.0}  # (c:1 down)
    link._move_on(None)
    assert link.controller == "a:1"
    clock.advance(7.5)
    link._move_on(None)
    assert link.controller == "b:1"  # the take-up did not come within takeover_s


def test_an_older_epoch_is_refused_until_every_controller_has_led_it_for_a_minute():
    """A deposed leader stands down within its lease; older epochs from every controller for EPOCH_RESET_S mean the
    epochs started again (etcd wiped, or back to one controller): the agent follows, says so, takes its commands."""
    from agent.link import EPOCH_RESET_S
    clock = FakeClock()
    events = []
    link = Link("node-e", ["a:1", "b:1"], inventory=None, heartbeat=None, backoff=Backoff(1.0, 8.0, random.Random(3)),
                on_command=lambda command: node_pb2.CommandResult(ok=True), clock=clock)
    link.emit = lambda kind, message, **fields: events.append((kind, fields))
    link.state.epoch = 5
    stop = node_pb2.Command(id=1, epoch=2, stop=node_pb2.StopRanks(job="j"))
    assert not link._run(stop).ok
    with pytest.raises(ConnectionError, match="deposed"):
        link._check_epoch(2)
    clock.advance(EPOCH_RESET_S - 1)
    link._check_epoch(5)  # the current leader, reached: the other one was only deposed
    clock.advance(2)
    with pytest.raises(ConnectionError, match="deposed"):
        link._check_epoch(2)
    clock.advance(EPOCH_RESET_S - 1)
    with pytest.raises(ConnectionError, match="deposed"):
        link._check_epoch(0)
    assert link.state.epoch == 5 and not events
    clock.advance(EPOCH_RESET_S)  # a long spell with no answer at all: the next older epoch starts the count afresh
    with pytest.raises(ConnectionError, match="deposed"):
        link._check_epoch(0)
    for _ in range(int(EPOCH_RESET_S) - 1):
        clock.advance(1)
        with pytest.raises(ConnectionError, match="deposed"):
            link._check_epoch(0)
    clock.advance(1)
    link._check_epoch(0)
    assert link.state.epoch == 0 and events == [("epoch_reset", {"epoch": "0", "previous_epoch": "5"})]
    assert link._run(stop).ok
