"""Recovery end to end: a real torch (gloo, CPU) job on a 4-node local cluster, a fault, and a final
model that must equal an uninterrupted run's.

Each test runs examples/train_phalanx.py on 2 nodes x 1 rank with 1 spare, injects one fault on a
node of the job, and checks what happened (events, generation, restarts) and the final checksum.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.eventually import TIMEOUT_S

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

TRAIN = str(Path(__file__).resolve().parent.parent / "examples" / "train_phalanx.py")
NODES = ["node-a", "node-b", "node-c", "node-d"]
# A job ends by event, not by length: it trains until a recovery, then AFTER_RESUME steps more (train_phalanx.py
# --steps-after-resume), and how many steps it trained in all it writes beside its checksum (--out-steps). The test
# compares that checksum with the model of an uninterrupted run of as many steps (the `reference` fixture). However
# slowly a loaded machine detects the fault, the job cannot end before it; STEPS only bounds a job that never
# recovers (its `phalanx wait` fails the test first).
STEPS = 100_000
AFTER_RESUME = 40


def phalanx(cluster, *args, timeout=300):
    return cluster.cli(*args, timeout=timeout)


def job(cluster, job_id):
    """What `phalanx job JOB --json` says (over gRPC: the waits poll it; `finish` asks the CLI itself)."""
    return cluster.job(job_id)


def events(cluster, job_id):
    """What `phalanx events --job JOB --json` says (over gRPC, as job())."""
    return cluster.events(job=job_id)


@pytest.fixture
def cluster4(cluster):
    # straggler_ratio 1.2 and straggler_cost 0.2: on a shared 2-core machine the CPU-bound ranks' compute times
    # drift apart by up to ~1.13x on their own (measured under `make test-busy`), which costs up to ~12% of a step;
    # the injected straggler (slow=0.9: 1.9x, ~45%) stands well clear. straggler_min_samples = 30, a full window:
    # once, under `make test-busy`, the healthy rank 0 computed 1.30x slower than rank 1 in 12 of a generation's
    # first 18 steps (the injected fault had not reached rank 1 yet), and 10 steps were enough for a verdict.
    return started4(cluster)


# keep_spares = false: here every "node" shares the same two cores, so a spare held again mid-run starts its
# standbys (torch imports) beside the training ranks and can make a healthy rank look like a straggler; on a
# fleet a spare is a machine of its own. Holding spares again is tested in tests/test_lifecycle.py.
CONTROLLER = ("[jobs]\nstop_grace_s = 3.0\nkeep_spares = false\n[recovery]\nrestart_backoff_s = 0.2\n"
              "checkpoint_deadline_s = 20.0\nhang_min_s = 4.0\nstraggler_ratio = 1.2\nstraggler_cost = 0.2\n"
              "straggler_min_samples = 30\n")


@pytest.fixture
def cluster4_warm(cluster):
    """cluster4 with warm standbys on (tests/cluster.py has them off): for the tests that a restart starts warm."""
    return started4(cluster, warm=True)


def started4(cluster, nodes=NODES, controller=CONTROLLER, warm=False):
    cluster.start_controller(controller)
    for name in nodes:
        cluster.start_agent(name, gpus=2, extra="warm_start = true" if warm else "")
    cluster.wait_states(dict.fromkeys(nodes, "UP"))
    return cluster


def start(cluster, tmp_path, *load, every="20", env=()):
    out = tmp_path / "checksum.txt"
    result = phalanx(cluster, "submit", "--nodes", "2", "--spares", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     *(a for kv in env for a in ("--env", kv)),
                     "--", sys.executable, TRAIN, *until_resumed(out), *(load or ("--step-time", "0.05")),
                     "--every", every)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    cluster.wait_for(lambda: job(cluster, job_id)["state"] == "RUNNING", "job running")
    # Start-up (torch's import, gloo's rendezvous) and 20 steps of real compute: seconds alone, but past a minute
    # once, in CI, beside three other workers' clusters on two cores. The wait is for the event; its bound is
    # generous, and a job that stops running ends it at once.
    cluster.wait_for(lambda: "step 20 loss" in cluster.logs(job_id) or job(cluster, job_id)["state"] != "RUNNING",
                     "training under way", timeout=4 * TIMEOUT_S)
    assert job(cluster, job_id)["state"] == "RUNNING", account(cluster, job_id)
    return job_id, out


def until_resumed(out: Path) -> list[str]:
    """train_phalanx.py's arguments for a run that ends AFTER_RESUME steps after its recovery (see STEPS), its
    checksum in `out` and its count of steps beside it (trained_as())."""
    return ["--steps", str(STEPS), "--steps-after-resume", str(AFTER_RESUME), "--out", str(out),
            "--out-steps", str(out.with_suffix(".steps"))]


def trained_as(out: Path, reference) -> tuple[str, str]:
    """(the run's checksum, an uninterrupted run's of as many steps): equal when no step was lost or done twice."""
    return out.read_text().strip(), reference(int(out.with_suffix(".steps").read_text()))


def start_snapshotting(cluster, tmp_path):
    """A job printing every step, with no disk checkpoint to speak of and a snapshot every step (not tuned to the
    3 % budget: on a loaded machine the tuning can double the interval, and these tests count the steps a restore
    recomputes)."""
    return start(cluster, tmp_path, "--step-time", "0.05", "--print-every", "1", every="100000",
                 env=("PHALANX_SNAPSHOT_EVERY=1",))


def account(cluster, job_id):
    """What the job went through, for a failure's message: its events, its record and the controller's log."""
    told = "\n".join(f"{e['kind']}: {e['message']}" for e in events(cluster, job_id))
    return (f"{told}\njob: {json.dumps(job(cluster, job_id))}\ncontroller log:\n{cluster.log('controller', 60)}"
            f"{cluster.rank_logs(job_id)}")


def finish(cluster, job_id, out, reference):
    """`phalanx wait` for the job's end, for as long as its ranks go on logging steps: on a loaded machine a job
    whose steps stretched to seconds (a straggler's, beside three other workers' clusters: 10 s a step once in CI)
    can take longer than one wait; a job that logs nothing new for a whole wait is stuck, and that fails."""
    logged = None
    while True:
        try:
            waited = phalanx(cluster, "wait", job_id)
            break
        except subprocess.TimeoutExpired as e:
            if (now := cluster.logs(job_id)) == logged:
                raise AssertionError(f"`phalanx wait {job_id}` still waiting after {e.timeout}s, nothing logged "
                                     f"since the last wait:\n{account(cluster, job_id)}") from None
            logged = now
    assert waited.returncode == 0, waited.stderr + account(cluster, job_id)
    j = json.loads(phalanx(cluster, "job", job_id, "--json").stdout)  # as a user reads it
    assert (j["state"], j["generation"], j["restarts"]) == ("SUCCEEDED", 2, 1), account(cluster, job_id)
    checksum, uninterrupted = trained_as(out, reference)
    assert checksum == uninterrupted  # the same model as the uninterrupted run
    return j


@pytest.mark.parametrize("commit", ["in host memory, each with a replica on another node", "durably"],
                         ids=["in-memory", "durable"])
def test_a_failing_gpu_is_checkpointed_then_evicted_with_no_step_lost(cluster4, tmp_path, reference, commit):
    """A predictable failure: every rank commits the agreed step before the eviction. A job that snapshots commits
    it as in-memory snapshots (each replicated to the other node of the job), and the spare's rank fetches its own
    from the node that is being drained, or its replica; a job that says PHALANX_EVICTION_CHECKPOINT=durable, with
    a durable save (its snapshots go on all the same)."""
    job_id, out = start(cluster4, tmp_path, env=("PHALANX_EVICTION_CHECKPOINT=durable",) if commit == "durably" else ())
    victim = job(cluster4, job_id)["nodes"][1]
    assert phalanx(cluster4, "inject", victim, "--gpu", "0", "remap-pending").returncode == 0
    j = finish(cluster4, job_id, out, reference)
    assert victim in j["evicted"] and victim not in j["nodes"]
    kinds = [e["kind"] for e in events(cluster4, job_id)]
    assert kinds.index("job.incident") < kinds.index("job.checkpointed") < kinds.index("job.evicting") \
        < kinds.index("job.rendezvous") < kinds.index("job.restarting")
    committed = next(e for e in events(cluster4, job_id) if e["kind"] == "job.checkpointed")["message"]
    step = int(committed.split("committed step ")[1].split()[0])
    assert f"committed step {step} {commit} (" in committed, committed
    logs = phalanx(cluster4, "logs", job_id).stdout
    assert f"resumed from step {step} (generation 2)" in logs  # zero lost: generation 1 stopped right there
    assert "CHECKPOINTING" in j["seconds_in_state"] and "EVICTING" in j["seconds_in_state"]
    if commit != "durably":  # (a durable job's ranks may snapshot every step, step S too: either would do then)
        restored = [e["message"] for e in events(cluster4, job_id) if e["kind"] == "job.snapshot_restore"]
        assert len(restored) == 1 and f"in-memory snapshot of step {step} (generation 1" in restored[0], restored
        assert "restored its in-memory snapshot of step" in logs, logs[-3000:]


def test_an_xid_79_resumes_from_the_in_memory_snapshots_recomputing_a_few_steps_at_most(cluster4, tmp_path,
                                                                                            reference):
    job_id, out = start_snapshotting(cluster4, tmp_path)
    victim = job(cluster4, job_id)["nodes"][1]  # rank 1's: rank 0's log of both generations stays on one node
    assert phalanx(cluster4, "inject", victim, "--gpu", "0", "xid=79").returncode == 0
    j = finish(cluster4, job_id, out, reference)
    assert victim in j["evicted"]
    kinds = [e["kind"] for e in events(cluster4, job_id)]
    assert "job.checkpointed" not in kinds  # sudden: nothing to save, resume from the newest whole snapshot
    assert_recomputed_a_few_steps_at_most(cluster4, job_id)


def assert_recomputed_a_few_steps_at_most(cluster, job_id):
    """A sudden failure with snapshots every step and no disk checkpoint: the next generation resumed from a
    snapshot a few steps at most behind the last step rank 0 finished (RECOMPUTED_AT_MOST)."""
    restore = next(e for e in events(cluster, job_id) if e["kind"] == "job.snapshot_restore")["message"]
    assert "in-memory snapshot of step" in restore, restore
    logs = phalanx(cluster, "logs", job_id, "--rank", "0").stdout
    assert 0 <= last_step_before_restart(logs) - resumed_step(logs) <= RECOMPUTED_AT_MOST, logs[-3000:]


# One in a quiet run (the step being snapshotted when the ranks stopped; `make bench` measures it). On a loaded machine
# a rank's writer can fall behind: one snapshot being written, one queued, the next one due skipped; a rank killed
# or frozen (SIGSTOP) then leaves three steps behind its last. Without the snapshots it would be every step run.
RECOMPUTED_AT_MOST = 3


# slow tier (CI's test-slow stage): 80-90 s under make test's contention, the longest there; the straggler on
# short steps below keeps the detector's end-to-end proof in make test
@pytest.mark.slow
def test_a_straggler_is_found_checkpointed_and_replaced(cluster, tmp_path, reference):
    # One straggler eviction an hour at most: on this shared 2-core machine the restarted ranks' computes can
    # drift past straggler_ratio on their own (seen twice in a row after the restart); the bound holds such a
    # second verdict back, as it is there to. hang_min_s 15 s: here the straggler stretches every rank's step to
    # ~1.8 s, so the module's 4 s floor leaves the hang limit at ~5.3 s, and a step stalled 5.5 s by other work on
    # the machine was once judged a hang before the straggler's 30 steps were in (CI, a second test run beside it).
    controller = CONTROLLER.replace("hang_min_s = 4.0", "hang_min_s = 15.0") + "straggler_max_evictions = 1\n"
    assert controller != CONTROLLER + "straggler_max_evictions = 1\n"
    cluster4 = started4(cluster, controller=controller)
    job_id, out = start(cluster4, tmp_path, "--work", "400")  # real compute before compute_done(), to stretch
    victim = job(cluster4, job_id)["nodes"][1]
    assert phalanx(cluster4, "inject", victim, "--gpu", "0", "slow=0.9").returncode == 0  # its compute 1.9x
    j = finish(cluster4, job_id, out, reference)
    incident = next(e for e in events(cluster4, job_id) if e["kind"] == "job.incident")["message"]
    assert "straggler" in incident and victim in j["evicted"]


def test_a_straggler_on_short_steps_is_found_by_what_it_costs_the_job(cluster, tmp_path, reference):
    """20 ms of compute a step, the victim's 1.5x: the job loses about a third of its pace to it. (Issue 11: the
    same fault on ~20 ms steps raised no incident at all.)"""
    cluster4 = started4(cluster, controller=CONTROLLER + "straggler_max_evictions = 1\n")
    job_id, out = start(cluster4, tmp_path, "--step-time", "0.02")
    victim = job(cluster4, job_id)["nodes"][0]
    assert phalanx(cluster4, "inject", victim, "--gpu", "0", "slow=0.5").returncode == 0
    j = finish(cluster4, job_id, out, reference)
    incident = next(e for e in events(cluster4, job_id) if e["kind"] == "job.incident")["message"]
    assert "straggler" in incident and victim in j["evicted"], incident


def test_a_hung_rank_is_found_and_restarted_from_the_in_memory_snapshots(cluster4, tmp_path, reference):
    job_id, out = start_snapshotting(cluster4, tmp_path)
    victim = job(cluster4, job_id)["nodes"][1]
    assert phalanx(cluster4, "inject", victim, "--gpu", "0", "hang").returncode == 0
    j = finish(cluster4, job_id, out, reference)
    incident = next(e for e in events(cluster4, job_id) if e["kind"] == "job.incident")["message"]
    assert "hang" in incident and victim in j["evicted"]
    assert_recomputed_a_few_steps_at_most(cluster4, job_id)


def test_a_killed_agent_is_a_lost_node_and_the_job_restarts(cluster4, tmp_path, reference):
    job_id, out = start(cluster4, tmp_path)
    victim = job(cluster4, job_id)["nodes"][1]
    cluster4.kill(victim, signal.SIGKILL)
    j = finish(cluster4, job_id, out, reference)
    incident = next(e for e in events(cluster4, job_id) if e["kind"] == "job.incident")["message"]
    assert "node-lost" in incident and victim in j["evicted"]


def test_a_controller_killed_during_recovery_finishes_it_after_restart(cluster4, tmp_path, reference):
    job_id, out = start(cluster4, tmp_path)
    victim = job(cluster4, job_id)["nodes"][1]
    assert phalanx(cluster4, "inject", victim, "--gpu", "0", "xid=79").returncode == 0
    cluster4.wait_for(lambda: job(cluster4, job_id)["state"] not in ("RUNNING",), "recovery under way")
    cluster4.kill("controller", signal.SIGKILL)
    cluster4.start_controller("[jobs]\nstop_grace_s = 3.0\n[recovery]\nrestart_backoff_s = 0.2\n")
    waited = phalanx(cluster4, "wait", job_id)
    story = account(cluster4, job_id)
    assert waited.returncode == 0, story
    j = job(cluster4, job_id)
    assert j["state"] == "SUCCEEDED" and victim in j["evicted"], story
    ran = [int(e["message"].split(" generation ")[1].split()[0]) for e in events(cluster4, job_id)
           if e["kind"] == "job.running"]
    # No generation ran twice, and the last one is the job's. One may never have run: a kill while its launches
    # were out leaves them uncertain, and the restarted controller starts the next generation instead.
    assert ran == sorted(set(ran)) and ran[-1] == j["generation"] and ran[0] == 1, f"{ran}\n{story}"
    checksum, uninterrupted = trained_as(out, reference)
    assert checksum == uninterrupted


def test_a_checkpoint_request_and_its_acknowledgement_go_through_the_agents(cluster4, tmp_path):
    job_id, _ = start(cluster4, tmp_path)
    result = phalanx(cluster4, "checkpoint", job_id, "--deadline", "60")
    assert result.returncode == 0, result.stderr
    step = int(result.stdout.split("every rank committed step ")[1].split()[0])
    manifest = json.loads((tmp_path / "ckpt" / f"step-{step:09d}" / "MANIFEST.json").read_text())
    assert manifest["step"] == step and manifest["world_size"] == 2
    # (trainlib acknowledges the request before the script prints what it saved)
    cluster4.wait_for(lambda: f"checkpointed step {step}" in cluster4.logs(job_id, rank=1),
                      f"rank 1's log of step {step}")
    assert job(cluster4, job_id)["state"] == "RUNNING"  # a checkpoint on request does not stop the job
    assert phalanx(cluster4, "cancel", job_id).returncode == 0


def test_a_checkpoint_directory_the_nodes_do_not_share_fails_the_job_at_once_with_that_reason(cluster4, tmp_path):
    """Each test agent has a checkpoint directory of its own: a 2-node job given none saves to two places.
    Rank 0 finds out at its first save, trainlib says so, and the job FAILS with that reason at once
    (before: rank 0 waited for shards written elsewhere, and the hang detector restarted it three times)."""
    result = phalanx(cluster4, "submit", "--nodes", "2", "--env", "PHALANX_CHECKPOINT_SHARED_WAIT_S=3", "--",
                     sys.executable, TRAIN, "--steps", "100", "--every", "5")
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    waited = phalanx(cluster4, "wait", job_id)
    j = job(cluster4, job_id)
    story = account(cluster4, job_id)
    assert waited.returncode != 0 and j["state"] == "FAILED", story
    assert "is not shared between the job's nodes" in j["reason"], story
    assert j["restarts"] == 0 and j["generation"] == 1, story


# -- in-memory snapshots: no periodic disk checkpoint at all (--every beyond the run), so only a snapshot can
# -- bring the job back past step 0

def last_step_before_restart(logs: str) -> int:
    """The last step rank 0 finished in generation 1 (it prints every step with --print-every 1)."""
    first = logs.split("generation 2 rank 0 ")[0]  # starting (a new process) or rejoining (the same)
    return max(int(line.split()[1]) for line in first.splitlines() if line.startswith("step ") and " loss " in line)


def await_standbys(cluster, job_id, nodes):
    """Wait until each of `nodes` holds a warm standby of the job (agent.warm): the restart can start warm."""
    cluster.wait_for(lambda: all(job(cluster, job_id)["standbys"].get(n, 0) >= 1 for n in nodes),
                     f"warm standbys on {', '.join(nodes)}")


def started_warm(logs: str, generation: int) -> bool:
    header = next(line for line in logs.splitlines() if f" generation {generation} rank " in line)
    return header.endswith("(warm) ---")


def resumed_step(logs: str) -> int:
    return int(logs.split("resumed from step ")[1].split()[0])


def test_a_killed_rank_resumes_from_the_in_memory_snapshots_recomputing_a_few_steps_at_most(cluster4_warm, tmp_path,
                                                                                              reference):
    job_id, out = start_snapshotting(cluster4_warm, tmp_path)
    await_standbys(cluster4_warm, job_id, job(cluster4_warm, job_id)["nodes"])
    rank1 = next(r for r in job(cluster4_warm, job_id)["ranks"] if r["rank"] == 1)
    os.kill(int(rank1["pid"]), signal.SIGKILL)
    finish(cluster4_warm, job_id, out, reference)
    restore = next(e for e in events(cluster4_warm, job_id) if e["kind"] == "job.snapshot_restore")["message"]
    assert "every rank restores from its in-memory snapshot of step" in restore and "fetched" not in restore
    # the ranks' own word, through their agent, is the job's too: `events --job` shows it
    assert any(e["kind"] == "agent.snapshot_restored" and e["job"] == job_id for e in events(cluster4_warm, job_id))
    logs = phalanx(cluster4_warm, "logs", job_id, "--rank", "0").stdout
    assert started_warm(logs, 2) and not started_warm(logs, 1)  # the restart took the standby
    assert 0 <= last_step_before_restart(logs) - resumed_step(logs) <= RECOMPUTED_AT_MOST, logs[-3000:]


def fetched_via(cluster, node: str) -> list[str]:
    """How `node`'s agent fetched each snapshot it restored from a peer (its log's "snapshot fetched" lines)."""
    lines = (cluster.root / f"{node}.log").read_text(errors="replace").splitlines()
    return [json.loads(line)["via"] for line in lines if '"snapshot fetched"' in line]


def test_a_lost_node_resumes_from_its_ranks_replica_on_another_node(cluster4_warm, tmp_path, reference):
    job_id, out = start_snapshotting(cluster4_warm, tmp_path)
    await_standbys(cluster4_warm, job_id, job(cluster4_warm, job_id)["spares"])
    victim = job(cluster4_warm, job_id)["nodes"][1]
    cluster4_warm.kill(victim, signal.SIGKILL)
    j = finish(cluster4_warm, job_id, out, reference)
    assert victim in j["evicted"]
    restore = next(e for e in events(cluster4_warm, job_id) if e["kind"] == "job.snapshot_restore")["message"]
    assert restore.endswith(f"fetched from {j['nodes'][0]}"), restore  # the survivor held the lost ranks' replicas
    assert fetched_via(cluster4_warm, j["nodes"][1]) == ["bulk port"]  # the spare read its rank's snapshot
    assert not [n for n in NODES if "did not read this node's bulk port" in cluster4_warm.log(n, lines=10_000)]  # nor
    # did any replica go by stream: peers pulled them from the bulk ports
    logs = phalanx(cluster4_warm, "logs", job_id, "--rank", "1").stdout
    assert "restored its in-memory snapshot of step" in logs and resumed_step(logs) > 0
    assert started_warm(logs, 2)  # on the spare, from the standby it held for the job


# slow tier (CI's test-slow stage): 80-90 s under make test's contention, the longest there; the lost node that
# resumes from its replica (above) keeps a node loss's end-to-end proof in make test
@pytest.mark.slow
def test_a_node_lost_with_the_node_holding_its_replicas_falls_back_to_the_disk_checkpoint(cluster4, tmp_path,
                                                                                           reference):
    result = phalanx(cluster4, "submit", "--nodes", "2", "--spares", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--", sys.executable, TRAIN, *until_resumed(tmp_path / "checksum.txt"), "--step-time", "0.05",
                     "--every", "20")
    job_id = result.stdout.strip()
    cluster4.wait_for(lambda: "checkpointed step 39" in cluster4.logs(job_id), "a disk checkpoint")
    for node in job(cluster4, job_id)["nodes"]:  # each holds the other's replicas: every snapshot is gone
        cluster4.kill(node, signal.SIGKILL)
    waited = phalanx(cluster4, "wait", job_id)
    story = account(cluster4, job_id)
    assert waited.returncode == 0, story
    fallback = next(e for e in events(cluster4, job_id) if e["kind"] == "job.snapshot_fallback")["message"]
    assert "left no in-memory snapshot on a node that is up" in fallback and "which cannot be reached" in fallback
    assert "resuming from the newest durable checkpoint" in fallback
    checksum, uninterrupted = trained_as(tmp_path / "checksum.txt", reference)
    assert checksum == uninterrupted


@pytest.mark.parametrize("fault", ["kill", "remap-pending"])
def test_a_surviving_rank_run_by_trainlib_run_rejoins_the_next_generation_in_its_own_process(cluster, tmp_path,
                                                                                            reference, fault):
    """kill: the survivor's collective fails and it waits (or, on a loaded machine, the stop reaches it first);
    remap-pending: it is stopped (SIGTERM) after the checkpoint, and waits. Either way it trains on in generation 2
    in the same process. The stop's grace is longer here than elsewhere: a survivor SIGKILLed before it could park
    (a loaded 2-core machine) would start again as a new process, which is the fallback, not what is tested."""
    cluster4 = started4(cluster, controller=CONTROLLER.replace("stop_grace_s = 3.0", "stop_grace_s = 15.0"))
    job_id, out = start(cluster4, tmp_path, "--step-time", "0.05", "--print-every", "1", "--rejoin", every="100000")
    ranks = {r["rank"]: r for r in job(cluster4, job_id)["ranks"]}
    if fault == "kill":
        os.kill(int(ranks[1]["pid"]), signal.SIGKILL)
    else:
        assert phalanx(cluster4, "inject", ranks[1]["node"], "--gpu", "0", "remap-pending").returncode == 0
    finish(cluster4, job_id, out, reference)
    again = {r["rank"]: r for r in job(cluster4, job_id)["ranks"]}
    assert again[0]["pid"] == ranks[0]["pid"]  # the survivor trained on in the same process
    assert again[1]["pid"] != ranks[1]["pid"]
    logs = phalanx(cluster4, "logs", job_id, "--rank", "0").stdout
    assert "generation 2 rank 0 rejoining in the same process" in logs, logs[-3000:]
    assert "rank 0 rejoins " + job_id + " in generation 2 (same process)" in logs
    if fault == "remap-pending":
        assert "(stopped); waiting to rejoin" in logs
    if fault == "kill":
        assert 0 <= last_step_before_restart(logs) - resumed_step(logs) <= 2, logs[-3000:]
    else:  # from the step every rank committed before the eviction: none lost
        committed = next(e for e in events(cluster4, job_id) if e["kind"] == "job.checkpointed")["message"]
        assert resumed_step(logs) == int(committed.split("committed step ")[1].split()[0]), logs[-3000:]


def test_a_lost_node_on_a_cluster_with_mutual_tls_resumes_from_a_replica_sent_over_tls(tmp_path, reference):
    """The same lost node as above, with every daemon on its own certificate: the replicas go agent to agent
    over mutual TLS (each agent serves them with its node certificate, and dials its peer by node name)."""
    from phalanx import pki
    from tests.cluster import Cluster
    ca = tmp_path / "pki"
    pki.init_ca(ca)
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(tmp_path / "cluster", pki=ca)
    try:
        started4(cluster, NODES[:3])
        job_id, out = start_snapshotting(cluster, tmp_path)
        victim = job(cluster, job_id)["nodes"][1]
        cluster.kill(victim, signal.SIGKILL)
        j = finish(cluster, job_id, out, reference)
        assert victim in j["evicted"]
        restore = next(e for e in events(cluster, job_id) if e["kind"] == "job.snapshot_restore")["message"]
        assert restore.endswith(f"fetched from {j['nodes'][0]}"), restore
        assert "restored its in-memory snapshot of step" in phalanx(cluster, "logs", job_id, "--rank", "1").stdout
        served = [line for line in (tmp_path / "cluster" / f"{j['nodes'][0]}.log").read_text().splitlines()
                  if "snapshot service serving" in line]
        assert served and '"tls": true' in served[0], served
        assert fetched_via(cluster, j["nodes"][1]) == ["bulk port"]  # over its mutual TLS too
        assert not [n for n in NODES[:3] if "did not read this node's bulk port" in cluster.log(n, lines=10_000)]
    finally:
        cluster.close()
