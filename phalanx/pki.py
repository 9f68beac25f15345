"""The cluster's certificate authority: `phalanx certs init` and `phalanx certs issue NAME`.

One CA per cluster signs three kinds of certificate, told apart by the subject's organizational
unit (OU) and the extended key usage:

- ``controller`` — serverAuth, with subject alternative names for every address agents and users
  dial (``--san``) and CONTROLLER_NAME, which is what clients check (so a node's certificate, valid
  for the node's name, never passes for a controller's); the controller presents it.
- ``node`` — clientAuth, and serverAuth for the agent's snapshot replica service (peer agents dial
  it by the node name); the common name (CN) is the node name, and the controller only lets that
  node register under that name.
- ``client`` — clientAuth, for operators and tools on the control API (and torchrun's rendezvous).

Keys are ECDSA P-256, written 0600; certificates 0644. Nothing existing is ever overwritten: a
second `init` or a repeated `issue` is refused with the path, so a cluster never loses its CA by a
slip of the keyboard.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.names import NAME, RULE

ROLES = ("node", "client", "controller", "etcd")
# The name every controller's certificate carries besides its hosts, and the one name its clients (agents, the CLI,
# torchrun's plugin, an enrolling node) expect of it: grpcio shows a client no peer certificate, so the role is
# checked by name. Under .invalid (RFC 6761: never a real host), and no other certificate may carry it.
CONTROLLER_NAME = "controller.phalanx.invalid"
RESERVED_TLD = ".invalid"
CA_DAYS = 3650
LEAF_DAYS = 825  # the longest validity browsers still accept; rotate with `issue` under a new name


class PkiError(PhalanxError):
    """A certificate operation that cannot be done, said so a person can fix it."""


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    not_after: datetime.datetime


def _x509():
    # cryptography is only needed by the commands that make certificates; the daemons read PEM files.
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:  # pragma: no cover - a packaging fault, not a user error
        raise PkiError("the `cryptography` package is not installed: pip install 'cryptography>=42'") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create path with mode (never replacing a file), durably."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_existing(*paths: Path) -> None:
    for path in paths:
        if path.exists():
            raise PkiError(f"{path} already exists; refusing to overwrite it (move it away first)")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def init_ca(directory: str | Path, cluster: str = "phalanx", days: int = CA_DAYS) -> Issued:
    """Create ca.crt and ca.key in directory (made 0700 if missing)."""
    if not NAME.fullmatch(cluster):
        raise PkiError(f"bad cluster name {cluster!r}: {RULE}")
    x509, hashes, serialization, ec, _, NameOID = _x509()
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    cert_path, key_path = d / "ca.crt", d / "ca.key"
    _refuse_existing(cert_path, key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"{cluster} cluster CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_new(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), 0o600)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(cert_path, key_path, cert.not_valid_after_utc)


def _load_ca(d: Path):
    x509, _, serialization, _, _, _ = _x509()
    cert_path, key_path = d / "ca.crt", d / "ca.key"
    if not cert_path.exists() or not key_path.exists():
        raise PkiError(f"no cluster CA in {d} (ca.crt and ca.key): run `phalanx certs init --dir {d}` first")
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise PkiError(f"cannot read the CA in {d}: {e}") from None
    except PermissionError as e:
        raise PkiError(f"cannot read the CA in {d}: {e.strerror} (run as the user who owns {key_path})") from None
    return cert, key


def _san_entries(x509, names: list[str]):
    entries = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def certificate_facts(pem: bytes) -> tuple[str, int]:
    """(serial in hex, not-before in Unix ns) of a certificate, PEM or DER."""
    x509 = _x509()[0]
    cert = x509.load_pem_x509_certificate(pem) if pem.lstrip().startswith(b"-----") else \
        x509.load_der_x509_certificate(pem)
    return format(cert.serial_number, "x"), int(cert.not_valid_before_utc.timestamp() * 1e9)


def revoked_by(serials: frozenset[str], names: dict[str, int], name: str, cert: bytes) -> bool:
    """Whether the certificate `cert` (PEM or DER) of node `name` is revoked: its serial listed, or its name revoked
    at a time after it began (less BACKDATE: `sign` backdates every certificate by that much)."""
    if not serials and not names:
        return False
    serial, not_before_ns = certificate_facts(cert)
    revoked_ns = names.get(name)
    return serial in serials or (revoked_ns is not None and
                                 not_before_ns + int(BACKDATE.total_seconds() * 1e9) <= revoked_ns)


def certificate_names(pem: bytes) -> frozenset[str]:
    """The names a certificate vouches for: its common name and every DNS and IP SAN. Raises ValueError."""
    x509 = _x509()[0]
    from cryptography.x509.oid import NameOID
    cert = x509.load_pem_x509_certificate(pem)
    names = {str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names |= set(sans.get_values_for_type(x509.DNSName)) | {str(ip) for ip in sans.get_values_for_type(
            x509.IPAddress)}
    except x509.ExtensionNotFound:
        pass
    return frozenset(names)


def node_name_problem(name: str, reserved: frozenset[str] = frozenset()) -> str:
    """Why `name` may not be a node certificate's name, or "". A node's certificate is also a server certificate
    (for its snapshot port) whose SAN is its name: a node named like an address ("10.0.0.1", "localhost") or like
    a controller (`reserved`: the controller's own names) would be a certificate the controller's clients accept
    as the controller."""
    try:
        ipaddress.ip_address(name)
        return f"{name!r} is an IP address; a node's name must not be one (its certificate would vouch for it)"
    except ValueError:
        pass
    lowered = name.lower()
    if lowered == "localhost" or lowered.endswith(".localhost"):
        return f"{name!r} is reserved (localhost)"
    if lowered.endswith(RESERVED_TLD):
        return (f"{name!r} is under {RESERVED_TLD}, which Phalanx keeps for its controllers' certificates "
                f"({CONTROLLER_NAME})")
    if lowered in {r.lower() for r in reserved}:
        return f"{name!r} is a controller's name; a node may not take it"
    return ""


def issue(directory: str | Path, name: str, role: str = "node", sans: tuple[str, ...] = (),
          days: int = LEAF_DAYS) -> Issued:
    """Create NAME.crt and NAME.key signed by the CA in directory."""
    if role not in ROLES:
        raise PkiError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    if not NAME.fullmatch(name):
        raise PkiError(f"bad certificate name {name!r}: {RULE} (a node's name, or a user's)")
    if role == "node" and (problem := node_name_problem(name)):
        raise PkiError(problem)
    _, _, serialization, ec, _, _ = _x509()
    d = Path(directory)
    ca_cert, ca_key = _load_ca(d)
    cert_path, key_path = d / f"{name}.crt", d / f"{name}.key"
    _refuse_existing(cert_path, key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = sign(ca_cert, ca_key, key.public_key(), name, role, sans, days)
    _write_new(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), 0o600)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(cert_path, key_path, cert.not_valid_after_utc)


BACKDATE = datetime.timedelta(minutes=5)  # a certificate is valid from 5 minutes before it is made (clock skew)


def sign(ca_cert, ca_key, public_key, name: str, role: str, sans: tuple[str, ...] = (), days: int = LEAF_DAYS,
         lifetime: datetime.timedelta | None = None):
    """A certificate for `public_key` as `name` in `role`, signed by the CA: what `issue` writes and what the
    controller gives an enrolling node (whose key never left it). `lifetime` instead of `days`: tests."""
    if role != "controller" and any(n.lower().endswith(RESERVED_TLD) for n in (name, *sans)):
        raise PkiError(f"names under {RESERVED_TLD} are only for controller certificates ({CONTROLLER_NAME} is how "
                       "clients know a controller)")
    x509, hashes, _, _, EKU, NameOID = _x509()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME,
                                            ca_cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = [EKU.SERVER_AUTH, EKU.CLIENT_AUTH] if role in ("controller", "node", "etcd") else [EKU.CLIENT_AUTH]
    # gRPC checks the name it dials against the SANs; a controller (an etcd member) is also reachable by its own name.
    # Every controller's also carries CONTROLLER_NAME, the name its clients check.
    alt_names = (list(dict.fromkeys([name, *sans, CONTROLLER_NAME])) if role == "controller"
                 else list(dict.fromkeys([name, *sans])) if role == "etcd" else [name])
    now = _now()
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - BACKDATE)
               .not_valid_after(min(now + (lifetime or datetime.timedelta(days=days)), ca_cert.not_valid_after_utc))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                            crl_sign=False, content_commitment=False, data_encipherment=False,
                                            key_agreement=True, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
               .add_extension(x509.SubjectAlternativeName(_san_entries(x509, alt_names)), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    return builder.sign(ca_key, hashes.SHA256())


def ca_hash(ca_pem: bytes) -> str:
    """sha256:HEX of a CA certificate's DER, the pin a node checks before it trusts a CA (as kubeadm's)."""
    import hashlib
    x509, _, serialization, _, _, _ = _x509()
    der = x509.load_pem_x509_certificate(ca_pem).public_bytes(serialization.Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def new_key_and_csr(name: str) -> tuple[bytes, bytes]:
    """(key PEM, CSR PEM) for a node that enrols: a fresh P-256 key and a request naming the node (CN)."""
    x509, hashes, serialization, ec, _, NameOID = _x509()
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])).sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()), csr.public_bytes(serialization.Encoding.PEM))


def refuse_existing(directory: str | Path, stem: str) -> None:
    """Raise PkiError if STEM.key or STEM.crt is in directory already."""
    _refuse_existing(Path(directory) / f"{stem}.key", Path(directory) / f"{stem}.crt")


def write_identity(directory: str | Path, name: str, key_pem: bytes, cert_pem: bytes, ca_pem: bytes) -> Issued:
    """NAME.key (0600), NAME.crt and ca.crt in directory, as an enrolled node keeps them; refuses to overwrite."""
    x509, _, _, _, _, _ = _x509()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = (d / f"{name}.key", d / f"{name}.crt")
    _refuse_existing(*paths)
    ca_path = d / "ca.crt"
    if ca_path.exists() and ca_path.read_bytes() != ca_pem:
        raise PkiError(f"{ca_path} holds another CA; refusing to overwrite it (move it away first)")
    _write_new(paths[0], key_pem, 0o600)
    _write_new(paths[1], cert_pem, 0o644)
    if not ca_path.exists():
        _write_new(ca_path, ca_pem, 0o644)
    return Issued(paths[1], paths[0], x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc)
