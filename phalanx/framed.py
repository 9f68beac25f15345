"""The session port's wire format, and its client end (the agent's session).

An agent's session (NodeService.Session: SessionOpen, then heartbeats up and commands down) is the one call
whose per-message cost sets how many nodes a controller can hold: ten thousand nodes are ten thousand messages
a second. Each costs the controller 240 us of CPU over grpc.aio with mutual TLS, and 114 us as length-prefixed
frames on TLS, at 2,000 nodes on a 2-core Xeon VM (`bench/run.py tls`; bench/RESULTS.md).
Everything else (Register, the control API, rendezvous) stays gRPC.

The semantics are gRPC's for that one call, so both ends reuse their gRPC code unchanged: the controller runs
the same handler through the same interceptors (authorization from the client certificate, revocation, the
request guard), and `FramedCall` behaves as the call object `NodeServiceStub.Session()` returns: `read()`
gives messages then `grpc.aio.EOF`, or raises `grpc.aio.AioRpcError` with the status and trailing metadata
the controller ended the call with (a standby's UNAVAILABLE naming the leader among them).

A frame is a 5-byte header, type (1 byte) and payload length (4 bytes, big-endian), then the payload:
  MESSAGE    a serialized AgentMessage (up) or ControllerMessage (down)
  CLOSE      down only, the last frame: the call's status as JSON {"code", "details", "metadata"}
  HALF_CLOSE up only, empty: the agent sends no more (gRPC's done_writing)
A dead peer is found by TCP keepalive and TCP_USER_TIMEOUT, set on both ends to about gRPC's keepalive
(2 s + 2 s), at no cost to either process.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct

import grpc

from phalanx.rpc import MAX_TRANSPORT_BYTES
from phalanx.tls import der_identity
from phalanx.v1 import node_pb2

HEADER = struct.Struct(">BI")
MESSAGE, CLOSE, HALF_CLOSE = 1, 2, 3
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 2, 1, 2
USER_TIMEOUT_MS = 4_000  # data written and not acknowledged this long: the peer is gone


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def close_payload(code: grpc.StatusCode, details: str, metadata=()) -> bytes:
    return json.dumps({"code": code.value[0], "details": details,
                       "metadata": [[str(k), v.decode() if isinstance(v, bytes) else str(v)]
                                    for k, v in metadata or ()]}).encode()


def parse_close(payload: bytes) -> tuple[grpc.StatusCode, str, tuple]:
    try:
        status = json.loads(payload)
        code = next(c for c in grpc.StatusCode if c.value[0] == status["code"])
        return code, str(status.get("details", "")), tuple((k, v) for k, v in status.get("metadata", ()))
    except (ValueError, KeyError, TypeError, StopIteration):
        return grpc.StatusCode.INTERNAL, f"the controller closed the session with a bad status ({payload[:80]!r})", ()


def tune(sock: socket.socket | None) -> None:
    """Keepalive and a user timeout on a session connection, so a cut link ends the session within seconds."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
    except OSError:
        pass


def session_address(controller: str, port: int) -> str:
    """The session port on the host of `controller` (its gRPC host:port)."""
    host = controller.rsplit(":", 1)[0]
    return f"{host}:{port}"


def client_context(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext:
    """Mutual TLS to the session port: the controller's certificate checked against the cluster CA, this node's
    presented. Made afresh for each session, so a renewed certificate is taken up."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.load_cert_chain(cert_file, key_file)
    return context


def _error(code: grpc.StatusCode, details: str, metadata=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata), details)


class FramedCall:
    """One session on a controller's session port, with the part of grpc.aio's StreamStreamCall the agent uses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> None:
        self._reader, self._writer, self.address = reader, writer, address
        self._status: tuple[grpc.StatusCode, str, tuple] | None = None
        self._writing = True

    @classmethod
    async def open(cls, address: str, context: ssl.SSLContext | None, server_name: str = "",
                   timeout_s: float = 10.0) -> FramedCall:
        """Connect (and shake hands); a failure is the UNAVAILABLE a gRPC call to a dead address ends with."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                host, int(port), ssl=context, server_hostname=(server_name or host) if context else None,
                limit=MAX_TRANSPORT_BYTES + HEADER.size), timeout_s)
        except (OSError, TimeoutError, ssl.SSLError, ValueError) as e:
            hint = (" (nothing listens there: is the controller's session_listen set to this port? The agent's "
                    "session_port must match it, or be 0 for sessions over gRPC)"
                    if isinstance(e, ConnectionRefusedError) or "Connect call failed" in str(e) else "")
            raise _error(grpc.StatusCode.UNAVAILABLE, f"cannot reach the session port {address}: "
                         f"{e or type(e).__name__}{hint}") from None
        tune(writer.get_extra_info("socket"))
        ssl_object = writer.get_extra_info("ssl_object") if context else None
        if ssl_object is not None:  # verified by the CA; it must also be a controller's, not a node's (whose
            der = ssl_object.getpeercert(binary_form=True)  # certificate is a server certificate too)
            identity = der_identity(der) if der else None
            if identity is None or identity[0] != "controller":
                writer.close()
                raise _error(grpc.StatusCode.UNAVAILABLE, f"the session port {address} presented the certificate of "
                             f"{'a ' + identity[0] + ' ' + repr(identity[1]) if identity else 'no Phalanx role'}, not "
                             "a controller's: refused")
        return cls(reader, writer, address)

    async def write(self, message) -> None:
        if self._status is not None or not self._writing or self._writer.is_closing():
            raise asyncio.InvalidStateError("the session has ended")
        self._writer.write(frame(MESSAGE, message.SerializeToString()))
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self._end(grpc.StatusCode.UNAVAILABLE, f"session port {self.address}: {e}")
            raise self._raise() from None

    async def done_writing(self) -> None:
        if self._writing and self._status is None and not self._writer.is_closing():
            self._writing = False
            self._writer.write(frame(HALF_CLOSE))

    async def read(self):
        if self._status is not None:
            return self._result()
        try:
            kind, size = HEADER.unpack(await self._reader.readexactly(HEADER.size))
            if size > MAX_TRANSPORT_BYTES:
                raise ConnectionError(f"a frame of {size} bytes; the limit is {MAX_TRANSPORT_BYTES}")
            payload = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError) as e:
            self._end(grpc.StatusCode.UNAVAILABLE, f"the session port {self.address} closed the connection"
                      + (f" ({e})" if str(e) and not isinstance(e, asyncio.IncompleteReadError) else ""))
            return self._result()
        if kind == MESSAGE:
            return node_pb2.ControllerMessage.FromString(payload)
        if kind == CLOSE:
            self._status = parse_close(payload)
        else:
            self._end(grpc.StatusCode.INTERNAL, f"an unknown frame type {kind} from {self.address}")
        return self._result()

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        if self._status is None:
            self._status = (code, details, ())
        self._writer.close()

    def _result(self):
        self._writer.close()
        if self._status[0] == grpc.StatusCode.OK:
            return grpc.aio.EOF
        raise self._raise()

    def _raise(self) -> grpc.aio.AioRpcError:
        code, details, metadata = self._status
        return _error(code, details, metadata)

    def cancel(self) -> bool:
        if self._status is None:
            self._status = (grpc.StatusCode.CANCELLED, "cancelled by the agent", ())
        self._writer.close()
        return True

    async def code(self) -> grpc.StatusCode:
        return self._status[0] if self._status else grpc.StatusCode.UNKNOWN

    async def details(self) -> str:
        return self._status[1] if self._status else ""
