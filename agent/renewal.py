"""The agent renews its own certificate well before it expires, over its authenticated channel.

Two thirds into the certificate's validity (or at once, for one that far gone already), the agent makes a new
key and a request naming itself, asks the controller (NodeService.RenewCertificate, authenticated by the
certificate it still has), and puts the new key and certificate in place of the old ones (written beside them,
then renamed over them: never half a file). The open session goes on undisturbed; the next one, and the metrics'
expiry series, use the new files (tls.ReloadingIdentity). A controller that cannot sign (no ca_key_file, e.g.
an external CA that renews by its own means) is said once, and asked again a day later.
"""

from __future__ import annotations

import asyncio
import datetime
import os
from pathlib import Path

import grpc

from phalanx import clock as clocks
from phalanx import log, pki, tls
from phalanx.clock import Clock, RealClock
from phalanx.rpc import CLIENT_OPTIONS
from phalanx.v1 import node_pb2, node_pb2_grpc

logger = log.get("renewal")

RENEW_AT = 2 / 3  # of the validity gone
RETRY_S = 60.0  # after a failure (the controller out of reach)
REFUSED_RETRY_S = 86_400.0  # after the controller said it cannot renew
TIMEOUT_S = 10.0


def renew_at(identity: tls.Identity) -> datetime.datetime | None:
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(identity.cert)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * RENEW_AT


def _replace(path: str, data: bytes, mode: int) -> None:
    """Write `data` beside `path`, fsync, rename over it: readers see the old file or the new one."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.renewing")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, target)


async def renew_once(identity: tls.ReloadingIdentity, node: str, controller: str, server_name: str = "") -> str:
    """Renew now; returns the new certificate's end. Raises grpc.RpcError, OSError."""
    current = identity.current()
    key_pem, csr_pem = pki.new_key_and_csr(node)
    options = [*CLIENT_OPTIONS, *tls.controller_name_options(server_name)]
    async with grpc.aio.secure_channel(controller, tls.channel_credentials(current.ca, current.cert, current.key),
                                       options=options) as channel:
        reply = await node_pb2_grpc.NodeServiceStub(channel).RenewCertificate(
            node_pb2.RenewCertificateRequest(csr_pem=csr_pem), timeout=TIMEOUT_S)
    _, cert_file, key_file = identity.files
    # what came back must be a certificate for the new key from our CA before anything is replaced
    from phalanx.errors import ConfigError
    try:
        tls._check(current.ca, reply.cert_pem, key_pem, "the renewed certificate", "its new key")
    except ConfigError as e:
        raise OSError(f"the controller's answer does not do: {e}") from None
    # both written beside, then renamed one after the other: ReloadingIdentity keeps the old pair until the
    # pair in place loads
    _replace(key_file, key_pem, 0o600)
    _replace(cert_file, reply.cert_pem, 0o644)
    renewed = identity.current()
    return str(renewed.not_after)


async def run(identity: tls.ReloadingIdentity, node: str, controllers: list[str], server_name: str,
              stop: asyncio.Event, now=lambda: datetime.datetime.now(datetime.UTC),
              clock: Clock | None = None) -> None:
    """Renew whenever it is due, until `stop`; waits on `clock` (the certificate's dates are wall-clock `now`)."""
    clock = clock or RealClock()
    attempt = 0
    while not stop.is_set():
        due = renew_at(identity.current())
        wait = max(0.0, (due - now()).total_seconds()) if due is not None else REFUSED_RETRY_S
        if wait > 0:
            try:
                await clocks.wait_for(clock, stop.wait(), min(wait, 3600.0))
                return
            except TimeoutError:
                continue
        controller = controllers[attempt % len(controllers)]
        attempt += 1
        try:
            until = await renew_once(identity, node, controller, server_name)
            logger.info("certificate renewed", node=node, controller=controller, not_after=until)
            attempt = 0
            continue
        except grpc.RpcError as e:
            refused = e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                                   grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED)
            (logger.warning if refused else logger.info)(
                "certificate not renewed", controller=controller, code=e.code().name, error=e.details(),
                retry_s=REFUSED_RETRY_S if refused else RETRY_S)
            delay = REFUSED_RETRY_S if refused else RETRY_S
        except OSError as e:
            logger.error("renewed certificate not written; the old one stays", error=str(e))
            delay = RETRY_S
        try:
            await clocks.wait_for(clock, stop.wait(), delay)
            return
        except TimeoutError:
            pass
