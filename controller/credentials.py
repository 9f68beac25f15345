"""Certificates the controller keeps track of: bootstrap tokens, nodes that enrolled themselves, revocations.

Everything lives in the store as credential records (so a standby that takes over knows it, and nothing is lost
with the leader's memory), cached here:

    token/ID                   {"secret_sha256", "expires_ns", "uses_left" (-1: any number), "description", "by"}
    node/NAME                  {"spki_sha256", "serial", "not_after_ns", "enrolled_ns", "token"}: NAME's key
    revoked/name/ROLE/NAME     {"revoked_ns", "reason", "by"}: every certificate of ROLE NAME issued before revoked_ns
    revoked/serial/HEX         {"revoked_ns", "reason", "by"}: one certificate

A node enrols with a token and a CSR (EnrolService): the token must exist, match, be unexpired and have a use
left; the CSR's CN must be a valid node name not enrolled with another key (the same key may enrol again: a
re-install keeping its key, or a renewal); the controller signs it with the cluster CA key
([security] ca_key_file). A revoked identity is refused at every call (controller/api/auth.py), its agent's
session is cut at once, and a certificate issued for that name after the revocation is accepted again.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import json
import secrets
import string
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from controller.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from controller.store.base import CredentialRecord, EventRecord, Store
from phalanx import log, pki
from phalanx.clock import Clock, to_the_end
from phalanx.names import NAME, RULE

logger = log.get("credentials")

_ALPHABET = string.ascii_lowercase + string.digits
MAX_TTL_S = 7 * 86_400.0  # a bootstrap token lives a week at most (kubeadm's default is a day)


@dataclass(frozen=True)
class Revocation:
    revoked_ns: int
    reason: str


@lru_cache(maxsize=4096)
def certificate_facts(pem: bytes) -> tuple[str, int]:
    """(serial in hex, not-before in Unix ns) of a PEM certificate; cached: every RPC's peer is looked up."""
    return pki.certificate_facts(pem)


LINEAGE_KEPT = 32  # serials a node's certificate was renewed from, kept with it (years of renewals)


class Credentials:
    def __init__(self, store: Store, clock: Clock, ca_file: str, ca_key_file: str, enrol_days: int,
                 publish: Callable[[list[EventRecord]], None]) -> None:
        self.store, self.clock = store, clock
        self.ca_file, self.ca_key_file, self.enrol_days = ca_file, ca_key_file, enrol_days
        self.publish = publish
        self.reserved: frozenset[str] = frozenset({"controller"})  # names no node may enrol as (server.py: its own)
        # the other controllers' names and hosts, read at each enrolment (server.py: from etcd's members, with HA): a
        # node enrolled at one controller as another's name would be a certificate its clients take for that one
        self.peers: Callable[[], Awaitable[set[str]]] | None = None
        self.records: dict[str, CredentialRecord] = {}
        self._revocations = 0  # revoked/... records: none, and a call's certificate is not even parsed
        self._lock = asyncio.Lock()  # one change at a time: each reads the record it replaces

    async def load(self) -> None:
        self.records = {r.key: r for r in await self.store.load_credentials()}
        self._revocations = sum(key.startswith("revoked/") for key in self.records)

    def _data(self, key: str) -> dict | None:
        record = self.records.get(key)
        return json.loads(record.data) if record is not None else None

    async def _commit(self, changes: dict[str, dict], event: EventRecord) -> None:
        """Commit, and memory follows: to the end, the lock held, even if the caller (an RPC) is cancelled."""
        await to_the_end(self._commit_now(changes, event))

    async def _commit_now(self, changes: dict[str, dict], event: EventRecord) -> None:
        records = [CredentialRecord(key, json.dumps(data, sort_keys=True).encode(),
                                    self.records[key].revision if key in self.records else 0)
                   for key, data in changes.items()]
        committed = await self.store.commit(credentials=records, events=[event])
        for record in committed.credentials:
            self.records[record.key] = record
        self._revocations = sum(key.startswith("revoked/") for key in self.records)
        self.publish(committed.events)

    def _event(self, kind: str, message: str, node: str = "", **fields: str) -> EventRecord:
        return EventRecord(kind=kind, message=message, time_ns=self.clock.wall_ns(), node=node, fields=fields)

    # -- the CA -----------------------------------------------------------------------------------

    def ca_pem(self) -> bytes:
        try:
            return Path(self.ca_file).read_bytes()
        except OSError as e:
            raise FailedPrecondition(f"cannot read the cluster CA {self.ca_file}: {e.strerror}") from None

    def _ca(self):
        if not self.ca_key_file:
            raise FailedPrecondition("enrolment is off: the controller needs the cluster CA's key to sign certificates "
                                     "([security] ca_key_file), and a token port ([security] token_listen)")
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        try:
            cert = x509.load_pem_x509_certificate(self.ca_pem())
            key = serialization.load_pem_private_key(Path(self.ca_key_file).read_bytes(), password=None)
        except OSError as e:
            raise FailedPrecondition(f"cannot read [security] ca_key_file {self.ca_key_file}: {e.strerror}") from None
        except (ValueError, TypeError) as e:
            raise FailedPrecondition(f"cannot use [security] ca_key_file {self.ca_key_file}: {e}") from None
        return cert, key

    # -- bootstrap tokens ---------------------------------------------------------------------------

    async def create_token(self, ttl_s: float, uses: int, description: str, by: str) -> tuple[str, int, str]:
        """(ID.SECRET, expiry in Unix ns, the CA's hash). Raises InvalidArgument, FailedPrecondition."""
        if not 0 < ttl_s <= MAX_TTL_S:
            raise InvalidArgument(f"ttl_s ({ttl_s:g}) must be more than 0 and at most {MAX_TTL_S:g} (a week)")
        if len(description) > 200:
            raise InvalidArgument(f"description is {len(description)} characters; the limit is 200")
        self._ca()  # refuse a token nobody could enrol with
        token_id = "".join(secrets.choice(_ALPHABET) for _ in range(6))
        secret = "".join(secrets.choice(_ALPHABET) for _ in range(16))
        expires_ns = self.clock.wall_ns() + int(ttl_s * 1e9)
        async with self._lock:
            await self._commit({f"token/{token_id}": {
                "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(), "expires_ns": expires_ns,
                "uses_left": uses or -1, "description": description, "by": by}},
                self._event("cert.token", f"bootstrap token {token_id} created by {by}, good for "
                            f"{'any number of nodes' if not uses else f'{uses} node(s)'} until "
                            f"{_iso(expires_ns)}" + (f": {description}" if description else ""),
                            token=token_id, by=by))
        return f"{token_id}.{secret}", expires_ns, pki.ca_hash(self.ca_pem())

    def _spend(self, token: str) -> tuple[str, dict]:
        """(token id, its record after this use). Raises PermissionDenied saying why the token does not do."""
        token_id, dot, secret = token.strip().partition(".")
        data = self._data(f"token/{token_id}") if dot and len(token_id) == 6 else None
        if data is None or not hmac.compare_digest(hashlib.sha256(secret.encode()).hexdigest(),
                                                   data["secret_sha256"]):
            raise PermissionDenied("unknown bootstrap token: ask an operator for one (`phalanx certs token create`)")
        if data["expires_ns"] <= self.clock.wall_ns():
            raise PermissionDenied(f"bootstrap token {token_id} expired at {_iso(data['expires_ns'])}: ask for a new "
                                   "one")
        if data["uses_left"] == 0:
            raise PermissionDenied(f"bootstrap token {token_id} is used up: ask for a new one")
        if data["uses_left"] > 0:
            data = {**data, "uses_left": data["uses_left"] - 1}
        return token_id, data

    # -- enrolment ---------------------------------------------------------------------------------

    async def enrol(self, token: str, csr_pem: bytes, peer: str) -> tuple[bytes, bytes, int]:
        """(certificate PEM, CA PEM, not-after in Unix ns) for the node the CSR names. Raises PermissionDenied,
        InvalidArgument, FailedPrecondition; nothing is recorded unless a certificate is given."""
        from cryptography.hazmat.primitives import serialization
        # the token first: no store read, CSR parsing or CA-key work for a caller without one; the other
        # controllers' names (a read of etcd's members) outside the lock, which other enrolments wait on
        self._spend(token)
        reserved = self.reserved | (await self.peers() if self.peers is not None else set())
        async with self._lock:
            token_id, token_data = self._spend(token)  # again: an enrolment meanwhile may have used it up
            csr, name, spki = _read_csr(csr_pem)
            if problem := pki.node_name_problem(name, frozenset(reserved)):
                raise InvalidArgument(problem)
            public = csr.public_key()
            ca_cert, ca_key = self._ca()
            enrolled = self._data(f"node/{name}")
            revoked = self._data(f"revoked/name/node/{name}")
            if enrolled is not None and enrolled["spki_sha256"] != spki and \
                    not (revoked and revoked["revoked_ns"] > enrolled["enrolled_ns"]):
                raise PermissionDenied(f"node name {name!r} is enrolled with another key (since "
                                       f"{_iso(enrolled['enrolled_ns'])}); if that node is gone, revoke it first "
                                       f"(`phalanx certs revoke {name}`)")
            cert = pki.sign(ca_cert, ca_key, public, name, "node", (), self.enrol_days)
            serial = format(cert.serial_number, "x")
            not_after_ns = int(cert.not_valid_after_utc.timestamp() * 1e9)
            now = self.clock.wall_ns()
            await self._commit({
                f"token/{token_id}": token_data,
                f"node/{name}": {"spki_sha256": spki, "serial": serial, "not_after_ns": not_after_ns,
                                 "enrolled_ns": now, "token": token_id}},
                self._event("cert.enrolled", f"node {name} enrolled from {peer} with token {token_id}: certificate "
                            f"{serial} until {_iso(not_after_ns)}" + (" (its key as before)" if enrolled and
                                                                       enrolled["spki_sha256"] == spki else ""),
                            node=name, token=token_id, serial=serial, peer=peer))
        logger.info("node enrolled", node=name, token=token_id, serial=serial, peer=peer)
        return cert.public_bytes(serialization.Encoding.PEM), self.ca_pem(), not_after_ns

    async def renew(self, node: str, csr_pem: bytes, peer: str, cert_pem: bytes = b"") -> tuple[bytes, int]:
        """(certificate PEM, not-after) for node `node`, the caller, whose current certificate got it here: the
        request must name that node. Raises InvalidArgument, PermissionDenied, FailedPrecondition."""
        from cryptography.hazmat.primitives import serialization
        csr, name, spki = _read_csr(csr_pem)
        if name != node:
            raise PermissionDenied(f"the request names {name!r}; node {node!r} can renew only its own certificate")
        ca_cert, ca_key = self._ca()
        async with self._lock:
            if cert_pem and self.revocation("node", node, cert_pem) is not None:  # revoked while it waited
                raise PermissionDenied(f"the certificate of node {node!r} was revoked; it renews nothing")
            cert = pki.sign(ca_cert, ca_key, csr.public_key(), name, "node", (), self.enrol_days)
            serial = format(cert.serial_number, "x")
            not_after_ns = int(cert.not_valid_after_utc.timestamp() * 1e9)
            before = self._data(f"node/{name}") or {}
            # the serials this certificate was renewed from: revoking any of them revokes it too
            lineage = [*before.get("lineage", []), before["serial"]][-LINEAGE_KEPT:] if "serial" in before else []
            await self._commit({f"node/{name}": {**before, "spki_sha256": spki, "serial": serial, "lineage": lineage,
                                                 "not_after_ns": not_after_ns, "renewed_ns": self.clock.wall_ns(),
                                                 "enrolled_ns": before.get("enrolled_ns", self.clock.wall_ns())}},
                               self._event("cert.renewed", f"node {name} renewed its certificate from {peer}: "
                                           f"{serial} until {_iso(not_after_ns)}", node=name, serial=serial))
        logger.info("certificate renewed", node=name, serial=serial)
        return cert.public_bytes(serialization.Encoding.PEM), not_after_ns

    # -- revocation --------------------------------------------------------------------------------

    async def revoke(self, name: str, role: str, serial: str, reason: str, by: str) -> str:
        """Record a revocation; returns what it covers. Raises InvalidArgument."""
        role = role or "node"
        if role not in ("node", "client", "controller"):
            raise InvalidArgument(f"role {role!r} must be node, client or controller")
        if len(reason) > 500:
            raise InvalidArgument(f"reason is {len(reason)} characters; the limit is 500")
        now = self.clock.wall_ns()
        if serial:
            digits = serial.lower().removeprefix("0x").replace(":", "")
            if name:
                raise InvalidArgument("give a name, or a serial, not both")
            if not digits or any(c not in "0123456789abcdef" for c in digits):
                raise InvalidArgument(f"serial {serial!r} is not hex: give it as `openssl x509 -serial` prints it")
            serial = format(int(digits, 16), "x")  # openssl pads to whole bytes: 0A1B is a1b
            key, what = f"revoked/serial/{serial}", f"certificate {serial}"
        else:
            if not NAME.fullmatch(name):
                raise InvalidArgument(f"name {name!r}: {RULE}")
            key, what = f"revoked/name/{role}/{name}", f"every {role} certificate of {name!r} issued until now"
        async with self._lock:
            await self._commit({key: {"revoked_ns": now, "reason": reason, "by": by}},
                               self._event("cert.revoked", f"{what} revoked by {by}" + (f": {reason}" if reason
                                                                                        else ""),
                                           node=name if role == "node" else "", serial=serial, role=role,
                                           name=name, by=by))
        return f"revoked {what}"

    def node_revocations(self):
        """The node certificates revoked so far, as agents are told them (node_pb2.Revocations): by serial (a
        certificate renewed from a revoked one included), and by name."""
        from phalanx.v1 import node_pb2
        out = node_pb2.Revocations()
        for key in self.records:
            if key.startswith("revoked/serial/"):
                out.serials.append(key.removeprefix("revoked/serial/"))
            elif key.startswith("revoked/name/node/"):
                out.names[key.removeprefix("revoked/name/node/")] = self._data(key)["revoked_ns"]
            elif key.startswith("node/"):
                record = self._data(key)
                if "serial" in record and self._revoked_ancestor("node", key.removeprefix("node/"), record["serial"]):
                    out.serials.append(record["serial"])
        return out

    def _revoked_ancestor(self, role: str, name: str, serial: str) -> dict | None:
        """The revocation of a certificate that node `name`'s current certificate (`serial`) was renewed from, if
        any: renewing must not outlive revoking."""
        if role != "node":
            return None
        record = self._data(f"node/{name}")
        if record is None or record.get("serial") != serial:
            return None
        for ancestor in record.get("lineage", []):
            revoked = self._data(f"revoked/serial/{ancestor}")
            if revoked is not None:
                return revoked
        return None

    def revocation(self, role: str, name: str, pem: bytes) -> Revocation | None:
        """Why the certificate `pem` of ROLE NAME may not be used, or None. Cheap: two dictionary looks."""
        if not self._revocations:
            return None
        serial, not_before_ns = certificate_facts(pem)
        by_serial = self._data(f"revoked/serial/{serial}") or self._revoked_ancestor(role, name, serial)
        if by_serial is not None:
            return Revocation(by_serial["revoked_ns"], by_serial["reason"])
        by_name = self._data(f"revoked/name/{role}/{name}")
        # phalanx certs backdates a certificate's start by pki.BACKDATE: it was made that much later
        if by_name is not None and not_before_ns + int(pki.BACKDATE.total_seconds() * 1e9) <= by_name["revoked_ns"]:
            return Revocation(by_name["revoked_ns"], by_name["reason"])
        return None


def _read_csr(csr_pem: bytes):
    """(the request, the node it names, its key's SHA-256) of a PEM CSR. Raises InvalidArgument."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise InvalidArgument("csr_pem is not a PEM certificate signing request") from None
    if not csr.is_signature_valid:
        raise InvalidArgument("the certificate signing request's signature does not verify")
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(names[0].value) if names else ""
    if not NAME.fullmatch(name):
        raise InvalidArgument(f"the request's common name {name!r} is not a node name: {RULE}")
    spki = hashlib.sha256(csr.public_key().public_bytes(serialization.Encoding.DER,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo)).hexdigest()
    return csr, name, spki


def _iso(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
