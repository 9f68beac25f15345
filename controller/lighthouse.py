"""torchft's lighthouse (the quorum of a job's replica groups), one child process per running replica-group job.

The controller starts a job's lighthouse when it places the job and stops it when the job ends; the port is stored in
the job's record, so a controller that restarts, or takes over, serves the job's quorum at the same port again (the
ranks were told `TORCHFT_LIGHTHOUSE=http://[replicas] lighthouse_host:PORT`: a name that follows the leader keeps the
quorum across a takeover). The lighthouse keeps no state a quorum needs across its restart: the groups' next quorum
forms at the new one. Health verdicts reach the quorum by the groups' own processes: the controller stops a group it
has judged at once, and the lighthouse drops it `heartbeat_timeout_ms` later (torchft has no call to remove a member).

Without torchft on the controller's host (`pip install 'phalanx[ft]'`), replica-group jobs run without a lighthouse
of Phalanx's (the ranks are not told one), which the job's event log says once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from controller import lighthouse_main
from controller.config import ReplicasConfig
from controller.lighthouse_main import extension
from phalanx import log

logger = log.get("lighthouse")

START_TIMEOUT_S = 30.0  # the child loads a native extension and binds: well under a second, but a Python start on
# a loaded host can take seconds


class LighthouseError(Exception):
    """A lighthouse could not be started (torchft missing, the port taken): the job runs without one."""


@dataclass
class Child:
    """A process started with posix_spawn: its pid and the write end of its standard input."""

    pid: int
    stdin: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone all the same
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


@dataclass
class Lighthouse:
    job: str
    port: int
    child: Child


class Lighthouses:
    def __init__(self, cfg: ReplicasConfig, host: str = "") -> None:
        """`host`: where the nodes reach this controller, for a config without lighthouse_host."""
        self.cfg = cfg
        self.host = cfg.lighthouse_host or host or socket.gethostname()
        self.running: dict[str, Lighthouse] = {}
        self._available: bool | None = None
        self.closed = False  # the controller stopped (or was demoted): none starts any more

    def available(self) -> bool:
        if self._available is None:
            self._available = self.cfg.lighthouse and extension() is not None
        return self._available

    def url(self, port: int) -> str:
        host = self.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def ensure(self, job: str, port: int = 0) -> int:
        """The job's lighthouse runs (on `port`, when it had one: the ranks were told it); returns its port. Raises
        LighthouseError when it cannot run."""
        running = self.running.get(job)
        if running is not None and running.child.poll() is None:
            return running.port
        if self.closed:
            raise LighthouseError("the controller is stopping")
        if not self.available():
            raise LighthouseError("torchft is not installed on the controller's host (pip install 'phalanx[ft]'), "
                                  "or [replicas] lighthouse = false")
        argv = [sys.executable, "-m", lighthouse_main.__name__, "--bind", f"{self.cfg.lighthouse_bind}:{port}",
                "--heartbeat-timeout-ms", str(self.cfg.heartbeat_timeout_ms),
                "--join-timeout-ms", str(self.cfg.join_timeout_ms), "--quorum-tick-ms", str(self.cfg.quorum_tick_ms)]
        child, out, log = _spawn(argv)
        threading.Thread(target=_drain, args=(log,), name=f"lighthouse-log-{job}", daemon=True).start()
        line = await asyncio.to_thread(_first_line, out, START_TIMEOUT_S)
        threading.Thread(target=_drain, args=(out,), name=f"lighthouse-{job}", daemon=True).start()
        if not line.startswith("ready "):
            await _end(child)
            why = line.removeprefix("error: ") or f"it exited at start (code {child.poll()})"
            raise LighthouseError(why)
        started = int(line.rsplit(":", 1)[1])
        self.running[job] = Lighthouse(job, started, child)
        logger.info("lighthouse started", job=job, port=started, url=self.url(started))
        return started

    def port(self, job: str) -> int:
        """The port of the job's lighthouse running here (0: none)."""
        running = self.running.get(job)
        return running.port if running is not None and running.child.poll() is None else 0

    async def stop(self, job: str) -> None:
        running = self.running.pop(job, None)
        if running is not None:
            await _end(running.child)
            logger.info("lighthouse stopped", job=job, port=running.port)

    async def close(self) -> None:
        self.closed = True
        await asyncio.gather(*(self.stop(job) for job in list(self.running)))


def _spawn(argv: list[str]) -> tuple[Child, int, int]:
    """Start `argv` with posix_spawn, its standard input a pipe from here, its output and its log (stderr) pipes to
    here, apart (torchft's log lines would mix into its ready line): (the child, the read ends of its output and its
    log). Not fork: the controller's gRPC threads make a forked child crash before its exec now and then (grpc's
    fork handlers: a SIGSEGV in a few starts of a hundred under load), and posix_spawn runs no fork handlers."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    log_r, log_w = os.pipe()
    try:
        pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=[
            (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, log_w, 2)])
    except OSError:
        for fd in (in_w, out_r, log_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, log_w):
            with contextlib.suppress(OSError):
                os.close(fd)
    return Child(pid, in_w), out_r, log_r


def _first_line(fd: int, timeout_s: float) -> str:
    """The line it says it is ready with (or why not): torchft's own log lines before it are skipped. "" at its
    end; an error line at the timeout."""
    deadline = time.monotonic() + timeout_s
    buffered = b""
    while True:
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            text = line.decode(errors="replace").strip()
            if text.startswith(("ready ", "error: ")):
                return text
        left = deadline - time.monotonic()
        if left <= 0:
            return f"error: not ready within {timeout_s:g}s"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return ""
            buffered += chunk


def _drain(fd: int) -> None:
    """Read (and drop) what a running lighthouse writes until it ends (torchft logs each quorum)."""
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


async def _end(child: Child) -> None:
    """Close its standard input (it ends then); SIGKILL after 5 s; reaped."""
    with contextlib.suppress(OSError):
        os.close(child.stdin)
    for _ in range(100):
        if child.poll() is not None:
            return
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGKILL)
    await asyncio.to_thread(_reap, child)


def _reap(child: Child) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(child.pid, 0)
    child.returncode = child.returncode if child.returncode is not None else -9
