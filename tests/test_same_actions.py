"""One policy core, two drivers (issue 41): the same incident, struck at a job of 2 nodes + 1 spare, once in the
fleet simulator (controller/sim/engine.py) and once in the controller on virtual time (tests/jobs_world.py: the job
manager, its executor and the node service, with fake agents), gives the same decisions: the same commits, in the
same order, to the same states, with the same incident, and the same choice of the next generation's nodes
(which node went, which came in). What differs is only what each world simulates (how long a launch takes, the
reasons' wording, the nodes' names)."""

from __future__ import annotations

import asyncio

import pytest

from controller.config import RecoveryConfig
from controller.recovery import lifecycle
from controller.sim import engine
from controller.sim import scenario as sc
from phalanx.v1 import common_pb2 as pb
from tests.jobs_world import World

# the tier (tests/conftest.py); each test with rank tables in rows and packed (conftest.rank_tables)
pytestmark = [pytest.mark.inproc, pytest.mark.usefixtures("rank_tables")]

FAULTS = ["crash", "node-lost", "gpu-failed", "gpu-failing"]
SIM = {"failures.per_1000_node_days": 0.0, "failures.straggler_per_1000_node_days": 0.0, "fleet.nodes": 3,
       "fleet.gpus_per_node": 2, "job.nodes": 2, "job.spares": 1, "run.days": 0.05}


def decision(commit: lifecycle.Commit, first: list[str]) -> tuple:
    """A commit as both worlds can be compared on: its event, the job's state, the incident, and the job's nodes
    and spares as their roles in the first generation (nodes are named differently in each world)."""
    role = {name: f"node{i}" for i, name in enumerate(first)}
    return (commit.kind, pb.JobState.Name(commit.job.state), commit.incident,
            tuple(role.get(n, n) for n in commit.job.nodes), tuple(role.get(n, n) for n in commit.job.spares))


def in_the_simulator(fault: str) -> list[tuple]:
    sim = engine.Simulation(sc.build(sc.with_overrides({}, SIM)))
    job = sim.jobs[0]
    commits: list[lifecycle.Commit] = []
    apply = job.apply

    def recording(actions):
        commits.extend(a for a in actions if isinstance(a, lifecycle.Commit))
        return apply(actions)

    job.apply = recording

    def strike() -> None:
        commits.append(None)  # the fault's place in the sequence
        victim = sim.nodes[job.job.nodes[1]]
        if fault == "crash":
            sim._crash(job)
        elif fault == "node-lost":
            sim._hardware_fault(victim, lost=True)
        else:  # a GPU off the bus (FAILED) or with a row remap pending (FAILING: checkpoint first)
            verdict = engine.verdict_of_xid(79, sim.now) if fault == "gpu-failed" else sim_failing()
            sim._hardware_fault(victim, lost=False, verdict=verdict)

    sim.at(engine.START + 1200, strike)
    sim.run()
    return decisions(commits)


def sim_failing():
    from controller.nodes import health
    return health.Verdict(health.FAILING, ("GPU 0: a row remap is pending",))


def in_the_controller(fault: str) -> list[tuple]:
    world = World(recovery=RecoveryConfig(restart_backoff_s=0.001, max_restarts=10))
    commits: list[lifecycle.Commit | None] = []

    async def main() -> None:
        try:
            await world.start()
            apply = world.jobs.executor.apply

            async def recording(entry, actions, now):
                commits.extend(a for a in actions if isinstance(a, lifecycle.Commit))
                return await apply(entry, actions, now)

            world.jobs.executor.apply = recording
            for name in ("node-a", "node-b", "node-c"):
                agent = world.add(name)
                agent.ack_checkpoints = True  # as trainlib in the simulated ranks does
                await agent.connect()
            job_id = await world.submit(nodes=2, spares=1)
            await world.until(lambda: world.job(job_id).state == pb.JOB_STATE_RUNNING, "generation 1 running")
            commits.append(None)
            victim = world.agents[world.job(job_id).nodes[1]]
            if fault == "crash":
                victim.crash(job_id, victim.running(job_id)[0].rank)
            elif fault == "node-lost":
                victim.frozen = True
            elif fault == "gpu-failed":
                victim.gpus_lost.add(0)
            else:
                victim.remap_pending.add(0)
            await world.until(lambda: world.job(job_id).generation == 2
                              and world.job(job_id).state == pb.JOB_STATE_RUNNING, "generation 2 running")
        finally:
            await world.stop()

    asyncio.run(main())
    return decisions(commits)


def decisions(commits: list) -> list[tuple]:
    """Every commit from the placement to generation 2 running, the fault's place marked."""
    first = list(next(c for c in commits if c is not None and c.kind == "job.placed").job.nodes)
    spares = list(next(c for c in commits if c is not None and c.kind == "job.placed").job.spares)
    out, order = [], first + spares
    for commit in commits:
        if commit is None:
            out.append("fault")
            continue
        out.append(decision(commit, order))
        if commit.kind == "job.running" and commit.job.generation == 2:
            break
    return out


@pytest.mark.parametrize("fault", FAULTS)
def test_the_simulator_and_the_controller_decide_an_incident_alike(fault):
    simulated, controlled = in_the_simulator(fault), in_the_controller(fault)
    assert simulated == controlled, f"\nsimulator:  {simulated}\ncontroller: {controlled}"
    assert "fault" in simulated and simulated[-1][0] == "job.running"
