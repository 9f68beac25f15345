"""Incident detection: the most urgent thing wrong with a running job, a pure function of its view and `now`.

Sudden failures (a lost node, a FAILED GPU, a crashed or hung rank) come before predictable ones (a
FAILING GPU, a straggler). A hang names its culprit from the NCCL flight-recorder dumps when they
single one rank out (its last collective), else from whose trainlib fell silent.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from controller.config import RecoveryConfig
from controller.nodes.health import FAILED, FAILING, Health
from controller.recovery import progress as monitors
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb


@dataclass(frozen=True)
class NodeView:
    """What recovery knows of one of the job's nodes (its own or a spare)."""

    name: str
    down: bool
    health: Health
    health_reason: str
    connected: bool = True
    drained: bool = False
    drain_reason: str = ""  # why, when drained (an operator's or an eviction's words)
    # (how far the job's stop has got on it: JobView.told, .stopped and .running)
    quiet: bool = False  # its heartbeats are late (over 1.5 intervals): its ranks' progress cannot arrive either
    heard_at: float = 0.0  # when its agent was last heard from, on the clock of `now` and the rank tracks (the
    # job manager's wall-clock seconds); 0.0: unknown, taken as now
    own_work_at: float = 0.0  # when (same clock) its heartbeat last showed Phalanx's own work there (standbys
    # starting); 0.0: never


KINDS = ("node-lost", "gpu-failed", "crash", "hang", "gpu-failing", "straggler")


@dataclass(frozen=True)
class Incident:
    kind: str  # one of KINDS, or "resumed" (a recovery a previous controller process began)
    predictable: bool  # checkpoint before evicting
    nodes: tuple[str, ...]  # to take out of the job (and drain); empty = restart in place
    reason: str
    exit_code: int = 1  # the job's exit code if this incident ends it (a crashed rank's own code)
    culprit: pb.HangCulprit | None = None  # a hang's rank and last collective, from the NCCL dumps
    fatal: bool = False  # no restart mends it (a rank said so): the job fails at once
    ranks: tuple[int, ...] = ()  # the ranks it is about, where it names them (a crash, a hang's culprit, a straggler)




def nccl_culprit(nccl: Mapping[int, pb.NcclRankState], node_of: Mapping[int, str]) -> pb.HangCulprit | None:
    """The rank the flight-recorder dumps single out: in the process group where the ranks disagree, the one
    furthest behind — it never entered the collective its peers wait in (fewest started), or, if all entered
    it, the one that did not finish it (fewest completed). None when the dumps agree, or fewer than two ranks
    dumped."""
    groups: dict[str, dict[int, pb.NcclRankState]] = {}
    for rank, state in nccl.items():
        groups.setdefault(state.process_group, {})[rank] = state
    best = None
    for group, states in sorted(groups.items()):
        if len(states) < 2:
            continue
        progress = {rank: (s.last_started_seq, s.last_completed_seq) for rank, s in states.items()}
        rank = min(progress, key=lambda r: (progress[r], r))
        newest = max(progress.values())
        if progress[rank] == newest:
            continue
        behind = states[rank]
        peers = newest[0] if newest[0] > behind.last_started_seq else newest[1]
        gap = peers - (behind.last_started_seq if newest[0] > behind.last_started_seq else behind.last_completed_seq)
        if best is None or gap > best[0]:
            best = (gap, pb.HangCulprit(rank=rank, node=node_of.get(rank, ""), process_group=group, op=behind.last_op,
                                        seq=behind.last_started_seq, state=behind.last_state, peers_seq=peers))
    return best[1] if best else None


def describe_culprit(c: pb.HangCulprit) -> str:
    return (f"rank {c.rank} on {c.node} is stuck at collective {c.seq} ({c.op or 'unknown op'}, {c.state or 'no state'}"
            f", process group {c.process_group or '?'}) while its peers reached {c.peers_seq}")


def detect(ranks: Iterable[pb.RankInfo], nodes: Mapping[str, NodeView], tracks: Mapping[int, monitors.RankTrack],
           now: float, cfg: RecoveryConfig, nccl: Mapping[int, pb.NcclRankState] | None = None,
           fatal: Mapping[int, str] | None = None, over: set[int] | None = None, since: float = 0.0,
           odd: Sequence[pb.RankInfo] | None = None, names: Collection[str] | None = None,
           unwell: AbstractSet[str] | None = None) -> Incident | None:
    """The most urgent thing wrong with a running job, or None. Sudden failures come first; a rank that
    said no restart can mend it comes before everything. `over`: training_over(ranks, tracks), when the caller
    has it already. `since`: no hang counted from before it (the ranks' quorum changed then). `odd`: unsettled(ranks),
    when the caller has it already. `names`: the nodes that count, where `nodes` has views of others too (a job's
    spares; replica groups out of the quorum); one of them without a view counts as lost. `unwell`: of `nodes`, the
    names of those whose view is `unwell`, where the caller keeps them (it then has a view of every node that counts):
    the few looked at, not every node's view."""
    ranks = ranks if isinstance(ranks, Sequence) else list(ranks)
    odd = unsettled(ranks) if odd is None else odd
    for rank, why in sorted((fatal or {}).items()):
        node = "?"
        for r in ranks:  # (the last with that number, as a map of them would say)
            if r.rank == rank:
                node = r.node
        return Incident("crash", False, (), f"rank {rank} on {node} stopped for good: {why}", fatal=True)
    # One pass over the nodes (a job of 16,384 nodes is judged at every step): the few that are not well, sorted
    get, among = nodes.get, names is not None
    if names is None:
        names = nodes.keys()
    if unwell is not None:
        sick = {n: nodes[n] for n in unwell if not among or n in names}
    else:
        sick = {n: v for n in names if is_unwell(v := get(n) or _unknown(n))}
    unwell = sorted(sick.items())
    lost = [n for n, v in unwell if v.down]
    if lost:
        return Incident("node-lost", False, tuple(lost), f"node {', '.join(lost)} lost")
    failed = [n for n, v in unwell if v.health >= FAILED]
    if failed:
        return Incident("gpu-failed", False, tuple(failed),
                        f"node {failed[0]} FAILED: {sick[failed[0]].health_reason}")
    over = training_over(odd, tracks) if over is None else over
    for rank in odd:
        if rank.state == pb.RANK_STATE_LOST or (rank.state == pb.RANK_STATE_EXITED and rank.exit_code != 0):
            if rank.rank in over and rank.state == pb.RANK_STATE_EXITED and rank.exit_code < 0:
                continue  # killed by a signal in its teardown after its training ended: once every rank has ended
                # training, lifecycle says so and the job's result stands; until then the other ranks decide
            # (a rank that said its training ended and then exits non-zero by itself, while some other rank has not
            # ended training, is a crash like any other: a script whose collective failed when a peer died may well
            # destroy its process group on the way out)
            how = "was lost" if rank.state == pb.RANK_STATE_LOST else f"exited with code {rank.exit_code}"
            code = rank.exit_code if rank.state == pb.RANK_STATE_EXITED and 0 < rank.exit_code < 256 else 1
            return Incident("crash", False, (), f"rank {rank.rank} on {rank.node} {how}", code, ranks=(rank.rank,))
    if over:
        return None  # the job's training has ended (a synchronous job's ranks all took the last step): its ranks are
        # tearing down, saving the final model, exiting; lifecycle bounds how long (recovery.exit_grace_s)
    hangs = monitors.hung(tracks, now, cfg, since)
    # (the verdicts on progress read the views of the nodes that count, each of which has one by now: the ranks' and
    # tracks' nodes are among them)
    if hangs and any(nodes[n].quiet for n in names):
        hangs = []  # a node whose agent is silent sends no progress: liveness decides about it first
    node_of = {r.rank: r.node for r in ranks} if hangs else {}
    if hangs:
        culprit = nccl_culprit(nccl or {}, node_of)
        if culprit is not None:
            return Incident("hang", False, (culprit.node,) if culprit.node else (),
                            f"{hangs[0].reason}; the NCCL flight recorder says {describe_culprit(culprit)}",
                            culprit=culprit, ranks=(culprit.rank,))
        heard = {r.rank: nodes[r.node].heard_at or now for r in ranks if r.node in nodes}
        silent = monitors.culprits(tracks, heard, now, cfg.silent_s)
        if silent and len(silent) == len(ranks) > 1:
            return Incident("hang", False, (), f"{hangs[0].reason}; every rank's trainlib fell silent at once (no "
                                               "culprit: the job's own doing, not a node's): restart in place")
        if silent:
            bad = tuple(sorted({node_of[r] for r in silent if r in node_of}))
            quiet = ", ".join(f"rank {r} for {now - tracks[r].last_report:.1f}s" for r in silent)
            return Incident("hang", False, bad, f"{hangs[0].reason}; trainlib is silent too (on {', '.join(bad)}): "
                                                f"{quiet}", ranks=tuple(sorted(silent)))
        known = {r.rank: nodes[r.node].heard_at for r in ranks if r.node in nodes and nodes[r.node].heard_at}
        if monitors.undecided(tracks, known, now, cfg.silent_s):
            return None  # a silent rank's node is due to be heard from: its next heartbeat names the culprit
        return Incident("hang", False, (), f"{hangs[0].reason}; every rank is stuck and none is silent: restart in "
                                           "place")
    failing = [n for n, v in unwell if v.health >= FAILING]
    if failing:
        return Incident("gpu-failing", True, tuple(failing),
                        f"node {failing[0]} FAILING: {sick[failing[0]].health_reason}")
    slow = monitors.stragglers(tracks, cfg)
    if slow:  # not one on a node where Phalanx started standbys within the window: it may be slow from that work
        node_of = _nodes_of(ranks, {f.rank for f in slow})
        span = cfg.straggler_window * monitors.job_step_s(tracks) + OWN_WORK_MARGIN_S  # the time the verdict sees
        slow = [f for f in slow if not (v := nodes.get(node_of.get(f.rank, ""))) or now - v.own_work_at > span]
    if slow:
        node = node_of.get(slow[0].rank, "")
        return Incident("straggler", True, (node,) if node else (), f"{slow[0].reason} (on {node})",
                        ranks=(slow[0].rank,))
    return None


# Beyond the straggler window's own span, how long after Phalanx's own work on a node (standbys starting) its ranks'
# compute times are still not held against it: the heartbeat that shows the work comes up to an interval late.
OWN_WORK_MARGIN_S = 2.0


def _nodes_of(ranks: Sequence[pb.RankInfo], wanted: set[int]) -> dict[int, str]:
    """rank -> node of the `wanted` ranks: where `ranks` are in rank order (rank r at r: lifecycle.rank_table) read
    there, else found in one pass."""
    table = getattr(ranks, "whole", ranks)  # stretches of a rank table (lifecycle.quorum's): the table they are of
    if all(0 <= r < len(table) and table[r].rank == r for r in wanted):
        return {r: table[r].node for r in wanted}
    return {r.rank: r.node for r in ranks if r.rank in wanted}


def is_unwell(view: NodeView) -> bool:
    """The node is lost (down) or its GPUs FAILING or worse: what the verdicts on nodes are about."""
    return view.down or view.health >= FAILING


def _unknown(name: str) -> NodeView:
    """The view of a node of the job that recovery has none of (its registration is gone): lost."""
    return NodeView(name, True, FAILED, "node unknown")


def unsettled(ranks: Sequence[pb.RankInfo]) -> list[pb.RankInfo]:
    """The ranks not RUNNING (not started yet, exited, lost), in order: what the verdicts on rank states read. A search
    in C over a job's ranks' states, for the few (a job of 16,384 ranks is judged at every step, nearly always with
    none)."""
    return ranktable.where(ranks, pb.RANK_STATE_RUNNING, equal=False)


def training_over(ranks: Iterable[pb.RankInfo], tracks: Mapping[int, monitors.RankTrack]) -> set[int]:
    """The ranks whose training has ended: trainlib said so (no step since), or the rank exited 0. In a synchronous
    job one such rank means every rank took the last step: what is left (a barrier, a final save, the process group's
    teardown, the interpreter's exit) makes no step progress and is no hang."""
    return {r.rank for r in ranks if r.state == pb.RANK_STATE_EXITED and r.exit_code == 0} | \
        {rank for rank, t in tracks.items() if t.finished}


def backoff(restarts: int, cfg: RecoveryConfig) -> float:
    """Seconds to wait before restart number `restarts + 1`."""
    return cfg.restart_backoff_s * (2 ** min(restarts, 10))
