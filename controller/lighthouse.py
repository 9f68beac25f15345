"""The lighthouse of each running replica-group job (the quorum of its groups, controller/lighthouse_main.py): one
process per job, started by the controller that places the job and stopped when the job ends.

The lighthouse outlives its controller: a controller that restarts, or another that takes over, takes it up again by
its control port, whose host, port and token are in the job's record, and the job's quorum never notices. One that
is gone (its process died, its host was lost) is started again: on the port the ranks were told if it is free, else
on another; the job's nodes are told where it runs (Executor._tell_lighthouse), and each agent relays its ranks'
TORCHFT_LIGHTHOUSE there (agent/lighthouse_relay.py), so torchft's managers, which ask again, reach it
(TORCHFT_QUORUM_RETRIES). One whose controller is gone for good ends after `[replicas] orphan_grace_s`.

Health verdicts reach the quorum at once: the controller stops a group it has judged and tells the lighthouse to
take it out (`drop`), so that the healthy groups' next quorum is issued without it; without that word (a lighthouse
of an earlier release, or the word lost) the lighthouse drops the group `heartbeat_timeout_ms` after its heartbeats
stop, as torchft's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from controller import lighthouse_main
from controller.config import ReplicasConfig
from controller.recovery.table import ACTIVE
from phalanx import log
from phalanx.v1 import common_pb2 as pb

logger = log.get("lighthouse")

KEEP_TIMEOUT_S = 3.0  # connecting to a lighthouse's control port and hearing it say "kept"
START_TIMEOUT_S = 30.0  # the child binds: well under a second, but a Python start on a loaded host can take seconds
AVOID_TRIES = 8  # starts on a port of the kernel's choosing before giving up on one no other job's ranks were told
WHY_MAX = 200  # bytes of a drop's reason sent (the control port reads lines of 256 at most)


class LighthouseError(Exception):
    """A lighthouse could not be started (the port taken, [replicas] lighthouse = false): the job runs without
    one."""


@dataclass
class Child:
    """A process started here with posix_spawn (its pid), reaped when it ends."""

    pid: int
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
    """A job's lighthouse this controller looks after: started here (`child`) or taken up. `keeper` is the held
    connection to its control port: while it is open, the lighthouse is looked after."""

    job: str
    port: int
    host: str  # where the ranks reach it (their TORCHFT_LIGHTHOUSE's host)
    control: str  # HOST:PORT of its control port, HOST the address of the controller host it runs on
    token: str
    keeper: socket.socket
    child: Child | None = None

    def alive(self) -> bool:
        """Whether it runs and holds the connection (a peer gone without a word is found by TCP keepalive)."""
        if self.child is not None and self.child.poll() is not None:
            return False
        try:
            return self.keeper.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:  # nothing to read: the connection holds
            return True
        except OSError:
            return False

    def url(self) -> str:
        return url(self.host, self.port)

    def drop(self, group: int, why: str) -> bool:
        """Tell it that replica group `group` leaves the quorum now (False: the word could not be sent; the
        lighthouse drops the group when its heartbeats stop). A line sent in part would run into the next: the
        connection is closed then, and the lighthouse taken up again (Executor._look_after_lighthouse)."""
        reason = " ".join(why.split()).encode()[:WHY_MAX].decode(errors="ignore")
        line = f"drop {group} {reason}\n".encode()
        try:
            sent = self.keeper.send(line, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            sent = 0
        if sent != len(line):
            with contextlib.suppress(OSError):
                self.keeper.shutdown(socket.SHUT_RDWR)
            return False
        return True


def describe(job, held: Lighthouse | None) -> None:
    """Write where the held lighthouse runs into the job's record (`job`, a pb.Job): its port, host, control port
    and token (none held: the record keeps the last one's)."""
    if held is not None:
        job.lighthouse_port, job.lighthouse_host = held.port, held.host
        job.lighthouse_control, job.lighthouse_token = held.control, held.token


def looks(job, jobs) -> dict:
    """What Lighthouses.ensure is given for `job` (a pb.Job; `jobs`, every job's record): where its lighthouse
    was, the ports other jobs' ranks were told, and, for one started in the place of one gone (the job had one),
    the groups it is to expect (those training). (Groups stopping are told to it at every pass while they stop:
    Executor._look_after_lighthouse.)"""
    had = bool(job.lighthouse_port)
    return {"port": job.lighthouse_port, "host": job.lighthouse_host, "control": job.lighthouse_control,
            "token": job.lighthouse_token, "avoid": told_ports(jobs, job.id),
            "expect": tuple(g.index for g in job.groups if g.state == pb.REPLICA_GROUP_TRAINING) if had else ()}


def told_ports(jobs, job: str) -> frozenset[int]:
    """The lighthouse ports the ranks of the active jobs in `jobs` (pb.Job records) other than `job` were told: a
    lighthouse started on a port of the kernel's choosing avoids them (Lighthouses.ensure)."""
    return frozenset(j.lighthouse_port for j in jobs if j.id != job and j.state in ACTIVE and j.lighthouse_port)


def url(host: str, port: int) -> str:
    return f"http://{_join(host, port)}"


class Lighthouses:
    def __init__(self, cfg: ReplicasConfig, host: str = "") -> None:
        """`host`: where the nodes and the other controllers reach this controller's host (its own address: a
        lighthouse's control port is reached there, whatever lighthouse_host the ranks are told)."""
        self.cfg = cfg
        self.own = host or socket.gethostname()
        self.host = cfg.lighthouse_host or self.own
        self.running: dict[str, Lighthouse] = {}
        self._starting: dict[str, asyncio.Future[Lighthouse]] = {}
        self._let_go: list[Child] = []  # started here and let go (a demotion): reaped when they end
        self.closed = False  # the controller stopped (or was demoted): none starts any more

    def available(self) -> bool:
        return self.cfg.lighthouse

    async def ensure(self, job: str, port: int = 0, host: str = "", control: str = "",
                     token: str = "", avoid: frozenset[int] = frozenset(), expect: tuple[int, ...] = ()) -> Lighthouse:
        """The job's lighthouse, looked after here: the one this controller holds; else the one the job's record
        names (`host`, `control`, `token`), taken up; else one started here (on `port`, when the job had one and it
        is free: its ranks were told it; else on another, which the nodes' agents relay them to). Raises
        LighthouseError when none can run. One look per job at a time; a caller cancelled meanwhile leaves it to
        finish (a lighthouse started is never left unkept). `avoid`: the ports other jobs' ranks were told, which
        one started on a port of the kernel's choosing must not take (their managers, asking again while theirs is
        gone, would join this job's quorum). One started in the place of one gone is told which groups to `expect`
        (those training: its first quorum waits for them)."""
        self._reap()
        held = self.running.get(job)
        if held is not None and held.alive():
            return held
        if held is not None:
            self._forget(job)
        if self.closed:
            raise LighthouseError("the controller is stopping")
        pending = self._starting.get(job)
        if pending is None:
            pending = self._starting[job] = asyncio.ensure_future(self._find(job, port, host, control, token, avoid,
                                                                             expect))
            pending.add_done_callback(lambda f, j=job: self._started(j, f))
        return await asyncio.shield(pending)

    def _started(self, job: str, done: asyncio.Future) -> None:
        self._starting.pop(job, None)
        if not done.cancelled() and done.exception() is not None:  # (retrieved: its callers may have gone)
            logger.debug("no lighthouse", job=job, error=str(done.exception()))

    async def _find(self, job: str, port: int, host: str, control: str, token: str, avoid: frozenset[int],
                    expect: tuple[int, ...]) -> Lighthouse:
        if control and token:
            keeper = await asyncio.to_thread(_keep, control, token)
            if keeper is not None:
                held = self.running[job] = Lighthouse(job, port, host or self.host, control, token, keeper)
                logger.info("lighthouse taken up", job=job, port=port, url=held.url(), control=control)
                return held
        if not self.available():
            raise LighthouseError("[replicas] lighthouse = false")
        held = None
        if port:
            try:
                held = await self._start(job, port, expect)
            except LighthouseError as e:
                logger.warning("lighthouse port taken: started on another", job=job, port=port, error=str(e))
        for _ in range(0 if held is not None else AVOID_TRIES):  # the nodes' agents relay their ranks to it
            held = await self._start(job, 0, expect)  # (Executor._tell_lighthouse)
            if held.port not in avoid:
                break
            await self._end_held(job)
            held = None
        if held is None:
            raise LighthouseError(f"every port given was one another job's ranks were told ({AVOID_TRIES} tries)")
        return held

    async def _start(self, job: str, port: int, expect: tuple[int, ...] = ()) -> Lighthouse:
        bind = self.cfg.lighthouse_bind
        argv = [sys.executable, "-m", lighthouse_main.__name__, "--bind", _join(bind, port),
                "--control-bind", _join(bind, 0), "--orphan-grace-s", f"{self.cfg.orphan_grace_s:g}",
                "--heartbeat-timeout-ms", str(self.cfg.heartbeat_timeout_ms),
                "--join-timeout-ms", str(self.cfg.join_timeout_ms), "--quorum-tick-ms", str(self.cfg.quorum_tick_ms),
                "--expect-groups", ",".join(str(g) for g in expect)]
        token = secrets.token_hex(16)
        child, out, log = _spawn(argv, {**os.environ, lighthouse_main.TOKEN_ENV: token})
        threading.Thread(target=_drain, args=(log,), name=f"lighthouse-log-{job}", daemon=True).start()
        line = await asyncio.to_thread(_first_line, out, START_TIMEOUT_S)
        threading.Thread(target=_drain, args=(out,), name=f"lighthouse-{job}", daemon=True).start()
        words = line.split()
        if line.startswith("ready ") and len(words) == 3:
            started, control_port = int(words[1].rsplit(":", 1)[1]), int(words[2])
            keeper = await asyncio.to_thread(_keep, _join(_local(bind), control_port), token)
            if keeper is not None:
                held = Lighthouse(job, started, self.host, _join(self.own, control_port), token, keeper, child)
                if self.closed:  # the controller stopped while it started: let go, as every other
                    self._let_go.append(child)
                    keeper.close()
                    raise LighthouseError("the controller is stopping")
                self.running[job] = held
                logger.info("lighthouse started", job=job, port=started, url=held.url(), control=held.control)
                return held
            line = "error: its control port did not take this controller's connection"
        await _end(child)
        why = line.removeprefix("error: ") or f"it exited at start (code {child.poll()})"
        raise LighthouseError(why)

    def starting(self, job: str) -> bool:
        """Whether the job's lighthouse is being taken up or started now."""
        return job in self._starting

    def held(self, job: str) -> Lighthouse | None:
        """The job's lighthouse, if this controller looks after it and it runs."""
        held = self.running.get(job)
        return held if held is not None and held.alive() else None

    async def stop(self, job: str) -> None:
        """End the job's lighthouse (the job has ended); one still being found or started is waited for first."""
        pending = self._starting.get(job)
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
        port = held.port if (held := self.running.get(job)) is not None else None
        await self._end_held(job)
        if port is not None:
            logger.info("lighthouse stopped", job=job, port=port)

    async def _end_held(self, job: str) -> None:
        held = self.running.pop(job, None)
        if held is None:
            return
        with contextlib.suppress(OSError):
            held.keeper.sendall(b"stop\n")
        held.keeper.close()
        if held.child is not None:
            await _end(held.child)

    def _forget(self, job: str) -> None:
        held = self.running.pop(job, None)
        if held is not None:
            held.keeper.close()
            if held.child is not None:
                self._let_go.append(held.child)

    def _reap(self) -> None:
        self._let_go = [c for c in self._let_go if c.poll() is None]

    async def close(self) -> None:
        """The controller stops, or no longer leads: the lighthouses are let go, not stopped. Each serves on while
        the controller that leads next takes it up (within `orphan_grace_s`, or it ends)."""
        self.closed = True
        for job in list(self.running):
            self._forget(job)
        self._reap()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _local(bind: str) -> str:
    """Where this host reaches a port bound to `bind`."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bind, bind)


def _keep(control: str, token: str) -> socket.socket | None:
    """A connection that holds the lighthouse at `control` (HOST:PORT; None: nothing there takes it)."""
    host, _, port = control.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=KEEP_TIMEOUT_S)
    except (OSError, ValueError):
        return None
    try:
        sock.sendall(f"{token}\nkeep\n".encode())
        if sock.makefile("rb").readline(64).strip() == b"kept":
            sock.settimeout(None)
            lighthouse_main.keepalive(sock)  # its host lost, the lighthouse is let go of here too
            return sock
    except OSError:
        pass
    sock.close()
    return None


def _spawn(argv: list[str], env: dict[str, str]) -> tuple[Child, int, int]:
    """Start `argv` with posix_spawn in a session of its own (it outlives this controller), its standard input
    /dev/null, its output and its log (stderr) pipes to here, apart (a warning at its start would mix into its ready
    line): (the child, the read ends of its output and its log). Once ready it writes to neither. Not fork: the
    controller's gRPC threads make a forked child crash before its exec now and then (grpc's fork handlers: a
    SIGSEGV in a few starts of a hundred under load), and posix_spawn runs no fork handlers."""
    out_r, out_w = os.pipe()
    log_r, log_w = os.pipe()
    try:
        pid = os.posix_spawn(argv[0], argv, env, setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
            (os.POSIX_SPAWN_DUP2, log_w, 2)])
    except OSError:
        for fd in (out_r, log_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, log_w):
            with contextlib.suppress(OSError):
                os.close(fd)
    return Child(pid), out_r, log_r


def _first_line(fd: int, timeout_s: float) -> str:
    """The line it says it is ready with (or why not): other lines before it (a warning) are skipped. "" at its
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
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        if poller.poll(left * 1000):
            chunk = os.read(fd, 65536)
            if not chunk:
                return ""
            buffered += chunk


def _drain(fd: int) -> None:
    """Read (and drop) what a running lighthouse writes until it ends."""
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


async def _end(child: Child) -> None:
    """SIGTERM (it was told to stop; this is in case it could not hear); SIGKILL after 5 s; reaped."""
    for i in range(100):
        if child.poll() is not None:
            return
        if i == 20:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGKILL)
    await asyncio.to_thread(_reap, child)


def _reap(child: Child) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(child.pid, 0)
    child.returncode = child.returncode if child.returncode is not None else -9
