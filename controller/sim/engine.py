"""The fleet simulator: the controller's own decisions on a simulated fleet, in virtual time.

Event-driven (a heap of timed events, no fixed tick) and deterministic for a seed. What is real: every job's
lifecycle is `controller.recovery.lifecycle.step` (detection of the incident, checkpoint before eviction,
choice of spares, a fresh placement when they run out, restart counting and backoff), placement is
`controller.jobs.placement.place` on the generated topology, and a fault's verdict is the health policy's
(`controller.nodes.health`: an XID or a pending row remap judged as the controller judges it). What is
simulated: the agents, the ranks and the network, by the timings of the scenario. One simulated rank stands
for a node's GPUs.

Accounting, per job: at every instant the job is training, paused for a durable checkpoint, recovering
(from the fault to training again), or waiting for nodes. Work done since the state it resumed from is
counted again when it is recomputed. ETTR = useful work / wall time; the losses by cause add up to the rest.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from pathlib import Path

from controller.config import HealthConfig
from controller.jobs.placement import Candidate
from controller.jobs.slurm_topology import parse_topology_conf
from controller.jobs.topology import ClusterTopology, TopologyError
from controller.nodes import health
from controller.nodes.states import DOWN, UP
from controller.recovery import detectors, lifecycle, table
from controller.recovery.detectors import NodeView
from controller.recovery.progress import RankTrack
from controller.sim import replay
from controller.sim.scenario import DAY_S, HOUR_S, FleetConfig, JobConfig, Scenario
from phalanx import ranks as ranktable
from phalanx.errors import ConfigError
from phalanx.v1 import common_pb2 as pb

HEALTH = HealthConfig()
START = 1_800_000_000.0  # wall-clock seconds of the simulation's start (the lifecycle takes wall time)
# What each kind of fault looks like to the health policy: the XID the agent reports, or the telemetry it sends.
GPU_FAULT_XIDS = (48, 79, 94, 95, 119, 64)  # double-bit ECC, off the bus, ECC, GSP, remap failure
TIMELINE_POINTS = 60
CAUSES = ("recomputed", "recovery", "waiting", "checkpoints", "snapshots", "stragglers", "groups out")
# "groups out": replica-group jobs, the share of the job's work the groups out of the quorum did not do (the steps
# go on with fewer groups: their samples are skipped, not recomputed)

TRAINING, PAUSED, RECOVERING, WAITING = "training", "checkpoints", "recovery", "waiting"
DONE = "done"  # the job trained for its length and ended: its time stops counting


def topology_of(fleet: FleetConfig) -> ClusterTopology:
    """The fleet's network: its topology.conf, or leaves under one spine (and NVLink blocks) as generated.
    Raises ConfigError for a topology.conf that cannot be read or parsed."""
    if fleet.topology_conf:
        path = Path(fleet.topology_conf)
        try:
            return parse_topology_conf(path.read_text(encoding="utf-8"), str(path))
        except OSError as e:
            raise ConfigError(f"fleet.topology_conf: {path}: {e.strerror or e}") from None
        except TopologyError as e:
            raise ConfigError(f"fleet.topology_conf: {e}") from None
    per_leaf = fleet.nodes_per_leaf or fleet.nodes
    width = len(str(fleet.nodes - 1))
    names = [f"node{i:0{width}d}" for i in range(fleet.nodes)]
    leaf = {name: f"leaf{i // per_leaf}" for i, name in enumerate(names)}
    blocks = {name: f"block{i // fleet.nodes_per_block}" for i, name in enumerate(names)} \
        if fleet.nodes_per_block else {}
    return ClusterTopology(leaf, {**{s: ("spine",) for s in dict.fromkeys(leaf.values())}, "spine": ()},
                           node_block=blocks)  # Slurm's default BlockSizes: 1, 2, 4 and 8 blocks together


@dataclass
class SimNode:
    name: str
    down: bool = False
    health: health.Health = health.HEALTHY
    reason: str = ""
    drained: bool = False
    holder: str = ""  # the job whose node or spare it is
    slow: bool = False
    faults: int = 0
    repairs: int = 0
    candidate: tuple[tuple, Candidate] | None = None  # (the state it was made from, the Candidate)


def ettr(jobs: list[SimJob]) -> float:
    """Useful GPU-time over the GPU-time the jobs have existed (each job weighed by its GPUs)."""
    wall = sum(j.wall_s() * j.gpus for j in jobs)
    return sum(j.work * j.gpus for j in jobs) / wall if wall > 0 else 0.0


def verdict_of_xid(xid: int, now: float) -> health.Verdict:
    history = health.GpuHistory()
    history.record_xid(xid, now, HEALTH.window_s)
    return health.evaluate_gpu(history, now, HEALTH)


def verdict_of_warning(now: float) -> health.Verdict:
    """A row remap pending: the GPU works now and fails at its next reset."""
    history = health.GpuHistory()
    history.observe(pb.GpuTelemetry(index=0, remap_pending=True), now, now, HEALTH.window_s)
    return health.evaluate_gpu(history, now, HEALTH)


@dataclass
class Tally:
    seconds: dict[str, float] = field(default_factory=lambda: {c: 0.0 for c in CAUSES})
    work_s: float = 0.0  # useful training kept
    incidents: dict[str, int] = field(default_factory=dict)
    recoveries_s: list[float] = field(default_factory=list)  # fault -> training again
    spares_used: int = 0
    fresh_placements: int = 0
    launches: int = 0
    warm_launches: int = 0  # of them, on nodes the job held (standbys ready)
    failed: str = ""  # why the job ended FAILED, if it did


class SimJob:
    """One job: its stored record, stepped by the real lifecycle, and what the controller process knows."""

    def __init__(self, sim: Simulation, job_id: str, shape: JobConfig) -> None:
        self.sim = sim
        self.shape = spec = shape
        self.gpus = spec.nodes * sim.scenario.fleet.gpus_per_node
        self.length_s = spec.length_h * HOUR_S or math.inf
        self.ended_at: float | None = None  # when it finished its length
        self.replicas = spec.replicas if spec.replicas > 1 else 0  # replica groups (0: none)
        self.snapshots = spec.snapshots and not self.replicas  # a group recovers from a healthy group instead
        self.job = pb.Job(id=job_id, spec=pb.JobSpec(command=["train"], nodes=spec.nodes, ranks_per_node=1,
                                                     spares=spec.spares, segment=spec.segment,
                                                     replicas=self.replicas),
                          state=table.PENDING, state_since_unix_ns=int(sim.now * 1e9))
        self.launch: lifecycle.LaunchView | None = None
        self.launch_nodes: tuple[str, ...] = ()
        self.checkpoint: lifecycle.CheckpointView | None = None
        self.told: set[str] = set()  # nodes told to stop the generation (JobView.told)
        self.taken: set[str] = set()  # ... that have stopped it (JobView.stopped)
        self.ended: dict[int, tuple[int, int]] = {}  # rank -> (state, exit code) its node reported (JobView.ended)
        self.generation = 0
        self.members: set[str] = set()
        self.node_list: tuple[str, ...] = ()  # the job's nodes in rank order, read from the record once a generation
        self.views: dict[str, NodeView] = {}
        self.unwell: set[str] = set()  # of `views`, those unwell (JobView.unwell), kept as they change
        self.candidates: dict[str, Candidate] = {}
        self.unfit: set[str] = set()  # of `candidates`, those a next generation cannot run on (lifecycle.unfit)
        self._node_views: dict[tuple, NodeView] = {}
        self._stale = False  # the views and candidates wait for a rebuild (done once, when next looked at)
        self._moved: set[str] = set()  # ... of these names: the nodes and spares that came or went since
        self.fleet: dict[str, Candidate] | None = None  # every node, as placement sees it from this job
        self.synced = 0  # how much of the simulation's change log `fleet` has taken in
        self.tally = Tally()
        # training
        self.activity = WAITING
        self.since = sim.now
        self.work = 0.0  # position of training, in seconds of useful work
        self.durable = 0.0  # position of the last durable checkpoint
        self.rate = 1.0
        self.strength = 1.0  # the share of the replica groups in the quorum (1.0 without groups)
        self.out: set[int] = set()  # replica groups out of the quorum: left, or rejoining with a healthy group's state
        self.position: dict[str, int] = {}  # replica groups: node -> its place in job.nodes
        self.since_checkpoint = 0.0  # seconds trained since the last durable checkpoint (or the resume)
        self.token = 0  # invalidates scheduled checkpoint/resume events when training stops or restarts
        self.pace = 0  # invalidates a scheduled end of training when the rate changes
        self.warm: set[str] = set()  # nodes with a standby of the job started ahead (none before the first start)
        self.broken_at: float | None = None  # a fault stopped training; recovery counts from here

    # -- time accounting ---------------------------------------------------------------------------

    def _settle(self) -> None:
        now, dt = self.sim.now, self.sim.now - self.since
        if dt > 0 and self.activity != DONE:
            if self.activity == TRAINING:
                gained = dt * self.rate
                self.work += gained
                self.since_checkpoint += dt
                overhead = self.shape.snapshot_overhead if self.snapshots else 0.0
                self.tally.seconds["snapshots"] += dt * overhead
                self.tally.seconds["groups out"] += dt * (1 - overhead) * (1 - self.strength)
                self.tally.seconds["stragglers"] += dt * (1 - overhead) * self.strength - gained
            else:
                self.tally.seconds[self.activity] += dt
        self.since = now

    def become(self, activity: str) -> None:
        self._settle()
        if activity != self.activity:
            self.token += 1
        self.activity = activity
        if activity == TRAINING:
            self.rate = self._rate()
            self._schedule_checkpoint()
            self._schedule_end()

    def wall_s(self) -> float:
        """Seconds the job has existed: from the start to now, or to its end."""
        return (self.ended_at if self.ended_at is not None else self.sim.now) - START

    def _schedule_end(self) -> None:
        if self.length_s < math.inf:
            self.pace += 1
            self.sim.at(self.sim.now + max(self.length_s - self.work, 0.0) / self.rate, self._trained, self.token,
                        self.pace)

    def _trained(self, token: int, pace: int) -> None:
        """The job has trained for its length: its ranks exit 0, and the lifecycle ends it."""
        if token != self.token or pace != self.pace or self.activity != TRAINING or self.job.state != table.RUNNING:
            return
        self._settle()
        self.ended = dict.fromkeys(range(ranktable.count(self.job)), (pb.RANK_STATE_EXITED, 0))  # in rank order
        self.decide()

    def _rate(self) -> float:
        spec, failures = self.shape, self.sim.scenario.failures
        rate = 1.0 - (spec.snapshot_overhead if self.snapshots else 0.0)
        self.strength = 1.0 - len(self.out) / self.replicas if self.replicas else 1.0
        if any(self.in_quorum(n) for n in self.sim.slow):
            rate /= 1.0 + failures.straggler_slowdown
        return rate * self.strength

    def in_quorum(self, node: str) -> bool:
        """The node is one of the job's, and (replica groups) of a group in the quorum: a fault or a slow step there
        holds the job's step back."""
        if not self.replicas:
            return node in self.members
        i = self.position.get(node)
        return i is not None and i // (len(self.job.nodes) // self.replicas) not in self.out

    def _schedule_checkpoint(self) -> None:
        due = self.shape.checkpoint_interval_s - self.since_checkpoint
        self.sim.at(self.sim.now + max(due, 0.0), self._checkpoint_due, self.token)

    def _checkpoint_due(self, token: int) -> None:
        if token != self.token or self.activity != TRAINING:
            return
        self.become(PAUSED)
        self.sim.at(self.sim.now + self.shape.checkpoint_cost_s, self._checkpoint_done, self.token,
                    self.work)

    def _checkpoint_done(self, token: int, position: float) -> None:
        if token != self.token or self.activity != PAUSED:
            return  # a fault came first: this checkpoint never became durable
        self.durable = position
        self.since_checkpoint = 0.0
        self.become(TRAINING)

    def speed_changed(self) -> None:
        if self.activity == TRAINING:
            self._settle()
            self.rate = self._rate()
            self._schedule_end()

    def broken(self, sudden: bool, node: str = "") -> None:
        """A fault reached one of the job's nodes (`node`, where one is named): training stops now. A sudden one loses
        the work since the state the next generation will resume from; with replica groups, the step in flight (the
        quorum's collective fails), until the lifecycle says whether the group alone restarts. A fault in a group out
        of the quorum stops nothing."""
        if self.broken_at is not None or self.job.state not in (table.RUNNING, table.CHECKPOINTING, table.EVICTING):
            return  # (EVICTING: a predictable incident's checkpoint is in, and training stops only now)
        if self.replicas and node and not self.in_quorum(node):
            return
        self.become(RECOVERING)
        self.broken_at = self.sim.now
        if sudden and self.replicas and self.job.state == table.RUNNING:
            step = min(self.shape.step_s * self.rate, self.work - self.durable)
            self.tally.seconds["recomputed"] += step
            self.work -= step
        elif sudden:
            self._rewind()

    def _rewind(self) -> None:
        spec = self.shape
        if self.snapshots:
            grain = spec.snapshot_every * spec.step_s
            resume = math.floor(self.work / grain) * grain
        else:
            resume = self.durable
        resume = max(resume, self.durable)
        self.tally.seconds["recomputed"] += self.work - resume
        self.work = resume

    # -- the controller: build the view, step, apply -----------------------------------------------

    def node_view(self, name: str) -> NodeView:
        n = self.sim.nodes[name]
        key = (name, n.down, n.health, n.reason, n.drained)
        view = self._node_views.get(key)
        if view is None:  # views are frozen: one per state a node is seen in serves every generation
            view = self._node_views[key] = NodeView(name, n.down, n.health, n.reason, connected=not n.down,
                                                    drained=n.drained)
        return view

    def _candidate(self, name: str) -> None:
        """The node's candidate (as placement sees it from this job), held with whether it is unfit."""
        held = self.candidates[name] = self.sim.candidate(self.sim.nodes[name], self.job.id)
        if lifecycle.unfit({name: held}, self.job.spec.ranks_per_node):
            self.unfit.add(name)
        else:
            self.unfit.discard(name)

    def refresh(self, *names: str) -> None:
        """Some of the job's nodes changed (a fault, a drain): their views and candidates again."""
        for name in names:
            if name in self.candidates:
                self._candidate(name)
            if name in self.views:  # (also while a rebuild is due: it keeps the views it finds, _rebuild)
                self._view(name)

    def _view(self, name: str) -> None:
        """The node's view as it is now, held with whether it is unwell."""
        view = self.views[name] = self.node_view(name)
        if detectors.is_unwell(view):
            self.unwell.add(name)
        else:
            self.unwell.discard(name)

    def rebuild(self, moved: AbstractSet[str]) -> None:
        """The job's nodes changed, `moved` among them (those that came or went, and the spares before and after):
        their views and candidates again, when next looked at."""
        self._moved |= moved
        self._stale = True

    def _rebuild(self) -> None:
        """The views and candidates of the job's nodes and spares, in place: a view and a candidate for each, none for
        any other name. One held is current for its node's state (refresh keeps it so): only the nodes that came or
        went since (`rebuild`) are looked at, sorted (a set's order is the process's string hashing). A view does not
        show the job's stops (JobView.told, .stopped): a recovery, which stops every node of the job, moves no view."""
        self._stale = False
        moved, self._moved = self._moved, set()
        spares = set(self.job.spares)
        came = sorted(n for n in moved if n in self.members or n in spares)
        went = sorted(n for n in moved if n not in self.members and n not in spares)
        for held, flagged, look in ((self.views, self.unwell, self._view),
                                    (self.candidates, self.unfit, self._candidate)):
            for name in went:
                if held.pop(name, None) is not None:
                    flagged.discard(name)
            for name in came:
                if name not in held:
                    look(name)

    def respare(self, before: pb.Job) -> None:
        """Only the spares changed (held again, or released): their views alone."""
        if self.job.state == table.RUNNING:
            self.warm.update(self.job.spares)  # a spare held while training gets its standby
        if self._stale:  # the rebuild due adds the views of the spares that came (and its candidates, here)
            self._moved.update(before.spares, self.job.spares)
        for name in set(before.spares) - set(self.job.spares) - self.members:
            self.views.pop(name, None)
            self.unwell.discard(name)
            self.candidates.pop(name, None)
            self.unfit.discard(name)
        for name in self.job.spares:
            if name not in self.candidates:
                self._candidate(name)
            if name not in self.views and not self._stale:
                self._view(name)

    def view(self, candidates: dict[str, Candidate] | None) -> lifecycle.JobView:
        """What the controller sees of the job. No progress reports: the simulated ranks step at the scenario's
        pace, and a checkpoint request is answered after timings.eviction_checkpoint_s (without reports the
        lifecycle asks at once). A stop is taken reliably here, within timings.stop_s: a node told once stays told for
        its generation, and `running` (a node still showing the generation after a stop, past the eviction's
        deadline) never arises. The view holds the simulator's own maps (views, candidates), read within the step it
        is built for (lifecycle.plan), not copies: a view kept past it would change under its reader."""
        job = self.job
        if self._stale:
            self._rebuild()
        launch = self.launch if self.launch and self.launch.generation == job.generation else None
        views = self.views  # (a node not connected is down here: among the few unwell)
        unreachable = {n for n in self.unwell if views[n].down or not views[n].connected}
        return lifecycle.JobView(nodes=views, unwell=self.unwell, unreachable=unreachable, told=self.told,
                                 stopped=self.taken,
                                 launch=launch, checkpoint=self.checkpoint,
                                 candidates=self.candidates if candidates is None else candidates,
                                 unfit=self.unfit if candidates is None else None,
                                 idle=None if candidates is None else self.sim.idle, members=self.members,
                                 node_list=self.node_list,
                                 topology=self.sim.topology, fleet=candidates is not None, ended=self.ended,
                                 step_s=self.shape.step_s)

    def decide(self) -> None:
        for _ in range(64):
            if self.job.state in table.TERMINAL:
                return
            if not self.apply(lifecycle.plan(self.job, self._view_of, self.sim.now, self.sim.policy)):
                return
        raise RuntimeError(f"{self.job.id}: no quiet point after 64 steps in {table.state_name(self.job.state)}")

    def judge(self, tracks: dict[int, RankTrack]) -> None:
        """A step that reads these progress tracks (the detectors' input: the simulated ranks send no reports),
        taken as the controller takes every step (lifecycle.plan); then on to a quiet point."""
        self.apply(lifecycle.plan(self.job, lambda fleet: replace(self._view_of(fleet), tracks=tracks),
                                  self.sim.now, self.sim.policy))
        self.decide()

    def _view_of(self, fleet: bool) -> lifecycle.JobView:
        """The view lifecycle.plan asks for. Choosing a next generation (RENDEZVOUS) sees the whole fleet only
        where the job's own nodes and spares do not do: the choice is the same (own nodes come first), and a
        whole-fleet look per recovery step would cost more than the rest of the simulation at 16,000 nodes."""
        view = self.view(None)
        if fleet and (self.job.state != table.RENDEZVOUS or self.needs_the_fleet()):
            view = self.view(self.sim.all_candidates(self))
        return view

    def needs_the_fleet(self) -> bool:
        """Whether the next generation's nodes must be chosen from the whole fleet, as the controller does: its own
        nodes and spares do not do, or would only with a node of the incident (taken only when nothing else in the
        fleet will do). lifecycle.next_nodes keeps the job on its own nodes exactly when its spares can take the
        places of those that will not do (unfit, or of the incident): counted from the few such nodes held, not by
        choosing (`tests/test_simulate.py` checks it against next_nodes' choice at every rendezvous of a run)."""
        if self._stale:
            self._rebuild()
        out = self.unfit.union(self.job.incident_nodes)
        return sum(name in self.members for name in out) > sum(name not in out for name in self.job.spares)

    def apply(self, actions: list[lifecycle.Action]) -> bool:
        sim, committed, stops = self.sim, False, []
        for action in actions:
            match action:
                case lifecycle.Commit(job=job, incident=incident, kind=kind, message=message):
                    before = self.job
                    self.job = job
                    committed = True
                    if self.ended:
                        self.ended = lifecycle.ended_unsaved(job, self.ended)
                    if incident:
                        self.tally.incidents[incident] = self.tally.incidents.get(incident, 0) + 1
                    if job.generation != self.generation:
                        self.generation, self.checkpoint, self.ended = job.generation, None, {}
                        self.told, self.taken = set(), set()
                    # (a job's nodes change only with its generation: lifecycle.with_nodes, a group's launch; the
                    # record's list is read once a generation, and compared as a tuple: the records' own lists
                    # compare at several times the cost of reading one: 33 against 8 ms, both measured beside a CI run)
                    nodes = tuple(job.nodes) if job.generation != before.generation else self.node_list
                    moved_nodes = nodes != self.node_list
                    assert moved_nodes or len(job.nodes) == len(before.nodes), "nodes changed within a generation"
                    moved_spares = job.spares != before.spares
                    members = set(nodes) if moved_nodes else self.members
                    if kind in ("job.restarting", "job.group_rebuilding"):
                        self.tally.spares_used += len(members.intersection(before.spares))
                        if "a new placement" in message:
                            self.tally.fresh_placements += 1
                    held: AbstractSet[str] = frozenset()  # (most commits hold what they held: no pass over the job)
                    if moved_nodes or moved_spares or (before.state in table.TERMINAL) != (job.state in table.TERMINAL):
                        held = sim.hold(self, before, job, members)
                    if moved_nodes:
                        self.members, self.node_list = members, nodes
                        if self.replicas:
                            self.position = dict(zip(nodes, range(len(nodes)), strict=True))  # (in C)
                        self.rebuild(held)
                    elif moved_spares:
                        self.respare(before)
                    if job.state != before.state:
                        self.entered(before.state, job.state)
                    elif self.replicas and job.state == table.RUNNING:
                        self._groups_moved(before, job)
                case lifecycle.Launch(generation=generation, nodes=nodes):
                    self.launch = lifecycle.LaunchView(generation)
                    self.launch_nodes = nodes or self.node_list
                    warm = sim.scenario.policy.warm_starts and self.warm.issuperset(self.launch_nodes)
                    self.tally.launches += 1
                    self.tally.warm_launches += warm
                    timings = sim.scenario.timings
                    sim.at(sim.now + (timings.warm_launch_s if warm else timings.launch_s), self._launched,
                           generation)
                case lifecycle.Stop(nodes=nodes):  # (sets anew, not changed in place: a view handed out keeps its own)
                    self.told = self.told.union(nodes)
                    self.taken = self.taken.difference(nodes)  # (told again: stopped once it has taken this stop)
                    stops += nodes
                case lifecycle.Drain(node=node):
                    sim.take_out(sim.nodes[node])
                case lifecycle.RequestCheckpoint(request=request):
                    self.checkpoint = lifecycle.CheckpointView(request.id, {})
                    self.token += 1  # a durable checkpoint under way gives way to this one (training stays paused)
                    self.become(PAUSED if self.broken_at is None else RECOVERING)
                    sim.at(sim.now + sim.scenario.timings.eviction_checkpoint_s, self._acked, request.id,
                           self.generation)
                case lifecycle.WakeAt(at=at):
                    sim.at(max(at, sim.now), self.decide)
                case lifecycle.Event():
                    pass
        if stops:  # every node takes its stop in the same time: one event for them all
            sim.at(sim.now + sim.scenario.timings.stop_s, self._stopped, stops, self.generation)
        return committed

    def entered(self, source: int, target: int) -> None:
        sim = self.sim
        if target == table.RUNNING and source in table.LAUNCHING:
            load = sim.scenario.timings.snapshot_load_s if self.snapshots and self.work > 0 else \
                sim.scenario.timings.load_s
            self.out.clear()  # the whole job anew: every group
            sim.at(sim.now + load, self._loaded, self.generation)
        elif target == table.EVICTING and self.broken_at is None:
            self.broken(sudden=False)  # predictable: the eviction checkpoint just committed
        elif target == table.EVICTING and self.replicas and source == table.RUNNING:
            self._rewind()  # a sudden fault of the whole gang (every group): back to the last durable checkpoint
        elif target == table.FAILED:
            self.become(WAITING)
            self.tally.failed = self.job.reason
        elif target == table.SUCCEEDED:
            self.become(DONE)
            self.ended_at = sim.now
        elif target == table.RENDEZVOUS and self.job.reason.startswith("waiting for nodes"):
            self.become(WAITING)

    def _loaded(self, generation: int) -> None:
        if generation != self.generation or self.job.state != table.RUNNING:
            return
        if self.broken_at is not None:
            self.tally.recoveries_s.append(self.sim.now - self.broken_at)
        self.broken_at = None
        self.since_checkpoint = 0.0
        self.warm = self.members.union(self.job.spares)  # standbys wait on these for the next restart
        self.become(TRAINING)
        if self.sim.scenario.policy.evict_stragglers and not self.sim.slow.isdisjoint(self.members):
            for name in self.node_list:  # a slow node the job (re)started on is found like any
                if self.sim.nodes[name].slow:
                    self.sim.check_straggler(self.sim.nodes[name], self)

    def _groups_moved(self, before: pb.Job, after: pb.Job) -> None:
        """A commit moved replica groups (the job RUNNING throughout): one that left is out of the quorum, and the
        others train on once the quorum has dropped it (after a sudden fault) or at once (it left at a step boundary);
        one whose launch is done is back in once it has a healthy group's state."""
        old = {g.index: g.state for g in before.groups}
        left = [g.index for g in after.groups if g.state == lifecycle.GROUP_STOPPING and
                old.get(g.index) == lifecycle.GROUP_TRAINING]
        joined = [g for g in after.groups if g.state == lifecycle.GROUP_TRAINING and
                  old.get(g.index) == lifecycle.GROUP_REBUILDING]
        if left:
            self.out.update(left)
            if self.broken_at is not None and self.activity == RECOVERING:
                self.sim.at(self.sim.now + self.sim.scenario.timings.regroup_s, self._regrouped, self.token)
            else:
                self.speed_changed()
        for group in joined:
            self.sim.at(self.sim.now + self.sim.scenario.timings.peer_recovery_s, self._rejoined, group.index,
                        group.generation)

    def _regrouped(self, token: int) -> None:
        """The quorum trains without the groups that left: the pause of the healthy groups ends."""
        if token != self.token or self.activity != RECOVERING or self.job.state != table.RUNNING:
            return
        if self.broken_at is not None:
            self.tally.recoveries_s.append(self.sim.now - self.broken_at)
        self.broken_at = None
        self.become(TRAINING)

    def _rejoined(self, g: int, generation: int) -> None:
        """A rebuilt group has a healthy group's state and joins the quorum at a step boundary."""
        groups = self.job.groups
        if self.job.state != table.RUNNING or g >= len(groups) or groups[g].generation != generation or \
                groups[g].state != lifecycle.GROUP_TRAINING:
            return
        self.out.discard(g)
        self.speed_changed()
        if self.sim.scenario.policy.evict_stragglers:  # a slow node it joined with is found like any
            for name in lifecycle.group_members(self.job, g):
                if self.sim.nodes[name].slow:
                    self.sim.check_straggler(self.sim.nodes[name], self)

    def _launched(self, generation: int) -> None:
        if self.launch is None or self.launch.generation != generation:
            return
        lost = self.sim.down.intersection(self.launch_nodes)  # (in C: the few down, in launch order below)
        down = [n for n in self.launch_nodes if n in lost] if lost else []
        self.launch = lifecycle.LaunchView(generation, done=True, ok=not down, error=f"{down} down",
                                           address="10.0.0.1", port=29500)
        self.decide()

    def _stopped(self, nodes: list[str], generation: int) -> None:
        if generation == self.generation:
            self.taken = self.taken.union(self.told.intersection(nodes).difference(self.sim.down))
        self.decide()

    def _acked(self, request_id: int, generation: int) -> None:
        if self.checkpoint is None or self.checkpoint.request_id != request_id or generation != self.generation:
            return
        if not self.sim.down.isdisjoint(self.members):
            self.decide()  # a node died first: the deadline will pass and the recovery resumes from before
            return
        step = int(self.work / self.shape.step_s)
        # every rank acks (its table is in rank order, lifecycle.rank_table: no pass over its rows)
        self.checkpoint = lifecycle.CheckpointView(request_id, dict.fromkeys(range(ranktable.count(self.job)), step))
        self.durable = max(self.durable, self.work)
        self.decide()

    def crash(self, rank: int = 0) -> None:
        """A rank of the job exits non-zero (software): what JobManager.observe records from the heartbeat."""
        if self.job.state != table.RUNNING or rank >= ranktable.count(self.job):
            return
        self.ended[rank] = (pb.RANK_STATE_EXITED, 1)  # (the table is in rank order)
        self.decide()

    def crash_rank(self) -> int:
        """Which rank a software fault crashes: rank 0; with replica groups, any rank of a group in the quorum."""
        if not self.replicas or not ranktable.count(self.job):
            return 0
        k = ranktable.count(self.job) // self.replicas
        groups = [g for g in range(self.replicas) if g not in self.out] or [0]
        return self.sim.rng.choice(groups) * k + self.sim.rng.randrange(k)


class Simulation:
    def __init__(self, scenario: Scenario, on_progress: Callable[[float], None] | None = None,
                 trace: replay.Trace | None = None) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.run.seed)
        self.policy = lifecycle.Policy(scenario.policy.recovery(), scenario.policy.jobs())
        self.now = START
        self.end = START + scenario.run.days * DAY_S
        self.queue: list = []
        self.order = itertools.count()
        self.on_progress = on_progress
        fleet = scenario.fleet
        self.topology = topology_of(fleet)
        self.nodes: dict[str, SimNode] = {name: SimNode(name) for name in self.topology.nodes}
        self.idle: set[str] = set(self.nodes)  # the nodes no job holds (JobView.idle), kept as jobs take and release
        scenario.check_fit(len(self.nodes))
        self.jobs: list[SimJob] = []
        for shape in scenario.shapes:
            for k in range(shape.count):
                name = f"{shape.name}-{k + 1}" if shape.name else f"job-{len(self.jobs) + 1}"
                self.jobs.append(SimJob(self, name, shape))
        self.node_fault_rate = scenario.failures.per_1000_node_days / 1000.0 / DAY_S
        self.leaf_fault_rate = scenario.failures.leaf_per_1000_leaf_days / 1000.0 / DAY_S
        self.straggler_rate = scenario.failures.straggler_per_1000_node_days / 1000.0 / DAY_S
        self.events = 0
        self.timeline: list[tuple[float, float]] = []  # (day, ETTR so far)
        self.nodes_drained = 0
        self.leaf_failures = 0
        self.slow: set[str] = set()  # nodes slow now
        self.down: set[str] = set()  # nodes down now
        self.checking: set[str] = set()  # slow nodes with a straggler verdict due (check_straggler)
        self.changes: list[str] = []  # every node whose state placement sees changed, in order (a log)
        self.trace = trace
        # the trace's faults: those that hit, and those that did not and why
        self.replayed = {"faults": 0, "watched": 0, "out_of_service": 0, "no_job": 0}
        self.trace_nodes: dict[str, SimNode] = {}
        if trace is not None:
            if len(trace.nodes) > fleet.nodes:
                raise ConfigError(f"replay.events: {trace.source} has faults on {len(trace.nodes)} nodes; "
                                 f"fleet.nodes ({fleet.nodes}) must be at least that")
            shuffled = list(self.nodes.values())
            self.rng.shuffle(shuffled)
            self.trace_nodes = dict(zip(trace.nodes, shuffled, strict=False))

    # -- the world's clock ---------------------------------------------------------------------------

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self.queue, (t, next(self.order), fn, args))

    def run(self) -> Simulation:
        if self.trace is None:
            for node in self.nodes.values():
                self._next_fault(node)
                self._next_straggle(node)
            for leaf in self.topology.leaves if self.leaf_fault_rate > 0 else ():
                self.at(self.now + self.rng.expovariate(self.leaf_fault_rate), self._leaf_fails, leaf)
        elif self.trace.faults:
            self.at(START + self.trace.faults[0].t, self._replay, 0, 0)
        for job in self.jobs:
            job.decide()
        report_every = (self.end - self.now) / 20
        next_report = self.now + report_every
        for k in range(1, TIMELINE_POINTS + 1):
            self.at(START + (self.end - START) * k / TIMELINE_POINTS, self._sample)
        while self.queue and self.queue[0][0] <= self.end:
            t, _, fn, args = heapq.heappop(self.queue)
            self.now = max(self.now, t)
            self.events += 1
            fn(*args)
            if self.on_progress is not None and self.now >= next_report:
                self.on_progress((self.now - START) / (self.end - START))
                next_report += report_every
        self.now = self.end
        for job in self.jobs:
            job.become(job.activity)  # settle the last stretch
            job.tally.work_s = job.work
        return self

    def _sample(self) -> None:
        """A point of the ETTR-over-time curve: useful work so far over the time so far, over every job."""
        for job in self.jobs:
            job.become(job.activity)  # settle the stretch up to now
        self.timeline.append(((self.now - START) / DAY_S, ettr(self.jobs)))

    # -- the fleet -------------------------------------------------------------------------------

    def candidate(self, node: SimNode, job_id: str) -> Candidate:
        """The node as placement sees it from `job_id` (its own nodes count as free). Cached per node state: the
        whole fleet is looked at each time a job needs a fresh placement."""
        free = node.holder in ("", job_id)
        key = (node.down, node.health, node.drained, free)
        if node.candidate is None or node.candidate[0] != key:
            node.candidate = (key, Candidate.of(node.name, DOWN if node.down else UP, node.health, free,
                                                self.scenario.fleet.gpus_per_node, connected=not node.down,
                                                drained=node.drained))
        return node.candidate[1]

    def all_candidates(self, job: SimJob) -> dict[str, Candidate]:
        """Every node as placement sees it from `job`: kept per job, brought up to date from the change log (a
        whole-fleet look each time a job needs nodes would cost more than the rest of the simulation)."""
        if job.fleet is None:
            job.fleet, job.synced = {n.name: self.candidate(n, job.job.id) for n in self.nodes.values()}, \
                len(self.changes)
        for name in self.changes[job.synced:]:
            job.fleet[name] = self.candidate(self.nodes[name], job.job.id)
        job.synced = len(self.changes)
        return job.fleet

    def hold(self, job: SimJob, before: pb.Job, after: pb.Job, members: set[str]) -> set[str]:
        """Which nodes a job holds follows its record (nodes and spares); a job that ended holds none. A job holds
        every node of its record (this keeps it so): only those that came or went are looked at. `job.members` are
        the nodes of `before`, `members` those of `after`. Returns the names looked at: those that came or went, and
        the spares before and after."""
        empty: set[str] = set()  # (a job that ended holds nothing)
        nodes_before, spares_before = (empty, empty) if before.state in table.TERMINAL else \
            (job.members, set(before.spares))
        nodes_after, spares_after = (empty, empty) if after.state in table.TERMINAL else (members, set(after.spares))
        # what came or went alone, found in C (none of the nodes where only the spares moved)
        moved = nodes_after.symmetric_difference(nodes_before) if nodes_after is not nodes_before else set()
        moved |= spares_before | spares_after
        gone = [n for n in moved if (n in nodes_before or n in spares_before) and
                n not in nodes_after and n not in spares_after]
        came = [n for n in moved if (n in nodes_after or n in spares_after) and
                n not in nodes_before and n not in spares_before]
        released = [name for name in gone if self.nodes[name].holder == job.job.id]
        for name in released:
            self.nodes[name].holder = ""
        self.idle.update(released)
        changed = [name for name in came if self.nodes[name].holder != after.id]
        self.idle.difference_update(changed)
        self.changes += released
        self.changes += changed
        for name in changed:
            self.nodes[name].holder = after.id
        job.refresh(*changed)
        return moved

    def touched(self, node: SimNode) -> None:
        """A node's state changed: the job holding it sees it anew."""
        self.changes.append(node.name)
        job = self._job_of(node)
        if job is not None:
            job.refresh(node.name)

    def take_out(self, node: SimNode) -> None:
        """Drained by the controller: out of service until repaired."""
        if node.drained:
            return
        node.drained = True
        self.touched(node)
        self.nodes_drained += 1
        self.at(self.now + self.scenario.failures.repair_h * HOUR_S, self._repaired, node)

    def _repaired(self, node: SimNode) -> None:
        node.down, node.drained, node.slow = False, False, False
        node.repairs += 1
        self.slow.discard(node.name)
        self.down.discard(node.name)
        node.health, node.reason = health.HEALTHY, ""
        self.touched(node)
        if self.trace is None:
            self._next_fault(node)
            self._next_straggle(node)
        for job in self.jobs:
            if job.job.state == table.RENDEZVOUS or job.job.state == table.PENDING:
                job.decide()

    def _job_of(self, node: SimNode) -> SimJob | None:
        if not node.holder:
            return None
        return next((j for j in self.jobs if j.job.id == node.holder), None)

    def _next_fault(self, node: SimNode) -> None:
        if self.node_fault_rate > 0:
            self.at(self.now + self.rng.expovariate(self.node_fault_rate), self._fault_arrives, node, node.faults)

    def _next_straggle(self, node: SimNode) -> None:
        if self.straggler_rate > 0:
            self.at(self.now + self.rng.expovariate(self.straggler_rate), self._straggle, node, node.faults)

    def _fault_arrives(self, node: SimNode, faults: int) -> None:
        """A fault is drawn: software, a lost node, or a GPU fault (some with a warning first)."""
        if faults != node.faults or node.down or node.drained:
            return  # the node was taken out meanwhile: this fault never happens
        f = self.scenario.failures
        r = self.rng.random()
        if r < f.software_share:
            job = self._job_of(node)
            if job is not None and node.name in job.members:
                if self.rng.random() < f.hang_share:
                    self._hang(job)
                else:
                    self._crash(job)
            self._next_fault(node)
            return
        node.faults += 1
        lost = r < f.software_share + f.node_loss_share
        if self.rng.random() < f.predictable_share:
            self._foretold(node, lost)
        else:
            self._hardware_fault(node, lost)

    def _crash(self, job: SimJob) -> None:
        rank = job.crash_rank()
        self.at(self.now + self.scenario.timings.crash_detect_s, job.crash, rank)
        ranks = ranktable.rows(job.job)
        job.broken(sudden=True, node=ranks[rank].node if rank < len(ranks) else "")

    def _hang(self, job: SimJob) -> None:
        """Every rank stops in a collective: no rank exits, and the controller's hang detector finds it once the
        ranks have made no progress for max(hang_min_s, hang_factor x the step), at the next report."""
        if job.job.state != table.RUNNING or job.broken_at is not None:
            return
        job.broken(sudden=True)
        recovery = self.scenario.policy.recovery()
        limit = max(recovery.hang_min_s, recovery.hang_factor * job.shape.step_s)
        self.at(self.now + limit + self.scenario.timings.crash_detect_s, self._hang_found, job, job.generation,
                self.now)

    def _hang_found(self, job: SimJob, generation: int, since: float) -> None:
        if job.generation != generation or job.job.state != table.RUNNING:
            return
        step = job.shape.step_s
        tracks = {}
        base = int(since / step)  # the steps go on from one generation to the next: no two hangs share a step
        for rank in itertools.islice(lifecycle.quorum(job.job)[0], 4):  # what the detector reads: reports that go
            # on, steps that do not (replica groups: of the groups in the quorum, the only ones it judges)
            track = RankTrack(last_advance=since, last_report=since)
            for k in range(1, 6):
                track.observe(base + 30 * k, step, [step] * 30, since, 30)
            track.last_report = self.now
            tracks[rank.rank] = track
        job.judge(tracks)

    def _foretold(self, node: SimNode, lost: bool) -> None:
        """A fault that warns first: the warning now, the fault itself failures.warning_s later."""
        warning = min(self.scenario.failures.warning_s, self.now - START)
        self.at(self.now + warning, self._foretold_fault, node, lost, node.repairs)
        self._warn(node)

    def _foretold_fault(self, node: SimNode, lost: bool, repairs: int) -> None:
        if node.repairs == repairs:  # a node repaired after its warning does not fail of it
            self._hardware_fault(node, lost)

    # -- a real event log as the failure trace (controller.sim.replay) -----------------------------------

    def _replay(self, index: int, cycle: int) -> None:
        """The trace's fault `index` of pass `cycle`, then the next one scheduled (one pending at a time: a short
        log repeated over months would be millions of events up front)."""
        trace = self.trace
        assert trace is not None
        self._apply(trace.faults[index])
        index += 1
        if index == len(trace.faults):
            if not self.scenario.replay.repeat:
                return
            index, cycle = 0, cycle + 1
        period = max(trace.span_s, trace.faults[-1].t) + 1.0  # a log of one instant still moves on
        self.at(START + cycle * period + trace.faults[index].t, self._replay, index, cycle)

    def _apply(self, fault: replay.Fault) -> None:
        if fault.job:
            job = self.jobs[self.trace.jobs.index(fault.job) % len(self.jobs)]
            if job.job.state != table.RUNNING or not job.node_list:
                self.replayed["no_job"] += 1  # the job is not training now: nothing for the fault to hit
                return
            self.replayed["faults"] += 1
            if fault.kind == replay.CRASH:
                self._crash(job)
            else:  # a straggler: one of its nodes turns slow
                node = self.nodes[self.rng.choice(job.node_list)]
                self._straggle(node, node.faults)
            return
        node = self.trace_nodes[fault.node]
        if node.down or node.drained:
            self.replayed["out_of_service"] += 1  # taken out here already (repair_h may be longer than the log's)
            return
        verdict = verdict_of_xid(fault.xid, self.now) if fault.kind == replay.XID else None
        if verdict is not None and verdict.health < health.FAILING:
            self.replayed["watched"] += 1  # an XID the health policy only watches: nothing stops
            return
        self.replayed["faults"] += 1
        node.faults += 1
        if fault.kind == replay.WARNING:
            self._foretold(node, lost=False)
        elif verdict is not None:
            self._hardware_fault(node, lost=False, verdict=verdict)
        else:
            self._hardware_fault(node, lost=fault.kind == replay.LOST)

    def _leaf_fails(self, leaf: str) -> None:
        """A leaf switch fails: every node under it is lost at once, and comes back with the switch's repair."""
        self.leaf_failures += 1
        for name in self.topology.nodes_under(leaf):
            node = self.nodes[name]
            if not node.down and not node.drained:
                node.faults += 1
                self._hardware_fault(node, lost=True)
        self.at(self.now + self.scenario.failures.repair_h * HOUR_S + self.rng.expovariate(self.leaf_fault_rate),
                self._leaf_fails, leaf)

    def _warn(self, node: SimNode) -> None:
        if not self.scenario.policy.predictive_eviction:
            return  # no health policy acts on it: the warning goes unseen
        verdict = verdict_of_warning(self.now)
        node.health, node.reason = verdict.health, verdict.reasons[0] if verdict.reasons else ""
        self.touched(node)
        job = self._job_of(node)
        if job is not None and node.name in job.members:
            self.at(self.now + self.scenario.timings.gpu_fault_detect_s, job.decide)
        elif job is None or node.name in job.job.spares:
            self.take_out(node)  # an idle node or a spare that turns FAILING is drained at once
            if job is not None:
                job.decide()

    def _hardware_fault(self, node: SimNode, lost: bool, verdict: health.Verdict | None = None) -> None:
        job = self._job_of(node)
        if node.drained and not (job and node.name in job.members):
            return  # evicted ahead of its fault: it fails on the bench
        if lost:
            node.down = True
            self.down.add(node.name)
            detect = self.scenario.timings.node_loss_detect_s
        else:
            verdict = verdict or verdict_of_xid(self.rng.choice(GPU_FAULT_XIDS), self.now)
            if verdict.health < health.FAILING:
                return  # an XID the health policy only watches (13 alone, 63): training goes on
            node.health, node.reason = verdict.health, verdict.reasons[0] if verdict.reasons else ""
            if not self.scenario.policy.predictive_eviction and node.health is health.FAILING:
                node.health = health.FAILED  # no checkpoint before the eviction: the fault ends training now
            detect = self.scenario.timings.gpu_fault_detect_s
        self.touched(node)
        if not node.drained and (job is None or node.name not in job.members):
            self.take_out(node)  # an idle node or a spare: drained by the health policy or liveness
        if job is not None and node.name in job.members:
            job.broken(sudden=True, node=node.name)
            self.at(self.now + detect, job.decide)
        elif job is not None:
            self.at(self.now + detect, job.decide)

    def _straggle(self, node: SimNode, faults: int) -> None:
        if faults != node.faults or node.down or node.drained or node.slow:
            return
        node.slow = True
        self.slow.add(node.name)
        job = self._job_of(node)
        if job is None or node.name not in job.members:
            return
        job.speed_changed()
        if self.scenario.policy.evict_stragglers:
            self.check_straggler(node, job)

    def check_straggler(self, node: SimNode, job: SimJob) -> None:
        """The straggler detector's next verdict on a slow node, straggler_detect_s from now (30 steps of reports):
        one pending at a time per node, as the controller judges each report once."""
        if node.name not in self.checking:
            self.checking.add(node.name)
            self.at(self.now + self.scenario.timings.straggler_detect_s, self._straggler_found, node, job)

    def _straggler_found(self, node: SimNode, job: SimJob) -> None:
        """The straggler detector's verdict, as the controller reaches it (controller.recovery.progress): the slow
        rank's computes against its peers'; the lifecycle then checkpoints and evicts."""
        self.checking.discard(node.name)
        if not node.slow or not job.in_quorum(node.name) or job.job.state != table.RUNNING:
            return
        step = job.shape.step_s
        slow = step * (1 + self.scenario.failures.straggler_slowdown)
        names = job.node_list  # (one rank a node, in rank order: lifecycle.rank_table)
        rank_of = {name: names.index(name) for name in (node.name, *names[:4])}
        other = next(n for n in names if n != node.name) if len(names) > 1 else None
        if other is None:
            return
        tracks = {}
        base = int(self.now / step)  # the steps go on from one generation to the next
        for name, compute in ((node.name, slow), (other, step), *((n, step) for n in names[2:4]
                                                                  if n != node.name)):
            track = RankTrack(last_advance=self.now, last_report=self.now)
            # This generation's reports: two at the job's own pace (the first carries the start-up), then three
            # of 30 steps since the node turned slow, when every rank waits for the slow one each step.
            track.observe(base + 30, step, [step] * 30, self.now, 30)
            track.observe(base + 60, step, [step] * 30, self.now, 30)
            for k in range(3, 6):
                track.observe(base + 30 * k, slow, [compute] * 30, self.now, 30)
            tracks[rank_of[name]] = track
        job.judge(tracks)
        if node.slow and job.in_quorum(node.name) and job.job.state == table.RUNNING:
            # Not acted on: held back (a bound on evictions), or another incident came first in the same step (a
            # replica group's fault leaves the other groups training, this one's straggler among them). The
            # controller judges every report; here, the next report's verdict is looked at again.
            self.check_straggler(node, job)
