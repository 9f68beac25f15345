"""The rendezvous servicer (torchrun's `--rdzv-backend=phalanx`): unpacks, asks the book, packs.

It reads the clock once per step and turns long waits into bounded server-side waits the client
repeats, so no call outlives its deadline. The decisions are `controller.rendezvous.book`'s.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from controller import access
from controller.api.rpc import unary
from controller.config import RecoveryConfig
from controller.errors import InvalidArgument, NotFound, RevisionConflict
from controller.nodes.states import DOWN
from controller.recovery.detectors import NodeView
from controller.rendezvous.book import (
    DEFAULT_POLICY,
    MAX_COMPUTE_SAMPLES,
    MAX_ID_CHARS,
    MAX_NODES,
    MAX_RUNS,
    MAX_WAIT_S,
    MAX_WORKERS,
    RELEARN_GRACE_S,
    Member,
    Outcome,
    RendezvousBook,
    Run,
    Settings,
    StoreAddress,
    Worker,
)
from controller.store.base import JobRecord
from phalanx import clock as clocks
from phalanx import log as logs
from phalanx.clock import Clock
from phalanx.names import NAME
from phalanx.v1 import common_pb2, rendezvous_pb2, rendezvous_pb2_grpc

if TYPE_CHECKING:
    from controller.nodes.registry import Registry
    from controller.store.base import Store

logger = logs.get("rendezvous")

TORCHRUN_PREFIX = "torchrun-"  # how `phalanx jobs` and the event log name a torchrun run: torchrun-RUN_ID
ENDED_RUNS_KEPT = 100  # ended torchrun runs `phalanx jobs` still shows, the newest
ENDED_RUN_TTL_S = 3600.0  # and for how long after they ended


def job_name(run_id: str) -> str:
    """The run's name as a job, for `phalanx jobs` and `phalanx events --job`; '' if the run id cannot be one."""
    name = f"{TORCHRUN_PREFIX}{run_id}"
    return name if NAME.fullmatch(name) else ""


def record_id(run_id: str) -> str:
    """The id of the run's record in the store: its job name, or for a run id that cannot be one, a digest of it
    (the record's command holds the run id itself)."""
    return job_name(run_id) or f"{TORCHRUN_PREFIX}{hashlib.sha256(run_id.encode()).hexdigest()[:32]}"


def stored_run_id(job: common_pb2.Job) -> str:
    """The run id a stored torchrun record is of ('' if the record says none: not one this controller wrote)."""
    rdzv = [a for a in job.spec.command if a.startswith(RDZV_ID)]
    return rdzv[0].removeprefix(RDZV_ID) if rdzv else ""


RDZV_ID = "--rdzv-id="
RETRY_WRITE_S = 2.0  # a run's record the store did not take is written again this long after
TERMINAL = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)


def _text(value: str, field_name: str, hint: str) -> str:
    if not value:
        raise InvalidArgument(f"{field_name} is empty; {hint}")
    if len(value) > MAX_ID_CHARS or not value.isprintable() or any(c.isspace() for c in value):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise InvalidArgument(f"{field_name} {shown!r} must be 1-{MAX_ID_CHARS} printable characters without spaces")
    return value


def _seconds(value: float, field_name: str, low: float, high: float) -> float:
    if not low <= value <= high:  # also false for NaN
        raise InvalidArgument(f"{field_name} ({value:g}s) must be between {low:g}s and {high:g}s")
    return value


def _settings(s: rendezvous_pb2.RoundSettings) -> Settings:
    if s.min_nodes < 1:
        raise InvalidArgument(f"settings.min_nodes ({s.min_nodes}) must be at least 1")
    if s.min_nodes > s.max_nodes:
        raise InvalidArgument(f"settings.min_nodes ({s.min_nodes}) must not be larger than max_nodes ({s.max_nodes})")
    if s.max_nodes > MAX_NODES:
        raise InvalidArgument(f"settings.max_nodes ({s.max_nodes}) is more than {MAX_NODES}")
    return Settings(s.min_nodes, s.max_nodes, _seconds(s.last_call_s, "settings.last_call_s", 0, 3600),
                    _seconds(s.hang_s, "settings.hang_s", 0, 7 * 86400))


def _store(s: rendezvous_pb2.StoreAddress) -> StoreAddress:
    host = _text(s.host, "store.host", "give the address other nodes reach this node's TCPStore at")
    if not 1 <= s.port <= 65535:
        raise InvalidArgument(f"store.port ({s.port}) must be between 1 and 65535")
    return StoreAddress(host, s.port)


def run_job(run: Run, owner: str = "", seen_ns: int = 0, ended: bool = False) -> common_pb2.Job:
    """A torchrun run as `phalanx jobs` shows it. RUNNING while members of its formed round are still there, even
    once a node's torchrun closed the rendezvous (a node left out of the next round shuts down and closes it;
    the others train on); ended (`ended`: every member gone) it is SUCCEEDED when its workers said training
    ended, or did not report at all, and FAILED when some worker that reported never did."""
    formed, waiting = run.formed, list(run.open.waiting.values()) if run.open else []
    members = (formed.member_ids() - run.left) if formed is not None else set()
    closed = " (rendezvous closed: no new round forms)" if run.closed else ""
    if ended or (run.closed and not members):
        workers = list(formed.workers.values()) if formed is not None else []
        unfinished = sorted(w.rank for w in workers if not w.finished)
        if workers and unfinished:
            state = common_pb2.JOB_STATE_FAILED
            said = ", ".join(map(str, unfinished[:8]))
            reason = f"torchrun run ended in round {formed.number} before worker(s) {said} said training ended"
        else:
            state = common_pb2.JOB_STATE_SUCCEEDED
            reason = "torchrun run ended" + (f": every worker of round {formed.number} said training ended"
                                             if workers else " (its workers did not report: not trainlib's)")
    elif formed is not None:
        state = common_pb2.JOB_STATE_RUNNING
        reason = f"torchrun round {formed.number}: {len(formed.ranks)} nodes" + (
            f", {len(waiting)} waiting (round {run.open.number})" if waiting else "") + closed
    else:
        state = common_pb2.JOB_STATE_PENDING
        reason = f"torchrun round {run.open.number if run.open else 0} forming: {len(waiting)} joined"
    ranks = formed.ranks if formed is not None else []
    settings = (formed or run.open).settings if (formed or run.open) else None
    job = common_pb2.Job(id=job_name(run.id) or f"{TORCHRUN_PREFIX}{run.id[:40]}", state=state, reason=reason,
                         generation=formed.number if formed else 0,
                         nodes=[p.node or p.id for p in ranks], spares=[p.node or p.id for p in waiting])
    job.spec.name = run.id[:63]
    job.user = owner
    job.spec.command.extend(["torchrun", f"{RDZV_ID}{run.id}"])
    job.incident_nodes.extend(sorted(run.evicted))  # left out of the run's rounds (stragglers): kept across takeovers
    if run.evicted:
        job.incident = "; ".join(f"node {n}: {why}" for n, why in sorted(run.evicted.items()))
    job.spec.nodes = settings.max_nodes if settings else 0
    if formed is not None and formed.world_size and formed.ranks:
        job.spec.ranks_per_node = max(1, formed.world_size // len(formed.ranks))
    job.submitted_unix_ns = seen_ns
    job.restarts = run.restarts
    return job


class RendezvousService(rendezvous_pb2_grpc.RendezvousServiceServicer):
    def __init__(self, clock: Clock, registry: Registry | None = None,
                 log: Callable[[str, str, str], Awaitable[None]] | None = None, restarted: bool = False,
                 policy: RecoveryConfig = DEFAULT_POLICY, store: Store | None = None) -> None:
        """`restarted`: this controller took over a fleet (its store knew nodes), so torchrun groups may be running:
        no round forms in its first RELEARN_GRACE_S, while their members re-teach it theirs. `store`: where each
        run is kept as a job record (`load` reads them back after a restart or a takeover)."""
        self._clock = clock
        self._events: dict[str, asyncio.Event] = {}
        self._registry = registry
        self._log = log  # (kind, message, run id) -> committed to the event log
        self._logging: set[asyncio.Task] = set()
        self._owners: dict[str, str] = {}  # run id -> the identity that owns it (with an access file)
        self._seen_ns: dict[str, int] = {}  # run id -> when (wall) this controller first heard of it
        self._ended: dict[str, tuple[float, common_pb2.Job]] = {}  # run id -> (when, how it ended), lately ended
        self._store = store
        self._records: dict[str, tuple[int, bytes]] = {}  # record id -> (revision, data) as last stored
        self._dirty: set[str] = set()  # runs whose record may have changed
        self._writer: asyncio.Task | None = None
        self._stored: dict[str, common_pb2.Job] = {}  # run id -> its record, for a run restored and not re-taught yet
        # Request ids from the wall clock (ms): a restarted controller never reuses one a worker already answered.
        self.book = RendezvousBook(on_change=self._wake, view=self._view, on_event=self._event,
                                   first_ask_id=clock.wall_ns() // 1_000_000,
                                   hold_until=clock.monotonic() + RELEARN_GRACE_S if restarted else float("-inf"),
                                   policy=policy, on_forget=self._forgotten)

    def _view(self, node: str) -> NodeView | None:
        """What recovery knows of `node`, from the controller's registry; None for a node it does not know (no
        Phalanx agent there: not judged)."""
        if self._registry is None:
            return None
        try:
            entry = self._registry.get(node)  # not entries_by_name(): every torchrun agent asks each second
        except NotFound:
            return None
        verdict = entry.verdict
        return NodeView(node, entry.record.state is DOWN, verdict.health, "; ".join(verdict.reasons[:2]),
                        connected=entry.session is not None, drained=bool(entry.record.drain_reason),
                        drain_reason=entry.record.drain_reason)

    async def load(self) -> None:
        """The runs a previous controller stored (a restart, a takeover): those that ran keep their owner and the
        nodes evicted from them, and show as they were until their members re-teach their round; those that had
        ended show as ended."""
        if self._store is None:
            return
        now = self._clock.monotonic()
        for record in await self._store.load_jobs():
            if not record.id.startswith(TORCHRUN_PREFIX):
                continue
            job = common_pb2.Job.FromString(record.data)
            run_id = stored_run_id(job)
            if not run_id or record_id(run_id) != record.id:
                continue  # not a record this service wrote
            self._records[record.id] = (record.revision, record.data)
            if job.state in TERMINAL:
                self._ended[run_id] = (now, job)
                continue
            why = f"it was evicted from rendezvous {run_id!r} (before this controller took over)"
            self.book.restore(run_id, job.generation, dict.fromkeys(job.incident_nodes, why), job.restarts, now)
            self._stored[run_id] = job
            if job.user:
                self._owners[run_id] = job.user
            if job.submitted_unix_ns:
                self._seen_ns[run_id] = job.submitted_unix_ns
        if self._records:
            logger.info("torchrun runs loaded", running=len(self._stored), ended=len(self._ended))

    def _mark(self, run_id: str) -> None:
        """The run's record may have changed: write it (one writer; it writes only what differs)."""
        if self._store is None:
            return
        self._dirty.add(run_id)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_dirty(), name="rendezvous-records")

    async def flush(self) -> None:
        """Wait until every run's record is written (or its write has failed)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    def _record_of(self, run_id: str) -> common_pb2.Job | None:
        """The run's record as it should be stored now; None: none (forgotten, and past its time as ended)."""
        run = self.book.get(run_id)
        if run is not None:
            if run.restored and run_id in self._stored:
                return self._stored[run_id]
            self._stored.pop(run_id, None)  # re-taught: its own record from now on
            return run_job(run, self._owners.get(run_id, ""), self._seen_ns.get(run_id, 0))
        ended = self._ended.get(run_id)
        return ended[1] if ended is not None else None

    async def _write_dirty(self) -> None:
        while self._dirty:
            run_id = self._dirty.pop()
            key = record_id(run_id)
            job = self._record_of(run_id)
            data = job.SerializeToString() if job is not None else None
            known = self._records.get(key)
            if (known[1] if known else None) == data:
                continue
            record = JobRecord(key, common_pb2.JobState.Name(job.state) if job is not None else "", data or b"",
                               known[0] if known else 0, deleted=data is None)
            try:
                committed = await self._store.commit(jobs=[record])
            except RevisionConflict:  # written meanwhile by another controller (a term before): take its revision
                try:
                    stored = [r for r in await self._store.load_jobs() if r.id == key]
                except Exception as e:
                    self._retry(run_id, e)
                    continue
                self._records.pop(key, None)
                self._records.update((r.id, (r.revision, r.data)) for r in stored)
                self._dirty.add(run_id)  # at once, with the revision the store has
                continue
            except Exception as e:
                self._retry(run_id, e)
                continue
            if data is None:
                self._records.pop(key, None)
            else:
                self._records[key] = (committed.jobs[0].revision, data)

    def _retry(self, run_id: str, error: Exception) -> None:
        """The store did not take the run's record (unavailable): the rendezvous goes on, and it is written again
        in a while, unless this service is closed by then."""
        logger.warning("could not store a torchrun run; will retry", run=run_id, error=str(error))
        self._clock.call_later(RETRY_WRITE_S, lambda: self._mark(run_id))

    async def close(self) -> None:
        """Write what is left (a run that just ended) and write nothing more: the controller stops."""
        try:
            await self.flush()
        finally:
            self._store = None

    def _event(self, kind: str, message: str, run_id: str) -> None:
        if self._log is None:
            return
        task = asyncio.get_running_loop().create_task(self._log(kind, message, run_id))
        self._logging.add(task)
        task.add_done_callback(self._logging.discard)

    def jobs(self) -> list[common_pb2.Job]:
        """The torchrun runs, as `phalanx jobs` lists them: the running round's nodes, the waiting ones as spares;
        and those that ended lately (ENDED_RUNS_KEPT, for ENDED_RUN_TTL_S) unless a new run took the id."""
        now = self._clock.monotonic()
        self.book.sweep(now)
        kept = {r: (t, j) for r, (t, j) in self._ended.items()
                if now - t < ENDED_RUN_TTL_S and self.book.get(r) is None}
        for run_id in set(self._ended) - set(kept):
            self._mark(run_id)  # its record goes too (or becomes the new run's)
        self._ended = kept
        live = [self._record_of(run.id) for run in self.book.runs()]
        return [j for j in live if j is not None] + [job for _, job in self._ended.values()]

    def _forgotten(self, run: Run) -> None:
        """The book forgets a run (everyone left, or abandoned): keep how it ended for `phalanx jobs` and `job`."""
        if run.restored and run.id in self._stored:  # no member came back after the takeover
            job = common_pb2.Job()
            job.CopyFrom(self._stored.pop(run.id))
            job.state = common_pb2.JOB_STATE_FAILED
            job.reason = "no member of the torchrun run came back after the controller took over"
            self._seen_ns.pop(run.id, None)
        else:
            job = run_job(run, self._owners.get(run.id, ""), self._seen_ns.pop(run.id, 0), ended=True)
        self._ended[run.id] = (self._clock.monotonic(), job)
        self._mark(run.id)
        while len(self._ended) > ENDED_RUNS_KEPT:
            oldest = next(iter(self._ended))
            del self._ended[oldest]
            self._mark(oldest)  # its record goes too

    def _authorize(self, run_id: str) -> None:
        """Raise PermissionDenied unless the caller may act on the run: with an access file, the identity that
        first joined (or reported to) it owns it, and only that identity or an admin may join, report to or close
        it. The owner is kept in the run's record, so a restart or a takeover keeps it; a run this controller does
        not hold (new, or forgotten) goes to the first identity that acts on it."""
        who = access.caller()
        if who is None:  # no access file: every client is an admin
            return
        self.book.sweep(self._clock.monotonic())  # a run abandoned past its time is forgotten first: its id is free
        owner = self._owners.get(run_id)
        if owner is None or self.book.get(run_id) is None:
            if len(self._owners) >= 2 * MAX_RUNS:
                self._owners = {r: o for r, o in self._owners.items() if self.book.get(r) is not None}
            self._owners[run_id] = who.name
            return
        access.require_owner(owner, f"torchrun run {run_id!r}")

    def _wake(self, run_id: str) -> None:
        event = self._events.pop(run_id, None)
        if event is not None:
            event.set()
        self._mark(run_id)

    @unary
    async def Join(self, request: rendezvous_pb2.JoinRequest, context) -> rendezvous_pb2.RoundReply:
        run_id = _text(request.run_id, "run_id", "pass --rdzv-id")
        self._authorize(run_id)
        pid = _text(request.participant_id, "participant_id", "give a name unique to this torchrun agent")
        settings = _settings(request.settings)
        join_timeout = _seconds(request.join_timeout_s, "join_timeout_s", 0.001, 7 * 86400)
        store = _store(request.store)
        node = request.node if not request.node or NAME.fullmatch(request.node) else ""
        reply = self.book.join(run_id, pid, request.attempt, settings, join_timeout, store, self._clock.monotonic(),
                               node)
        if len(self._seen_ns) < 2 * MAX_RUNS:
            self._seen_ns.setdefault(run_id, self._clock.wall_ns())
        return reply.to_proto()

    @unary
    async def AwaitRound(self, request: rendezvous_pb2.AwaitRoundRequest, context) -> rendezvous_pb2.RoundReply:
        run_id = _text(request.run_id, "run_id", "pass --rdzv-id")
        self._authorize(run_id)
        pid = _text(request.participant_id, "participant_id", "give the id this participant joined with")
        wait_s = _seconds(request.wait_s, "wait_s", 0, MAX_WAIT_S)
        start = self._clock.monotonic()
        while True:
            now = self._clock.monotonic()
            reply = self.book.poll(run_id, pid, request.round, now)
            left = start + wait_s - now
            if reply.outcome is not Outcome.WAITING or left <= 0:
                return reply.to_proto()
            # No await between the poll and here, so no change can slip in before we wait on the event.
            event = self._events.setdefault(run_id, asyncio.Event())
            wakeup = self.book.next_wakeup(run_id)
            timeout = left if wakeup is None else min(left, max(0.0, wakeup - now) + 0.001)
            try:
                await clocks.wait_for(self._clock, event.wait(), timeout)
            except TimeoutError:
                pass

    @unary
    async def NumNodesWaiting(self, request: rendezvous_pb2.NumNodesWaitingRequest,
                              context) -> rendezvous_pb2.NumNodesWaitingReply:
        run_id = _text(request.run_id, "run_id", "pass --rdzv-id")
        self._authorize(run_id)
        pid = _text(request.participant_id, "participant_id", "give the id this participant joined with")
        member = None
        if request.HasField("member"):
            m = request.member
            settings = _settings(m.settings)
            if not 1 <= m.world_size <= settings.max_nodes:
                raise InvalidArgument(f"member.world_size ({m.world_size}) must be between 1 and its settings' "
                                      f"max_nodes ({settings.max_nodes})")
            if m.rank >= m.world_size:
                raise InvalidArgument(f"member.rank ({m.rank}) must be below member.world_size ({m.world_size})")
            node = m.node if not m.node or NAME.fullmatch(m.node) else ""
            member = Member(m.rank, m.world_size, _store(m.store), settings, node, m.attempt)
        waiting = self.book.num_waiting(run_id, pid, request.round, self._clock.monotonic(), member)
        return rendezvous_pb2.NumNodesWaitingReply(waiting=waiting)

    @unary
    async def SetClosed(self, request: rendezvous_pb2.SetClosedRequest, context) -> rendezvous_pb2.SetClosedReply:
        run_id = _text(request.run_id, "run_id", "pass --rdzv-id")
        self._authorize(run_id)
        self.book.close(run_id, self._clock.monotonic())
        return rendezvous_pb2.SetClosedReply()

    @unary
    async def GetRun(self, request: rendezvous_pb2.GetRunRequest, context) -> rendezvous_pb2.RunStatus:
        run_id = _text(request.run_id, "run_id", "pass --rdzv-id")
        self.book.sweep(self._clock.monotonic())
        run = self.book.get(run_id)
        if run is None:
            raise NotFound(f"rendezvous {run_id!r} is not known here (never joined, or finished and forgotten)")
        return rendezvous_pb2.RunStatus(
            run_id=run.id, closed=run.closed, formed_round=run.formed.number if run.formed else 0,
            world_size=len(run.formed.ranks) if run.formed else 0, open_round=run.open.number if run.open else 0,
            waiting=len(run.open.waiting) if run.open else 0)

    @unary
    async def Leave(self, request: rendezvous_pb2.LeaveRequest, context) -> rendezvous_pb2.LeaveReply:
        run_id = _text(request.run_id, "run_id", "pass --rdzv-id")
        self._authorize(run_id)
        pid = _text(request.participant_id, "participant_id", "give the id this participant joined with")
        self.book.leave(run_id, pid, request.round, request.close_run, self._clock.monotonic())
        return rendezvous_pb2.LeaveReply()

    @unary
    async def ReportWorker(self, request: rendezvous_pb2.WorkerReport, context) -> rendezvous_pb2.WorkerReply:
        run_id = _text(request.run_id, "run_id", "the worker's $PHALANX_RDZV_RUN (its torchrun --rdzv-id)")
        self._authorize(run_id)
        if not 1 <= request.world_size <= MAX_WORKERS:
            raise InvalidArgument(f"world_size ({request.world_size}) must be between 1 and {MAX_WORKERS}")
        if request.rank >= request.world_size:
            raise InvalidArgument(f"rank ({request.rank}) must be below world_size ({request.world_size})")
        if request.step < -1 or request.done_step < -1:
            raise InvalidArgument(f"step ({request.step}) and done_step ({request.done_step}) must be -1 (none) "
                                  "or more")
        step_s = _seconds(request.step_s, "step_s", 0, 3600)
        node = request.node if NAME.fullmatch(request.node) else ""
        if len(request.compute_s) > MAX_COMPUTE_SAMPLES:
            raise InvalidArgument(f"compute_s has {len(request.compute_s)} samples; at most {MAX_COMPUTE_SAMPLES} a "
                                  "report (the steps since the last one)")
        compute_s = tuple(_seconds(c, "compute_s", 0, 3600) for c in request.compute_s)
        worker = Worker(request.rank, request.world_size, request.step, step_s, self._clock.monotonic(),
                        request.done_id, request.done_step, node, request.saving, request.finished,
                        compute_s=compute_s)
        ask = self.book.report_worker(run_id, request.round, worker, worker.heard)
        if ask is None:
            return rendezvous_pb2.WorkerReply()
        return rendezvous_pb2.WorkerReply(checkpoint_id=ask.id, at_step=ask.at_step, pause=True,
                                          reason=f"round {ask.round} restarts without {ask.why}")
