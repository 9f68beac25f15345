"""A job's whole life as one pure decision: `step(job, view, now, cfg) -> list[Action]`.

`job` is the stored record (the truth); `view` is what this controller process sees of the job's
nodes, ranks, progress and acknowledgements, and of its own commands in flight; `now` is wall-clock
seconds. The answer is data: commit a new record (with its event), launch, stop, drain, ask for a
checkpoint, wake me at. `controller.recovery.executor` applies it, committing to the store first, and
steps again as outcomes come back. A controller that restarts starts with an empty view and steps the
stored record like any other: a command the previous process sent but whose outcome it never saw
shows up as "sent, never seen here" (`launched_generation`, `checkpoint.id`), and is redone or
abandoned by the same rules. Every state change goes through `controller.recovery.table`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

from controller.config import JobsConfig, RecoveryConfig
from controller.jobs.placement import Candidate, GangRequest, Placement, Unplaceable, place
from controller.jobs.topology import ClusterTopology
from controller.recovery import progress
from controller.recovery.detectors import Incident, NodeView, backoff, detect, training_over, unsettled
from controller.recovery.table import (
    ACTIVE,
    CANCELLED,
    CANCELLING,
    CHECKPOINTING,
    EVICTING,
    FAILED,
    PENDING,
    RANK_EXITED,
    RANK_LOST,
    RANK_RUNNING,
    RANK_UNKNOWN,
    RENDEZVOUS,
    RESTARTING,
    RUNNING,
    STARTING,
    SUCCEEDED,
    check,
    check_rank,
    rank_may_move,
    state_name,
)
from phalanx import hostlist, slurm
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb

# -- the view ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchView:
    """This process's launch of one generation: in flight, or how it ended."""

    generation: int
    done: bool = False
    ok: bool = False
    error: str = ""
    address: str = ""
    port: int = 0


@dataclass(frozen=True)
class CheckpointView:
    """This process's sending of one checkpoint request, and the ranks' acknowledgements (rank -> step)."""

    request_id: int
    acks: Mapping[int, int] = field(default_factory=dict)
    in_memory: int = 0  # of the acks, those committed as in-memory snapshots (replicated), not durable saves


@dataclass(frozen=True)
class JobView:
    nodes: Mapping[str, NodeView] = field(default_factory=dict)  # the job's nodes and spares
    # Of `nodes`, the names whose view is unwell (detectors.is_unwell), where the driver keeps them as views change
    # (the simulator: a job of 16,384 nodes is judged at every step); it then has a view of each of the job's nodes.
    # None: the detectors look through `nodes`.
    unwell: AbstractSet[str] | None = None
    # Of `candidates`, those a next generation cannot run on (`unfit`), where the driver keeps them as candidates
    # change (the simulator); None: next_nodes looks through `candidates`.
    unfit: AbstractSet[str] | None = None
    # Of `nodes`, the names whose view is down or not connected (no stop can reach them), where the driver keeps them
    # as views change (the simulator); it then has a view of each of the job's nodes. None: the stops look through
    # `nodes`.
    unreachable: AbstractSet[str] | None = None
    # Of `candidates` (the fleet's), the names no job holds, where the driver keeps them as jobs take and release
    # nodes (the simulator): the few a job short of spares may take. None: replenish looks through `candidates`.
    idle: AbstractSet[str] | None = None
    # The job's nodes as a set, where the driver keeps one (the simulator): a step asks of it in C what it would
    # otherwise ask of the record's list of 16,384 names, one by one. None: a step makes the set where it needs one.
    members: AbstractSet[str] | None = None
    # The job's nodes in rank order (the record's list), where the driver keeps them for the generation (the
    # simulator): each read of the record's list makes its 16,384 strings anew, and hashes them anew in each set
    # asked of them. None: a step reads the record.
    node_list: Sequence[str] | None = None
    # The generation's stops, as sets of node names (a node's view says its health; these say how far this process's
    # stop of the job has got there, and a recovery moves every node of the job through them at once):
    told: AbstractSet[str] = frozenset()  # told to stop the generation by this process, on the node's current
    # session, and lately (RESTOP_S): a stop that raced a launch still in flight is sent again
    stopped: AbstractSet[str] = frozenset()  # ... and a heartbeat since says none of the generation's ranks runs there
    running: AbstractSet[str] = frozenset()  # its newest heartbeat shows ranks of the job's generation running
    tracks: Mapping[int, progress.RankTrack] = field(default_factory=dict)  # this generation's progress
    nccl: Mapping[int, pb.NcclRankState] = field(default_factory=dict)  # rank -> newest flight-recorder state
    fatal: Mapping[int, str] = field(default_factory=dict)  # rank -> why it stopped for good
    launch: LaunchView | None = None  # of job.generation, by this process
    checkpoint: CheckpointView | None = None  # of job.checkpoint.id, by this process
    # name -> the node as placement sees it (this job's own count as free): every node (`fleet`), or the job's own
    candidates: Mapping[str, Candidate] = field(default_factory=dict)
    topology: ClusterTopology | None = None
    fleet: bool = False  # `candidates` are every node of the fleet, not only the job's own
    reported: bool = False  # trainlib has reported progress for some generation of the job (it will for this one)
    step_s: float = 0.0  # the job's step time where the driver knows it without progress reports (the simulator's)
    # rank -> heartbeats in a row from its node without news of it (this generation; the job manager counts them)
    missing: Mapping[int, int] = field(default_factory=dict)
    # rank -> (state, exit code) its node reported that the record does not say yet (this generation)
    ended: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    # spare -> when (the clock of `now`) it was last asked to hold standbys; None: this driver keeps none (the
    # simulator models warm starts itself)
    prepared: Mapping[str, float] | None = None
    snapshot_step: int | None = None  # the newest step of which every rank's in-memory snapshot is held twice over
    pinned: tuple[int, int] = (0, 0)  # (generation, step) the job's nodes were last told to keep


@dataclass(frozen=True)
class Policy:
    recovery: RecoveryConfig
    jobs: JobsConfig


# -- the actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Commit:
    """Store `job` (with an event); memory follows the store. `incident` counts a new incident of that kind."""

    job: pb.Job
    kind: str
    message: str
    incident: str = ""


@dataclass(frozen=True)
class Launch:
    job: str
    generation: int
    nodes: tuple[str, ...] = ()  # a replica group's rebuild: only these nodes (the ranks of `generation`); () = all


@dataclass(frozen=True)
class Stop:
    """Stop generation `generation` of `job` on each of `nodes`: one action for many (a job of 16,384 nodes stops
    them all at each of its recoveries)."""

    nodes: tuple[str, ...]
    job: str
    generation: int


@dataclass(frozen=True)
class Drain:
    node: str
    reason: str


@dataclass(frozen=True)
class RequestCheckpoint:
    job: str
    generation: int
    nodes: tuple[str, ...]
    request: pb.JobCheckpoint


@dataclass(frozen=True)
class WakeAt:
    at: float  # wall-clock seconds


@dataclass(frozen=True)
class Event:
    kind: str
    message: str


@dataclass(frozen=True)
class Prepare:
    """Ask a spare to hold `count` standbys of the job's ranks (started ahead: a restart there skips starting Python
    and importing torch); count 0: let them go."""
    node: str
    count: int


@dataclass(frozen=True)
class Pin:
    """Tell the nodes that hold the job's in-memory snapshots to keep `step` (held twice over) however many newer
    ones come: a restart resumes from it if a node is lost."""
    step: int


@dataclass(frozen=True)
class LeaveQuorum:
    """Take replica group `group` out of the job's quorum now (its lighthouse issues the others' next quorum without
    it, not `heartbeat_timeout_ms` after its heartbeats stop): `reason` is what its managers' requests are refused
    with."""
    group: int
    reason: str


Action = Commit | Launch | Stop | Drain | RequestCheckpoint | WakeAt | Event | Prepare | Pin | LeaveQuorum

# -- timings (protocol margins, not operator policy: those are in RecoveryConfig) --------------------

REQUEST_LATENCY_S = RecoveryConfig().checkpoint_lead_s  # the default lead of the agreed checkpoint step
RENDEZVOUS_RETRY_S = 1.0  # how often a job waiting for nodes looks again
RESTOP_S = 2.0  # a node still running the generation this long after taking a stop is told again
FINISH_MIN_S = 0.5  # at least this long between a predictable fault's group leaving the quorum and its stop
PREPARE_RENEW_S = 30.0  # a running job's spares are asked again this often to hold standbys (agent warm pools)


def pace(tracks: Mapping[int, progress.RankTrack]) -> tuple[int, float]:
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


def checkpoint_step(tracks: Mapping[int, progress.RankTrack], lead_s: float = REQUEST_LATENCY_S,
                    now: float | None = None) -> int:
    """The step after which every rank should save: far enough ahead that the request reaches every
    rank before it gets there, so all ranks save the same step. 0 (at once) without progress reports.

    The newest report is up to a report interval and a heartbeat old, so with `now` the step the ranks
    are at now is reckoned from when their last reported step ended (by the rank's clock) at their pace:
    the lead then covers only the request's way down (pushed: milliseconds), not the reports' way up."""
    if not tracks:
        return 0
    latest, step_s = pace(tracks)
    step_s = max(step_s, 1e-3)
    if now is not None:
        latest = max([latest, *(t.last_step + math.floor(max(0.0, now - t.last_step_at) / step_s)
                                for t in tracks.values() if t.last_step >= 0 and t.last_step_at > 0)])
    return max(latest, 0) + math.ceil(lead_s / step_s) + 2


def straggler_hold(job: pb.Job, view: JobView, now: float, cfg: RecoveryConfig) -> str:
    """Why a straggler verdict must not be acted on now ("" if it may): evictions must not cascade. A false
    verdict drains a healthy node, and in a loop it could drain a fleet. Nor may one stop a job that would then
    wait for nodes: a slow job trains, a job short of nodes does not."""
    tracks = view.tracks
    window = [t for t in job.straggler_evictions_unix_ns if now - t / 1e9 < cfg.straggler_evictions_window_s]
    if len(window) >= cfg.straggler_max_evictions:
        return (f"{len(window)} straggler evictions in the last {cfg.straggler_evictions_window_s:g}s already "
                f"(recovery.straggler_max_evictions = {cfg.straggler_max_evictions})")
    # Did the last eviction pay off? The fastest this generation has gone against the job's step time when
    # it evicted: a new straggler slows the job again, but only lately.
    before = job.straggler_step_s
    best = min((t.fastest_s for t in tracks.values() if t.fastest_s), default=0.0)
    if before and best and best > before * (1 - cfg.straggler_gain):
        return (f"the last straggler eviction did not make the job faster ({before:.3f}s a step before it, at best "
                f"{best:.3f}s since; recovery.straggler_gain = {cfg.straggler_gain:g}): the verdict may be noise")
    # No spare left: the fleet (which the executor's view carries while the job is short of spares, and for a job
    # without any when a straggler verdict would evict) says whether a free node could replace the straggler's.
    # With none, the eviction would stop the job until one is free. (A node of an incident before, repaired and
    # undrained since, counts: next_nodes takes it when it must.)
    if not job.spares and view.fleet and not _free(job, view, {*job.nodes, *job.spares}):
        why = "it was submitted with none" if not job.spec.spares else "the job's spares are used up"
        return f"no spare and no free node to replace it ({why}): the job goes on at its pace until one is free"
    return ""


def pace_known(tracks: Mapping[int, progress.RankTrack], reported: bool) -> bool:
    """A report past some rank's start-up, or nothing to wait for: a job whose trainlib has never reported (none,
    or the simulator's ranks) is asked to save at once. One that has reported, in an earlier generation, will in
    this one: before its first report a request could only say "at once", which ranks that hear it a step apart
    take at different steps, each then waiting in its save for the others (a deadlock)."""
    return any(t.recent_pace() for t in tracks.values()) or (not tracks and not reported)


def pace_wait(cfg: RecoveryConfig, reported: bool, deadline_s: float) -> float:
    """How long a checkpoint request waits for pace_known: pace_wait_s; for a job whose trainlib has reported before
    (a new generation's ranks still starting), up to half the request's deadline, the other half being the save's."""
    return max(cfg.pace_wait_s, deadline_s / 2) if reported else cfg.pace_wait_s


# -- building records ------------------------------------------------------------------------------


def moved(job: pb.Job, state: int, reason: str, now: float, **changes: object) -> pb.Job:
    """A copy of `job` in `state` (checked against the table), its time in the old state added up."""
    check(job.id, job.state, state)
    now_ns = int(now * 1e9)
    new = copied(job, state=state, reason=reason, state_since_unix_ns=now_ns, **changes)
    if job.state_since_unix_ns:
        phase = state_name(job.state)
        spent = max(0.0, (now_ns - job.state_since_unix_ns) / 1e9)
        existing = next((p for p in new.phase_times if p.phase == phase), None)
        if existing is None:
            new.phase_times.add(phase=phase, seconds=spent)
        else:
            existing.seconds += spent
    return new


def copied(job: pb.Job, **changes: object) -> pb.Job:
    new = pb.Job()
    new.CopyFrom(job)
    for key, value in changes.items():
        if isinstance(value, pb.JobCheckpoint | pb.HangCulprit):
            getattr(new, key).CopyFrom(value)
        else:
            setattr(new, key, value)
    return new


def _replace(repeated, values) -> None:
    del repeated[:]
    repeated.extend(values)


def rank_table(job: pb.Job, state: int = pb.RANK_STATE_UNSPECIFIED) -> None:
    """The job's rank table anew for its nodes and generation: rank i * ranks_per_node + local on node i, in rank
    order, each in `state` (a new generation's: not started); packed from ranktable.PACKED_FROM ranks. Read it
    through ranktable.rows (phalanx/ranks.py)."""
    ranktable.build(job, state)


def with_nodes(job: pb.Job, nodes: Sequence[str], spares: Sequence[str]) -> pb.Job:
    """A new generation of the whole job on `nodes`: its rank table, and (replica groups) every group training."""
    _replace(job.nodes, nodes)
    _replace(job.spares, spares)
    rank_table(job)
    job.ClearField("groups")
    if job.spec.replicas > 1:
        job.groups.extend(pb.ReplicaGroup(index=g, state=GROUP_TRAINING, generation=job.generation,
                                          since_unix_ns=job.state_since_unix_ns) for g in range(job.spec.replicas))
    return job


def finished(job: pb.Job, state: int, reason: str, exit_code: int, now: float) -> Commit:
    new = moved(job, state, reason, now, exit_code=exit_code, finished_unix_ns=int(now * 1e9))
    return Commit(new, f"job.{state_name(state).lower()}", f"{job.id} {state_name(state)}: {reason}")


def all_exited_zero(job: pb.Job, ranks: Sequence[pb.RankInfo] | None = None) -> bool:
    ranks = ranktable.rows(job) if ranks is None else ranks
    states = ranktable.states(ranks)  # (a packed table's: one look in C, nearly always at a rank not EXITED)
    if states is not None and states.count(RANK_EXITED) != len(states):
        return False
    if isinstance(ranks, ranktable.Rows):
        return bool(ranks) and not any(ranks.exit_codes or ())
    return bool(ranks) and all(r.state == RANK_EXITED and r.exit_code == 0 for r in ranks)


def stops(job: pb.Job, nodes: Iterable[str], generation: int | None = None) -> list[Action]:
    """The Stop actions for `nodes` of `job`: of `generation`, or each node's own (node_generations), one action per
    generation; none for no nodes."""
    if generation is None and job.groups:
        generations, by = node_generations(job), {}
        for node in nodes:
            by.setdefault(generations.get(node, job.generation), []).append(node)
        return [Stop(tuple(names), job.id, g) for g, names in by.items()]
    names = tuple(nodes)
    return [Stop(names, job.id, job.generation if generation is None else generation)] if names else []


def _stop_out(job: pb.Job) -> list[Action]:
    """A replica-group job's groups out of the quorum, stopped as the job ends (the others' ranks have exited)."""
    return stops(job, sorted(out_of_quorum(job)))


def nodes_of(job: pb.Job, view: JobView) -> Sequence[str]:
    """The job's nodes in rank order: the driver's list for the generation where it keeps one, else the record's."""
    return view.node_list if view.node_list is not None else job.nodes


def named(nodes: Sequence[str], most: int = 32) -> str:
    """Nodes for a reason or an event: each name, or for a job of more than `most` nodes, how many and the first and
    last few (a 16,384-node job's full list is ~200 KB in every record and event of a recovery)."""
    if len(nodes) <= most:
        return ", ".join(nodes)
    return f"{len(nodes):,} nodes ({', '.join(nodes[:3])}, ..., {nodes[-1]})"


def stop_untold(job: pb.Job, view: JobView) -> list[Action]:
    """Stop the job's generation on each of its nodes whose agent has not been told on its current session (each
    node's own: a replica group rebuilt since the others started runs a newer one than theirs)."""
    get, told, nodes = view.nodes.get, view.told, nodes_of(job, view)
    if told and (told >= view.members if view.members is not None else
                 all(map(told.__contains__, nodes))):  # (in C: once the stop is out, at each step after)
        return []
    if view.unreachable is not None:  # (in C: the first stop of a recovery tells every node of a job of 16,384)
        return stops(job, list(itertools.filterfalse(told.union(view.unreachable).__contains__, nodes)))
    return stops(job, [node for node in nodes
                       if node not in told and (v := get(node)) is not None and not v.down and v.connected])


# -- the decision ----------------------------------------------------------------------------------


def step(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    """What to do next for `job`, given what is seen of it and the wall-clock time `now`."""
    decide = _BY_STATE.get(job.state)
    if decide is None:
        return []  # a final state: nothing to do
    return decide(ranks_lost(ranks_ended(job, view.ended), view.missing, policy.jobs.missing_reports_lost), view, now,
                  policy)


def ranks_ended(job: pb.Job, ended: Mapping[int, tuple[int, int]]) -> pb.Job:
    """`job` with the rank states its nodes reported (a rank that exited, and its code): the job itself when the
    record says them all already. What follows is decided on this job, and the commit that follows stores it; a
    state the rank table does not allow from the record's (a report of an older look) is not taken."""
    moves = _rank_moves(job, ended)
    if not moves:
        return job
    new = copied(job)
    ranktable.set_states(new, moves)
    return new


def ended_unsaved(job: pb.Job, ended: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Of `ended`, what the record `job` does not say yet (after a commit: what the next step must take in)."""
    moves = _rank_moves(job, ended)
    ranks = ranktable.rows(job)
    return {ranks[i].rank: s for i, s in moves.items()}


def _rank_moves(job: pb.Job, ended: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Index in the rank table -> (state, code), for each reported state the record does not say and may move to."""
    if not ended:
        return {}
    ranks = ranktable.rows(job)
    if isinstance(ranks, ranktable.Rows):  # rank r at r, its state a byte: no row made (every rank may end at once)
        table = ranks.states
        return {r: ended[r] for r in ended if 0 <= r < len(table) and table[r] != ended[r][0] and
                rank_may_move(table[r], ended[r][0])}
    at = {r: r for r in ended if 0 <= r < len(ranks) and ranks[r].rank == r}  # rank order: rank r at r
    if len(at) < len(ended):
        at = {r.rank: i for i, r in enumerate(ranks) if r.rank in ended}
    states = {i: ranks[i].state for i in at.values()}
    return {i: ended[r] for r, i in at.items()
            if states[i] != ended[r][0] and rank_may_move(states[i], ended[r][0])}


def ranks_lost(job: pb.Job, missing: Mapping[int, int], limit: int) -> pb.Job:
    """`job` with the ranks whose node has sent `limit` heartbeats in a row without news of them LOST (the node
    runs, the rank is gone without an exit anyone saw): the job itself when there are none. What follows from a
    lost rank (a crash incident) is decided on this job, and the commit that follows stores it."""
    lost = {rank for rank, count in missing.items() if count >= limit}
    if not lost:
        return job
    ranks = ranktable.rows(job)
    at = {r: r for r in lost if 0 <= r < len(ranks) and ranks[r].rank == r}  # rank order: rank r at r
    if len(at) < len(lost):
        at = {r.rank: i for i, r in enumerate(ranks) if r.rank in lost}
    moves = {}
    for i in sorted(at.values()):
        row = ranks[i]
        if row.state in (RANK_UNKNOWN, RANK_RUNNING):
            check_rank(job.id, row.rank, row.state, RANK_LOST)
            moves[i] = (RANK_LOST, row.exit_code)
    if not moves:
        return job
    new = copied(job)
    ranktable.set_states(new, moves)
    return new


def ask_checkpoint(job: pb.Job, tracks: Mapping[int, progress.RankTrack], now: float, lead_s: float,
                   deadline_s: float, pause: bool, reason: str) -> list[Action]:
    """A checkpoint request to every rank of the running generation (before an eviction, with `pause`; or the
    user's `phalanx checkpoint`): the step `lead_s` ahead at the ranks' pace, committed with the job (its id is
    the stored counter plus one, so a restarted controller never reuses an id trainlib has handled), then sent."""
    at_step = checkpoint_step(tracks, lead_s, now)
    latest, step_s = pace(tracks)
    ask = pb.JobCheckpoint(id=job.checkpoint.id + 1, at_step=at_step, deadline_unix_ns=int((now + deadline_s) * 1e9),
                           pause=pause, reason=reason, generation=job.generation, asked_unix_ns=int(now * 1e9))
    ranks, nodes = quorum(job)  # (replica groups: a group out of the quorum has no state of the job to save)
    return [Commit(copied(job, checkpoint=ask), "job.checkpoint",
                   f"{job.id}: checkpoint {ask.id} requested from {len(ranks)} ranks after step {at_step} "
                   f"(deadline {deadline_s:g}s; last reported step {latest}, {step_s:.3f}s a step): {reason}"),
            RequestCheckpoint(job.id, job.generation, tuple(nodes), ask)]


def needs_fleet(job: pb.Job, policy: Policy) -> bool:
    """Whether a step of `job` must see every node as placement does (JobView.fleet: candidates and topology):
    placing it, choosing its next generation's nodes, or holding spares again. Other steps see only the job's
    own nodes; a scan of 10,000 nodes on every step of every job would cost more than the steps."""
    return job.state in (PENDING, RENDEZVOUS) or (job.state == RUNNING and len(job.spares) < job.spec.spares
                                                  and policy.jobs.keep_spares) or (
        job.state == RUNNING and any(g.state == GROUP_WAITING for g in job.groups))


def plan(job: pb.Job, view_of: Callable[[bool], JobView], now: float, policy: Policy) -> list[Action]:
    """The step every driver takes (the controller's executor, the simulator, the tests): `step` with the view
    `view_of(fleet)` builds, the fleet only where `needs_fleet` says, and once more with the fleet where a job
    with no spare would evict a straggler: only the fleet says whether a free node could replace it, and with
    none the straggler is held (`_running`), not evicted into a job that cannot restart."""
    view = view_of(needs_fleet(job, policy))
    actions = step(job, view, now, policy)
    if not view.fleet and not job.spares and any(isinstance(a, Commit) and a.incident == "straggler"
                                                 for a in actions):
        actions = step(job, view_of(True), now, policy)
    return actions


def allocation_short(job: pb.Job, view: JobView, what: str) -> str:
    """Why a job bound to a Slurm allocation (spec.within) can never get enough nodes there, or '' while it may: a
    node that is only disconnected or busy for now may come back, one DOWN, drained or FAILING will not by itself
    (and the allocation's time limit runs: such a job ends rather than waits)."""
    if not job.spec.within:
        return ""
    usable = {c.name for c in view.candidates.values() if not c.lost}
    if len(usable) >= job.spec.nodes:
        return ""
    out = [n for n in job.spec.within if n not in usable]
    return (f"{slurm.EXHAUSTED} {what} in Slurm job {job.spec.slurm_job_id or '?'}'s allocation: {len(usable)} of its "
            f"{len(job.spec.within)} nodes usable, {job.spec.nodes} needed ({hostlist.compress(out)} down, drained, "
            "failing or without a Phalanx agent); requeue the Slurm job for a new allocation")


def placed(job: pb.Job, candidates: Sequence[Candidate], topology: ClusterTopology | None,
           spares: int) -> Placement | Unplaceable:
    """Where the whole job goes (its nodes, and `spares` spares). A replica-group job's groups each lie inside
    one leaf switch (block), the tightest part of the fabric, where a group fits in one, and they are spread over
    as many leaves as can take one: at most one group a leaf if enough leaves have room, else at most two, and
    so on (a leaf switch lost then takes the fewest groups with it). Groups that fit no single leaf, or a job
    with a segment of its own, are placed as any job: its ranks in order, so each group is as tight as it can
    be."""
    spec = job.spec
    request = GangRequest(nodes=spec.nodes, ranks_per_node=spec.ranks_per_node, spares=spares,
                          segment=spec.segment or None)
    if spec.replicas <= 1 or spec.segment:
        return place(candidates, request, topology)

    def spread(per_leaf: int) -> Placement | Unplaceable:
        return place(candidates, replace(request, segment=spec.nodes // spec.replicas, per_leaf=per_leaf), topology)

    best = spread(1)
    if not isinstance(best, Unplaceable):
        return best
    best = spread(spec.replicas)  # groups each in one leaf, however many a leaf
    if isinstance(best, Unplaceable):
        return place(candidates, request, topology)
    low, high = 1, spec.replicas  # the fewest groups a leaf that places (placeable is monotone in it)
    while high - low > 1:
        mid = (low + high) // 2
        decision = spread(mid)
        if isinstance(decision, Unplaceable):
            low = mid
        else:
            high, best = mid, decision
    return best


def _pending(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    decision = placed(job, list(view.candidates.values()), view.topology, job.spec.spares)
    if isinstance(decision, Unplaceable) and (why := allocation_short(job, view, "to run on")):
        return [finished(job, FAILED, why, 1, now)]
    if isinstance(decision, Unplaceable):
        if job.reason == decision.reason:
            return []
        return [Commit(copied(job, reason=decision.reason), "job.pending", f"{job.id} waits: {decision.reason}")]
    generation = job.generation + 1
    new = moved(job, STARTING, f"placed on {named(decision.nodes)}", now, generation=generation,
                started_unix_ns=int(now * 1e9), launched_generation=generation)
    with_nodes(new, decision.nodes, decision.spares)
    spares = f"; spares {named(decision.spares)}" if decision.spares else ""
    return [Commit(new, "job.placed", f"{new.id} generation {generation} placed on {named(decision.nodes)}"
                   f"{spares} ({len(decision.leaves)} leaf switches, lower bound {decision.lower_bound})"),
            Launch(job.id, generation)]


def _launching(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    launch = view.launch
    if job.launched_generation < job.generation:  # committed by an older version that launched after the commit
        return [Commit(copied(job, launched_generation=job.generation), "job.launching",
                       f"{job.id} generation {job.generation}: launching"), Launch(job.id, job.generation)]
    if launch is None or launch.generation != job.generation:
        # The record says this generation's launch was sent, and this process never saw it: a controller
        # restart lost its outcome. It is evicted and made again as the next generation, so no generation
        # number is ever launched twice.
        return _incident(job, Incident("crash", False, (), f"the launch of generation {job.generation} was "
                                       "interrupted by a controller restart"), now, policy)
    if not launch.done:
        return []
    if launch.ok:
        new = moved(job, RUNNING, f"running on {named(nodes_of(job, view))}", now, master_addr=launch.address,
                    master_port=launch.port)
        n = ranktable.count(new)
        ranktable.set_span(new, 0, n, RANK_RUNNING)
        return [Commit(new, "job.running", f"{job.id} generation {job.generation} running: {n} ranks, "
                       f"MASTER_ADDR={launch.address} MASTER_PORT={launch.port}")]
    reason = f"launch failed: {launch.error}"
    if job.state == STARTING:
        return [finished(job, FAILED, reason, 1, now), *_stop_all(job)]
    return _incident(job, Incident("crash", False, (), reason), now, policy)


def _stop_all(job: pb.Job) -> list[Action]:
    """Best effort when a job ends: every node of it is told; an unreachable one is fenced when it returns."""
    return stops(job, job.nodes)


def _running(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    ranks, names = quorum(job, nodes_of(job, view))  # the job's, or (replica groups) those of the groups in the quorum
    if all_exited_zero(job, ranks):
        return [finished(job, SUCCEEDED, "every rank exited 0", 0, now), *_stop_out(job)]
    odd = unsettled(ranks)  # the few ranks not RUNNING: what follows reads their states, not every rank's
    over = training_over(odd, view.tracks)
    if len(over) == len(ranks):  # what befalls a node now costs no training: nothing to recover
        return _ending(job, now, policy, over, ranks)
    tracks, nccl = view.tracks, view.nccl
    if isinstance(ranks, _Spans) and (tracks or nccl):  # a group out of the quorum is judged no more (by its ranks'
        tracks = {r: view.tracks[r] for r in sorted(view.tracks) if ranks.holds_rank(r)}  # numbers: no row made)
        nccl = {r: view.nccl[r] for r in sorted(view.nccl) if ranks.holds_rank(r)}
    since = max((g.since_unix_ns for g in job.groups), default=0) / 1e9 if grouped(job) else 0.0
    incident = detect(ranks, view.nodes, tracks, now, policy.recovery, nccl, view.fatal, over, since, odd, names,
                      view.unwell)
    if incident is None and over:
        return _ending(job, now, policy, over, ranks)
    if incident is None and job.ending_since_unix_ns and any(
            t.last_advance > job.ending_since_unix_ns / 1e9 for t in view.tracks.values()):
        return [Commit(copied(job, ending_since_unix_ns=0), "job.training", f"{job.id} generation {job.generation}: "
                       "training goes on (a step after the ranks said it had ended)")]
    # a group out of the quorum goes on (stops, launch, join), but launches and joins none once training has ended
    moves = group_moves(job, view, now, policy) if grouped(job) and not over and not job.ending_since_unix_ns else []
    if incident is None and any(isinstance(a, Commit) for a in moves):
        return moves
    if incident is None:
        more = replenish(job, view) if policy.jobs.keep_spares else []
        if not more:
            return [*moves, *upkeep(job, view, now)]
        new = copied(job)
        new.spares.extend(more)
        return [Commit(new, "job.spares", f"{job.id}: {', '.join(more)} now held as spare{'s' * (len(more) > 1)} "
                       f"({len(new.spares)} of {job.spec.spares}), in place of those used by restarts")]
    if incident.kind == "straggler":
        held = straggler_hold(job, view, now, policy.recovery)
        if held:
            if job.straggler_held == held.split(" (")[0]:
                return [*moves, *upkeep(job, view, now)]  # said once; the job trains on at its pace
            return [Commit(copied(job, straggler_held=held.split(" (")[0]), "job.straggler_held",
                           f"{job.id}: straggler verdict held back: {incident.reason}: {held}")]
    if grouped(job) and not incident.fatal:
        hit = groups_hit(job, incident, nodes_of(job, view))
        if hit and holders(job, view) - hit:  # some group that holds the job's state trains on
            return group_leaves(job, incident, hit, view, now, policy)
    return _incident(job, incident, now, policy, view)


def _ending(job: pb.Job, now: float, policy: Policy, over: set[int],
            ranks: Sequence[pb.RankInfo] | None = None) -> list[Action]:
    """The job's training has ended in the ranks `over` (they said so, or exited 0): no hang or straggler verdict
    now, and every rank has recovery.exit_grace_s from the first such rank to exit. A rank still running then is
    stopped; the job has SUCCEEDED if every rank finished training (a slow or failed teardown is said in an event,
    not blamed on a node), else FAILED with the ranks that never finished. `ranks`: those that count (replica
    groups: the groups in the quorum; a group out of it when training ends is stopped with the job)."""
    ranks = ranktable.rows(job) if ranks is None else ranks
    grace = policy.recovery.exit_grace_s
    if not job.ending_since_unix_ns:
        return [Commit(copied(job, ending_since_unix_ns=int(now * 1e9)), "job.ending",
                       f"{job.id} generation {job.generation}: training has ended in {ranks_named(over)}; no hang or "
                       f"straggler verdict from now on, and every rank has {grace:g}s (recovery.exit_grace_s) to exit"),
                WakeAt(now + grace)]
    if isinstance(ranks, ranktable.Rows | _Spans):
        ranks = list(ranks)  # (a packed table's rows made once, for the passes below)
    stop_out = _stop_out(job)
    failed = [r for r in ranks if r.state == RANK_EXITED and r.exit_code > 0]
    if failed:  # the script itself said it failed after its training (a final save that raised): no restart redoes
        r = failed[0]  # what went wrong there, and the training is done
        return [finished(job, FAILED, f"rank {r.rank} on {r.node} exited with code {r.exit_code} after its training "
                         "ended", r.exit_code if r.exit_code < 256 else 1, now), *_stop_all(job)]
    since = job.ending_since_unix_ns / 1e9
    left = [r.rank for r in ranks if r.state != RANK_EXITED]
    unfinished = sorted({r.rank for r in ranks} - over)
    torn = [r for r in ranks if r.state == RANK_EXITED and r.exit_code != 0]
    if not left and not unfinished:  # every rank exited, some killed by a signal in their teardown
        said = "; ".join(f"rank {r.rank} on {r.node} exited with code {r.exit_code}" for r in torn[:8])
        return [Event("job.teardown_failed", f"{job.id}: training ended in every rank, but {said} in its teardown "
                      "(after its training ended: the job's result stands)"),
                finished(job, SUCCEEDED, f"every rank finished training ({len(torn)} killed by a signal in its "
                         "teardown)", 0, now), *stop_out]
    if now < since + grace:
        return [WakeAt(since + grace)]
    if not unfinished:
        return [Event("job.slow_exit", f"{job.id}: training ended in every rank, but {ranks_named(left)} had not "
                      f"exited {grace:g}s after it ended (recovery.exit_grace_s): stopped; no node is blamed"),
                finished(job, SUCCEEDED, f"every rank finished training; {ranks_named(left)} did not exit within "
                         f"{grace:g}s and {'were' if len(left) > 1 else 'was'} stopped", 0, now), *_stop_all(job)]
    return [finished(job, FAILED, f"{ranks_named(unfinished)} had not finished training {grace:g}s after "
                     f"{ranks_named(over)} had (recovery.exit_grace_s): stopped", 1, now), *_stop_all(job)]


def ranks_named(ranks: Sequence[int] | set[int]) -> str:
    """`rank 3`, `ranks 0, 1, 2`, `ranks 0, 1, 2, 3, 4, 5, 6, 7 and 56 more`."""
    ranks = sorted(ranks)
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' * (len(ranks) > 1)} {shown}"


def replenish(job: pb.Job, view: JobView) -> list[str]:
    """Free nodes to hold as spares in place of those restarts used up (a long job would otherwise run out of
    them, and every later fault would wait for a fresh placement): healthy ones on the job's own leaf switches
    first, then any. `view.candidates` is empty unless the job is short of spares (the executor's rule)."""
    short = job.spec.spares - len(job.spares)
    if short <= 0 or not view.candidates:
        return []
    if view.idle is not None:  # the few no job holds, where the driver keeps them: no pass over the job's nodes
        per, candidates, bad = job.spec.ranks_per_node, view.candidates, set(job.incident_nodes)
        free = {n for n in view.idle if n not in view.nodes and n not in bad and _fits(candidates[n], per)}
    else:
        free = _free(job, view, set(job.nodes).union(job.spares, job.incident_nodes))
    if not free:
        return []
    current = set(job.nodes) if view.members is None else view.members
    topology = view.topology
    leaf_of = topology.node_leaf if topology is not None else {}
    home: dict[str | None, bool] = {}  # leaf switch -> whether a node of the job is on it (None: no leaf switch)

    def on_home(n: str) -> bool:  # looked up for the few free nodes' leaves, not for each of the job's nodes
        leaf = leaf_of.get(n)
        if leaf not in home:
            home[leaf] = any(m not in leaf_of for m in current) if leaf is None else \
                not current.isdisjoint(topology.nodes_under(leaf))
        return home[leaf]

    return sorted(free, key=lambda n: (not on_home(n), n))[:short]


def free_nodes(job: pb.Job, view: JobView, taken: set[str]) -> list[str]:
    """The candidates that could join the job, but those `taken`: schedulable, healthy, free, big enough; in the
    candidates' order."""
    free = _free(job, view, taken)
    return [n for n in view.candidates if n in free] if free else []


def _free(job: pb.Job, view: JobView, taken: set[str]) -> set[str]:
    """free_nodes, as a set."""
    per, candidates = job.spec.ranks_per_node, view.candidates
    # (in C: at 16,384 nodes, nearly every candidate is the job's own; where the driver keeps the nodes no job holds,
    # the few of those: a candidate free to this job is one of them or the job's own, which `taken` holds)
    rest = view.idle - taken if view.idle is not None and view.fleet else candidates.keys() - taken
    return {n for n in rest if _fits(candidates[n], per)}


def _fits(c: Candidate, ranks_per_node: int) -> bool:
    """Whether a free node could join the job: schedulable, healthy, free, big enough."""
    return c.schedulable and c.healthy and c.free and c.gpus >= ranks_per_node


def _incident(job: pb.Job, incident: Incident, now: float, policy: Policy, view: JobView | None = None) -> list[Action]:
    """Begin a recovery: checkpoint first when the failure is predictable, else evict at once; give up
    after max_restarts in a row, or at once when a rank said no restart mends it. A job that has run for
    restart_window_s since it last (re)started begins a new row: its restarts count from zero again."""
    calm_s = now - job.state_since_unix_ns / 1e9
    if job.restarts_in_row and job.state == RUNNING and calm_s >= policy.recovery.restart_window_s:
        job = copied(job, restarts_in_row=0)
    at_step = max((t.last_step for t in view.tracks.values()), default=-1) if view is not None else -1
    if not incident.fatal and (again := repeated(job, incident, at_step)):
        incident = Incident(incident.kind, False, (), again, incident.exit_code, incident.culprit, fatal=True)
    if incident.fatal or job.restarts_in_row >= policy.recovery.max_restarts:
        return _give_up(job, incident, now)
    target = CHECKPOINTING if incident.predictable else EVICTING
    new = moved(job, target, incident.reason, now, incident=incident.reason, incident_predictable=incident.predictable,
                incident_kind=incident.kind, incident_step=at_step)
    if incident.kind == "straggler" and view is not None:
        new.straggler_evictions_unix_ns.append(int(now * 1e9))
        new.straggler_step_s = progress.job_step_s(view.tracks)
        new.straggler_held = ""
    _replace(new.incident_nodes, incident.nodes)
    new.ClearField("culprit")
    if incident.culprit is not None:
        new.culprit.CopyFrom(incident.culprit)
    what = "predictable: checkpoint first" if incident.predictable else \
        "sudden: resume from the last committed checkpoint (a job of replica groups keeps no in-memory snapshots)" \
        if grouped(job) else \
        "sudden: resume from the newest in-memory snapshot every rank has, else the last committed checkpoint"
    return [Commit(new, "job.incident", f"{job.id} generation {job.generation}: {incident.kind}: {incident.reason} "
                   f"({what})", incident=incident.kind)]


def _give_up(job: pb.Job, incident: Incident, now: float) -> list[Action]:
    """The job ends FAILED: no restart mends the incident, or max_restarts restarts in a row did not."""
    why = incident.reason if incident.fatal else f"gave up after {job.restarts_in_row} restarts: {incident.reason}"
    new = finished(job, FAILED, why, incident.exit_code, now)
    new.job.incident, new.job.incident_kind = incident.reason, incident.kind
    return [Commit(new.job, new.kind, new.message, incident=incident.kind), *_stop_all(job)]


REPEATABLE = ("crash", "hang", "straggler")  # verdicts on the job's behaviour (not a node's health) that can repeat


def repeated(job: pb.Job, incident: Incident, at_step: int) -> str:
    """Why `incident` ends the job instead of another recovery ("" if it does not): the same kind of verdict on the
    job's own behaviour at the same step as the one that ended the previous generation. A script or its data that
    hangs (or crashes, or slows) at one step does so on any node: evicting node after node for it would drain the
    fleet. `at_step` is the newest step any rank reported (-1, or 0 in an older record: unknown, no verdict)."""
    if incident.kind not in REPEATABLE or at_step <= 0 or job.generation < 2 or job.incident_kind != incident.kind \
            or job.incident_step != at_step:
        return ""
    return (f"{incident.kind} again at step {at_step}, as in generation {job.generation - 1}: a fault of the job "
            f"itself (its script or data), not of a node, so no node is evicted for it: {incident.reason}")


def _checkpointing(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    ranks = quorum(job)[0]  # (replica groups: a group out of the quorum neither saves nor ends training)
    if all_exited_zero(job, ranks):  # it finished before the agreed step: nothing left to save or evict
        return [finished(job, SUCCEEDED, "every rank exited 0 (before the eviction checkpoint)", 0, now),
                *_stop_out(job)]
    over = training_over(unsettled(ranks), view.tracks)
    if len(over) == len(ranks):  # it finished training before the agreed step: no rank will ever save it
        return _ending(job, now, policy, over, ranks)
    request = job.checkpoint
    asked_here = bool(request.id) and request.pause and request.generation == job.generation and \
        request.asked_unix_ns >= job.state_since_unix_ns
    if not asked_here:
        wait_until = job.state_since_unix_ns / 1e9 + pace_wait(policy.recovery, view.reported,
                                                               policy.recovery.checkpoint_deadline_s)
        if not pace_known(view.tracks, view.reported) and now < wait_until:
            return [WakeAt(wait_until)]
        return ask_checkpoint(job, view.tracks, now, policy.recovery.checkpoint_lead_s,
                              policy.recovery.checkpoint_deadline_s, pause=True, reason=job.incident)
    seen = view.checkpoint
    if seen is None or seen.request_id != request.id:
        note = (f"checkpoint {request.id} abandoned: the controller restarted while it was in flight; resuming "
                "from the newest complete checkpoint")
        return [Commit(moved(job, EVICTING, note, now), "job.evicting", f"{job.id}: {note}; evicting "
                       f"{', '.join(job.incident_nodes) or 'nothing (restart in place)'}")]
    asked_at = request.asked_unix_ns / 1e9
    asked = len(quorum(job)[0])
    if len(seen.acks) >= asked:
        step_done = min(seen.acks.values())
        note = f"every rank committed step {step_done} in {max(0.0, now - asked_at):.2f}s"
        how = "in host memory, each with a replica on another node" if seen.in_memory == len(seen.acks) else \
            f"{seen.in_memory} of {len(seen.acks)} in host memory, the others durably" if seen.in_memory else "durably"
        return [Event("job.checkpointed", f"{job.id}: every rank committed step {step_done} {how} "
                      f"({max(0.0, now - asked_at):.2f}s after the request)"),
                Commit(moved(job, EVICTING, note, now), "job.evicting",
                       f"{job.id}: {note}; evicting {', '.join(job.incident_nodes) or 'nothing (restart in place)'}")]
    deadline = request.deadline_unix_ns / 1e9
    if now >= deadline:
        note = (f"checkpoint incomplete (only {len(seen.acks)} of {asked} ranks committed checkpoint "
                f"{request.id} within {policy.recovery.checkpoint_deadline_s:g}s); resuming from the last committed "
                "one")
        return [Commit(moved(job, EVICTING, note, now), "job.evicting",
                       f"{job.id}: {note}; evicting {', '.join(job.incident_nodes) or 'nothing (restart in place)'}")]
    return [WakeAt(deadline)]


def _evicting(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    """Stop the generation's ranks, drain the bad nodes, and go on once each of the job's nodes has said,
    in a heartbeat after the stop, that none of the generation's ranks runs there any more. A node that
    is DOWN is not waited for (its ranks are fenced if it returns); one whose agent is not connected
    (after a controller restart, agents come back one by one) is told as soon as it is."""
    out: list[Action] = [Drain(n, f"evicted from {job.id}: {job.incident}") for n in job.incident_nodes
                         if n in view.nodes and not view.nodes[n].drained]
    out += stop_untold(job, view)
    get, stopped = view.nodes.get, view.stopped
    unconfirmed = (n for n in nodes_of(job, view) if n not in stopped and (v := get(n)) is not None and not v.down)
    window = policy.jobs.stop_grace_s + policy.recovery.evict_margin_s
    deadline = job.state_since_unix_ns / 1e9 + window
    everywhere = view.members is not None and stopped >= view.members  # (in C)
    first = None if everywhere else next(unconfirmed, None)
    if first is not None and now < deadline:  # one node to wait for is enough to know (a job of 16,384 nodes)
        return [*out, WakeAt(min(now + RESTOP_S, deadline))]
    waiting = [first, *unconfirmed] if first is not None else []
    # A node that is connected and still shows the generation running (a launch the previous controller sent
    # may land after the stop) holds the next generation back a while longer: it must never start beside it.
    running = [n for n in waiting if n in view.running and view.nodes[n].connected]
    if waiting and (now < deadline or (running and now < deadline + 2 * window)):
        return [*out, WakeAt(min(now + RESTOP_S, deadline if now < deadline else deadline + 2 * window))]
    if waiting:
        out.append(Event("job.unconfirmed", f"{job.id}: generation {job.generation} not known to be stopped on "
                         f"{', '.join(waiting)}; its ranks will be fenced when their agents report them"))
    return [*out, Commit(moved(job, RENDEZVOUS, "choosing the next generation's nodes", now), "job.rendezvous",
                         f"{job.id}: generation {job.generation} stopped; choosing nodes for the next")]


def next_nodes(job: pb.Job, view: JobView) -> tuple[list[str], list[str], str] | str:
    """The next generation's nodes: the good ones kept in rank order, bad ones replaced by the job's
    spares; failing that, a fresh placement. Returns (nodes, spares, how), or why it must wait.

    The nodes of the incident are left out while anything else will do. Each was drained on the way here,
    so one that is schedulable again was undrained since (repaired): when the job can go on only with it,
    it is taken rather than waited past for ever (`phalanx simulate --replay` found that wait)."""
    candidates = view.candidates
    bad = set(job.incident_nodes)
    chosen = _next_nodes(job, view, candidates, bad)
    back = {n for n in bad if n in candidates and candidates[n].schedulable}
    if isinstance(chosen, str) and back:
        again = _next_nodes(job, view, candidates, bad - back)
        if not isinstance(again, str):
            return again
    return chosen


def _next_nodes(job: pb.Job, view: JobView, candidates: Mapping[str, Candidate],
                bad: set[str]) -> tuple[list[str], list[str], str] | str:
    # Sets, not the record's lists (a 2,048-node job made this quadratic), and passes in C over the job's nodes for the
    # few that will not do, not the many that will (a 16,384-node job is decided here at each of its recoveries).
    unusable = bad | (unfit(candidates, job.spec.ranks_per_node) if view.unfit is None else view.unfit)
    nodes = list(nodes_of(job, view))
    current = set(nodes) if view.members is None else view.members
    gone = current.difference(candidates)  # the job's nodes that will not do: the few not kept
    gone |= current & unusable
    spares = [n for n in job.spares if n in candidates and n not in unusable and (n not in current or n in gone)]
    missing = len(nodes) - (len(current) - len(gone))
    if missing <= len(spares):
        # each place of a node that will not do, in rank order, by the next spare (as many places as `missing`, or
        # fewer where the record names a node twice)
        places = _places(nodes, gone) if missing else []
        taken = spares[:len(places)]
        for i, spare in zip(places, taken, strict=True):
            nodes[i] = spare
        used = set(taken)
        how = "same nodes" if not taken else f"spare{'s' if len(taken) > 1 else ''} {', '.join(taken)} taken"
        return nodes, [s for s in job.spares if s not in used and (s not in current or s in gone) and s in candidates
                       and s not in unusable], how
    decision = placed(job, [c for n, c in candidates.items() if n not in bad], view.topology, 0)
    if isinstance(decision, Unplaceable):
        return f"waiting for nodes: {decision.reason}"
    return list(decision.nodes), [], "a new placement (no spare left in the domain)"


def _places(nodes: Sequence[str], gone: AbstractSet[str]) -> list[int]:
    """The positions in `nodes` of the names in `gone`, in order (a name the list holds twice: each place). A few
    gone of many nodes: a scan in C for each (list.index), not a pass in Python over all of them."""
    if len(gone) > 8:
        return [at for at, n in enumerate(nodes) if n in gone]
    if not isinstance(nodes, list | tuple):
        nodes = list(nodes)  # (a record's list has no index)
    out = []
    for name in gone:
        at = -1
        while True:
            try:
                at = nodes.index(name, at + 1)
            except ValueError:
                break
            out.append(at)
    return sorted(out)


def unfit(candidates: Mapping[str, Candidate], ranks_per_node: int) -> set[str]:
    """The candidates a job's next generation cannot run on (next_nodes): not schedulable, another job's, too small."""
    return {n for n, c in candidates.items() if not (c.schedulable and c.free and c.gpus >= ranks_per_node)}


def _rendezvous(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    # A restart in place backs off: a job failing by itself must not spin. One that leaves a bad node behind
    # does not wait: the drains it makes (or the node being down) bound how often that can happen, and a wait
    # would only add to the downtime of every node loss and every eviction for a failing GPU. A node lost is
    # often seen first as a crash (its peers' collectives fail before it is declared DOWN): the nodes chosen
    # tell.
    chosen = next_nodes(job, view)
    before = nodes_of(job, view)  # (the driver's: strings the choice shares, so the comparison is by identity)
    replacing = bool(job.incident_nodes) or (not isinstance(chosen, str) and chosen[0] != list(before))
    delay = 0.0 if replacing else backoff(job.restarts_in_row, policy.recovery)
    ready_at = job.state_since_unix_ns / 1e9 + delay
    if now < ready_at:
        return [WakeAt(ready_at)]
    if isinstance(chosen, str) and (why := allocation_short(
            job, view, f"to replace {', '.join(job.incident_nodes) or 'its nodes'}")):
        return [finished(job, FAILED, why, 1, now)]
    if isinstance(chosen, str):
        wait = [WakeAt(now + RENDEZVOUS_RETRY_S)]
        candidates = view.candidates
        own = sorted(n for n in {*job.evicted, *job.incident_nodes}
                     if n in candidates and not candidates[n].schedulable)
        if own:  # it ran out of nodes through its own evictions: say so, and do not wait for ever
            bound = policy.recovery.evicted_wait_s
            waited = now - ready_at
            chosen = (f"{chosen}; {len(own)} node{'s' * (len(own) > 1)} this job evicted stay drained "
                      f"({hostlist.compress(own)}): undrain one, or the job fails {bound:g}s after it began to wait "
                      "(recovery.evicted_wait_s)")
            if waited >= bound:
                return [finished(job, FAILED, f"no nodes for {waited:.0f}s: {chosen}", 1, now)]
            wait = [WakeAt(min(now + RENDEZVOUS_RETRY_S, ready_at + bound))]
        if job.reason == chosen:
            return wait
        return [Commit(copied(job, reason=chosen), "job.waiting", f"{job.id}: {chosen}"), *wait]
    nodes, spares, how = chosen
    generation = job.generation + 1
    # max_restarts stops a job that keeps failing by itself; a restart that leaves a bad node behind is the
    # recovery working (the drains it makes bound how often it can happen), and does not count toward it: nor
    # one after a crash that leaves a node found down since (a node loss seen first as its peer's crash).
    in_row = job.restarts_in_row if replacing else job.restarts_in_row + 1
    new = moved(job, RESTARTING, f"restarting on {named(nodes)}", now, generation=generation,
                restarts=job.restarts + 1, restarts_in_row=in_row, launched_generation=generation,
                ending_since_unix_ns=0)
    new.evicted.extend(n for n in job.incident_nodes if n not in new.evicted)
    with_nodes(new, nodes, spares)
    chosen_set = set(nodes)  # (a job of thousands of nodes: a list's `in` made this quadratic)
    replaced = list(itertools.filterfalse(chosen_set.__contains__, before))  # the incident's, or down since
    kept = [n for n in job.incident_nodes if n in chosen_set]
    counted = (f"restart {new.restarts}; {new.restarts_in_row} of at most {policy.recovery.max_restarts} in a row"
               if not replacing else f"restart {new.restarts}" + (
                   f", replacing {', '.join(replaced)}" if replaced else "") + (
                   f", keeping {', '.join(kept)} of the incident (schedulable again, and nothing else would do)"
                   if kept else "") + ": not counted toward max_restarts")
    return [Commit(new, "job.restarting", f"{job.id} generation {generation} on {named(nodes)} ({how}; "
                   f"{counted}, after {delay:g}s)"),
            Launch(job.id, generation)]


# -- replica groups (spec.replicas > 1) ------------------------------------------------------------------------
#
# The job's nodes are `replicas` equal groups in order, each a data-parallel replica of the model (torchft's replica
# groups). A fault in one group takes that group out of the quorum; the others train on without restarting. The
# group stops (STOPPING), its bad nodes are replaced from the spares once it has (WAITING), and it is launched again
# on its nodes as the job's next generation (REBUILDING: its ranks recover the state from a healthy group and join at
# a step boundary), then trains with the others (TRAINING). One group launches at a time: the job's launch view is one
# generation's. A fault that leaves no group training, a fatal one, or one that names no node or rank is the whole
# gang's, recovered as any job's.

GROUP_TRAINING, GROUP_STOPPING, GROUP_WAITING, GROUP_REBUILDING = (
    pb.REPLICA_GROUP_TRAINING, pb.REPLICA_GROUP_STOPPING, pb.REPLICA_GROUP_WAITING, pb.REPLICA_GROUP_REBUILDING)
GROUP_STATES = {GROUP_TRAINING: "TRAINING", GROUP_STOPPING: "STOPPING", GROUP_WAITING: "WAITING",
                GROUP_REBUILDING: "REBUILDING"}


def grouped(job: pb.Job) -> bool:
    return job.spec.replicas > 1 and len(job.groups) == job.spec.replicas and len(job.nodes) % job.spec.replicas == 0


def group_span(job: pb.Job, g: int) -> range:
    """Positions in job.nodes of group `g`'s nodes."""
    k = len(job.nodes) // job.spec.replicas
    return range(g * k, (g + 1) * k)


def group_members(job: pb.Job, g: int) -> list[str]:
    return [job.nodes[i] for i in group_span(job, g)]


def rank_generation(job: pb.Job, rank: int) -> int:
    """The generation rank `rank` of the job runs now: the job's, or (replica groups) its group's, which may be older
    (a group rebuilt since has the newer one). Its node's reports of an other generation are stale."""
    if not job.groups:
        return job.generation
    ranks = ranktable.rows(job)
    if isinstance(ranks, ranktable.Rows):  # (on the heartbeat path: no row made)
        return (0 <= rank < len(ranks) and ranks.generation(rank)) or job.generation
    if 0 <= rank < len(ranks) and (row := ranks[rank]).rank == rank and row.generation:
        return row.generation
    return job.generation


def generation_of(job: pb.Job) -> Callable[[int], int]:
    """`rank_generation` of the record for any rank, with what the record implies read once: the heartbeat path asks
    it of each rank a node reports (once per record: JobEntry.of_record)."""
    default = job.generation
    if not job.groups:
        return lambda rank: default
    if not ranktable.is_packed(job) or job.packed_ranks.generations or job.spec.replicas < 1 or \
            job.spec.ranks_per_node < 1:
        return lambda rank: rank_generation(job, rank)
    per, n, k = job.spec.ranks_per_node, ranktable.count(job), len(job.nodes) // job.spec.replicas
    groups = [g.generation for g in job.groups]

    def generation(rank: int) -> int:  # (ranktable.group_generation, its lookups done)
        g = rank // per // k if k else len(groups)
        return (0 <= rank < n and (groups[g] if g < len(groups) else default)) or default
    return generation


def node_positions(job: pb.Job) -> dict[str, int]:
    """node -> its position in job.nodes: node i runs ranks [i * ranks_per_node, (i + 1) * ranks_per_node)."""
    return {node: i for i, node in enumerate(job.nodes)}


def ranks_on(job: pb.Job, node: str, positions: Mapping[str, int]) -> Sequence[pb.RankInfo]:
    """The ranks of the job that `node` runs (none for a spare), found by its position (`node_positions`): a node's
    heartbeat costs its own ranks, not the job's (a fleet beating once a second would otherwise cost the square of
    its size). A record whose ranks are not in that order (none this code writes) is searched instead."""
    i = positions.get(node)
    if i is None:
        return ()
    per, ranks = job.spec.ranks_per_node, ranktable.rows(job)
    mine = ranks[i * per:(i + 1) * per]
    if isinstance(ranks, ranktable.Rows):
        return mine  # (a generation's layout, made so)
    if len(mine) == per and all(r.node == node and r.rank == i * per + k for k, r in enumerate(mine)):
        return mine
    return [r for r in ranks if r.node == node]


def node_generations(job: pb.Job) -> dict[str, int]:
    """node -> the generation its ranks of the job run (replica groups: each group's); empty for a job without
    groups (every node runs the job's). One pass: per node, a search would make a stop of every node quadratic."""
    if not job.groups:
        return {}
    per = job.spec.ranks_per_node
    return {node: rank_generation(job, i * per) for i, node in enumerate(job.nodes)}


def out_of_quorum(job: pb.Job) -> set[str]:
    """The nodes of the job's replica groups out of the quorum (stopping, waiting or rebuilding): their ranks' states
    and progress are not the job's news until the group trains again."""
    if not grouped(job):
        return set()
    return {n for g in job.groups if g.state != GROUP_TRAINING for n in group_members(job, g.index)}


def group_rebuilt(job: pb.Job) -> set[int]:
    """The ranks a replica group's rebuild has just launched as the job's generation (the record's newest), when the
    job runs on: every other rank keeps what this process knows of it. Empty otherwise (a whole new generation)."""
    if job.state != RUNNING or not grouped(job):
        return set()
    if ranktable.is_packed(job) and not job.packed_ranks.generations:  # each rank's is its group's
        per, k = job.spec.ranks_per_node, len(job.nodes) // job.spec.replicas
        return {r for g in job.groups if g.generation == job.generation for r in range(g.index * k * per,
                                                                                       (g.index + 1) * k * per)}
    return {r.rank for r in ranktable.rows(job) if r.generation == job.generation}


def quorum(job: pb.Job, nodes: Sequence[str] | None = None) -> tuple[Sequence[pb.RankInfo], Sequence[str]]:
    """The ranks and nodes that train now: the job's, or (replica groups) those of its groups in the quorum. A group
    that left is no longer judged by the detectors: its own steps say what it waits for. `nodes`: the job's, where
    the caller holds them (nodes_of), else the record's."""
    nodes = job.nodes if nodes is None else nodes
    if not grouped(job) or all(g.state == GROUP_TRAINING for g in job.groups):
        return ranktable.rows(job), nodes
    per, k = job.spec.ranks_per_node, len(nodes) // job.spec.replicas
    training = [g.index for g in job.groups if g.state == GROUP_TRAINING]
    return _Spans(ranktable.rows(job), [(g * k * per, (g + 1) * k * per) for g in training]), \
        _Spans(nodes, [(g * k, (g + 1) * k) for g in training])


class _Spans(Sequence):
    """Stretches of a record's list, read as one sequence as it is gone through: the quorum's ranks are most of a
    16,384-rank job's, gone through once at each step, and a copy first would be a second pass."""

    def __init__(self, items: Sequence, spans: list[tuple[int, int]]) -> None:
        self._items, n = items, len(items)
        self._spans = [(a, min(b, n)) for a, b in spans if a < n]  # as slicing reads them
        self._len = sum(b - a for a, b in self._spans)
        self._set: frozenset | bool | None = None  # (False: its items cannot be hashed)
        self._looks = 0

    @property
    def whole(self) -> Sequence:
        """The list the stretches are cut from (a rank table in rank order: rank r at r)."""
        return self._items

    def __len__(self) -> int:
        return self._len

    @property
    def states(self) -> bytes | None:
        """The stretches' states, one byte each, where the list holds them so (ranktable.states)."""
        table = ranktable.states(self._items)
        return None if table is None else b"".join(table[a:b] for a, b in self._spans)

    def __iter__(self) -> Iterator:
        items = self._items  # (chained in C: a generator's yield for each of 16,384 items cost as much as the step)
        return itertools.chain.from_iterable(items[a:b] for a, b in self._spans)

    def __contains__(self, value: object) -> bool:
        self._looks += 1
        if self._set is None and self._looks <= 8 and isinstance(self._items, list | tuple):
            items = self._items  # (the few first looks, each a scan in C: a set of 16,384 names costs more)
            return any(value in items[a:b] for a, b in self._spans)
        if self._set is None:  # (one pass in C: a node's, for each of the job's unwell, once there are many)
            try:
                self._set = frozenset(self)
            except TypeError:  # rows (messages) are not hashable: each stretch looked through
                self._set = False
        if self._set is False:
            items = self._items
            return any(value in items[a:b] for a, b in self._spans)
        return value in self._set

    def holds_rank(self, rank: int) -> bool:
        """Whether rank number `rank` is in the stretches, of a rank table in rank order (rank r at r: every table
        lifecycle.rank_table makes)."""
        return any(a <= rank < b for a, b in self._spans)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(self)[i]
        if i < 0:
            i += self._len
        for a, b in self._spans:
            if 0 <= i < b - a:
                return self._items[a + i]
            i -= b - a
        raise IndexError(i)


def holders(job: pb.Job, view: JobView) -> set[int]:
    """The groups in the quorum that hold the job's state: those that have trained since the oldest launch of any
    (the lowest generation: they started from the same state, and none was rebuilt since), and each rebuilt group
    that has trained a step since it joined (it takes a healthy group's state at its first quorum; until its ranks
    step, it may not have it). Without progress reports (the simulator's ranks), every group in the quorum."""
    training = [g for g in job.groups if g.state == GROUP_TRAINING]
    if not training:
        return set()
    oldest = min(g.generation for g in training)
    if not view.tracks:
        return {g.index for g in training}
    per, k = job.spec.ranks_per_node, len(job.nodes) // job.spec.replicas
    held = set()
    for g in training:
        since = g.since_unix_ns / 1e9
        ranks = range(g.index * k * per, (g.index + 1) * k * per)
        if g.generation == oldest or any((t := view.tracks.get(r)) is not None and t.last_step >= 0 and
                                         t.last_advance > since for r in ranks):
            held.add(g.index)
    return held


def groups_hit(job: pb.Job, incident: Incident, nodes: Sequence[str] | None = None) -> set[int]:
    """The training groups an incident is about (by its nodes and ranks); empty when it names neither. `nodes`: the
    job's, where the caller holds them (nodes_of), else the record's."""
    nodes = job.nodes if nodes is None else nodes
    k = len(nodes) // job.spec.replicas
    per = max(job.spec.ranks_per_node, 1)
    wanted = set(incident.nodes)
    hit = {i // k for i in _places(nodes, wanted)} if wanted else set()
    hit |= {r // per // k for r in incident.ranks if r // per < len(nodes)}
    return {g for g in hit if job.groups[g].state == GROUP_TRAINING}


def group_leaves(job: pb.Job, incident: Incident, hit: set[int], view: JobView, now: float,
                 policy: Policy) -> list[Action]:
    """The groups `hit` leave the quorum at once; the others train on. No checkpoint: every healthy group holds the
    state. A sudden fault's group is stopped at once (its step is lost to the quorum, which takes it again without
    it). A predictable fault's group finishes its step first: it leaves the quorum now (its next quorum is refused),
    and its ranks are stopped only once the step they were in has been taken with the others (`finish_s`), so the
    healthy groups lose no step to it. A restart in place (a crash) counts toward max_restarts and backs off, as the
    whole job's would."""
    calm_s = now - max(job.state_since_unix_ns, *(job.groups[g].since_unix_ns for g in hit)) / 1e9  # since joining
    if job.restarts_in_row and calm_s >= policy.recovery.restart_window_s:
        job = copied(job, restarts_in_row=0)
    replacing = bool(incident.nodes)
    if not replacing and job.restarts_in_row >= policy.recovery.max_restarts:
        return _give_up(job, incident, now)  # as the whole job's would (its calm counted from the group's join)
    now_ns = int(now * 1e9)
    new = copied(job, restarts=job.restarts + len(hit), restarts_in_row=job.restarts_in_row + (not replacing))
    new.evicted.extend(n for n in incident.nodes if n not in new.evicted)
    if incident.kind == "straggler":
        new.straggler_evictions_unix_ns.append(now_ns)
        new.straggler_step_s = progress.job_step_s(view.tracks)
        new.straggler_held = ""
    out: list[Action] = [Drain(n, f"evicted from {job.id}: {incident.reason}") for n in incident.nodes
                         if n in view.nodes and not view.nodes[n].drained]
    bad = set(incident.nodes)
    finish = finish_s(view, policy) if incident.predictable else 0.0
    for g in sorted(hit):
        group = new.groups[g]
        members = group_members(new, g)
        group.state, group.reason, group.since_unix_ns, group.incident_kind = (
            GROUP_STOPPING, incident.reason, now_ns, incident.kind)
        group.finish_until_unix_ns = now_ns + int(finish * 1e9) if finish else 0
        _replace(group.bad, [n for n in members if n in bad])
        if not finish:
            out += stops(job, [n for n in members if (v := view.nodes.get(n)) is not None and not v.down and
                               v.connected], group.generation)
    left = sum(g.state == GROUP_TRAINING for g in new.groups)
    how = "finishes its step and leaves the quorum" if incident.predictable else "left the quorum (its step is lost)"
    names = ", ".join(str(g) for g in sorted(hit))
    return [Commit(new, "job.group_left", f"{job.id}: replica group{'s' * (len(hit) > 1)} {names} {how}: "
                   f"{incident.kind}: {incident.reason}; {left} of {job.spec.replicas} train on",
                   incident=incident.kind), *out,
            *(LeaveQuorum(g, f"{incident.kind}: {incident.reason}") for g in sorted(hit))]


def finish_s(view: JobView, policy: Policy) -> float:
    """How long a predictable fault's group goes on after leaving the quorum before its ranks are stopped: two of the
    job's step times (the step it was in, taken with the others, ends within them; its next quorum is refused), at
    least FINISH_MIN_S (the job's ranks report no steps, or report them late), at most jobs.stop_grace_s."""
    step_s = progress.job_step_s(view.tracks) or view.step_s
    return min(max(2 * step_s, FINISH_MIN_S), policy.jobs.stop_grace_s)


def group_moves(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    """What the job's groups out of the quorum do next: stop, wait for nodes, launch, join. A commit comes alone
    (the next step sees it); otherwise the stops to send again and when to look next."""
    out: list[Action] = []
    rebuilding = any(g.state == GROUP_REBUILDING for g in job.groups)
    for group in job.groups:
        if group.state == GROUP_STOPPING:
            members = group_members(job, group.index)
            if group.finish_until_unix_ns:  # a predictable fault's group finishes the step it was in, out of the quorum
                if now < group.finish_until_unix_ns / 1e9:
                    out.append(WakeAt(group.finish_until_unix_ns / 1e9))
                    continue
                new = copied(job)  # its stop starts now, on the record: the stop's deadline counts from here, also
                finished = new.groups[group.index]  # for a controller that takes over long after
                finished.finish_until_unix_ns, finished.since_unix_ns = 0, int(now * 1e9)
                return [Commit(new, "job.group_finished", f"{job.id}: replica group {group.index} finished its step "
                               "out of the quorum; stopping its ranks"),
                        *stops(job, [n for n in members if (v := view.nodes.get(n)) is not None and not v.down and
                                     v.connected], group.generation)]  # (its bad nodes' too)
            kept = [n for n in members if n not in group.bad]
            waiting = [n for n in kept if n not in view.stopped and (v := view.nodes.get(n)) is not None
                       and not v.down]
            deadline = group.since_unix_ns / 1e9 + policy.jobs.stop_grace_s + policy.recovery.evict_margin_s
            if waiting and now < deadline:
                out += stops(job, [n for n in waiting if n not in view.told and view.nodes[n].connected],
                             group.generation)
                out.append(WakeAt(min(now + RESTOP_S, deadline)))
                continue
            new = copied(job)
            _group_to(new, group.index, GROUP_WAITING, "stopped; choosing its nodes", now)
            unconfirmed = f" (not known to be stopped on {', '.join(waiting)}: fenced if they report it)" \
                if waiting else ""
            return [Commit(new, "job.group_stopped", f"{job.id}: replica group {group.index} stopped{unconfirmed}")]
        if group.state == GROUP_WAITING and not rebuilding:
            delay = 0.0 if group.bad else backoff(max(job.restarts_in_row - 1, 0), policy.recovery)
            ready_at = group.since_unix_ns / 1e9 + delay
            if now < ready_at:
                out.append(WakeAt(ready_at))
                continue
            chosen = _group_next_nodes(job, view, group)
            if isinstance(chosen, str):
                wait = WakeAt(now + RENDEZVOUS_RETRY_S)
                if group.reason == chosen:
                    out.append(wait)
                    continue
                new = copied(job)
                new.groups[group.index].reason = chosen
                return [Commit(new, "job.group_waiting", f"{job.id}: replica group {group.index}: {chosen}"), wait]
            return _group_launch(job, group.index, *chosen, now)
        if group.state == GROUP_REBUILDING and (done := _group_launched(job, group.index, view, now, policy)):
            return done
    return out


def _group_to(job: pb.Job, g: int, state: int, reason: str, now: float) -> None:
    group = job.groups[g]
    group.state, group.reason, group.since_unix_ns = state, reason, int(now * 1e9)


def _group_next_nodes(job: pb.Job, view: JobView, group: pb.ReplicaGroup) -> tuple[list[str], list[str]] | str:
    """The group's next nodes: its good ones in place, its bad ones (and any not usable now) replaced by the job's
    spares, then by free nodes of the fleet (the view has it while a group waits); of each, those on the leaf
    switches of the group's other nodes first (the group stays as tight as it was). Returns (nodes, the spares
    left), or why it waits. As for a whole job (`next_nodes`), a bad node schedulable again was undrained since
    (repaired): it is taken back when nothing else will do."""
    candidates = view.candidates

    def usable(n: str) -> bool:
        c = candidates.get(n)
        return c is not None and c.schedulable and c.free and c.gpus >= job.spec.ranks_per_node

    members = group_members(job, group.index)
    spares = [s for s in job.spares if usable(s)]
    free = free_nodes(job, view, (view.members if view.members is not None else set(job.nodes))
                      | {*job.spares, *job.evicted}) if view.fleet else []
    leaf_of = view.topology.node_leaf if view.topology is not None else {}
    home = {leaf_of.get(n) for n in members if n not in group.bad}

    def away(n: str) -> bool:  # (sorted is stable: the order within each kind is kept)
        return leaf_of.get(n) not in home

    nearest = [*sorted(spares, key=away), *sorted(free, key=away)]
    nodes: list[str] = []
    for bad in (set(group.bad), set()):
        replacements = iter(nearest)
        nodes = [n if n not in bad and usable(n) else next(replacements, "") for n in members]
        if "" not in nodes:
            used = set(nodes)
            return nodes, [s for s in job.spares if s not in used and usable(s)]
    return (f"waiting for nodes: {nodes.count('')} more than the {len(spares)} usable spare(s) and {len(free)} free "
            "node(s) (the other groups train on)")


def _group_launch(job: pb.Job, g: int, nodes: list[str], spares: list[str], now: float) -> list[Action]:
    """The group, on `nodes`, as the job's next generation: its ranks anew, launched on its nodes alone."""
    generation = job.generation + 1
    new = copied(job, generation=generation, launched_generation=generation)
    span = group_span(new, g)
    members = set(group_members(job, g))
    taken = [n for n in nodes if n not in members]
    for i, node in zip(span, nodes, strict=True):
        new.nodes[i] = node
    _replace(new.spares, spares)
    per = job.spec.ranks_per_node
    ranktable.renew(new, span.start * per, span.stop * per, generation)
    new.groups[g].generation = generation
    _group_to(new, g, GROUP_REBUILDING, f"launched as generation {generation}: recovering the state from a healthy "
              "group", now)
    how = f"spare{'s' * (len(taken) > 1)} {', '.join(taken)} taken" if taken else "same nodes"
    return [Commit(new, "job.group_rebuilding", f"{job.id}: replica group {g} launched as generation {generation} "
                   f"({how}); it joins the quorum at a step boundary once it has the state of a healthy group"),
            Launch(job.id, generation, tuple(nodes))]


def _group_launched(job: pb.Job, g: int, view: JobView, now: float, policy: Policy) -> list[Action]:
    """A rebuilding group's launch: in flight (nothing), done (it trains: its ranks recover and join by themselves),
    failed or lost to a controller restart (it leaves again, and launches anew as a later generation)."""
    group = job.groups[g]
    launch = view.launch
    if launch is not None and launch.generation == group.generation and not launch.done:
        return []
    new = copied(job)
    if launch is not None and launch.generation == group.generation and launch.ok:
        _group_to(new, g, GROUP_TRAINING, "", now)
        span, per = group_span(new, g), job.spec.ranks_per_node
        ranktable.set_span(new, span.start * per, span.stop * per, RANK_RUNNING)
        return [Commit(new, "job.group_joined", f"{job.id}: replica group {g} (generation {group.generation}) "
                       "running; it joins the quorum")]
    why = f"launch failed: {launch.error}" if launch is not None and launch.generation == group.generation else \
        f"the launch of generation {group.generation} was interrupted by a controller restart"
    new.restarts_in_row = job.restarts_in_row + 1
    if new.restarts_in_row > policy.recovery.max_restarts:
        return _give_up(job, Incident("crash", False, (), f"replica group {g}: {why}"), now)
    _group_to(new, g, GROUP_STOPPING, why, now)
    return [Commit(new, "job.group_left", f"{job.id}: replica group {g}: {why}; it stops and launches again"),
            *stops(job, [n for n in group_members(job, g) if (v := view.nodes.get(n)) is not None and not v.down
                         and v.connected], group.generation), LeaveQuorum(g, why)]


def _cancelling(job: pb.Job, view: JobView, now: float, policy: Policy) -> list[Action]:
    out = stop_untold(job, view)
    down = {n for n, v in view.nodes.items() if v.down}
    running = ranktable.iter_where(ranktable.rows(job), RANK_RUNNING)  # (the first made is enough to know)
    if any(r.node not in down and r.node in view.nodes for r in running):
        return out
    why = "" if job.reason == CANCEL_REQUESTED else f": {job.reason}"
    return [*out, finished(job, CANCELLED, f"cancelled{why}", 1, now)]


CANCEL_REQUESTED = "cancel requested"


def upkeep(job: pb.Job, view: JobView, now: float) -> list[Action]:
    """What a running job with nothing wrong asks of its nodes: its spares to hold standbys of its ranks (renewed
    every PREPARE_RENEW_S; none for a job that runs as an account: a standby runs the job's code as the agent's
    user), and its nodes to keep the newest step whose snapshots are held twice over, when that moved on."""
    out: list[Action] = []
    if view.prepared is not None and not job.spec.run_as:
        out += [Prepare(spare, job.spec.ranks_per_node) for spare in job.spares
                if now - view.prepared.get(spare, float("-inf")) >= PREPARE_RENEW_S
                and (v := view.nodes.get(spare)) is not None and v.connected and not v.down]
    if view.snapshot_step is not None and len(job.nodes) >= 2 and (job.generation, view.snapshot_step) > view.pinned:
        out.append(Pin(view.snapshot_step))
    return out


@dataclass(frozen=True)
class Fence:
    """Stop generation `generation` of `job` on a node: ranks of it run there that belong to no current generation
    (a launch a dead controller sent, a node back from a partition)."""
    job: str
    generation: int
    ranks: tuple[int, ...]
    why: str


def fences(statuses: Iterable[tuple[str, int, int]], current: Callable[[str], pb.Job | None],
           told: Mapping[tuple[str, int], float], now: float, repeat_s: float) -> list[Fence]:
    """What a node's heartbeat calls for: one stop per (job, generation) of its running ranks (`statuses`: job,
    generation, rank) that is not its job's current generation while the job is active; not again within
    `repeat_s` of the last (`told`, on the clock of `now`)."""
    stale: dict[tuple[str, int], list[int]] = {}
    for job_id, generation, rank in statuses:
        job = current(job_id)
        if job is None or job.state not in ACTIVE or generation != rank_generation(job, rank):
            stale.setdefault((job_id, generation), []).append(rank)
    out = []
    for (job_id, generation), ranks in stale.items():
        if now - told.get((job_id, generation), float("-inf")) < repeat_s:
            continue
        job = current(job_id)
        why = ("unknown job" if job is None else f"the job is {state_name(job.state)}" if job.state not in ACTIVE
               else f"generation {generation} is stale (current {job.generation}, {state_name(job.state)})")
        out.append(Fence(job_id, generation, tuple(ranks), why))
    return out


def cancel(job: pb.Job, now: float, why: str = "", prepared: Iterable[str] = ()) -> list[Action]:
    """What a cancel request does to a job in any state (raises IllegalTransition from a final one); `why`, when
    the controller itself cancels, is the reason the job keeps. The spares asked to hold standbys (`prepared`) let
    them go now, not when their hold runs out."""
    if job.state == PENDING:
        return [finished(job, CANCELLED, f"cancelled while pending: {why}" if why else "cancelled while pending", 1,
                         now)]
    if job.state == CANCELLING:
        return []
    new = moved(job, CANCELLING, why or CANCEL_REQUESTED, now)
    return [Commit(new, "job.cancelling",
                   f"{job.id}: {why or CANCEL_REQUESTED}; stopping {ranktable.count(job)} ranks"),
            *(Prepare(spare, 0) for spare in prepared)]


_BY_STATE = {PENDING: _pending, STARTING: _launching, RESTARTING: _launching, RUNNING: _running,
             CHECKPOINTING: _checkpointing, EVICTING: _evicting, RENDEZVOUS: _rendezvous, CANCELLING: _cancelling}
