"""torchft's lighthouse for one replica-group job, started by a controller (controller/lighthouse.py).

`python -m controller.lighthouse_main --bind HOST:PORT --control-bind HOST:PORT --orphan-grace-s S
--heartbeat-timeout-ms N --join-timeout-ms N --quorum-tick-ms N` serves torchft's quorum, with
PHALANX_LIGHTHOUSE_TOKEN in its environment. It prints `ready http://HOST:PORT CONTROL_PORT` once it listens, or
`error: WHY` and exits 1.

It outlives the controller that started it: a controller that restarts, or another that takes over, takes it up
again on its control port, and the job's quorum never notices (torchft's managers, which ask it for a quorum at every
step, would otherwise wait out their quorum timeout and fail). The control port takes a connection that says the
token first, then `keep` (a controller holds the connection open while it looks after the lighthouse) or `stop`. It
ends on `stop`, on SIGTERM, or once no controller has held it for the orphan grace (its controller gone for good).

torchft's lighthouse is native code (`torchft._torchft`). Importing the `torchft` package imports torch, which neither
the controller nor this process may: the extension is loaded from its file, by the path of torchft's package found
without running it.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import importlib.machinery
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import ModuleType


def extension() -> Path | None:
    """torchft's native extension, if torchft is installed (found, not imported)."""
    try:
        spec = importlib.util.find_spec("torchft")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        found = sorted(Path(where).glob("_torchft*.so"))
        if found:
            return found[0]
    return None


def load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
    spec = importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


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
    args = p.parse_args(argv)
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        print(f"error: no {TOKEN_ENV} in the environment", flush=True)
        return 1
    path = extension()
    if path is None:
        print("error: torchft is not installed (pip install 'phalanx[ft]')", flush=True)
        return 1
    try:
        server = load(path).LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                             join_timeout_ms=args.join_timeout_ms,
                                             quorum_tick_ms=args.quorum_tick_ms,
                                             heartbeat_timeout_ms=args.heartbeat_timeout_ms)
        host = args.bind.rsplit(":", 1)[0].strip("[]")
        control = Control(args.control_bind or f"{host}:0", token)
    except Exception as e:  # a port taken, a bad address: said to the controller, which decides
        print(f"error: {e}", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: control.done.set())
    threading.Thread(target=control.serve, name="control", daemon=True).start()
    print(f"ready {server.address()} {control.port}", flush=True)
    _detach()
    while not control.done.wait(1.0):
        if control.orphaned_for() > args.orphan_grace_s:
            break
    server.shutdown()
    control.close()
    return 0


TOKEN_ENV = "PHALANX_LIGHTHOUSE_TOKEN"


def _detach() -> None:
    """Once it has said it is ready, nothing of it writes to the controller that started it: its output goes
    nowhere from now on (a write into the pipe of a controller that has gone would fail, and torchft's native log
    would end the process with it). It keeps none of the controller's descriptors either."""
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
    """The control port: a controller's `keep` connection holds the lighthouse; `stop` ends it."""

    def __init__(self, bind: str, token: str) -> None:
        host, _, port = bind.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, int(port)))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.token = token.encode()
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
