"""Nodes that enrol themselves, and certificates revoked: real controller and agents on mutual TLS, the CLI as an
operator and a new node would run it. Every refusal leaves nothing enrolled and nothing written."""

import json
import stat
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from phalanx import pki
from phalanx.ports import free_port
from phalanx.v1 import control_pb2
from tests.cluster import Cluster

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


@pytest.fixture
def enrolling(tmp_path):
    """A controller that signs for enrolling nodes (its CA key) on a token port, and one agent issued by hand."""
    ca = tmp_path / "pki"
    pki.init_ca(ca, cluster="test")
    c = Cluster(tmp_path / "cluster", pki=ca)
    c.root.mkdir()
    c.token_address = f"127.0.0.1:{free_port()}"
    c.controller_extra = (f'[security]\nca_file = "{ca / "ca.crt"}"\ncert_file = "{ca / "controller.crt"}"\n'
                          f'key_file = "{ca / "controller.key"}"\nca_key_file = "{ca / "ca.key"}"\n'
                          f'token_listen = "{c.token_address}"\n')
    c.start_controller(c.controller_extra)
    yield c
    c.close()


def token(c, *args) -> dict:
    out = c.cli("certs", "token", "create", *args, "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def enrol(c, tok: str, ca_hash: str, name: str, directory: Path, controllers: str = ""):
    return c.cli("certs", "enrol", "--controller", controllers or c.token_address, "--token", tok, "--ca-hash",
                 ca_hash, "--name", name, "--dir", str(directory))


def events(c, kind: str) -> list:
    return [e for e in c.control.ListEvents(control_pb2.ListEventsRequest(limit=1000), timeout=10).events
            if e.kind == kind]


def start_enrolled(c, name: str, directory: Path):
    c.start_agent(name, gpus=1, extra=f'[security]\nca_file = "{directory / "ca.crt"}"\n'
                                      f'cert_file = "{directory / "node.crt"}"\n'
                                      f'key_file = "{directory / "node.key"}"\n')


def test_a_node_enrols_itself_and_joins_with_a_key_made_on_it(enrolling, tmp_path):
    c = enrolling
    t = token(c, "--ttl", "1h", "--uses", "2", "--description", "rack 7")
    assert t["ca_hash"] == pki.ca_hash((c.pki / "ca.crt").read_bytes())
    node_dir = tmp_path / "gpu101"
    # a control plane's token ports, the first one down: the next one enrols
    out = enrol(c, t["token"], t["ca_hash"], "gpu101", node_dir, f"127.0.0.1:{free_port()},{c.token_address}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"node gpu101 enrolled: {node_dir / 'node.crt'}")
    assert stat.S_IMODE((node_dir / "node.key").stat().st_mode) == 0o600
    assert (node_dir / "ca.crt").read_bytes() == (c.pki / "ca.crt").read_bytes()
    cert = x509.load_pem_x509_certificate((node_dir / "node.crt").read_bytes())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu101"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "node"
    start_enrolled(c, "gpu101", node_dir)
    c.wait_states({"gpu101": "UP"})
    [made] = events(c, "cert.token")
    assert "good for 2 node(s)" in made.message and made.message.endswith(": rack 7")
    [enrolled] = events(c, "cert.enrolled")
    assert enrolled.node == "gpu101" and enrolled.fields["serial"] == format(cert.serial_number, "x")
    # the token, its use, and the enrolled key survive a restart of the controller
    c.kill("controller")
    c.start_controller(c.controller_extra)
    again = enrol(c, t["token"], t["ca_hash"], "gpu101", tmp_path / "thief")
    assert again.returncode == 1 and "enrolled with another key" in again.stderr, again.stderr
    assert not (tmp_path / "thief" / "node.key").exists()


@pytest.mark.parametrize("case", ["expired", "used-up", "unknown", "wrong-ca-hash", "bad-name", "address-name"])
def test_enrolment_refusals_say_why_and_enrol_nothing(enrolling, tmp_path, case):
    c = enrolling
    t = token(c, "--ttl", "1s" if case == "expired" else "1h", "--uses", "1")
    tok, ca_hash, name = t["token"], t["ca_hash"], "gpu201"
    if case == "expired":
        c.wait_for(lambda: time.time() > _unix(t["expires"]) + 0.2, "the token to expire")
        expected = f"bootstrap token {tok.split('.')[0]} expired"
    elif case == "used-up":
        assert enrol(c, tok, ca_hash, "gpu200", tmp_path / "first").returncode == 0
        expected = "is used up"
    elif case == "unknown":
        tok = tok.split(".")[0] + ".0000000000000000"
        expected = "unknown bootstrap token"
    elif case == "wrong-ca-hash":
        other = tmp_path / "other"
        pki.init_ca(other, cluster="elsewhere")
        ca_hash = pki.ca_hash((other / "ca.crt").read_bytes())
        expected = "not the " + ca_hash + " you were given: refusing it"
    elif case == "bad-name":
        name = "gpu 7"
        expected = "is not a node name"
    else:  # its certificate would vouch for the controller's address (issue 39)
        name = "127.0.0.1"
        expected = "'127.0.0.1' is an IP address"
    before = len(events(c, "cert.enrolled"))
    out = enrol(c, tok, ca_hash, name, tmp_path / "node")
    assert out.returncode != 0 and expected in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "node" / "node.key").exists() and not (tmp_path / "node" / "node.crt").exists()
    assert len(events(c, "cert.enrolled")) == before


def _unix(iso: str) -> float:
    import datetime
    return datetime.datetime.fromisoformat(iso).timestamp()


def test_a_revoked_node_is_cut_off_at_once_stays_out_after_a_restart_and_may_enrol_anew(enrolling, tmp_path):
    c = enrolling
    t = token(c, "--ttl", "1h", "--uses", "2")
    first = tmp_path / "first"
    assert enrol(c, t["token"], t["ca_hash"], "gpu301", first).returncode == 0
    start_enrolled(c, "gpu301", first)
    c.wait_states({"gpu301": "UP"})
    c.wait_for(lambda: c.node("gpu301").connected, "gpu301 connected")
    out = c.cli("certs", "revoke", "gpu301", "--reason", "stolen from the loading dock")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("revoked every node certificate of 'gpu301' issued until now; its agent's session "
                                  "was cut")
    c.wait_for(lambda: not c.node("gpu301").connected, "gpu301's session cut")
    log = c.root / "gpu301.log"
    c.wait_for(lambda: "was revoked" in log.read_text(), "the agent told its certificate was revoked")
    [revoked] = events(c, "cert.revoked")
    assert revoked.node == "gpu301" and revoked.message.endswith(": stolen from the loading dock")
    # kept with the controller's state: after a restart the agent's certificate is still refused
    c.kill("controller")
    c.start_controller(c.controller_extra)
    with pytest.raises(grpc.RpcError) as e:
        _as_node(c, first)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "was revoked" in e.value.details()
    assert not c.node("gpu301").connected
    # the same name enrols again with a new key (the node was re-imaged): accepted, and it joins
    c.kill("gpu301")
    second = tmp_path / "second"
    out = enrol(c, t["token"], t["ca_hash"], "gpu301", second)
    assert out.returncode == 0, out.stderr
    start_enrolled(c, "gpu301", second)
    c.wait_for(lambda: c.node("gpu301").connected, "gpu301 back with its new certificate")


def _as_node(c, directory: Path):
    from phalanx.tls import channel_credentials
    from phalanx.v1 import node_pb2, node_pb2_grpc
    creds = channel_credentials((directory / "ca.crt").read_bytes(), (directory / "node.crt").read_bytes(),
                                (directory / "node.key").read_bytes())
    with grpc.secure_channel(c.address, creds) as channel:
        return node_pb2_grpc.NodeServiceStub(channel).Register(node_pb2.RegisterRequest(node_name="gpu301"),
                                                                timeout=10)


def test_a_certificate_issued_by_hand_is_revoked_by_serial_and_bad_revocations_are_refused(enrolling):
    c = enrolling
    issued = pki.issue(c.pki, "ci-bot", "client")
    serial = format(x509.load_pem_x509_certificate(issued.cert.read_bytes()).serial_number, "x")
    # as openssl prints it: whole bytes, upper case (a leading 0 where the hex is odd)
    assert c.cli("certs", "revoke", "--serial", "0" + serial.upper(), "--reason", "leaked").returncode == 0
    from phalanx.tls import channel_credentials
    from phalanx.v1 import control_pb2_grpc
    creds = channel_credentials((c.pki / "ca.crt").read_bytes(), issued.cert.read_bytes(), issued.key.read_bytes())
    with grpc.secure_channel(c.address, creds) as channel, pytest.raises(grpc.RpcError) as e:
        control_pb2_grpc.ControlServiceStub(channel).ListNodes(control_pb2.ListNodesRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "(leaked)" in e.value.details()
    assert c.cli("nodes").returncode == 0  # the operator's own certificate is not touched
    for args, message in ((("certs", "revoke"), "give NAME or --serial HEX"),
                          (("certs", "revoke", "x", "--serial", "ab"), "give NAME or --serial HEX"),
                          (("certs", "revoke", "--serial", "zz"), "serial 'zz' is not hex"),
                          (("certs", "revoke", "bad name"), "name 'bad name'")):
        out = c.cli(*args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def short_lived(ca: Path, name: str, directory: Path, minutes: float = 3.0) -> x509.Certificate:
    """A node certificate two thirds gone already (it starts 5 minutes back, as every one does)."""
    import datetime

    from cryptography.hazmat.primitives import serialization
    ca_cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), password=None)
    key_pem, _ = pki.new_key_and_csr(name)
    key = serialization.load_pem_private_key(key_pem, password=None)
    cert = pki.sign(ca_cert, ca_key, key.public_key(), name, "node", lifetime=datetime.timedelta(minutes=minutes))
    pki.write_identity(directory, "node", key_pem, cert.public_bytes(serialization.Encoding.PEM),
                       (ca / "ca.crt").read_bytes())
    return cert


def test_a_node_renews_its_certificate_while_its_job_runs_and_the_controller_takes_a_new_one_in_place(
        enrolling, tmp_path):
    import ssl
    import sys
    c = enrolling
    node_dir = tmp_path / "gpu401"
    old = short_lived(c.pki, "gpu401", node_dir)
    start_enrolled(c, "gpu401", node_dir)
    c.wait_states({"gpu401": "UP"})
    job = c.cli("submit", "--nodes", "1", "--", sys.executable, "-c", "import time; time.sleep(600)").stdout.strip()
    c.wait_for(lambda: json.loads(c.cli("job", job, "-o", "json").stdout)["state"] == "RUNNING", "the job running")

    def current() -> x509.Certificate:
        return x509.load_pem_x509_certificate((node_dir / "node.crt").read_bytes())

    c.wait_for(lambda: current().serial_number != old.serial_number, "the certificate renewed")
    new = current()
    assert new.not_valid_after_utc - old.not_valid_after_utc > __import__("datetime").timedelta(days=300)
    assert stat.S_IMODE((node_dir / "node.key").stat().st_mode) == 0o600
    [renewed] = events(c, "cert.renewed")
    assert renewed.node == "gpu401" and renewed.fields["serial"] == format(new.serial_number, "x")
    # nothing noticed: the session never dropped, the job runs on in its first generation
    assert len([e for e in events(c, "node.registered") if e.node == "gpu401"]) == 1
    assert c.node("gpu401").connected
    j = json.loads(c.cli("job", job, "-o", "json").stdout)
    assert (j["state"], j["generation"]) == ("RUNNING", 1)
    # the controller's own certificate replaced in place is what its next handshake shows, without a restart
    served = x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", int(
        c.token_address.rsplit(":", 1)[1]))).encode())
    (c.pki / "controller.crt").unlink()
    (c.pki / "controller.key").unlink()
    replaced = x509.load_pem_x509_certificate(pki.issue(c.pki, "controller", "controller",
                                                        ("127.0.0.1", "localhost")).cert.read_bytes())
    c.wait_for(lambda: x509.load_pem_x509_certificate(ssl.get_server_certificate(("127.0.0.1", int(
        c.token_address.rsplit(":", 1)[1]))).encode()).serial_number == replaced.serial_number,
        "the controller serving its new certificate")
    assert served.serial_number != replaced.serial_number
    assert c.cli("nodes").returncode == 0  # clients go on verifying it against the same CA
    assert c.cli("cancel", job).returncode == 0
