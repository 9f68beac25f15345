"""A standby that sees another controller elected names it on the sessions parked there (StandingBy again): an agent
whose session is down and that is not parked at the new leader goes there at once, instead of waiting
StandingBy.takeover_s for a take-up that cannot come. Real gRPC servers on loopback stand in for the controllers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from agent.backoff import Backoff
from agent.link import Link
from phalanx.clock import FakeClock, RealClock
from phalanx.v1 import common_pb2, node_pb2, node_pb2_grpc

pytestmark = pytest.mark.etcd  # the tier (tests/conftest.py)

TAKEOVER_S = 3600.0  # what the standby promises: far longer than any test waits


class FakeController(node_pb2_grpc.NodeServiceServicer):
    """A leader (accepts every session) or a standby (parks sessions; `name(address)` names a new leader)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.opened: list[node_pb2.SessionOpen] = []
        self.changed = asyncio.Event()
        self.leader = ""
        self._named = asyncio.Event()
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> FakeController:
        self.server = grpc.aio.server()
        node_pb2_grpc.add_NodeServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    def name(self, address: str) -> None:
        self.leader = address
        self._named.set()

    async def wait_for(self, what) -> None:
        while not what():
            changed = self.changed
            await asyncio.wait_for(changed.wait(), 60)

    def _saw(self, message: node_pb2.SessionOpen) -> None:
        self.opened.append(message)
        self.changed.set()
        self.changed = asyncio.Event()

    async def Session(self, request_iterator, context):
        first = await context.read()
        self._saw(first.open)
        if self.role == "standby":
            if not first.open.standby:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "a standby")
            await context.write(node_pb2.ControllerMessage(standing_by=node_pb2.StandingBy(
                controller="s", leader=self.leader, takeover_s=TAKEOVER_S)))
            await self._named.wait()
            await context.write(node_pb2.ControllerMessage(standing_by=node_pb2.StandingBy(
                controller="s", leader=self.leader, takeover_s=TAKEOVER_S)))
            await asyncio.Event().wait()  # held until the agent goes
        await context.write(node_pb2.ControllerMessage(accepted=node_pb2.SessionAccepted(
            incarnation=first.open.incarnation, heartbeat_interval_s=1.0, state=common_pb2.NODE_STATE_UP, epoch=1)))
        while await context.read() is not grpc.aio.EOF:
            pass


async def _heartbeat(budget_s: float) -> node_pb2.Heartbeat:
    return node_pb2.Heartbeat()


def test_an_agent_goes_to_the_leader_a_standby_names_when_it_is_not_parked_there():
    async def go():
        old, standby, new = [await FakeController(r).start() for r in ("leader", "standby", "leader")]
        standby.leader = old.address
        link = Link("node-n", [old.address, standby.address], inventory=common_pb2.NodeInventory,
                    heartbeat=_heartbeat, backoff=Backoff(0.05, 0.2))
        link.state.incarnation = 7  # registered before: it resumes
        stop = asyncio.Event()
        running = asyncio.create_task(link.run(stop))
        try:
            await old.wait_for(lambda: any(not o.standby for o in old.opened))
            await standby.wait_for(lambda: any(o.standby for o in standby.opened))
            while standby.address not in link._standing_by:
                await asyncio.sleep(0.01)
            await old.server.stop(0)  # the leader is gone: the agent tries it again, waiting for a take-up
            while link.state.connected:
                await asyncio.sleep(0.01)
            assert link.controller == old.address
            standby.name(new.address)  # another controller won, one this agent is not parked at
            await new.wait_for(lambda: any(not o.standby and o.incarnation == 7 for o in new.opened))
            while not link.state.connected:
                await asyncio.sleep(0.01)
            assert link.controller == new.address
        finally:
            stop.set()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            for c in (standby, new):
                await c.server.stop(0)
    asyncio.run(go())


def test_a_named_leader_is_not_followed_while_in_session_or_parked_there():
    """In session, or parked at the named leader (which takes that session up), the agent stays where it is: only
    an agent that could not be taken up moves, so naming is no reconnect storm."""
    clock = FakeClock()
    link = Link("node-p", ["a:1", "b:1", "c:1"], inventory=None, heartbeat=None, backoff=Backoff(1.0, 8.0),
                clock=clock)
    link._standing_by = {"b:1": 7.0, "c:1": 7.0}
    link.state.connected = True
    link._leader_named("c:1", "d:1")
    assert link._named == ""  # in session
    link.state.connected = False
    link._leader_named("c:1", "b:1")
    assert link._named == ""  # parked there: b:1 takes the session up
    link._leader_named("c:1", "d:1")
    assert link._named == "d:1"
    link._lost_at = clock.monotonic()
    link._move_on(None)  # the session's end does not send it round the list: it goes to the one named
    assert link.controller == "a:1" and link._named == "d:1"


def test_a_standby_hears_of_each_new_leader_it_sees_elected_once(etcd_server):
    """Elector.on_new_leader (which names the leader on the parked sessions) is called when a standby's campaign
    finds another controller elected after the one it knew, with the count of sessions parked at the winner; not
    for the first leader it sees, nor for the same one seen again."""
    import uuid

    from controller.ha import Elector
    from controller.store.etcd import Etcd

    async def main() -> None:
        etcd = Etcd([etcd_server.endpoint])
        prefix = f"/test-named/{uuid.uuid4().hex}"
        first = Elector(etcd, prefix, "c0", "127.0.0.1:1", 30, probe=False)
        standby = Elector(etcd, prefix, "c1", "127.0.0.1:2", 30, probe=False)
        second = Elector(etcd, prefix, "c2", "127.0.0.1:3", 30, probe=False)
        heard: list[tuple[str, int]] = []
        standby.on_new_leader = lambda leader: heard.append((leader.name, leader.parked))
        second.parked_count = lambda: 7  # sessions parked at it: it says so in the leader key when it wins
        try:
            term = await first.campaign()
            assert await standby._try() is None and heard == []  # the first leader it sees: nothing to tell
            assert await standby._try() is None and heard == []  # the same one again
            await first.resign(term)
            term = await second.campaign()
            assert await standby._try() is None and heard == [("c2", 7)]
            await second.resign(term)
        finally:
            await etcd.close()

    asyncio.run(main())


def test_a_standby_names_the_new_leader_only_if_fewer_sessions_were_parked_there(monkeypatch):
    """The winner says in the leader key how many sessions were parked at it; a losing standby with more parked
    names it (some of its agents cannot be taken up there), with as many or fewer sends nothing (the steady
    state: at 8,000 nodes the names would cost CPU in the seconds of the take-up). A winner that does not say
    (an earlier release) is named."""
    from types import SimpleNamespace

    from controller.api import node_service
    from controller.ha import LeaderInfo, Standby

    monkeypatch.setattr(node_service, "NAME_DELAY_S", 3600.0)  # (the names themselves are not sent here)

    async def go():
        elector = SimpleNamespace(name="c2", ttl_s=2.0, problem="", leader=None, clock=RealClock())
        standby = Standby(elector)
        standby.parked._waiters.extend(node_service._Parked() for _ in range(3))
        assert elector.parked_count() == 3
        named = []
        for parked_there in (3, 5, 2, -1):
            standby.parked._naming = None
            elector.on_new_leader(LeaderInfo("c1", "127.0.0.1:7001", 9, 0, parked_there))
            named.append(standby.parked._naming is not None)
            if standby.parked._naming is not None:
                standby.parked._naming.cancel()
        assert named == [False, False, True, True]
    asyncio.run(go())
