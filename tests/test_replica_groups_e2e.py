"""Replica-group jobs end to end: real agents on loopback, real ranks (gloo, CPU), `phalanx submit --replicas 2`.

A kill -9 of a rank in one group restarts that group alone: the other group's processes run on, stepping, and the
job never leaves RUNNING. (The cross-group quorum, torchft's, is not part of this test: each group here trains on
its own, which is what shows that no process of a healthy group is touched.)
"""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.cluster import alive

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

WORKER = str(Path(__file__).resolve().parent / "replica_worker.py")
NODES = ["node-a", "node-b", "node-c", "node-d"]
CONTROLLER = "[jobs]\nstop_grace_s = 3.0\nkeep_spares = false\n[recovery]\nrestart_backoff_s = 0.2\n"


def ranks(out: Path) -> dict[int, dict]:
    """What each rank last wrote (rank -> pid, group, generation, step)."""
    seen = {}
    for path in out.glob("rank-*.json"):
        try:
            seen[int(path.stem.removeprefix("rank-"))] = json.loads(path.read_text())
        except (ValueError, OSError):
            continue  # (replaced under us: read again next time)
    return seen


def started(cluster, tmp_path, nodes=NODES, spares=0) -> tuple[str, Path]:
    cluster.start_controller(CONTROLLER)
    for name in nodes:
        cluster.start_agent(name, gpus=2)
    cluster.wait_states(dict.fromkeys(nodes, "UP"))
    out = tmp_path / "out"
    out.mkdir()
    submitted = cluster.cli("submit", "--nodes", "4", "--replicas", "2", "--spares", str(spares), "--",
                            sys.executable, WORKER, str(out))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    cluster.wait_for(lambda: len(ranks(out)) == 4 and min(r["step"] for r in ranks(out).values()) >= 5,
                     "both groups training")
    return job_id, out


def group0_again(out: Path, before: dict[int, dict]) -> bool:
    now = ranks(out)
    return all(now[r]["pid"] != before[r]["pid"] and now[r]["step"] >= 3 for r in (0, 1))


def group1_untouched(cluster, job_id: str, out: Path, before: dict[int, dict]) -> None:
    """Group 1 ran on: the same processes, never stopped, stepping; and the job never left RUNNING."""
    after = ranks(out)
    assert [after[r]["pid"] for r in (2, 3)] == [before[r]["pid"] for r in (2, 3)]
    assert all(alive(after[r]["pid"]) for r in (2, 3)) and after[2]["generation"] == 1
    assert min(after[r]["step"] for r in (2, 3)) > max(before[r]["step"] for r in (2, 3)) + 20
    kinds = [e["kind"] for e in cluster.events(job=job_id)]
    assert "job.group_left" in kinds and "job.group_joined" in kinds, kinds
    assert not {"job.incident", "job.evicting", "job.restarting"} & set(kinds), kinds


def test_a_killed_rank_restarts_its_replica_group_alone_while_the_other_group_trains_on(cluster, tmp_path):
    job_id, out = started(cluster, tmp_path)
    before = ranks(out)
    # each group is a process group of its own: RANK and WORLD_SIZE are the group's, REPLICA_GROUP_ID says which
    assert {r: (v["group"], v["group_size"], v["group_rank"]) for r, v in before.items()} == {
        0: (0, 2, 0), 1: (0, 2, 1), 2: (1, 2, 0), 3: (1, 2, 1)}
    shown = json.loads(cluster.cli("job", job_id, "--json").stdout)
    assert shown["replicas"] == 2 and [g["state"] for g in shown["groups"]] == ["TRAINING", "TRAINING"]

    os.kill(before[1]["pid"], signal.SIGKILL)  # a rank of group 0 (on node-a)
    cluster.wait_for(lambda: group0_again(out, before), "group 0 training again")
    after = ranks(out)
    assert after[0]["generation"] == after[1]["generation"] == 2
    group1_untouched(cluster, job_id, out, before)
    shown = json.loads(cluster.cli("job", job_id, "--json").stdout)
    assert shown["state"] == "RUNNING" and [(g["state"], g["generation"]) for g in shown["groups"]] == [
        ("TRAINING", 2), ("TRAINING", 1)]

    (out / "stop").touch()
    waited = cluster.cli("wait", job_id)
    assert waited.returncode == 0, waited.stderr + cluster.log("controller", 40)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["node-lost", "xid-79"])
def test_a_lost_or_failed_node_is_replaced_by_a_spare_in_its_group_alone(cluster, tmp_path, fault):
    job_id, out = started(cluster, tmp_path, nodes=[*NODES, "node-e"], spares=1)
    before = ranks(out)
    nodes = json.loads(cluster.cli("job", job_id, "--json").stdout)["groups"][0]["nodes"]
    victim = nodes[1]  # the node of rank 1, in group 0
    if fault == "node-lost":
        cluster.kill(victim)  # kill -9 of its agent: the node turns DOWN
    else:
        assert cluster.cli("inject", victim, "--gpu", "0", "xid=79").returncode == 0
    cluster.wait_for(lambda: group0_again(out, before), "group 0 training again on the spare")
    group1_untouched(cluster, job_id, out, before)
    shown = json.loads(cluster.cli("job", job_id, "--json").stdout)
    assert shown["groups"][0]["nodes"] == [nodes[0], "node-e"] and victim in shown["evicted"], shown
    assert [(g["state"], g["generation"]) for g in shown["groups"]] == [("TRAINING", 2), ("TRAINING", 1)]
    left = next(e["message"] for e in cluster.events(job=job_id) if e["kind"] == "job.group_left")
    assert fault.replace("xid-79", "gpu-failed") in left, left
    (out / "stop").touch()
    assert cluster.cli("wait", job_id).returncode == 0
