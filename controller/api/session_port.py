"""The controller's session port: NodeService.Session in frames on mutual TLS (the format: phalanx/framed.py).

Each connection is one call of NodeService.Session, run by the same handler as on the gRPC port, found through
the same interceptors (`resolve`: authorization from the client certificate and its revocation, the request
guard), with `FramedContext` standing in for grpc.aio's servicer context. A leader serves sessions; a standby
parks them (controller/api/node_service.py, ParkedSessions) and refuses the rest naming the leader, exactly as
on its gRPC port, because `resolve` follows the role of the moment (controller/switchboard.py).

The read path is an asyncio.Protocol, not streams: the frames of a heartbeat are cut out of the received bytes
and handed to the waiting reader with one future and no per-message task, which is most of what this port saves.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import ssl
from collections.abc import Awaitable, Callable

import grpc

from phalanx import framed, log, tls
from phalanx.rpc import MAX_TRANSPORT_BYTES

logger = log.get("session-port")

SESSION_METHOD = "/phalanx.v1.NodeService/Session"
QUEUED_FRAMES = 64  # frames read and not yet taken by the handler before the connection stops being read
QUEUED_BYTES = 4 << 20  # or their bytes: a connection holds at most about this plus one frame (MAX_TRANSPORT_BYTES)
#                         plus the frame being read, not QUEUED_FRAMES frames of the largest size (1 GiB)


class _Details:
    """What a grpc.HandlerCallDetails gives the interceptors."""
    method = SESSION_METHOD
    invocation_metadata = ()


class FramedContext:
    """The part of grpc.aio.ServicerContext the session handlers and interceptors use."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.decode: Callable[[bytes], object] | None = None
        self.encode: Callable[[object], bytes] | None = None
        self.code, self.details, self.trailing = grpc.StatusCode.OK, "", ()

    async def read(self):
        raw = await self._conn.next_frame()
        if raw is None:
            return grpc.aio.EOF
        return self.decode(raw) if self.decode is not None else raw

    async def write(self, message) -> None:
        await self._conn.send(self.encode(message) if self.encode is not None else message)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError(details)

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def invocation_metadata(self):
        return ()

    def peer(self) -> str:
        return self._conn.peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._conn.auth


async def _requests(context: FramedContext):
    while (message := await context.read()) is not grpc.aio.EOF:
        yield message


class _Connection(asyncio.Protocol):
    def __init__(self, port: SessionPort) -> None:
        self._port = port
        self._buffer = bytearray()
        self._frames: collections.deque[bytes | None] = collections.deque()
        self.queued = 0  # bytes of the frames in _frames
        self._waiter: asyncio.Future | None = None
        self._writable: asyncio.Future | None = None
        self._reading = True
        self.lost = False
        self.peer = ""
        self.auth: dict[str, list[bytes]] = {}
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        framed.tune(transport.get_extra_info("socket"))
        host, port = (transport.get_extra_info("peername") or ("?", 0))[:2]
        self.peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None and (der := ssl_object.getpeercert(binary_form=True)):
            self.auth = tls.auth_context_of(der)
        self._port.connections.add(self)
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="session-port")

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        size = framed.HEADER.size
        while len(buffer) >= size:
            kind, length = framed.HEADER.unpack_from(buffer)
            if length > MAX_TRANSPORT_BYTES or kind not in (framed.MESSAGE, framed.HALF_CLOSE):
                logger.warning("session port: a bad frame; closing", peer=self.peer, kind=kind, length=length)
                self._push(None)
                self._transport.abort()
                return
            if len(buffer) < size + length:
                break
            self._push(bytes(buffer[size:size + length]) if kind == framed.MESSAGE else None)
            del buffer[:size + length]
        if (len(self._frames) >= QUEUED_FRAMES or self.queued >= QUEUED_BYTES) and self._reading:
            self._reading = False
            self._transport.pause_reading()

    @property
    def reading(self) -> bool:
        return self._reading

    def _push(self, raw: bytes | None) -> None:
        self._frames.append(raw)
        self.queued += len(raw or b"")
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def eof_received(self) -> bool:
        self._push(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._port.connections.discard(self)
        self._push(None)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # as gRPC cancels the handler of a call whose client went away

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    async def next_frame(self) -> bytes | None:
        while not self._frames:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        raw = self._frames[0]
        if raw is not None:  # the end stays, for every later read
            self._frames.popleft()
            self.queued -= len(raw)
        if not self._reading and len(self._frames) < QUEUED_FRAMES // 2 and self.queued < QUEUED_BYTES // 2:
            self._reading = True
            self._transport.resume_reading()
        return raw

    async def send(self, payload: bytes) -> None:
        if self.lost:
            raise ConnectionError("the agent went away")
        self._transport.write(framed.frame(framed.MESSAGE, payload))
        if self._writable is not None:
            await self._writable

    async def _serve(self) -> None:
        context = FramedContext(self)
        try:
            handler = await self._port.resolve(_Details())
            if handler is None or handler.stream_stream is None:
                context.code, context.details = grpc.StatusCode.UNIMPLEMENTED, "this controller serves no sessions now"
            else:
                context.decode, context.encode = handler.request_deserializer, handler.response_serializer
                result = handler.stream_stream(_requests(context), context)
                if inspect.isasyncgen(result):
                    async for reply in result:
                        await context.write(reply)
                else:
                    await result
        except grpc.aio.AbortError:
            pass
        except asyncio.CancelledError:
            self._transport.abort()
            raise
        except Exception as e:
            logger.exception("session port: the session failed", peer=self.peer)
            context.code, context.details = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
        if not self.lost:
            self._transport.write(framed.frame(framed.CLOSE, framed.close_payload(
                context.code, context.details, context.trailing)))
            self._transport.close()


class SessionPort:
    """Serves NodeService.Session on `listen` until stopped. `resolve` gives the handler (through the
    interceptors) for a call, as controller/switchboard.py's Switchboard.resolve does."""

    def __init__(self, resolve: Callable[[object], Awaitable[grpc.RpcMethodHandler | None]],
                 identity: tls.ReloadingIdentity | None) -> None:
        self.resolve = resolve
        self._identity = identity
        self._loaded: tls.Identity | None = None
        self._context = self._ssl_context() if identity is not None else None
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: a node presents its certificate
        self._load(context)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        ca_file, cert_file, key_file = self._identity.files
        context.load_verify_locations(ca_file)
        context.load_cert_chain(cert_file, key_file)
        self._loaded = self._identity.identity

    def _new_connection(self) -> _Connection:
        if self._identity is not None and self._identity.current() is not self._loaded:
            try:  # a renewed certificate: for the handshakes from now on
                self._load(self._context)
            except (OSError, ssl.SSLError) as e:
                logger.error("session port: the renewed certificate does not load; the one before stays",
                             error=str(e))
        return _Connection(self)

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        try:
            self._server = await asyncio.get_running_loop().create_server(
                self._new_connection, host.strip("[]") or None, int(port), ssl=self._context, backlog=4096,
                reuse_address=True)
        except OSError as e:
            raise OSError(f"cannot listen on session_listen {listen}: {e.strerror or e}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Every session ends now (their handlers are cancelled, as a gRPC server's stop(0) does)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
