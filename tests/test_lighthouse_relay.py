"""The agent's relay of a replica-group job's lighthouse (agent/lighthouse_relay.py): the ranks' address stays, the
lighthouse behind it moves, and an open connection is closed at the move so that its manager reconnects."""

from __future__ import annotations

import asyncio

import pytest

from agent.lighthouse_relay import Relays, parse

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py): sockets on loopback, in this process


async def upstream(name: bytes) -> tuple[asyncio.base_events.Server, str]:
    """A stand-in lighthouse that answers each line with its name and the line."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(name + b" " + line)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def ask(url: str, line: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    host, port = parse(url)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(line)
    return reader, writer, await asyncio.wait_for(reader.readline(), 30)


def test_the_ranks_address_stays_while_the_lighthouse_behind_it_moves():
    async def run() -> None:
        first, first_url = await upstream(b"first")
        second, second_url = await upstream(b"second")
        relays = Relays()
        url = relays.relay("job-1", first_url)
        assert url.startswith("http://127.0.0.1:") and url != first_url
        assert relays.relay("job-1", first_url) == url  # a later launch of the job: the same relay
        reader, writer, said = await ask(url, b"hello\n")
        assert said == b"first hello\n"
        assert relays.point("job-2", second_url) == "no ranks of job-2 here relay its lighthouse"
        assert "relayed to" in relays.point("job-1", second_url)
        assert await asyncio.wait_for(reader.read(), 30) == b""  # the connection to the old one: closed
        writer.close()
        *_, said = await ask(url, b"again\n")
        assert said == b"second again\n"
        relays.keep({"job-9"})  # no rank of job-1 here any more
        assert relays.relays == {}
        with pytest.raises(OSError):
            await ask(url, b"gone\n")
        for server in (first, second):
            server.close()

    asyncio.run(run())


@pytest.mark.parametrize("bad", ["127.0.0.1:80", "https://h:1", "http://h", "http://:80", "http://h:0",
                                 "http://h:99999", "http://h:1/x", "http://h:1?q"])
def test_an_address_that_is_no_lighthouses_is_refused(bad):
    with pytest.raises(ValueError, match="not a lighthouse address"):
        parse(bad)


def test_an_agent_that_restarts_opens_its_relays_again_at_the_same_port(tmp_path):
    async def run() -> None:
        lighthouse, lighthouse_url = await upstream(b"lh")
        kept = tmp_path / "lighthouse-relays.json"
        before = Relays(kept)
        url = before.relay("job-1", lighthouse_url)
        before.close()  # the agent stops; its ranks (and their TORCHFT_LIGHTHOUSE) run on
        after = Relays(kept)
        after.restore()
        assert after.relays["job-1"].url() == url
        *_, said = await ask(url, b"still\n")
        assert said == b"lh still\n"
        after.keep(set())  # the job's ranks ended here: closed, and no longer kept
        again = Relays(kept)
        again.restore()
        assert again.relays == {}
        kept.write_text("{not json")  # a damaged file: said, nothing restored, nothing raised
        Relays(kept).restore()
        lighthouse.close()

    asyncio.run(run())
