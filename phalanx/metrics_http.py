"""Prometheus metrics over plain HTTP, served on the daemon's own event loop.

A daemon's state is safe to read only from its event loop; so instead of prometheus_client's
`start_http_server` (a thread that would read the state while the loop changes it), `GET /metrics`
is answered by a small asyncio server on that very loop. A scrape first calls the daemon's
`snapshot` there, between two callbacks, which copies what the collectors need; then the text is
rendered from that copy in a worker thread, so a large cluster's scrape does not stall the loop.
Anything else gets a 4xx answer; slow, oversized or garbled requests are cut off; nothing a client
sends stops the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.registry import Collector

from phalanx import log
from phalanx.config import host_port

logger = log.get("metrics")

PATH = "/metrics"
EXAMPLE = "0.0.0.0:7371"
MAX_REQUEST_BYTES = 8192  # request line and headers; a scraper sends a few hundred
READ_TIMEOUT_S = 5.0  # to send the whole request
WRITE_TIMEOUT_S = 10.0  # for a client to take the answer
MAX_CLIENTS = 16  # connections served at once; more are closed at once (Prometheus needs one)

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


def standard_registry(*collectors: Collector) -> CollectorRegistry:
    """`collectors` plus prometheus_client's process, platform and garbage-collector metrics."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    for collector in collectors:
        registry.register(collector)
    return registry


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class MetricsServer:
    """`GET /metrics` (and HEAD) answered with `generate_latest(registry)`; 404 for other paths.
    `snapshot` runs on the event loop before each scrape; the registry is rendered in a thread."""

    def __init__(self, registry: CollectorRegistry, snapshot: Callable[[], None] = lambda: None) -> None:
        self.registry = registry
        self.snapshot = snapshot
        self.port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()  # one per open connection
        self._scraping = asyncio.Lock()  # one scrape at a time: a flood of them costs one core, not many

    async def start(self, listen: str) -> int:
        """Bind and serve. Returns the bound port. Raises OSError (ConfigError for a bad address)."""
        host, port = host_port("metrics_listen", listen, EXAMPLE)
        try:
            self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES)
        except OSError as e:  # asyncio says "error while attempting to bind on address (...): address already in use"
            why = (e.strerror or str(e)).rsplit(": ", 1)[-1].lower()
            raise OSError(f"cannot serve metrics on {listen}: {why}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("metrics serving", listen=listen, port=self.port, path=PATH)
        return self.port

    async def serve(self, listen: str) -> bool:
        """`start`, but an address that cannot be bound is logged, not raised: a daemon keeps running
        (and supervising, and controlling) without its metrics rather than stop for them."""
        try:
            await self.start(listen)
            return True
        except OSError as e:
            logger.error("metrics not served", listen=listen, error=str(e))
            return False

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: one request, one answer, closed. Nothing a client sends escapes this."""
        if len(self._handlers) >= MAX_CLIENTS:
            writer.close()
            return
        handler = asyncio.current_task()
        self._handlers.add(handler)
        try:
            await self._exchange(reader, writer)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away, or never finished its request: nothing to answer
        except asyncio.CancelledError:
            pass  # the server is closing; a connection task that ends cancelled makes asyncio log it (3.11)
        except Exception:  # a daemon never dies for what a client sent
            logger.exception("metrics request failed")
        finally:
            self._handlers.discard(handler)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, target = await asyncio.wait_for(self._read_request(reader), READ_TIMEOUT_S)
            status, body, content_type = await self.answer(method, target)
        except _BadRequest as e:
            method, status, body, content_type = "GET", e.status, f"{e}\n".encode(), "text/plain; charset=utf-8"
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        if status == 405:
            head += "Allow: GET, HEAD\r\n"
        writer.write(head.encode() + b"\r\n" + (b"" if method == "HEAD" else body))
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
        """The request line's method and target; the headers are read and ignored."""
        size = 0
        lines: list[bytes] = []
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                raise _BadRequest(431, "request line or headers too long") from None
            size += len(line)
            if size > MAX_REQUEST_BYTES:
                raise _BadRequest(431, "request line or headers too long")
            if not line.strip():
                if lines:
                    break
                continue  # tolerate blank lines before the request line (RFC 9112, 2.2)
            lines.append(line)
        parts = lines[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise _BadRequest(400, "not an HTTP request; try GET /metrics")
        return parts[0], parts[1]

    async def answer(self, method: str, target: str) -> tuple[int, bytes, str]:
        """(status, body, content type) for a request."""
        text = "text/plain; charset=utf-8"
        if method not in ("GET", "HEAD"):
            return 405, f"{method[:16]} is not supported; use GET {PATH}\n".encode(), text
        path = target.split("?", 1)[0]
        if path != PATH:
            return 404, f"not found; metrics are at {PATH}\n".encode(), text
        try:
            return 200, await self.render(), CONTENT_TYPE_LATEST
        except Exception as e:  # a collector's bug costs one scrape, not the daemon
            logger.exception("metrics collection failed")
            return 500, f"collecting metrics failed: {type(e).__name__}: {e}\n".encode(), text

    async def render(self) -> bytes:
        async with self._scraping:
            self.snapshot()
            return await asyncio.to_thread(generate_latest, self.registry)
