"""Attacks on the documented multi-tenant set-up (issue 39), each of which worked before: a real controller on
mutual TLS with an access file, real local accounts, and callers holding a `user`'s, a `viewer`'s, an unknown
identity's or a node's certificate. One cluster for the module; each test uses its own run ids and jobs."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from phalanx import pki
from phalanx.tls import channel_credentials
from phalanx.v1 import control_pb2, control_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc
from tests.cluster import Cluster
from tests.test_tenancy import as_, needs_root, start_fleet, traversable

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, accounts):
    c = start_fleet(tmp_path_factory.mktemp("attacks"))
    pki.issue(c.pki, "node-b", "node")  # a node's certificate, for the calls a node must not make
    yield c
    c.close()


def channel(c: Cluster, who: str) -> grpc.Channel:
    read = lambda name: (c.pki / name).read_bytes()  # noqa: E731
    return grpc.secure_channel(c.address, channel_credentials(read("ca.crt"), read(f"{who}.crt"), read(f"{who}.key")))


def rendezvous(c: Cluster, who: str) -> rendezvous_pb2_grpc.RendezvousServiceStub:
    return rendezvous_pb2_grpc.RendezvousServiceStub(channel(c, who))


def env_seen(c: Cluster, who: str, job_id: str) -> tuple[dict, dict]:
    """The job's environment as `who` gets it from GetJob, and from ListJobs."""
    stub = control_pb2_grpc.ControlServiceStub(channel(c, who))
    got = stub.GetJob(control_pb2.GetJobRequest(id=job_id), timeout=30)
    listed = next(j for j in stub.ListJobs(control_pb2.ListJobsRequest(), timeout=30).jobs if j.id == job_id)
    return dict(got.spec.env), dict(listed.spec.env)


def join(stub, run_id: str, participant: str):
    return stub.Join(rendezvous_pb2.JoinRequest(
        run_id=run_id, participant_id=participant, settings=rendezvous_pb2.RoundSettings(
            min_nodes=2, max_nodes=2, last_call_s=0, hang_s=60), join_timeout_s=60,
        store=rendezvous_pb2.StoreAddress(host="127.0.0.1", port=29500)), timeout=30)


def denied(call) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    return e.value.details()


@needs_root
def test_only_a_runs_owner_or_an_admin_takes_part_in_its_torchrun_rounds(fleet):
    """A viewer, and an identity with no entry in the access file, joined a user's torchrun round (and were told
    its store address) and closed it."""
    run_id = "alices-run"
    join(rendezvous(fleet, "alice"), run_id, "alice-1")
    listed = control_pb2_grpc.ControlServiceStub(channel(fleet, "operator")).ListJobs(control_pb2.ListJobsRequest(),
                                                                                      timeout=30).jobs
    assert [j.user for j in listed if j.id == f"torchrun-{run_id}"] == ["alice"]
    assert "viewer" in denied(lambda: join(rendezvous(fleet, "grafana"), run_id, "grafana-1"))
    assert "no entry in the access file" in denied(lambda: join(rendezvous(fleet, "mallory"), run_id, "mallory-1"))
    assert "belongs to 'alice'" in denied(lambda: join(rendezvous(fleet, "bob"), run_id, "bob-1"))
    for who in ("bob", "grafana", "mallory"):
        denied(lambda who=who: rendezvous(fleet, who).SetClosed(rendezvous_pb2.SetClosedRequest(run_id=run_id),
                                                                 timeout=30))
    assert "node" in denied(lambda: join(rendezvous(fleet, "node-b"), run_id, "node-b-1"))
    status = rendezvous(fleet, "grafana").GetRun(rendezvous_pb2.GetRunRequest(run_id=run_id), timeout=30)
    assert not status.closed and status.waiting == 1  # viewers see it; nothing they tried reached it
    join(rendezvous(fleet, "operator"), run_id, "operator-1")  # an admin may
    rendezvous(fleet, "alice").SetClosed(rendezvous_pb2.SetClosedRequest(run_id=run_id), timeout=30)
    assert rendezvous(fleet, "alice").GetRun(rendezvous_pb2.GetRunRequest(run_id=run_id), timeout=30).closed


@needs_root
def test_a_jobs_checkpoint_directory_and_secrets_are_its_owners_alone(fleet, accounts):
    """A job's checkpoint directory was 0755 (its steps too, shards 0644): another account listed, copied and
    loaded them. And viewers read every job's environment, tokens included."""
    submitted = as_(fleet, "alice", "submit", "--env", "API_TOKEN=s3cret", "--", "/bin/sh", "-c",
                    'echo weights > "$PHALANX_CHECKPOINT_DIR/model.pt" && echo "saved in $PHALANX_CHECKPOINT_DIR"; '
                    'sleep 300')
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    fleet.wait_for(lambda: "saved in /" in as_(fleet, "alice", "logs", job_id).stdout, "the job's file saved")
    log = as_(fleet, "alice", "logs", job_id).stdout
    directory = Path(log.split("saved in ", 1)[1].split()[0])
    st = directory.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (accounts["phx-alice"].pw_uid, 0o700)
    read = subprocess.run(["cat", str(directory / "model.pt")], user=accounts["phx-bob"].pw_uid,
                          capture_output=True, text=True, timeout=30)
    assert read.returncode != 0 and "Permission denied" in read.stderr
    assert env_seen(fleet, "alice", job_id) == ({"API_TOKEN": "s3cret"},) * 2
    assert env_seen(fleet, "operator", job_id) == ({"API_TOKEN": "s3cret"},) * 2
    for who in ("grafana", "bob"):
        assert env_seen(fleet, who, job_id) == ({"API_TOKEN": "<hidden>"},) * 2
    assert as_(fleet, "alice", "cancel", job_id).returncode == 0


def test_node_certificates_never_stand_in_for_users(fleet):
    """The rule behind the first test, for every rendezvous method: a node's certificate is its agent's."""
    stub = rendezvous(fleet, "node-b")
    for call in (lambda: stub.GetRun(rendezvous_pb2.GetRunRequest(run_id="x"), timeout=30),
                 lambda: stub.SetClosed(rendezvous_pb2.SetClosedRequest(run_id="x"), timeout=30)):
        assert "access file" in denied(call)


def test_no_node_certificate_can_name_an_address_or_a_controller(tmp_path):
    """Node certificates are server certificates for the node's name: one named like the controller's address or
    host name was one the controller's clients accepted as the controller."""
    pki.init_ca(tmp_path, cluster="test")
    for name in ("10.0.0.1", "localhost", "gpu.localhost"):
        with pytest.raises(pki.PkiError, match=r"IP address|reserved"):
            pki.issue(tmp_path, name, "node")
    assert pki.node_name_problem("ctl1", frozenset({"ctl1", "10.0.0.9"})) == "'ctl1' is a controller's name; a " \
                                                                             "node may not take it"
    assert pki.node_name_problem("gpu101", frozenset({"ctl1"})) == ""
    issued = pki.issue(tmp_path, "controller", "controller", sans=("ctl1", "10.0.0.9"))
    names = pki.certificate_names(Path(issued.cert).read_bytes())
    assert {"controller", "ctl1", "10.0.0.9"} <= names


@needs_root
def test_a_job_never_starts_in_a_directory_its_account_cannot_enter(fleet, tmp_path):
    """Root entered the job's working directory (the submitter's cwd) and only then became the account: a rank
    started inside a 0700 root directory read a file there that its mode alone guarded."""
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "note.txt").write_text("root's notes\n")
    (secret / "note.txt").chmod(0o644)
    traversable(tmp_path)  # the account could reach the directory above it
    env = {**os.environ, "PHALANX_CONTROLLER": fleet.address, "PHALANX_CA": str(fleet.pki / "ca.crt"),
           "PHALANX_CERT": str(fleet.pki / "alice.crt"), "PHALANX_KEY": str(fleet.pki / "alice.key")}
    env.pop("PHALANX_INSECURE", None)
    submitted = subprocess.run([sys.executable, "-m", "cli.main", "submit", "--", "/bin/sh", "-c",
                                "cat note.txt; sleep 300"], capture_output=True, text=True, env=env, timeout=60,
                               cwd=secret)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    fleet.wait_for(lambda: "cannot enter its working directory" in as_(fleet, "alice", "logs", job_id).stdout,
                   "the rank refused its working directory")
    assert "root's notes" not in as_(fleet, "alice", "logs", job_id).stdout
    as_(fleet, "alice", "cancel", job_id)


@needs_root
def test_a_snapshot_directory_another_account_made_first_turns_snapshots_off_not_the_node(fleet):
    """A local account that makes the agent's snapshot directory before its first start (in /dev/shm, emptied at
    boot) got it chmodded 1777 or followed; now the agent refuses the tree, says so, and the node runs on."""
    taken = fleet.root / "node-x" / "snapshots"
    taken.mkdir(parents=True)
    os.chown(taken, 54321, 54321)
    fleet.start_agent("node-x", gpus=1)
    fleet.wait_states({"node-a": "UP", "node-x": "UP"})
    fleet.wait_for(lambda: any(e["kind"] == "agent.snapshot_replicas_off" and "owned by uid 54321" in e["message"]
                               for e in fleet.events(node="node-x")), "the agent saying why it keeps no snapshots")
    assert taken.stat().st_uid == 54321 and stat.S_IMODE(taken.stat().st_mode) == 0o755
    fleet.kill("node-x")
