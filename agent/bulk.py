"""The snapshot bulk port: one held snapshot per TCP connection, faster than gRPC's messages.

A peer restoring a rank asks this node's SnapshotService to `Open` a snapshot (over gRPC, so the same
authentication and authorization as every other snapshot call) and gets a one-time ticket: a random
token, the file's size and CRC-32 as recorded, and this port. It connects here, sends the token, and
reads exactly `size` bytes; the receiver checks the CRC-32 before it keeps the file, as for a stream.

Python's gRPC costs a copy and a message object per chunk on each end, which held a restore of a
gigabyte under 1 GB/s on loopback; here the sender is one `sendfile` (plaintext) and the receiver a
`recv_into` a reused buffer, both on a thread of their own, so the agents' event loops (their
heartbeats) are not held either. With TLS configured the connection is mutual TLS with the nodes'
certificates, like the service: the file is not sent in the clear because it took another path.

The protocol is only: TLS handshake (if any), TOKEN_BYTES from the client, the file's bytes, close.
A wrong or expired token, a client that does not send one in IO_TIMEOUT_S, or one connection too many
is closed without a byte; the client then falls back to gRPC's Get.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from phalanx import framed, log, tls
from phalanx.clock import Clock, RealClock

logger = log.get("snapshots")

TOKEN_BYTES = 32
TICKET_S = 15.0  # a ticket not used within this is dropped (with the file it holds open)
MAX_TICKETS = 64  # tickets outstanding at once; Open is refused beyond (the client streams)
CONNECT_S = 3.0  # reaching a peer's bulk port; a filtered one is given up on soon (the stream is the fallback)
HELLO_S = 5.0  # from a connection to its token, handshake included: no slot is held by a client that trickles
IO_TIMEOUT_S = 15.0  # no byte either way for this long: the peer is gone (as gRPC's keepalive would tell)
MAX_CONNECTIONS = 8  # transfers served (or received) at once; more is refused (the client falls back to the stream)
BUFFER = 4 << 20  # the receiver's read size: 4 MiB measured fastest on loopback (1 MiB: ~10 % slower)


# the threads receives run on: their own, so that transfers never wait on (or hold up) the collectors' threads
RECEIVERS = ThreadPoolExecutor(MAX_CONNECTIONS, thread_name_prefix="snapshot-bulk-receive")


class BulkError(Exception):
    """A bulk transfer that did not happen or did not complete; the message says why. `started`: part of the file
    came (the peer failed or went away mid-transfer), else none did (the port refused, filtered, a handshake that
    failed, a ticket refused, one connection too many)."""

    def __init__(self, message: str, started: bool = False) -> None:
        super().__init__(message)
        self.started = started


@dataclass(frozen=True)
class TlsFiles:
    ca: str
    cert: str
    key: str

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED  # a node presents its certificate, as to the service
        context.load_verify_locations(self.ca)
        context.load_cert_chain(self.cert, self.key)
        return context

    def client_context(self) -> ssl.SSLContext:
        return framed.client_context(self.ca, self.cert, self.key)


@dataclass
class _Ticket:
    file: BinaryIO
    size: int
    expires: float
    node: str = ""  # the node whose certificate may use it ("" = any node: no TLS)


class BulkServer:
    """Serves tickets' files on `host`:`port` (0 = a free one) from threads of its own."""

    def __init__(self, host: str, port: int = 0, tls_files: TlsFiles | None = None, clock: Clock | None = None) -> None:
        self._tls = tls_files
        # tickets expire on the injected clock (a decision); a connection's deadlines bound real socket waits
        self._clock = clock or RealClock()
        self.revoked: Callable[[str, bytes], bool] = lambda node, der: False  # (node, its certificate) -> refused
        self._tickets: dict[bytes, _Ticket] = {}
        self._lock = threading.Lock()
        self._active = 0
        self._closed = False
        host = host.strip("[]")
        if ":" in host:  # every address of IPv6 takes IPv4 too, as gRPC's [::] does
            self._sock = socket.create_server((host, port), family=socket.AF_INET6, backlog=MAX_CONNECTIONS,
                                              dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        else:
            self._sock = socket.create_server((host, port), backlog=MAX_CONNECTIONS)
        self._sock.settimeout(1.0)  # the accept loop wakes each second to drop expired tickets
        self.port: int = self._sock.getsockname()[1]
        self.served = 0
        self._thread = threading.Thread(target=self._accept, name="snapshot-bulk", daemon=True)
        self._thread.start()

    def ticket(self, fd: int, size: int, node: str = "") -> bytes:
        """A token for one connection that reads the file open at `fd` (opened by the caller, who checked it: a
        file reclaimed meanwhile is still sent whole); the ticket owns `fd` from here on, refused or not. Raises
        BulkError when too many tickets are outstanding. With `node`, only that node's certificate may use it."""
        with self._lock:
            if len(self._tickets) >= MAX_TICKETS:
                os.close(fd)
                raise BulkError(f"{MAX_TICKETS} bulk tickets outstanding")
        file = open(fd, "rb")  # noqa: SIM115 (closed when the ticket is used or expires)
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._tickets[token] = _Ticket(file, size, self._clock.monotonic() + TICKET_S, node)
        return token

    @property
    def transfers(self) -> int:
        """Connections being served now."""
        with self._lock:
            return self._active

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._tickets)

    def close(self) -> None:
        """Stop accepting and drop the tickets; transfers under way end on their own (their threads are daemons)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        with self._lock:
            for ticket in self._tickets.values():
                ticket.file.close()
            self._tickets.clear()

    def _expire(self, now: float) -> None:
        for token in [t for t, ticket in self._tickets.items() if ticket.expires < now]:
            self._tickets.pop(token).file.close()

    def _take(self, token: bytes) -> _Ticket | None:
        with self._lock:
            self._expire(self._clock.monotonic())
            return self._tickets.pop(token, None)

    def _accept(self) -> None:
        while not self._closed:
            with self._lock:
                self._expire(self._clock.monotonic())
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed:
                    return
                logger.warning("snapshot bulk port: accept failed; trying again", error=str(e))  # EMFILE...
                time.sleep(0.5)
                continue
            with self._lock:
                busy = self._active >= MAX_CONNECTIONS
                if not busy:
                    self._active += 1
            if busy:
                logger.warning("snapshot bulk port: too many transfers at once; one refused", peer=peer[0])
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, peer[0]), name="snapshot-bulk-send",
                                 daemon=True).start()
            except RuntimeError as e:  # no thread to be had
                logger.warning("snapshot bulk port: no thread for a transfer; one refused", error=str(e))
                with self._lock:
                    self._active -= 1
                conn.close()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.settimeout(HELLO_S)  # the handshake's steps; the token has HELLO_S in all
            framed.tune(conn)
            hello_by = time.monotonic() + HELLO_S
            who = None
            if self._tls is not None:
                conn = self._tls.server_context().wrap_socket(conn, server_side=True)
                who = tls.der_identity(conn.getpeercert(binary_form=True) or b"")
                if who is None or who[0] != "node":
                    raise BulkError(f"a peer without a node certificate ({who})")
                if self.revoked(who[1], conn.getpeercert(binary_form=True) or b""):
                    raise BulkError(f"node {who[1]!r} presented a revoked certificate")
            ticket = self._take(_read_exact(conn, TOKEN_BYTES, hello_by))
            if ticket is None:
                raise BulkError("an unknown or expired ticket")
            if ticket.node and (who is None or who[1] != ticket.node):  # a ticket is the node's that asked for it
                ticket.file.close()
                raise BulkError(f"a ticket of node {ticket.node!r} presented by {who[1] if who else 'no node'!r}")
            conn.settimeout(IO_TIMEOUT_S)
            with ticket.file:
                sent = _send(conn, ticket.file, ticket.size)
            if sent != ticket.size:
                raise BulkError(f"sent {sent} of {ticket.size} bytes (the file shrank)")
            with self._lock:
                self.served += 1
        except (OSError, ssl.SSLError, BulkError, ValueError) as e:
            logger.warning("snapshot bulk transfer not served", peer=peer, error=str(e))
        finally:
            with self._lock:
                self._active -= 1
            conn.close()


def _send(conn: socket.socket, file: BinaryIO, size: int) -> int:
    """`sendfile` in plaintext; under TLS, large writes (socket.sendfile's fallback would write 8 KiB at a time)."""
    if not isinstance(conn, ssl.SSLSocket):
        return conn.sendfile(file, 0, size)
    buffer, sent = memoryview(bytearray(min(BUFFER, max(size, 1)))), 0
    while sent < size and (n := file.readinto(buffer[:min(len(buffer), size - sent)])):
        conn.sendall(buffer[:n])
        sent += n
    return sent


def _read_exact(conn: socket.socket, n: int, by: float) -> bytes:
    data = b""
    while len(data) < n:
        left = by - time.monotonic()
        if left <= 0:
            raise BulkError(f"{len(data)} of {n} bytes of the token in {HELLO_S:.0f} s")
        conn.settimeout(left)
        more = conn.recv(n - len(data))
        if not more:
            raise BulkError(f"the connection closed after {len(data)} of {n} bytes")
        data += more
    return data


class Receiver:
    """Reads one ticket's file from a peer's bulk port, on a worker thread; `cancel()` (from any thread) ends it at
    once by shutting its connection down, so a fetch given up on does not go on reading into a file nobody keeps."""

    def __init__(self, host: str, port: int, token: bytes, size: int, tls_files: TlsFiles | None = None,
                 server_node: str = "") -> None:
        self.host, self.port, self.token, self.size = host.strip("[]"), port, token, size
        self.tls_files, self.server_node = tls_files, server_node
        self._sock: socket.socket | None = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def into(self, path: Path) -> tuple[int, int]:
        """Read the file into `path` (made empty first, opened and closed here: a receive given up on writes only
        into its own file); the bytes written and their CRC-32. With TLS, the server must present the certificate
        of `server_node` (else of the host). Raises BulkError (OSError and TLS errors included): the caller may
        fall back to the stream."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise BulkError(f"cannot write {path}: {e.strerror}") from e
        try:
            return self._into(fd)
        finally:
            os.close(fd)

    def _into(self, fd: int) -> tuple[int, int]:
        crc, got = 0, 0
        buffer = memoryview(bytearray(min(BUFFER, max(self.size, 1))))
        try:
            sock = socket.create_connection((self.host, self.port), timeout=CONNECT_S)
            self._sock = sock
            with contextlib.closing(sock):
                if self._cancelled:
                    raise BulkError("cancelled")
                sock.settimeout(IO_TIMEOUT_S)
                framed.tune(sock)
                conn: socket.socket = sock
                if self.tls_files is not None:
                    conn = self.tls_files.client_context().wrap_socket(sock, server_hostname=self.server_node
                                                                       or self.host)
                conn.sendall(self.token)
                while got < self.size:
                    n = conn.recv_into(buffer, min(len(buffer), self.size - got))
                    if not n:
                        raise BulkError(f"the peer closed the bulk connection after {got} of {self.size} bytes",
                                        got > 0)
                    chunk = buffer[:n]
                    crc = zlib.crc32(chunk, crc)
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
                    got += n
        except (OSError, ssl.SSLError) as e:
            why = "cancelled" if self._cancelled else str(e)
            raise BulkError(f"bulk transfer from {self.host}:{self.port} failed after {got} of {self.size} bytes: "
                            f"{why}", got > 0) from e
        return got, crc


def receive(host: str, port: int, token: bytes, size: int, into: Path, tls_files: TlsFiles | None = None,
            server_node: str = "") -> tuple[int, int]:
    """Receiver(...).into(`into`) (blocking)."""
    return Receiver(host, port, token, size, tls_files, server_node).into(into)
