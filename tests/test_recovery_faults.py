"""Recovery and fencing under faults, in process (tests/jobs_world.py): a controller killed in each
recovery state and restarted on the same store, a partitioned agent, a launch refused mid-restart, and
a fencing stop that must not block its session. No processes, no sleeps that matter: every wait is for
a condition, and liveness moves only with the fake clock."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import pytest

from controller.config import RecoveryConfig
from controller.errors import FailedPrecondition
from controller.jobs import record
from controller.jobs.placement import Candidate
from controller.nodes.states import DOWN, DRAINED, UP
from controller.recovery import lifecycle
from controller.recovery.lifecycle import REQUEST_LATENCY_S
from controller.recovery.table import ACTIVE
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb
from phalanx.v1 import node_pb2
from tests.jobs_world import World

# the tier (tests/conftest.py); each test with rank tables in rows and packed (conftest.rank_tables)
pytestmark = [pytest.mark.inproc, pytest.mark.usefixtures("rank_tables")]

NODES = ("node-a", "node-b", "node-c")
FAST = RecoveryConfig(restart_backoff_s=0.001, max_restarts=10)


def run(coro):
    return asyncio.run(coro)


async def cluster(world: World, nodes=NODES) -> str:
    """Agents on `nodes`, and a job of 2 nodes + 1 spare running on them."""
    await world.start()
    for name in nodes:
        await world.add(name).connect()
    job_id = await world.submit(nodes=2, spares=1)
    await world.until(lambda: world.job(job_id).state == pb.JOB_STATE_RUNNING, "job running")
    return job_id


def state(world: World, job_id: str = "job-1") -> str:
    return pb.JobState.Name(world.job(job_id).state).removeprefix("JOB_STATE_")


async def check_consistent(world: World, job_id: str, after_generation: int, unreachable: tuple[str, ...] = ()) -> None:
    """What every recovery must leave behind: the job running a newer generation, each generation
    launched at most once on each node, no node launching one while an older one still ran there,
    and no rank of an older generation left running on any node the controller can reach."""
    await world.until(lambda: state(world, job_id) == "RUNNING" and world.job(job_id).generation > after_generation,
                      f"job running a generation after {after_generation}")
    job = world.job(job_id)
    assert await world.stored_state(job_id) == "RUNNING"
    generations = await world.launched_generations(job_id)
    assert generations == sorted(set(generations)) and generations[-1] == job.generation, generations
    for agent in world.agents.values():
        twice = [launch for launch, n in Counter(agent.launches).items() if n > 1]
        assert not twice, f"{agent.name} launched {twice} more than once"
        assert not agent.overlaps, agent.overlaps
    await world.until(lambda: all(s.generation == job.generation for a in world.agents.values()
                                  if a.name not in unreachable for s in a.running(job_id)),
                      "old generations stopped everywhere")
    for node in job.nodes:
        record = world.registry.get(node).record
        assert (record.state, record.drain_reason) == (UP, ""), (node, record)
        assert [s.generation for s in world.agents[node].running(job_id)] == [job.generation]


# -- a controller killed in each recovery state ---------------------------------------------------------


async def _kill_during(world: World, target: str, how: str) -> None:
    job_id = await cluster(world)
    before = world.job(job_id).generation
    victim = world.agents[world.job(job_id).nodes[1]]
    if target == "RENDEZVOUS":
        world.jobs.recovery_cfg = RecoveryConfig(restart_backoff_s=600.0)  # the dead controller never gets past it
    command = {"CHECKPOINTING": "checkpoint", "EVICTING": "stop", "RESTARTING": "launch"}.get(target)
    for agent in world.agents.values():
        agent.received.clear()
        if command is not None:
            (agent.hold if how == "hold" else agent.mute).add(command)
    if target == "CHECKPOINTING":
        victim.remap_pending.add(0)  # FAILING: checkpoint, then evict
    else:
        victim.crash(job_id, rank=1)
    await world.until(lambda: state(world, job_id) == target, target)
    if command is not None:  # the command went out (and was lost, or carried out unanswered)
        await world.until(lambda: any(command in a.received for a in world.agents.values()), f"{command} sent")
    assert await world.stored_state(job_id) == target
    await world.kill()
    for agent in world.agents.values():
        agent.hold.clear()
        agent.mute.clear()
    await world.start()
    # the agents come back later: the restarted controller's first stops find nobody. "Later" on the world's own
    # clock, which turns only as the controller's loops do (tests/jobs_world.py), not on a busy machine's
    restarted = world.clock.monotonic()
    await world.until(lambda: world.clock.monotonic() >= restarted + 0.2, "the restarted controller's first turns")
    for agent in world.agents.values():
        await agent.connect()
    await check_consistent(world, job_id, before)
    if target == "CHECKPOINTING":
        assert victim.name not in world.job(job_id).nodes
        # DRAINED once the controller has heard, in a heartbeat after the stop, that no rank runs there: the stop
        # the test saw carried out at the agent may not have reached the controller yet
        await world.until(lambda: world.registry.get(victim.name).record.state is DRAINED, "the victim DRAINED")
        record = world.registry.get(victim.name).record
        assert record.drain_reason.startswith("health FAILING"), record


@pytest.mark.parametrize(("target", "how"), [
    ("CHECKPOINTING", "hold"), ("EVICTING", "hold"), ("EVICTING", "mute"), ("RENDEZVOUS", ""),
    ("RESTARTING", "hold"), ("RESTARTING", "mute")])
def test_a_controller_killed_during_recovery_finishes_it_after_a_restart(target, how):
    """`hold`: the agents never got the dead controller's last command; `mute`: they carried it out and
    the answer was lost with the controller."""
    world = World(recovery=FAST)

    async def main():
        try:
            await _kill_during(world, target, how)
        finally:
            await world.stop()

    run(main())


# -- a launch refused during a restart ------------------------------------------------------------------


def test_a_launch_refused_during_a_restart_starts_the_recovery_again():
    world = World(recovery=FAST)

    async def main():
        try:
            job_id = await cluster(world)
            world.agents["node-a"].fail_launch.add(2)
            world.agents["node-b"].crash(job_id, rank=1)
            await check_consistent(world, job_id, after_generation=2)
            assert world.job(job_id).generation == 3 and world.job(job_id).restarts == 2
            story = [e.message for e in await world.store.list_events(job=job_id)]
            assert any("launch failed" in m and "generation 2 refused" in m for m in story), story
        finally:
            await world.stop()

    run(main())


def test_a_launch_refused_before_the_ranks_restored_still_restores_the_snapshots_of_the_generation_before():
    """A second failure during a recovery: generation 2 was to restore generation 1's snapshots, but its launch
    was refused, so it took none. Generation 3 restores generation 1's (every rank the same step of one
    generation), where it used to look at generation 2 alone and fall back to the disk checkpoint."""
    world = World(recovery=FAST)

    async def main():
        try:
            await world.start()
            for i, name in enumerate(NODES):
                world.add(name).snapshot_address = f"127.0.0.1:{7400 + i}"
                await world.agents[name].connect()
            job_id = await world.submit(nodes=2, spares=1)
            await world.until(lambda: state(world, job_id) == "RUNNING", "job running")
            a, b = (world.agents[n] for n in world.job(job_id).nodes)
            for agent, own, other in ((a, 0, 1), (b, 1, 0)):  # each rank's own, and the other node's replica
                agent.snapshots = [node_pb2.SnapshotHeld(job=job_id, generation=1, rank=own, step=40, size=1),
                                   node_pb2.SnapshotHeld(job=job_id, generation=1, rank=other, step=40, size=1,
                                                         replica=True)]
            await world.until(lambda: len(world.jobs.entries[job_id].snapshots) == 2, "the snapshots reported")
            a.fail_launch.add(2)
            b.crash(job_id, rank=1)
            await check_consistent(world, job_id, after_generation=2)
            assert world.job(job_id).generation == 3
            (launch,) = [c.launch for c in a.commands if c.WhichOneof("body") == "launch" and c.launch.generation == 3]
            assert launch.ranks[0].env["PHALANX_RESTORE"] == f"1:40:{a.name}@127.0.0.1:7400,{b.name}@127.0.0.1:7401"
            story = [e.message for e in await world.store.list_events(job=job_id) if e.kind == "job.snapshot_restore"]
            assert story[-1] == (f"{job_id} generation 3: every rank restores from its in-memory snapshot of step 40 "
                                 f"(generation 1: generation 2 left no in-memory snapshot on a node that is up)")
        finally:
            await world.stop()

    run(main())


# -- fencing ----------------------------------------------------------------------------------------------


def test_heartbeats_are_read_while_a_fencing_stop_waits_for_its_answer():
    """The session reader hands stale ranks to fencing and goes on reading: the stop's answer, and the
    heartbeats that keep the node alive, arrive on that same stream."""
    world = World(recovery=FAST)

    async def main():
        try:
            await world.start()
            agent = world.add("node-a")
            agent.hold.add("stop")  # the answer never comes back
            agent.ranks[("job-9", 1, 0)] = node_pb2.RankStatus(job="job-9", generation=1, rank=0,
                                                          state=pb.RANK_STATE_RUNNING, pid=7)  # no such job
            await agent.connect()
            await world.until(lambda: agent.held, "the fencing stop sent")
            entry = world.registry.get("node-a")
            seen = entry.heartbeats
            await world.until(lambda: entry.heartbeats >= seen + 5, "heartbeats read after the stop went out")
            assert agent.session.unanswered == 1  # ... while it still waits for its answer
        finally:
            await world.stop()

    run(main())


async def _partition(world: World, node: str, job_id: str) -> None:
    """SIGSTOP `node`'s agent until the controller declares the node DOWN: the fake clock moves on while
    the other agents keep beating."""
    world.agents[node].frozen = True
    await world.until(lambda: world.registry.get(node).record.state is DOWN, f"{node} DOWN")


def test_a_partitioned_agent_is_evicted_and_its_stale_ranks_are_fenced_when_it_returns():
    world = World(recovery=FAST)

    async def main():
        try:
            job_id = await cluster(world)
            victim = world.agents["node-b"]
            await _partition(world, "node-b", job_id)
            await check_consistent(world, job_id, after_generation=1, unreachable=("node-b",))
            job = world.job(job_id)
            assert list(job.nodes) == ["node-a", "node-c"] and "node-b" in job.evicted
            assert [s.generation for s in victim.running(job_id)] == [1]  # it knows nothing yet
            victim.frozen = False  # SIGCONT: its session is gone; it registers again
            victim.received.clear()
            await victim.connect()
            await world.until(lambda: not victim.running(job_id), "the stale rank stopped")
            assert "stop" in victim.received and "launch" not in victim.received
            assert ("job-1", 2) not in victim.launches
            record = world.registry.get("node-b").record
            assert record.state is DRAINED, record  # back, but out of service until an operator says so
            assert record.drain_reason == "evicted from job-1: node node-b lost"
            assert "job.fenced" in await world.kinds(job_id)
            assert state(world, job_id) == "RUNNING" and world.job(job_id).generation == 2
        finally:
            await world.stop()

    run(main())


def test_a_straggler_of_a_job_without_spares_waits_while_no_node_could_replace_it():
    """A job submitted with --spares 0 on every node there is, and one rank twice as slow: evicting its node
    would stop the job until a node is free (a slow job trains; a stopped one does not). The executor looks at
    the fleet only for such a verdict, holds it and says so; once a free node joins, the straggler is evicted."""
    world = World(recovery=FAST)

    async def main():
        try:
            await world.start()
            for name in NODES[:2]:
                await world.add(name).connect()
            job_id = await world.submit(nodes=2, spares=0)
            await world.until(lambda: state(world, job_id) == "RUNNING", "job running")
            a, b = (world.agents[n] for n in world.job(job_id).nodes)
            for report in range(1, 9):  # 80 steps of 0.2 s; rank 1 computes twice as long as rank 0
                for agent, rank, compute in ((a, 0, 0.1), (b, 1, 0.2)):
                    agent.progress.append(node_pb2.RankProgress(
                        job=job_id, generation=1, rank=rank, last_step=report * 10 - 1, steps=10, mean_step_s=0.2,
                        compute_samples=[compute] * 10))
                await world.until(lambda r=report: world.jobs.entries[job_id].tracks and all(
                    t.last_step == r * 10 - 1 for t in world.jobs.entries[job_id].tracks.values()), "the reports")
            await world.until(lambda: world.job(job_id).straggler_held, "the verdict held")
            assert state(world, job_id) == "RUNNING" and world.job(job_id).generation == 1
            assert world.job(job_id).straggler_held.startswith("no spare and no free node to replace it")
            assert (await world.kinds(job_id)).count("job.straggler_held") == 1
            await world.add("node-c").connect()
            await world.until(lambda: state(world, job_id) != "RUNNING" or world.job(job_id).generation > 1,
                              "the straggler evicted once node-c is free")
            assert "straggler" in world.job(job_id).incident_kind
        finally:
            await world.stop()

    run(main())


# -- the agreed checkpoint step -----------------------------------------------------------------------------


def test_a_checkpoint_soon_after_a_start_waits_for_the_ranks_real_pace():
    """A FAILING GPU right after the ranks' first report, whose mean step time is mostly their start-up: the
    request waits for the next report, and agrees on a step REQUEST_LATENCY_S of real steps ahead."""
    world = World(recovery=FAST)

    async def main():
        try:
            job_id = await cluster(world)
            a, b = (world.agents[n] for n in world.job(job_id).nodes)
            for agent, rank in ((a, 0), (b, 1)):  # steps 0-9, the first after 3 s of start-up
                agent.progress.append(node_pb2.RankProgress(job=job_id, generation=1, rank=rank, last_step=9,
                                                            steps=10, mean_step_s=0.35))
            await world.until(lambda: world.jobs.entries[job_id].tracks and all(
                t.last_step == 9 for t in world.jobs.entries[job_id].tracks.values()), "the start-up reports")
            b.remap_pending.add(0)
            await world.until(lambda: state(world, job_id) == "CHECKPOINTING", "checkpointing")
            for agent, rank in ((a, 0), (b, 1)):
                agent.progress.append(node_pb2.RankProgress(job=job_id, generation=1, rank=rank, last_step=29,
                                                            steps=20, mean_step_s=0.05))
            await world.until(lambda: "checkpoint" in a.received, "the checkpoint request")
            (request,) = [c.checkpoint for c in a.commands if c.WhichOneof("body") == "checkpoint"]
            assert request.at_step == 29 + math.ceil(REQUEST_LATENCY_S / 0.05) + 2 and request.pause
        finally:
            await world.stop()

    run(main())


def asked(agent) -> list[node_pb2.RequestCheckpoint]:
    return [c.checkpoint for c in agent.commands if c.WhichOneof("body") == "checkpoint"]


async def restarted_after_reports(world: World, job_id: str) -> list:
    """Generation 1's trainlib reports once, then a rank crashes: the agents of generation 2, running."""
    a, b = (world.agents[n] for n in world.job(job_id).nodes)
    for agent, rank in ((a, 0), (b, 1)):
        agent.progress.append(node_pb2.RankProgress(job=job_id, generation=1, rank=rank, last_step=9, steps=10,
                                                    mean_step_s=0.35))
    await world.until(lambda: world.jobs.entries[job_id].tracks, "generation 1's first reports")
    a.crash(job_id, 0)
    await world.until(lambda: state(world, job_id) == "RUNNING" and world.job(job_id).generation == 2,
                      "generation 2 running")
    return [world.agents[n] for n in world.job(job_id).nodes]


async def new_generation_reports(world: World, job_id: str, nodes: list) -> None:
    """Generation 2's start-up report (steps 0-4), then one at its pace (steps 5-24, 0.05 s each)."""
    for last, steps, mean in ((4, 5, 0.6), (24, 20, 0.05)):
        for agent, rank in zip(nodes, (0, 1), strict=True):
            agent.progress.append(node_pb2.RankProgress(job=job_id, generation=2, rank=rank, last_step=last,
                                                        steps=steps, mean_step_s=mean))
        await world.until(lambda last=last: world.jobs.entries[job_id].tracks and all(
            t.last_step == last for t in world.jobs.entries[job_id].tracks.values()), "generation 2's reports")


async def asked_once_paced(world: World, job_id: str, nodes: list) -> node_pb2.RequestCheckpoint:
    """Nothing asked of generation 2 past pace_wait_s (twice over, virtual); its reports; then its request."""
    start = world.clock.monotonic()
    await world.until(lambda: world.clock.monotonic() > start + 2 * FAST.pace_wait_s, "past pace_wait_s")
    assert not [r for r in asked(nodes[0]) if r.generation == 2], "asked before generation 2 reported"
    await new_generation_reports(world, job_id, nodes)
    await world.until(lambda: any(r.generation == 2 for r in asked(nodes[0])), "the request")
    (ask,) = [r for r in asked(nodes[0]) if r.generation == 2]
    return ask


def test_a_checkpoint_before_a_new_generations_first_report_waits_for_its_pace_not_at_once():
    """`phalanx checkpoint` just after a restart, before the new generation's trainlib had reported: with no
    progress at all the request said "at once" (at_step 0), which ranks that hear it a step apart take at different
    steps, each then waiting in its save for the others (a `make test-busy` run: 0 of 2 ranks committed in 60 s).
    It now waits for the new ranks' pace; a job whose trainlib never reported is still asked at once."""
    world = World(recovery=FAST)

    async def main():
        try:
            job_id = await cluster(world)
            a = world.agents[world.job(job_id).nodes[0]]
            # no trainlib reports at all, ever: at once
            with pytest.raises(FailedPrecondition, match="checkpoint 1 within"):
                await world.jobs.checkpoint(job_id, 0.2)
            assert [r.at_step for r in asked(a)] == [0]
            nodes = await restarted_after_reports(world, job_id)
            request = asyncio.create_task(world.jobs.checkpoint(job_id, 60.0))
            ask = await asked_once_paced(world, job_id, nodes)
            assert ask.at_step > 24
            request.cancel()
        finally:
            await world.stop()

    run(main())


@pytest.mark.parametrize("restarted", [False, True], ids=["same-controller", "controller-restarted"])
def test_an_eviction_checkpoint_before_a_new_generations_first_report_waits_for_its_pace(restarted):
    """The same for a FAILING GPU found while a new generation starts: the eviction's checkpoint waits for the new
    ranks' pace (up to half of checkpoint_deadline_s, not only pace_wait_s) rather than saying "at once". Whether a
    job's trainlib reports is stored with the job: a controller that restarts (or takes over) after the job's
    restart, before the new generation's first report, waits too; it used to start out not knowing."""
    world = World(recovery=FAST)

    async def main():
        try:
            job_id = await cluster(world)
            nodes = await restarted_after_reports(world, job_id)
            if restarted:
                await world.restart()
                for name in NODES:
                    await world.agents[name].connect()
                await world.until(lambda: all(world.registry.get(n).session is not None for n in NODES),
                                  "agents back")
                assert not world.jobs.entries[job_id].tracks, "generation 2 reported before the restart"
            nodes[1].remap_pending.add(0)
            await world.until(lambda: state(world, job_id) == "CHECKPOINTING", "checkpointing")
            ask = await asked_once_paced(world, job_id, nodes)
            assert ask.at_step > 24 and ask.pause
        finally:
            await world.stop()

    run(main())


def test_checkpoint_request_ids_go_on_counting_after_a_controller_restart():
    """trainlib ignores a request id it has handled: a restarted controller that began again at 1 had its first
    request (in a recovery, the eviction checkpoint) dropped by every rank."""

    async def go():
        world = World()
        job_id = await cluster(world)
        agent = world.agents[world.job(job_id).nodes[0]]
        with pytest.raises(FailedPrecondition, match="only 0 of 2 ranks committed checkpoint 1"):
            await world.jobs.checkpoint(job_id, 0.2)
        await world.restart()
        for name in NODES:
            await world.agents[name].connect()
        await world.until(lambda: all(world.registry.get(n).session is not None for n in NODES), "agents back")
        with pytest.raises(FailedPrecondition, match="checkpoint 2 within"):
            await world.jobs.checkpoint(job_id, 0.2)
        ids = [c.checkpoint.request_id for c in agent.commands if c.WhichOneof("body") == "checkpoint"]
        assert ids == [1, 2]
        assert world.job(job_id).checkpoint.id == 2
        await world.stop()

    run(go())


def test_a_checkpoint_asked_before_the_agents_are_back_reaches_them_once_they_are():
    """A controller that restarts (or takes over) during CHECKPOINTING before the dead one had asked, asks at once;
    its agents are not back yet, so the request went nowhere and the job waited out the whole deadline (20 s) on a
    FAILING GPU, which a kill-loop trial took for a lost recovery. Each agent is told once it is back."""
    world = World(recovery=FAST)

    async def main():
        try:
            job_id = await cluster(world)
            victim = world.agents[world.job(job_id).nodes[1]]
            for agent in world.agents.values():
                agent.hold.add("checkpoint")  # the dead controller's request never arrives
            victim.remap_pending.add(0)
            await world.until(lambda: state(world, job_id) == "CHECKPOINTING", "CHECKPOINTING")
            await world.kill()
            # as if the controller died before it committed its request: the next one asks anew
            record = next(r for r in await world.store.load_jobs() if r.id == job_id)
            job = pb.Job.FromString(record.data)
            job.ClearField("checkpoint")
            await world.store.commit(jobs=[record.replace(data=job.SerializeToString())])
            for agent in world.agents.values():
                agent.hold.clear()
                agent.received.clear()
            await world.start()
            await world.until(lambda: world.jobs.entries[job_id].checkpoint is not None, "a new request")
            pending = world.jobs.entries[job_id].checkpoint
            await world.until(lambda: pending.untold == set(world.job(job_id).nodes), "the request undelivered")
            for agent in world.agents.values():
                await agent.connect()
            ranks_on = set(world.job(job_id).nodes)
            await world.until(lambda: all("checkpoint" in world.agents[n].received for n in ranks_on),
                              "the request told once the agents are back")
            assert state(world, job_id) == "CHECKPOINTING" and not pending.untold
        finally:
            await world.stop()

    run(main())


def test_the_jobs_of_a_pass_share_one_look_at_the_fleet_and_each_sees_the_nodes_the_one_before_took():
    """A queue of pending jobs sees every node once a pass, not once a job (about 70 ms a job at 16,384 nodes); a
    job placed in the pass makes the look again, so the next one is not placed on the nodes it just took, and so
    does a node that changed; each job sees the fleet as a look of its own showed it."""
    async def go():
        world = World()
        await world.start()
        scheduler = next(t for t in world._tasks if t.get_name() == "scheduler")
        scheduler.cancel()  # the passes below, one at a time
        for name in ("n1", "n2", "n3"):
            world.add(name)
            await world.agents[name].connect()
        await world.until(lambda: all(world.registry.get(n).heartbeats > 0 for n in ("n1", "n2", "n3")),
                          "every node's first heartbeat")
        executor, looks = world.jobs.executor, []
        holders = executor.holders
        executor.holders = lambda: looks.append(1) or holders()
        waiting = [await world.submit(nodes=4, spares=0) for _ in range(3)]  # more than the fleet has
        await executor.run_pass()  # (each commits why it waits: no node taken or freed)
        await executor.run_pass()
        assert len(looks) == 2 and all(world.job(j).state == pb.JOB_STATE_PENDING for j in waiting)
        first, second = await world.submit(nodes=2, spares=0), await world.submit(nodes=2, spares=0)
        looks.clear()
        await executor.run_pass()
        assert world.job(first).state != pb.JOB_STATE_PENDING and len(world.job(first).nodes) == 2
        assert world.job(second).state == pb.JOB_STATE_PENDING, world.job(second)  # one node left, not two
        assert len(looks) == 2  # the second look after the first job's commit

        def as_before(job):
            """The fleet as a job's step saw it before the look was shared (built for each step)."""
            busy = {n for e in world.jobs.entries.values() if e.job.state in ACTIVE and e.job.id != job.id
                    for n in [*e.job.nodes, *e.job.spares]}
            allowed = set(job.spec.within)
            return [Candidate.of(e.record.name, e.record.state, e.verdict.health, e.record.name not in busy,
                                 e.gpu_count(), connected=e.session is not None and not e.judge_deferred,
                                 drained=bool(e.record.drain_reason))
                    for e in world.registry.entries() if not allowed or e.record.name in allowed]

        bound = pb.Job(id="job-99", spec=pb.JobSpec(within=["n3", *world.job(first).nodes[:1]]))  # (Slurm)
        for job in (world.job(first), world.job(second), bound):
            assert list(executor._candidates_for(job).values()) == as_before(job), job.id
        looks.clear()
        await world.registry.drain("n3", "repair")  # a node changed mid-pass: the look is made again
        assert not executor._candidates_for(world.job(second))["n3"].schedulable and len(looks) == 1
        shared = world.job(first).nodes[0]  # (held by two jobs: free for neither)
        world.jobs.entries[second].job = pb.Job(id=second, state=pb.JOB_STATE_RUNNING, nodes=[shared])
        executor._fleet = None
        for job in (world.job(first), world.job(second)):
            assert list(executor._candidates_for(job).values()) == as_before(job), job.id
        assert not executor._candidates_for(world.job(first))[shared].free
        await world.stop()

    run(go())


def test_a_node_whose_health_a_takeover_has_not_judged_yet_is_not_placed_on():
    async def go():
        world = World()
        await world.start()
        world.registry.defer_judging()  # a takeover's take-up
        world.add("n1")
        await world.agents["n1"].connect()
        await world.until(lambda: world.registry.get("n1").heartbeats > 0, "n1's first heartbeat")
        (candidate,) = world.jobs.executor.candidates()
        assert world.registry.get("n1").judge_deferred and not candidate.schedulable and not candidate.lost
        world.registry.judge_deferred()
        await world.registry._judging_deferred
        (candidate,) = world.jobs.executor.candidates()
        assert candidate.schedulable
        await world.stop()

    run(go())



def test_a_request_cancelled_while_its_commit_is_in_the_store_leaves_the_job_committable():
    """The fuzzer's finds: a `phalanx checkpoint` whose client gave up (a 0.05 s deadline) was cancelled between
    the store's write of the job record and the manager's update of its revision; from then on every commit of
    the job failed its revision check (UNAVAILABLE, for good). Then, the commit merely shielded, the cancelled
    caller let go of the job's lock while its commit was still in the store, and the next commit raced it with the
    revision it replaced. The commit and the update now run to the end, the caller in its lock until then."""

    async def go():
        world = World()
        job_id = await cluster(world)
        entry = world.jobs.entries[job_id]
        inner = world.store.commit
        in_store, release = asyncio.Event(), asyncio.Event()

        async def slow_commit(**records):
            done = await inner(**records)  # written
            in_store.set()
            await release.wait()  # ... and the caller is cancelled before it hears so
            return done
        world.store.commit = slow_commit
        saving = asyncio.create_task(world.jobs.save(entry, lifecycle.Commit(world.job(job_id), "job.test", "x")))
        await in_store.wait()
        saving.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not saving.done()  # the caller waits for the store's answer (and keeps whatever lock it holds)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await saving
        world.store.commit = inner
        assert entry.revision == next(r.revision for r in world.store._jobs.values() if r.id == job_id)
        await world.jobs.save(entry, lifecycle.Commit(world.job(job_id), "job.test", "again"))  # no conflict
        await world.stop()

    run(go())


def test_a_rank_its_node_stops_telling_of_is_lost_and_the_job_restarts_with_the_loss_stored():
    """A node that runs and beats but no longer reports one of its ranks (its wrapper gone without an exit file):
    after jobs.missing_reports_lost heartbeats the step decides the rank LOST, and the restart's incident is stored
    with it; the manager only counted the heartbeats."""
    world = World(recovery=FAST)

    async def main():
        try:
            job_id = await cluster(world)
            victim = world.agents[world.job(job_id).nodes[1]]
            gone = next(key for key, status in victim.ranks.items() if status.job == job_id)
            del victim.ranks[gone]  # no exit seen: only silence about it
            await world.until(lambda: world.job(job_id).generation == 2 and state(world, job_id) == "RUNNING",
                              "generation 2 running")
            records = {r.id: r for r in await world.store.load_jobs()}
            incident = [e.message for e in await world.store.list_events(job=job_id, limit=1000)
                        if e.kind == "job.incident"]
            assert len(incident) == 1 and f"rank {gone[2]}" in incident[0] and "was lost" in incident[0], incident
            assert records[job_id].state == "RUNNING"
        finally:
            await world.stop()

    run(main())


def test_a_long_scheduler_pass_is_followed_by_as_long_a_rest_for_the_event_loop():
    """While a job recovers, every heartbeat of its nodes wakes a pass; over a job of thousands of nodes passes back
    to back would starve the reading of those heartbeats. After a pass of LONG_PASS_S or more the loop gets as long
    (at most MAX_REST_S) before the next one; a short pass is followed at once."""
    from types import SimpleNamespace

    from controller.recovery import executor as ex
    from phalanx.clock import RealClock

    assert ex.rest_after(ex.LONG_PASS_S / 2) == 0.0
    assert ex.rest_after(0.2) == 0.2 and ex.rest_after(60.0) == ex.MAX_REST_S

    async def main():
        executor = ex.Executor(SimpleNamespace(clock=RealClock(), cfg=SimpleNamespace(schedule_interval_s=60.0)))
        spins, between, third = [0], [], asyncio.Event()

        async def slow_pass():  # as long as a pass over a big job, and woken again at once, as by heartbeats
            between.append(spins[0])
            if len(between) == 3:
                third.set()
            started = time.thread_time()
            while time.thread_time() < started + ex.LONG_PASS_S * 1.2:
                pass
            executor.pass_cpu += time.thread_time() - started  # as Executor.advance counts a step's view and decision
            spins[0] = 0
            executor.wake()

        async def probe():  # the rest of the loop: how often it runs between two passes
            while True:
                await asyncio.sleep(0)
                spins[0] += 1

        executor.run_pass = slow_pass
        tasks = [asyncio.create_task(probe()), asyncio.create_task(executor.run())]
        executor.wake()
        try:
            await asyncio.wait_for(third.wait(), 60)
        finally:
            for task in tasks:
                task.cancel()
        # back to back, the rest of the loop would run once or twice between passes; with the rest, many times
        assert min(between[1:3]) > 20, between

    run(main())


def test_a_pass_counts_the_cpu_of_its_views_and_decisions():
    """What the rest after a pass is measured by (Executor.pass_cpu): each step's view and decision of a job."""
    world = World()

    async def main():
        try:
            await cluster(world)
            await world.until(lambda: world.jobs.executor.pass_cpu > 0, "a pass over the running job counted")
        finally:
            await world.stop()

    run(main())


def test_ranks_that_end_after_their_job_gave_up_are_written_to_its_record_one_heartbeat_after_another():
    """A job that gives up stops its other ranks. Each that ends after (its node says so, a heartbeat at a time) is
    written to the ended job's record (`job.ranks_stopped`), in either form of its rank table: a packed one's states,
    which the heartbeat path reads once per record, are read anew after each such change."""

    async def go():
        world = World(recovery=RecoveryConfig(restart_backoff_s=0.001, max_restarts=0))
        await world.start()
        for name in NODES:
            await world.add(name).connect()
        job = await world.jobs.submit(pb.JobSpec(command=["train"], nodes=2, ranks_per_node=2), "tester")
        await world.until(lambda: state(world, job.id) == "RUNNING", "job running")
        a = world.agents[world.job(job.id).nodes[0]]
        b = world.agents[world.job(job.id).nodes[1]]
        for agent in (a, b):
            agent.hold.add("stop")  # its ranks run on past the job's end, until ended one by one below
        b.crash(job.id, 2, code=3)  # rank 2 fails: no restart (max_restarts 0), the job gives up
        await world.until(lambda: state(world, job.id) == "FAILED", "the job failed")
        rows = [(r.rank, r.state) for r in ranktable.rows(world.job(job.id))]
        assert rows == [(0, pb.RANK_STATE_RUNNING), (1, pb.RANK_STATE_RUNNING), (2, pb.RANK_STATE_EXITED),
                        (3, pb.RANK_STATE_RUNNING)], rows
        for rank, agent in ((1, a), (0, a), (3, b)):  # node a's two ranks end in two heartbeats, then b's
            agent.crash(job.id, rank, code=-15)
            await world.until(lambda rank=rank: ranktable.rows(world.job(job.id))[rank].state == pb.RANK_STATE_EXITED,
                              f"rank {rank} written as ended")
            assert ranktable.rows(world.job(job.id))[rank].exit_code == -15
        await world.until(lambda: job.id not in world.jobs.ended_ranks, "the ranks' ends saved")
        assert "job.ranks_stopped" in await world.kinds(job.id)
        stored = next(r for r in await world.store.load_jobs() if r.id == job.id)
        assert not ranktable.any_in(record.unpack(stored.data), pb.RANK_STATE_RUNNING)
        await world.stop()

    run(go())
