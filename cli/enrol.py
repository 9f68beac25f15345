"""`phalanx certs enrol`: a node gets its own certificate with a bootstrap token, its key never leaving it.

1. The controller's token port is dialled trusting whatever certificate it shows, for one thing only: the
   cluster CA (EnrolService.GetClusterCa). Its hash must be the one the operator gave (`--ca-hash`, printed by
   `phalanx certs token create`), or nothing else happens: a wrong controller, or someone in between, learns
   nothing and gets nothing.
2. With that CA trusted, the node makes its key and a request naming itself and sends it with the token
   (EnrolService.Enrol); the controller checks the token and the name and signs.
3. The key (0600), the certificate and the CA go where the agent's config looks (`/etc/phalanx/pki/node.*`).
"""

from __future__ import annotations

import os
import ssl

import grpc

from phalanx import pki, tls
from phalanx.rpc import CLIENT_OPTIONS
from phalanx.v1 import enrol_pb2, enrol_pb2_grpc

TIMEOUT_S = 10.0


class EnrolError(Exception):
    """Enrolment failed; the message says why and what to do. Nothing was written. `usage`: the arguments were
    wrong (exit 2), not the controller's answer or the network (exit 1)."""

    def __init__(self, message: str, usage: bool = False, unreached: bool = False) -> None:
        super().__init__(message)
        self.usage = usage
        self.unreached = unreached  # the controller could not be reached, or is a standby: another one may do


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EnrolError(f"--controller {address!r} must be HOST:PORT, the controller's token port (token_listen)",
                         usage=True)
    return host.strip("[]"), int(port)


def _call(address: str, root: bytes, fn, options: tuple = ()):
    channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root),
                                  [*CLIENT_OPTIONS, *options])
    try:
        return fn(enrol_pb2_grpc.EnrolServiceStub(channel))
    except grpc.RpcError as e:
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            # not answered in time: the token may have been used up already, so no other controller is asked
            raise EnrolError(f"cannot reach the controller's token port at {address}: {e.details()}",
                             unreached=code == grpc.StatusCode.UNAVAILABLE) from None
        raise EnrolError(f"the controller refused: {e.details()} ({code.name})") from None
    finally:
        channel.close()


def fetch_ca(address: str, ca_hash: str) -> bytes:
    """The cluster CA from the controller at `address`, once its hash is `ca_hash`. Raises EnrolError."""
    host, port = _split(address)
    try:
        shown = ssl.get_server_certificate((host, port), timeout=TIMEOUT_S).encode()
    except (OSError, ssl.SSLError) as e:
        raise EnrolError(f"cannot reach the controller's token port at {address}: {e}", unreached=True) from None
    ca = _call(address, shown, lambda s: s.GetClusterCa(enrol_pb2.GetClusterCaRequest(), timeout=TIMEOUT_S)).ca_pem
    try:
        actual = pki.ca_hash(ca)
    except ValueError:
        raise EnrolError(f"the controller at {address} sent no CA certificate") from None
    if actual != ca_hash.strip().lower():
        raise EnrolError(f"the controller at {address} has a CA with hash {actual}, not the {ca_hash} you were "
                         "given: refusing it (a wrong address, another cluster, or someone in between); nothing "
                         "was sent or written")
    return ca


def enrol(address: str, token: str, ca_hash: str, name: str, directory: str, stem: str = "node") -> pki.Issued:
    """Enrol node `name`; writes STEM.key, STEM.crt and ca.crt in `directory`. Raises EnrolError, pki.PkiError."""
    if not ca_hash.lower().startswith("sha256:") or len(ca_hash) != len("sha256:") + 64:
        raise EnrolError(f"--ca-hash {ca_hash!r} must be sha256: and 64 hex digits, as `phalanx certs token create` "
                         "prints it", usage=True)
    pki.refuse_existing(directory, stem)  # before anything is asked: a node already enrolled keeps its files
    ca = fetch_ca(address, ca_hash)
    key_pem, csr_pem = pki.new_key_and_csr(name)
    # the token goes only to a controller: a certificate of the CA that is a controller's (tls.controller_name_options)
    reply = _call(address, ca, lambda s: s.Enrol(enrol_pb2.EnrolRequest(token=token, csr_pem=csr_pem),
                                                 timeout=TIMEOUT_S),
                  tuple(tls.controller_name_options(os.environ.get("PHALANX_SERVER_NAME", ""))))
    return pki.write_identity(directory, stem, key_pem, reply.cert_pem, ca)  # the CA checked by its hash
