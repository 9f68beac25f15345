"""Mutual TLS, tokens and who may call what — with real certificates and real daemons.

`phalanx certs` makes a cluster CA and certificates; the controller refuses agents and clients
without a certificate from that CA, a node certificate only registers its own node, the control
API takes a client certificate or (on the token port) a token, and plaintext needs an explicit
`insecure = true`. Every refusal is checked for its status code and a message a person can act on.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from controller.api import auth
from phalanx import pki, tls
from phalanx.errors import ConfigError
from phalanx.ports import free_port
from phalanx.v1 import control_pb2, control_pb2_grpc, node_pb2, node_pb2_grpc
from tests.cluster import TIMEOUT_S, Cluster
from tests.eventually import eventually

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

TOKEN = "0123456789abcdef0123456789abcdef"


def run(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    pki.init_ca(d, cluster="test")
    return d


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("other-pki")
    pki.init_ca(d, cluster="stranger")
    pki.issue(d, "node-x", "node")
    pki.issue(d, "mallory", "client")
    return d


@pytest.fixture(scope="module")
def secure(ca, tmp_path_factory):
    """A controller on mutual TLS with a token port, and two agents with their own node certificates."""
    (ca / "tokens").write_text(f"# name token\nci-bot {TOKEN}\n")
    c = Cluster(tmp_path_factory.mktemp("secure"), pki=ca)
    c.token_address = f"127.0.0.1:{free_port()}"
    c.start_controller(f'[security]\nca_file = "{ca / "ca.crt"}"\ncert_file = "{ca / "controller.crt"}"\n'
                       f'key_file = "{ca / "controller.key"}"\ntokens_file = "{ca / "tokens"}"\n'
                       f'token_listen = "{c.token_address}"\n')
    for name in ("node-a", "node-b"):
        c.start_agent(name, gpus=1)
    c.wait_states({"node-a": "UP", "node-b": "UP"})
    yield c
    c.close()


def creds(d: Path, name: str | None, ca_dir: Path | None = None, token: str | None = None):
    ca_pem = ((ca_dir or d) / "ca.crt").read_bytes()
    if name is None:
        return tls.channel_credentials(ca_pem, token=token)
    return tls.channel_credentials(ca_pem, (d / f"{name}.crt").read_bytes(), (d / f"{name}.key").read_bytes(), token)


def list_nodes(address: str, credentials) -> control_pb2.ListNodesResponse:
    with grpc.secure_channel(address, credentials) as channel:
        return control_pb2_grpc.ControlServiceStub(channel).ListNodes(control_pb2.ListNodesRequest(), timeout=10)


def status_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


# -- the CA and certificates ---------------------------------------------------------------------

def test_certs_init_and_issue_make_a_chain_the_handshake_accepts(tmp_path):
    from cryptography import x509
    d = tmp_path / "pki"
    init = run("-m", "cli.main", "certs", "init", "--dir", str(d), "--cluster", "prod")
    assert init.returncode == 0, init.stderr
    assert "cluster CA:" in init.stdout and "phalanx certs issue controller" in init.stdout
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((d / "ca.crt").stat().st_mode) == 0o644
    issued = run("-m", "cli.main", "certs", "issue", "ctl", "--role", "controller", "--san", "10.0.0.1",
                 "--san", "ctl.example", "--dir", str(d))
    assert issued.returncode == 0, issued.stderr
    cert = x509.load_pem_x509_certificate((d / "ctl.crt").read_bytes())
    ca_cert = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca_cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["ctl", "ctl.example", pki.CONTROLLER_NAME]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.1"]
    assert cert.subject.rfc4514_string() == "CN=ctl,OU=controller,O=prod"
    assert stat.S_IMODE((d / "ctl.key").stat().st_mode) == 0o600
    # the files the daemons will read check out
    identity = tls.Identity.load(str(d / "ca.crt"), str(d / "ctl.crt"), str(d / "ctl.key"))
    assert identity.not_after is not None and not identity.expires_soon()


def test_certs_refuse_to_overwrite_and_explain_what_is_missing(tmp_path):
    d = tmp_path / "pki"
    no_ca = run("-m", "cli.main", "certs", "issue", "node-1", "--dir", str(d))
    assert no_ca.returncode == 1
    assert f"no cluster CA in {d} (ca.crt and ca.key): run `phalanx certs init --dir {d}` first" in no_ca.stderr
    assert run("-m", "cli.main", "certs", "init", "--dir", str(d)).returncode == 0
    key_before = (d / "ca.key").read_bytes()
    again = run("-m", "cli.main", "certs", "init", "--dir", str(d))
    assert again.returncode == 1 and f"{d / 'ca.crt'} already exists; refusing to overwrite it" in again.stderr
    assert (d / "ca.key").read_bytes() == key_before
    assert run("-m", "cli.main", "certs", "issue", "node-1", "--dir", str(d)).returncode == 0
    twice = run("-m", "cli.main", "certs", "issue", "node-1", "--dir", str(d))
    assert twice.returncode == 1 and "node-1.crt already exists" in twice.stderr
    san = run("-m", "cli.main", "certs", "issue", "node-2", "--san", "x", "--dir", str(d))
    assert san.returncode == 2 and "--san is only for --role controller" in san.stderr
    for bad in ("../evil", ".hidden", "a,b", "a=b"):
        with pytest.raises(pki.PkiError, match="bad certificate name"):
            pki.issue(d, bad)


def test_daemon_files_are_checked_at_start_with_one_line_each(ca, other_ca, tmp_path):
    with pytest.raises(ConfigError, match=r"CA certificate .*nope\.crt: no such file"):
        tls.Identity.load(str(tmp_path / "nope.crt"), str(ca / "node-a.crt"), str(ca / "node-a.key"))
    pki.issue(ca, "node-k", "node")
    pki.issue(ca, "node-l", "node")
    with pytest.raises(ConfigError, match=r"private key .*node-k\.key does not belong to certificate .*node-l\.crt"):
        tls.Identity.load(str(ca / "ca.crt"), str(ca / "node-l.crt"), str(ca / "node-k.key"))
    with pytest.raises(ConfigError, match="was not issued by the CA in the configured ca_file"):
        tls.Identity.load(str(ca / "ca.crt"), str(other_ca / "node-x.crt"), str(other_ca / "node-x.key"))
    twin = tmp_path / "twin"  # a second cluster with the same CA name: the signature tells them apart
    pki.init_ca(twin, cluster="test")
    pki.issue(twin, "node-k", "node")
    with pytest.raises(ConfigError, match="was not issued by the CA in the configured ca_file"):
        tls.Identity.load(str(ca / "ca.crt"), str(twin / "node-k.crt"), str(twin / "node-k.key"))
    (tmp_path / "junk.crt").write_text("hello")
    with pytest.raises(ConfigError, match="not a PEM file"):
        tls.Identity.load(str(tmp_path / "junk.crt"), str(ca / "node-k.crt"), str(ca / "node-k.key"))


def test_daemons_exit_2_on_missing_certificates_and_bad_security_config(tmp_path):
    port = free_port()
    controller = tmp_path / "c.toml"
    controller.write_text(f'listen = "127.0.0.1:{port}"\nstate_db = "{tmp_path / "c.db"}"\n'
                          f'[security]\nca_file = "{tmp_path / "ca.crt"}"\n')
    result = run("-m", "controller.main", "--config", str(controller))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"phalanx-controller: config error: security: CA certificate {tmp_path / 'ca.crt'}: no such file (make one "
        "with `phalanx certs`; plaintext on loopback needs insecure = true in a daemon's config, or --insecure / "
        "PHALANX_INSECURE=1 for a client)")
    controller.write_text(f'listen = "127.0.0.1:{port}"\n[security]\ntoken_listen = "127.0.0.1:1"\n')
    result = run("-m", "controller.main", "--config", str(controller))
    assert result.returncode == 2
    assert "token_listen is set but neither security.tokens_file nor security.ca_key_file" in result.stderr
    controller.write_text(f'listen = "127.0.0.1:{port}"\n[security]\ninsecure = true\ntoken_listen = "127.0.0.1:1"\n'
                          f'tokens_file = "{tmp_path / "t"}"\n')
    result = run("-m", "controller.main", "--config", str(controller))
    assert result.returncode == 2
    assert "token_listen needs TLS; it cannot be used with security.insecure" in result.stderr
    agent = tmp_path / "a.toml"
    agent.write_text(f'node_name = "n1"\nstate_dir = "{tmp_path / "s"}"\nsnapshot_dir = ""\n[security]\n'
                     f'cert_file = "{tmp_path / "n1.crt"}"\nca_file = "{tmp_path / "ca.crt"}"\n')
    result = run("-m", "agent.main", "--config", str(agent))
    assert result.returncode == 2 and result.stderr.startswith("phalanx-agent: config error: security: CA certificate")
    agent.write_text('node_name = "n1"\n[security]\ninsecure = true\nsocket_group = "no-such-group-here"\n')
    result = run("-m", "agent.main", "--config", str(agent))
    assert result.returncode == 2
    assert "security.socket_group ('no-such-group-here') is not a group on this host" in result.stderr


# -- who may call what ---------------------------------------------------------------------------

def test_agents_with_their_certificates_register_and_clients_with_theirs_can_list(secure, ca):
    names = sorted(n.name for n in list_nodes(secure.address, creds(ca, "operator")).nodes)
    assert names == ["node-a", "node-b"]
    result = secure.cli("nodes", "--json")  # the CLI with PHALANX_CA / PHALANX_CERT / PHALANX_KEY
    assert result.returncode == 0, result.stderr
    assert sorted(n["name"] for n in json.loads(result.stdout)) == ["node-a", "node-b"]


def test_a_client_without_a_certificate_or_with_a_strangers_is_turned_away(secure, ca, other_ca):
    for credentials in (creds(ca, None), creds(other_ca, "mallory", ca_dir=ca)):
        code, _ = status_of(lambda c=credentials: list_nodes(secure.address, c))
        assert code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake itself fails
    with grpc.insecure_channel(secure.address) as channel:  # plaintext to a TLS port
        code, _ = status_of(lambda: control_pb2_grpc.ControlServiceStub(channel).ListNodes(
            control_pb2.ListNodesRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    insecure_cli = subprocess.run([sys.executable, "-m", "cli.main", "--insecure", "nodes"],
                                  capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "PHALANX_CONTROLLER": secure.address})
    assert insecure_cli.returncode == 1 and "cannot reach the controller" in insecure_cli.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    anonymous_cli = subprocess.run([sys.executable, "-m", "cli.main", "--controller", secure.address, "--ca",
                                    str(secure.pki / "ca.crt"), "nodes"], capture_output=True, text=True, timeout=60,
                                   env=env)  # the CA, but no certificate: the error says what is missing
    assert anonymous_cli.returncode == 1 and "no client certificate or token was given" in anonymous_cli.stderr, \
        anonymous_cli.stderr
    assert secure._serving()  # and the controller is none the worse


def test_a_node_certificate_only_acts_as_its_own_node(secure, ca):
    with grpc.secure_channel(secure.address, creds(ca, "node-a")) as channel:
        control = control_pb2_grpc.ControlServiceStub(channel)
        code, details = status_of(lambda: control.ListNodes(control_pb2.ListNodesRequest(), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details == ("node 'node-a' (certificate) may not call phalanx.v1.ControlService (allowed: client)")
        nodes = node_pb2_grpc.NodeServiceStub(channel)
        inventory = node_pb2.RegisterRequest(node_name="node-b").inventory
        inventory.hostname = "h"
        code, details = status_of(lambda: nodes.Register(
            node_pb2.RegisterRequest(node_name="node-b", inventory=inventory), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details == "this certificate is for node 'node-a'; it cannot act as node 'node-b'"
    with grpc.secure_channel(secure.address, creds(ca, "operator")) as channel:
        nodes = node_pb2_grpc.NodeServiceStub(channel)
        code, details = status_of(lambda: nodes.Register(node_pb2.RegisterRequest(node_name="node-z"), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may not call phalanx.v1.NodeService" in details


def test_an_agent_with_another_nodes_certificate_is_a_config_error(secure, ca):
    pki.issue(ca, "node-c", "node")
    proc = secure.start_agent("node-d", gpus=1, extra=(
        f'[security]\nca_file = "{ca / "ca.crt"}"\ncert_file = "{ca / "node-c.crt"}"\n'
        f'key_file = "{ca / "node-c.key"}"\n'))
    assert proc.wait(timeout=TIMEOUT_S) == 2
    assert (f"config error: security: certificate {ca / 'node-c.crt'} is for node 'node-c', not node 'node-d'"
            in (secure.root / "node-d.log").read_text())
    assert "node-d" not in secure.states()


def test_a_session_for_another_node_is_refused_too(secure, ca):
    with grpc.secure_channel(secure.address, creds(ca, "node-a")) as channel:
        call = node_pb2_grpc.NodeServiceStub(channel).Session(iter([node_pb2.AgentMessage(
            open=node_pb2.SessionOpen(node_name="node-b", incarnation=1))]), timeout=10)
        code, details = status_of(lambda: list(call))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details == "this certificate is for node 'node-a'; it cannot act as node 'node-b'"
    assert secure.states()["node-b"] == "UP"


def test_only_plain_subjects_with_one_role_and_one_name_are_read():
    assert auth.parse_subject("CN=node-a,OU=node,O=phalanx") == ("node", "node-a")
    for subject in ("CN=x\\,OU=client,OU=node,O=p", "CN=a,OU=node,OU=client,O=p", "OU=client,O=p", "CN=a,O=p",
                    'CN="a,OU=client",OU=node', "CN=a+OU=client,OU=node", "CN=a,OU=,O=p", "garbage"):
        assert auth.parse_subject(subject) is None, subject


def test_the_token_port_takes_tokens_for_the_control_api_and_nothing_else(secure, ca):
    address = secure.token_address
    assert len(list_nodes(address, creds(ca, None, token=TOKEN)).nodes) >= 2
    code, details = status_of(lambda: list_nodes(address, creds(ca, None, token="wrong-token-wrong-token")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "needs a client certificate from the cluster CA or a valid token" in details
    code, _ = status_of(lambda: list_nodes(address, creds(ca, None)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # an agent cannot register through the token port, even with its node certificate (none is asked for)
    with grpc.secure_channel(address, creds(ca, "node-a")) as channel:
        code, _ = status_of(lambda: node_pb2_grpc.NodeServiceStub(channel).Register(
            node_pb2.RegisterRequest(node_name="node-a"), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    # the CLI with a token file
    token_file = secure.root / "token"
    token_file.write_text(TOKEN + "\n")
    result = subprocess.run([sys.executable, "-m", "cli.main", "nodes"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PHALANX_CONTROLLER": address,
                                             "PHALANX_CA": str(ca / "ca.crt"), "PHALANX_TOKEN_FILE": str(token_file)})
    assert result.returncode == 0, result.stderr
    assert "node-a" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "cli.main", "nodes"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PHALANX_CONTROLLER": address,
                                          "PHALANX_CA": str(ca / "ca.crt"), "PHALANX_TOKEN": "x" * 32})
    assert bad.returncode == 1 and "does not know you" in bad.stderr


def test_tokens_file_errors_name_the_line(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"ok {TOKEN}\nshort abc\n")
    with pytest.raises(ConfigError, match=r"tokens:2: expected 'NAME TOKEN' with a token of at least 16"):
        auth.load_tokens(str(path))
    path.write_text(f"# comment\n\nok {TOKEN}  # trailing\n")
    assert list(auth.load_tokens(str(path)).values()) == ["ok"]


# -- the node's own sockets ----------------------------------------------------------------------

def test_the_trainlib_and_nvrx_sockets_are_0660_and_given_to_the_configured_group(tmp_path):
    mine = os.getgid()
    other = next((g for g in grp.getgrall() if g.gr_gid != mine), None)
    if other is None:
        pytest.skip("this host has only one group")
    me = pwd.getpwuid(os.getuid()).pw_name
    if os.geteuid() != 0 and other.gr_name not in {g.gr_name for g in grp.getgrall() if me in g.gr_mem}:
        pytest.skip("not root and not a member of another group: cannot hand a socket to one")
    c = Cluster(tmp_path)
    try:
        c.start_controller()
        c.start_agent("node-s", gpus=1, extra=f'[security]\ninsecure = true\nsocket_group = "{other.gr_name}"\n')
        c.wait_states({"node-s": "UP"})
        for path in (tmp_path / "node-s" / "state" / "agent.sock", tmp_path / "node-s" / "nvhcd.sock"):
            info = path.stat()
            assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660, path
            assert info.st_gid == other.gr_gid, path
    finally:
        c.close()


def test_torchruns_rendezvous_handler_speaks_mutual_tls_from_the_environment(secure, ca, monkeypatch):
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from trainlib.torchrun_plugin import handler_creator

    def handler(run_id: str):
        return handler_creator()(RendezvousParameters("phalanx", secure.address, run_id, 1, 1,
                                                      local_addr="127.0.0.1"))

    monkeypatch.delenv("PHALANX_INSECURE", raising=False)
    monkeypatch.setenv("PHALANX_CA", str(ca / "ca.crt"))
    monkeypatch.setenv("PHALANX_CERT", str(ca / "operator.crt"))
    monkeypatch.setenv("PHALANX_KEY", str(ca / "operator.key"))
    info = handler("tls-run").next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    monkeypatch.setenv("PHALANX_CA", str(secure.root / "missing-ca.crt"))
    with pytest.raises(ConfigError, match=r"missing-ca\.crt: no such file"):
        handler("tls-run-2")


def test_server_streams_go_through_the_same_checks(secure, ca):
    with grpc.secure_channel(secure.address, creds(ca, "operator")) as channel:
        stream = control_pb2_grpc.ControlServiceStub(channel).WatchEvents(control_pb2.WatchEventsRequest(), timeout=10)
        first = next(iter(stream))
        assert first.seq >= 1
        stream.cancel()
    with grpc.secure_channel(secure.address, creds(ca, "node-a")) as channel:
        stream = control_pb2_grpc.ControlServiceStub(channel).WatchEvents(control_pb2.WatchEventsRequest(), timeout=10)
        code, details = status_of(lambda: next(iter(stream)))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may not call phalanx.v1.ControlService" in details


# -- a certificate of the CA that is not a controller's is no controller --------------------------

class Recorder(grpc.GenericRpcHandler):
    """A server that only notes which methods reached it (and answers UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def service(self, handler_call_details):
        self.calls.append(handler_call_details.method)
        return None


def impostor(ca: Path, cert_pem: bytes, key_pem: bytes):
    """A gRPC server on 127.0.0.1 that presents (cert_pem, key_pem) and asks clients for certificates of the CA."""
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[recorder])
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(key_pem, cert_pem)], root_certificates=(ca / "ca.crt").read_bytes(), require_client_auth=True))
    server.start()
    return server, f"127.0.0.1:{port}", recorder


def node_certificate_for_loopback(ca: Path) -> tuple[bytes, bytes]:
    """A node's certificate valid for 127.0.0.1: what a node named like the controller's address held before
    enrolment refused such names, or one an admin issued by mistake. It is a server certificate (for the node's
    snapshot port), so before clients checked the controller's name, it passed for the controller there."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    ca_cert, ca_key = pki._load_ca(ca)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = pki.sign(ca_cert, ca_key, key.public_key(), "127.0.0.1", "node")
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def test_clients_take_only_a_controllers_certificate_as_the_controller(secure, ca, tmp_path):
    """A holder of a node's key who can make clients dial it (a DNS entry, an address it took over) posed as the
    controller: the CLI sent it its calls, an agent its reports, torchrun's plugin its rendezvous. Now every client
    expects pki.CONTROLLER_NAME, which only a controller's certificate carries, and refuses before a byte of a
    call is sent; the same server with the controller's own certificate is reached (so the refusal is the name's)."""
    env = {"PHALANX_CA": str(ca / "ca.crt"), "PHALANX_CERT": str(ca / "operator.crt"),
           "PHALANX_KEY": str(ca / "operator.key"), "PHALANX_INSECURE": ""}
    real, address, recorder = impostor(ca, (ca / "controller.crt").read_bytes(),
                                       (ca / "controller.key").read_bytes())
    try:
        reached = run("-m", "cli.main", "--controller", address, "nodes", env=env)
        assert reached.returncode != 0 and "UNIMPLEMENTED" in reached.stderr, reached.stderr
        assert recorder.calls == ["/phalanx.v1.ControlService/ListNodes"]
    finally:
        real.stop(None)

    fake, address, recorder = impostor(ca, *node_certificate_for_loopback(ca))
    try:
        refused = run("-m", "cli.main", "--controller", address, "nodes", env=env)
        assert refused.returncode != 0 and pki.CONTROLLER_NAME in refused.stderr, refused.stderr
        assert "not a controller" in refused.stderr
        # the agent: its session never opens, and it says why
        c = Cluster(tmp_path, pki=ca)
        try:
            c.address = address
            c.start_agent("node-c", gpus=1)
            eventually(lambda: pki.CONTROLLER_NAME in c.log("node-c", 200), "the agent saying why it has no session",
                       timeout=TIMEOUT_S)
        finally:
            c.close()
        # torchrun's plugin (and every other client on ClientSecurity)
        with tls.ClientSecurity.from_env(env).channel(address, []) as channel:
            code, details = status_of(lambda: control_pb2_grpc.ControlServiceStub(channel).ListNodes(
                control_pb2.ListNodesRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE and tls.controller_name_problem(details)
        assert recorder.calls == []
    finally:
        fake.stop(None)


def test_no_certificate_but_a_controllers_may_carry_the_controllers_name(tmp_path):
    d = tmp_path / "pki"
    pki.init_ca(d, cluster="test")
    for name, role, sans in ((pki.CONTROLLER_NAME, "node", ()), ("x", "etcd", (pki.CONTROLLER_NAME,)),
                             ("gpu.phalanx.invalid", "client", ())):
        with pytest.raises(pki.PkiError, match=r"only for controller certificates|Phalanx keeps for its controllers"):
            pki.issue(d, name, role, sans)
    assert "Phalanx keeps" in pki.node_name_problem("node-1.phalanx.invalid")
    issued = pki.issue(d, "ctl", "controller", ("10.0.0.1",))
    assert pki.CONTROLLER_NAME in pki.certificate_names(issued.cert.read_bytes())
    assert pki.CONTROLLER_NAME not in pki.certificate_names(pki.issue(d, "gpu-1", "node").cert.read_bytes())
