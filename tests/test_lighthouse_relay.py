"""The agent's relay of a replica-group job's lighthouse (agent/lighthouse_relay.py): the ranks' address stays while
the lighthouse behind it moves, an open connection is closed at the move so that its manager reconnects, and the
relay is a process of its own that outlives the agent (an agent that restarts takes it up again). Real processes:
what is tested is that the relay outlives its agent and ends when its job leaves the node."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from agent.lighthouse_relay import Relays, parse
from tests.eventually import eventually_async

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


async def upstream(name: bytes) -> tuple[asyncio.base_events.Server, str]:
    """A stand-in lighthouse that answers each line with its name and the line."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(name + b" " + line)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(*parse(url))


async def ask(url: str, line: bytes) -> bytes:
    """One connection, one line: the answer (b"" if the connection closes first)."""
    reader, writer = await connect(url)
    writer.write(line)
    try:
        return await asyncio.wait_for(reader.readline(), 30)
    finally:
        writer.close()


async def answered(url: str, line: bytes, want: bytes, timeout_s: float = 60.0) -> None:
    """Until the relay at `url` answers `line` with `want` (it has just started, or its file just changed): polled,
    as tests/eventually.py polls, with an answer that takes a connection."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            if await ask(url, line) == want:
                return
        except OSError:
            pass
        assert loop.time() < deadline, f"{url} did not answer {want!r} within {timeout_s:g}s"
        await asyncio.sleep(0.02)


def test_the_ranks_address_stays_while_the_lighthouse_behind_it_moves_and_the_relay_outlives_its_agent(tmp_path):
    async def run() -> None:
        first, first_url = await upstream(b"first")
        second, second_url = await upstream(b"second")
        relays = Relays(tmp_path / "relays")
        url = relays.relay("job-1", first_url)
        assert url.startswith("http://127.0.0.1:") and url != first_url
        assert relays.relay("job-1", second_url) == url  # a later launch: the same relay, pointed where it was
        await answered(url, b"hello\n", b"first hello\n")
        reader, writer = await connect(url)
        writer.write(b"open\n")
        assert await asyncio.wait_for(reader.readline(), 30) == b"first open\n"
        assert relays.point("job-2", second_url) == "no ranks of job-2 here relay its lighthouse"
        assert "relayed to" in relays.point("job-1", second_url)
        assert await asyncio.wait_for(reader.read(), 30) == b""  # the connection to the old one: closed
        writer.close()
        await answered(url, b"again\n", b"second again\n")
        # the agent restarts: the relay runs on, undisturbed, and the next agent takes it up
        (_, pid), = relays.relays.values()
        again = Relays(tmp_path / "relays")
        again.restore()
        assert again.relays == {"job-1": (int(url.rsplit(":", 1)[1]), pid)}
        assert await ask(url, b"still\n") == b"second still\n"
        # its process gone while no agent ran: the next agent starts it again, at the same port
        os.kill(pid, signal.SIGKILL)
        await eventually_async(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
                               "the relay gone")
        third = Relays(tmp_path / "relays")
        third.restore()
        assert third.relays["job-1"][0] == int(url.rsplit(":", 1)[1]) and third.relays["job-1"][1] != pid
        await answered(url, b"back\n", b"second back\n")
        third.keep({"job-9"})  # no rank of job-1 here any more: its relay ends
        (ended,) = [p for p in third._children.values()]
        await eventually_async(lambda: ended.poll() is not None, "the relay ended")
        with pytest.raises(OSError):
            await ask(url, b"gone\n")
        Relays(tmp_path / "relays").restore()  # nothing left to take up
        (tmp_path / "relays" / "relays.json").write_text("{not json")  # damaged: said, nothing raised
        Relays(tmp_path / "relays").restore()
        for server in (first, second):
            server.close()

    asyncio.run(run())


@pytest.mark.parametrize("bad", ["127.0.0.1:80", "https://h:1", "http://h", "http://:80", "http://h:0",
                                 "http://h:99999", "http://h:1/x", "http://h:1?q"])
def test_an_address_that_is_no_lighthouses_is_refused(bad):
    with pytest.raises(ValueError, match="not a lighthouse address"):
        parse(bad)


def test_a_job_id_that_is_no_file_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a job id"):
        Relays(tmp_path).relay("../etc", "http://127.0.0.1:1")
