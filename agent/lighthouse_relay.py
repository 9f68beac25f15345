"""A replica-group job's lighthouse, relayed on this node at an address that does not move.

torchft's managers read TORCHFT_LIGHTHOUSE once, at their start, and reconnect to that address, whatever becomes of
the lighthouse. The controller starts a job's lighthouse again when it is gone (its process died; its controller's
host was lost, so the next leader starts it on its own host), and that one may be elsewhere. So the agent gives the
job's ranks a port on this host (`http://127.0.0.1:PORT`) and relays each connection to where the lighthouse is now:
the controller says so at launch (the TORCHFT_LIGHTHOUSE it gives, which the agent replaces) and whenever it moves
(`LighthouseAddress`). A connection open when it moves is closed, so that the manager reconnects, through the relay,
to the new one.

Each job's relay is a small process of its own (`python -m agent.lighthouse_relay`), in a session of its own, as
the ranks are: it outlives the agent, so an agent that restarts (an upgrade) leaves the quorum undisturbed, and the
agent that starts next takes it up again. It serves on the listening socket the agent bound (a descriptor it is
given), and reads where to relay from a file of its own (`<state_dir>/lighthouse-relays/JOB.url`), which the agent
replaces when the lighthouse moves; it ends when the file is removed (the job has no rank here any more), or after
ten minutes without a connection. The relay listens on loopback alone: it reaches nothing the node's processes could
not reach themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from phalanx import log

logger = log.get("lighthouse-relay")

CONNECT_TIMEOUT_S = 5.0
CHUNK = 65536
LOOK_S = 0.2  # how often a relay looks at its file (where to relay, or whether to end)
IDLE_S = 600.0  # a relay with no connection for this long ends (an agent that would have ended it is gone for good;
# a node whose ranks never reach the lighthouse: only a group's first rank does. A launch here starts it again)


def parse(url: str) -> tuple[str, int]:
    """(host, port) of a lighthouse's `http://HOST:PORT` (HOST in brackets if IPv6); ValueError for anything else."""
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


# -- the relay process ------------------------------------------------------------------------------------------

class Relay:
    """One job's relay: the listening socket `sock`, its connections piped to where `path` says."""

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self.sock, self.path = sock, path
        self.upstream: tuple[str, int] | None = None
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime_ns, size) of the file as last read
        self._pipes: set[asyncio.Task] = set()
        self.accepted = 0  # connections since the serving loop last looked

    def look(self) -> bool:
        """Read where to relay if the file changed; False once it is gone (the relay ends)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False
        if (st.st_ino, st.st_mtime_ns, st.st_size) != self._seen:  # (replaced: a new inode, whatever its time)
            self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            try:
                upstream = parse(self.path.read_text().strip())
            except (OSError, ValueError):
                return True  # (being replaced: read at the next look)
            if upstream != self.upstream:
                self.upstream = upstream
                for pipe in list(self._pipes):  # a connection to where it was: closed, the manager reconnects
                    pipe.cancel()
        return True

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        self.accepted += 1
        theirs: asyncio.StreamWriter | None = None
        try:
            if self.upstream is None:
                return
            up, theirs = await asyncio.wait_for(asyncio.open_connection(*self.upstream), CONNECT_TIMEOUT_S)
            async with asyncio.TaskGroup() as group:
                group.create_task(_pipe(reader, theirs))
                group.create_task(_pipe(up, writer))
        except (OSError, TimeoutError, ExceptionGroup):
            pass  # the lighthouse not there (yet): the manager's connection fails, and it tries again
        finally:
            self._pipes.discard(task)
            for w in (writer, theirs):
                if w is not None:
                    w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()


async def _serve(path: Path, fd: int) -> int:
    relay = Relay(socket.socket(fileno=fd), path)
    if not relay.look():
        return 0
    server = await asyncio.start_server(relay.relay, sock=relay.sock)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    loop = asyncio.get_running_loop()
    active = loop.time()
    while not stop.is_set() and relay.look():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), LOOK_S)
        if relay._pipes or relay.accepted:
            active, relay.accepted = loop.time(), 0
        elif loop.time() - active > IDLE_S:
            break
    server.close()
    for pipe in list(relay._pipes):
        pipe.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lighthouse_relay", description="relay a job's lighthouse on this node (started "
                                "by the agent, which gives it the listening socket)")
    p.add_argument("--url-file", required=True, type=Path, help="where to relay (http://HOST:PORT); ends when removed")
    p.add_argument("--fd", required=True, type=int, help="the listening socket's descriptor")
    args = p.parse_args(argv)
    return asyncio.run(_serve(args.url_file, args.fd))


if __name__ == "__main__":
    sys.exit(main())


# -- the agent's side ----------------------------------------------------------------------------------------------

class Relays:
    """The relays of the jobs whose ranks run here, by job: their processes, kept in `root` (their url files, and
    `relays.json`: each job's port and pid) for the agent that starts next."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.relays: dict[str, tuple[int, int]] = {}  # job -> (port, pid)
        self._children: dict[int, subprocess.Popen] = {}  # started by this agent: reaped when they end

    def _url_file(self, job: str) -> Path:
        if not job or not all(c.isalnum() or c in "._-" for c in job) or job.startswith("."):
            raise ValueError(f"not a job id: {job!r}")
        return self.root / f"{job}.url"

    def _alive(self, pid: int) -> bool:
        child = self._children.get(pid)
        if child is not None:
            return child.poll() is None
        try:
            return __name__ in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False

    def restore(self) -> None:
        """Take up the relays an agent before this one left (their ranks are re-adopted): each whose process still
        runs; one that ended is started again at its port (said if that port is taken now)."""
        try:
            kept = json.loads((self.root / "relays.json").read_text())
            entries = [(str(job), int(port), int(pid)) for job, (port, pid) in kept.items()]
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as e:
            logger.warning("lighthouse relays not taken up: unreadable", path=str(self.root), error=str(e))
            return
        for job, port, pid in entries:
            if self._alive(pid):
                self.relays[job] = (port, pid)
            elif self._url_file(job).exists():
                try:
                    self._start(job, port)
                except OSError as e:
                    logger.warning("lighthouse relay not started again: its port is taken", job=job, port=port,
                                   error=str(e))
        self._save()
        if self.relays:
            logger.info("lighthouse relays taken up", jobs=sorted(self.relays))

    def relay(self, job: str, url: str) -> str:
        """The address to give the job's ranks for the lighthouse at `url`: its relay's, started if needed (pointed
        at `url`). A relay already running keeps where it points: the controller says where the lighthouse is now
        (`point`), and a launch's address may be older. ValueError for an address that is not a lighthouse's."""
        parse(url)
        held = self.relays.get(job)
        if held is not None and self._alive(held[1]):
            return f"http://127.0.0.1:{held[0]}"
        self._write(job, url)
        port = self._start(job, 0)
        logger.info("lighthouse relayed", job=job, relay=f"http://127.0.0.1:{port}", lighthouse=url)
        return f"http://127.0.0.1:{port}"

    def point(self, job: str, url: str) -> str:
        """The job's lighthouse runs at `url` now; what is done, in words."""
        parse(url)
        if job not in self.relays:
            return f"no ranks of {job} here relay its lighthouse"
        self._write(job, url)
        return f"{job}'s lighthouse relayed to {url}"

    def keep(self, jobs: set[str]) -> None:
        """End the relays of jobs with no rank here any more."""
        gone = [j for j in self.relays if j not in jobs]
        for job in gone:
            port, _ = self.relays.pop(job)
            with contextlib.suppress(FileNotFoundError):
                self._url_file(job).unlink()  # (it ends at its next look)
            logger.info("lighthouse relay ended", job=job, port=port)
        self._children = {pid: c for pid, c in self._children.items() if c.poll() is None}
        if gone:
            self._save()

    def _start(self, job: str, port: int) -> int:
        """Start the job's relay process on `port` (0: any), which must be free; returns the port."""
        sock = socket.create_server(("127.0.0.1", port))
        bound = sock.getsockname()[1]
        try:
            child = subprocess.Popen([sys.executable, "-m", __name__, "--url-file", str(self._url_file(job)),
                                      "--fd", str(sock.fileno())], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(sock.fileno(),),
                                     start_new_session=True)
        finally:
            sock.close()  # (the relay holds it now)
        self._children[child.pid] = child
        self.relays[job] = (bound, child.pid)
        self._save()
        return bound

    def _write(self, job: str, url: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        part = self._url_file(job).with_suffix(".part")
        part.write_text(url + "\n")
        os.replace(part, self._url_file(job))

    def _save(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            part = self.root / "relays.json.part"
            part.write_text(json.dumps({job: list(held) for job, held in self.relays.items()}))
            os.replace(part, self.root / "relays.json")
        except OSError as e:
            logger.warning("lighthouse relays not kept", path=str(self.root), error=str(e))
