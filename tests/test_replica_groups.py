"""Replica-group jobs in the lifecycle (spec.replicas > 1): a fault restarts its group alone while the others train on,
driven through the pure `step` in tests/test_lifecycle.py's virtual-time world (agents, ranks and trainlib)."""

from __future__ import annotations

import asyncio

import pytest

from controller.config import RecoveryConfig
from controller.errors import InvalidArgument
from controller.nodes.health import HEALTHY
from controller.recovery import lifecycle, table
from controller.recovery.progress import RankTrack
from controller.validation import job_spec
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb
from tests.jobs_world import World
from tests.test_lifecycle import INCIDENTS, Sim, inject, running, start

# the tier (tests/conftest.py); each test with rank tables in rows and packed (conftest.rank_tables)
pytestmark = [pytest.mark.inproc, pytest.mark.usefixtures("rank_tables")]

# Two groups of two nodes (a, b | c, d), two ranks a node, one spare (e): the fault is on b, in group 0.
GROUP0, GROUP1 = ("a", "b"), ("c", "d")


def grouped_sim(spares: int = 1, nodes=("a", "b", "c", "d", "e")) -> Sim:
    sim = Sim(nodes=nodes, job_nodes=4, spares=spares, replicas=2)
    start(sim)
    assert [g.state for g in sim.job.groups] == [lifecycle.GROUP_TRAINING] * 2
    return sim


def group_state(sim: Sim, g: int) -> int:
    return sim.job.groups[g].state


def rejoined(sim: Sim, generation: int) -> bool:
    """Group 0 trains again, as a generation after `generation`."""
    return running(sim) and sim.job.groups[0].generation > generation and \
        group_state(sim, 0) == lifecycle.GROUP_TRAINING


def group1_steps(sim: Sim) -> int:
    return min(sim.step_of[r.rank] for r in ranktable.rows(sim.job) if r.node in GROUP1)


@pytest.mark.parametrize("kind", [k for k in INCIDENTS if k != "hang"] + ["hang"])
def test_a_fault_in_one_group_restarts_that_group_alone_while_the_other_trains_on(kind):
    sim = grouped_sim()
    before, seen = sim.job.generation, len(sim.states)
    group1 = [(r.rank, r.generation) for r in ranktable.rows(sim.job) if r.node in GROUP1]
    steps = group1_steps(sim)
    inject(sim, kind)
    sim.run_until(lambda: rejoined(sim, before))
    job = sim.job
    kinds = [k for k, _ in sim.events]
    assert sim.incidents == [kind], sim.events
    assert sim.states[seen:] == [], f"the job left RUNNING: {sim.states[seen:]}"
    assert "job.checkpoint" not in kinds  # no checkpoint: the healthy group holds the state
    assert kinds.count("job.group_left") == 1 and "job.group_rebuilding" in kinds and "job.group_joined" in kinds
    # its lighthouse is told at once: the healthy group's next quorum does not wait for its heartbeats to stop
    assert [g for g, _ in sim.left_quorum] == [0] and sim.left_quorum[0][1].startswith(f"{kind}: ")
    # the healthy group: the same ranks of the same generation, never stopped, still stepping
    assert [(r.rank, r.generation) for r in ranktable.rows(job) if r.node in GROUP1] == group1
    assert all(sim.nodes[n].ranks[(before, r)] == "running" for r, _ in group1 for n in GROUP1
               if (before, r) in sim.nodes[n].ranks)
    sim.hung.clear()  # (the world's hung ranks are by number: the rebuilt group's are new processes)
    sim.run_for(3.0)
    assert group1_steps(sim) > steps + 20
    assert group_state(sim, 1) == lifecycle.GROUP_TRAINING and job.groups[1].generation == before
    # the faulty group: launched alone as the next generation
    assert sim.launched[-1] == job.generation == job.groups[0].generation == before + 1
    assert {r.generation for r in ranktable.rows(job) if r.rank < 4} == {before + 1}
    if INCIDENTS[kind]:
        assert list(job.nodes) == ["a", "e", "c", "d"] and "b" in job.evicted and sim.nodes["b"].drained
        assert list(job.spares) == []
    else:
        assert list(job.nodes) == ["a", "b", "c", "d"]  # a crash restarts its group in place
        assert job.restarts_in_row == 1


def recorded(sim: Sim) -> list[tuple[float, lifecycle.Action]]:
    """Every action the sim applies from now on, with its time (a list that grows as they come)."""
    seen: list[tuple[float, lifecycle.Action]] = []
    apply = sim.apply

    def recording(actions) -> bool:
        seen.extend((sim.now, a) for a in actions)
        return apply(actions)

    sim.apply = recording
    return seen


@pytest.mark.parametrize("kind", list(INCIDENTS))
def test_a_predictable_faults_group_leaves_the_quorum_at_once_and_is_stopped_once_its_step_is_taken(kind):
    """A predictable fault's group (a FAILING GPU, a straggler) leaves the quorum at once but its ranks run on for
    the step they were in (lifecycle.finish_s), so the healthy group's step with them is not lost; then all of its
    nodes are stopped, the bad one too. A sudden fault's group is stopped with its leaving."""
    sim = grouped_sim()
    acted = recorded(sim)
    inject(sim, kind)
    sim.run_until(lambda: sim.left_quorum)
    left_at, group = sim.now, sim.job.groups[0]
    predictable = kind in ("gpu-failing", "straggler")
    assert group.state == lifecycle.GROUP_STOPPING and bool(group.finish_until_unix_ns) == predictable
    sim.run_until(lambda: group_state(sim, 0) != lifecycle.GROUP_STOPPING)
    told = [(t, n) for t, a in acted if isinstance(a, lifecycle.Stop) for n in a.nodes]
    stopped_at = {n: min(t for t, m in told if m == n) for n in GROUP0 if any(m == n for _, m in told)}
    if predictable:
        assert set(stopped_at) == set(GROUP0), told  # the bad node's ranks too
        assert min(stopped_at.values()) == pytest.approx(group.finish_until_unix_ns / 1e9)
        assert min(stopped_at.values()) - left_at >= lifecycle.FINISH_MIN_S - 1e-6
        assert [k for k, _ in sim.events].count("job.group_finished") == 1
    else:
        assert min(stopped_at.values()) == left_at, told
        assert "job.group_finished" not in [k for k, _ in sim.events]
    assert not any(n in GROUP1 for _, n in told)


def test_a_controller_that_takes_over_after_a_finishing_groups_time_stops_it_before_it_is_rebuilt():
    """The stop of a predictable fault's group is on the record when it starts: a controller that takes over long
    after the group was due to stop stops it first, and rebuilds it only once it is stopped (not at once, as the
    stop's deadline counted from its leaving would have it)."""
    sim = grouped_sim()
    inject(sim, "gpu-failing")
    sim.run_until(lambda: sim.left_quorum)
    assert sim.job.groups[0].finish_until_unix_ns
    sim.controller_restart()
    sim.now += 120.0  # (past stop_grace_s and evict_margin_s since it left)
    acted = recorded(sim)
    sim.run_until(lambda: group_state(sim, 0) == lifecycle.GROUP_REBUILDING)
    first_stop = next(t for t, a in acted if isinstance(a, lifecycle.Stop))
    launch = next(t for t, a in acted if isinstance(a, lifecycle.Launch))
    assert launch > first_stop, acted  # its kept node's ranks were told, and confirmed stopped, first
    assert "running" not in [v for k, v in sim.nodes["a"].ranks.items() if k[0] < sim.job.groups[0].generation]
    assert {"a", "b"} <= {n for _, a in acted if isinstance(a, lifecycle.Stop) for n in a.nodes}  # (b's told too)


def test_a_fault_that_leaves_no_group_training_restarts_the_whole_job():
    sim = grouped_sim(spares=2, nodes=("a", "b", "c", "d", "e", "f"))
    before = sim.job.generation
    sim.nodes["b"].down = sim.nodes["c"].down = True  # one node of each group at once (a leaf switch)
    sim.run_until(lambda: running(sim) and sim.job.generation > before)
    assert "EVICTING" in sim.states and "job.group_left" not in [k for k, _ in sim.events]
    assert list(sim.job.nodes) == ["a", "e", "f", "d"]
    assert [(g.state, g.generation) for g in sim.job.groups] == [(lifecycle.GROUP_TRAINING, before + 1)] * 2


def test_a_group_without_a_spare_takes_a_free_node_of_the_fleet():
    sim = grouped_sim(spares=0)  # e is free in the fleet, not held
    before = sim.job.generation
    inject(sim, "node-lost")
    sim.run_until(lambda: rejoined(sim, before))
    assert list(sim.job.nodes) == ["a", "e", "c", "d"]


def test_a_group_with_no_node_to_take_waits_while_the_other_trains_and_takes_its_node_back_once_repaired():
    sim = grouped_sim(spares=0, nodes=("a", "b", "c", "d"))
    before = sim.job.generation
    inject(sim, "gpu-failed")
    sim.run_until(lambda: group_state(sim, 0) == lifecycle.GROUP_WAITING and "waiting for nodes" in
                  sim.job.groups[0].reason)
    steps = group1_steps(sim)
    sim.run_for(10.0)
    assert running(sim) and group_state(sim, 0) == lifecycle.GROUP_WAITING
    assert group1_steps(sim) > steps + 50  # the other group trains on meanwhile
    b = sim.nodes["b"]
    b.health, b.reason, b.drained = HEALTHY, "", False  # repaired; `phalanx undrain b`
    sim.run_until(lambda: rejoined(sim, before))
    assert list(sim.job.nodes) == ["a", "b", "c", "d"]


def test_a_group_launch_lost_to_a_controller_restart_is_launched_again_as_a_later_generation():
    sim = grouped_sim()
    before = sim.job.generation
    inject(sim, "node-lost")
    sim.run_until(lambda: group_state(sim, 0) == lifecycle.GROUP_REBUILDING)
    sim.controller_restart()
    sim.run_until(lambda: rejoined(sim, before + 1))
    assert any("interrupted by a controller restart" in m for _, m in sim.events), sim.events
    assert sim.launched == sorted(set(sim.launched)), f"a generation launched twice: {sim.launched}"
    assert sim.states[-1] == "RUNNING" and group_state(sim, 1) == lifecycle.GROUP_TRAINING


def test_a_group_that_keeps_crashing_ends_the_job_after_max_restarts():
    sim = grouped_sim()
    for _ in range(lifecycle_max_restarts(sim) + 1):
        if not running(sim):
            break
        generation = sim.job.groups[0].generation
        sim.run_until(lambda g=generation: group_state(sim, 0) == lifecycle.GROUP_TRAINING and
                      sim.job.groups[0].generation == g and all(
                          sim.nodes["b"].ranks.get((g, r.rank)) == "running" for r in ranktable.rows(sim.job)
                          if r.node == "b"))
        inject(sim, "crash")
        sim.run_until(lambda g=generation: sim.job.state != pb.JOB_STATE_RUNNING or (
            sim.job.groups[0].generation > g and group_state(sim, 0) == lifecycle.GROUP_TRAINING))
    assert sim.job.state == pb.JOB_STATE_FAILED and "gave up after" in sim.job.reason, sim.describe()


def lifecycle_max_restarts(sim: Sim) -> int:
    return sim.policy.recovery.max_restarts


def test_a_replica_group_job_needs_nodes_in_equal_groups():
    spec = pb.JobSpec(command=["python", "train.py"], nodes=4, ranks_per_node=1, replicas=3)
    with pytest.raises(InvalidArgument, match=r"nodes \(4\) must be a multiple of replicas \(3\)"):
        job_spec(spec)
    job_spec(pb.JobSpec(command=["python", "train.py"], nodes=4, ranks_per_node=1, replicas=2))


@pytest.mark.parametrize("when", ["after a rebuild", "a group waiting"])
def test_a_cancel_stops_every_group_at_its_own_generation(when):
    """After a group's rebuild the groups run different generations; with a group waiting for nodes its ranks were
    stopped and exited. Either way the cancel stops every rank and ends CANCELLED."""
    sim = grouped_sim(spares=1 if when == "after a rebuild" else 0, nodes=("a", "b", "c", "d", "e")[:
                      5 if when == "after a rebuild" else 4])
    before = sim.job.generation
    inject(sim, "node-lost" if when == "after a rebuild" else "gpu-failed")
    if when == "after a rebuild":
        sim.run_until(lambda: rejoined(sim, before))
        assert {r.generation for r in ranktable.rows(sim.job)} == {before, before + 1}
    else:
        sim.run_until(lambda: group_state(sim, 0) == lifecycle.GROUP_WAITING and "waiting" in sim.job.groups[0].reason)
    for action in lifecycle.cancel(sim.job, sim.now):
        sim.apply([action])
    sim.run_until(lambda: sim.job.state in (pb.JOB_STATE_CANCELLED, pb.JOB_STATE_FAILED), limit_s=60)
    assert sim.job.state == pb.JOB_STATE_CANCELLED, sim.events
    sim.run_for(2)  # the stops land
    for node in sim.nodes.values():  # (a node lost has its ranks fenced when it comes back)
        assert node.down or not any(s == "running" for s in node.ranks.values()), node


def test_training_that_ends_while_a_group_waits_succeeds_on_the_groups_in_the_quorum():
    sim = grouped_sim(spares=0, nodes=("a", "b", "c", "d"))
    inject(sim, "gpu-failed")
    sim.run_until(lambda: group_state(sim, 0) == lifecycle.GROUP_WAITING and "waiting" in sim.job.groups[0].reason)
    sim.done.update(r.rank for r in ranktable.rows(sim.job) if r.node in GROUP1)  # group 1 takes the last step
    for r in ranktable.rows(sim.job):
        if r.node in GROUP1:
            sim.at(sim.now + 1.0, lambda r=r: sim.nodes[r.node].ranks.__setitem__((r.generation, r.rank), "exited:0"))
    sim.run_until(lambda: sim.job.state in table.TERMINAL, limit_s=300)
    assert sim.job.state == pb.JOB_STATE_SUCCEEDED, sim.events
    assert "every rank exited 0" in sim.job.reason


def test_a_checkpoint_request_asks_and_counts_the_groups_in_the_quorum():
    sim = grouped_sim(spares=0, nodes=("a", "b", "c", "d"))
    inject(sim, "gpu-failed")
    sim.run_until(lambda: group_state(sim, 0) == lifecycle.GROUP_WAITING and "waiting" in sim.job.groups[0].reason)
    actions = lifecycle.ask_checkpoint(sim.job, sim.process.tracks, sim.now, 1.0, 30.0, pause=False, reason="user")
    ask = next(a for a in actions if isinstance(a, lifecycle.RequestCheckpoint))
    assert ask.nodes == GROUP1
    assert "requested from 4 ranks" in next(a for a in actions if isinstance(a, lifecycle.Commit)).message


def test_in_the_controller_a_crash_restarts_its_group_alone_and_a_cancel_stops_every_generation():
    """The job manager and the executor (tests/jobs_world.py: fake agents, virtual time): a group's rebuild launches
    its nodes alone, the other group's ranks run on at their generation, what the controller knows of their progress
    stays across the rebuild and the commits after it, and a cancel stops every node at its own generation."""
    async def go() -> None:
        world = World(recovery=RecoveryConfig(restart_backoff_s=0.001, max_restarts=10, hang_min_s=3600.0,
                                              startup_s=3600.0))
        await world.start()
        for name in ("node-a", "node-b", "node-c", "node-d", "node-e"):
            await world.add(name).connect()
        job_id = (await world.jobs.submit(pb.JobSpec(command=["train"], nodes=4, ranks_per_node=1, spares=1,
                                                     replicas=2), "tester")).id
        await world.until(lambda: world.job(job_id).state == pb.JOB_STATE_RUNNING, "job running")
        entry = world.jobs.entries[job_id]
        now = world.jobs.now()
        entry.tracks = {r: RankTrack(last_step=5, last_advance=now, last_report=now) for r in range(4)}
        healthy = entry.tracks[2]
        node_of = {r.rank: r.node for r in ranktable.rows(world.job(job_id))}
        world.agents[node_of[1]].crash(job_id, 1)
        await world.until(lambda: world.job(job_id).groups[0].generation == 2 and
                          world.job(job_id).groups[0].state == lifecycle.GROUP_TRAINING, "group 0 rebuilt")
        job = world.job(job_id)
        assert job.state == pb.JOB_STATE_RUNNING and [r.generation for r in ranktable.rows(job)] == [2, 2, 1, 1]
        assert entry.tracks[2] is healthy and set(entry.tracks) == {0, 1, 2, 3}  # kept; the rebuilt ranks followed
        for rank in (2, 3):
            assert [s.generation for s in world.agents[node_of[rank]].running(job_id)] == [1]
        assert "job.incident" not in await world.kinds(job_id)
        assert not [o for a in world.agents.values() for o in a.overlaps]
        await world.jobs.cancel(job_id)
        await world.until(lambda: world.job(job_id).state == pb.JOB_STATE_CANCELLED, "cancelled")
        assert not [s for a in world.agents.values() for s in a.running(job_id)]
        await world.stop()

    asyncio.run(go())


def replica_job(nodes: int, replicas: int) -> pb.Job:
    return pb.Job(id="job-1", spec=pb.JobSpec(nodes=nodes, ranks_per_node=1, replicas=replicas))


def test_placement_puts_each_group_inside_one_leaf_and_spreads_the_groups_over_the_leaves():
    from tests.test_placement import candidates, tree  # the placement tests' builders

    def leaves_of_groups(decision, k):
        return [{topo.leaf(n) for n in decision.nodes[g * k:(g + 1) * k]} for g in range(len(decision.nodes) // k)]

    topo = tree([[4, 4], [4, 4]])
    free = candidates({f"l{i}": "HHHH" for i in range(4)}, topo)
    # two groups of two: one job-wide placement would put both on one leaf, where one switch takes both
    decision = lifecycle.placed(replica_job(4, 2), free, topo, spares=1)
    groups = leaves_of_groups(decision, 2)
    assert all(len(g) == 1 for g in groups) and groups[0] != groups[1], decision
    assert decision.domain == "s0"  # and still as tight as that allows: under one spine
    # four groups of two on four leaves: one a leaf; eight groups: two a leaf (no more than needed)
    assert sorted(len(g) for g in leaves_of_groups(lifecycle.placed(replica_job(8, 4), free, topo, 0), 2)) == [1] * 4
    eight = leaves_of_groups(lifecycle.placed(replica_job(16, 8), free, topo, 0), 2)
    assert all(len(g) == 1 for g in eight) and max(eight.count(g) for g in eight) == 2
    # groups of three: each inside a leaf of its own (not n000-n005 over two leaves, a group split between them)
    assert leaves_of_groups(lifecycle.placed(replica_job(6, 2), free, topo, 0), 3) == [{"l0"}, {"l1"}]
    # groups that fit no single leaf: placed as any job, in rank order
    wide = lifecycle.placed(replica_job(10, 2), free, topo, 0)
    assert wide.nodes == lifecycle.place(free, lifecycle.GangRequest(nodes=10), topo).nodes
    # a job that is not in groups: as before
    assert lifecycle.placed(replica_job(4, 1), free, topo, 0).leaves == ("l0",)


def test_the_api_never_shows_the_token_of_a_jobs_lighthouse():
    from controller.api.control_service import _shown  # what GetJob and ListJobs return of a job
    job = pb.Job(id="job-1", user="ann", spec=pb.JobSpec(nodes=4, replicas=2), lighthouse_port=5000,
                 lighthouse_host="ctl", lighthouse_control="ctl:5001", lighthouse_token="secret")
    shown = _shown(job)
    assert shown.lighthouse_token == "" and shown.lighthouse_control == "ctl:5001"
    assert job.lighthouse_token == "secret"  # (the record itself untouched)


def test_a_rebuilt_group_takes_the_spare_on_its_own_leaf_first():
    from controller.jobs.placement import Candidate
    from tests.test_placement import tree
    topo = tree([[4, 4, 4]])  # l0: n000-n003, l1: n004-n007, l2: n008-n011
    job = pb.Job(id="job-1", spec=pb.JobSpec(nodes=4, ranks_per_node=1, replicas=2),
                 nodes=["n000", "n001", "n004", "n005"], spares=["n008", "n002"],
                 groups=[pb.ReplicaGroup(index=0, bad=["n001"]), pb.ReplicaGroup(index=1)])
    view = lifecycle.JobView(candidates={n: Candidate(n, True, True, True, 8) for n in topo.nodes}, topology=topo)
    assert lifecycle._group_next_nodes(job, view, job.groups[0]) == (["n000", "n002"], ["n008"])
    job.groups[0].ClearField("bad")
    job.groups[0].bad.append("n000")  # no spare on the group's leaf: the spares in their order
    job.spares[:] = ["n008", "n009"]
    assert lifecycle._group_next_nodes(job, view, job.groups[0]) == (["n008", "n001"], ["n009"])
