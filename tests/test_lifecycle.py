"""The job lifecycle's transition coverage, in virtual time: every incident, with the controller restarted
in every state it passes through, and cancels from every state, all driven through the pure `step`.

A small discrete-event world stands in for the agents, the ranks and trainlib: it applies the actions
(`Launch` starts ranks a second later, `Stop` kills them, `RequestCheckpoint` is answered by the ranks
that still step) and feeds the outcomes back as the view. A controller restart wipes everything the
controller process knew (launches, stops and checkpoint requests in flight, progress) and keeps the
stored record, exactly as a kill -9 does. No sleeps, no event loop: each case runs in milliseconds.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from dataclasses import dataclass, field

import pytest

from controller.config import JobsConfig, RecoveryConfig
from controller.errors import IllegalTransition
from controller.jobs.placement import Candidate
from controller.jobs.topology import flat
from controller.nodes.health import FAILED, FAILING, HEALTHY
from controller.nodes.states import DOWN, UP
from controller.recovery import lifecycle, table
from controller.recovery.detectors import NodeView
from controller.recovery.progress import RankTrack
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb

# the tier (tests/conftest.py); each test with rank tables in rows and packed (conftest.rank_tables)
pytestmark = [pytest.mark.inproc, pytest.mark.usefixtures("rank_tables")]

START = 1_700_000_000.0
STEP_S = 0.1  # a training step
REPORT_S = 0.5  # trainlib reports twice a second
POLICY = lifecycle.Policy(RecoveryConfig(max_restarts=3, restart_backoff_s=1.0, checkpoint_deadline_s=30.0,
                                         hang_min_s=5.0, startup_s=20.0),
                          JobsConfig(stop_grace_s=5.0))


@dataclass
class Node:
    name: str
    down: bool = False
    health: object = HEALTHY
    reason: str = ""
    drained: bool = False
    ranks: dict[tuple[int, int], str] = field(default_factory=dict)  # (generation, rank) -> running|exited:<code>
    stopped_generation: int = 0  # the agent refuses to launch a generation it was told to stop (as the real one)
    own_work: bool = False  # Phalanx's own work runs there now (standbys starting)


@dataclass
class Process:
    """What one controller process knows beyond the store; a restart starts a new one."""

    epoch: int
    launch: lifecycle.LaunchView | None = None
    checkpoint: lifecycle.CheckpointView | None = None
    stops: dict[str, tuple[str, float]] = field(default_factory=dict)  # node -> (sending | taken, when)
    tracks: dict[int, RankTrack] = field(default_factory=dict)
    generation: int = 0


class Sim:
    def __init__(self, nodes=("a", "b", "c"), job_nodes: int = 2, spares: int = 1, ranks_per_node: int = 2,
                 policy: lifecycle.Policy = POLICY, replicas: int = 0) -> None:
        self.now = START
        self.policy = policy
        self.nodes = {n: Node(n) for n in nodes}
        self.queue: list = []
        self.order = itertools.count()
        self.process = Process(epoch=0)
        self.launched: list[int] = []
        self.left_quorum: list[tuple[int, str]] = []  # (group, why): LeaveQuorum, in order
        self.states: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.incidents: list[str] = []  # the kind of every incident committed, in order
        self.on_state: dict[str, callable] = {}  # state -> run 50 ms after the job enters it
        self.on_commit: dict[str, callable] = {}  # state -> run at once on the commit that enters it
        self.hung: set[int] = set()  # ranks that stopped (SIGSTOP): they step no more and fall silent
        self.done: set[int] = set()  # ranks whose training ended: they step no more and say so (trainlib.finish)
        self.own_work_at: dict[str, float] = {}  # node -> when it last showed Phalanx's own work
        self.slow: set[str] = set()  # nodes whose ranks compute 50% slower (and so the job's steps, when they run)
        self.pace_factor = 1.0  # the whole job's steps this much slower, whatever its ranks (a slow dataset)
        self.step_of: dict[int, int] = {}
        self.in_memory: set[int] = set()  # ranks that commit a checkpoint as an in-memory snapshot (replicated)
        spec = pb.JobSpec(command=["train"], nodes=job_nodes, ranks_per_node=ranks_per_node, spares=spares,
                          replicas=replicas)
        self.job = pb.Job(id="job-1", spec=spec, state=pb.JOB_STATE_PENDING, state_since_unix_ns=int(self.now * 1e9))
        self.at(self.now, self.report)

    # -- the world's clock ---------------------------------------------------------------------

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.queue, (t, next(self.order), fn, args))

    def run_until(self, done, limit_s: float = 600.0) -> None:
        end = self.now + limit_s
        self.decide()
        while not done():
            assert self.queue and self.queue[0][0] <= end, f"not done after {limit_s}s: {self.describe()}"
            t, _, fn, args = heapq.heappop(self.queue)
            self.now = max(self.now, t)
            fn(*args)
            self.decide()

    def run_for(self, seconds: float) -> None:
        end = self.now + seconds
        self.run_until(lambda: not self.queue or self.queue[0][0] > end, limit_s=seconds + 1)
        self.now = end

    def describe(self) -> str:
        return f"{table.state_name(self.job.state)} gen {self.job.generation}: {self.job.reason}; {self.events[-3:]}"

    # -- the controller side: build the view, step, apply ---------------------------------------

    def view(self) -> lifecycle.JobView:
        job, p = self.job, self.process
        views, told, stopped, running = {}, set(), set(), set()
        for name, n in self.nodes.items():
            runs = any(g == job.generation and s == "running" for (g, _), s in n.ranks.items())
            how, when = p.stops.get(name, ("", 0.0))
            if how == "sending" or (how == "taken" and self.now - when < lifecycle.RESTOP_S):
                told.add(name)
            if how == "taken" and not runs:
                stopped.add(name)
            if runs:
                running.add(name)
            views[name] = NodeView(name, n.down, n.health, n.reason, connected=not n.down, drained=n.drained,
                                   own_work_at=self.now if n.own_work else self.own_work_at.get(name, 0.0))
            if n.own_work:
                self.own_work_at[name] = self.now
        candidates = {n.name: Candidate.of(n.name, DOWN if n.down else UP, n.health, True, 8, connected=not n.down,
                                           drained=n.drained) for n in self.nodes.values()}
        launch = p.launch if p.launch and p.launch.generation == job.generation else None
        return lifecycle.JobView(nodes=views, told=told, stopped=stopped, running=running, tracks=p.tracks,
                                 launch=launch, checkpoint=p.checkpoint,
                                 candidates=candidates, topology=flat(self.nodes), fleet=True)

    def decide(self) -> None:
        for _ in range(32):
            self.sync_ranks()
            actions = lifecycle.plan(self.job, lambda fleet: self.view(), self.now, self.policy)  # the fleet always
            if not self.apply(actions):
                return
        raise AssertionError(f"no quiet point after 32 steps: {self.describe()}")

    def sync_ranks(self) -> None:
        """What heartbeats tell the controller of the current generation's ranks (JobManager.observe)."""
        if self.job.state in table.LAUNCHING:
            return
        moves = {}
        for rank in ranktable.rows(self.job):
            node = self.nodes[rank.node]
            status = node.ranks.get((rank.generation, rank.rank))
            if node.down or status is None:
                continue
            target = pb.RANK_STATE_RUNNING if status == "running" else pb.RANK_STATE_EXITED
            if target != rank.state and table.rank_may_move(rank.state, target):
                moves[rank.rank] = (target, 0 if status == "running" else int(status.split(":")[1]))
        ranktable.set_states(self.job, moves)  # (a packed table's row is a copy)

    def apply(self, actions) -> bool:
        committed = False
        for action in actions:
            p = self.process
            match action:
                case lifecycle.Commit(job=job, kind=kind, message=message, incident=incident):
                    if incident:
                        self.incidents.append(incident)
                    before = self.job.state
                    self.job = job
                    self.events.append((kind, message))
                    if job.generation != p.generation and job.state == pb.JOB_STATE_RUNNING and job.groups:
                        # a replica group's rebuild: the new progress of its ranks alone (the others go on)
                        p.generation = job.generation
                        p.tracks = {r: t for r, t in p.tracks.items()
                                    if ranktable.rows(job)[r].generation != job.generation}
                    elif job.generation != p.generation:
                        p.generation, p.tracks, p.stops, p.checkpoint = job.generation, {}, {}, None
                    if job.state != before:
                        self.states.append(table.state_name(job.state))
                        hook = self.on_state.pop(table.state_name(job.state), None)
                        if hook is not None:
                            self.at(self.now + 0.05, hook)
                        if (hook := self.on_commit.pop(table.state_name(job.state), None)) is not None:
                            hook()
                    committed = True
                case lifecycle.Launch(generation=generation):
                    self.launched.append(generation)
                    p.launch = lifecycle.LaunchView(generation)
                    self.at(self.now + 1.0, self.launched_on_agents, p.epoch, generation,
                            tuple((r.node, r.rank) for r in ranktable.rows(self.job) if r.generation == generation))
                case lifecycle.Stop(nodes=nodes, generation=generation):
                    for node in nodes:
                        p.stops[node] = ("sending", self.now)
                        self.at(self.now + 0.1, self.stopped_on_agent, p.epoch, node, generation)
                case lifecycle.Drain(node=node):
                    self.nodes[node].drained = True
                case lifecycle.RequestCheckpoint(request=request):
                    p.checkpoint = lifecycle.CheckpointView(request.id, {})
                    self.at(self.now + 0.5, self.acked, p.epoch, self.job.generation, request.id, request.at_step)
                case lifecycle.WakeAt(at=at):
                    assert at > self.now - 1e-9, f"a wake-up in the past: {at - self.now}"
                    self.at(at, lambda: None)
                case lifecycle.LeaveQuorum(group=group, reason=reason):
                    self.left_quorum.append((group, reason))
                case lifecycle.Event(kind=kind, message=message):
                    self.events.append((kind, message))
        return committed

    # -- the agents and the ranks --------------------------------------------------------------

    def launched_on_agents(self, epoch: int, generation: int, ranks: tuple[tuple[str, int], ...]) -> None:
        """The ranks (node, rank) of `generation` start (only those of the launch: a replica group's are its own)."""
        nodes = list(dict.fromkeys(n for n, _ in ranks))
        missing = [n for n in nodes if self.nodes[n].down or self.nodes[n].stopped_generation >= generation]
        if not missing:
            for name in nodes:
                node = self.nodes[name]
                assert not any(s == "running" for (g, _), s in node.ranks.items() if g < generation), \
                    f"generation {generation} launched on {name} while an older one still runs there"
            for name, rank in ranks:
                self.nodes[name].ranks[(generation, rank)] = "running"
        if epoch == self.process.epoch and self.process.launch and self.process.launch.generation == generation:
            self.process.launch = lifecycle.LaunchView(generation, done=True, ok=not missing, error=f"{missing} down",
                                                       address="10.0.0.1", port=29500)

    def stopped_on_agent(self, epoch: int, name: str, generation: int) -> None:
        node = self.nodes[name]
        if node.down:
            if epoch == self.process.epoch:
                self.process.stops.pop(name, None)
            return
        node.stopped_generation = max(node.stopped_generation, generation)
        for key, status in node.ranks.items():
            if key[0] == generation and status == "running":
                node.ranks[key] = "exited:-15"
        if epoch == self.process.epoch and name in self.process.stops:
            self.process.stops[name] = ("taken", self.now)

    def acked(self, epoch: int, generation: int, request_id: int, at_step: int) -> None:
        p = self.process
        if epoch != p.epoch or p.checkpoint is None or p.checkpoint.request_id != request_id:
            return  # the ranks' answers went to a controller that is gone
        acks = dict(p.checkpoint.acks)
        for rank in ranktable.rows(self.job):
            if rank.rank not in self.hung and rank.rank not in self.done and self._running(rank):
                acks[rank.rank] = at_step
        p.checkpoint = lifecycle.CheckpointView(request_id, acks, len(self.in_memory & set(acks)))

    def _running(self, rank) -> bool:
        node = self.nodes[rank.node]
        return not node.down and node.ranks.get((rank.generation, rank.rank)) == "running"

    def report(self) -> None:
        """trainlib's reports: running ranks step on (all wait for a hung one: a synchronous job)."""
        job, p = self.job, self.process
        if job.state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_CHECKPOINTING):
            quorum = lifecycle.quorum(job)[0]  # the ranks that step together (replica groups: those in the quorum)
            live = [r for r in quorum if self._running(r)]
            stuck = any(r.rank in self.hung for r in quorum)
            step_s = STEP_S * self.pace_factor * (1.5 if any(r.node in self.slow for r in live) else 1.0)
            for rank in live:
                if rank.rank in self.hung:
                    continue
                track = p.tracks.setdefault(rank.rank, RankTrack(last_advance=self.now, last_report=self.now))
                steps = 0 if stuck or self.done else int(REPORT_S / STEP_S)
                self.step_of[rank.rank] = self.step_of.get(rank.rank, 0) + steps
                compute = [STEP_S * (1.5 if rank.node in self.slow else 1.0)] * steps
                track.observe(self.step_of[rank.rank], step_s if steps else 0.0, compute, self.now, steps,
                              finished=rank.rank in self.done)
        self.at(self.now + REPORT_S, self.report)

    def controller_restart(self) -> None:
        self.process = Process(epoch=self.process.epoch + 1)
        self.events.append(("test.restart", f"controller restarted in {table.state_name(self.job.state)}"))


def running(sim: Sim) -> bool:
    return sim.job.state == pb.JOB_STATE_RUNNING


def start(sim: Sim) -> None:
    sim.run_until(lambda: running(sim) and sim.process.tracks and min(sim.step_of.values(), default=0) > 20)


INCIDENTS = {
    # kind: (what happens to node b, whether it is taken out, predictable)
    "node-lost": True, "gpu-failed": True, "crash": False, "hang": True, "gpu-failing": True, "straggler": True,
}


def inject(sim: Sim, kind: str) -> None:
    b = sim.nodes["b"]
    first_b = next(r.rank for r in ranktable.rows(sim.job) if r.node == "b")
    if kind == "node-lost":
        b.down = True
    elif kind == "gpu-failed":
        b.health, b.reason = FAILED, "GPU 1: XID 79"
    elif kind == "gpu-failing":
        b.health, b.reason = FAILING, "GPU 1: row remap pending"
    elif kind == "crash":
        b.ranks[(sim.job.generation, first_b)] = "exited:3"
    elif kind == "hang":
        sim.hung.add(first_b)
    elif kind == "straggler":
        sim.slow.add("b")


RESTART_AT = [None, "CHECKPOINTING", "EVICTING", "RENDEZVOUS", "RESTARTING"]


@pytest.mark.parametrize("restart_at", RESTART_AT, ids=lambda s: f"restart-in-{s}" if s else "no-restart")
@pytest.mark.parametrize("kind", list(INCIDENTS))
def test_every_incident_recovers_with_a_controller_restart_in_any_state(kind, restart_at):
    sim = Sim()
    start(sim)
    before, seen = sim.job.generation, len(sim.states)
    if restart_at == "RENDEZVOUS":  # right after the commit: a replacement leaves RENDEZVOUS at once (no backoff)
        sim.on_commit[restart_at] = sim.controller_restart
    elif restart_at is not None:
        sim.on_state[restart_at] = sim.controller_restart
    inject(sim, kind)
    sim.run_until(lambda: running(sim) and sim.job.generation > before)
    job = sim.job
    kinds = [k for k, _ in sim.events]
    assert sim.incidents[0] == kind, sim.events
    if restart_at in ("RESTARTING",):  # the launch the dead controller sent is lost with it: a second recovery
        assert sim.incidents[1:] == ["crash"] and "interrupted by a controller restart" in job.incident
    else:
        assert sim.incidents == [kind] and job.incident_kind == kind
    assert sim.launched == sorted(set(sim.launched)), f"a generation launched twice: {sim.launched}"
    if INCIDENTS[kind]:
        assert "b" not in job.nodes and "b" in job.evicted and sim.nodes["b"].drained, sim.events
        assert job.nodes == ["a", "c"]  # the good node keeps its place; the spare takes b's
    else:
        assert list(job.nodes) == ["a", "b"]  # a crash restarts in place
    predictable = kind in ("gpu-failing", "straggler")
    if predictable and restart_at != "CHECKPOINTING":
        assert "job.checkpointed" in kinds, sim.events
        assert sim.states[seen:seen + 2] == ["CHECKPOINTING", "EVICTING"]
    if restart_at == "CHECKPOINTING" and predictable:
        assert any("abandoned" in m for k, m in sim.events if k == "job.evicting"), sim.events
    if restart_at in sim.states[seen:]:
        assert "test.restart" in kinds, f"the controller was never restarted in {restart_at}: {sim.states}"
    if kind == "hang":
        first = next(m for k, m in sim.events if k == "job.incident")
        assert "trainlib is silent too (on b)" in first, first
    # nothing of an older generation runs anywhere the controller can reach
    for node in sim.nodes.values():
        if not node.down:
            assert all(g == job.generation for (g, _), s in node.ranks.items() if s == "running"), node


def test_a_hang_names_the_rank_the_flight_recorder_singles_out():
    sim = Sim()
    start(sim)
    sim.hung.add(2)
    sim.run_until(lambda: sim.job.state != pb.JOB_STATE_RUNNING or sim.now > START + 200, limit_s=400)
    sim.job.state = pb.JOB_STATE_RUNNING  # replay the decision with the dumps in view
    # ranks 0, 1, 3 entered collective 41 and wait in it; rank 2 finished 40 and never entered 41
    nccl = {r: pb.NcclRankState(job="job-1", rank=r, process_group="0", last_started_seq=41 if r != 2 else 40,
                                last_completed_seq=40, last_op="nccl:all_reduce",
                                last_state="started" if r != 2 else "completed") for r in range(4)}
    view = sim.view()
    view = lifecycle.JobView(**{**view.__dict__, "nccl": nccl})
    [commit] = lifecycle.step(sim.job, view, sim.now + 60, POLICY)
    assert commit.job.culprit.rank == 2 and commit.job.culprit.node == "b"
    assert commit.job.culprit.seq == 40 and commit.job.culprit.peers_seq == 41
    assert "rank 2 on b is stuck at collective 40 (nccl:all_reduce, completed, process group 0) while its peers " \
           "reached 41" in commit.message
    assert list(commit.job.incident_nodes) == ["b"]


def test_a_spare_used_by_a_restart_is_replaced_by_a_free_node_so_the_next_fault_finds_one_too():
    sim = Sim(nodes=("a", "b", "c", "d"))
    start(sim)
    assert list(sim.job.nodes) == ["a", "b"] and list(sim.job.spares) == ["c"]
    sim.nodes["b"].health, sim.nodes["b"].reason = FAILED, "GPU 1: XID 79"
    sim.run_until(lambda: running(sim) and list(sim.job.spares) == ["d"])
    assert list(sim.job.nodes) == ["a", "c"]
    assert any(k == "job.spares" and "d now held as spare (1 of 1)" in m for k, m in sim.events), sim.events
    generation = sim.job.generation
    sim.nodes["a"].down = True  # the next fault: the new spare takes a's place at once
    sim.run_until(lambda: running(sim) and sim.job.generation > generation)
    assert list(sim.job.nodes) == ["d", "c"] and not any("new placement" in m for _, m in sim.events)


def test_a_node_of_the_incident_undrained_while_the_job_waits_is_taken_when_nothing_else_will_do():
    """Found by `phalanx simulate --replay`: a job with no spare left waited for ever for a node other than the one
    it evicted, though that one was repaired and undrained meanwhile."""
    sim = Sim(nodes=("a", "b"), spares=0)
    start(sim)
    generation = sim.job.generation
    sim.nodes["b"].health, sim.nodes["b"].reason = FAILED, "GPU 1: XID 79"
    sim.run_until(lambda: "waiting for nodes" in sim.job.reason)
    assert sim.nodes["b"].drained and sim.job.state == pb.JOB_STATE_RENDEZVOUS
    sim.run_for(30)
    assert sim.job.state == pb.JOB_STATE_RENDEZVOUS  # b is still drained: nothing to run on
    b = sim.nodes["b"]
    b.health, b.reason, b.drained = HEALTHY, "", False  # repaired; `phalanx undrain b`
    sim.run_until(lambda: running(sim) and sim.job.generation > generation)
    assert list(sim.job.nodes) == ["a", "b"]


def test_a_node_of_the_incident_is_passed_over_while_another_will_do():
    sim = Sim(nodes=("a", "b", "c"), spares=0)
    start(sim)
    generation = sim.job.generation
    sim.nodes["b"].health, sim.nodes["b"].reason = FAILED, "GPU 1: XID 79"
    sim.on_state["RENDEZVOUS"] = lambda: (setattr(sim.nodes["b"], "health", HEALTHY),
                                          setattr(sim.nodes["b"], "drained", False))  # back at once: still avoided
    sim.run_until(lambda: running(sim) and sim.job.generation > generation)
    assert sorted(sim.job.nodes) == ["a", "c"]


@pytest.mark.parametrize("kind, waits", [("crash", True), ("gpu-failed", False), ("node-lost", False),
                                         ("crash-then-node-lost", False)])
def test_a_restart_in_place_backs_off_and_one_that_replaces_a_bad_node_does_not(kind, waits):
    """The backoff keeps a job failing by itself from spinning; a replacement is bounded by the drains it makes,
    and waiting would only lengthen every node loss. A node lost is often seen first as its peer's crash (a
    collective fails before the node is declared DOWN): the restart then replaces it, and does not wait."""
    sim = Sim()
    start(sim)
    entered: dict[str, float] = {}
    for state in ("RENDEZVOUS", "RESTARTING"):
        sim.on_commit[state] = lambda state=state: entered.setdefault(state, sim.now)
    generation = sim.job.generation
    if kind == "crash-then-node-lost":
        inject(sim, "crash")
        sim.on_commit["EVICTING"] = lambda: setattr(sim.nodes["b"], "down", True)
    else:
        inject(sim, kind)
    sim.run_until(lambda: running(sim) and sim.job.generation > generation)
    waited = entered["RESTARTING"] - entered["RENDEZVOUS"]
    if waits:
        assert waited >= POLICY.recovery.restart_backoff_s, (waited, sim.events)
        assert sim.job.restarts_in_row == 1  # and counts toward max_restarts
    else:
        assert waited == 0.0 and "b" not in sim.job.nodes, (waited, sim.events)
        assert sim.job.restarts_in_row == 0, sim.events  # a replacement: not counted toward max_restarts
        assert "replacing b: not counted toward max_restarts" in next(m for k, m in sim.events
                                                                      if k == "job.restarting"), sim.events


def test_a_job_gives_up_after_max_restarts_with_the_reason():
    sim = Sim(policy=lifecycle.Policy(RecoveryConfig(max_restarts=1, restart_backoff_s=1.0), JobsConfig()))
    start(sim)
    for _ in range(2):
        generation = sim.job.generation
        first = next(r.rank for r in ranktable.rows(sim.job) if r.node == "a")
        sim.nodes["a"].ranks[(generation, first)] = "exited:7"
        sim.run_until(lambda g=generation: (sim.job.generation > g and running(sim)) or
                      sim.job.state == pb.JOB_STATE_FAILED)
        if sim.job.state != pb.JOB_STATE_FAILED:
            start(sim)
    assert sim.job.state == pb.JOB_STATE_FAILED and sim.job.exit_code == 7
    assert sim.job.reason.startswith("gave up after 1 restarts: rank 0 on a exited with code 7")


def test_restarts_count_from_zero_again_once_the_job_ran_for_the_restart_window():
    """A months-long job outlives many faults: only restarts in a row (less than restart_window_s of running
    between them) count toward max_restarts and the backoff."""
    sim = Sim(policy=lifecycle.Policy(RecoveryConfig(max_restarts=1, restart_backoff_s=1.0, restart_window_s=60.0),
                                      JobsConfig()))
    start(sim)
    for crash in range(3):
        generation = sim.job.generation
        first = next(r.rank for r in ranktable.rows(sim.job) if r.node == "a")
        sim.run_for(61.0)  # a minute of training past the window since the last (re)start
        sim.nodes["a"].ranks[(generation, first)] = "exited:7"
        sim.run_until(lambda g=generation: (sim.job.generation > g and running(sim)) or
                      sim.job.state == pb.JOB_STATE_FAILED)
        assert sim.job.state == pb.JOB_STATE_RUNNING, f"crash {crash}: {sim.describe()}"
        assert sim.job.restarts == crash + 1 and sim.job.restarts_in_row == 1
        start(sim)
    first = next(r.rank for r in ranktable.rows(sim.job) if r.node == "a")
    sim.nodes["a"].ranks[(sim.job.generation, first)] = "exited:7"  # a crash soon after the restart: in a row
    sim.run_until(lambda: sim.job.state == pb.JOB_STATE_FAILED)
    assert sim.job.reason.startswith("gave up after 1 restarts")


def test_a_fatal_rank_fails_the_job_at_once():
    sim = Sim()
    start(sim)
    view = sim.view()
    view = lifecycle.JobView(**{**view.__dict__, "fatal": {1: "checkpoint directory /x is not shared"}})
    actions = lifecycle.step(sim.job, view, sim.now, POLICY)
    assert actions[0].job.state == pb.JOB_STATE_FAILED
    assert "stopped for good: checkpoint directory /x is not shared" in actions[0].job.reason
    assert {n for a in actions[1:] for n in a.nodes} == {"a", "b"}


def test_a_job_waits_for_nodes_and_a_launch_that_fails_at_start_fails_it():
    sim = Sim(nodes=("a", "b"), spares=0)
    sim.nodes["b"].down = True
    sim.run_for(30)  # b is down: placement waits, and says why once
    assert sim.job.state == pb.JOB_STATE_PENDING and "needs 2 nodes" in sim.job.reason
    assert [k for k, _ in sim.events] == ["job.pending"]
    sim.nodes["b"].down = False
    sim.on_state["STARTING"] = lambda: setattr(sim.nodes["b"], "down", True)  # b dies while the launch is on its way
    sim.run_until(lambda: sim.job.state in table.TERMINAL)
    assert sim.job.state == pb.JOB_STATE_FAILED and sim.job.reason.startswith("launch failed")


STATES_TO_CANCEL = ["STARTING", "RUNNING", "CHECKPOINTING", "EVICTING", "RENDEZVOUS", "RESTARTING"]


@pytest.mark.parametrize("state", STATES_TO_CANCEL)
def test_a_cancel_in_any_state_stops_every_rank_and_ends_cancelled(state):
    sim = Sim()

    def cancel():
        for action in lifecycle.cancel(sim.job, sim.now):
            sim.apply([action])

    if state == "STARTING":
        sim.on_state["STARTING"] = cancel
    else:
        start(sim)
        if state == "RUNNING":
            sim.at(sim.now + 0.01, cancel)
        else:
            sim.on_state[state] = cancel
            inject(sim, "gpu-failing")
    sim.run_until(lambda: sim.job.state in table.TERMINAL)
    assert sim.job.state == pb.JOB_STATE_CANCELLED, sim.events
    sim.run_for(2)  # the stops land
    for node in sim.nodes.values():
        assert not any(s == "running" for s in node.ranks.values()), (state, node)


def test_every_transition_outside_the_table_is_refused_with_both_states():
    job = pb.Job(id="job-9", state=pb.JOB_STATE_RUNNING)
    with pytest.raises(IllegalTransition, match=r"job job-9.*RUNNING.*RENDEZVOUS"):
        lifecycle.moved(job, pb.JOB_STATE_RENDEZVOUS, "skip", START)
    for source, targets in table.TRANSITIONS.items():
        for target in table.TRANSITIONS:
            if target not in targets:
                with pytest.raises(IllegalTransition):
                    table.check("j", source, target)
    with pytest.raises(IllegalTransition, match=r"rank 3.*EXITED.*RUNNING"):
        table.check_rank("j", 3, pb.RANK_STATE_EXITED, pb.RANK_STATE_RUNNING)


def test_the_flight_recorder_names_no_culprit_when_the_dumps_agree_or_are_too_few():
    from controller.recovery.detectors import nccl_culprit

    def state(rank, started, completed, group="0"):
        return pb.NcclRankState(rank=rank, process_group=group, last_started_seq=started, last_completed_seq=completed,
                                last_op="nccl:all_reduce", last_state="started")

    nodes = {0: "a", 1: "b", 2: "c"}
    assert nccl_culprit({0: state(0, 9, 8), 1: state(1, 9, 8)}, nodes) is None  # all wait in 9 together
    assert nccl_culprit({0: state(0, 9, 8)}, nodes) is None
    assert nccl_culprit({}, nodes) is None
    # everyone entered 9, rank 1 alone did not finish it
    culprit = nccl_culprit({0: state(0, 9, 9), 1: state(1, 9, 8), 2: state(2, 9, 9)}, nodes)
    assert (culprit.rank, culprit.node, culprit.seq, culprit.peers_seq) == (1, "b", 9, 9)
    # two groups: the one where a rank is furthest behind wins
    culprit = nccl_culprit({0: state(0, 9, 8, "0"), 1: state(1, 8, 8, "0"), 2: state(2, 30, 29, "1"),
                            3: state(3, 20, 20, "1")}, {**nodes, 3: "d"})
    assert (culprit.rank, culprit.process_group, culprit.seq, culprit.peers_seq) == (3, "1", 20, 30)


def test_a_checkpoint_some_ranks_never_commit_is_given_up_at_its_deadline_in_virtual_time():
    sim = Sim()
    start(sim)
    before = sim.job.generation
    inject(sim, "gpu-failing")
    sim.hung.add(0)  # rank 0 stops stepping as the request goes out: it never commits
    sim.on_state["EVICTING"] = lambda: sim.hung.clear()
    sim.run_until(lambda: running(sim) and sim.job.generation > before)
    notes = [m for k, m in sim.events if k == "job.evicting"]
    assert notes and "checkpoint incomplete (only 3 of 4 ranks committed checkpoint 1 within 30s)" in notes[0]
    asked = next(i for i, (k, _) in enumerate(sim.events) if k == "job.checkpoint")
    assert "job.checkpointed" not in [k for k, _ in sim.events[asked:]]
    assert sim.job.phase_times and dict((p.phase, p.seconds) for p in sim.job.phase_times)["CHECKPOINTING"] >= 30


@pytest.mark.parametrize("in_memory, said", [({0, 1, 2, 3}, "in host memory, each with a replica on another node"),
                                              ({1}, "1 of 4 in host memory, the others durably"),
                                              (set(), "durably")])
def test_the_checkpoint_before_an_eviction_says_how_the_ranks_committed_it(in_memory, said):
    sim = Sim()
    start(sim)
    sim.in_memory = in_memory
    inject(sim, "gpu-failing")
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    committed = [m for k, m in sim.events if k == "job.checkpointed"]
    assert len(committed) == 1 and f" {said} (" in committed[0], committed


def test_a_second_predictable_incident_soon_after_the_first_asks_for_a_new_checkpoint():
    """The first request's deadline (30 s) has not passed when the next generation's incident comes: its
    checkpoint must still be asked for afresh, not taken for one a dead controller left in flight."""
    sim = Sim(nodes=("a", "b", "c", "d"))
    start(sim)
    inject(sim, "gpu-failing")
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    assert sim.now - START < 30
    sim.slow.add("c")
    sim.run_until(lambda: running(sim) and sim.job.generation == 3)
    kinds = [k for k, _ in sim.events]
    assert kinds.count("job.checkpointed") == 2, sim.events
    assert not any("abandoned" in m for _, m in sim.events)
    assert sim.job.checkpoint.id == 2 and sim.job.checkpoint.generation == 2


def straggler_policy(**changes) -> lifecycle.Policy:
    return lifecycle.Policy(RecoveryConfig(**{"max_restarts": 10, "restart_backoff_s": 1.0, **changes}),
                            JobsConfig(stop_grace_s=5.0))


def held_events(sim: Sim) -> list[str]:
    return [m for k, m in sim.events if k == "job.straggler_held"]


def test_straggler_evictions_are_bounded_per_window_and_the_bound_says_so_once():
    sim = Sim(nodes=("a", "b", "c", "d"), policy=straggler_policy(straggler_max_evictions=1))
    start(sim)
    inject(sim, "straggler")
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    sim.run_for(20)  # the eviction paid off: the job runs at full speed again
    sim.slow.add("c")  # a second straggler, within the hour
    sim.run_for(120)
    assert sim.job.generation == 2 and running(sim), sim.describe()
    [held] = held_events(sim)
    assert "straggler verdict held back: rank" in held and "1 straggler evictions in the last 3600s already" in held
    assert sim.incidents == ["straggler"]
    sim.run_for(3600)  # the window passes: the verdict is acted on
    assert sim.incidents == ["straggler", "straggler"] and sim.job.generation == 3
    assert len(held_events(sim)) == 1


def test_a_straggler_eviction_that_did_not_speed_the_job_up_holds_the_next_verdict():
    sim = Sim(nodes=("a", "b", "c", "d"), policy=straggler_policy())
    start(sim)
    inject(sim, "straggler")
    sim.pace_factor = 1.5  # the job was slow for another reason: evicting b will not help
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    assert sim.job.straggler_step_s == pytest.approx(STEP_S * 1.5 * 1.5)
    sim.slow.add("c")  # with the job's own slowness: 2.25x, as before the eviction
    sim.run_for(120)
    assert sim.job.generation == 2, sim.describe()
    [held] = held_events(sim)
    assert "the last straggler eviction did not make the job faster" in held


def test_a_straggler_is_not_evicted_while_nothing_could_replace_its_node():
    """The job's one spare went to a failed GPU's node; then a rank is slow. Evicting its node would leave the
    job waiting for nodes (a slow job trains; a stopped one does not): the verdict is held, said once, until a
    free node could take the straggler's place."""
    sim = Sim(policy=straggler_policy())  # a, b and c: two to train on, one spare
    start(sim)
    inject(sim, "gpu-failed")
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    assert not sim.job.spares and sim.nodes["b"].drained
    sim.slow.add("c")
    sim.run_for(120)
    assert sim.job.generation == 2 and running(sim), sim.describe()
    assert sim.incidents == ["gpu-failed"]
    [held] = held_events(sim)
    assert "straggler verdict held back: rank" in held and "no spare and no free node to replace it" in held
    b = sim.nodes["b"]
    b.drained, b.health, b.reason = False, HEALTHY, ""  # repaired and undrained: now b can take c's place
    sim.run_until(lambda: running(sim) and sim.job.generation == 3)
    assert sim.incidents == ["gpu-failed", "straggler"] and "c" not in sim.job.nodes
    assert len(held_events(sim)) == 1


def test_no_hang_is_blamed_while_a_node_of_the_job_is_quiet():
    """An agent that stops (SIGSTOP, a partition) takes its ranks' progress with it: their steps look
    stalled before liveness can call the node DOWN. The hang verdict waits; the node-lost one follows."""
    from controller.recovery.detectors import detect

    t = {r: RankTrack(last_advance=0.0, last_report=0.0) for r in range(2)}
    for step in range(20):
        for track in t.values():
            track.observe(step, 0.1, [0.08], step * 0.1)
    ranks = [pb.RankInfo(rank=r, node="b", state=pb.RANK_STATE_RUNNING) for r in range(2)]
    quiet = {"b": NodeView("b", False, HEALTHY, "", quiet=True)}
    assert detect(ranks, quiet, t, 10.0, POLICY.recovery) is None
    heard = {"b": NodeView("b", False, HEALTHY, "")}
    assert detect(ranks, heard, t, 10.0, POLICY.recovery).kind == "hang"
    down = {"b": NodeView("b", True, HEALTHY, "", quiet=True)}
    assert detect(ranks, down, t, 10.0, POLICY.recovery).kind == "node-lost"


def test_a_stopped_rank_is_named_even_when_a_waiting_peer_crosses_the_hang_limit_first():
    """Progress reaches the controller folded into each node's heartbeat: the stopped rank's last step can
    arrive a heartbeat after its peers', so a waiting peer crosses the hang limit first. The verdict still
    names the silent rank's node (a CI run restarted in place instead, and the hang came back)."""
    from controller.recovery.detectors import detect

    t = {r: RankTrack(last_advance=0.0, last_report=0.0) for r in range(4)}
    for step in range(40):
        for rank, track in t.items():
            track.observe(step, 0.1, [0.08], step * 0.1 + (0.9 if rank >= 2 else 0.0))
    now = 3.9 + POLICY.recovery.hang_min_s + 0.1  # past the limit for node a's ranks, not yet for rank 2 or 3
    for rank in (0, 1, 3):  # rank 2 is stopped; the others wait in the collective and report no new step
        t[rank].observe(39, 0.0, [], now - 0.3, steps=0)
    ranks = [pb.RankInfo(rank=r, node="a" if r < 2 else "b", state=pb.RANK_STATE_RUNNING) for r in range(4)]
    nodes = {n: NodeView(n, False, HEALTHY, "") for n in "ab"}
    incident = detect(ranks, nodes, t, now, POLICY.recovery)
    assert incident.kind == "hang" and incident.reason.startswith("rank 0 made no progress"), incident
    assert incident.nodes == ("b",), incident
    assert "trainlib is silent too (on b): rank 2 for" in incident.reason, incident


def test_a_rank_is_silent_only_if_its_agent_was_heard_from_since_its_last_report():
    """A node whose heartbeat is late (not yet quiet) brings its ranks' reports late too: they are not silent for
    it. The rank whose agent kept being heard while it said nothing is."""
    from controller.recovery.detectors import detect

    t = {r: RankTrack(last_advance=0.0, last_report=0.0) for r in range(2)}
    for step in range(40):
        for track in t.values():
            track.observe(step, 0.1, [0.08], step * 0.1)
    now = 3.9 + POLICY.recovery.hang_min_s + 0.1
    t[0].observe(39, 0.0, [], now - 2.5, steps=0)  # node a's last heartbeat (and rank 0's report) 2.5 s ago
    t[1].observe(39, 0.0, [], now - 2.5, steps=0)  # rank 1 reported then too, and not since
    ranks = [pb.RankInfo(rank=0, node="a", state=pb.RANK_STATE_RUNNING),
             pb.RankInfo(rank=1, node="b", state=pb.RANK_STATE_RUNNING)]
    nodes = {"a": NodeView("a", False, HEALTHY, "", heard_at=now - 2.5),  # late: nothing new could arrive
             "b": NodeView("b", False, HEALTHY, "", heard_at=now - 0.2)}  # heard since: rank 1 said nothing
    incident = detect(ranks, nodes, t, now, POLICY.recovery)
    assert incident.kind == "hang" and incident.nodes == ("b",), incident


def test_a_hang_found_before_its_culprits_silence_can_show_waits_for_that_nodes_next_heartbeat():
    """hang_min_s and silent_s are both 2 s: the waiting peers cross the hang limit while the stopped rank's node
    has not yet been heard from silent_s after the rank's last report. Judged then, no rank is silent and the job
    restarts in place, keeping the stopped rank's node (seen trying `phalanx inject ... hang` by hand). The
    verdict waits for that heartbeat, which names the culprit."""
    from controller.recovery.detectors import detect

    cfg = dataclasses.replace(POLICY.recovery, hang_min_s=2.0, silent_s=2.0)  # the defaults
    t = {r: RankTrack(last_advance=0.0, last_report=0.0) for r in range(2)}
    for step in range(40):
        for track in t.values():
            track.observe(step, 0.1, [0.08], step * 0.1)
    stopped_at = 3.9 + 0.4  # rank 1's last report, a report interval after its last step
    t[1].observe(39, 0.0, [], stopped_at, steps=0)
    now = 3.9 + cfg.hang_min_s + 0.1  # the peers are past the hang limit
    t[0].observe(39, 0.0, [], now - 0.2, steps=0)  # rank 0 waits in the collective and keeps reporting
    ranks = [pb.RankInfo(rank=0, node="a", state=pb.RANK_STATE_RUNNING),
             pb.RankInfo(rank=1, node="b", state=pb.RANK_STATE_RUNNING)]
    nodes = {"a": NodeView("a", False, HEALTHY, "", heard_at=now - 0.2),
             "b": NodeView("b", False, HEALTHY, "", heard_at=now - 0.2)}  # not yet silent_s after its last report
    assert detect(ranks, nodes, t, now, cfg) is None
    later = stopped_at + cfg.silent_s + 0.1
    nodes["b"] = NodeView("b", False, HEALTHY, "", heard_at=later)  # its next heartbeat: still nothing from rank 1
    t[0].observe(39, 0.0, [], later, steps=0)
    incident = detect(ranks, nodes, t, later, cfg)
    assert incident.kind == "hang" and incident.nodes == ("b",), incident
    # A whole job stuck with every trainlib reporting is not held: neither a heartbeat that came a little after its
    # rank's last report (heartbeats faster than trainlib's 0.5 s reports), nor a node heard at no known time.
    t[1].observe(39, 0.0, [], later - 0.3, steps=0)
    assert detect(ranks, nodes, t, later, cfg).reason.endswith("none is silent: restart in place")
    t[1].observe(39, 0.0, [], later - 1.5, steps=0)
    nodes["b"] = NodeView("b", False, HEALTHY, "")  # heard_at 0: unknown
    assert detect(ranks, nodes, t, later, cfg).reason.endswith("none is silent: restart in place")


def allocation_sim(**kw) -> Sim:
    """A job bound to a Slurm allocation of nodes a, b, c (spec.within), as `phalanx run` submits it."""
    sim = Sim(**kw)
    sim.job.spec.within.extend(sim.nodes)
    sim.job.spec.slurm_job_id = "17"
    return sim


def test_a_job_in_an_allocation_waits_for_a_disconnected_node_but_ends_when_too_few_usable_nodes_are_left():
    sim = allocation_sim(nodes=("a", "b"), spares=0)
    sim.nodes["b"].drained = True  # will not come back by itself: the allocation cannot run the job
    sim.run_for(5)
    assert sim.job.state == pb.JOB_STATE_FAILED
    assert sim.job.reason.startswith("no healthy node left to run on in Slurm job 17's allocation: 1 of its 2 nodes "
                                     "usable, 2 needed (b down, drained"), sim.job.reason

    sim = allocation_sim(nodes=("a", "b", "c"), spares=1)
    start(sim)
    victim = sim.job.nodes[1]
    sim.nodes[victim].health, sim.nodes[victim].reason = FAILED, "GPU 0: XID 79"
    sim.nodes[victim].drained = True
    spare = sim.job.spares[0]
    sim.run_until(lambda: sim.job.state == pb.JOB_STATE_RUNNING and sim.job.generation == 2)
    assert spare in sim.job.nodes  # the allocation's spare took its place
    other = next(n for n in sim.job.nodes if n != spare)
    sim.nodes[other].health, sim.nodes[other].reason = FAILED, "GPU 1: XID 79"
    sim.nodes[other].drained = True
    sim.run_until(lambda: sim.job.state in table.TERMINAL)
    assert sim.job.state == pb.JOB_STATE_FAILED and sim.job.reason.startswith(
        f"no healthy node left to replace {other} in Slurm job 17's allocation: 1 of its 3 nodes usable"), \
        sim.job.reason


# -- the end of a job (issue 40): training that ended is never a hang, and no false verdict cascades -------------

def exit_ranks(sim: Sim, codes: dict[int, int]) -> None:
    for rank in ranktable.rows(sim.job):
        if rank.rank in codes:
            sim.nodes[rank.node].ranks[(sim.job.generation, rank.rank)] = f"exited:{codes[rank.rank]}"


def test_ranks_that_ended_training_are_never_hung_and_the_job_succeeds_when_they_exit():
    sim = Sim()
    start(sim)
    sim.done = {r.rank for r in ranktable.rows(sim.job)}  # the loop is over: barrier, a final save, the teardown
    sim.run_for(60.0)  # twelve times hang_min_s without a step
    assert running(sim) and not sim.incidents, sim.events
    assert [k for k, _ in sim.events].count("job.ending") == 1, sim.events
    exit_ranks(sim, {r.rank: 0 for r in ranktable.rows(sim.job)})
    sim.run_until(lambda: sim.job.state == pb.JOB_STATE_SUCCEEDED)
    assert sim.launched == [1] and not any(n.drained for n in sim.nodes.values())


def test_one_rank_exiting_0_ends_the_hang_rule_for_the_ranks_still_saving_the_final_model():
    sim = Sim()
    start(sim)
    sim.done = {0}  # rank 0 writes the final model (no trainlib.finish); the others are done and exit
    exit_ranks(sim, {1: 0, 2: 0, 3: 0})
    sim.done = {1, 2, 3}
    sim.run_for(60.0)
    assert running(sim) and not sim.incidents, sim.events
    exit_ranks(sim, {0: 0})
    sim.run_until(lambda: sim.job.state == pb.JOB_STATE_SUCCEEDED)


def test_a_rank_that_finished_but_does_not_exit_is_stopped_after_the_grace_and_no_node_is_blamed():
    policy = lifecycle.Policy(dataclasses.replace(POLICY.recovery, exit_grace_s=30.0), POLICY.jobs)
    sim = Sim(policy=policy)
    start(sim)
    sim.done = {r.rank for r in ranktable.rows(sim.job)}
    exit_ranks(sim, {0: 0, 1: 0, 2: 0})  # rank 3 hangs in its teardown (an NCCL communicator's destroy)
    began = sim.now
    sim.run_until(lambda: sim.job.state in table.TERMINAL, limit_s=120)
    assert sim.job.state == pb.JOB_STATE_SUCCEEDED, sim.describe()
    assert sim.now - began == pytest.approx(30.0, abs=1.0)
    slow = [m for k, m in sim.events if k == "job.slow_exit"]
    assert slow and "rank 3" in slow[0] and "no node is blamed" in slow[0], sim.events
    assert not any(n.drained for n in sim.nodes.values()) and sim.launched == [1] and not sim.incidents
    sim.run_for(1.0)
    assert sim.nodes["b"].ranks[(1, 3)] == "exited:-15"  # stopped


def test_a_rank_that_never_finishes_after_the_others_did_fails_the_job_after_the_grace():
    policy = lifecycle.Policy(dataclasses.replace(POLICY.recovery, exit_grace_s=30.0), POLICY.jobs)
    sim = Sim(policy=policy)
    start(sim)
    sim.done = {1, 2, 3}
    exit_ranks(sim, {1: 0, 2: 0, 3: 0})  # rank 0 reports on but never finishes
    sim.run_until(lambda: sim.job.state in table.TERMINAL, limit_s=120)
    assert sim.job.state == pb.JOB_STATE_FAILED and "rank 0 had not finished training 30s after" in sim.job.reason
    assert not any(n.drained for n in sim.nodes.values()) and not sim.incidents


def test_a_signal_in_the_teardown_after_training_ended_is_not_a_crash():
    sim = Sim()
    start(sim)
    sim.done = {r.rank for r in ranktable.rows(sim.job)}
    sim.run_for(1.0)
    exit_ranks(sim, {0: 0, 1: -6, 2: 0, 3: 0})  # "terminate called without an active exception"
    sim.run_until(lambda: sim.job.state in table.TERMINAL)
    assert sim.job.state == pb.JOB_STATE_SUCCEEDED and sim.launched == [1], sim.events
    assert any(k == "job.teardown_failed" and "rank 1" in m for k, m in sim.events), sim.events


def test_a_script_that_fails_after_training_ended_fails_the_job_without_a_restart():
    sim = Sim()
    start(sim)
    sim.done = {r.rank for r in ranktable.rows(sim.job)}
    sim.run_for(1.0)
    exit_ranks(sim, {0: 1, 1: 0, 2: 0, 3: 0})  # rank 0's final save raised
    sim.run_until(lambda: sim.job.state in table.TERMINAL)
    assert sim.job.state == pb.JOB_STATE_FAILED and sim.launched == [1], sim.events
    assert "exited with code 1 after its training ended" in sim.job.reason


def test_a_step_after_the_end_means_training_goes_on():
    sim = Sim()
    start(sim)
    sim.done = {r.rank for r in ranktable.rows(sim.job)}
    sim.run_for(3.0)
    sim.done = set()  # a script that destroyed its process group and made a new one
    sim.run_for(3.0)
    assert sim.job.ending_since_unix_ns == 0 and "job.training" in [k for k, _ in sim.events]
    sim.hung.add(1)
    sim.run_until(lambda: sim.incidents)
    assert sim.incidents == ["hang"]


def test_every_rank_silent_at_once_names_no_culprit_and_drains_no_node():
    sim = Sim()
    start(sim)
    sim.hung = {r.rank for r in ranktable.rows(sim.job)}  # e.g. the job's own storage stalls every rank at once
    sim.run_until(lambda: sim.incidents)
    incident = next(m for k, m in sim.events if k == "job.incident")
    assert "every rank's trainlib fell silent at once" in incident, incident
    sim.hung = set()
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    assert list(sim.job.nodes) == ["a", "b"] and not any(n.drained for n in sim.nodes.values())


def test_the_same_hang_at_the_same_step_in_the_next_generation_ends_the_job_instead_of_evicting_again():
    sim = Sim(nodes=("a", "b", "c", "d"), spares=2)
    start(sim)
    first_b = next(r.rank for r in ranktable.rows(sim.job) if r.node == "b")
    sim.hung.add(first_b)
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    step = sim.job.incident_step
    assert step > 0 and sim.nodes["b"].drained
    sim.hung = set()
    # the next generation resumes just before that step and stops at it again, on another rank (node a's)
    sim.step_of = {r.rank: step - int(REPORT_S / STEP_S) for r in ranktable.rows(sim.job)}
    first_a = next(r.rank for r in ranktable.rows(sim.job) if r.node == "a")
    sim.at(sim.now + REPORT_S + 0.01, sim.hung.add, first_a)
    sim.run_until(lambda: sim.job.state in table.TERMINAL)
    assert sim.job.state == pb.JOB_STATE_FAILED, sim.describe()
    assert f"hang again at step {step}, as in generation 1" in sim.job.reason, sim.job.reason
    assert not sim.nodes["a"].drained and sim.launched == [1, 2]


def test_a_job_that_ran_out_of_nodes_through_its_own_evictions_says_so_and_fails_after_the_bound():
    policy = lifecycle.Policy(dataclasses.replace(POLICY.recovery, evicted_wait_s=60.0), POLICY.jobs)
    sim = Sim(nodes=("a", "b"), spares=0, policy=policy)
    start(sim)
    sim.hung.add(next(r.rank for r in ranktable.rows(sim.job) if r.node == "b"))
    sim.run_until(lambda: sim.job.state == pb.JOB_STATE_RENDEZVOUS and "evicted" in sim.job.reason)
    assert "1 node this job evicted stay drained (b)" in sim.job.reason and "recovery.evicted_wait_s" in sim.job.reason
    began = sim.now
    sim.run_until(lambda: sim.job.state in table.TERMINAL, limit_s=100)
    assert sim.job.state == pb.JOB_STATE_FAILED and "no nodes for 60s" in sim.job.reason, sim.job.reason
    assert sim.now - began <= 61


def test_phalanx_own_work_on_a_node_draws_no_straggler_verdict_against_it_until_the_window_is_past_it():
    """Issue 40: standbys starting on a node (a Python and torch import each, beside its ranks) made healthy ranks
    look 1.4-2x slower right after restarts, and their nodes were evicted. The compute times of a window that
    overlaps such work are not held against the node; once the window is past it, a slow node is found as ever."""
    sim = Sim()
    start(sim)
    sim.nodes["b"].own_work = True
    sim.slow.add("b")  # as slow as a straggler, for as long as the work lasts
    sim.run_for(30.0)
    assert running(sim) and not sim.incidents, sim.events
    sim.nodes["b"].own_work = False  # the work is done, and b stays slow: now it is b's own
    sim.run_until(lambda: sim.incidents)
    assert sim.incidents == ["straggler"] and "on b" in sim.job.incident
    own = sim.own_work_at["b"]
    assert sim.now - own >= POLICY.recovery.straggler_window * STEP_S * 1.5, sim.now - own


def test_a_job_whose_training_ends_before_its_eviction_checkpoint_ends_instead_of_restarting():
    sim = Sim()
    start(sim)
    inject(sim, "gpu-failing")  # checkpoint first, at a step ahead...
    sim.run_until(lambda: sim.job.state == pb.JOB_STATE_CHECKPOINTING)
    sim.done = {r.rank for r in ranktable.rows(sim.job)}  # ...which the ranks never reach: their loop was at its end
    sim.run_for(5.0)
    exit_ranks(sim, {r.rank: 0 for r in ranktable.rows(sim.job) if r.rank != 3})
    sim.run_until(lambda: sim.job.state in table.TERMINAL)
    assert sim.job.state == pb.JOB_STATE_SUCCEEDED and sim.launched == [1], sim.events


def test_ranks_that_exit_1_on_their_way_out_of_a_failed_collective_are_a_crash_to_recover_not_an_end():
    """A script with `finally: dist.destroy_process_group()` (or `sys.exit(1)` after catching the error) whose
    collective failed when a peer died may say its training ended on the way out. While some rank has not ended
    training, its non-zero exit is a crash like any other: the job recovers, it is not failed for good."""
    sim = Sim()
    start(sim)
    sim.done = {0, 2, 3}  # rank 1 was killed; the controller has not heard of it yet
    sim.run_for(0.6)
    exit_ranks(sim, {0: 1, 2: 1, 3: 1})
    sim.run_until(lambda: running(sim) and sim.job.generation == 2)
    assert sim.incidents == ["crash"] and sim.job.state == pb.JOB_STATE_RUNNING, sim.events


def test_a_rank_whose_node_stops_telling_of_it_is_lost_by_the_step_and_stored_with_the_incident():
    """The job manager only counts the heartbeats without news of a rank (JobView.missing); `step` decides the rank
    LOST at jobs.missing_reports_lost and the crash incident's commit stores it. The record it was given is never
    changed in place (it is the stored one)."""
    sim = Sim()
    start(sim)
    limit = POLICY.jobs.missing_reports_lost
    before = pb.Job()
    before.CopyFrom(sim.job)
    view = sim.view()
    short = lifecycle.JobView(**{**view.__dict__, "missing": {1: limit - 1}})
    assert not [a for a in lifecycle.step(sim.job, short, sim.now, POLICY) if isinstance(a, lifecycle.Commit)]
    lost = lifecycle.JobView(**{**view.__dict__, "missing": {1: limit}})
    commit = lifecycle.step(sim.job, lost, sim.now, POLICY)[0]
    assert isinstance(commit, lifecycle.Commit) and commit.incident == "crash" and "rank 1" in commit.message
    assert "was lost" in commit.message
    assert [r.state for r in ranktable.rows(commit.job) if r.rank == 1] == [pb.RANK_STATE_LOST]
    assert sim.job == before  # decided on a copy


def test_a_ranks_exit_its_node_reports_is_taken_in_by_the_step_and_stored_by_the_commit_that_follows():
    """The job manager no longer writes a reported exit into the stored record: it keeps it beside (JobView.ended),
    `step` takes it in on a copy, and the commit of what follows (the crash incident) stores it. A state the rank
    table does not allow from the record's is not taken; once committed, nothing is left to take in."""
    sim = Sim()
    start(sim)
    before = pb.Job()
    before.CopyFrom(sim.job)
    view = sim.view()
    crashed = lifecycle.JobView(**{**view.__dict__, "ended": {2: (pb.RANK_STATE_EXITED, 7)}})
    commit = lifecycle.step(sim.job, crashed, sim.now, POLICY)[0]
    assert isinstance(commit, lifecycle.Commit) and commit.incident == "crash", commit
    assert "rank 2 on " in commit.message and "exited with code 7" in commit.message
    assert [(r.state, r.exit_code) for r in ranktable.rows(commit.job) if r.rank == 2] == [(pb.RANK_STATE_EXITED, 7)]
    assert sim.job == before  # decided on a copy: the stored record is the commit's to change
    assert lifecycle.ended_unsaved(commit.job, {2: (pb.RANK_STATE_EXITED, 7)}) == {}
    assert lifecycle.ended_unsaved(sim.job, {2: (pb.RANK_STATE_EXITED, 7)}) == {2: (pb.RANK_STATE_EXITED, 7)}
    # an ended rank does not run again, whatever a late report says
    back = lifecycle.ranks_ended(commit.job, {2: (pb.RANK_STATE_RUNNING, 0)})
    assert back is commit.job


def test_a_running_jobs_upkeep_is_decided_in_the_step_spares_hold_standbys_and_the_safe_step_is_pinned():
    """What the job manager did inline from heartbeats: asking spares to hold standbys (renewed), pinning the
    newest step whose snapshots are held twice over. Now `step` says it (lifecycle.upkeep), the executor sends."""
    sim = Sim()
    start(sim)
    job = sim.job
    spares, count = list(job.spares), job.spec.ranks_per_node
    assert spares
    view = lifecycle.JobView(**{**sim.view().__dict__, "prepared": {}, "snapshot_step": 40, "pinned": (0, 0),
                                "tracks": {}})  # (no progress reports: no hang verdict as time passes)
    assert lifecycle.step(job, view, sim.now, POLICY) == [*(lifecycle.Prepare(s, count) for s in spares),
                                                         lifecycle.Pin(40)]
    asked = lifecycle.JobView(**{**view.__dict__, "prepared": dict.fromkeys(spares, sim.now - 1.0),
                                 "pinned": (job.generation, 40)})
    assert lifecycle.step(job, asked, sim.now, POLICY) == []  # asked lately, pinned already
    due = lifecycle.JobView(**{**asked.__dict__, "snapshot_step": 41})
    assert lifecycle.step(job, due, sim.now + lifecycle.PREPARE_RENEW_S, POLICY) == [
        *(lifecycle.Prepare(s, count) for s in spares), lifecycle.Pin(41)]
    assert lifecycle.step(job, lifecycle.JobView(**{**view.__dict__, "prepared": None}), sim.now, POLICY) == [
        lifecycle.Pin(40)]  # a driver that keeps no standbys (the simulator)
    as_account = pb.Job()
    as_account.CopyFrom(job)
    as_account.spec.run_as = "alice"  # its standbys would run its code as the agent's user: none
    assert lifecycle.step(as_account, view, sim.now, POLICY) == [lifecycle.Pin(40)]
    cancelled = lifecycle.cancel(job, sim.now, prepared=spares)
    assert cancelled[1:] == [lifecycle.Prepare(s, 0) for s in spares]  # the standbys go with the job


def test_a_node_running_a_generation_that_is_not_current_is_fenced_once_a_repeat():
    jobs = {"job-1": pb.Job(id="job-1", state=pb.JOB_STATE_RUNNING, generation=3),
            "job-2": pb.Job(id="job-2", state=pb.JOB_STATE_FAILED, generation=1)}
    running = [("job-1", 3, 0), ("job-1", 2, 1), ("job-1", 2, 2), ("job-2", 1, 0), ("job-9", 4, 0)]
    fences = lifecycle.fences(running, jobs.get, {}, 100.0, 10.0)
    assert fences == [lifecycle.Fence("job-1", 2, (1, 2), "generation 2 is stale (current 3, RUNNING)"),
                      lifecycle.Fence("job-2", 1, (0,), "the job is FAILED"),
                      lifecycle.Fence("job-9", 4, (0,), "unknown job")]
    told = {("job-1", 2): 95.0, ("job-2", 1): 80.0}
    assert [(f.job, f.generation) for f in lifecycle.fences(running, jobs.get, told, 100.0, 10.0)] == [
        ("job-2", 1), ("job-9", 4)]


def test_spares_are_replenished_from_the_jobs_own_leaf_switches_first():
    """A job short of spares takes free nodes on a leaf switch one of its nodes is on before any other (then by name);
    a free node on no leaf switch counts as near only where some node of the job is on none either."""
    from controller.jobs.topology import ClusterTopology
    leaf = {"a1": "A", "a2": "A", "a9": "A", "b1": "B", "b2": "B", "c1": "C", "c9": "C", "y1": ""}
    job = pb.Job(id="j", spec=pb.JobSpec(nodes=2, ranks_per_node=1, spares=3), nodes=["a1", "c1"], spares=[])

    def chosen(free_leaves: dict[str, str], nodes=("a1", "c1")) -> list[str]:
        names = [*nodes, *free_leaves]
        on = {n: free_leaves.get(n) or leaf.get(n, "") for n in names}
        topology = ClusterTopology({n: s for n, s in on.items() if s}, {"A": (), "B": (), "C": ()})
        del job.nodes[:]
        job.nodes.extend(nodes)
        candidates = {n: Candidate(n, True, True, True, 8) for n in names}
        return lifecycle.replenish(job, lifecycle.JobView(candidates=candidates, topology=topology, fleet=True))

    assert chosen({"b1": "B", "b2": "B", "a9": "A"}) == ["a9", "b1", "b2"]  # a9 is near a1; b1 < b2 by name
    assert chosen({"b2": "B", "a9": "A", "c9": "C", "b1": "B"}) == ["a9", "c9", "b1"]  # three wanted, two near
    assert chosen({"b1": "B", "z9": ""}) == ["b1", "z9"]  # z9 is on no leaf switch; every node of the job is on one
    assert chosen({"b1": "B", "z9": ""}, nodes=("a1", "y1")) == ["z9", "b1"]  # y1 is on none either: z9 is near


@pytest.mark.parametrize("rank_tables", ["rows"], indirect=True)  # (a table out of order is one in rows)
def test_a_nodes_ranks_are_found_by_its_position_and_a_table_out_of_order_is_searched():
    """The heartbeat path asks for one node's ranks at every heartbeat: found by the node's position in the job
    (rank order), the same ranks a search of the whole table finds, also after a replica group's rebuild put a spare
    in its place; a spare has none; a table not in rank order (none written by this code) is searched."""
    job = pb.Job(id="job-1", generation=1, spec=pb.JobSpec(command=["x"], nodes=4, ranks_per_node=2, replicas=2))
    lifecycle.with_nodes(job, ["a", "b", "c", "d"], ["s"])
    job.nodes[1] = "s"  # group 0 rebuilt with the spare s in b's place, as _group_launch writes it
    job.spares[:] = ["b"]
    for rank in job.ranks[2:4]:
        rank.node = "s"

    def searched(j, node):
        return [r.rank for r in j.ranks if r.node == node]

    positions = lifecycle.node_positions(job)
    for node in ["a", "s", "c", "d"]:
        found = lifecycle.ranks_on(job, node, positions)
        assert [r.rank for r in found] == searched(job, node) and len(found) == 2, node
    assert lifecycle.ranks_on(job, "b", positions) == ()  # a spare runs none
    shuffled = pb.Job()
    shuffled.CopyFrom(job)
    shuffled.ClearField("ranks")
    shuffled.ranks.extend(reversed(job.ranks))
    assert [r.rank for r in lifecycle.ranks_on(shuffled, "c", positions)] == searched(shuffled, "c") == [5, 4]

    class Table(list):
        """The rank table, counting the passes over all of it (a slice of it is a plain list, not counted)."""
        passes = 0

        def __iter__(self):
            Table.passes += 1
            return super().__iter__()

    from types import SimpleNamespace
    in_order, out_of_order = (SimpleNamespace(spec=j.spec, ranks=Table(j.ranks), HasField=lambda name: False)
                              for j in (job, shuffled))  # (a table in rows, not packed)
    assert [r.rank for r in lifecycle.ranks_on(in_order, "c", positions)] == [4, 5] and Table.passes == 0
    assert [r.rank for r in lifecycle.ranks_on(out_of_order, "c", positions)] == [5, 4] and Table.passes == 1


def test_unsettled_ranks_are_those_not_running_in_order_however_their_states_are_read(rank_tables):
    """detectors.unsettled finds the few ranks not RUNNING by a search in C over every rank's state: a packed table's
    states as they are, a table in rows read in one pass; a state past a byte (no RankState is one, but a record in
    rows could hold it) is read one by one; the quorum's spans of a table (lifecycle._Spans) are read as it is."""
    from controller.recovery.detectors import unsettled

    job = pb.Job(id="j", spec=pb.JobSpec(nodes=4, ranks_per_node=2), nodes=["a", "b", "c", "d"], generation=1)
    lifecycle.rank_table(job, pb.RANK_STATE_RUNNING)
    assert ranktable.is_packed(job) == (rank_tables == "packed")
    assert unsettled(ranktable.rows(job)) == []
    ranktable.set_states(job, {5: (pb.RANK_STATE_EXITED, 3), 2: (pb.RANK_STATE_LOST, 0)})
    odd = unsettled(ranktable.rows(job))
    assert [(r.rank, r.node, r.state, r.exit_code) for r in odd] == [(2, "b", pb.RANK_STATE_LOST, 0),
                                                                     (5, "c", pb.RANK_STATE_EXITED, 3)]
    assert [r.rank for r in unsettled(lifecycle._Spans(ranktable.rows(job), [(0, 2), (4, 6)]))] == [5]
    assert unsettled([]) == []
    if rank_tables == "rows":
        job.ranks[7].state = 300
        assert [r.rank for r in unsettled(job.ranks)] == [2, 5, 7]
    else:
        with pytest.raises(ValueError, match="rank state 300 is not a RankState"):
            ranktable.set_states(job, {7: (300, 0)})
