"""Gang jobs on a real 4-node local cluster, with real torch (gloo, CPU) ranks."""

import signal
import sys
from pathlib import Path

import psutil
import pytest

from tests.cluster import alive

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

TRAIN = str(Path(__file__).resolve().parent.parent / "examples" / "train_gloo.py")
NODES = ["node-a", "node-b", "node-c", "node-d"]


def phalanx(cluster, *args, timeout=180):
    return cluster.cli(*args, timeout=timeout)


def job(cluster, job_id):
    """What `phalanx job JOB --json` says, over gRPC: the waits poll it (the CLI's own is tested in test_cli)."""
    return cluster.job(job_id)


@pytest.fixture
def four(cluster, request):
    # An agent restart must not look like a lost node: on a loaded machine starting the agent again can take
    # longer than the default 3 s before DOWN, and the node's job would then (rightly) be restarted.
    liveness = ("[liveness]\nsuspect_after_s = 4.0\ndown_after_s = 8.0\n"
                if request.node.get_closest_marker("agent_restart") else "")
    cluster.start_controller(liveness + '[jobs]\nstop_grace_s = 5.0\n[recovery]\nmax_restarts = 1\n'
                             'restart_backoff_s = 0.2\n')
    for name in NODES:
        cluster.start_agent(name, gpus=2)
    cluster.wait_states(dict.fromkeys(NODES, "UP"))
    return cluster


def submit(cluster, *args):
    result = phalanx(cluster, "submit", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def running_ranks(cluster, job_id):
    j = job(cluster, job_id)
    return j["state"] == "RUNNING" and all(r["state"] == "RUNNING" and r["pid"] for r in j["ranks"])


def test_a_two_node_gloo_job_runs_to_completion(four, tmp_path):
    out = tmp_path / "checksum.txt"
    job_id = submit(four, "--nodes", "2", "--ranks-per-node", "2", "--name", "tiny", "--",
                    sys.executable, TRAIN, "--steps", "10", "--out", str(out))
    assert job_id == "job-1"
    waited = phalanx(four, "wait", job_id)
    assert waited.returncode == 0, waited.stderr + phalanx(four, "logs", job_id).stdout
    j = job(four, job_id)
    assert j["state"] == "SUCCEEDED" and len(j["nodes"]) == 2 and j["world_size"] == 4
    assert [r["exit_code"] for r in j["ranks"]] == [0, 0, 0, 0]
    assert j["master_addr"] == "127.0.0.1" and j["master_port"]
    logs = phalanx(four, "logs", job_id, "--rank", "0").stdout
    assert "step 9 loss" in logs and "rank 0/4 done" in logs
    assert "rank 3/4 done" in phalanx(four, "logs", job_id, "--rank", "3").stdout
    # the same result as the same training run alone, in one process group of 4 (the model is the same)
    assert len(out.read_text().strip()) == 64
    listing = phalanx(four, "jobs").stdout.splitlines()
    assert listing[0].split()[:4] == ["JOB", "NAME", "STATE", "SIZE"] and "SUCCEEDED" in listing[1]


def test_a_failing_rank_is_restarted_then_fails_the_job_with_its_exit_code(four):
    job_id = submit(four, "--nodes", "2", "--", sys.executable, TRAIN, "--steps", "3", "--exit-code", "3")
    waited = phalanx(four, "wait", job_id)
    assert waited.returncode == 3, waited.stderr
    j = job(four, job_id)
    assert j["state"] == "FAILED" and j["generation"] == 2
    assert j["reason"].startswith("gave up after 1 restarts: rank 1 on ") and j["reason"].endswith(
        "exited with code 3")
    # the job ended while its other rank still ran (it was stopped): its record says how that one ended too
    four.wait_for(lambda: all(r["state"] != "RUNNING" for r in job(four, job_id)["ranks"]),
                  "every rank's end recorded")
    ended = {r["rank"]: (r["state"], r["exit_code"]) for r in job(four, job_id)["ranks"]}
    assert all(state == "EXITED" for state, _ in ended.values()) and ended[1] == ("EXITED", 3), ended


def test_cancel_stops_every_rank_on_every_node(four):
    job_id = submit(four, "--nodes", "2", "--ranks-per-node", "2", "--", sys.executable, TRAIN, "--steps", "100000",
                    "--step-time", "0.05")
    four.wait_for(lambda: running_ranks(four, job_id), "ranks running")
    pids = [r["pid"] for r in job(four, job_id)["ranks"]]
    assert all(psutil.pid_exists(p) for p in pids)
    result = phalanx(four, "cancel", job_id)
    assert result.returncode == 0, result.stderr
    assert phalanx(four, "wait", job_id).returncode == 1
    assert job(four, job_id)["state"] == "CANCELLED"
    four.wait_for(lambda: not any(alive(p) for p in pids), "every rank process gone")
    assert phalanx(four, "cancel", job_id).returncode == 1  # already ended


@pytest.mark.agent_restart
def test_an_agent_restart_leaves_ranks_running_and_readopts_them(four):
    job_id = submit(four, "--nodes", "2", "--", sys.executable, TRAIN, "--steps", "100000", "--step-time", "0.05")
    four.wait_for(lambda: running_ranks(four, job_id), "ranks running")
    j = job(four, job_id)
    node, pid = j["ranks"][0]["node"], j["ranks"][0]["pid"]
    four.kill(node, signal.SIGKILL)  # the agent dies; its ranks live in sessions of their own
    four.wait_for(lambda: not four.node(node).connected, "the controller to see the agent's session end")
    assert psutil.pid_exists(pid)
    four.start_agent(node, gpus=2)
    four.wait_for(lambda: four.node(node).connected and four.node(node).running_ranks == 1, "ranks re-adopted")
    assert psutil.pid_exists(pid)
    assert job(four, job_id)["state"] == "RUNNING"
    events = phalanx(four, "events", "--node", node, "--json").stdout
    assert "re-adopted 1 running ranks" in events
    # the re-adopted rank can still be stopped, and how it ended is known
    assert phalanx(four, "cancel", job_id).returncode == 0
    assert phalanx(four, "wait", job_id).returncode == 1
    four.wait_for(lambda: not alive(pid), "re-adopted rank stopped")


def test_a_job_larger_than_the_cluster_waits_with_a_reason(four):
    job_id = submit(four, "--nodes", "6", "--", "true")
    four.wait_for(lambda: "needs 6 nodes" in job(four, job_id)["reason"], "a pending reason")
    j = job(four, job_id)
    assert j["state"] == "PENDING"
    text = phalanx(four, "job", job_id).stdout
    assert "PENDING" in text and "needs 6 nodes" in text
    assert phalanx(four, "cancel", job_id).returncode == 0
    assert job(four, job_id)["state"] == "CANCELLED"


def test_bad_submissions(four):
    cases = [
        (("submit", "--nodes", "0", "--", "true"), 2, "'0' must be at least 1"),
        (("submit", "--nodes", "-1", "--", "true"), 2, "'-1' must be at least 1"),  # not "not negative": 0 is not
        (("submit", "--nodes", "1", "--gpus", "3", "--", "true"), 2, "unrecognized arguments"),
        (("submit", "--nodes", "1"), 2, "no command: put the program after --"),
        (("submit", "--nodes", "3", "--segment", "2", "--", "true"), 2, "nodes (3) must be a multiple of segment (2)"),
        (("submit", "--name", "bad name", "--", "true"), 2, "name 'bad name' must be 1-63 letters"),
        (("job", "job-999"), 1, "no job 'job-999'"),
    ]
    for args, code, message in cases:
        result = phalanx(four, *args)
        assert result.returncode == code, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    assert phalanx(four, "jobs", "--json").stdout.strip() == "[]"


def test_jobs_survive_a_controller_restart(four):
    job_id = submit(four, "--nodes", "2", "--", sys.executable, TRAIN, "--steps", "100000", "--step-time", "0.05")
    # until each rank's own pid is known: before its wrapper has said it, a rank's pid is the wrapper's, and the
    # new controller would then be told the rank's own (a test that killed the controller in that second failed)
    four.wait_for(lambda: running_ranks(four, job_id) and all(r["pid"] != r["wrapper_pid"]
                                                               for r in job(four, job_id)["ranks"]),
                  "ranks running, each its own pid known")
    pids = [r["pid"] for r in job(four, job_id)["ranks"]]
    four.kill("controller", signal.SIGKILL)
    four.start_controller('[jobs]\nstop_grace_s = 5.0\n')
    four.wait_for(lambda: all(four.node(n).connected for n in NODES), "agents reconnected")
    # the ranks' pids come with the agents' heartbeats to the new controller (the store may hold none)
    four.wait_for(lambda: [r["pid"] for r in job(four, job_id)["ranks"]] == pids, "the ranks' pids reported again")
    j = job(four, job_id)
    assert j["state"] == "RUNNING" and j["generation"] == 1
    assert all(psutil.pid_exists(p) for p in pids)
    assert phalanx(four, "cancel", job_id).returncode == 0
    assert phalanx(four, "wait", job_id).returncode == 1
