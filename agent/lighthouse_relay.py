"""A replica-group job's lighthouse, relayed on this node at an address that does not move.

torchft's managers read TORCHFT_LIGHTHOUSE once, at their start, and reconnect to that address, whatever becomes of
the lighthouse. The controller starts a job's lighthouse again when it is gone (its process died; its controller's
host was lost, so the next leader starts it on its own host), and that one may be elsewhere. So the agent gives the
job's ranks a port of its own on this host (`http://127.0.0.1:PORT`) and relays each connection to where the
lighthouse is now: the controller says so at launch (the TORCHFT_LIGHTHOUSE it gives, which the agent replaces) and
whenever it moves (`LighthouseAddress`). A connection open when it moves is closed, so that the manager reconnects,
through the relay, to the new one.

The relay listens on loopback alone: it reaches nothing the node's processes could not reach themselves. Its port
and where it points are kept in the agent's state directory: an agent that restarts, and re-adopts the job's ranks,
opens it again at the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from phalanx import log

logger = log.get("lighthouse-relay")

CONNECT_TIMEOUT_S = 5.0
CHUNK = 65536


def parse(url: str) -> tuple[str, int]:
    """(host, port) of a lighthouse's `http://HOST:PORT`; ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"not a lighthouse address (http://HOST:PORT): {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not port:
        raise ValueError(f"not a lighthouse address (http://HOST:PORT): {url!r}")
    return parts.hostname, port


class Relay:
    """One job's relay: a port on loopback, its connections piped to `upstream`."""

    def __init__(self, job: str, upstream: tuple[str, int], port: int = 0) -> None:
        self.job = job
        self.upstream = upstream
        self.sock = socket.create_server(("127.0.0.1", port))
        self.port: int = self.sock.getsockname()[1]
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[asyncio.Task] = set()
        self._serving = asyncio.get_running_loop().create_task(self._serve(), name=f"lighthouse-relay-{job}")

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._relay, sock=self.sock)

    def point(self, upstream: tuple[str, int]) -> None:
        """The lighthouse is at `upstream` now: the next connections go there, and those open are closed."""
        if upstream == self.upstream:
            return
        self.upstream = upstream
        for pipe in list(self._pipes):
            pipe.cancel()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        theirs: asyncio.StreamWriter | None = None
        try:
            host, port = self.upstream
            up, theirs = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
            await asyncio.gather(_pipe(reader, theirs), _pipe(up, writer))
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the lighthouse not there (yet): the manager's connection fails, and it tries again
        finally:
            self._pipes.discard(task)
            for w in (writer, theirs):
                if w is not None:
                    w.close()

    def close(self) -> None:
        self._serving.cancel()
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(OSError):
            self.sock.close()
        for pipe in list(self._pipes):
            pipe.cancel()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()


class Relays:
    """The relays of the jobs whose ranks run here, by job; kept in `path` (None: nowhere)."""

    def __init__(self, path: Path | None = None) -> None:
        self.relays: dict[str, Relay] = {}
        self.path = path

    def restore(self) -> None:
        """Open again the relays an agent before this one left (its ranks are re-adopted): each at its port, to
        where it pointed. One whose port is taken now is said and left."""
        if self.path is None or not self.path.exists():
            return
        try:
            kept = json.loads(self.path.read_text())
            entries = [(str(job), str(url), int(port)) for job, (url, port) in kept.items()]
        except (OSError, ValueError, TypeError, AttributeError) as e:
            logger.warning("lighthouse relays not restored: unreadable", path=str(self.path), error=str(e))
            return
        for job, url, port in entries:
            try:
                self.relays[job] = Relay(job, parse(url), port)
            except (OSError, ValueError) as e:
                logger.warning("lighthouse relay not restored", job=job, port=port, error=str(e))
        logger.info("lighthouse relays restored", jobs=sorted(self.relays))

    def _save(self) -> None:
        if self.path is None:
            return
        kept = {job: [f"http://{r.upstream[0]}:{r.upstream[1]}", r.port] for job, r in self.relays.items()}
        try:
            part = self.path.with_name(self.path.name + ".part")
            part.write_text(json.dumps(kept))
            os.replace(part, self.path)
        except OSError as e:
            logger.warning("lighthouse relays not kept", path=str(self.path), error=str(e))

    def relay(self, job: str, url: str) -> str:
        """The address to give the job's ranks for the lighthouse at `url`: its relay's, made if needed (and
        pointed at `url`). ValueError for an address that is not a lighthouse's."""
        upstream = parse(url)
        relay = self.relays.get(job)
        if relay is None:
            relay = self.relays[job] = Relay(job, upstream)
            logger.info("lighthouse relayed", job=job, relay=relay.url(), lighthouse=url)
        else:
            relay.point(upstream)
        self._save()
        return relay.url()

    def point(self, job: str, url: str) -> str:
        """The job's lighthouse has moved to `url`; what is done, in words."""
        upstream = parse(url)
        relay = self.relays.get(job)
        if relay is None:
            return f"no ranks of {job} here relay its lighthouse"
        if relay.upstream != upstream:
            relay.point(upstream)
            self._save()
            logger.info("lighthouse moved", job=job, relay=relay.url(), lighthouse=url)
        return f"{job}'s lighthouse relayed to {url}"

    def keep(self, jobs: set[str]) -> None:
        """Close the relays of jobs with no rank here any more."""
        gone = [j for j in self.relays if j not in jobs]
        for job in gone:
            self.relays.pop(job).close()
            logger.info("lighthouse relay closed", job=job)
        if gone:
            self._save()

    def close(self) -> None:
        """The agent stops: the relays close, and stay kept for the agent that starts next (its ranks run on)."""
        for relay in self.relays.values():
            relay.close()
