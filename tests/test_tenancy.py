"""Many users on one fleet: identities from authentication, roles from the access file, ranks as their account,
and who did what in the event log. Real daemons on mutual TLS, real local accounts the test makes (as root)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from controller import access
from controller.errors import PermissionDenied
from phalanx import pki
from phalanx.errors import ConfigError
from phalanx.v1 import control_pb2
from tests.cluster import Cluster

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="makes local accounts: needs root and useradd")


ACCESS = """
[identities.operator]
role = "admin"

[identities.alice]
role = "user"
accounts = ["phx-alice"]

[identities.bob]
role = "user"
accounts = ["phx-bob"]

[identities.grafana]
role = "viewer"
"""


def traversable(path: Path) -> None:
    """Let every account traverse the directories above `path` (pytest's tmp is 0700)."""
    for d in [path, *path.parents]:
        if d == Path("/"):
            break
        d.chmod(d.stat().st_mode | 0o011)


def start_fleet(tmp: Path) -> Cluster:
    """The documented multi-tenant set-up on loopback: mutual TLS, the access file ACCESS, node-a UP."""
    ca = tmp / "pki"
    pki.init_ca(ca, cluster="test")
    for name in ("alice", "bob", "grafana", "mallory"):
        pki.issue(ca, name, "client")
    (tmp / "access.toml").write_text(ACCESS)
    c = Cluster(tmp / "cluster", pki=ca)
    c.root.mkdir()
    traversable(c.root)  # the accounts reach the agent's state
    c.start_controller(f'[security]\nca_file = "{ca / "ca.crt"}"\ncert_file = "{ca / "controller.crt"}"\n'
                       f'key_file = "{ca / "controller.key"}"\naccess_file = "{tmp / "access.toml"}"\n')
    c.start_agent("node-a", gpus=2)
    c.wait_states({"node-a": "UP"})
    return c


@pytest.fixture
def fleet(tmp_path, accounts):
    c = start_fleet(tmp_path)
    yield c
    c.close()


def as_(c, who: str, *args):
    env = {**os.environ, "PHALANX_CONTROLLER": c.address, "PHALANX_CA": str(c.pki / "ca.crt"),
           "PHALANX_CERT": str(c.pki / f"{who}.crt"), "PHALANX_KEY": str(c.pki / f"{who}.key")}
    env.pop("PHALANX_INSECURE", None)
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def job(c, who: str, job_id: str) -> dict:
    out = as_(c, who, "job", job_id, "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@needs_root
def test_ranks_run_as_their_users_account_and_only_owners_and_admins_act_on_a_job(fleet, accounts):
    c = fleet
    # its NCCL dumps and in-memory snapshots go to directories of its own, which its ranks may write
    probe = 'touch "$PHALANX_SNAPSHOT_DIR/$PHALANX_JOB/probe" "$(dirname "$TORCH_NCCL_DEBUG_INFO_TEMP_FILE")/probe" ' \
            '&& echo wrote-both; '
    submitted = as_(c, "alice", "submit", "--env", "LD_PRELOAD=/nonexistent.so", "--", "/bin/sh", "-c",
                    probe + "id; sleep 300")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    c.wait_for(lambda: job(c, "alice", job_id)["state"] == "RUNNING" and job(c, "alice", job_id)["ranks"][0]["pid"],
               "alice's job running")
    j = job(c, "alice", job_id)
    assert j["user"] == "alice"  # who authenticated, not what the CLI claimed (it runs as root here)
    status = Path(f"/proc/{j['ranks'][0]['pid']}/status").read_text()
    alice = accounts["phx-alice"]
    fields = {line.split(":")[0]: line.split(":")[1].split() for line in status.splitlines() if ":" in line}
    assert fields["Uid"][:2] == [str(alice.pw_uid)] * 2 and fields["Gid"][:2] == [str(alice.pw_gid)] * 2
    import grp
    assert str(grp.getgrnam("phx-data").gr_gid) in fields["Groups"]
    env = Path(f"/proc/{j['ranks'][0]['pid']}/environ").read_bytes().split(b"\0")
    assert b"USER=phx-alice" in env and not any(e.startswith((b"NOTIFY_SOCKET=", b"PHALANX_KEY=")) for e in env)
    # the wrapper, which keeps the agent's rights, never ran with what the job put in its environment
    wrapper = Path(f"/proc/{j['ranks'][0]['wrapper_pid']}/environ").read_bytes().split(b"\0")
    assert b"LD_PRELOAD=/nonexistent.so" in env and not any(e.startswith(b"LD_PRELOAD") for e in wrapper)
    c.wait_for(lambda: f"uid={alice.pw_uid}" in as_(c, "alice", "logs", job_id).stdout, "the rank's `id` in its log")
    log_text = as_(c, "alice", "logs", job_id).stdout
    assert "wrote-both" in log_text, log_text
    assert (c.root / "node-a" / "state" / "nccl" / job_id).stat().st_uid == alice.pw_uid
    # its trainlib socket is its own: alice's processes may open it, bob's may not, and the shared one refuses it
    sock = next(e for e in env if e.startswith(b"PHALANX_AGENT_SOCKET=")).split(b"=", 1)[1].decode()
    assert sock.endswith(f"/jobs/{job_id}/agent.sock") and Path(sock).stat().st_uid == alice.pw_uid
    probe = ["/usr/bin/python3", "-c", "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])", sock]
    assert subprocess.run(probe, user=alice.pw_uid, capture_output=True, timeout=30).returncode == 0
    refused = subprocess.run(probe, user=accounts["phx-bob"].pw_uid, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr
    from phalanx.v1 import local_pb2, local_pb2_grpc
    shared = f"unix://{c.root / 'node-a' / 'state' / 'agent.sock'}"
    with grpc.insecure_channel(shared) as channel, pytest.raises(grpc.RpcError) as e:
        local_pb2_grpc.LocalServiceStub(channel).Report(local_pb2.ReportRequest(job=job_id, generation=1), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "its own socket" in e.value.details()
    log_dir = c.root / "node-a" / "state"
    assert any(p.stat().st_uid == alice.pw_uid for p in log_dir.rglob("rank-0.log"))
    # bob may not touch alice's job; the viewer may look, not act; an unknown identity gets nothing
    for who, args, message in (
            ("bob", ("cancel", job_id), f"{job_id} belongs to 'alice'; 'bob' is a user and may act only on its own"),
            ("bob", ("logs", job_id), f"{job_id} belongs to 'alice'"),
            ("bob", ("checkpoint", job_id), f"{job_id} belongs to 'alice'"),
            ("grafana", ("cancel", job_id), "'grafana' is a viewer; CancelJob is for a job's owner or an admin"),
            ("grafana", ("submit", "--", "/bin/true"), "'grafana' is a viewer; SubmitJob is for users and admins"),
            ("alice", ("drain", "node-a", "--reason", "x"), "'alice' is a user; DrainNode is for admins"),
            ("mallory", ("nodes",), "identity 'mallory' has no entry in the access file"),
            ("alice", ("submit", "--as", "root", "--", "/bin/true"), "may run jobs as phx-alice, not 'root'"),
            ("alice", ("submit", "--as", "phx-bob", "--", "/bin/true"), "may run jobs as phx-alice, not 'phx-bob'")):
        out = as_(c, who, *args)
        assert out.returncode == 1 and message in out.stderr and "PERMISSION_DENIED" in out.stderr, (who, args,
                                                                                                     out.stderr)
    assert as_(c, "grafana", "jobs", "-o", "name").stdout.split() == [job_id]
    assert as_(c, "grafana", "nodes", "-o", "name").stdout.split() == ["node-a"]
    assert job(c, "alice", job_id)["state"] == "RUNNING"
    # the owner and an admin may; every such action says who did it
    assert as_(c, "operator", "drain", "node-a", "--reason", "swap a fan").returncode == 0
    assert as_(c, "alice", "cancel", job_id).returncode == 0
    by_alice = json.loads(as_(c, "grafana", "events", "--by", "alice", "-o", "json").stdout)
    assert [e["kind"] for e in by_alice] == ["job.submitted", "job.cancelling"]
    by_operator = json.loads(as_(c, "grafana", "events", "--by", "operator", "-o", "json").stdout)
    assert [e["kind"] for e in by_operator] == ["node.drain"]
    assert "[by operator]" in as_(c, "grafana", "events", "--node", "node-a").stdout


def test_every_control_method_has_its_rule():
    from phalanx.v1 import control_pb2 as pb
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ControlService"].methods}
    assert set(access.METHODS) == methods


@pytest.mark.parametrize("text, message", [
    ('[identities.a]\nrole = "boss"\n', "identities.a.role ('boss') must be one of: viewer, user, admin"),
    ('[identities.a]\nrole = "user"\naccounts = ["root"]\n', "accounts name root; say allow_root = true"),
    ('[identities.a]\nrole = "viewer"\naccounts = ["x"]\n', "a viewer runs no jobs"),
    ('[identities.a]\nrole = "user"\nacounts = ["x"]\n', "unknown key 'acounts'"),
    ('[people.a]\nrole = "user"\n', "unknown key 'people'"),
])
def test_bad_access_files_are_refused_naming_the_rule(tmp_path, text, message):
    path = tmp_path / "access.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        access.load(str(path))
    assert message in str(e.value)


def test_root_only_where_allowed():
    policy = access.Policy({"ops": access.Identity("ops", "admin", ("root",), True),
                            "al": access.Identity("al", "user", ("al", "root"), False)}, "access.toml")
    assert policy.account(policy.identity("ops"), "") == "root"
    with pytest.raises(PermissionDenied, match="may not run jobs as root"):
        policy.account(policy.identity("al"), "root")


def test_without_an_access_file_run_as_is_refused(cluster):
    cluster.start_controller()
    with grpc.insecure_channel(cluster.address) as ch:
        from phalanx.v1 import common_pb2, control_pb2_grpc
        with pytest.raises(grpc.RpcError) as e:
            control_pb2_grpc.ControlServiceStub(ch).SubmitJob(control_pb2.SubmitJobRequest(
                spec=common_pb2.JobSpec(command=["true"], nodes=1, run_as="nobody")), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "needs an access file" in e.value.details()
