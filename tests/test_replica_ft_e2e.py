"""Replica groups with torchft, end to end: real agents on loopback, the controller's lighthouse, and
examples/train_ft.py on 2 groups x 2 ranks (gloo, CPU) with a spare. Each fault in one group: the other group never
restarts and commits every step once, in order (a sudden fault fails the step it is in, which it takes again; a fault
Phalanx sees coming costs it no step at all), the failed group's replacement recovers the state from it over the
network and joins, every group holds bit-identical parameters at every step, and the run converges."""

import contextlib
import importlib.util
import json
import os
import signal
import socket
import sys
from pathlib import Path

import psutil
import pytest

from tests.cluster import alive
from tests.ha_cluster import HaCluster

pytestmark = [pytest.mark.procs, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                 reason="torchft is not installed (requirements-dev.txt)")]

TRAIN = str(Path(__file__).resolve().parent.parent / "examples" / "train_ft.py")
NODES = ["node-a", "node-b", "node-c", "node-d", "node-e"]
# The straggler rule as tests/test_recovery_e2e.py sets it for this shared 2-core machine, in every test here (the
# example marks compute_done, so the rule judges these ranks): healthy ranks' computes drift apart by up to ~1.13x on
# their own, and at the default ratio (1.05) a healthy group was once taken for a straggler in CI; a full window of
# samples; one eviction at most. The injected straggler (slow=0.9: 1.9x) stands well clear.
STRAGGLER = "straggler_ratio = 1.2\nstraggler_cost = 0.2\nstraggler_min_samples = 30\nstraggler_max_evictions = 1\n"
CONTROLLER = ("[jobs]\nstop_grace_s = 3.0\nkeep_spares = false\n[recovery]\nrestart_backoff_s = 0.2\n" + STRAGGLER +
              "[replicas]\nlighthouse_host = \"127.0.0.1\"\nlighthouse_bind = \"127.0.0.1\"\n")
# The two tests that a controller's restart or takeover disturbs nothing judge hangs from 10 s: in CI's test-slow
# (4 workers on 2 cores) every rank once stalled for 3 s, 17 s after the restart, and was rightly judged hung at 2 s
# (a restart these tests are not about, and no fault of the controller's: its restart was long over).
CARRY_ON = CONTROLLER.replace("[recovery]\n", "[recovery]\nhang_min_s = 10.0\n")
STEPS = 300
TOGETHER = 40  # the run ends with this many steps of both groups together after the fault, however slow its recovery


def records(path: Path) -> list[dict]:
    """A JSON-lines file the example writes (its last line may be half written); [] while there is none."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def commits(out: Path) -> dict[int, list[dict]]:
    """Each rank's committed steps, in order (rank -> [{step, digest, groups, time, pid, group}])."""
    return {int(path.stem.removeprefix("rank-")): records(path) for path in out.glob("rank-*.jsonl")}


def retaken(out: Path, at: dict[int, list[dict]], ranks: tuple[int, ...]) -> list[dict]:
    """The steps `ranks` took but could not commit (a group in the quorum failed during them: the step is taken
    again, its work lost) from the step each was in at `at` on."""
    return [x for r in ranks for x in records(out / f"retaken-{r}.jsonl") if x["step"] > at[r][-1]["step"]]


# Each fault on rank 1 (group 0, node-b). kill-9: of the rank; xid-79: its GPU fails (the node is drained and replaced
# by the spare); node-lost: its agent and its ranks killed (power lost); remap-pending: its GPU turns FAILING (the
# group leaves predictably, replaced by the spare); hang: the rank stopped (SIGSTOP; found by trainlib's silence);
# straggler: its GPU throttled (slow=0.9: its compute takes 1.9x; the quorum drops its group rather than wait for it).
FAULTS = ["kill-9", "xid-79", "node-lost", "remap-pending", "hang", "straggler"]
REPLACED = {"xid-79", "node-lost", "remap-pending", "hang", "straggler"}  # whose node the spare replaces
# The faults Phalanx sees coming: their group leaves the quorum at once but finishes the step it is in before it is
# stopped, so no other group's step fails (a sudden fault fails the healthy group's step in flight, taken again).
PREDICTABLE = {"remap-pending", "straggler"}


def uninterrupted_loss(steps: int, groups: int = 2, ranks: int = 2) -> float:
    """The final test loss of an uninterrupted run of examples/train_ft.py (`groups` x `ranks`, `steps` committed
    steps), computed in this process: each step's gradient is the mean of every rank's of every group, as the
    example's two all-reduces make it when no group is missing."""
    import torch

    torch.set_num_threads(1)  # (tiny tensors: more threads only fight the cluster's processes for the cores)
    spec = importlib.util.spec_from_file_location("train_ft", TRAIN)
    ft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ft)
    torch.manual_seed(0)
    model = torch.nn.Linear(ft.FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # the example's defaults
    for step in range(steps):
        grads = []
        for group in range(groups):
            for rank in range(ranks):
                model.zero_grad()
                x, y = ft.batch(step, group, rank)
                torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
        for i, param in enumerate(model.parameters()):
            param.grad = sum(g[i] for g in grads) / len(grads)
        optimizer.step()
    x, y = ft.batch(10**9, 0, 0, size=4096)  # the example's test set
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def inject(cluster, fault: str, pid: int, node: str) -> None:
    if fault == "kill-9":
        os.kill(pid, signal.SIGKILL)
    elif fault == "hang":
        os.kill(pid, signal.SIGSTOP)
    elif fault == "node-lost":
        cluster.kill(node)  # its agent, then its ranks: nothing of the node runs on
        os.kill(pid, signal.SIGKILL)
    else:
        fault = {"xid-79": "xid=79", "straggler": "slow=0.9"}.get(fault, fault)
        assert cluster.cli("inject", node, "--gpu", "0", fault).returncode == 0


def started(cluster, tmp_path: Path, controller: str | None = CONTROLLER) -> tuple[str, Path, dict[int, list[dict]]]:
    """The controller(s) (None: started already) and the five agents, and the job training: (its id, its output,
    each rank's commits so far)."""
    if controller is not None:
        cluster.start_controller(controller)
    for name in NODES:
        cluster.start_agent(name, gpus=2)
    cluster.wait_states(dict.fromkeys(NODES, "UP"))
    out = tmp_path / "out"
    job_id = submit(cluster, tmp_path, out)
    return job_id, out, commits(out)


def assert_converged(out: Path, steps: int) -> None:
    """Every rank's final test loss the same, and within 10 % of an uninterrupted run's of as many steps (a toy
    regression with noise 0.01: both end near its floor, 1e-4, a few % apart with the samples each saw; a fault skips
    the samples of its group's missed steps; untrained, the loss is ~0.3)."""
    losses = {float((out / f"loss-{r}.txt").read_text()) for r in range(4)}
    reference = uninterrupted_loss(steps)
    assert len(losses) == 1 and abs(losses.pop() - reference) <= 0.1 * reference, (losses, reference)


def submit(cluster, tmp_path: Path, out: Path) -> str:
    """The job (2 groups x 2 ranks, a spare), once both groups train together past their first checkpoint."""
    out.mkdir()
    submitted = cluster.cli("submit", "--nodes", "4", "--replicas", "2", "--spares", "1", "--checkpoint-dir",
                            str(tmp_path / "ckpt"), "--", sys.executable, TRAIN, "--steps", str(STEPS), "--out",
                            str(out), "--step-time", "0.05", "--every", "50", "--until-full", str(TOGETHER))
    assert submitted.returncode == 0, submitted.stderr
    cluster.wait_for(lambda: len(commits(out)) == 4 and min(len(c) for c in commits(out).values()) >= 60,
                     "both groups training together, past their first checkpoint (step 49)")
    return submitted.stdout.strip()


def same_model_at_every_step(seen: dict[int, list[dict]]) -> dict[int, set[str]]:
    """The digests of every step all groups committed: one each when every group holds the same parameters."""
    by_step: dict[int, set[str]] = {}
    for ranks in seen.values():
        for c in ranks:
            if c["groups"] == 2:
                by_step.setdefault(c["step"], set()).add(c["digest"])
    assert all(len(d) == 1 for d in by_step.values()), {s: d for s, d in by_step.items() if len(d) > 1}
    return by_step


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_costs_its_group_alone_and_every_group_holds_the_same_model_at_every_step(cluster, tmp_path, fault):
    job_id, out, at_kill = started(cluster, tmp_path)
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
    assert len(same_model_at_every_step(seen)) >= 2 * TOGETHER  # (before the fault and after the rejoin)
    alone = [c["step"] for c in healthy[0] if c["groups"] == 1]
    assert alone, "group 1 never trained alone: the fault was not seen"
    lost = retaken(out, at_kill, (2, 3))
    assert not lost or fault not in PREDICTABLE, f"group 1 took steps again at a predictable fault: {lost}"
    assert_converged(out, last + 1)  # as an uninterrupted run of as many steps
    kinds = [e["kind"] for e in cluster.events(job=job_id)]
    assert "job.group_left" in kinds and "job.group_joined" in kinds and "job.incident" not in kinds, kinds
    shown = json.loads(cluster.cli("job", job_id, "--json").stdout)
    if fault in REPLACED:  # the spare took the faulty node's place in its group
        assert shown["groups"][0]["nodes"][1] == "node-e", shown
        # evicted (drained), but a lost node may be seen first as its group's crash (group 0's other rank exits when
        # its peer is gone), before its silence makes it DOWN: then it is replaced as not usable, not evicted, as in
        # a job without groups
        assert victim in shown["evicted"] or fault == "node-lost", shown
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
    print(f"{fault}: group 1's longest pause {max(gaps):.2f}s, {len(alone)} steps alone, "
          f"{len({x['step'] for x in lost})} steps taken again")


def assert_carried_on(c, job_id: str, out: Path, at_kill: dict[int, list[dict]], said: frozenset = frozenset()) -> None:
    """The job ended with no rank restarted, every rank took every step once, in order, every group held the same
    model at every step, nothing was judged (no event but `said` of a lighthouse started again), and the run
    converged."""
    before = {r: ranks[-1]["pid"] for r, ranks in at_kill.items()}
    waited = c.cli("wait", job_id)
    assert waited.returncode == 0, waited.stderr + c.log("controller", 60) + c.rank_logs(job_id)
    seen = commits(out)
    last = max(ranks[-1]["step"] for ranks in seen.values())
    told = "\n".join(f"{e['kind']}: {e['message']}" for e in c.events(job=job_id))
    assert last >= STEPS - 1
    for r, ranks in seen.items():
        assert {x["pid"] for x in ranks} == {before[r]}, f"rank {r} was restarted:\n{told}{c.rank_logs(job_id, 30)}"
        since = at_kill[r][-1]["step"]
        assert [x["step"] for x in ranks if x["step"] >= since] == list(range(since, last + 1)), f"rank {r}"
    assert not retaken(out, at_kill, tuple(seen)), f"a step was taken again:\n{told}"
    assert len(same_model_at_every_step(seen)) >= last - 60  # (every step, but a group's first few at its start)
    kinds = [e["kind"] for e in c.events(job=job_id)]
    assert not {"job.group_left", "job.incident", "job.lighthouse"} - said & set(kinds), told
    assert said <= set(kinds), told
    assert_converged(out, last + 1)


def test_a_controller_killed_and_restarted_leaves_every_group_training(cluster, tmp_path):
    """One controller (SQLite), killed -9 while both groups train and started again: the lighthouse it started
    served on meanwhile, the restarted controller takes it up, and the quorum never noticed."""
    job_id, out, at_kill = started(cluster, tmp_path, CARRY_ON)
    cluster.kill("controller", signal.SIGKILL)
    cluster.start_controller(CARRY_ON)
    cluster.wait_for(lambda: "lighthouse taken up" in cluster.log("controller", 200), "the lighthouse taken up")
    assert_carried_on(cluster, job_id, out, at_kill)


def test_a_lighthouse_that_dies_is_started_again_elsewhere_and_every_group_trains_on(cluster, tmp_path):
    """The job's lighthouse killed -9 while both groups train, and its port taken by another process before the
    controller looks: the controller starts it again on another port and tells the job's nodes, whose agents relay
    the ranks' unchanged TORCHFT_LIGHTHOUSE there; the managers ask it again (TORCHFT_QUORUM_RETRIES), and no rank
    restarts or loses a step."""
    job_id, out, at_kill = started(cluster, tmp_path, CARRY_ON)
    controller = cluster.procs["controller"]
    [lighthouse] = [p for p in psutil.Process(controller.pid).children() if "controller.lighthouse_main" in p.cmdline()]
    port = int(json.loads(cluster.cli("job", job_id, "--json").stdout)["lighthouse"].rsplit(":", 1)[1])
    taken: list[socket.socket] = []

    def take() -> bool:
        with contextlib.suppress(OSError):
            taken.append(socket.create_server(("127.0.0.1", port)))
        return bool(taken)

    os.kill(controller.pid, signal.SIGSTOP)  # (so that it cannot look before the port is taken)
    try:
        lighthouse.kill()
        cluster.wait_for(take, "the lighthouse's port free, and taken by another process")
    finally:
        os.kill(controller.pid, signal.SIGCONT)
    with taken[0]:
        cluster.wait_for(lambda: "job.lighthouse" in [e["kind"] for e in cluster.events(job=job_id)],
                         "the lighthouse started again")
        assert not json.loads(cluster.cli("job", job_id, "--json").stdout)["lighthouse"].endswith(f":{port}")
        assert_carried_on(cluster, job_id, out, at_kill, said=frozenset({"job.lighthouse"}))


def test_a_controller_takeover_leaves_every_group_training(tmp_path, etcd_server):
    """Two controllers on etcd; the leader, which started the job's lighthouse, killed -9 while both groups train.
    The new leader takes the lighthouse up (it outlived its controller), and the quorum carries on."""
    ha = HaCluster(tmp_path, etcd_server.endpoint, controllers=2)
    try:
        job_id, out, at_kill = started(ha, tmp_path, CARRY_ON)
        old, _ = ha.leader()
        ha.kill(old, signal.SIGKILL)
        ha.wait_for(lambda: (ha.leader() or (old,))[0] != old, "a new leader")
        assert_carried_on(ha, job_id, out, at_kill)
        new, _ = ha.leader()
        assert "lighthouse taken up" in ha.log(new, 400)
    finally:
        ha.close()


def test_a_controllers_host_lost_with_the_lighthouse_the_next_leader_starts_it_on_its_own_and_training_goes_on(
        tmp_path, etcd_server):
    """Two controllers on etcd, each host's lighthouses on an address of its own (127.0.0.1, 127.0.0.2): the leader
    and the job's lighthouse killed -9 together (its host lost) while both groups train. The new leader cannot take
    the lighthouse up, starts it on its own address, and tells the job's nodes, whose agents relay the ranks'
    unchanged TORCHFT_LIGHTHOUSE there: no rank restarts or loses a step."""
    ha = HaCluster(tmp_path, etcd_server.endpoint, controllers=2)
    try:
        first, second = ha.names
        ha.start_controller(CARRY_ON, name=first)  # (the first leads: started alone)
        ha.start_controller(CARRY_ON.replace("127.0.0.1", "127.0.0.2"), name=second)
        assert ha.leader()[0] == first
        job_id, out, at_kill = started(ha, tmp_path, None)
        assert json.loads(ha.cli("job", job_id, "--json").stdout)["lighthouse"].startswith("http://127.0.0.1:")
        [lighthouse] = [p for p in psutil.Process(ha.procs[first].pid).children()
                        if "controller.lighthouse_main" in p.cmdline()]
        lighthouse.kill()
        ha.kill(first, signal.SIGKILL)
        ha.wait_for(lambda: (ha.leader() or (first,))[0] == second, "the second controller leads")
        ha.wait_for(lambda: (json.loads(ha.cli("job", job_id, "--json").stdout)["lighthouse"] or "").startswith(
            "http://127.0.0.2:"), "the lighthouse started on the new leader's address")
        assert_carried_on(ha, job_id, out, at_kill, said=frozenset({"job.lighthouse"}))
    finally:
        ha.close()
