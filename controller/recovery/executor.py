"""The one executor of the job lifecycle: builds each job's view, steps it, and applies the actions.

A pass steps every job that is not over (pending ones by priority, then submission, so placement
sees earlier placements); each job is stepped again while its step commits something. Commits go to
the store before anything else of the same step happens; launches, stops and checkpoint requests go
out as tasks whose outcomes land in the job's entry and wake the loop. All waiting is on the
injected clock: `WakeAt` sets a timer on it, so under a fake clock a whole recovery plays out as fast
as the clock is moved.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from controller.errors import FailedPrecondition
from controller.jobs.placement import Candidate
from controller.lighthouse import LighthouseError, Lighthouses, looks
from controller.nodes.states import DOWN
from controller.recovery import lifecycle
from controller.recovery import snapshots as snapshot_plan
from controller.recovery.detectors import NodeView
from controller.recovery.entry import JobEntry, PendingCheckpoint
from controller.recovery.table import (
    ACTIVE,
    CANCELLING,
    CHECKPOINTING,
    EVICTING,
    LAUNCHING,
    PENDING,
    RANK_RUNNING,
    RESTARTING,
    RUNNING,
    TERMINAL,
)
from phalanx import clock as clocks
from phalanx import log, slurm
from phalanx.rpc import peer_host
from phalanx.v1 import node_pb2

if TYPE_CHECKING:
    from collections import Counter

    from controller import access
    from controller.config import JobsConfig
    from controller.jobs.topology import ClusterTopology
    from controller.nodes.registry import NodeEntry, Registry
    from controller.obs.stats import Buckets
    from phalanx.clock import Clock


class Jobs(Protocol):
    """What the executor needs of the job manager, which implements it (controller/jobs/manager.py): the jobs'
    entries and their lock, the nodes, the clock, the store's commits and event log, and the counters for metrics.
    The executor never imports the manager; the manager owns the executor."""

    entries: dict[str, JobEntry]
    registry: Registry
    cfg: JobsConfig
    clock: Clock
    lock: asyncio.Lock
    access_policy: access.Policy | None
    own_work_at: dict[str, float]  # node -> when Phalanx last started its own work there (standbys)
    ended_ranks: set[str]  # ended jobs whose running ranks ended since (save_ended_ranks)
    incidents: Counter
    restarts_by_cause: Counter
    recovery_s: dict[str, Buckets]
    lighthouses: Lighthouses | None  # torchft's, for replica-group jobs

    def now(self) -> float: ...

    def policy(self) -> lifecycle.Policy: ...

    def topology(self) -> ClusterTopology: ...

    def fenced(self, node: str, job: str, generation: int) -> None: ...

    async def save(self, entry: JobEntry, commit: lifecycle.Commit) -> None: ...

    async def log(self, event: lifecycle.Event, job: str) -> None: ...

    async def save_ended_ranks(self) -> None: ...

    async def forget_ended(self) -> None: ...

    async def no_lighthouse(self, job_id: str, why: str) -> None: ...

    async def lighthouse(self, entry: JobEntry) -> None: ...


logger = log.get("recovery")

MAX_STEPS = 16  # steps of one job in one pass; each commits, so this bounds a pass, not a recovery
LONG_PASS_S = 0.05  # a pass at least this long is followed by as long a rest (rest_after)
MAX_REST_S = 1.0
# A job that ends waits this long at most for the Slurm drains of its evicted nodes (slurm.adrain: 3 tries of
# 15 s at most): `phalanx run` exits when the job ends, and a requeued Slurm job could land on a node not drained.
SLURM_DRAIN_WAIT_S = 10.0
LIGHTHOUSE_LOOK_S = 2.0  # a running replica-group job's lighthouse found gone is started again at once, then again
LIGHTHOUSE_LOOK_MAX_S = 60.0  # after this long, doubling up to this (while starts fail)
# A replica group's torchft manager asks for its quorum this many times before its step fails (unless the job's own
# environment sets TORCHFT_QUORUM_RETRIES): a lighthouse gone (it died, its host was lost) is started again by the
# controller within seconds, and the groups carry on with it. torchft waits its quorum timeout / (this + 1) between
# tries after an error (0.1 s at least), so a manager rides out a lighthouse's absence of about its quorum timeout.
QUORUM_RETRIES = 20
PREPARE_HOLD_S = 120.0  # a spare holds standbys this long unless asked again (lifecycle.PREPARE_RENEW_S)


def rest_after(took: float) -> float:
    """Seconds to leave the event loop to everything else after a pass whose views and decisions took `took` of its
    CPU (not what ran on the loop while the pass awaited the store): as long, from LONG_PASS_S up to MAX_REST_S;
    none after a short one. While a job launches, checkpoints, evicts or stops, every heartbeat of its nodes wakes a
    pass, and passes back to back over a job of thousands of nodes (about 0.09 s each at 16,384 nodes x 8 ranks
    here: bench job-heartbeats) would leave the loop little time to read those heartbeats, whose lag is what
    declares a node SUSPECT. With the rest, passes take at most about half the loop; a decision waits at most one
    pass longer."""
    return min(took, MAX_REST_S) if took >= LONG_PASS_S else 0.0


@dataclass
class _Fleet:
    """Every node as placement sees it, built once for the steps of a pass that see the whole fleet (pending jobs,
    jobs choosing their next nodes or holding spares again): a queue of jobs each building it cost about 70 ms a job
    at 16,384 nodes. Made again after a commit that places a job, frees nodes or holds spares, and whenever what
    placement sees of a node changed since (Registry.changes: its record, session, health verdict); dropped as
    the pass ends."""

    candidates: dict[str, Candidate]  # every node; one held by any active job is not free
    holders: dict[str, set[str]]  # node -> the active jobs holding it (its nodes and spares)
    topology: ClusterTopology
    changes: int  # Registry.changes when it was made


class Executor:
    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self._wake = asyncio.Event()
        self._timer = None
        self._timer_at: float | None = None
        self._tasks: set[asyncio.Task] = set()  # stops and checkpoint requests on their way
        self._slurm_drains: dict[str, list[asyncio.Task]] = {}  # job -> the Slurm drains of its evicted nodes
        # job -> (when its lighthouse, found gone, was last looked for; how long until the next look)
        self._lighthouse_looked: dict[str, tuple[float, float]] = {}
        self.pass_cpu = 0.0  # CPU the current pass's views and decisions took (its awaits excluded)
        self._fleet: _Fleet | None = None  # until the pass ends, a commit moves nodes or a node changes (fleet)
        self.rest_after = rest_after  # (a world in virtual time sets none: a rest measured in real CPU would make
        # its timeline depend on the host's speed)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """The loop: a pass on every change (submit, node or rank news, an outcome, a timer) and at least every
        `jobs.schedule_interval_s`; a pass that fails is logged and the loop goes on."""
        clock = self.jobs.clock
        while True:
            try:
                await clocks.wait_for(clock, self._wake.wait(), self.jobs.cfg.schedule_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            self.pass_cpu = 0.0
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("scheduler pass failed; will retry")
            if rest := self.rest_after(self.pass_cpu):
                await clock.sleep(rest)

    async def run_pass(self) -> None:
        self._fleet = None  # (the nodes changed since the last pass, most likely)
        if self.jobs.ended_ranks:
            await self.jobs.save_ended_ranks()
        entries = list(self.jobs.entries.values())
        pending = sorted((e for e in entries if e.job.state == PENDING),
                         key=lambda e: (-e.job.spec.priority, e.job.submitted_unix_ns))
        for entry in [*pending, *(e for e in entries if e.job.state in ACTIVE)]:
            try:
                self.retell_checkpoint(entry)
                self._look_after_lighthouse(entry)
                await self.advance(entry)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("job step failed; will retry", job=entry.job.id,
                                 generation=entry.job.generation)
        for gone in [j for j in self._lighthouse_looked if (e := self.jobs.entries.get(j)) is None or
                     e.job.state not in ACTIVE]:
            del self._lighthouse_looked[gone]
        await self.jobs.forget_ended()  # last: the records of ended jobs past the retention
        self._fleet = None

    async def advance(self, entry: JobEntry) -> None:
        """Step one job until its step commits nothing more."""
        for _ in range(MAX_STEPS):
            async with self.jobs.lock:
                if entry.job.state in TERMINAL:
                    return
                with _bound(entry):
                    now = self.jobs.now()
                    started = time.thread_time()  # (the view and the decision: what a job's size costs, all on
                    actions = lifecycle.plan(entry.job, lambda fleet: self.view(entry, fleet), now,  # the loop)
                                             self.jobs.policy())
                    self.pass_cpu += time.thread_time() - started
                    committed = await self.apply(entry, actions, now)
            if not committed:
                return

    # -- the view ------------------------------------------------------------------------------

    def view(self, entry: JobEntry, fleet: bool) -> lifecycle.JobView:
        """What lifecycle.step sees of the job: its own nodes, and with `fleet` every node as placement sees it
        (lifecycle.plan says when)."""
        job = entry.job
        find = self.jobs.registry.find
        names = dict.fromkeys([*job.nodes, *job.spares, *job.incident_nodes])
        known = [node for n in names if (node := find(n)) is not None]
        monotonic, now = self.jobs.clock.monotonic(), self.jobs.now()  # (one reading for every node of the view)
        quiet_s, own_work_at = 1.5 * self.jobs.registry.policy.heartbeat_interval_s, self.jobs.own_work_at.get
        views = {node.record.name: _node_view(node, monotonic, now, quiet_s, own_work_at) for node in known}
        told, stopped, running = self._stops(entry, views, monotonic)
        since_ns = job.state_since_unix_ns if job.state == RUNNING else 0
        return lifecycle.JobView(
            nodes=views, told=told, stopped=stopped, running=running, tracks=entry.tracks, fatal=dict(entry.fatal),
            nccl={r: s for r, s in entry.nccl.items() if s.dump_time_unix_ns >= since_ns},
            launch=entry.launch if entry.launch is not None and entry.launch.generation == job.generation else None,
            checkpoint=entry.checkpoint.view() if entry.checkpoint is not None else None,
            candidates=self._candidates_for(job) if fleet else {},
            topology=self.fleet().topology if fleet else None, fleet=fleet, reported=entry.reported,
            missing=entry.missing, ended=entry.ended, prepared=entry.prepared, pinned=entry.pinned,
            snapshot_step=entry.safe[1] if entry.safe is not None and entry.safe[0] == job.generation else None)

    def _stops(self, entry: JobEntry, views: Mapping[str, NodeView],
               monotonic: float) -> tuple[set[str], set[str], AbstractSet[str]]:
        """How far this process's stop of the job's generation has got on each node of the view (JobView.told,
        .stopped, .running): told (on the node's current session, and lately), confirmed stopped by a heartbeat since,
        and showing ranks of the generation running. Told and stopped are of the nodes told to stop (a few, or none
        while the job runs); running is looked up for a node when a step asks (only a stop's end does): not a pass
        over every node's heartbeat at each step of a job of thousands of nodes."""
        job, told, stopped, find = entry.job, set(), set(), self.jobs.registry.find
        for name, stop in entry.stops.items():  # None: on its way; (session, heartbeats, when): taken
            node = find(name) if name in views else None
            if node is None:
                continue
            taken = bool(stop) and stop[0] is node.session
            if stop is None or (taken and monotonic - stop[2] < lifecycle.RESTOP_S):
                told.add(name)
            if taken and not _runs(job, node) and _after(node, stop):
                stopped.add(name)
        return told, stopped, _Running(job, views, find)

    def holders(self) -> dict[str, set[str]]:
        """node -> the active jobs holding it (as a node or a spare)."""
        holders: dict[str, set[str]] = {}
        for e in self.jobs.entries.values():
            if e.job.state in ACTIVE:
                for n in [*e.job.nodes, *e.job.spares]:
                    holders.setdefault(n, set()).add(e.job.id)
        return holders

    def candidates(self, holders: Mapping[str, set[str]] | None = None) -> list[Candidate]:
        """Every node as placement sees it; one an active job holds (`holders`) is not free."""
        holders = self.holders() if holders is None else holders
        return [Candidate.of(e.record.name, e.record.state, e.verdict.health, e.record.name not in holders,
                             # a node whose health a takeover has not judged yet is not placed on until it is
                             e.gpu_count(), connected=e.session is not None and not e.judge_deferred,
                             drained=bool(e.record.drain_reason))
                for e in self.jobs.registry.entries()]

    def fleet(self) -> _Fleet:
        """The fleet as placement sees it, for this pass (until a commit moves nodes or a node changes)."""
        registry = self.jobs.registry
        if self._fleet is None or self._fleet.changes != registry.changes:
            holders, changes = self.holders(), registry.changes
            self._fleet = _Fleet({c.name: c for c in self.candidates(holders)}, holders, self.jobs.topology(), changes)
        return self._fleet

    def _candidates_for(self, job) -> dict[str, Candidate]:
        """The fleet as `job` sees it: only the nodes of its Slurm allocation (spec.within), when it has one, and
        its own nodes and spares free (it is being re-placed, or holds spares again), in the registry's order."""
        fleet = self.fleet()
        candidates = fleet.candidates
        if job.spec.within:
            allowed = set(job.spec.within)
            candidates = {n: c for n, c in candidates.items() if n in allowed}
        own = [n for n in dict.fromkeys([*job.nodes, *job.spares]) if fleet.holders.get(n) == {job.id}
               and n in candidates]
        if own:
            candidates = dict(candidates) if candidates is fleet.candidates else candidates
            for n in own:  # (its place in the order kept)
                candidates[n] = replace(candidates[n], free=True)
        return candidates

    # -- the actions ----------------------------------------------------------------------------

    async def apply(self, entry: JobEntry, actions: list[lifecycle.Action], now: float) -> bool:
        """Carry out `actions` in order (lock held); True if any committed. A failed commit raises, and
        nothing after it happens."""
        committed = False
        for action in actions:
            match action:
                case lifecycle.Commit():
                    await self._commit(entry, action)
                    committed = True
                case lifecycle.Launch(generation=generation, nodes=nodes):
                    entry.launch = lifecycle.LaunchView(generation)
                    entry.launch_task = asyncio.create_task(self._launch(entry, generation, nodes),
                                                            name=f"launch-{entry.job.id}-{generation}")
                case lifecycle.Stop(nodes=nodes, generation=generation):
                    for node in nodes:
                        before, entry.stops[node] = entry.stops.get(node), None
                        self._spawn(self._stop(entry, node, generation, before), f"stop-{entry.job.id}-{node}")
                case lifecycle.Drain(node=node, reason=reason):
                    try:  # (the drain's commit counts in Registry.changes: the fleet is looked at again)
                        await self.jobs.registry.drain(node, reason)
                    except Exception as e:  # a node that vanished meanwhile needs no drain
                        logger.warning("could not drain an evicted node", node=node, error=str(e))
                case lifecycle.RequestCheckpoint():
                    self._request_checkpoint(entry, action)
                case lifecycle.WakeAt(at=at):
                    self._wake_at(at, now)
                case lifecycle.Prepare(node=node, count=count):
                    self._prepare(entry, node, count, now)
                case lifecycle.Pin(step=step):
                    entry.pinned = (entry.job.generation, step)
                    self.pin_snapshot(entry, step)
                case lifecycle.LeaveQuorum(group=group, reason=reason):
                    self._leave_quorum(entry, group, reason)
                case lifecycle.Event(kind=kind, message=message):
                    await self.jobs.log(action, entry.job.id)
                    logger.info(kind.removeprefix("job."), job=entry.job.id, generation=entry.job.generation,
                                detail=message)
        return committed

    async def _commit(self, entry: JobEntry, commit: lifecycle.Commit) -> None:
        old, job = entry.job, commit.job
        before = old.state
        moves = (before in ACTIVE) != (job.state in ACTIVE) or old.nodes != job.nodes or old.spares != job.spares
        drains = self._slurm_drains.pop(entry.job.id, []) if commit.job.state in TERMINAL else []
        if drains:  # the job's end lets its Slurm job go on (a requeue): not onto a node whose drain is on its way
            await asyncio.wait(drains, timeout=SLURM_DRAIN_WAIT_S)
        try:
            await self.jobs.save(entry, commit)
        finally:
            if moves:  # a job placed, or nodes freed, held or let go: the fleet looked at again
                self._fleet = None
        if commit.incident:
            self.jobs.incidents[commit.incident] += 1
            if entry.incident_at is None:  # a restart that fails is the same recovery going on
                entry.incident_at, entry.incident_kind = self.jobs.clock.monotonic(), commit.incident
        if job.state == EVICTING and before != EVICTING and job.spec.slurm_job_id and self.jobs.cfg.slurm_drain:
            for node in job.incident_nodes:  # Slurm must not schedule on it either (already drained here or not)
                drains = [t for t in self._slurm_drains.get(job.id, []) if not t.done()]  # a recovery's before
                drains.append(self._spawn(self._slurm_drain(job, node, f"evicted from {job.id}: {job.incident}"),
                                          f"slurm-drain-{node}"))
                self._slurm_drains[job.id] = drains
        if job.state == RESTARTING and before != RESTARTING:
            self.jobs.restarts_by_cause[entry.incident_kind or job.incident_kind or "resumed"] += 1
        if job.state == RUNNING and before in LAUNCHING and entry.incident_at is not None:
            self.jobs.recovery_s[entry.incident_kind].observe(self.jobs.clock.monotonic() - entry.incident_at)
            entry.incident_at = None
        if job.state in TERMINAL:
            entry.incident_at = None  # a recovery that ends the job is no recovery
            if entry.launch_task is not None:
                entry.launch_task.cancel()

    async def _slurm_drain(self, job, node: str, reason: str) -> None:
        """Drain an evicted node in Slurm as well, so that Slurm schedules nothing more on it; an event says
        whether it worked (a controller host without Slurm's config cannot)."""
        why = await slurm.adrain(self.jobs.cfg.scontrol, node, f"{slurm.EVICTED} {reason}")
        message = (f"node {node} drained in Slurm (job {job.spec.slurm_job_id}): {reason}" if not why else
                   f"node {node} could not be drained in Slurm (job {job.spec.slurm_job_id}): {why}")
        (logger.info if not why else logger.warning)("slurm drain", node=node, job=job.id, detail=message)
        await self.jobs.log(lifecycle.Event("job.slurm_drain" if not why else "job.slurm_drain_failed", message),
                            job.id)

    def _wake_at(self, at: float, now: float) -> None:
        if self._timer_at is not None and self._timer_at <= at and self._timer_at > now:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.jobs.clock.call_later(max(0.0, at - now), self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, None
        self.wake()

    async def _launch(self, entry: JobEntry, generation: int, only: tuple[str, ...] = ()) -> None:
        """Ask the first node for a port (MASTER_PORT), then every node to start its ranks; the outcome
        lands in the entry and the lifecycle decides. A replica-group job's groups are process groups of their own:
        each has its first node's address and port, and `only` launches one group's nodes alone (its rebuild)."""
        job = entry.job
        registry = self.jobs.registry
        try:
            policy = self.jobs.access_policy  # the record is not trusted: its run_as is checked every time
            refused = policy.launchable(job.user, job.spec.run_as) if policy is not None else ""
            if refused:
                raise FailedPrecondition(refused)
            grouped = lifecycle.grouped(job)
            lighthouse = await self._lighthouse(job) if grouped else ""
            k = len(job.nodes) // job.spec.replicas if grouped else len(job.nodes)
            launched = set(only)  # (a set: a group of 8,192 nodes searched in a tuple for each node is 67M compares)
            indexes = [i for i, n in enumerate(job.nodes) if not only or n in launched]
            masters: dict[int, tuple[str, int]] = {}  # the first node of each group launched -> (address, port)
            for first in sorted({i // k * k for i in indexes}):
                master = registry.get(job.nodes[first])
                port = (await _session(master).request(node_pb2.Command(reserve_port=node_pb2.ReservePort()))).port
                masters[first] = (master.inventory().address or peer_host(master.peer), port)
            nodes = registry.entries_by_name()
            restore = None if grouped else await self._restore_plan(entry, nodes)  # a group recovers from a peer
            await self._grant_snapshots(job, restore, nodes)
            await asyncio.gather(*(self._launch_node(job, i, nodes, *masters[i // k * k], restore, k, lighthouse)
                                   for i in indexes))
            address, port = masters[min(masters)]
            outcome = lifecycle.LaunchView(generation, done=True, ok=True, address=address, port=port)
            if lighthouse and not only:  # every node launched was told it (its agent relays it)
                entry.lighthouse_told, entry.lighthouse_untold = lighthouse, set()
            elif lighthouse and lighthouse != entry.lighthouse_told:  # told an address since replaced: again
                entry.lighthouse_untold |= set(only)
        except asyncio.CancelledError:
            return  # cancelled meanwhile: the cancel stops whatever started
        except Exception as e:  # any node refusing or unreachable fails the whole gang
            logger.warning("launch failed", job=job.id, generation=generation, error=str(e))
            outcome = lifecycle.LaunchView(generation, done=True, ok=False, error=str(e))
        if entry.launch is not None and entry.launch.generation == generation:
            entry.launch = outcome
        self.wake()

    async def _grant_snapshots(self, job, restore: snapshot_plan.Restore | None,
                               nodes: dict[str, NodeEntry]) -> None:
        """Tell the generation's nodes, and every node its ranks restore from, that the generation's nodes (and only
        they) may put and get the job's snapshots there. Before the launch: a rank's first replica and a restore's
        first read come after it. A node that cannot be told serves the job's snapshots to no one (a restore from
        it falls back to the disk checkpoint, saying so)."""
        targets = set(job.nodes)
        if restore is not None:
            targets |= set(restore.sources.values()) | {n for also in restore.also.values() for n in also}
        grant = node_pb2.GrantSnapshots(job=job.id, nodes=list(job.nodes))
        sessions = {name: nodes[name].session for name in sorted(targets)
                    if name in nodes and nodes[name].session is not None}
        results = await asyncio.gather(*(session.request(node_pb2.Command(grant_snapshots=grant),
                                                         timeout=self.jobs.cfg.launch_timeout_s)
                                         for session in sessions.values()), return_exceptions=True)
        for name, result in zip(sessions, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("snapshot grant not delivered", job=job.id, node=name, error=str(result))

    async def _restore_plan(self, entry: JobEntry, nodes: dict[str, NodeEntry]) -> snapshot_plan.Restore | None:
        """Where each rank of the generation about to start finds its in-memory snapshot of the last one, if every
        rank's survives; the event log says which, or why the disk checkpoint decides."""
        job = entry.job
        if job.generation <= 1:
            return None
        per = job.spec.ranks_per_node
        up = {name for name, n in nodes.items() if n.session is not None and n.record.state is not DOWN
              and n.inventory().snapshot_address}  # every source is one of these: every rank is told, or none
        placement = {i * per + local: node for i, node in enumerate(job.nodes) for local in range(per)}
        restore, why = snapshot_plan.plan(entry.snapshots, job.generation - 1, len(placement), up, placement)
        if restore is None:
            if entry.snapshots:
                await self.jobs.log(lifecycle.Event("job.snapshot_fallback", f"{job.id} generation {job.generation}: "
                                                    f"{why}; resuming from the newest durable checkpoint"), job.id)
            return None
        fetched = sorted({node for rank, node in restore.sources.items() if node != placement[rank]})
        older = f": {why}" if why else ""  # the generation just ended left no whole step
        await self.jobs.log(lifecycle.Event("job.snapshot_restore", f"{job.id} generation {job.generation}: every rank "
                                            f"restores from its in-memory snapshot of step {restore.step} (generation "
                                            f"{restore.generation}{older})" +
                                            (f", fetched from {', '.join(fetched)}" if fetched else "")), job.id)
        return restore

    def _look_after_lighthouse(self, entry: JobEntry) -> None:
        """A running replica-group job whose lighthouse is gone (its process died; taken up by no one) has one
        started again, on the port its ranks were told if it is free: their managers ask it again (QUORUM_RETRIES)
        and carry on. Looked for at most every LIGHTHOUSE_LOOK_S (a start that fails is said in the job's event log,
        once). The job's nodes are told where it runs whenever that changes (their agents relay it to the ranks)."""
        job, lighthouses = entry.job, self.jobs.lighthouses
        if lighthouses is None or lighthouses.closed or not job.lighthouse_port or job.state != RUNNING or \
                job.spec.replicas <= 1 or not lighthouses.available() or lighthouses.starting(job.id):
            return
        held = lighthouses.held(job.id)
        now = self.jobs.clock.monotonic()
        if held is not None:
            if now - self._lighthouse_looked.get(job.id, (-math.inf, 0.0))[0] >= LIGHTHOUSE_LOOK_MAX_S:
                self._lighthouse_looked.pop(job.id, None)  # (up for a while: one that died again is looked for at once)
            self._tell_lighthouse(entry, held.url())
            for group in job.groups:  # told again while they stop: a lighthouse started since knows nothing of it, and
                if group.state == lifecycle.GROUP_STOPPING:  # a manager of theirs it had not heard yet is caught now
                    held.drop(group.index, group.reason or "it is stopping")
            return
        at, wait = self._lighthouse_looked.get(job.id, (-math.inf, LIGHTHOUSE_LOOK_S / 2))
        if now - at < wait:
            return
        self._lighthouse_looked[job.id] = (now, min(wait * 2, LIGHTHOUSE_LOOK_MAX_S))  # (a start that fails: less
        logger.warning("lighthouse gone: starting it again", job=job.id, port=job.lighthouse_port)  # often)
        self._spawn(self.jobs.lighthouse(entry), f"lighthouse-{job.id}")

    def _tell_lighthouse(self, entry: JobEntry, url: str) -> None:
        """Tell the job's nodes that have not heard it that its lighthouse runs at `url` (once each, and again to one
        whose agent was away). Their agents relay the ranks' TORCHFT_LIGHTHOUSE there (agent/lighthouse_relay.py)."""
        if entry.lighthouse_told != url:
            entry.lighthouse_told, entry.lighthouse_untold = url, set(entry.job.nodes)
        if not entry.lighthouse_untold:
            return
        members = entry.of_record("node_set", lambda job: frozenset(job.nodes))
        for node in list(entry.lighthouse_untold):
            if node not in members:
                entry.lighthouse_untold.discard(node)
            elif self.jobs.registry.in_session(node):
                entry.lighthouse_untold.discard(node)
                self._spawn(self._send_lighthouse(entry, node, url), f"lighthouse-{entry.job.id}-{node}")

    async def _send_lighthouse(self, entry: JobEntry, node: str, url: str) -> None:
        """Told again once its agent is back if none heard it (an agent's refusal, an earlier release's that knows
        no such command, is not told again: its ranks were not relayed)."""
        told = node_pb2.Command(lighthouse=node_pb2.LighthouseAddress(job=entry.job.id, url=url))
        if not await self._send(node, told) and entry.lighthouse_told == url and \
                not self.jobs.registry.in_session(node):
            entry.lighthouse_untold.add(node)

    def _leave_quorum(self, entry: JobEntry, group: int, reason: str) -> None:
        """Tell the job's lighthouse that `group` leaves the quorum now. Not held here (none, or one being taken up
        again): it drops the group when its heartbeats stop."""
        held = self.jobs.lighthouses.held(entry.job.id) if self.jobs.lighthouses is not None else None
        told = held is not None and held.drop(group, reason)
        logger.info("group out of the quorum", job=entry.job.id, group=group,
                    how="the lighthouse told" if told else "when its heartbeats stop (the lighthouse was not told)")

    async def _lighthouse(self, job) -> str:
        """The URL of the replica-group job's lighthouse: the one looked after here, else the one its record names
        taken up, else one started here (on the port its ranks were told if any and free: Lighthouses.ensure); ""
        without one (no lighthouse of the controller's). Raises FailedPrecondition when one should run and cannot
        start: the launch fails with the reason, and the lifecycle decides."""
        lighthouses = self.jobs.lighthouses
        if lighthouses is None:
            return ""
        if not lighthouses.available():  # not asked for: the job runs without one
            await self.jobs.no_lighthouse(job.id, "[replicas] lighthouse = false; its ranks are not told "
                                          "TORCHFT_LIGHTHOUSE")
            return ""
        try:
            return (await lighthouses.ensure(job.id, **looks(job, (e.job for e in self.jobs.entries.values())))).url()
        except LighthouseError as e:
            raise FailedPrecondition(f"no torchft lighthouse for its replica groups: {e}") from None

    async def _launch_node(self, job, index: int, registry: dict[str, NodeEntry], master_addr: str,
                           master_port: int, restore: snapshot_plan.Restore | None, k: int,
                           lighthouse: str = "") -> None:
        """Start node `index`'s ranks. In a job of replica groups of `k` nodes each, RANK, WORLD_SIZE and the master
        are its group's (torchft's convention: each group is launched as a torchrun of its own would be, with
        REPLICA_GROUP_ID and NUM_REPLICA_GROUPS); PHALANX_RANK and PHALANX_WORLD_SIZE are the job's."""
        spec, per = job.spec, job.spec.ranks_per_node
        world = k * per
        group, first = index // k, index // k * k
        common = {
            **spec.env,
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(index - first), "GROUP_WORLD_SIZE": str(k),
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world),
            "TORCHELASTIC_RESTART_COUNT": str(job.generation - 1),
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": job.id,
            "PHALANX_JOB": job.id, "PHALANX_GENERATION": str(job.generation),
            "PHALANX_WORLD_SIZE": str(len(job.nodes) * per),
        }
        if lifecycle.grouped(job):
            common.update(REPLICA_GROUP_ID=str(group), NUM_REPLICA_GROUPS=str(job.spec.replicas),
                          TORCHELASTIC_RUN_ID=f"{job.id}-group{group}", PHALANX_REPLICA_GROUP=str(group))
            if lighthouse:
                common["TORCHFT_LIGHTHOUSE"] = lighthouse
                common.setdefault("TORCHFT_QUORUM_RETRIES", str(QUORUM_RETRIES))
        if spec.checkpoint_dir:
            common["PHALANX_CHECKPOINT_DIR"] = spec.checkpoint_dir
        if len(job.nodes) > 1:  # this node's ranks' snapshots are replicated to the next node of the job
            peer = registry.get(job.nodes[(index + 1) % len(job.nodes)])
            common["PHALANX_SNAPSHOT_PEER"] = _snapshot_peer(peer) if peer is not None else ""
        ranks = []
        for local in range(per):
            rank = index * per + local
            env = {"RANK": str(rank - first * per), "LOCAL_RANK": str(local), "ROLE_RANK": str(rank - first * per),
                   "CUDA_VISIBLE_DEVICES": str(local), "PHALANX_RANK": str(rank)}
            source = registry.get(restore.sources.get(rank, "")) if restore is not None else None
            if source is not None:  # generation:step:where its snapshot is served from[,where else, in turn]
                others = [registry[n] for n in restore.also.get(rank, ()) if n in registry]
                where = ",".join(_snapshot_peer(n) for n in [source, *others])
                env["PHALANX_RESTORE"] = f"{restore.generation}:{restore.step}:{where}"
            ranks.append(node_pb2.RankLaunch(rank=rank, local_rank=local, gpu=local, env=env))
        session = _session(self.jobs.registry.get(job.nodes[index]))
        await session.request(node_pb2.Command(launch=node_pb2.LaunchRanks(
            job=job.id, generation=job.generation, command=spec.command, env=common, workdir=spec.workdir,
            ranks=ranks, run_as=spec.run_as, limits=spec.limits)), timeout=self.jobs.cfg.launch_timeout_s)

    async def _stop(self, entry: JobEntry, node: str, generation: int, before: tuple | None = None) -> None:
        """Tell one node to stop a generation; once its agent took the command, the session, heartbeat count and
        command id are remembered, so a later heartbeat (one that says it came after the command) can confirm the
        ranks are gone. A stop told again on the same session keeps the first one's: any heartbeat since the first
        can confirm."""
        target = self.jobs.registry.find(node)  # (one stop a node: a copy of the fleet's map for each is quadratic)
        session = target.session if target is not None else None
        taken = None
        if session is not None:
            try:
                command = node_pb2.Command(stop=node_pb2.StopRanks(
                    job=entry.job.id, generation=generation, grace_s=self.jobs.cfg.stop_grace_s,
                    final=entry.job.state == CANCELLING))
                await session.request(command)  # which gives it its id
                first = before if before and before[0] is session else (session, target.heartbeats, 0.0, command.id)
                taken = (session, first[1], self.jobs.clock.monotonic(), first[3])
                self.jobs.fenced(node, entry.job.id, generation)
            except Exception as e:
                logger.warning("stop failed", job=entry.job.id, node=node, generation=generation, error=str(e))
        if self._node_generation(entry, node) == generation and entry.stops.get(node, False) is None:
            if taken is None:
                entry.stops.pop(node, None)  # told again when its agent is back
            else:
                entry.stops[node] = taken
        self.wake()

    def _node_generation(self, entry: JobEntry, node: str) -> int:
        """The generation the job's ranks on `node` run: the job's, or (replica groups) their group's."""
        job = entry.job
        return entry.of_record("generations", lifecycle.node_generations).get(node, job.generation) if job.groups \
            else job.generation

    def _request_checkpoint(self, entry: JobEntry, action: lifecycle.RequestCheckpoint) -> None:
        request = action.request
        entry.checkpoint = PendingCheckpoint(request.id, action.generation,
                                             len(action.nodes) * entry.job.spec.ranks_per_node, job=action.job,
                                             request=request)
        for node in action.nodes:
            self._tell_checkpoint(entry.checkpoint, node)

    def _tell_checkpoint(self, pending: PendingCheckpoint, node: str) -> None:
        request = pending.request
        deadline_s = max(0.0, request.deadline_unix_ns / 1e9 - self.jobs.now())
        entry = self.jobs.entries.get(pending.job)
        generation = pending.generation  # (a replica group rebuilt since the others started runs a newer one)
        if entry is not None and entry.job.groups:
            generation = self._node_generation(entry, node)
        command = node_pb2.Command(checkpoint=node_pb2.RequestCheckpoint(
            job=pending.job, generation=generation, request_id=request.id, deadline_s=deadline_s,
            reason=request.reason, pause=request.pause, at_step=request.at_step))
        pending.untold.discard(node)
        self._spawn(self._send_checkpoint(pending, node, command), f"checkpoint-{pending.job}-{node}")

    async def _send_checkpoint(self, pending: PendingCheckpoint, node: str, command: node_pb2.Command) -> None:
        if not await self._send(node, command) and not self.jobs.registry.in_session(node):  # none heard it (not
            pending.untold.add(node)  # an agent's refusal): told again once its agent is back (retell_checkpoint)

    def retell_checkpoint(self, entry: JobEntry) -> None:
        """Tell the pending checkpoint request to the job's nodes it has not reached, once their agents are back. A
        controller that took over or restarted during a recovery may ask before the agents have come back: the
        request went nowhere, and the job waited out the whole deadline (20 s) on a FAILING GPU."""
        pending = entry.checkpoint
        if pending is None or not pending.untold or pending.request is None or entry.job.state != CHECKPOINTING or \
                pending.generation != entry.job.generation or len(pending.acks) >= pending.ranks:
            return
        for node in sorted(pending.untold):
            if self.jobs.registry.in_session(node):
                logger.info("checkpoint request told again", job=pending.job, node=node,
                            request=pending.request_id)
                self._tell_checkpoint(pending, node)

    def _prepare(self, entry: JobEntry, spare: str, count: int, now: float) -> None:
        """Ask `spare` to hold `count` standbys of the job's ranks for PREPARE_HOLD_S (0: let them go)."""
        if count:
            entry.prepared[spare] = now
        else:
            entry.prepared.pop(spare, None)
        spec = entry.job.spec
        self.send(spare, node_pb2.Command(prepare=node_pb2.PrepareRanks(
            job=entry.job.id, command=spec.command, env=spec.env, workdir=spec.workdir, count=count,
            hold_s=PREPARE_HOLD_S, run_as=spec.run_as)), f"prepare-{entry.job.id}-{spare}")

    def pin_snapshot(self, entry: JobEntry, step: int) -> None:
        command = node_pb2.Command(pin_snapshot=node_pb2.PinSnapshot(job=entry.job.id, generation=entry.job.generation,
                                                                     step=step))
        for node in entry.snapshots:
            self.send(node, command, f"pin-{entry.job.id}-{node}")

    def send(self, node: str, command: node_pb2.Command, name: str) -> None:
        """Send a command that needs no answer, in the background (a failure is logged)."""
        self._spawn(self._send(node, command), name)

    async def _send(self, node: str, command: node_pb2.Command) -> bool:
        """Whether the agent took `command`."""
        try:
            await _session(self.jobs.registry.get(node)).request(command)
            return True
        except Exception as e:  # a checkpoint is told again (retell_checkpoint); a pin when the step moves on
            logger.warning("command not delivered", node=node, command=command.WhichOneof("body"), error=str(e))
            return False


def _node_view(node: NodeEntry, monotonic: float, now: float, quiet_s: float,
               own_work_at: Callable[[str, float], float]) -> NodeView:
    """What recovery sees of a node: `now` on the job manager's clock (that of the ranks' tracks), `quiet_s` the
    silence that makes it quiet (1.5 heartbeat intervals), `own_work_at` the job manager's map's get."""
    record, verdict = node.record, node.verdict
    silence = monotonic - node.last_seen
    return NodeView(record.name, record.state is DOWN, verdict.health, verdict.reasons[0] if verdict.reasons else "",
                    connected=node.session is not None, drained=bool(record.drain_reason), quiet=silence > quiet_s,
                    heard_at=now - silence, own_work_at=own_work_at(record.name, 0.0))


def _runs(job, node: NodeEntry) -> bool:
    """Whether the node's newest heartbeat shows ranks of the job's generation (each rank's own) running."""
    beat = node.heartbeat
    return beat is not None and any(s.job == job.id and s.generation == lifecycle.rank_generation(job, s.rank)
                                    and s.state == RANK_RUNNING for s in beat.ranks)


class _Running(AbstractSet):
    """JobView.running: the nodes of the view whose newest heartbeat shows the job's generation running, each
    looked up when asked."""

    def __init__(self, job, views: Mapping[str, NodeView], find: Callable[[str], NodeEntry | None]) -> None:
        self._job, self._views, self._find = job, views, find

    def __contains__(self, name: object) -> bool:
        return name in self._views and (node := self._find(name)) is not None and _runs(self._job, node)

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._views if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _from_iterable(cls, iterable) -> frozenset:  # what &, | and - on it build
        return frozenset(iterable)


def _after(node, told: tuple) -> bool:
    """Whether the node's newest heartbeat came after it carried out the stop `told` (session, heartbeats then,
    when, command id): a later heartbeat than the one before the stop, which says so (commands_done) unless its
    agent does not say."""
    if node.heartbeats <= told[1]:  # not one since: the newest may be from before (a session resumed since counts
        return False  # its command ids afresh)
    beat = node.heartbeat
    return not (beat is not None and beat.commands_done) or beat.commands_done >= told[3]


def _bound(entry: JobEntry):
    return log.bound(job=entry.job.id, generation=entry.job.generation)


def _snapshot_peer(node: NodeEntry) -> str:
    """Where a node serves snapshot replicas, as agents dial it: NODE@HOST:PORT (a TLS peer's certificate must name
    NODE). An agent serving on all its addresses says only ":PORT"; the host is the one the node is known by."""
    address = node.inventory().snapshot_address
    if address.startswith(":"):
        host = node.inventory().address or peer_host(node.peer)
        address = f"[{host}]{address}" if ":" in host and not host.startswith("[") else f"{host}{address}"  # IPv6
    return f"{node.record.name}@{address}"


def _session(entry):
    if entry.session is None:
        raise FailedPrecondition(f"node {entry.record.name} is not connected")
    return entry.session

