"""torchrun's rendezvous in the controller: rounds of participants per run id.

One participant per torchrun agent. A participant joins the open round of its run; the round forms
when `max_nodes` have joined, or when `min_nodes` have joined and the last call has passed. Ranks
follow a stable order: members of the previous round keep their relative order (so rank 0, which
serves the round's store, stays put when it can), newcomers follow in join order.

Health decides too (`fit(node)`, the controller's verdict on the participant's Phalanx node): a
participant on a node that is FAILING, FAILED, drained or DOWN does not count toward a round and is
left out when it forms (told TIMED_OUT, with the reason, so its torchrun agent stops); and when a
member of the running round is on such a node, every member is told that nodes are waiting, so
torchrun restarts its workers and the next round forms without that node, with a spare that was
waiting (a node beyond --nnodes's MAX) in its place.

The round is judged by the lifecycle's own rules (`controller.recovery.detectors.detect`, with the
controller's [recovery] settings), as a job Phalanx launched: the workers of a formed round whose
scripts use trainlib report their progress here (`report_worker`, twice a second: steps, step time, the
compute time of each step, whether they save or have finished), and those reports become the same rank
tracks a Phalanx-launched job's heartbeats fill. The incident comes from `detect`: a member's node lost
(DOWN) or FAILED, a hang, a FAILING node, a straggler; besides, torchrun's own, a member's node drained.

Checkpoint first: a predictable incident (FAILING, drained, a straggler) first asks the workers to
checkpoint after a step every one of them can still reach (`lifecycle.checkpoint_step`, the lead
recovery.checkpoint_lead_s plus a report interval), and to take no step after it; the members hear that
nodes are waiting only once every worker has committed that step, or recovery.checkpoint_deadline_s has
passed, or a worker has stopped reporting, or one went past the step before it heard (no consistent
checkpoint can come of it). A sudden incident (a lost or FAILED node, a hang), or a round with no
reporting workers, one already silent or one that has not stepped yet (no pace to agree by), restarts at
once. A straggler's node is left out of the run's later rounds (its torchrun agent is told TIMED_OUT with
the reason), within lifecycle.straggler_hold's bounds: not while no participant waits to take its place,
nor beyond recovery.straggler_max_evictions an hour, nor after an eviction that did not pay off.

Hangs follow the same rule too (recovery.hang_min_s, hang_factor x the p90 step time, startup_s over
the first steps, no hang while a worker saves or once one has finished training); a run's `--rdzv-conf
hang_timeout` replaces hang_min_s for that run. One difference, torchrun's: a worker that stopped
reporting is not named as a hang's culprit (its torchrun agent sees its exit and restarts the round), so
a hang restarts the round in place.

Each participant brings a fresh TCPStore of its own to every join, and the formed round hands out
rank 0's. So no round ever sees keys of an earlier one (torchrun's relaunch broke on exactly that
when a store was reused) and no step is needed after forming: a rank 0 that dies cannot leave the
others waiting for an address it never published.

`RendezvousBook` is the state: it reads no clock, does no I/O, and `decide(run, now)` says what
time alone changes (timeouts, dropped participants, the last call). The servicer is
`controller.api.rendezvous_service`. The state is in memory, a cache of what the torchrun agents
know: after a controller restart (or a takeover) waiting agents re-join (their AwaitRound answers
NOT_FOUND), and the members of a running round, which ask NumNodesWaiting every second and say
where they stand in it, bring the round back (`num_waiting(..., member)`), so that its health
protection goes on; an open round a spare re-opened first is renumbered past it. For RELEARN_GRACE_S
after that nothing is judged (the other members and the workers' reports come in); a member that
still has not asked by then was lost while the controller was away, and the round restarts. A
controller that took over a fleet also forms no round in its first RELEARN_GRACE_S (`hold_until`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from controller.config import RecoveryConfig
from controller.errors import FailedPrecondition, NotFound
from controller.nodes.health import Health
from controller.recovery import lifecycle
from controller.recovery.detectors import Incident, NodeView, detect
from controller.recovery.progress import RankTrack
from phalanx import log
from phalanx.v1 import common_pb2, rendezvous_pb2

logger = log.get("rendezvous")

LEASE_S = 15.0          # a waiting participant not heard from for this long is dropped from its round
MAX_WAIT_S = 5.0        # the longest one AwaitRound may wait inside the server
IDLE_RUN_TTL_S = 3600.0  # a run nobody mentions for this long is forgotten (its agents were killed)
CLOSED_RUN_TTL_S = 60.0  # a run closed before anyone joined is kept this long, so latecomers see it
MAX_RUNS = 10_000
MAX_NODES = 100_000
MAX_ID_CHARS = 256
MAX_GONE = 1000         # remembered reasons for dropped participants, per run
SWEEP_EVERY_S = 5.0
MAX_WORKERS = 1 << 20    # WORLD_SIZE's bound in worker reports
WORKER_REPORT_S = 0.5   # trainlib's report interval under torchrun: the request's way down takes up to this
WORKER_SILENT_S = 5.0   # a worker not heard from for this long is not waited for (nor judged: it has exited)
MAX_COMPUTE_SAMPLES = 256  # per report: a worker reports twice a second
DEFAULT_POLICY = RecoveryConfig()
JUDGED_EVERY_S = 0.25  # every member asks each second: the round is judged at most this often
RELEARN_GRACE_S = 3.0   # after a controller start or a re-learned round: the members' asks (every second) come in
# A node evicted from a run as a straggler takes part again once the open round, for this long, could have formed
# with it and not without it (another node failed since): a slow node is better than no job. Long enough for the
# fit members of the last round, restarting, to join again first (their torchrun agents stop workers and re-join).
READMIT_AFTER_S = 30.0


class StaleParticipant(FailedPrecondition):
    """A participant acts on a round it is not (or no longer) part of: it must join again."""


@dataclass(frozen=True)
class Settings:
    min_nodes: int
    max_nodes: int
    last_call_s: float
    hang_s: float = 0.0  # the floor of the hang rule (--rdzv-conf hang_timeout); 0 = recovery.hang_min_s


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int

    def to_proto(self) -> rendezvous_pb2.StoreAddress:
        return rendezvous_pb2.StoreAddress(host=self.host, port=self.port)


@dataclass
class Participant:
    id: str
    store: StoreAddress
    seq: int          # join order within the run
    attempt: int      # the participant's count of joins: tells a retried Join from a new one
    deadline: float   # the round must form by then (join timeout)
    last_seen: float
    node: str = ""    # the Phalanx node it runs on ("" = not known: always fit)


@dataclass
class Worker:
    """One training process of a formed round, as its trainlib last reported."""
    rank: int
    world_size: int
    step: int        # the last step done; -1 = none yet
    step_s: float    # its recent median step time; 0 = not known
    heard: float     # when the report came (the book's clock)
    done_id: int = 0  # the checkpoint request it has committed
    done_step: int = -1
    node: str = ""
    saving: bool = False  # inside trainlib.save
    finished: bool = False  # training has ended in it: what follows (teardown, exit) is no hang
    compute_s: tuple[float, ...] = ()  # the compute time (before the gradient sync) of each step since its last report


@dataclass
class CheckpointAsk:
    """The checkpoint a formed round's workers are asked for before the round restarts without an unfit node."""
    id: int
    round: int
    at_step: int
    world_size: int
    asked_at: float
    why: str = ""      # the unfit nodes the restart leaves out, and why
    outcome: str = ""  # once decided, how it ended (every worker committed, or why the restart goes on without)
    furthest: int = -1  # the furthest step a worker has reported


@dataclass
class Round:
    number: int
    settings: Settings
    waiting: dict[str, Participant] = field(default_factory=dict)
    quorum_at: float | None = None  # when min_nodes was reached: the last call runs from here
    short_since: float | None = None  # since when min_nodes is reached only with nodes evicted as stragglers
    ranks: list[Participant] = field(default_factory=list)  # by rank, once formed
    workers: dict[int, Worker] = field(default_factory=dict)  # by global rank, once formed: trainlib's reports
    adopted: dict[str, int] = field(default_factory=dict)  # re-learned from its members' asks: participant -> rank
    declared: int = 0  # re-learned: the world size its members say it has (not all of them may have asked yet)
    relearned_at: float = 0.0
    world_size: int = 0  # workers in the round, as the first worker report said (later reports must agree)
    tracks: dict[int, RankTrack] = field(default_factory=dict)  # by global rank: the workers' progress, as a job's
    judged: tuple[float, tuple, Incident | None, str] = (float("-inf"), (), None, "")  # when, the members' nodes
    # as seen then, the incident, what its restart leaves out

    def member_ids(self) -> set[str]:
        return {p.id for p in self.ranks}


class Outcome(enum.Enum):
    WAITING = rendezvous_pb2.ROUND_OUTCOME_WAITING
    FORMED = rendezvous_pb2.ROUND_OUTCOME_FORMED
    TIMED_OUT = rendezvous_pb2.ROUND_OUTCOME_TIMED_OUT
    CLOSED = rendezvous_pb2.ROUND_OUTCOME_CLOSED


@dataclass(frozen=True)
class Reply:
    outcome: Outcome
    round: int
    rank: int = 0
    world_size: int = 0
    store: StoreAddress | None = None
    joined: int = 0
    message: str = ""

    def to_proto(self) -> rendezvous_pb2.RoundReply:
        return rendezvous_pb2.RoundReply(
            outcome=self.outcome.value, round=self.round, rank=self.rank, world_size=self.world_size,
            store=self.store.to_proto() if self.store else None, joined=self.joined, message=self.message)


@dataclass
class Run:
    id: str
    last_activity: float
    closed: bool = False
    formed: Round | None = None  # the round whose group runs now
    open: Round | None = None    # the round collecting participants
    last_number: int = 0
    next_seq: int = 0
    left: set[str] = field(default_factory=set)        # formed members that shut down
    gone: dict[str, Drop] = field(default_factory=dict)  # dropped from the open round; told on their next poll
    restart_told: int = 0  # the formed round whose members were told to restart for an unfit member
    ask: CheckpointAsk | None = None  # the formed round's checkpoint before its restart
    aliases: dict[int, int] = field(default_factory=dict)  # an open round renumbered past a re-learned one: old -> new
    evicted: dict[str, str] = field(default_factory=dict)  # node -> why it is left out of this run's rounds (straggler)
    straggler_evictions: list[float] = field(default_factory=list)  # when (the book's clock), for straggler_hold
    straggler_step_s: float = 0.0  # the round's step time when a straggler was last evicted
    straggler_held: str = ""  # why the last straggler verdict was held back (said once)
    restored: bool = False  # from a record a previous controller stored: its members have not re-taught it yet
    restarts: int = 0  # rounds restarted for an incident (this controller process)

    def present(self) -> set[str]:
        waiting = set(self.open.waiting) if self.open else set()
        return waiting | ((self.formed.member_ids() if self.formed else set()) - self.left)


@dataclass(frozen=True)
class Member:
    """What a member of a formed round says of its place in it (NumNodesWaiting), so that a controller that lost
    the round (a restart, a takeover) can re-learn it."""
    rank: int
    world_size: int
    store: StoreAddress
    settings: Settings
    node: str = ""
    attempt: int = 0


@dataclass(frozen=True)
class Drop:
    participant: str
    round: int
    reason: str
    timed_out: bool  # True: the join timeout passed (a result); False: no keep-alive (a stale participant)


@dataclass(frozen=True)
class Form:
    round: int
    left_out: tuple[tuple[str, str], ...] = ()  # (participant, why): waiting on unfit nodes, dropped as it forms
    readmitted: tuple[str, ...] = ()  # participants on nodes evicted as stragglers, taken back (READMIT_AFTER_S)


Action = Drop | Form


def decide(run: Run, now: float, fit: Callable[[str], str] = lambda node: "",
           health: Callable[[str], str] | None = None) -> list[Action]:
    """What time alone changes in `run` at `now`: participants past their join timeout or lease leave
    the open round, then the round forms if it is full, or has its quorum and the last call is over.
    Participants on nodes `fit` finds wanting do not count, and are left out when it forms; but those `health`
    (the controller's verdict alone) finds fit, whose nodes were evicted from the run as stragglers, are taken
    back when the round has been short of its minimum without them for READMIT_AFTER_S."""
    rnd = run.open
    if rnd is None or run.closed:
        return []
    actions: list[Action] = []
    staying, left_out, evicted = 0, [], []
    for p in rnd.waiting.values():
        if now >= p.deadline:
            actions.append(Drop(p.id, rnd.number, _timeout_message(run.id, rnd, fit), timed_out=True))
        elif now >= p.last_seen + LEASE_S:
            actions.append(Drop(p.id, rnd.number, f"{p.id} was dropped from round {rnd.number} of rendezvous "
                                f"{run.id!r}: not heard from for {LEASE_S:g}s; join again", timed_out=False))
        elif why := _unfit(p, fit):
            left_out.append((p.id, why))
            if health is not None and p.node in run.evicted and not health(p.node):
                evicted.append(p)
        else:
            staying += 1
    s = rnd.settings
    last_call_over = rnd.quorum_at is not None and now >= rnd.quorum_at + s.last_call_s
    if staying >= s.max_nodes or (staying >= s.min_nodes and last_call_over):
        actions.append(Form(rnd.number, tuple(left_out)))
    elif (staying < s.min_nodes <= staying + len(evicted) and rnd.short_since is not None
          and now >= rnd.short_since + READMIT_AFTER_S):
        back = {p.id for p in sorted(evicted, key=lambda p: p.seq)[:s.min_nodes - staying]}  # the fewest that do
        actions.append(Form(rnd.number, tuple(o for o in left_out if o[0] not in back), tuple(sorted(back))))
    return actions


def _unfit(p: Participant, fit: Callable[[str], str]) -> str:
    return fit(p.node) if p.node else ""


def unfit(view: NodeView | None) -> str:
    """'' if a node may take part in a round, else why not, from the controller's view of it (None: a node
    without a Phalanx agent, not judged)."""
    if view is None:
        return ""
    if view.down:
        return "it is DOWN (its agent is not heard from)"
    if view.health >= Health.FAILING:
        return f"it is {view.health.name}: {view.health_reason or 'no reason given'}"
    if view.drained:
        return f"it is drained: {view.drain_reason or 'no reason given'}"
    return ""


def _timeout_message(run_id: str, rnd: Round, fit: Callable[[str], str] = lambda node: "") -> str:
    """Why the round did not form: too few joined, or too few of those who did may take part (and why not)."""
    s = rnd.settings
    unfit_ones = [(p.node, why) for p in rnd.waiting.values() if (why := _unfit(p, fit))]
    joined = f"{len(rnd.waiting)} node(s) joined"
    if unfit_ones:
        joined += (f", {len(rnd.waiting) - len(unfit_ones)} of them fit to take part (left out: "
                   + "; ".join(f"node {node}: {why}" for node, why in sorted(dict(unfit_ones).items())) + ")")
    return (f"round {rnd.number} of rendezvous {run_id!r} did not form within the join timeout: {joined}, it needs "
            f"{s.min_nodes} (at most {s.max_nodes}); start the missing nodes with the same --rdzv-id, or lower "
            "--nnodes")


def rank_order(members: list[Participant], previous: Round | None) -> list[Participant]:
    """Members of the previous round first, in their old rank order; newcomers after, in join order."""
    before = {p.id: rank for rank, p in enumerate(previous.ranks)} if previous else {}
    return sorted(members, key=lambda p: (before.get(p.id, len(before)), p.seq))


class RendezvousBook:
    """Every run id's rounds. Methods take `now`; `on_change(run_id)` wakes whoever waits on a run."""

    def __init__(self, on_change: Callable[[str], None] = lambda run_id: None,
                 on_event: Callable[[str, str, str], None] = lambda kind, message, run_id: None,
                 first_ask_id: int = 0, hold_until: float = float("-inf"),
                 policy: RecoveryConfig = DEFAULT_POLICY,
                 on_forget: Callable[[Run], None] = lambda run: None,
                 view: Callable[[str], NodeView | None] = lambda node: None) -> None:
        """`first_ask_id`: checkpoint request ids count up from it (the servicer passes the wall clock, so that a
        restarted controller never reuses one a worker already answered). `hold_until`: no round forms before it
        (the controller's start plus RELEARN_GRACE_S), so that members of a running round re-teach it first."""
        self._runs: dict[str, Run] = {}
        self._on_change = on_change
        self._event = on_event  # (kind, message, run id) -> the controller's event log
        self._last_sweep = float("-inf")
        self._last_ask_id = first_ask_id
        self._hold_until = hold_until
        self.policy = policy  # [recovery], as for every job: hang and straggler rules, the checkpoint's lead, deadline
        self._view = view  # node -> what recovery knows of it (None: no Phalanx agent there, taken as healthy)
        self._on_forget = on_forget  # a run about to be forgotten (the servicer keeps how it ended)
        self.incidents: Counter[str] = Counter()  # by kind, as the job manager counts a job's (the metrics)

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def restore(self, run_id: str, last_number: int, evicted: dict[str, str], restarts: int, now: float) -> Run:
        """A run a previous controller stored (it ran when this one took over): known, with the nodes evicted from
        it, before its members re-teach its round (`num_waiting(..., member)`); a new round is numbered past
        `last_number`, and none forms for RELEARN_GRACE_S. Kept IDLE_RUN_TTL_S for its members, however few come
        back."""
        run = self._runs[run_id] = Run(run_id, last_activity=now, last_number=last_number, evicted=dict(evicted),
                                       restored=True, restarts=restarts)
        self._hold_until = max(self._hold_until, now + RELEARN_GRACE_S)
        return run

    def _fit_in(self, run: Run) -> Callable[[str], str]:
        """'' if a node may take part in the run's rounds, else why not: the controller's verdict on it
        (`unfit`), or the run's own (a node evicted from it as a straggler)."""
        return lambda node: run.evicted.get(node) or unfit(self._view(node))

    def _health(self, node: str) -> str:
        """'' if the controller finds `node` fit, else why not (its verdict alone: a run's evictions aside)."""
        return unfit(self._view(node))

    def runs(self) -> list[Run]:
        return list(self._runs.values())

    def _run(self, run_id: str, now: float, create: bool = False) -> Run:
        self.sweep(now)
        run = self._runs.get(run_id)
        if run is None:
            if not create:
                raise NotFound(f"rendezvous {run_id!r} is not known here (the controller may have restarted); "
                               "join again")
            if len(self._runs) >= MAX_RUNS:
                raise FailedPrecondition(f"the controller already holds {MAX_RUNS} rendezvous runs, its limit; "
                                         "finish or close some first")
            run = self._runs[run_id] = Run(run_id, last_activity=now)
        return run

    def advance(self, run: Run, now: float) -> list[Action]:
        """Apply what `decide` says; one log line per decision."""
        actions = decide(run, now, self._fit_in(run), self._health)
        if now < self._hold_until:  # just started: a running round's members may not have asked yet
            actions = [a for a in actions if not isinstance(a, Form)]
        rnd = run.open
        for action in actions:
            assert rnd is not None
            if isinstance(action, Drop):
                del rnd.waiting[action.participant]
                run.gone[action.participant] = action
                while len(run.gone) > MAX_GONE:
                    run.gone.pop(next(iter(run.gone)))
                logger.info("rendezvous participant dropped", run=run.id, round=rnd.number,
                            participant=action.participant, why="join timeout" if action.timed_out else "no keep-alive")
            else:
                out = dict(action.left_out)
                rnd.ranks = rank_order([p for p in rnd.waiting.values() if p.id not in out], run.formed)
                for pid in action.readmitted:
                    node = rnd.waiting[pid].node
                    why = run.evicted.pop(node, "")
                    self._event("rendezvous.readmitted", f"node {node} takes part in round {rnd.number} of rendezvous "
                                f"{run.id!r} again, though {why}: without it the round could not "
                                f"reach its {rnd.settings.min_nodes} nodes for {READMIT_AFTER_S:g}s", run.id)
                for pid, why in out.items():
                    node = rnd.waiting[pid].node
                    message = (f"{pid} on node {node} was left out of round {rnd.number} of rendezvous {run.id!r}: "
                               f"{why}")
                    run.gone[pid] = Drop(pid, rnd.number, message, timed_out=True)
                    self._event("rendezvous.left_out", message, run.id)
                rnd.waiting.clear()
                run.formed, run.open, run.restored = rnd, None, False
                run.left.clear()
                nodes = ", ".join(p.node or p.id for p in rnd.ranks)
                self._event("rendezvous.formed", f"round {rnd.number} of rendezvous {run.id!r} formed: "
                            f"{len(rnd.ranks)} nodes ({nodes})", run.id)
                logger.info("rendezvous round formed", run=run.id, round=rnd.number, world_size=len(rnd.ranks),
                            rank0=rnd.ranks[0].id, store=f"{rnd.ranks[0].store.host}:{rnd.ranks[0].store.port}")
        if rnd is not None and run.open is rnd:
            _update_quorum(rnd, now, self._fit_in(run), self._health)
        if actions:
            self._on_change(run.id)
        return actions

    def join(self, run_id: str, pid: str, attempt: int, settings: Settings, join_timeout_s: float,
             store: StoreAddress, now: float, node: str = "") -> Reply:
        run = self._run(run_id, now, create=True)
        if run.closed:
            return _closed(run)
        run.last_activity = now
        self.advance(run, now)
        formed = run.formed
        if formed is not None and any(p.id == pid and p.attempt == attempt for p in formed.ranks):
            return self.poll(run_id, pid, formed.number, now)  # a retry of the Join that formed it: same answer
        run.gone.pop(pid, None)
        rnd = run.open
        if rnd is None:
            run.last_number += 1
            rnd = run.open = Round(run.last_number, settings)
            logger.info("rendezvous round opened", run=run_id, round=rnd.number, min_nodes=settings.min_nodes,
                        max_nodes=settings.max_nodes, last_call_s=settings.last_call_s)
        elif rnd.settings != settings:
            have, want = rnd.settings, settings
            raise FailedPrecondition(
                f"round {rnd.number} of rendezvous {run_id!r} was opened with nnodes {have.min_nodes}:{have.max_nodes} "
                f"and last_call_timeout {have.last_call_s:g}s, but {pid} asks for {want.min_nodes}:{want.max_nodes} "
                f"and {want.last_call_s:g}s; give every node the same --nnodes and --rdzv-conf")
        if pid in rnd.waiting:  # a retried Join: keep its place, take the newest store
            p = rnd.waiting[pid]
            p.store, p.attempt, p.last_seen, p.node = store, attempt, now, node
        else:
            rnd.waiting[pid] = Participant(pid, store, run.next_seq, attempt, now + join_timeout_s, now, node)
            run.next_seq += 1
            logger.info("rendezvous participant joined", run=run_id, round=rnd.number, participant=pid,
                        joined=len(rnd.waiting), node=node or None)
        _update_quorum(rnd, now, self._fit_in(run), self._health)
        self._on_change(run_id)
        return self.poll(run_id, pid, rnd.number, now)

    def poll(self, run_id: str, pid: str, number: int, now: float) -> Reply:
        """Where `pid` stands in round `number`; a poll is also the participant's keep-alive."""
        run = self._run(run_id, now)
        run.last_activity = now
        number = _aliased(run, pid, number)
        self.advance(run, now)
        if run.closed:
            return _closed(run)
        formed = run.formed
        if formed is not None and formed.number == number:
            for rank, p in enumerate(formed.ranks):
                if p.id == pid:
                    return Reply(Outcome.FORMED, number, rank=rank, world_size=len(formed.ranks),
                                 store=formed.ranks[0].store)
        dropped = run.gone.get(pid)
        if dropped is not None and dropped.round == number:
            del run.gone[pid]
            if dropped.timed_out:
                return Reply(Outcome.TIMED_OUT, number, message=dropped.reason)
            raise StaleParticipant(dropped.reason)
        rnd = run.open
        if rnd is not None and rnd.number == number and pid in rnd.waiting:
            p = rnd.waiting[pid]
            p.last_seen = now
            why = _unfit(p, self._fit_in(run))
            return Reply(Outcome.WAITING, number, joined=len(rnd.waiting),
                         message=f"node {p.node} is left out of rounds while {why}" if why else "")
        if number == 0 or number > run.last_number:
            raise NotFound(f"rendezvous {run_id!r} has no round {number} (the controller may have restarted); "
                           "join again")
        latest = f"round {formed.number} formed" if formed else "no round formed"
        raise StaleParticipant(f"{pid} is not in round {number} of rendezvous {run_id!r} ({latest}, "
                               f"{rnd.number if rnd else 'none'} open); a participant of an older round cannot take "
                               "part in a newer one without joining again")

    def num_waiting(self, run_id: str, pid: str, number: int, now: float, member: Member | None = None) -> int:
        """Nodes the caller's running group should restart for: everyone waiting in the next round when a
        member of the running round re-joined (it restarted) or there is room to grow; 0 for spares
        waiting on a full group. A caller from a superseded round gets at least 1, so it re-joins.
        A round this book does not know, asked about by a member that says where it stands in it (`member`),
        is re-learned: the controller restarted or took over while the group ran."""
        run = self._runs.get(run_id)
        if member is not None and number and not (run is not None and run.closed):
            run = self._relearn(run_id, run, pid, number, member, now)
        if run is None:
            return 0  # forgotten, e.g. across a controller restart: nothing to say, keep running
        run.last_activity = now
        self.advance(run, now)
        waiting = list(run.open.waiting) if run.open else []
        formed = run.formed
        if formed is None or number > formed.number:
            return 0
        if number < formed.number:
            return max(1, len(waiting))
        if formed.adopted:
            if now < formed.relearned_at + RELEARN_GRACE_S:
                return 0  # the other members, and the workers' reports, are still coming in: judge nothing yet
            missing = formed.declared - len(formed.adopted)
            if missing > 0:  # members that never asked since: lost while the controller was away
                if run.restart_told != formed.number:
                    run.restart_told = formed.number
                    self._restarted(run, "node-lost")
                    self._event("rendezvous.restart", f"round {formed.number} of rendezvous {run.id!r} restarts: "
                                f"{missing} of its {formed.declared} nodes did not ask after the controller restarted "
                                "(lost while it was away)", run.id)
                return max(1, len(waiting))
        if run.restart_told == formed.number:
            return max(1, len(waiting))  # decided: every member restarts, whatever is seen since
        ask = run.ask if run.ask is not None and run.ask.round == formed.number else None
        if ask is None:
            nodes = self._nodes(run, formed)
            if now - formed.judged[0] >= JUDGED_EVERY_S or nodes != formed.judged[1]:  # news of a node: at once
                formed.judged = (now, nodes, *self._judge(run, formed, nodes, now))
            incident = formed.judged[2]
            if incident is not None and incident.kind == "straggler" and self._straggler_held(run, formed, incident,
                                                                                              now):
                incident = None
        else:
            incident = None
        if incident is not None or ask is not None:  # restart: the next round forms from the fit nodes and a spare
            why = ask.why if ask is not None else formed.judged[3]
            if (ask is not None or incident.predictable) and self._checkpoint_first(run, formed, why, now):
                return 0
            run.restart_told = formed.number
            cause = incident or formed.judged[2]  # (judged when the checkpoint was asked)
            self._restarted(run, cause.kind if cause is not None else "crash")
            if cause is not None and cause.kind == "straggler":
                self._evict(run, formed, cause, now)
            hang = incident is not None and incident.kind == "hang"
            self._event("rendezvous.hang" if hang else "rendezvous.restart",
                        f"round {formed.number} of rendezvous {run.id!r} restarts "
                        + (f"(hung): {why}" if hang else f"without {why}")
                        + (f"; {len(waiting)} node(s) waiting to take part" if waiting else "")
                        + (f"; {ask.outcome}" if ask is not None else ""), run.id)
            return max(1, len(waiting))
        members = formed.member_ids()
        if any(w in members for w in waiting) or max(len(members), formed.declared) < formed.settings.max_nodes:
            return len(waiting)
        return 0

    def _relearn(self, run_id: str, run: Run | None, pid: str, number: int, member: Member, now: float) -> Run | None:
        """Take `pid`'s word for its place in round `number` when this book has no such round formed: the first
        member to ask brings the round back, the others join it as they ask."""
        formed = run.formed if run is not None else None
        if formed is not None and formed.number > number:
            return run  # a member of a superseded round: num_waiting tells it to re-join
        if formed is None or formed.number < number:
            if run is None:
                if len(self._runs) >= MAX_RUNS:
                    return None
                run = self._runs[run_id] = Run(run_id, last_activity=now)
            formed = run.formed = Round(number, member.settings, declared=member.world_size, relearned_at=now)
            run.restored = False
            run.left.clear()
            run.restart_told, run.ask = 0, None
            if run.open is not None and run.open.number <= number:  # opened by a spare that re-joined first
                run.aliases[run.open.number] = number + 1
                run.open.number = number + 1
            run.last_number = max(run.last_number, run.open.number if run.open else number)
            logger.info("rendezvous round re-learned", run=run_id, round=number, participant=pid)
            self._event("rendezvous.relearned", f"round {number} of rendezvous {run_id!r} re-learned from its "
                        f"members (this controller did not know it: it restarted or took over); "
                        f"{member.world_size} nodes", run_id)
        if not formed.adopted and formed.ranks:
            return run  # a round this book formed itself: its members are known
        if pid not in formed.adopted:
            formed.adopted[pid] = member.rank
            p = Participant(pid, member.store, run.next_seq, member.attempt, float("inf"), now, member.node)
            run.next_seq += 1
            formed.ranks = sorted([*formed.ranks, p], key=lambda q: formed.adopted[q.id])
        run.last_activity = now
        return run

    def _restarted(self, run: Run, kind: str) -> None:
        run.restarts += 1
        self.incidents[kind] += 1

    def _nodes(self, run: Run, formed: Round) -> tuple[NodeView, ...]:
        """The round's members' nodes as the controller sees them (a node without a Phalanx agent: healthy)."""
        return tuple(self._view(p.node) or NodeView(p.node, False, Health.HEALTHY, "") for p in formed.ranks
                     if p.node and p.id not in run.left)

    def _judge(self, run: Run, formed: Round, views: tuple[NodeView, ...], now: float) -> tuple[Incident | None, str]:
        """What is wrong with the running round, by the rules every job is judged by (detectors.detect), or None,
        and what its restart leaves out, in words: its members' nodes as the controller sees them, its workers'
        progress as their trainlib reported it. Only the workers still reporting are judged: one that stopped has
        exited (torchrun restarts the round) or is stopped, and the round's hang then restarts it in place. A
        drained node, torchrun's own, is predictable."""
        nodes = {v.name: v for v in views}
        live = {r: w for r, w in formed.workers.items() if now - w.heard < WORKER_SILENT_S}
        ranks = [common_pb2.RankInfo(rank=r, node=w.node, state=common_pb2.RANK_STATE_RUNNING)
                 for r, w in sorted(live.items())]
        cfg = self.policy if not formed.settings.hang_s else \
            dataclasses.replace(self.policy, hang_min_s=formed.settings.hang_s,
                                silent_s=min(self.policy.silent_s, formed.settings.hang_s))
        over = {r for r, t in formed.tracks.items() if t.finished}  # any worker's, silent ones too: training ended
        incident = detect(ranks, nodes, {r: formed.tracks[r] for r in live if r in formed.tracks}, now, cfg,
                          over=over)
        if incident is not None and incident.kind == "hang":
            return dataclasses.replace(incident, nodes=()), incident.reason  # no culprit named (the docstring)
        if not over and (incident is None or incident.kind == "straggler"):  # (a drain once training ended: no restart)
            drained = sorted(n for n, v in nodes.items() if v.drained)
            if drained:
                incident = Incident("drained", True, tuple(drained), f"node {drained[0]} is drained")
        if incident is None or (incident.kind == "straggler" and not incident.nodes):
            return None, ""  # (a straggler whose worker did not say its node: nothing to leave out)
        if incident.kind == "straggler":
            return incident, f"node {incident.nodes[0]} ({incident.reason})"
        return incident, "; ".join(f"node {n} ({unfit(nodes[n]) or incident.reason})" for n in incident.nodes)

    def _straggler_held(self, run: Run, formed: Round, incident: Incident, now: float) -> bool:
        """Whether a straggler verdict must wait (lifecycle.straggler_hold, the rule for every job: not beyond
        recovery.straggler_max_evictions in its window, not after an eviction that did not pay off, not without a
        node to take its place: for a torchrun round, a participant waiting); said once in an event."""
        fit = self._fit_in(run)
        waiting = [p.node or p.id for p in run.open.waiting.values() if not _unfit(p, fit)] if run.open else []
        job = common_pb2.Job(id=f"rendezvous {run.id!r}", spares=waiting,
                             straggler_evictions_unix_ns=[int(t * 1e9) for t in run.straggler_evictions],
                             straggler_step_s=run.straggler_step_s)
        held = lifecycle.straggler_hold(job, lifecycle.JobView(nodes={}, tracks=formed.tracks, fleet=True), now,
                                        self.policy)
        if held.startswith("no spare"):
            held = ("no torchrun agent waits to take its node's place (one started beyond --nnodes's maximum): the "
                    "round goes on at its pace until one does")
        if held and run.straggler_held != held.split(" (")[0]:
            run.straggler_held = held.split(" (")[0]
            self._event("rendezvous.straggler_held", f"round {formed.number} of rendezvous {run.id!r}: straggler "
                        f"verdict held back: {incident.reason}: {held}", run.id)
        return bool(held)

    def _evict(self, run: Run, formed: Round, incident: Incident, now: float) -> None:
        """Leave the straggler's node out of the run's later rounds; remember when, for straggler_hold."""
        for node in incident.nodes:
            run.evicted[node] = f"it was evicted from rendezvous {run.id!r} as a straggler: {incident.reason}"
        run.straggler_evictions = [t for t in run.straggler_evictions
                                   if now - t < self.policy.straggler_evictions_window_s] + [now]
        run.straggler_step_s = lifecycle.pace(formed.tracks)[1]
        run.straggler_held = ""

    def _checkpoint_first(self, run: Run, formed: Round, without: str, now: float) -> bool:
        """True while `formed` must not restart yet: its workers are checkpointing (asked now if not yet)."""
        live = [w for w in formed.workers.values() if now - w.heard < WORKER_SILENT_S]
        ask = run.ask if run.ask is not None and run.ask.round == formed.number else None
        if ask is None:
            world = formed.world_size
            if not live or len(live) < world or any(w.step < 0 or w.step_s <= 0 for w in live):
                # No worker reports (its script does not use trainlib), or one has gone silent (its node lost, its
                # process dead): the round's collectives cannot complete, so neither could a checkpoint. Or one has
                # not stepped yet (the round just started): no pace to agree a step by, and nothing to save. At once.
                return False
            self._last_ask_id += 1
            at_step = lifecycle.checkpoint_step({w.rank: formed.tracks[w.rank] for w in live},
                                                self.policy.checkpoint_lead_s + WORKER_REPORT_S, now)
            ask = run.ask = CheckpointAsk(self._last_ask_id, formed.number, at_step, world, now,
                                          without, furthest=max(w.step for w in live))
            self._event("rendezvous.checkpoint", f"round {formed.number} of rendezvous {run.id!r}: {ask.world_size} "
                        f"workers asked to checkpoint after step {ask.at_step} before the round restarts without "
                        f"{without}", run.id)
            return True
        if ask.outcome:
            return False
        done = sum(1 for w in formed.workers.values() if w.done_id == ask.id and w.done_step == ask.at_step)
        if done >= ask.world_size:
            ask.outcome = f"every worker ({done}) committed the checkpoint of step {ask.at_step}"
        elif now >= ask.asked_at + self.policy.checkpoint_deadline_s:
            ask.outcome = (f"only {done} of {ask.world_size} workers committed the checkpoint of step {ask.at_step} "
                           f"within {self.policy.checkpoint_deadline_s:g}s (recovery.checkpoint_deadline_s)")
        elif len(live) < ask.world_size:
            ask.outcome = (f"{ask.world_size - len(live)} of {ask.world_size} workers stopped reporting before the "
                           f"checkpoint of step {ask.at_step} ({done} committed it)")
        elif any(w.done_id == ask.id and w.done_step != ask.at_step for w in live) or ask.furthest > ask.at_step:
            ask.outcome = (f"a worker went past step {ask.at_step} before it heard of the checkpoint (it reached step "
                           f"{ask.furthest}); {done} of {ask.world_size} committed that step")
        else:
            return True
        self._event("rendezvous.checkpointed" if done >= ask.world_size else "rendezvous.checkpoint_failed",
                    f"round {formed.number} of rendezvous {run.id!r}: {ask.outcome} "
                    f"({now - ask.asked_at:.1f}s after the request)", run.id)
        return False

    def report_worker(self, run_id: str, number: int, worker: Worker, now: float) -> CheckpointAsk | None:
        """A worker of round `number` says where it is; the checkpoint it is asked for, if any. A report for a
        round that is not the formed one (a worker torchrun has not stopped yet, a controller that restarted)
        is ignored: its agent hears of the restart through num_waiting."""
        run = self._runs.get(run_id)
        formed = run.formed if run is not None else None
        if run is None or formed is None or formed.number != number:
            return None
        run.last_activity = now
        if not formed.world_size:
            formed.world_size = worker.world_size
        elif worker.world_size != formed.world_size:
            raise FailedPrecondition(f"worker {worker.rank} of round {number} of rendezvous {run_id!r} says the round "
                                     f"has {worker.world_size} workers; its first report said {formed.world_size}")
        formed.workers[worker.rank] = worker  # rank < world_size (the servicer checks): bounded
        track = formed.tracks.get(worker.rank)
        if track is None:
            track = formed.tracks[worker.rank] = RankTrack(last_advance=now)  # started: the start-up allowance runs
        # the steps since its last report: a first report counts one (a round resumed at step 500 has taken a step
        # or so, not 500: its start-up allowance runs over its first WARMUP_STEPS as a job's does); a step whose
        # compute the script did not mark (no trainlib.compute_done()) says nothing of its speed
        steps = (1 if track.last_step < 0 else worker.step - track.last_step) if worker.step > track.last_step else 0
        track.observe(worker.step, worker.step_s, [c for c in worker.compute_s[-MAX_COMPUTE_SAMPLES:] if c > 0], now,
                      steps=steps, saving=worker.saving, step_at=now, finished=worker.finished)
        ask = run.ask
        if ask is None or ask.round != number:
            return None
        ask.furthest = max(ask.furthest, worker.step)
        return ask

    def close(self, run_id: str, now: float) -> None:
        self._close(self._run(run_id, now, create=True), now, by="SetClosed")

    def _close(self, run: Run, now: float, by: str) -> None:
        if not run.closed:
            run.closed = True
            run.last_activity = now
            logger.info("rendezvous closed", run=run.id, by=by)
            self._on_change(run.id)

    def leave(self, run_id: str, pid: str, number: int, close: bool, now: float) -> None:
        """torchrun's shutdown: the participant goes; a participant of another round leaves that one alone."""
        run = self._runs.get(run_id)
        if run is None:
            return
        run.last_activity = now
        number = _aliased(run, pid, number)
        if close:
            self._close(run, now, by=pid)
        if run.open is not None and run.open.number == number and run.open.waiting.pop(pid, None):
            _update_quorum(run.open, now, self._fit_in(run), self._health)
        if run.formed is not None and run.formed.number == number and pid in run.formed.member_ids():
            run.left.add(pid)
        logger.info("rendezvous participant left", run=run_id, round=number, participant=pid, closed=run.closed)
        self._on_change(run_id)
        self._forget_if_finished(run, now)

    def next_wakeup(self, run_id: str) -> float | None:
        """The next moment at which `decide` may change this run: the earliest deadline in its open round."""
        run = self._runs.get(run_id)
        rnd = run.open if run else None
        if rnd is None or run is None or run.closed:
            return None
        times = [t for p in rnd.waiting.values() for t in (p.deadline, p.last_seen + LEASE_S)]
        if rnd.quorum_at is not None:
            times.append(max(rnd.quorum_at + rnd.settings.last_call_s, self._hold_until))
        if rnd.short_since is not None:
            times.append(max(rnd.short_since + READMIT_AFTER_S, self._hold_until))
        return min(times, default=None)

    def sweep(self, now: float) -> None:
        """Forget finished and abandoned runs, so run ids (torchrun's default is "none") can be reused."""
        if now - self._last_sweep < SWEEP_EVERY_S:
            return
        self._last_sweep = now
        for run in list(self._runs.values()):
            self._forget_if_finished(run, now)

    def _forget_if_finished(self, run: Run, now: float) -> None:
        idle = now - run.last_activity
        if run.present() or (run.restored and run.formed is None and run.open is None and not run.closed):
            finished = idle >= IDLE_RUN_TTL_S  # (a restored run: its members may not have found this controller)
        elif run.closed and run.formed is None and run.open is None:
            finished = idle >= CLOSED_RUN_TTL_S  # closed by hand before anyone came: keep it for latecomers
        else:
            finished = True  # everyone left
        if finished:
            self._on_forget(run)
            del self._runs[run.id]
            logger.info("rendezvous forgotten", run=run.id, idle_s=round(idle, 1), closed=run.closed)
            self._on_change(run.id)


def _aliased(run: Run, pid: str, number: int) -> int:
    """The round `pid` means by `number`: its open round, renumbered past a re-learned one, unless it is a member of
    the round that bears the number now."""
    if number not in run.aliases or (run.formed is not None and run.formed.number == number
                                     and pid in run.formed.member_ids()):
        return number
    return run.aliases[number]


def _update_quorum(rnd: Round, now: float, fit: Callable[[str], str] = lambda node: "",
                   health: Callable[[str], str] | None = None) -> None:
    """Start (or stop) the clocks a round forms by: its last call, from when it has its quorum of fit nodes, and,
    while it has that quorum only with nodes evicted from the run as stragglers (`health` finds them fit, `fit` not),
    the wait before they are taken back (READMIT_AFTER_S)."""
    fit_now = sum(1 for p in rnd.waiting.values() if not _unfit(p, fit))
    if fit_now < rnd.settings.min_nodes:
        rnd.quorum_at = None
    elif rnd.quorum_at is None:
        rnd.quorum_at = now
    healthy = fit_now if health is None else sum(1 for p in rnd.waiting.values() if not _unfit(p, health))
    if not fit_now < rnd.settings.min_nodes <= healthy:
        rnd.short_since = None
    elif rnd.short_since is None:
        rnd.short_since = now


def _closed(run: Run) -> Reply:
    return Reply(Outcome.CLOSED, run.open.number if run.open else run.last_number,
                 message=f"rendezvous {run.id!r} is closed (a node finished or shut down); use a new --rdzv-id "
                         "to start another job")


# --- the servicer: validate, call the book, pack ---------------------------------------------------------------
