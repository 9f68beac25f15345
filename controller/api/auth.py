"""Who may call what: the controller's authorization, on top of mutual TLS.

The TLS layer already proved that a certificate was signed by the cluster CA; this module turns the
verified subject into a `Peer` (role from the OU, name from the CN, as `phalanx certs` issues them)
or, on the token port, a bearer token into one, and lets each call through only when its service
admits that role. Agents may only speak the node service — and only as the node their certificate
names (`require_node`); users and tools need a client certificate or a token for the control API.

Without TLS (``insecure = true``) no interceptor is installed and every peer is anonymous.
"""

from __future__ import annotations

import contextvars
import datetime
import hashlib
import hmac
import inspect
from dataclasses import dataclass
from pathlib import Path

import grpc

from controller import access
from controller.errors import PermissionDenied
from phalanx.errors import ConfigError
from phalanx.request_guard import handler_parts
from phalanx.tls import parse_subject

NODE, CLIENT, CONTROLLER = "node", "client", "controller"

# Services and the roles that may call them; OPEN_SERVICES need no credential, any other service none may call.
SERVICE_ROLES: dict[str, frozenset[str]] = {
    "phalanx.v1.NodeService": frozenset({NODE}),
    "phalanx.v1.ControlService": frozenset({CLIENT}),
    # torchrun's handler runs beside the ranks on a node, or wherever a user starts it.
    "phalanx.v1.RendezvousService": frozenset({CLIENT, NODE}),
}
# With an access file, the rules of each of these services' methods (controller/access.py): clients only.
POLICED = {"phalanx.v1.ControlService": access.METHODS, "phalanx.v1.RendezvousService": access.RENDEZVOUS_METHODS}
# EnrolService: a node that has no certificate yet proves itself with the bootstrap token in its request.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "phalanx.v1.EnrolService"})


@dataclass(frozen=True)
class Peer:
    role: str
    name: str
    via: str  # "certificate" or "token"

    def __str__(self) -> str:
        return f"{self.role} {self.name!r} ({self.via})"


_peer: contextvars.ContextVar[Peer | None] = contextvars.ContextVar("phalanx_peer", default=None)


def current_peer() -> Peer | None:
    """The authenticated caller of the RPC being handled (None when the controller runs insecure)."""
    return _peer.get()


def require_node(name: str) -> None:
    """Raise PermissionDenied unless the caller may act as node `name`: its certificate must be that node's."""
    peer = current_peer()
    if peer is not None and peer.name != name:
        raise PermissionDenied(f"this certificate is for node {peer.name!r}; it cannot act as node {name!r}")


def load_tokens(path: str) -> dict[bytes, str]:
    """Read a tokens file: one ``NAME TOKEN`` per line, '#' comments. Returns sha256(token) → name."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"security.tokens_file {path}: {e.strerror}") from None
    tokens: dict[bytes, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) < 16:
            raise ConfigError(f"security.tokens_file {path}:{number}: expected 'NAME TOKEN' with a token of at "
                              "least 16 characters (e.g. from `openssl rand -hex 32`)")
        tokens[hashlib.sha256(parts[1].encode()).digest()] = parts[0]
    return tokens


class Revoked(Exception):
    def __init__(self, peer: Peer, why: str) -> None:
        super().__init__(why)
        self.peer = peer


class Authorizer(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: dict[bytes, str], revocation=None, policy: access.Policy | None = None) -> None:
        self._tokens = tokens
        self.policy = policy  # the access file: roles on the control API (None: every client an admin)
        self._revocation = revocation  # (role, name, certificate PEM) -> a Revocation, or None

    def identify(self, context: grpc.aio.ServicerContext, metadata: tuple) -> Peer | None:
        """The caller, from its certificate or its token; raises Revoked for a certificate that was revoked."""
        auth = context.auth_context()
        subject = auth.get("x509_subject")
        if subject:
            parsed = parse_subject(subject[0].decode(errors="replace"))
            if not parsed:
                return None
            peer = Peer(*parsed, "certificate")
            pem = auth.get("x509_pem_cert")
            if self._revocation is not None and pem:
                revoked = self._revocation(peer.role, peer.name, pem[0])
                if revoked is not None:
                    when = datetime.datetime.fromtimestamp(revoked.revoked_ns / 1e9, datetime.UTC)
                    raise Revoked(peer, f"the certificate of {peer} was revoked at {when:%Y-%m-%d %H:%M:%S} UTC"
                                  + (f" ({revoked.reason})" if revoked.reason else "")
                                  + "; an operator can issue a new one (or the node enrol again)")
            return peer
        for key, value in metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                name = self._lookup(value[len("Bearer "):].strip())
                return Peer(CLIENT, name, "token") if name else None
        return None

    def _lookup(self, token: str) -> str | None:
        digest = hashlib.sha256(token.encode()).digest()
        for known, name in self._tokens.items():
            if hmac.compare_digest(known, digest):
                return name
        return None

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        service = details.method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES:
            return handler
        roles = SERVICE_ROLES.get(service, frozenset())
        return _guarded(handler, self, roles, details.invocation_metadata, service, details.method)


async def _admit(authorizer: Authorizer, roles: frozenset[str], metadata, service: str,
                 context: grpc.aio.ServicerContext, method: str = "") -> None:
    try:
        peer = authorizer.identify(context, metadata)
    except Revoked as e:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
    if peer is None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{service} needs a client certificate from the cluster CA or a valid token "
                            "(`phalanx certs issue NAME --role client`, or PHALANX_TOKEN)")
    if peer.role not in roles:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{peer} may not call {service} (allowed: {', '.join(sorted(roles)) or 'nobody'})")
    _peer.set(peer)
    if authorizer.policy is None or service not in POLICED:
        return
    try:
        if peer.role != CLIENT:  # a node's certificate speaks for its agent, never for a user's torchrun
            raise PermissionDenied(f"{peer} may not call {service} when an access file is in force: torchrun's "
                                   "handler uses its user's certificate or token (PHALANX_CERT/KEY, PHALANX_TOKEN)")
        access.set_caller(authorizer.policy.admit(peer.name, method.rsplit("/", 1)[-1], POLICED[service]))
    except PermissionDenied as e:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))


def _guarded(handler: grpc.RpcMethodHandler, authorizer: Authorizer, roles: frozenset[str], metadata,
             service: str, method: str = "") -> grpc.RpcMethodHandler:
    """The same handler with `_admit` run first, in the RPC's own task (so `current_peer` sees it)."""
    _, inner, factory = handler_parts(handler)

    if inspect.isasyncgenfunction(inner):
        async def behaviour(request, context):
            await _admit(authorizer, roles, metadata, service, context, method)
            async for reply in inner(request, context):
                yield reply
    else:
        async def behaviour(request, context):
            await _admit(authorizer, roles, metadata, service, context, method)
            return await inner(request, context)

    return factory(behaviour, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)
