"""Gang jobs: what the controller keeps of each job, the user's requests, and the ranks' news from heartbeats.

The record in the store is the truth; a `JobEntry` adds what this process sees (progress, launches and
stops in flight, checkpoint acknowledgements). Every decision about a job is
`controller.recovery.lifecycle.step`, applied by `controller.recovery.executor.Executor`; this module
only turns requests and heartbeats into records and views. Ranks that belong to no current job
generation on their node are told to stop (fencing): a rank from an old generation never runs on.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable

from google.protobuf.message import DecodeError

from controller import access, validation
from controller.config import JobsConfig, RecoveryConfig
from controller.errors import FailedPrecondition, InvalidArgument, NotFound
from controller.jobs import record as job_record
from controller.jobs.topology import ClusterTopology
from controller.lighthouse import LighthouseError, Lighthouses, describe, looks
from controller.nodes.registry import NodeEntry, Registry
from controller.obs.events import EventHub
from controller.obs.stats import RECOVERY_BUCKETS_S, Buckets
from controller.recovery import detectors, lifecycle, table
from controller.recovery import progress as monitors
from controller.recovery import snapshots as snapshot_plan
from controller.recovery.entry import JobEntry
from controller.recovery.executor import Executor
from controller.recovery.table import ACTIVE, RUNNING, TERMINAL, rank_may_move, state_name
from controller.store.base import EventRecord, JobRecord, Store
from phalanx import clock as clocks
from phalanx import log
from phalanx import ranks as ranktable
from phalanx.clock import Clock
from phalanx.v1 import common_pb2, node_pb2

logger = log.get("jobs")

LIGHTHOUSE_LOOKS = 16  # replica-group jobs whose lighthouses a controller that starts leading takes up at once

pb = common_pb2
TORCHRUN_RECORDS = "torchrun-"  # the prefix of torchrun runs' records in the jobs table (the rendezvous service's)
FORGET_EVERY_S = 60.0  # how often ended jobs' records are looked over for deletion (jobs.ended_kept)
FORGET_BATCH = 100  # records deleted in one commit (an etcd transaction holds 128 operations)

__all__ = ["ACTIVE", "TERMINAL", "JobEntry", "JobManager", "state_name"]


def expired(entries: Iterable[JobEntry], stopping: set[str], newest: str, now: float, cfg: JobsConfig) -> list[str]:
    """The ids of ended jobs whose records go (at most FORGET_BATCH, oldest ended first): those beyond
    `jobs.ended_kept` and those that ended more than `jobs.ended_kept_s` before `now`. Never one whose ranks may
    still run (`stopping`: its stop is not saved yet; or a rank recorded RUNNING), nor `newest`, whose id the
    next controller counts on from the records it loads."""
    ended = sorted((e.job for e in entries if e.job.state in TERMINAL and e.job.id not in stopping
                    and not ranktable.any_in(e.job, pb.RANK_STATE_RUNNING)),
                   key=lambda j: (j.state_since_unix_ns, int(j.id.removeprefix("job-"))))
    over = len(ended) - cfg.ended_kept
    cutoff_ns = (now - cfg.ended_kept_s) * 1e9 if cfg.ended_kept_s else float("-inf")
    return [j.id for i, j in enumerate(ended)
            if (i < over or j.state_since_unix_ns < cutoff_ns) and j.id != newest][:FORGET_BATCH]


def _involved(job: pb.Job) -> frozenset[str]:
    """The nodes a job's record names: its own, its spares, those evicted from it (once a record: a recovery's burst
    of agent events names the job from every node)."""
    return frozenset([*job.nodes, *job.spares, *job.evicted])


def _ranks_on(entry: JobEntry, node: str) -> list[tuple[int, int, pb.RankInfo | None]]:
    """(number, state, row) of each rank of the entry's job that `node` runs, found by its position: a table in rows
    gives its rows (lifecycle.ranks_on), a packed one its states alone, read once per record (no row made, None: its
    pids are set through ranktable.set_pids). An active job's states change only by a commit, a new record
    (`_rank_ended` changes those of an ended job, which no node's heartbeat reads here: `index`)."""
    job = entry.job
    positions = entry.of_record("positions", lifecycle.node_positions)
    if not ranktable.is_packed(job):
        return [(r.rank, r.state, r) for r in lifecycle.ranks_on(job, node, positions)]
    i = positions.get(node)
    if i is None:
        return []
    per, states = job.spec.ranks_per_node, entry.of_record("states", lambda j: j.packed_ranks.states)
    return [(r, states[r], None) for r in range(i * per, (i + 1) * per)]


def runs_here(job: pb.Job, rank: int, node: str) -> bool:
    """Whether `node` runs rank `rank` of the job's current generation: the only node whose reports about that rank
    (its state, progress, NCCL state, checkpoint acks) are believed. The ranks are in rank order (rank_table)."""
    return ranktable.node_runs(job, rank, node)

class JobManager:
    INCIDENT_KINDS = detectors.KINDS

    def __init__(self, store: Store, registry: Registry, clock: Clock, hub: EventHub, cfg: JobsConfig,
                 topology: Callable[[], ClusterTopology], recovery_cfg: RecoveryConfig | None = None,
                 lighthouses: Lighthouses | None = None) -> None:
        self.recovery_cfg = recovery_cfg or RecoveryConfig()
        self.store = store
        self.registry = registry
        self.clock = clock
        self.hub = hub
        self.cfg = cfg
        self.topology = topology
        self.entries: dict[str, JobEntry] = {}
        self.lock = asyncio.Lock()
        self._next_id = 1
        self._fenced: dict[str, dict[tuple[str, int], float]] = {}  # node -> (job, generation) -> when told to stop
        self._on_node: dict[str, set[str]] = {}  # node -> ids of active jobs placed on it (heartbeat fast path)
        self._snapshots_on: dict[str, set[str]] = {}  # node -> ids of jobs it last said it holds snapshots of
        self._standbys_on: dict[str, set[str]] = {}  # node -> ids of jobs it last said it holds standbys of
        # node -> when (self.now()) its heartbeat last showed Phalanx's own work there: standbys starting (a Python
        # and torch import each); a straggler verdict against the node then could be that work's, not its GPU's
        self.own_work_at: dict[str, float] = {}
        # ids of jobs that ended (FAILED) with ranks still running, stopped since: their records are saved with
        # how those ranks ended (the executor's next pass)
        self.ended_ranks: set[str] = set()
        self._forgot_at = float("-inf")  # when forget_ended last looked (self.now())
        self.incidents: Counter[str] = Counter()  # by kind; these three feed controller.obs.metrics
        self.restarts_by_cause: Counter[str] = Counter()
        self.recovery_s: dict[str, Buckets] = {kind: Buckets(RECOVERY_BUCKETS_S) for kind in detectors.KINDS}
        self.lighthouses = lighthouses  # torchft's, for replica-group jobs (server.py; None: none)
        self._no_lighthouse: set[str] = set()  # jobs whose event log says they run without one (said once)
        self.executor = Executor(self)

    access_policy: access.Policy | None = None  # the access file (server.py sets it): run_as checked at each launch

    def policy(self) -> lifecycle.Policy:
        return lifecycle.Policy(self.recovery_cfg, self.cfg)

    def now(self) -> float:
        return clocks.wall_s(self.clock)

    async def load(self) -> None:
        for record in await self.store.load_jobs():
            if record.id.startswith(TORCHRUN_RECORDS):
                continue  # a torchrun run's record: the rendezvous service's (controller/api/rendezvous_service.py)
            number = record.id.removeprefix("job-")
            if number.isdigit():  # (never an id again, even one whose record cannot be read)
                self._next_id = max(self._next_id, int(number) + 1)
            try:
                job = job_record.unpack(record.data)
            except (job_record.BadRecord, DecodeError) as e:  # one damaged record keeps no controller from starting,
                # no standby from taking over
                logger.error("job record unreadable: not loaded (restore it from a backup)", job=record.id,
                             error=str(e))
                continue
            self.entries[job.id] = JobEntry(job, record.revision, generation=job.generation,
                                            reported=job.progress_reported)
            self.index(job)
        logger.info("jobs loaded", jobs=len(self.entries),
                    active=sum(e.job.state in ACTIVE for e in self.entries.values()))
        limit = asyncio.Semaphore(LIGHTHOUSE_LOOKS)  # a restart or a takeover: their lighthouses taken up

        async def look(entry: JobEntry) -> None:
            async with limit:
                await self.lighthouse(entry)
        await asyncio.gather(*(look(e) for e in self.entries.values()
                               if e.job.state in ACTIVE and e.job.lighthouse_port))
        self.wake()  # the first pass carries on whatever the stored records say, recoveries included

    async def run(self) -> None:
        await self.executor.run()

    def wake(self) -> None:
        self.executor.wake()

    # -- the user side -----------------------------------------------------------------------

    def get(self, job_id: str) -> pb.Job:
        """The job as `phalanx job` shows it: its record, with what its nodes said of its ranks since the last
        commit and the standbys ready for it."""
        entry = self.entry(job_id)
        if entry.job.state not in ACTIVE or not (entry.standbys or entry.ended):
            return entry.job
        job = lifecycle.ranks_ended(entry.job, entry.ended)
        if job is entry.job:
            job = pb.Job()
            job.CopyFrom(entry.job)
        job.standbys.update(entry.standbys)
        return job

    def entry(self, job_id: str) -> JobEntry:
        try:
            return self.entries[job_id]
        except KeyError:
            number = job_id.removeprefix("job-")
            if number.isdigit() and int(number) < self._next_id:
                raise NotFound(f"{job_id} is no longer kept: the records of ended jobs are deleted past "
                               f"jobs.ended_kept ({self.cfg.ended_kept}) or jobs.ended_kept_s; its events remain "
                               f"(`phalanx events --job {job_id}`)") from None
            raise NotFound(f"no job {job_id!r}; `phalanx jobs` lists them") from None

    def involves(self, job_id: str, node: str) -> bool:
        """Whether `node` runs `job_id`, spares or holds standbys for it, or was evicted from it: the jobs a node's
        own event may be filed under (any other node's word about a job is its own, not the job's)."""
        entry = self.entries.get(job_id)
        return entry is not None and (node in entry.of_record("involved", _involved) or node in entry.standbys)

    def list(self, states: set[int]) -> list[pb.Job]:
        jobs = [lifecycle.ranks_ended(e.job, e.ended) if e.job.state in ACTIVE else e.job
                for e in self.entries.values() if not states or e.job.state in states]
        return sorted(jobs, key=lambda j: int(j.id.removeprefix("job-")))

    async def submit(self, spec: pb.JobSpec, user: str) -> pb.Job:
        validation.job_spec(spec)
        spec.ranks_per_node = spec.ranks_per_node or 1
        async with self.lock:
            active = sum(1 for e in self.entries.values() if e.job.user == user and e.job.state not in TERMINAL)
            if active >= self.cfg.max_active_per_user:
                raise FailedPrecondition(f"{user or 'this client'} has {active} jobs that have not ended, the most one "
                                         f"user may have (jobs.max_active_per_user); cancel some, or wait for them")
            now_ns = self.clock.wall_ns()
            job = pb.Job(id=f"job-{self._next_id}", spec=spec, state=pb.JOB_STATE_PENDING,
                         reason="waiting for the scheduler", submitted_unix_ns=now_ns, user=user,
                         state_since_unix_ns=now_ns)
            entry = JobEntry(job)
            what = f"{spec.nodes} nodes x {spec.ranks_per_node} ranks" + (f" + {spec.spares} spares" if spec.spares
                                                                           else "")
            await self.save(entry, lifecycle.Commit(job, "job.submitted", f"{job.id} ({spec.name or spec.command[0]}) "
                                                    f"submitted: {what}, priority {spec.priority}"))
            self.entries[job.id] = entry
            self._next_id += 1
        self.wake()
        return entry.job

    async def cancel(self, job_id: str, why: str = "") -> pb.Job:
        """Stop the job's ranks and end it CANCELLED; `why`: the reason when the controller itself cancels."""
        async with self.lock:
            entry = self.entry(job_id)
            if entry.job.state in TERMINAL:
                raise FailedPrecondition(f"{job_id} already ended ({state_name(entry.job.state)})")
            await self.executor.apply(entry, lifecycle.cancel(entry.job, self.now(), why, list(entry.prepared)),
                                      self.now())
            if entry.launch_task is not None:
                entry.launch_task.cancel()
        await self.executor.advance(entry)  # the stops go out before the answer
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
        session = self.registry.get(node).session
        if session is None:
            raise FailedPrecondition(f"node {node}, which holds rank {rank}'s log, is not connected")
        result = await session.request(node_pb2.Command(read_log=node_pb2.ReadLog(
            job=job_id, rank=rank, offset=offset, max_bytes=max_bytes)))
        return result, node

    async def checkpoint(self, job_id: str, deadline_s: float) -> tuple[int, float]:
        """Ask every rank of a running job to checkpoint; return the step all committed and the seconds.
        The request's id is the job's stored counter plus one, so a restarted controller never reuses an id
        that trainlib has already handled."""
        entry = self.entry(job_id)
        if entry.job.state != RUNNING:
            raise FailedPrecondition(f"{job_id} is {state_name(entry.job.state)}; only a running job can checkpoint")
        await self._pace_known(entry, deadline_s)
        async with self.lock:
            job = entry.job
            if job.state != RUNNING:
                raise FailedPrecondition(f"{job_id} is {state_name(job.state)}; only a running job can checkpoint")
            now = self.now()
            actions = lifecycle.ask_checkpoint(job, entry.tracks, now, self.recovery_cfg.checkpoint_lead_s,
                                               deadline_s, pause=False, reason="requested")
            sent = actions[-1]
            assert isinstance(sent, lifecycle.RequestCheckpoint)
            ask = sent.request
            future = asyncio.get_running_loop().create_future()
            await self.executor.apply(entry, actions, now)
            entry.checkpoint.future = future
            started = self.clock.monotonic()
        try:
            step = await clocks.wait_for(self.clock, asyncio.shield(future), deadline_s)
        except TimeoutError:
            pending = entry.checkpoint
            done = len(pending.acks) if pending is not None and pending.request_id == ask.id else 0
            asked = pending.ranks if pending is not None and pending.request_id == ask.id else ranktable.count(job)
            raise FailedPrecondition(f"{job_id}: only {done} of {asked} ranks committed checkpoint {ask.id} "
                                     f"within {deadline_s:g}s") from None
        seconds = self.clock.monotonic() - started
        await self.log(lifecycle.Event("job.checkpointed", f"{job_id}: every rank committed step {step} "
                                       f"({seconds:.2f}s after the request)"), job_id)
        return step, seconds

    async def _pace_known(self, entry: JobEntry, deadline_s: float) -> None:
        """Wait briefly for the ranks to report a step past their start-up: a request soon after a (re)start
        would otherwise agree on a step from a pace that start-up makes look several times slower, or, before
        any report, say "at once" (which ranks that hear it a step apart take at different steps, deadlocked in
        their saves). For how long: lifecycle.pace_wait."""
        deadline = self.clock.monotonic() + lifecycle.pace_wait(self.recovery_cfg, entry.reported, deadline_s)
        while not lifecycle.pace_known(entry.tracks, entry.reported) and self.clock.monotonic() < deadline:
            await self.clock.sleep(0.1)

    def checkpoint_ack(self, node: str, ack: node_pb2.CheckpointAck) -> None:
        """Rank `ack.rank` committed a checkpoint, says `node`: counted only from the node that runs that rank of
        the generation the request was for (another node's certificate cannot speak for it)."""
        entry = self.entries.get(ack.job)
        pending = entry.checkpoint if entry is not None else None
        if pending is None or pending.request_id != ack.request_id or \
                ack.generation != entry.of_record("generation_of", lifecycle.generation_of)(ack.rank):
            return  # unasked, or from a stale generation: fenced, never counted
        if not runs_here(entry.job, ack.rank, node):
            logger.warning("checkpoint ack from a node that does not run the rank: ignored", job=ack.job,
                           rank=ack.rank, node=node)
            return
        pending.acks[ack.rank] = ack.step
        (pending.in_memory.add if ack.in_memory else pending.in_memory.discard)(ack.rank)
        if len(pending.acks) >= pending.ranks:
            if pending.future is not None and not pending.future.done():
                pending.future.set_result(min(pending.acks.values()))
            self.wake()

    # -- following the ranks -------------------------------------------------------------------

    def observe(self, node: NodeEntry, heartbeat: node_pb2.Heartbeat) -> bool:
        """Fold a heartbeat's rank reports into the jobs (no I/O; wakes the executor when a decision may
        follow). True if the node runs ranks of no current generation (fencing follows)."""
        name = node.record.name
        self._fold_snapshots(name, heartbeat.snapshots)
        self._fold_standbys(name, heartbeat.standbys)
        if not heartbeat.ranks and name not in self._on_node:
            return False
        reported = {}
        stale = False
        for status in heartbeat.ranks:
            entry = self.entries.get(status.job)
            if entry is not None and entry.job.state in ACTIVE and \
                    status.generation == entry.of_record("generation_of", lifecycle.generation_of)(status.rank):
                if runs_here(entry.job, status.rank, name):  # a node speaks for its own ranks only
                    reported[(status.job, status.rank)] = status
            elif status.state == pb.RANK_STATE_RUNNING:
                stale = True
            elif entry is not None and entry.job.state in TERMINAL and \
                    status.generation == entry.of_record("generation_of", lifecycle.generation_of)(status.rank):
                self._rank_ended(entry, name, status)
        changed = stale
        now = self.now()
        for report in heartbeat.progress:
            entry = self.entries.get(report.job)
            if entry is None or entry.job.state not in ACTIVE or not runs_here(entry.job, report.rank, name) or \
                    entry.of_record("generation_of", lifecycle.generation_of)(report.rank) != report.generation:
                continue
            if not entry.tracks:  # trainlib speaks for this job: follow every rank's progress from now on
                entry.reported = True
                entry.tracks = {r: monitors.RankTrack(last_advance=now, last_report=now)
                                for r in ranktable.numbers(entry.job)}
            track = entry.tracks.get(report.rank)
            if track is None and entry.job.groups and 0 <= report.rank < ranktable.count(entry.job):
                track = entry.tracks[report.rank] = monitors.RankTrack(last_advance=now, last_report=now)  # rebuilt
            if track is not None:
                track.observe(report.last_step, report.mean_step_s, list(report.compute_samples), now, report.steps,
                              report.saving, report.last_step_unix_ns / 1e9, report.finished)
        for nccl in heartbeat.nccl:
            entry = self.entries.get(nccl.job)
            if entry is not None and entry.job.state in ACTIVE and runs_here(entry.job, nccl.rank, name):
                entry.nccl[nccl.rank] = nccl
        for job_id in self._on_node.get(name, ()):
            entry = self.entries[job_id]
            job = entry.job
            if job.state != RUNNING:
                changed = True  # launching, recovering or cancelling: each heartbeat may be the news it waits for
            if job.state in table.LAUNCHING:
                continue
            # a replica group out of the quorum: stopping, or starting (one set per record, not per heartbeat)
            out = bool(job.groups) and name in entry.of_record("out_of_quorum", lifecycle.out_of_quorum)
            for number, state, row in _ranks_on(entry, name):
                state = entry.ended[number][0] if number in entry.ended else state
                if state in (pb.RANK_STATE_EXITED, pb.RANK_STATE_LOST):
                    continue
                status = reported.get((job.id, number))
                if status is None and out:
                    continue  # not missing: its group's own steps say what it waits for
                if status is None:  # counted here; the lifecycle's step decides the rank LOST (ranks_lost)
                    entry.missing[number] = entry.missing.get(number, 0) + 1
                    if entry.missing[number] >= self.cfg.missing_reports_lost:
                        changed = True
                    continue
                entry.missing.pop(number, None)
                if row is None:
                    ranktable.set_pids(job, number, status.rank_pid or status.pid, status.pid)
                else:
                    row.pid, row.wrapper_pid = status.rank_pid or status.pid, status.pid
                if status.fatal and number not in entry.fatal:
                    entry.fatal[number] = status.fatal
                    changed = True
                if status.state != state and rank_may_move(state, status.state):  # news: the step takes it in
                    entry.ended[number] = (status.state, status.exit_code)
                    changed = True
        if changed:
            self.wake()
        return stale

    def _rank_ended(self, entry: JobEntry, node: str, status: node_pb2.RankStatus) -> None:
        """A rank of a job that ended while it ran (a job that gave up stops its other ranks) has ended too: its
        record says how once the executor saves it, instead of RUNNING for ever."""
        ranks = ranktable.rows(entry.job)  # in rank order (lifecycle.rank_table): on the heartbeat path, no search
        rank = ranks[status.rank] if status.rank < len(ranks) else None
        if rank is not None and rank.rank == status.rank and rank.node == node and \
                rank.state == pb.RANK_STATE_RUNNING and rank_may_move(rank.state, status.state):
            ranktable.set_states(entry.job, {status.rank: (status.state, status.exit_code)})
            self.ended_ranks.add(entry.job.id)
            self.wake()

    async def save_ended_ranks(self) -> None:
        """Save the records of ended jobs whose running ranks have ended since (`_rank_ended`), with an event."""
        for job_id in sorted(self.ended_ranks):
            entry = self.entries.get(job_id)
            if entry is not None and entry.job.state in TERMINAL:
                async with self.lock:
                    job = entry.job
                    running = ranktable.positions(job, pb.RANK_STATE_RUNNING)
                    await self.save(entry, lifecycle.Commit(job, "job.ranks_stopped", (
                        f"{job.id} ({state_name(job.state)}): its ranks have stopped" if not running else
                        f"{job.id} ({state_name(job.state)}): {lifecycle.ranks_named(running)} still to stop")))
            self.ended_ranks.discard(job_id)  # saved (a failed commit leaves it for the next pass)

    async def forget_ended(self) -> int:
        """Delete the records of ended jobs beyond `jobs.ended_kept` (the oldest first) or older than
        `jobs.ended_kept_s`, at most FORGET_BATCH a commit (the next pass goes on with a backlog, else the next
        look is FORGET_EVERY_S later), each with its `job.forgotten` event; how many. Never one
        whose ranks may still run (its stop is not saved yet), and never the newest job, whose id the next
        controller counts on from the records it loads."""
        now = self.now()
        if now - self._forgot_at < FORGET_EVERY_S:
            return 0
        self._forgot_at = now
        async with self.lock:
            ids = expired(self.entries.values(), self.ended_ranks, f"job-{self._next_id - 1}", now, self.cfg)
            gone = [self.entries[job_id] for job_id in ids]
            if not gone:
                return 0
            if len(gone) == FORGET_BATCH:
                self._forgot_at = float("-inf")  # more to do: at the next pass
            events = [self.event("job.forgotten", f"{e.job.id} ({state_name(e.job.state)}) no longer kept: past "
                                 f"jobs.ended_kept ({self.cfg.ended_kept} records) or jobs.ended_kept_s "
                                 f"({self.cfg.ended_kept_s:g}s); its events stay", e.job.id) for e in gone]
            committed = await self.store.commit(events=events, jobs=[
                JobRecord(e.job.id, state_name(e.job.state), b"", e.revision, deleted=True) for e in gone])
            for job_id in ids:
                del self.entries[job_id]
            logger.info("ended jobs forgotten", jobs=len(ids), first=ids[0], last=ids[-1])
            self.hub.publish(committed.events)
            return len(ids)

    async def fence(self, node: NodeEntry, heartbeat: node_pb2.Heartbeat) -> None:
        """Stop ranks running on `node` that belong to no current job generation: one stop per generation."""
        if node.session is None:
            return
        name, now = node.record.name, self.clock.monotonic()
        repeat = self.cfg.fence_repeat_s
        told = self._fenced[name] = {k: at for k, at in self._fenced.get(name, {}).items() if now - at < repeat}
        running = [(s.job, s.generation, s.rank) for s in heartbeat.ranks if s.state == pb.RANK_STATE_RUNNING]
        current = lambda job_id: e.job if (e := self.entries.get(job_id)) is not None else None  # noqa: E731
        for fence in lifecycle.fences(running, current, told, now, repeat):
            told[(fence.job, fence.generation)] = now
            ranks = ", ".join(map(str, fence.ranks))
            await self.log(lifecycle.Event("job.fenced", f"{fence.job}: stopping generation {fence.generation} on "
                                           f"{name} (ranks {ranks}): {fence.why}"), fence.job)
            try:
                await node.session.request(node_pb2.Command(stop=node_pb2.StopRanks(
                    job=fence.job, generation=fence.generation, grace_s=self.cfg.stop_grace_s)))
            except Exception as e:
                logger.warning("fencing failed", job=fence.job, node=name, error=str(e))

    def fenced(self, node: str, job: str, generation: int) -> None:
        self._fenced.setdefault(node, {})[(job, generation)] = self.clock.monotonic()

    # -- the store -------------------------------------------------------------------------------

    async def save(self, entry: JobEntry, commit: lifecycle.Commit) -> None:
        """Commit the record with its event; memory follows only once the store has it. Lock held.

        Run to its end: the caller may be an RPC whose client gave up (a `phalanx checkpoint` with a short
        deadline) and is cancelled while the store commits. Cancelled between the store's write and memory's
        update, the entry kept the old revision, and every later commit of the job failed its revision check for
        good; merely shielded, the commit went on after its caller had let go of the lock, and the next commit of
        the job raced it with the revision it was replacing (the fuzzer found both). The commit and the update run
        to the end together, the lock held; the caller's cancel comes after."""
        await clocks.to_the_end(self._save(entry, commit))

    async def lighthouse(self, entry: JobEntry) -> None:
        """A replica-group job loaded by a controller that restarted or took over, or one whose lighthouse is gone
        (Executor._look_after_lighthouse): its lighthouse taken up (it outlives its controller), else started again
        (on the port its ranks were told if it is free: Lighthouses.ensure), and then the record says so at once (a
        controller that fails next must find that one; the nodes are told where it runs). Without one the job runs
        on, its event log saying why once. (A launch starts one too: Executor._launch.)"""
        job = entry.job
        if self.lighthouses is None or job.spec.replicas <= 1 or job.state == table.PENDING or \
                job.state not in ACTIVE or self.lighthouses.closed:
            return
        try:
            held = await self.lighthouses.ensure(job.id, **looks(job, (e.job for e in self.entries.values())))
        except LighthouseError as e:  # tried again while the job runs, less and less often, and at each launch
            told = (f"tried again while it runs (its ranks were told port {job.lighthouse_port})"
                    if job.lighthouse_port else "its ranks are not told TORCHFT_LIGHTHOUSE")
            await self.no_lighthouse(job.id, f"{e}; {told}")
            return
        if (held.control, held.token) == (job.lighthouse_control, job.lighthouse_token):
            return  # taken up: the record says where it runs
        async with self.lock:
            if entry.job.state in ACTIVE:
                await self.save(entry, lifecycle.Commit(
                    lifecycle.copied(entry.job), "job.lighthouse",
                    f"{job.id}: its lighthouse started again on port {held.port} (the one its record named could "
                    f"not be taken up: {job.lighthouse_control or 'none named'}); its groups' managers ask it again "
                    "and carry on (TORCHFT_QUORUM_RETRIES)"))

    async def no_lighthouse(self, job_id: str, why: str) -> None:
        """Say once in the job's event log that it runs without a lighthouse of the controller's, and why."""
        if job_id not in self._no_lighthouse:
            self._no_lighthouse.add(job_id)
            logger.warning("no lighthouse", job=job_id, error=why)
            await self.log(lifecycle.Event("job.no_lighthouse", f"{job_id}: no torchft lighthouse for its replica "
                                           f"groups: {why}"), job_id)

    async def _save(self, entry: JobEntry, commit: lifecycle.Commit) -> None:
        job = commit.job
        if self.lighthouses is not None and job.spec.replicas > 1 and job.state in ACTIVE:
            describe(job, self.lighthouses.held(job.id))  # the record keeps it (none: the last one's)
        elif job.state in TERMINAL:  # ended: nothing is to take its lighthouse up again
            job.lighthouse_control, job.lighthouse_token = "", ""
        job.progress_reported = entry.reported  # set by a heartbeat, kept for the next controller at the next commit
        event = self.event(commit.kind, commit.message, job.id)
        record = JobRecord(job.id, state_name(job.state), job_record.pack(job), entry.revision)
        committed = await self.store.commit(jobs=[record], events=[event])
        entry.job, entry.revision = job, committed.jobs[0].revision
        if self.lighthouses is not None and job.state in TERMINAL:
            await self.lighthouses.stop(job.id)
        rebuilt = lifecycle.group_rebuilt(job) if job.generation != entry.generation else set()
        per = job.spec.ranks_per_node  # (rank r on node r // per: a generation's layout, either form)
        entry.new_generation(job.generation, rebuilt, {job.nodes[r // per] for r in rebuilt})
        if rebuilt and entry.tracks:  # followed from its launch on, as every rank of a new generation is
            now = self.now()
            entry.tracks.update({r: monitors.RankTrack(last_advance=now, last_report=now) for r in rebuilt})
        if entry.ended:
            entry.ended = lifecycle.ended_unsaved(job, entry.ended)
        self.index(job)
        logger.info(commit.kind.removeprefix("job.").replace(".", " "), kind=commit.kind, job=job.id,
                    generation=job.generation, state=state_name(job.state), detail=commit.message)
        self.hub.publish(committed.events)

    def index(self, job: pb.Job) -> None:
        for ids in self._on_node.values():
            ids.discard(job.id)
        if job.state in ACTIVE:
            for node in [*job.nodes, *job.spares]:
                self._on_node.setdefault(node, set()).add(job.id)
        for node in [n for n, ids in self._on_node.items() if not ids]:
            del self._on_node[node]

    def _fold_snapshots(self, node: str, snapshots) -> None:
        """What in-memory snapshots `node` holds now, per job (a job it reported before and not now: none)."""
        if not snapshots and node not in self._snapshots_on:
            return  # the heartbeat of a node that holds none and held none: most of them
        for entry in self._fold_by_job(self._snapshots_on, node, snapshot_plan.by_job(snapshots), "snapshots"):
            job = entry.job
            if job.state == RUNNING and len(job.nodes) >= 2 and node == job.nodes[0]:  # once an interval, not per node
                step = entry.snapshots.safe(job.generation, ranktable.count(job))
                if step is not None and (job.generation, step) > entry.pinned:
                    entry.safe = (job.generation, step)
                    self.wake()  # the step pins it (lifecycle.upkeep)

    def _fold_standbys(self, node: str, standbys) -> None:
        """How many warm standbys of each job `node` holds ready now, and whether any is starting there."""
        if any(s.starting for s in standbys):
            self.own_work_at[node] = self.now()
        if not standbys and node not in self._standbys_on:
            return
        self._fold_by_job(self._standbys_on, node, {s.job: s.ready for s in standbys if s.ready}, "standbys")

    def _fold_by_job(self, seen: dict[str, set[str]], node: str, by_job: dict, name: str) -> list[JobEntry]:
        """Set what `node` says of each active job into the entry's `name` dict, by node (a job it said something of
        before and not now: removed). Returns the entries set."""
        for job in seen.get(node, set()) - set(by_job):
            entry = self.entries.get(job)
            if entry is not None:
                getattr(entry, name).pop(node, None)
        updated = []
        for job, value in by_job.items():
            entry = self.entries.get(job)
            if entry is not None and entry.job.state in ACTIVE:
                getattr(entry, name)[node] = value
                updated.append(entry)
        if by_job:
            seen[node] = set(by_job)
        else:
            seen.pop(node, None)
        return updated

    async def log(self, event: lifecycle.Event, job: str) -> None:
        committed = await self.store.commit(events=[self.event(event.kind, event.message, job)])
        self.hub.publish(committed.events)

    def event(self, kind: str, message: str, job: str) -> EventRecord:
        return EventRecord(kind=kind, message=message, time_ns=self.clock.wall_ns(), job=job, fields=access.by(kind))
