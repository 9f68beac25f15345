"""Transport security shared by every Phalanx process: PEM files → gRPC credentials.

The controller speaks mutual TLS: every agent and every client presents a certificate signed by the
cluster CA (`phalanx certs`). A client without a certificate may instead use a bearer token on the
controller's token port (TLS without a client certificate). Plaintext is only ever used when a
config or the caller says ``insecure`` explicitly — the local cluster on loopback does.

Files are checked when a daemon starts, so a missing, unreadable, expired or mismatched file is one
line naming the file, not a failed handshake minutes later.
"""

from __future__ import annotations

import datetime
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from phalanx.errors import ConfigError

DEFAULT_PKI_DIR = "/etc/phalanx/pki"
EXPIRY_WARNING = datetime.timedelta(days=30)


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file, or ConfigError naming it and saying what to do."""
    if not path:
        raise ConfigError(f"no {what} file configured")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: no such file (make one with `phalanx certs`; plaintext on loopback "
                          "needs insecure = true in a daemon's config, or --insecure / PHALANX_INSECURE=1 for a "
                          "client)") from None
    except PermissionError:
        raise ConfigError(f"{what} {path}: permission denied (the daemon's user must be able to read it)") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path}: is a directory, not a PEM file") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {path}: not a PEM file")
    return data


@dataclass(frozen=True)
class Identity:
    """A certificate and its key (PEM), checked against each other and the CA."""

    ca: bytes
    cert: bytes
    key: bytes
    not_after: datetime.datetime | None

    @classmethod
    def load(cls, ca_file: str, cert_file: str, key_file: str) -> Identity:
        ca = read_pem(ca_file, "CA certificate")
        cert = read_pem(cert_file, "certificate")
        key = read_pem(key_file, "private key")
        return cls(ca, cert, key, _check(ca, cert, key, cert_file, key_file))

    def expires_soon(self, now: datetime.datetime | None = None) -> bool:
        now = now or datetime.datetime.now(datetime.UTC)
        return self.not_after is not None and self.not_after - now < EXPIRY_WARNING


def _check(ca: bytes, cert: bytes, key: bytes, cert_file: str, key_file: str) -> datetime.datetime | None:
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
    except ImportError:  # the handshake will check instead
        return None
    try:
        ca_cert = x509.load_pem_x509_certificate(ca)
        leaf = x509.load_pem_x509_certificate(cert)
    except ValueError as e:
        raise ConfigError(f"certificate {cert_file}: cannot be parsed: {e}") from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"private key {key_file}: cannot be used (encrypted keys are not supported): {e}") from None
    if private.public_key() != leaf.public_key():
        raise ConfigError(f"private key {key_file} does not belong to certificate {cert_file}")
    now = datetime.datetime.now(datetime.UTC)
    if leaf.not_valid_after_utc < now:
        raise ConfigError(f"certificate {cert_file} expired on {leaf.not_valid_after_utc:%Y-%m-%d}; issue a new "
                          "one with `phalanx certs issue NAME`")
    try:
        leaf.verify_directly_issued_by(ca_cert)  # the signature, not just the names: clusters share names
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(f"certificate {cert_file} was not issued by the CA in the configured ca_file "
                          f"(issuer {leaf.issuer.rfc4514_string()}; CA {ca_cert.subject.rfc4514_string()})") from None
    return leaf.not_valid_after_utc


def identity_of(cert: bytes) -> tuple[str, str] | None:
    """(OU, CN) of a PEM certificate as `phalanx certs` issues them; None without cryptography or either."""
    try:
        from cryptography import x509
        from cryptography.x509.oid import NameOID
    except ImportError:
        return None
    subject = x509.load_pem_x509_certificate(cert).subject
    ous = subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    cns = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return (str(ous[0].value) if ous else "", str(cns[0].value) if cns else "")


def parse_subject(subject: str) -> tuple[str, str] | None:
    """(role, name) from an RFC 2253 subject such as "CN=node-a,OU=node,O=phalanx": the one OU and the
    one CN. None for anything else — a subject with escapes (a ',' or '=' inside a value, which
    `phalanx certs` never issues and which could smuggle in a second OU), or one without exactly one
    OU and one CN — so such a certificate gets nowhere, whichever CA signed it."""
    if "\\" in subject or '"' in subject or "+" in subject:
        return None
    fields: dict[str, list[str]] = {}
    for part in subject.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            return None
        fields.setdefault(key.strip(), []).append(value.strip())
    ous, cns = fields.get("OU", []), fields.get("CN", [])
    if len(ous) != 1 or len(cns) != 1 or not ous[0] or not cns[0]:
        return None
    return ous[0], cns[0]


def auth_context_of(der: bytes) -> dict[str, list[bytes]]:
    """What gRPC's auth_context() says of a peer certificate (DER) that the TLS layer verified: its RFC 4514
    subject and its PEM, for a connection made outside gRPC (the session port)."""
    from cryptography import x509
    subject = x509.load_der_x509_certificate(der).subject.rfc4514_string()
    return {"x509_subject": [subject.encode()], "x509_pem_cert": [ssl.DER_cert_to_PEM_cert(der).encode()]}


def der_identity(der: bytes) -> tuple[str, str] | None:
    """(role, name) of a certificate (DER) that a TLS connection outside gRPC verified; None as peer_identity."""
    try:
        return parse_subject(auth_context_of(der)["x509_subject"][0].decode(errors="replace"))
    except (ValueError, ImportError):
        return None


def peer_identity(context) -> tuple[str, str] | None:
    """(role, name) of the certificate a gRPC peer presented (mutual TLS); None without one or for a subject
    `phalanx certs` would not issue."""
    subject = context.auth_context().get("x509_subject")
    return parse_subject(subject[0].decode(errors="replace")) if subject else None


def serves_tls(cert: bytes) -> bool:
    """Whether a TLS server may present `cert`: its extended key usage names serverAuth (or it has none).
    True without the cryptography package (the handshake will tell)."""
    try:
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID
    except ImportError:
        return True
    try:
        usage = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ExtendedKeyUsageOID.SERVER_AUTH in usage


def load_identity(ca_file: str, cert_file: str, key_file: str, who: str, log) -> Identity:
    """A daemon's identity from its [security] files: ConfigError prefixed "security: ", a warning when the
    certificate runs out within EXPIRY_WARNING."""
    try:
        identity = Identity.load(ca_file, cert_file, key_file)
    except ConfigError as e:
        raise ConfigError(f"security: {e}") from None
    if identity.expires_soon():
        log.warning(f"{who} certificate expires soon", cert=cert_file, not_after=str(identity.not_after))
    return identity


class ReloadingIdentity:
    """A daemon's [security] files, read again whenever they change (a renewal, a certificate put in place by
    hand): `current()` compares the files' modification times and sizes, a stat each, and loads a changed set;
    one that does not load (a half-copied file, a key that does not match) is logged and the last good identity
    kept, so a daemon never drops to no certificate."""

    def __init__(self, ca_file: str, cert_file: str, key_file: str, who: str, log) -> None:
        self.files = (ca_file, cert_file, key_file)
        self.who, self.log = who, log
        self.identity = load_identity(ca_file, cert_file, key_file, who, log)
        self._stamp = self._stamps()
        self.reloads = 0

    def _stamps(self) -> tuple:
        out = []
        for path in self.files:
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def current(self) -> Identity:
        stamp = self._stamps()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.identity = load_identity(*self.files, self.who, self.log)
                self.reloads += 1
                self.log.info(f"{self.who} certificate read again", cert=self.files[1],
                              not_after=str(self.identity.not_after))
            except ConfigError as e:
                self.log.error(f"{self.who} changed certificate files do not load; the ones before stay in use",
                               error=str(e))
        return self.identity

    def channel_credentials(self) -> grpc.ChannelCredentials:
        identity = self.current()
        return channel_credentials(identity.ca, identity.cert, identity.key)

    def session_context(self) -> ssl.SSLContext:
        """A client context for the controllers' session port (phalanx/framed.py), from the current files."""
        from phalanx.framed import client_context
        self.current()
        return client_context(*self.files)


def reloading_server_credentials(reloading: ReloadingIdentity, client_auth: bool = True) -> grpc.ServerCredentials:
    """Server credentials that take up renewed files at the next handshake, without a restart: gRPC asks before
    each handshake, and gets a new configuration only when the files changed."""
    def configuration(identity: Identity):
        return grpc.ssl_server_certificate_configuration([(identity.key, identity.cert)],
                                                         root_certificates=identity.ca if client_auth else None)

    served = [reloading.identity]

    def fetch():
        identity = reloading.current()
        if identity is served[0]:
            return None  # unchanged: gRPC keeps the configuration it has
        served[0] = identity
        return configuration(identity)

    return grpc.dynamic_ssl_server_credentials(configuration(reloading.identity), fetch,
                                               require_client_authentication=client_auth)


def target_name_options(server_name: str) -> list[tuple[str, object]]:
    """Channel options to expect `server_name` in the server's certificate (when not the host dialled)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def controller_name_options(server_name: str = "") -> list[tuple[str, object]]:
    """Channel options for dialling a controller: its certificate must carry pki.CONTROLLER_NAME, which only
    controllers' certificates do (grpcio shows a client no peer certificate whose role it could read), whatever
    address is dialled. `server_name` (security.server_name, PHALANX_SERVER_NAME) instead: for a controller
    certificate made before controllers carried that name; any certificate of the CA naming it passes."""
    from phalanx.pki import CONTROLLER_NAME
    return target_name_options(server_name or CONTROLLER_NAME)


def controller_name_problem(details: str, server_name: str = "") -> str:
    """What a failed connection's `details` mean when the server's certificate lacked the name expected of a
    controller (controller_name_options), said so a person can act; "" otherwise."""
    if "Hostname Verification" not in (details or ""):
        return ""
    from phalanx.pki import CONTROLLER_NAME
    if server_name:
        return f"the server's certificate does not name {server_name} (security.server_name, PHALANX_SERVER_NAME)"
    return (f"the server's certificate is of the cluster CA but does not carry {CONTROLLER_NAME}, which every "
            "controller's does: it is not a controller, or its certificate was made before controllers' carried "
            "that name (issue it again, or set PHALANX_SERVER_NAME / security.server_name to a host name it names)")


def server_credentials(identity: Identity) -> grpc.ServerCredentials:
    """Mutual TLS: the peer must present a certificate signed by the cluster CA."""
    return grpc.ssl_server_credentials([(identity.key, identity.cert)], root_certificates=identity.ca,
                                       require_client_auth=True)


def token_server_credentials(identity: Identity) -> grpc.ServerCredentials:
    """TLS without a client certificate, for the token port: the caller proves itself with a token."""
    return grpc.ssl_server_credentials([(identity.key, identity.cert)], require_client_auth=False)


def channel_credentials(ca: bytes, cert: bytes | None = None, key: bytes | None = None,
                        token: str | None = None) -> grpc.ChannelCredentials:
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


@dataclass(frozen=True)
class ClientSecurity:
    """How a client (the CLI, torchrun's rendezvous handler) reaches the controller.

    From the environment: ``PHALANX_INSECURE=1`` for plaintext; else TLS with ``PHALANX_CA``
    (default /etc/phalanx/pki/ca.crt), a client certificate ``PHALANX_CERT`` + ``PHALANX_KEY`` and/or
    a token from ``PHALANX_TOKEN`` or the file ``PHALANX_TOKEN_FILE``; ``PHALANX_SERVER_NAME`` when
    the controller's certificate names it differently from the address dialled.
    """

    insecure: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    token: str = ""
    server_name: str = ""

    @classmethod
    def from_env(cls, env: os._Environ[str] | dict[str, str] | None = None, **overrides: object) -> ClientSecurity:
        env = os.environ if env is None else env
        token = env.get("PHALANX_TOKEN", "")
        if not token and env.get("PHALANX_TOKEN_FILE"):
            token = read_token_file(env["PHALANX_TOKEN_FILE"])
        values = {
            "insecure": env.get("PHALANX_INSECURE", "") not in ("", "0", "false", "no"),
            "ca_file": env.get("PHALANX_CA", f"{DEFAULT_PKI_DIR}/ca.crt"),
            "cert_file": env.get("PHALANX_CERT", ""),
            "key_file": env.get("PHALANX_KEY", ""),
            "token": token,
            "server_name": env.get("PHALANX_SERVER_NAME", ""),
        }
        values.update({k: v for k, v in overrides.items() if v not in (None, "")})
        return cls(**values)  # type: ignore[arg-type]

    def options(self) -> list[tuple[str, object]]:
        return [] if self.insecure else controller_name_options(self.server_name)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """None for plaintext; raises ConfigError when files are missing or unusable."""
        if self.insecure:
            return None
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError("a client certificate needs both PHALANX_CERT and PHALANX_KEY (or --cert and --key)")
        ca = read_pem(self.ca_file, "CA certificate")
        cert = key = None
        if self.cert_file:
            cert, key = read_pem(self.cert_file, "certificate"), read_pem(self.key_file, "private key")
        return channel_credentials(ca, cert, key, self.token or None)

    def channel(self, target: str, options: list[tuple[str, object]]) -> grpc.Channel:
        creds = self.credentials()
        if creds is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, creds, options=[*options, *self.options()])


def read_token_file(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"token file {path}: {e.strerror}") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"token file {path}: must hold one token (no spaces)")
    return token
