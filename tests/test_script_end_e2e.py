"""Issue 40, end to end: a script written as users write them (examples/train_user.py: the loop, a barrier, rank 0
saves the final model, destroy_process_group, `sys.exit(main())`) on a 4-node local cluster with warm standbys on,
2 nodes x 2 ranks + 1 spare and snapshots every step, one fault of each kind mid-run. Each job must recover once,
run to SUCCEEDED with the model of an uninterrupted run, and draw no other verdict: not a hang at its end (what
the issue saw after 3 of 14 recoveries), and no straggler verdict after its restart.

Marked slow (`make test-slow`, CI's test-slow stage): five real 4-rank jobs with standbys importing torch beside
them take about a minute each on 2 CPUs; the in-process rules they rest on are in tests/test_lifecycle.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _run_base

pytestmark = [pytest.mark.procs, pytest.mark.slow]

SCRIPT = str(Path(__file__).resolve().parent.parent / "examples" / "train_user.py")
NODES = ["node-a", "node-b", "node-c", "node-d"]
STEPS = 600  # 500 after the fault: a durable checkpoint (every 500), the end, and any late verdict have their time
FAULT_AT = 100  # rank 0 prints every 50 steps: the fault comes once it printed this one
# keep_spares = false: every "node" here shares the same two cores (see tests/test_recovery_e2e.py). The straggler
# rule is tuned for that as there (ratio 1.2, cost 0.2, a full window): healthy ranks' computes drift apart by up to
# ~1.13x on their own, and at the default ratio (1.05) a healthy rank was taken for a straggler 800 steps after the
# restart once in CI (1.15x, 19 of 30 steps), beside three other workers' clusters. A straggler verdict the restart
# itself draws (the start-up taken for slowness) stands well clear of that.
CONTROLLER = ("[jobs]\nstop_grace_s = 3.0\nkeep_spares = false\n[recovery]\nrestart_backoff_s = 0.2\n"
              "checkpoint_deadline_s = 20.0\nstraggler_ratio = 1.2\nstraggler_cost = 0.2\nstraggler_min_samples = 30\n")


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> str:
    """The final model's sha256 of the same script run uninterrupted as 4 ranks with torch's own launch (trainlib
    a no-op shim; once per run: under the run's base directory, made under a lock)."""
    import fcntl

    from phalanx.ports import free_port
    base = _run_base(tmp_path_factory)
    with open(base / "user-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = base / "user-reference.sha256"
        if not done.exists():
            scratch = tmp_path_factory.mktemp("user-reference")
            port = free_port()
            env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
            procs = [subprocess.Popen([sys.executable, SCRIPT, "--steps", str(STEPS), "--step-time", "0"],
                                      env={**env, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(port)}, cwd=scratch, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE) for rank in range(4)]
            for p in procs:
                assert p.wait(timeout=600) == 0, p.stderr.read()
            os.replace(scratch / "checkpoints" / "final.pt.sha256", done)
        return done.read_text().strip()


@pytest.fixture
def warm4(cluster):
    cluster.start_controller(CONTROLLER)
    for name in NODES:
        cluster.start_agent(name, gpus=2, extra="warm_start = true")
    cluster.wait_states(dict.fromkeys(NODES, "UP"))
    return cluster


def account(cluster, job_id: str) -> str:
    told = "\n".join(f"{e['kind']}: {e['message']}" for e in cluster.events(job=job_id))
    return f"{told}\njob: {json.dumps(cluster.job(job_id))}\n{cluster.rank_logs(job_id)}"


FAULTS = ["crash", "xid-79", "node-lost", "hang", "predictable"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_users_script_recovers_once_and_ends_succeeded_with_the_uninterrupted_model(warm4, tmp_path, fault,
                                                                                     uninterrupted):
    c = warm4
    ckpt = tmp_path / "ckpt"
    submitted = c.cli("submit", "--nodes", "2", "--ranks-per-node", "2", "--spares", "1", "--checkpoint-dir",
                      str(ckpt), "--", sys.executable, SCRIPT, "--steps", str(STEPS), "--snapshot")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    j = c.job(job_id)
    # the restart should start warm: standbys of the job on its nodes and its spare first
    # (standbys import torch under SCHED_IDLE, in the time the ranks leave idle: on 2 loaded CPUs that can be slow)
    c.wait_for(lambda: all(c.job(job_id)["standbys"].get(n, 0) >= 1 for n in (*j["nodes"], *j["spares"])),
               "a warm standby of the job on each of its nodes and its spare", timeout=240)
    c.wait_for(lambda: f"step {FAULT_AT} loss" in c.logs(job_id), f"step {FAULT_AT}", timeout=240)
    j = c.job(job_id)
    assert j["state"] == "RUNNING" and j["generation"] == 1, f"the job ended before its fault: {account(c, job_id)}"
    victim = j["nodes"][1]
    if fault == "crash":
        rank = next(r for r in j["ranks"] if r["node"] == victim)
        os.kill(rank["pid"], signal.SIGKILL)
    elif fault == "node-lost":
        c.kill(victim, signal.SIGKILL)
    else:
        what = {"xid-79": "xid=79", "hang": "hang", "predictable": "remap-pending"}[fault]
        assert c.cli("inject", victim, "--gpu", "0", what).returncode == 0
    waited = c.cli("wait", job_id)
    j = c.job(job_id)
    assert waited.returncode == 0 and j["state"] == "SUCCEEDED", account(c, job_id)
    # one recovery, and no verdict besides the fault's: no hang at the end, no straggler after the restart
    assert (j["generation"], j["restarts"]) == (2, 1), account(c, job_id)
    events = c.events(job=job_id)
    incidents = [e["message"] for e in events if e["kind"] == "job.incident"]
    kind = {"crash": "crash", "xid-79": "gpu-failed", "node-lost": "node-lost", "hang": "hang",
            "predictable": "gpu-failing"}[fault]
    assert len(incidents) == 1 and f": {kind}: " in incidents[0], account(c, job_id)  # the fault, seen as such
    assert not [e for e in events if e["kind"] in ("job.slow_exit", "job.teardown_failed")], account(c, job_id)
    assert j["evicted"] == ([] if fault == "crash" else [victim]), account(c, job_id)
    assert (ckpt / "final.pt.sha256").read_text().strip() == uninterrupted, account(c, job_id)
    assert any("(warm) ---" in c.logs(job_id, rank) for rank in range(4)), "no rank of generation 2 started warm"
