"""A standby finds a dead leader's process by its port (controller/ha.py leader_gone) and revokes its lease."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest

from controller import ha
from controller.ha import Elector, leader_gone

pytestmark = pytest.mark.etcd  # the tier (tests/conftest.py)


class Listener:
    """A port that accepts connections and keeps them, like a controller's; `die()` closes it all at once."""

    def __init__(self) -> None:
        self.accepted: list[asyncio.StreamWriter] = []
        self.arrived = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.append(writer)
        self.arrived.set()

    async def connected(self, count: int) -> None:
        while len(self.accepted) < count:
            self.arrived.clear()
            await self.arrived.wait()

    def drop_connections(self) -> None:
        for w in self.accepted:
            w.close()

    def die(self) -> None:
        self.server.close()  # (a listener closed: connections to it are refused from now on)
        self.drop_connections()


async def run_probe(address: str) -> asyncio.Task:
    return asyncio.create_task(leader_gone(address))


def test_a_connection_that_closes_then_a_refusal_says_the_process_is_gone():
    async def main() -> None:
        port = Listener()
        probe = await run_probe(await port.start())
        await port.connected(1)
        assert not probe.done()
        port.die()
        await asyncio.wait_for(probe, 10)

    asyncio.run(main())


def test_a_connection_let_go_by_a_live_server_is_made_again_and_proves_nothing():
    async def main() -> None:
        port = Listener()
        probe = await run_probe(await port.start())
        await port.connected(1)
        port.drop_connections()  # an idle connection let go, the port still open
        await asyncio.wait_for(port.connected(2), 10)
        assert not probe.done()
        port.die()
        await asyncio.wait_for(probe, 10)

    asyncio.run(main())


def scripted(monkeypatch, outcomes: list) -> asyncio.Event:
    """asyncio.open_connection, as seen by leader_gone, gives `outcomes` in turn (an exception to raise, or
    "open": a connection that then closes), then refusals. The event is set once every outcome was given."""
    given = asyncio.Event()
    left = list(outcomes)

    async def open_connection(host, port):
        outcome = left.pop(0) if left else ConnectionRefusedError()
        if not left:
            given.set()
        if isinstance(outcome, BaseException):
            raise outcome
        reader = asyncio.StreamReader()
        reader.feed_eof()

        class Writer:
            def close(self) -> None:
                pass

            def get_extra_info(self, name: str):
                return None

        return reader, Writer()

    monkeypatch.setattr(ha.asyncio, "open_connection", open_connection)
    monkeypatch.setattr(ha, "PROBE_PAUSE_S", 0.001)
    return given


@pytest.mark.parametrize("outcomes", [
    [ConnectionRefusedError()] * 5,  # refused from the start: a wrong address, not a death
    ["open", TimeoutError(), ConnectionRefusedError(), ConnectionRefusedError()],  # out of reach in between
    ["open", OSError("network unreachable"), ConnectionRefusedError()],
], ids=["refused from the start", "a timeout in between", "unreachable in between"])
def test_what_proves_nothing(monkeypatch, outcomes):
    async def main() -> None:
        given = scripted(monkeypatch, [*outcomes, TimeoutError()] * 3)
        probe = asyncio.create_task(leader_gone("127.0.0.1:1"))
        await asyncio.wait_for(given.wait(), 10)
        assert not probe.done()
        probe.cancel()

    asyncio.run(main())


def test_open_then_refused_is_gone(monkeypatch):
    async def main() -> None:
        scripted(monkeypatch, [ConnectionRefusedError(), TimeoutError(), "open", ConnectionRefusedError()])
        await asyncio.wait_for(leader_gone("127.0.0.1:1"), 10)

    asyncio.run(main())


def test_a_standby_revokes_the_lease_of_a_leader_whose_process_is_gone(etcd_server):
    """The leader's lease is 30 s and nothing renews it: a standby that takes over well within that did so because
    it found the leader's port closed and revoked the lease."""
    from controller.store.etcd import Etcd

    async def main() -> None:
        etcd = Etcd([etcd_server.endpoint])
        prefix = f"/test-probe/{uuid.uuid4().hex}"
        port = Listener()
        leader = Elector(etcd, prefix, "c0", await port.start(), 30)
        standby = Elector(etcd, prefix, "c2", "127.0.0.1:2", 30)
        try:
            first = await leader.campaign()
            winning = asyncio.create_task(standby.campaign())
            await asyncio.wait_for(port.connected(1), 10)  # the standby's probe
            assert not winning.done()
            port.die()
            term = await asyncio.wait_for(winning, 20)
            assert term.epoch > first.epoch and standby.leader.name == "c2"
            await standby.resign(term)
        finally:
            await etcd.close()

    asyncio.run(main())


def test_a_paused_leader_keeps_its_port_and_its_lease():
    """A stopped (SIGSTOP) process's port still accepts connections (the kernel does): nothing is revoked, and the
    lease decides. Here: a socket that the kernel completes connections for, and whose owner reads nothing."""
    async def main() -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        held = None
        try:
            probe = asyncio.create_task(leader_gone(f"127.0.0.1:{sock.getsockname()[1]}"))
            while held is None:  # the probe's connection, made by the kernel alone
                try:
                    held, _ = sock.accept()
                except BlockingIOError:
                    await asyncio.sleep(0.01)
            for _ in range(50):
                await asyncio.sleep(0)
            assert not probe.done()
            probe.cancel()
        finally:
            if held is not None:
                held.close()
            sock.close()

    asyncio.run(main())


def test_once_connected_the_probe_asks_that_address_again_not_the_name(monkeypatch):
    """A name that resolves to several addresses (or moves): the refusal that counts is the one from the address the
    connection was open to."""
    async def main() -> None:
        port = Listener()
        address = await port.start()
        asked = []
        real = asyncio.open_connection

        async def open_connection(host, port_):
            asked.append(host)
            return await real("127.0.0.1" if host == "leader.example" else host, port_)

        monkeypatch.setattr(ha.asyncio, "open_connection", open_connection)
        probe = asyncio.create_task(leader_gone("leader.example:" + address.rpartition(":")[2]))
        await port.connected(1)
        port.die()
        await asyncio.wait_for(probe, 10)
        assert asked[0] == "leader.example" and set(asked[1:]) == {"127.0.0.1"}, asked

    asyncio.run(main())


def test_a_probe_that_fails_is_passed_over_and_the_standby_waits_on_the_key_alone(etcd_server, monkeypatch):
    """A bug in the probe (an exception) must neither revoke a live leader's lease nor send the standby campaigning
    in a tight loop: the standby waits on the leader key alone, and takes its turn once the key goes."""
    from controller.store.etcd import Etcd

    failed = asyncio.Event()

    async def broken(address: str, clock=None) -> None:
        failed.set()
        raise RuntimeError("a bug of the probe's")

    monkeypatch.setattr(ha, "leader_gone", broken)

    async def main() -> None:
        etcd = Etcd([etcd_server.endpoint])
        prefix = f"/test-probe/{uuid.uuid4().hex}"
        leader = Elector(etcd, prefix, "c0", "127.0.0.1:1", 30, probe=False)
        standby = Elector(etcd, prefix, "c2", "127.0.0.1:2", 30)
        try:
            term = await leader.campaign()
            assert await standby._try() is None
            revoked: list[int] = []

            async def revoke(lease: int) -> None:
                revoked.append(lease)

            monkeypatch.setattr(standby, "_revoke", revoke)
            waiting = asyncio.create_task(standby._wait_vacant())
            await asyncio.wait_for(failed.wait(), 10)
            for _ in range(20):  # the event loop goes round: the standby is still waiting on the key
                await asyncio.sleep(0.01)
            assert not waiting.done()
            await leader.resign(term)  # the key goes: the standby's turn
            await asyncio.wait_for(waiting, 20)
            assert revoked == []  # nothing revoked on the probe's word
        finally:
            await etcd.close()

    asyncio.run(main())
