"""Replica groups with torchft, end to end: real agents on loopback, the controller's lighthouse, and
examples/train_ft.py on 2 groups x 2 ranks (gloo, CPU) with a spare. A kill -9 of a rank in one group: the other
group never restarts and never loses a step, the failed group's replacement recovers the state from it over the
network and joins, every group holds bit-identical parameters at every step, and the run converges."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from controller.lighthouse_main import extension
from tests.cluster import alive

pytestmark = [pytest.mark.procs, pytest.mark.slow,
              pytest.mark.skipif(extension() is None, reason="torchft is not installed (requirements-dev.txt)")]

TRAIN = str(Path(__file__).resolve().parent.parent / "examples" / "train_ft.py")
NODES = ["node-a", "node-b", "node-c", "node-d", "node-e"]
CONTROLLER = ("[jobs]\nstop_grace_s = 3.0\nkeep_spares = false\n[recovery]\nrestart_backoff_s = 0.2\n"
              "[replicas]\nlighthouse_host = \"127.0.0.1\"\nlighthouse_bind = \"127.0.0.1\"\n")
STEPS = 300
TOGETHER = 40  # the run ends with this many steps of both groups together after the fault, however slow its recovery


def commits(out: Path) -> dict[int, list[dict]]:
    """Each rank's committed steps, in order (rank -> [{step, digest, groups, time, pid, group}])."""
    seen = {}
    for path in out.glob("rank-*.jsonl"):
        lines = path.read_text().splitlines()
        seen[int(path.stem.removeprefix("rank-"))] = [json.loads(line) for line in lines if line.endswith("}")]
    return seen


# Each fault on rank 1 (group 0, node-b). kill-9: of the rank; xid-79: its GPU fails (the node is drained and replaced
# by the spare); node-lost: its agent and its ranks killed (power lost); remap-pending: its GPU turns FAILING (the
# group leaves predictably, replaced by the spare); hang: the rank stopped (SIGSTOP; found by trainlib's silence).
FAULTS = ["kill-9", "xid-79", "node-lost", "remap-pending", "hang"]
REPLACED = {"xid-79", "node-lost", "remap-pending", "hang"}  # whose node the spare replaces (a hang: the silent one's)


def inject(cluster, fault: str, pid: int, node: str) -> None:
    if fault == "kill-9":
        os.kill(pid, signal.SIGKILL)
    elif fault == "hang":
        os.kill(pid, signal.SIGSTOP)
    elif fault == "node-lost":
        cluster.kill(node)  # its agent, then its ranks: nothing of the node runs on
        os.kill(pid, signal.SIGKILL)
    else:
        fault = {"xid-79": "xid=79"}.get(fault, fault)
        assert cluster.cli("inject", node, "--gpu", "0", fault).returncode == 0


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_costs_its_group_alone_and_every_group_holds_the_same_model_at_every_step(cluster, tmp_path, fault):
    cluster.start_controller(CONTROLLER)
    for name in NODES:
        cluster.start_agent(name, gpus=2)
    cluster.wait_states(dict.fromkeys(NODES, "UP"))
    out = tmp_path / "out"
    out.mkdir()
    submitted = cluster.cli("submit", "--nodes", "4", "--replicas", "2", "--spares", "1", "--checkpoint-dir",
                            str(tmp_path / "ckpt"), "--", sys.executable, TRAIN, "--steps", str(STEPS), "--out",
                            str(out), "--step-time", "0.05", "--every", "50", "--until-full", str(TOGETHER))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    cluster.wait_for(lambda: len(commits(out)) == 4 and min(len(c) for c in commits(out).values()) >= 60,
                     "both groups training together, past their first checkpoint (step 49)")
    at_kill = commits(out)
    before = {r: c[-1]["pid"] for r, c in at_kill.items()}
    victim = json.loads(cluster.cli("job", job_id, "--json").stdout)["ranks"][1]["node"]
    inject(cluster, fault, before[1], victim)
    waited = cluster.cli("wait", job_id)
    assert waited.returncode == 0, waited.stderr + cluster.log("controller", 60) + cluster.rank_logs(job_id)

    seen = commits(out)
    healthy = [seen[2], seen[3]]  # group 1
    last = healthy[0][-1]["step"]
    assert last >= STEPS - 1
    assert {c["pid"] for c in healthy[0]} == {before[2]} and {c["pid"] for c in healthy[1]} == {before[3]}
    for r, ranks in ((2, healthy[0]), (3, healthy[1])):  # from the kill on: every step once, in order (at the
        since = at_kill[r][-1]["step"]  # start, a group that came up later than the other took the state it had)
        assert [c["step"] for c in ranks if c["step"] >= since] == list(range(since, last + 1))
    # group 0: its first processes until the kill, its replacement's after it joined (recovered from group 1)
    rejoined = [c for c in seen[0] if c["pid"] != before[0]]
    assert rejoined and rejoined[-1]["step"] == last and len([c for c in rejoined if c["groups"] == 2]) >= TOGETHER
    # bit-identical parameters in every group at every step both committed (a group that trained a step before it
    # joined the others, at its start, took their state when it joined)
    by_step: dict[int, set[str]] = {}
    for ranks in seen.values():
        for c in ranks:
            if c["groups"] == 2:
                by_step.setdefault(c["step"], set()).add(c["digest"])
    assert len(by_step) >= 2 * TOGETHER  # (before the fault and after the rejoin)
    assert all(len(d) == 1 for d in by_step.values()), {s: d for s, d in by_step.items() if len(d) > 1}
    alone = [c["step"] for c in healthy[0] if c["groups"] == 1]
    assert alone, "group 1 never trained alone: the fault was not seen"
    # converged as the uninterrupted run would (a toy regression with noise 0.01: its loss floor is 1e-4)
    losses = {float((out / f"loss-{r}.txt").read_text()) for r in range(4)}
    assert len(losses) == 1 and losses.pop() < 2e-4
    kinds = [e["kind"] for e in cluster.events(job=job_id)]
    assert "job.group_left" in kinds and "job.group_joined" in kinds and "job.incident" not in kinds, kinds
    shown = json.loads(cluster.cli("job", job_id, "--json").stdout)
    if fault in REPLACED:  # the spare took the faulty node's place in its group
        assert shown["groups"][0]["nodes"][1] == "node-e" and victim in shown["evicted"], shown
    else:
        assert shown["groups"][0]["nodes"][1] == victim, shown
    # durable checkpoints with trainlib, each group its own copy at its own generations (the rebuilt group's newer)
    newest = {}
    for group, generation in ((0, "2"), (1, "1")):
        saved = tmp_path / "ckpt" / f"group-{group}"
        newest[group] = max(p.name for p in saved.glob("step-*"))
        assert (saved / "GENERATION").read_text().strip() == generation
    assert newest[1] == f"step-{(last + 1) // 50 * 50 - 1:09d}", newest  # (group 0's: its newest since it joined)
    assert not alive(before[2])  # (it ended with the job)
    # the pause of the healthy group's step loop at the fault, for the record (bench/replicas.py measures it)
    gaps = [b["time"] - a["time"] for a, b in zip(healthy[0], healthy[0][1:], strict=False)]
    print(f"{fault}: group 1's longest pause {max(gaps):.2f}s, {len(alone)} steps alone")
