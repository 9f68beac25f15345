"""The lighthouse of one replica-group job (the quorum of its groups), started by a controller
(controller/lighthouse.py).

`python -m controller.lighthouse_main --bind HOST:PORT --control-bind HOST:PORT --orphan-grace-s S
--heartbeat-timeout-ms N --join-timeout-ms N --quorum-tick-ms N` serves torchft's lighthouse service (its gRPC
`torchft.LighthouseService`: each group's torchft manager asks it for the quorum at every step and heartbeats to it),
with PHALANX_LIGHTHOUSE_TOKEN in its environment. It prints `ready http://HOST:PORT CONTROL_PORT` once it listens, or
`error: WHY` and exits 1.

The quorum is torchft 0.2.0's (controller/quorum.py), with what torchft's own lighthouse has no call for: the
controller takes a group it has judged out of the quorum at once (`drop`), so that the healthy groups go on at their
next step instead of after the heartbeat timeout. It is Python and protobuf: the controller's host needs no torchft
(and so no torch).

It outlives the controller that started it: a controller that restarts, or another that takes over, takes it up
again on its control port, and the job's quorum never notices (torchft's managers, which ask it for a quorum at every
step, would otherwise wait out their quorum timeout and fail). The control port takes a connection that says the
token first, then `keep` (a controller holds the connection open while it looks after the lighthouse; it answers
`kept`), `drop GROUP WHY` on that connection (replica group GROUP leaves the quorum now: controller/quorum.py; no
answer), or `stop`. It
ends on `stop`, on SIGTERM, or once no controller has held it for the orphan grace (its controller gone for good).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import grpc

from controller.quorum import Dropped, QuorumState
from phalanx.torchft import lighthouse_pb2 as ft
from phalanx.torchft import lighthouse_pb2_grpc as ft_grpc

SERVER_OPTIONS = [("grpc.so_reuseport", 0)]  # a port another lighthouse holds is an error, not a shared port


class Lighthouse(ft_grpc.LighthouseServiceServicer):
    """torchft's lighthouse service on a QuorumState: a request waits for the first quorum that names it (one
    that does not is joined again, as torchft's does), and the quorum is looked at on each request, each drop and
    every tick."""

    def __init__(self, state: QuorumState) -> None:
        self.state = state
        self.waiting: list[tuple[ft.QuorumMember, asyncio.Future[ft.Quorum]]] = []
        self.reason = ""  # why the quorum is (not) met, as last looked at
        self.issued = 0  # quorums issued

    async def Quorum(self, request: ft.LighthouseQuorumRequest, context) -> ft.LighthouseQuorumResponse:
        if not request.HasField("requester"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing requester")
        member = request.requester
        loop = asyncio.get_running_loop()
        waiter: tuple[ft.QuorumMember, asyncio.Future[ft.Quorum]] = (member, loop.create_future())
        try:
            self.state.join(member, loop.time())
        except Dropped:  # taken out: answered at once with a quorum without it (its ranks' step fails)
            return ft.LighthouseQuorumResponse(quorum=self.state.without(member.replica_id))
        self.waiting.append(waiter)
        try:
            self.tick()
            return ft.LighthouseQuorumResponse(quorum=await waiter[1])
        finally:
            with contextlib.suppress(ValueError):
                self.waiting.remove(waiter)

    async def Heartbeat(self, request: ft.LighthouseHeartbeatRequest, context) -> ft.LighthouseHeartbeatResponse:
        self.state.heartbeat(request.replica_id, asyncio.get_running_loop().time())
        return ft.LighthouseHeartbeatResponse()

    def tick(self) -> None:
        now = asyncio.get_running_loop().time()
        quorum, self.reason = self.state.tick(now)
        if quorum is None:
            return
        self.issued += 1
        named = {p.replica_id for p in quorum.participants}
        for member, future in self.waiting:
            if future.done():
                continue
            if member.replica_id in named:
                future.set_result(quorum)
            else:  # not in it: asks for the next one
                self.state.rejoin(member, now)

    def drop(self, group: int, why: str) -> None:
        """Replica group `group` leaves the quorum now: its waiting requests are answered with a quorum without it,
        and the others' quorum is looked at at once."""
        taken = self.state.drop(group, f"replica group {group} was taken out of the quorum by Phalanx: {why}")
        for member, future in self.waiting:
            if member.replica_id in taken and not future.done():
                future.set_result(self.state.without(member.replica_id))
        self.tick()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lighthouse_main")
    p.add_argument("--bind", required=True)
    p.add_argument("--control-bind", default="", help="HOST:PORT of the control port (default: --bind's host, any "
                   "free port)")
    p.add_argument("--orphan-grace-s", type=float, default=600.0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    p.add_argument("--join-timeout-ms", type=int, default=1000)
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    p.add_argument("--expect-groups", default="", help="started again in the place of one gone: the first quorum "
                   "waits for these groups (comma-separated; for --expect-s at most)")
    p.add_argument("--expect-s", type=float, default=30.0)
    args = p.parse_args(argv)
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        print(f"error: no {TOKEN_ENV} in the environment", flush=True)
        return 1
    return asyncio.run(_serve(args, token))


async def _serve(args: argparse.Namespace, token: str) -> int:
    loop = asyncio.get_running_loop()
    # quorum ids from the wall clock in ms: one started again in the place of one gone (a restart, another host)
    # issues none its managers have seen (the one before would have had to issue more than one a millisecond)
    lighthouse = Lighthouse(QuorumState(args.min_replicas, args.join_timeout_ms / 1000,
                                        args.heartbeat_timeout_ms / 1000, first_id=time.time_ns() // 1_000_000,
                                        expect=frozenset(int(g) for g in args.expect_groups.split(",") if g),
                                        expect_until=loop.time() + args.expect_s))
    server = grpc.aio.server(options=SERVER_OPTIONS)
    ft_grpc.add_LighthouseServiceServicer_to_server(lighthouse, server)
    try:
        port = server.add_insecure_port(args.bind)
        if not port:
            raise OSError(f"could not bind {args.bind}")
        await server.start()
        host = args.bind.rsplit(":", 1)[0].strip("[]")
        control = Control(args.control_bind or f"{host}:0", token, lambda group, why: _soon(loop, lighthouse.drop,
                                                                                         group, why))
    except Exception as e:  # a port taken, a bad address: said to the controller, which decides
        print(f"error: {e}", flush=True)
        return 1
    loop.add_signal_handler(signal.SIGTERM, control.done.set)
    threading.Thread(target=control.serve, name="control", daemon=True).start()
    print(f"ready http://{socket.gethostname()}:{port} {control.port}", flush=True)
    _detach()
    tick_s = args.quorum_tick_ms / 1000
    while not control.done.is_set() and control.orphaned_for() <= args.orphan_grace_s:
        await asyncio.sleep(tick_s)
        lighthouse.tick()
    await server.stop(grace=0)
    control.close()
    return 0


TOKEN_ENV = "PHALANX_LIGHTHOUSE_TOKEN"


def _soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    """`fn(*args)` in the loop, from the control thread (nothing once the loop has closed: the lighthouse ends)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _detach() -> None:
    """Once it has said it is ready, nothing of it writes to the controller that started it: its output goes
    nowhere from now on (a write into the pipe of a controller that has gone would fail, and end the process with
    it). It keeps none of the controller's descriptors either."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


CONNECTIONS = 16  # control connections at once: a controller holds one, and a takeover adds another for a moment
TOKEN_DEADLINE_S = 5.0  # a connection says the token within this, whole, or is closed
LINE_MAX = 256


def _lines(conn: socket.socket, deadline_s: float):
    """The lines a connection sends, stripped: the first (the token) within `deadline_s` in all, the next whenever
    they come; no line longer than LINE_MAX (a connection that sends one is done)."""
    end, buffered, first = time.monotonic() + deadline_s, b"", True
    while True:
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            yield line.strip()
            if first:
                first = False
                conn.settimeout(None)
        if len(buffered) > LINE_MAX:
            return
        if first:
            left = end - time.monotonic()
            if left <= 0:
                return
            conn.settimeout(left)
        chunk = conn.recv(4096)
        if not chunk:
            return
        buffered += chunk


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive on a control connection, at both ends: a peer whose host is lost (no FIN, no RST) is found in
    ~25 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Control:
    """The control port: a controller's `keep` connection holds the lighthouse and says which groups to `drop`;
    `stop` ends it."""

    def __init__(self, bind: str, token: str, drop: Callable[[int, str], object] = lambda group, why: None) -> None:
        host, _, port = bind.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, int(port)))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.token = token.encode()
        self.drop = drop
        self.done = threading.Event()
        self._slots = threading.BoundedSemaphore(CONNECTIONS)
        self._lock = threading.Lock()
        self._keepers = 0
        self._alone_since = time.monotonic()  # started: its controller takes it up at once

    def orphaned_for(self) -> float:
        with self._lock:
            return 0.0 if self._keepers else time.monotonic() - self._alone_since

    def serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):  # more connections than any controllers make: refused
                conn.close()
                continue
            try:
                threading.Thread(target=self._talk, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread to be had: this connection is refused, the port serves on
                conn.close()
                self._slots.release()

    def _talk(self, conn: socket.socket) -> None:
        kept = False
        try:
            with conn:
                lines = _lines(conn, TOKEN_DEADLINE_S)
                if not hmac.compare_digest(next(lines, b""), self.token):
                    return
                keepalive(conn)  # a controller whose host is lost lets go of it all the same
                for command in lines:
                    if command == b"keep" and not kept:
                        kept = True
                        with self._lock:
                            self._keepers += 1
                        conn.sendall(b"kept\n")
                    elif command.startswith(b"drop ") and kept:
                        group, _, why = command[5:].decode(errors="replace").partition(" ")
                        if group.isdigit():
                            self.drop(int(group), why or "judged by the controller")
                    elif command == b"stop":
                        conn.sendall(b"stopping\n")
                        self.done.set()
                        return
        except OSError:
            pass
        finally:
            self._slots.release()
            if kept:
                with self._lock:
                    self._keepers -= 1
                    self._alone_since = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


if __name__ == "__main__":
    sys.exit(main())
