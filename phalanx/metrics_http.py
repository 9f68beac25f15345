"""Prometheus metrics over plain HTTP, served on the daemon's own event loop.

A daemon's state is safe to read only from its event loop; so instead of prometheus_client's
`start_http_server` (a thread that would read the state while the loop changes it), `GET /metrics`
is answered by a small asyncio server on that very loop. A scrape first calls the daemon's
`snapshot` there, between two callbacks, which copies what the collectors need; then the text is
rendered from that copy in a worker thread, so a large cluster's scrape does not stall the loop.
Anything else gets a 4xx answer; slow, oversized or garbled requests are cut off; nothing a client
sends stops the daemon.

Access (`[metrics]` in both daemons' configs): plain HTTP by default; `tls = true` serves HTTPS with the
daemon's own certificate, `client_cert = true` then asks the scraper for a certificate signed by the
cluster CA, and `basic_auth_file` names the users a scrape must authenticate as (HTTP basic auth).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
from phalanx.config import MetricsAccessConfig, host_port, require
from phalanx.errors import ConfigError

logger = log.get("metrics")

PATH = "/metrics"
EXAMPLE = "0.0.0.0:7371"
MAX_REQUEST_BYTES = 8192  # request line and headers; a scraper sends a few hundred
READ_TIMEOUT_S = 5.0  # to send the whole request
WRITE_TIMEOUT_S = 10.0  # for a client to take the answer
MAX_CLIENTS = 16  # connections served at once; more are closed at once (Prometheus needs one)

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


@dataclass(frozen=True)
class Access:
    """How a MetricsServer lets scrapers in: a TLS context (None: plain HTTP) and basic auth users."""

    tls: ssl.SSLContext | None = None
    users: dict[str, str] | None = None  # user -> sha256 hex of the password

    def allows(self, authorization: str) -> bool:
        if not self.users:
            return True
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        digest = hashlib.sha256(password.encode()).hexdigest()
        expected = self.users.get(user, "")
        return bool(sep) and hmac.compare_digest(digest, expected or "x" * 64) and bool(expected)


def access(cfg: MetricsAccessConfig, ca_file: str, cert_file: str, key_file: str) -> Access:
    """The Access `cfg` asks for, with the daemon's own certificate files. Raises ConfigError naming the key and
    the file when one cannot be read."""
    context = None
    if cfg.tls:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert_file, key_file)
            if cfg.client_cert:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"metrics.tls: cannot use [security] cert_file {cert_file}, key_file {key_file}"
                              f"{' and ca_file ' + ca_file if cfg.client_cert else ''}: {e}") from None
    users = None
    if cfg.basic_auth_file:
        users = {}
        try:
            lines = Path(cfg.basic_auth_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"metrics.basic_auth_file: cannot read {cfg.basic_auth_file}: "
                              f"{getattr(e, 'strerror', None) or e}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or len(parts[1]) != 64 or any(c not in "0123456789abcdef" for c in parts[1].lower()):
                raise ConfigError(f"metrics.basic_auth_file: {cfg.basic_auth_file}:{n}: write 'USER SHA256', the "
                                  "SHA-256 of the password in hex (printf %s PASSWORD | sha256sum)")
            users[parts[0]] = parts[1].lower()
        require(bool(users), f"metrics.basic_auth_file: {cfg.basic_auth_file} names no user")
    return Access(context, users)


class CertificateExpiry:
    """`phalanx_certificate_expiry_timestamp_seconds{file}`: when each of the daemon's certificates expires, read
    from the file at every scrape (a renewed file shows at once); a file that cannot be read is left out, and
    `phalanx_certificate_readable{file}` says so."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        expiry = GaugeMetricFamily("phalanx_certificate_expiry_timestamp_seconds", "When the certificate expires "
                                   "(Unix time); alert well before (alerts/phalanx.rules.yml).", labels=["file"])
        readable = GaugeMetricFamily("phalanx_certificate_readable", "1 if the certificate file could be read and "
                                     "parsed at this scrape.", labels=["file"])
        for path in self.paths:
            not_after = _not_after(path)
            readable.add_metric([path], 0 if not_after is None else 1)
            if not_after is not None:
                expiry.add_metric([path], not_after)
        yield expiry
        yield readable


def _not_after(path: str) -> float | None:
    try:
        from cryptography import x509
        return x509.load_pem_x509_certificate(Path(path).read_bytes()).not_valid_after_utc.timestamp()
    except Exception:  # missing, unreadable, not a certificate, no cryptography: said by phalanx_certificate_readable
        return None


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
        self.access = Access()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()  # one per open connection
        self._scraping = asyncio.Lock()  # one scrape at a time: a flood of them costs one core, not many

    async def start(self, listen: str, access: Access | None = None) -> int:
        """Bind and serve. Returns the bound port. Raises OSError (ConfigError for a bad address)."""
        host, port = host_port("metrics_listen", listen, EXAMPLE)
        self.access = access or Access()
        try:
            tls = {"ssl": self.access.tls, "ssl_handshake_timeout": READ_TIMEOUT_S} if self.access.tls else {}
            self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_BYTES, **tls)
        except OSError as e:  # asyncio says "error while attempting to bind on address (...): address already in use"
            why = (e.strerror or str(e)).rsplit(": ", 1)[-1].lower()
            raise OSError(f"cannot serve metrics on {listen}: {why}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("metrics serving", listen=listen, port=self.port, path=PATH,
                    scheme="https" if self.access.tls else "http", basic_auth=bool(self.access.users))
        return self.port

    async def serve(self, listen: str, access: Callable[[], Access] | None = None) -> bool:
        """`start`, but an address that cannot be bound, or certificates or users that cannot be read
        (`access` says which), are logged, not raised: a daemon keeps running (and supervising, and
        controlling) without its metrics rather than stop for them, and never serves them with less
        protection than its config asks."""
        try:
            await self.start(listen, access() if access is not None else None)
            return True
        except (OSError, ConfigError) as e:
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
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client went away, or never finished its request (or its TLS): nothing to answer
        except asyncio.CancelledError:
            pass  # the server is closing; a connection task that ends cancelled makes asyncio log it (3.11)
        except Exception:  # a daemon never dies for what a client sent
            logger.exception("metrics request failed")
        finally:
            self._handlers.discard(handler)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, target, authorization = await asyncio.wait_for(self._read_request(reader), READ_TIMEOUT_S)
            if not self.access.allows(authorization):
                raise _BadRequest(401, "authenticate (HTTP basic auth) as a user of metrics.basic_auth_file")
            status, body, content_type = await self.answer(method, target)
        except _BadRequest as e:
            method, status, body, content_type = "GET", e.status, f"{e}\n".encode(), "text/plain; charset=utf-8"
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        if status == 405:
            head += "Allow: GET, HEAD\r\n"
        if status == 401:
            head += 'WWW-Authenticate: Basic realm="phalanx metrics"\r\n'
        writer.write(head.encode() + b"\r\n" + (b"" if method == "HEAD" else body))
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, str]:
        """The request line's method and target, and the Authorization header ("" if none); the other headers
        are read and ignored."""
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
        authorization = ""
        for line in lines[1:]:
            name, sep, value = line.decode("latin-1").partition(":")
            if sep and name.strip().lower() == "authorization":
                authorization = value.strip()
        return parts[0], parts[1], authorization

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
