"""Gang jobs: the queue, placement, launching through the agents, and following the ranks to the end.

Decisions (where a job goes, whether it is done, which ranks are stale) are made from the
registry's and the jobs' state; the I/O (store commits, commands to agents) follows them. A job's
record changes only after the store has committed the change. Ranks that belong to no current job
generation on their node are told to stop (fencing): a rank from an old generation never runs on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from controller import health as health_policy
from controller import monitors, recovery, validation
from controller.cluster_topology import ClusterTopology
from controller.config import JobsConfig, RecoveryConfig
from controller.errors import FailedPrecondition, InvalidArgument, NotFound
from controller.events import EventHub
from controller.job_recovery import RecoveryMixin
from controller.placement import Candidate, GangRequest, Unplaceable, place
from controller.registry import NodeEntry, Registry
from controller.states import DOWN, UP
from controller.stats import RECOVERY_BUCKETS_S, Buckets
from controller.store.base import EventRecord, JobRecord, Store
from phalanx import log
from phalanx.clock import Clock
from phalanx.v1 import common_pb2, node_pb2

logger = log.get("jobs")

pb = common_pb2
RECOVERING = frozenset({pb.JOB_STATE_CHECKPOINTING, pb.JOB_STATE_EVICTING, pb.JOB_STATE_RENDEZVOUS,
                        pb.JOB_STATE_RESTARTING})
ACTIVE = frozenset({pb.JOB_STATE_STARTING, pb.JOB_STATE_RUNNING, pb.JOB_STATE_CANCELLING}) | RECOVERING
TERMINAL = frozenset({pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED})
FAILED_HEALTH = health_policy.FAILED
MISSING_REPORTS_LOST = 5  # heartbeats in a row without news of a rank before it counts as lost
FENCE_REPEAT_S = 10.0


REQUEST_LATENCY_S = 5.0  # controller -> agent -> trainlib's next report, with room to spare on a loaded host
PACE_WAIT_S = 3.0  # how long a checkpoint request waits for the ranks' first report past their start-up


def pace(tracks: dict[int, monitors.RankTrack]) -> tuple[int, float]:
    """The newest step any rank reported, and the seconds a step takes now, erring fast: the ranks of a
    synchronous job share one pace, and a slow report (a save, start-up contention) overstates it, which
    would bring the agreed step too close. Without a report past a rank's start-up, the start-up one; 1.0
    without any."""
    latest = max((t.last_step for t in tracks.values()), default=-1)
    recent = [p for t in tracks.values() if (p := t.recent_pace()) > 0]
    if recent:
        return latest, min(recent)
    steps = sorted(s for t in tracks.values() for s in t.step_times())
    return latest, steps[len(steps) // 2] if steps else 1.0


def checkpoint_step(tracks: dict[int, monitors.RankTrack]) -> int:
    """The step after which every rank should save: far enough ahead that the request reaches every
    rank before it gets there, so all ranks save the same step. 0 (at once) without progress reports."""
    if not tracks:
        return 0
    latest, step_s = pace(tracks)
    return max(latest, 0) + math.ceil(REQUEST_LATENCY_S / max(step_s, 1e-3)) + 2


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: "ipv4:10.0.0.7:52344" -> "10.0.0.7", "ipv6:[::1]:5" -> "::1"."""
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return address.rsplit(":", 1)[0].strip("[]")


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_STATE_")


@dataclass
class _PendingCheckpoint:
    job: str
    generation: int
    ranks: int
    future: asyncio.Future
    steps: dict[int, int] = field(default_factory=dict)  # rank -> committed step


@dataclass
class JobEntry:
    job: pb.Job
    revision: int = 0
    missing: dict[int, int] = field(default_factory=dict)  # rank -> heartbeats without news of it
    launching: asyncio.Task | None = None
    recovering: asyncio.Task | None = None
    tracks: dict[int, monitors.RankTrack] = field(default_factory=dict)  # this generation's progress
    incident_at: float | None = None  # monotonic time the recovery under way began (this process), for metrics
    incident_kind: str = ""


class JobManager(RecoveryMixin):
    INCIDENT_KINDS = recovery.KINDS

    def __init__(self, store: Store, registry: Registry, clock: Clock, hub: EventHub, cfg: JobsConfig,
                 topology: Callable[[], ClusterTopology], recovery_cfg: RecoveryConfig | None = None) -> None:
        self.recovery_cfg = recovery_cfg or RecoveryConfig()
        self._store = store
        self._registry = registry
        self._clock = clock
        self._hub = hub
        self.cfg = cfg
        self._topology = topology
        self._jobs: dict[str, JobEntry] = {}
        self._lock = asyncio.Lock()
        self._next_id = 1
        self._fenced: dict[tuple[str, str, int], float] = {}  # (node, job, generation) -> when told to stop
        self._wake = asyncio.Event()
        self._on_node: dict[str, set[str]] = {}  # node -> ids of active jobs placed on it (heartbeat fast path)
        self._checkpoints: dict[int, _PendingCheckpoint] = {}
        self._checkpoint_ids = 0
        self.incidents: Counter[str] = Counter()  # by kind; these three feed controller.metrics
        self.restarts_by_cause: Counter[str] = Counter()
        self.recovery_s: dict[str, Buckets] = {kind: Buckets(RECOVERY_BUCKETS_S) for kind in recovery.KINDS}

    async def load(self) -> None:
        for record in await self._store.load_jobs():
            job = pb.Job.FromString(record.data)
            self._jobs[job.id] = JobEntry(job, record.revision)
            self._index(job)
            self._next_id = max(self._next_id, int(job.id.removeprefix("job-")) + 1)
        logger.info("jobs loaded", jobs=len(self._jobs), active=sum(e.job.state in ACTIVE for e in self._jobs.values()))

    # -- the user side -----------------------------------------------------------------------

    def get(self, job_id: str) -> pb.Job:
        try:
            return self._jobs[job_id].job
        except KeyError:
            raise NotFound(f"no job {job_id!r}; `phalanx jobs` lists them") from None

    def list(self, states: set[int]) -> list[pb.Job]:
        jobs = [e.job for e in self._jobs.values() if not states or e.job.state in states]
        return sorted(jobs, key=lambda j: int(j.id.removeprefix("job-")))

    async def submit(self, spec: pb.JobSpec, user: str) -> pb.Job:
        validation.job_spec(spec)
        spec.ranks_per_node = spec.ranks_per_node or 1
        async with self._lock:
            now_ns = self._clock.wall_ns()
            job = pb.Job(id=f"job-{self._next_id}", spec=spec, state=pb.JOB_STATE_PENDING,
                         reason="waiting for the scheduler", submitted_unix_ns=now_ns, user=user,
                         state_since_unix_ns=now_ns)
            entry = JobEntry(job)
            what = f"{spec.nodes} nodes x {spec.ranks_per_node} ranks" + (f" + {spec.spares} spares" if spec.spares
                                                                           else "")
            await self._save(entry, job, self._event("job.submitted", f"{job.id} ({spec.name or spec.command[0]}) "
                                                     f"submitted: {what}, priority {spec.priority}", job.id))
            self._jobs[job.id] = entry
            self._next_id += 1
        self._wake.set()
        return entry.job

    async def cancel(self, job_id: str) -> pb.Job:
        async with self._lock:
            entry = self._entry(job_id)
            job = entry.job
            if job.state in TERMINAL:
                raise FailedPrecondition(f"{job_id} already ended ({state_name(job.state)})")
            if job.state == pb.JOB_STATE_PENDING:
                await self._finish(entry, pb.JOB_STATE_CANCELLED, "cancelled while pending", 1)
                return entry.job
            if job.state != pb.JOB_STATE_CANCELLING:
                new = self._moved(job, pb.JOB_STATE_CANCELLING, "cancel requested")
                await self._save(entry, new, self._event("job.cancelling", f"{job_id}: cancel requested; stopping "
                                                         f"{len(job.ranks)} ranks", job_id))
            for task in (entry.launching, entry.recovering):
                if task is not None:
                    task.cancel()
        await self._stop_everywhere(entry.job, entry.job.generation)
        self._wake.set()
        return entry.job

    async def read_logs(self, job_id: str, rank: int, offset: int,
                        max_bytes: int) -> tuple[node_pb2.CommandResult, str]:
        job = self.get(job_id)
        if not job.nodes:
            raise FailedPrecondition(f"{job_id} has not started; it has no logs yet")
        world = len(job.nodes) * job.spec.ranks_per_node
        if rank >= world:
            raise InvalidArgument(f"{job_id} has ranks 0-{world - 1}; there is no rank {rank}")
        node = job.nodes[rank // job.spec.ranks_per_node]
        session = self._registry.get(node).session
        if session is None:
            raise FailedPrecondition(f"node {node}, which holds rank {rank}'s log, is not connected")
        result = await session.request(node_pb2.Command(read_log=node_pb2.ReadLog(
            job=job_id, rank=rank, offset=offset, max_bytes=max_bytes)))
        return result, node

    async def checkpoint(self, job_id: str, deadline_s: float) -> tuple[int, float]:
        """Ask every rank of a running job to checkpoint; return the step all committed and the seconds."""
        job = self.get(job_id)
        if job.state != pb.JOB_STATE_RUNNING:
            raise FailedPrecondition(f"{job_id} is {state_name(job.state)}; only a running job can checkpoint")
        return await self._request_checkpoint(self._jobs[job_id], deadline_s, "requested")

    async def _request_checkpoint(self, entry: JobEntry, deadline_s: float, reason: str,
                                  pause: bool = False) -> tuple[int, float]:
        job = entry.job
        await self._pace_known(entry)
        at_step = checkpoint_step(entry.tracks)
        self._checkpoint_ids += 1
        request_id = self._checkpoint_ids
        pending = _PendingCheckpoint(job.id, job.generation, len(job.ranks),
                                     asyncio.get_running_loop().create_future())
        self._checkpoints[request_id] = pending
        started = time.monotonic()
        try:
            latest, step_s = pace(entry.tracks)
            await self._log(self._event("job.checkpoint", f"{job.id}: checkpoint {request_id} requested from "
                                        f"{len(job.ranks)} ranks after step {at_step} (deadline {deadline_s:g}s; "
                                        f"last reported step {latest}, {step_s:.3f}s a step): {reason}", job.id))
            command = node_pb2.Command(checkpoint=node_pb2.RequestCheckpoint(
                job=job.id, generation=job.generation, request_id=request_id, deadline_s=deadline_s,
                reason=reason, pause=pause, at_step=at_step))
            await asyncio.gather(*(self._session(self._registry.get(n)).request(command) for n in job.nodes))
            try:
                step = await asyncio.wait_for(asyncio.shield(pending.future), deadline_s)
            except TimeoutError:
                raise FailedPrecondition(f"{job.id}: only {len(pending.steps)} of {pending.ranks} ranks committed "
                                         f"checkpoint {request_id} within {deadline_s:g}s") from None
        finally:
            self._checkpoints.pop(request_id, None)
        seconds = time.monotonic() - started
        await self._log(self._event("job.checkpointed", f"{job.id}: every rank committed step {step} "
                                    f"({seconds:.2f}s after the request)", job.id))
        return step, seconds

    async def _pace_known(self, entry: JobEntry) -> None:
        """Wait briefly for the ranks to report a step past their start-up: a request soon after a (re)start
        would otherwise agree on a step from a pace that start-up makes look several times slower."""
        deadline = self._clock.monotonic() + PACE_WAIT_S
        for _ in range(int(PACE_WAIT_S / 0.1)):  # bounded in real time too, whatever the clock does
            if not entry.tracks or any(t.recent_pace() for t in entry.tracks.values()) or \
                    self._clock.monotonic() >= deadline:
                return
            await asyncio.sleep(0.1)

    def checkpoint_ack(self, ack: node_pb2.CheckpointAck) -> None:
        pending = self._checkpoints.get(ack.request_id)
        if pending is None or (pending.job, pending.generation) != (ack.job, ack.generation):
            return  # unasked, or from a stale generation: fenced, never counted
        pending.steps[ack.rank] = ack.step
        if len(pending.steps) == pending.ranks and not pending.future.done():
            pending.future.set_result(min(pending.steps.values()))

    # -- scheduling ----------------------------------------------------------------------------

    async def run(self) -> None:
        """The scheduler loop: on every change (submit, node or rank news) and at least twice a second."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.schedule_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.schedule()
                await self.follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("scheduler pass failed; will retry")

    def wake(self) -> None:
        self._wake.set()

    def _candidates(self, exclude: str = "") -> list[Candidate]:
        """Every node as placement sees it; nodes held by job `exclude` count as free (it is being re-placed)."""
        busy = {n for e in self._jobs.values() if e.job.state in ACTIVE and e.job.id != exclude
                for n in [*e.job.nodes, *e.job.spares]}
        out = []
        for entry in self._registry.entries():
            record = entry.record
            schedulable = (record.state is UP and not record.drain_reason and entry.session is not None
                           and entry.verdict.health < health_policy.FAILING)
            out.append(Candidate(name=record.name, schedulable=schedulable,
                                 healthy=entry.verdict.health is health_policy.HEALTHY,
                                 free=record.name not in busy, gpus=len(entry.inventory().gpus)))
        return out

    async def schedule(self) -> None:
        """Place pending jobs by priority, then submission; a job that does not fit waits with the reason.
        A smaller job may start ahead of a larger one that waits (no reservations)."""
        pending = sorted((e for e in self._jobs.values() if e.job.state == pb.JOB_STATE_PENDING),
                         key=lambda e: (-e.job.spec.priority, e.job.submitted_unix_ns))
        if not pending:
            return
        topology = self._topology()
        for entry in pending:
            spec = entry.job.spec
            request = GangRequest(nodes=spec.nodes, ranks_per_node=spec.ranks_per_node, spares=spec.spares,
                                  segment=spec.segment or None)
            decision = place(self._candidates(), request, topology)
            async with self._lock:
                if entry.job.state != pb.JOB_STATE_PENDING:
                    continue
                if isinstance(decision, Unplaceable):
                    if entry.job.reason != decision.reason:
                        await self._save(entry, self._copy(entry.job, reason=decision.reason),
                                         self._event("job.pending", f"{entry.job.id} waits: {decision.reason}",
                                                     entry.job.id))
                    continue
                generation = entry.job.generation + 1
                new = self._moved(entry.job, pb.JOB_STATE_STARTING, f"placed on {', '.join(decision.nodes)}",
                                  generation=generation, started_unix_ns=self._clock.wall_ns())
                del new.nodes[:]
                new.nodes.extend(decision.nodes)
                del new.spares[:]
                new.spares.extend(decision.spares)
                del new.ranks[:]
                new.ranks.extend(self._rank_table(new))
                spares = f"; spares {', '.join(decision.spares)}" if decision.spares else ""
                await self._save(entry, new, self._event(
                    "job.placed", f"{new.id} generation {generation} placed on {', '.join(decision.nodes)}{spares} "
                    f"({len(decision.leaves)} leaf switches, lower bound {decision.lower_bound})", new.id))
                entry.missing.clear()
                entry.tracks = {}
                entry.launching = asyncio.create_task(self._launch(entry, generation), name=f"launch-{new.id}")

    @staticmethod
    def _rank_table(job: pb.Job) -> list[pb.RankInfo]:
        per = job.spec.ranks_per_node
        return [pb.RankInfo(rank=i * per + local, node=node, local_rank=local, gpu=local,
                            state=pb.RANK_STATE_UNSPECIFIED, generation=job.generation)
                for i, node in enumerate(job.nodes) for local in range(per)]

    async def _launch(self, entry: JobEntry, generation: int) -> None:
        job = entry.job
        try:
            master = self._registry.get(job.nodes[0])
            session = self._session(master)
            port = (await session.request(node_pb2.Command(reserve_port=node_pb2.ReservePort()))).port
            address = master.inventory().address or peer_host(master.peer)
            await asyncio.gather(*(self._launch_node(job, i, node, address, port) for i, node in enumerate(job.nodes)))
        except asyncio.CancelledError:
            return  # cancelled meanwhile: cancel() stops whatever started
        except Exception as e:  # any node refusing or unreachable fails the whole gang
            reason = f"launch failed: {e}"
            logger.warning("launch failed", job=job.id, error=str(e))
            await self._stop_everywhere(job, generation)
            async with self._lock:
                if entry.job.generation != generation:
                    return
                if entry.job.state == pb.JOB_STATE_STARTING:
                    await self._finish(entry, pb.JOB_STATE_FAILED, reason, 1)
                    return
            if entry.job.state == pb.JOB_STATE_RESTARTING:
                await self._begin_recovery(entry, recovery.Incident("crash", False, (), reason))
            return
        async with self._lock:
            if entry.job.generation != generation or entry.job.state not in (pb.JOB_STATE_STARTING,
                                                                              pb.JOB_STATE_RESTARTING):
                return
            new = self._moved(entry.job, pb.JOB_STATE_RUNNING, f"running on {', '.join(job.nodes)}",
                              master_addr=address, master_port=port)
            for rank in new.ranks:
                rank.state = pb.RANK_STATE_RUNNING
            await self._save(entry, new, self._event(
                "job.running", f"{job.id} generation {generation} running: {len(new.ranks)} ranks, MASTER_ADDR="
                f"{address} MASTER_PORT={port}", job.id))
            if entry.incident_at is not None:
                self.recovery_s.setdefault(entry.incident_kind, Buckets(RECOVERY_BUCKETS_S)).observe(
                    self._clock.monotonic() - entry.incident_at)
                entry.incident_at = None

    def _session(self, entry: NodeEntry):
        if entry.session is None:
            raise FailedPrecondition(f"node {entry.record.name} is not connected")
        return entry.session

    async def _launch_node(self, job: pb.Job, index: int, node: str, master_addr: str, master_port: int) -> None:
        spec, per = job.spec, job.spec.ranks_per_node
        world = len(job.nodes) * per
        common = {
            **spec.env,
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(index), "GROUP_WORLD_SIZE": str(len(job.nodes)),
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world),
            "TORCHELASTIC_RESTART_COUNT": str(job.generation - 1),
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": job.id,
            "PHALANX_JOB": job.id, "PHALANX_GENERATION": str(job.generation),
        }
        if spec.checkpoint_dir:
            common["PHALANX_CHECKPOINT_DIR"] = spec.checkpoint_dir
        ranks = []
        for local in range(per):
            rank = index * per + local
            ranks.append(node_pb2.RankLaunch(rank=rank, local_rank=local, gpu=local, env={
                "RANK": str(rank), "LOCAL_RANK": str(local), "ROLE_RANK": str(rank),
                "CUDA_VISIBLE_DEVICES": str(local)}))
        session = self._session(self._registry.get(node))
        await session.request(node_pb2.Command(launch=node_pb2.LaunchRanks(
            job=job.id, generation=job.generation, command=spec.command, env=common, workdir=spec.workdir,
            ranks=ranks)), timeout=self.cfg.launch_timeout_s)

    async def _stop_everywhere(self, job: pb.Job, generation: int) -> None:
        """Best effort: every node of the job is told to stop it; an unreachable one is fenced when it returns."""
        for node in job.nodes:
            entry = self._registry.entries_by_name().get(node)
            if entry is not None:
                await self._stop_node(entry, job.id, generation)

    async def _stop_node(self, entry: NodeEntry, job_id: str, generation: int) -> bool:
        """Tell one node to stop a generation of a job; True if its agent took the command."""
        if entry.session is None:
            return False
        node = entry.record.name
        try:
            await entry.session.request(node_pb2.Command(stop=node_pb2.StopRanks(
                job=job_id, generation=generation, grace_s=self.cfg.stop_grace_s)))
        except Exception as e:
            logger.warning("stop failed", job=job_id, node=node, error=str(e))
            return False
        self._fenced[(node, job_id, generation)] = time.monotonic()
        return True

    # -- following the ranks -------------------------------------------------------------------

    def observe(self, node: NodeEntry, heartbeat: node_pb2.Heartbeat) -> bool:
        """Fold a heartbeat's rank reports into the jobs (no I/O). True if a decision may follow."""
        name = node.record.name
        if not heartbeat.ranks and name not in self._on_node:
            return False
        reported = {}
        stale = False
        for status in heartbeat.ranks:
            entry = self._jobs.get(status.job)
            current = entry is not None and entry.job.state in ACTIVE and status.generation == entry.job.generation
            if current:
                reported[(status.job, status.rank)] = status
            elif status.state == pb.RANK_STATE_RUNNING:
                stale = True
        changed = stale
        now = self._clock.monotonic()
        for progress in heartbeat.progress:
            entry = self._jobs.get(progress.job)
            if entry is None or entry.job.generation != progress.generation or entry.job.state not in ACTIVE:
                continue
            if not entry.tracks:  # trainlib speaks for this job: follow every rank's progress from now on
                entry.tracks = {r.rank: monitors.RankTrack(last_advance=now, last_report=now) for r in entry.job.ranks}
            track = entry.tracks.get(progress.rank)
            if track is not None:
                track.observe(progress.last_step, progress.mean_step_s, list(progress.compute_samples), now,
                              progress.steps)
        for job_id in self._on_node.get(name, ()):
            entry = self._jobs[job_id]
            job = entry.job
            if job.state in (pb.JOB_STATE_STARTING, pb.JOB_STATE_RESTARTING):
                continue
            for rank in job.ranks:
                if rank.node != name or rank.state in (pb.RANK_STATE_EXITED, pb.RANK_STATE_LOST):
                    continue
                status = reported.get((job.id, rank.rank))
                if status is None:
                    entry.missing[rank.rank] = entry.missing.get(rank.rank, 0) + 1
                    if entry.missing[rank.rank] >= MISSING_REPORTS_LOST:
                        rank.state = pb.RANK_STATE_LOST
                        changed = True
                    continue
                entry.missing.pop(rank.rank, None)
                rank.pid = status.pid
                if status.state != rank.state:
                    rank.state, rank.exit_code = status.state, status.exit_code
                    changed = True
        if changed:
            self._wake.set()
        return stale

    async def fence(self, node: NodeEntry, heartbeat: node_pb2.Heartbeat) -> None:
        """Stop ranks running on `node` that belong to no current job generation: one stop per generation."""
        now = time.monotonic()
        stale: dict[tuple[str, int], list[int]] = {}
        for status in heartbeat.ranks:
            entry = self._jobs.get(status.job)
            if status.state != pb.RANK_STATE_RUNNING or (entry is not None and entry.job.state in ACTIVE
                                                         and status.generation == entry.job.generation):
                continue
            stale.setdefault((status.job, status.generation), []).append(status.rank)
        for (job_id, generation), ranks in stale.items():
            key = (node.record.name, job_id, generation)
            if now - self._fenced.get(key, -FENCE_REPEAT_S) < FENCE_REPEAT_S or node.session is None:
                continue
            self._fenced[key] = now
            entry = self._jobs.get(job_id)
            why = ("unknown job" if entry is None else f"the job is {state_name(entry.job.state)}"
                   if entry.job.state not in ACTIVE else f"generation {generation} is stale (current "
                   f"{entry.job.generation}, {state_name(entry.job.state)})")
            await self._log(self._event("job.fenced", f"{job_id}: stopping generation {generation} on "
                                        f"{node.record.name} (ranks {', '.join(map(str, ranks))}): {why}", job_id))
            try:
                await node.session.request(node_pb2.Command(stop=node_pb2.StopRanks(
                    job=job_id, generation=generation, grace_s=self.cfg.stop_grace_s)))
            except Exception as e:
                logger.warning("fencing failed", job=job_id, node=node.record.name, error=str(e))

    async def follow(self) -> None:
        """Decide the fate of running jobs from their ranks, their nodes and their progress."""
        nodes = self._registry.entries_by_name()
        now = self._clock.monotonic()
        for entry in list(self._jobs.values()):
            job = entry.job
            if job.state == pb.JOB_STATE_CHECKPOINTING and all(
                    r.state == pb.RANK_STATE_EXITED and r.exit_code == 0 for r in job.ranks):
                async with self._lock:  # it finished before the agreed step: nothing left to save or evict
                    if entry.job is job:
                        await self._finish(entry, pb.JOB_STATE_SUCCEEDED, "every rank exited 0 (before the "
                                           "eviction checkpoint)", 0)
                continue
            if job.state not in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_CANCELLING):
                continue
            lost = [n for n in job.nodes if n not in nodes or nodes[n].record.state is DOWN]
            for rank in job.ranks:
                if rank.node in lost and rank.state == pb.RANK_STATE_RUNNING:
                    rank.state = pb.RANK_STATE_LOST
            running = [r for r in job.ranks if r.state == pb.RANK_STATE_RUNNING]
            if job.state == pb.JOB_STATE_CANCELLING:
                if not running:
                    async with self._lock:
                        if entry.job is job:
                            await self._finish(entry, pb.JOB_STATE_CANCELLED, "cancelled", 1)
                continue
            if not running and all(r.state == pb.RANK_STATE_EXITED and r.exit_code == 0 for r in job.ranks):
                async with self._lock:
                    if entry.job is job:
                        await self._finish(entry, pb.JOB_STATE_SUCCEEDED, "every rank exited 0", 0)
                continue
            views = {n: recovery.NodeView(n, n in lost, nodes[n].verdict.health if n in nodes else FAILED_HEALTH,
                                          nodes[n].verdict.reasons[0] if n in nodes and nodes[n].verdict.reasons
                                          else "")
                     for n in job.nodes}
            incident = recovery.detect(job.ranks, views, entry.tracks, now, self.recovery_cfg)
            if incident is not None:
                await self._begin_recovery(entry, incident)

    # -- helpers -------------------------------------------------------------------------------

    def _entry(self, job_id: str) -> JobEntry:
        self.get(job_id)
        return self._jobs[job_id]

    @staticmethod
    def _copy(job: pb.Job, **changes: object) -> pb.Job:
        new = pb.Job()
        new.CopyFrom(job)
        for key, value in changes.items():
            setattr(new, key, value)
        return new

    def _moved(self, job: pb.Job, state: int, reason: str, **changes: object) -> pb.Job:
        """A copy of `job` in `state` (checked against the transition table), its time in the old state added up."""
        recovery.check(job.id, job.state, state)
        now_ns = self._clock.wall_ns()
        new = self._copy(job, state=state, reason=reason, state_since_unix_ns=now_ns, **changes)
        if job.state_since_unix_ns:
            phase = state_name(job.state)
            spent = (now_ns - job.state_since_unix_ns) / 1e9
            existing = next((p for p in new.phase_times if p.phase == phase), None)
            if existing is None:
                new.phase_times.add(phase=phase, seconds=spent)
            else:
                existing.seconds += spent
        return new

    async def _finish(self, entry: JobEntry, state: int, reason: str, exit_code: int) -> None:
        if entry.recovering is not None and entry.recovering is not asyncio.current_task():
            entry.recovering.cancel()
        entry.incident_at = None  # a recovery that ends the job is no recovery
        new = self._moved(entry.job, state, reason, exit_code=exit_code, finished_unix_ns=self._clock.wall_ns())
        await self._save(entry, new, self._event(f"job.{state_name(state).lower()}",
                                                 f"{new.id} {state_name(state)}: {reason}", new.id))

    async def _save(self, entry: JobEntry, job: pb.Job, event: EventRecord) -> None:
        """Commit `job` with its event; memory follows only once the store has it. Lock held."""
        record = JobRecord(job.id, state_name(job.state), job.SerializeToString(), entry.revision)
        committed = await self._store.commit(jobs=[record], events=[event])
        entry.job, entry.revision = job, committed.jobs[0].revision
        self._index(job)
        logger.info(event.message, kind=event.kind, job=job.id, generation=job.generation)
        self._hub.publish(committed.events)

    def _index(self, job: pb.Job) -> None:
        for ids in self._on_node.values():
            ids.discard(job.id)
        if job.state in ACTIVE:
            for node in [*job.nodes, *job.spares]:
                self._on_node.setdefault(node, set()).add(job.id)
        for node in [n for n, ids in self._on_node.items() if not ids]:
            del self._on_node[node]

    async def _log(self, event: EventRecord) -> None:
        committed = await self._store.commit(events=[event])
        self._hub.publish(committed.events)

    def _event(self, kind: str, message: str, job: str) -> EventRecord:
        return EventRecord(kind=kind, message=message, time_ns=self._clock.wall_ns(), job=job)
