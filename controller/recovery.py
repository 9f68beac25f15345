"""Per-job recovery: what went wrong (a pure detector) and the one transition table of job states.

    RUNNING -> CHECKPOINTING   a predictable failure: a FAILING GPU, a straggler (with a deadline)
    RUNNING -> EVICTING        a sudden one: a lost node, a FAILED GPU, a crashed or hung rank
    CHECKPOINTING -> EVICTING  every rank committed, or the deadline passed
    EVICTING -> RENDEZVOUS     the generation's ranks are gone; bad nodes drained
    RENDEZVOUS -> RESTARTING   the next generation's nodes are chosen (a spare first)
    RESTARTING -> RUNNING      its ranks run; they resume from the newest complete checkpoint
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from controller import monitors
from controller.config import RecoveryConfig
from controller.errors import IllegalTransition
from controller.health import FAILED, FAILING, Health
from phalanx.v1 import common_pb2 as pb

TRANSITIONS: dict[int, frozenset[int]] = {
    pb.JOB_STATE_PENDING: frozenset({pb.JOB_STATE_STARTING, pb.JOB_STATE_CANCELLED}),
    pb.JOB_STATE_STARTING: frozenset({pb.JOB_STATE_RUNNING, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLING}),
    pb.JOB_STATE_RUNNING: frozenset({pb.JOB_STATE_CHECKPOINTING, pb.JOB_STATE_EVICTING, pb.JOB_STATE_SUCCEEDED,
                                     pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLING}),
    pb.JOB_STATE_CHECKPOINTING: frozenset({pb.JOB_STATE_EVICTING, pb.JOB_STATE_CANCELLING, pb.JOB_STATE_SUCCEEDED}),
    pb.JOB_STATE_EVICTING: frozenset({pb.JOB_STATE_RENDEZVOUS, pb.JOB_STATE_CANCELLING, pb.JOB_STATE_FAILED}),
    pb.JOB_STATE_RENDEZVOUS: frozenset({pb.JOB_STATE_RESTARTING, pb.JOB_STATE_CANCELLING, pb.JOB_STATE_FAILED}),
    pb.JOB_STATE_RESTARTING: frozenset({pb.JOB_STATE_RUNNING, pb.JOB_STATE_EVICTING, pb.JOB_STATE_CANCELLING}),
    pb.JOB_STATE_CANCELLING: frozenset({pb.JOB_STATE_CANCELLED}),
    pb.JOB_STATE_SUCCEEDED: frozenset(),
    pb.JOB_STATE_FAILED: frozenset(),
    pb.JOB_STATE_CANCELLED: frozenset(),
}


def check(job: str, source: int, target: int) -> None:
    if target not in TRANSITIONS[source]:
        name = pb.JobState.Name
        raise IllegalTransition(f"job {job}", name(source).removeprefix("JOB_STATE_"),
                                name(target).removeprefix("JOB_STATE_"))


@dataclass(frozen=True)
class NodeView:
    """What recovery needs to know of one of the job's nodes."""

    name: str
    down: bool
    health: Health
    health_reason: str


KINDS = ("node-lost", "gpu-failed", "crash", "hang", "gpu-failing", "straggler")


@dataclass(frozen=True)
class Incident:
    kind: str  # one of KINDS, or "resumed" (a recovery a previous controller process began)
    predictable: bool  # checkpoint before evicting
    nodes: tuple[str, ...]  # to take out of the job (and drain); empty = restart in place
    reason: str
    exit_code: int = 1  # the job's exit code if this incident ends it (a crashed rank's own code)


SILENT_S = 3.0  # a rank's trainlib reports twice a second; three seconds of silence means it is stopped


def detect(ranks: Iterable[pb.RankInfo], nodes: dict[str, NodeView], tracks: dict[int, monitors.RankTrack],
           now: float, cfg: RecoveryConfig) -> Incident | None:
    """The most urgent thing wrong with a running job, or None. Sudden failures come first."""
    ranks = list(ranks)
    node_of = {r.rank: r.node for r in ranks}
    lost = sorted(n for n, v in nodes.items() if v.down)
    if lost:
        return Incident("node-lost", False, tuple(lost), f"node {', '.join(lost)} lost")
    failed = sorted(n for n, v in nodes.items() if v.health >= FAILED)
    if failed:
        return Incident("gpu-failed", False, tuple(failed),
                        f"node {failed[0]} FAILED: {nodes[failed[0]].health_reason}")
    for rank in ranks:
        if rank.state == pb.RANK_STATE_LOST or (rank.state == pb.RANK_STATE_EXITED and rank.exit_code != 0):
            how = "was lost" if rank.state == pb.RANK_STATE_LOST else f"exited with code {rank.exit_code}"
            code = rank.exit_code if rank.state == pb.RANK_STATE_EXITED and 0 < rank.exit_code < 256 else 1
            return Incident("crash", False, (), f"rank {rank.rank} on {rank.node} {how}", code)
    hangs = monitors.hung(tracks, now, cfg)
    if hangs:
        silent = monitors.culprits(hangs, tracks, now, SILENT_S)
        if silent:
            bad = tuple(sorted({node_of[r] for r in silent if r in node_of}))
            first = next(f for f in hangs if f.rank == silent[0])
            return Incident("hang", False, bad, f"{first.reason}; its trainlib is silent too (on {', '.join(bad)})")
        return Incident("hang", False, (), f"{hangs[0].reason}; every rank is stuck and none is silent: restart in "
                                           "place")
    failing = sorted(n for n, v in nodes.items() if v.health >= FAILING)
    if failing:
        return Incident("gpu-failing", True, tuple(failing),
                        f"node {failing[0]} FAILING: {nodes[failing[0]].health_reason}")
    slow = monitors.stragglers(tracks, cfg)
    if slow:
        node = node_of.get(slow[0].rank, "")
        return Incident("straggler", True, (node,) if node else (), f"{slow[0].reason} (on {node})")
    return None


def backoff(restarts: int, cfg: RecoveryConfig) -> float:
    """Seconds to wait before restart number `restarts + 1`."""
    return cfg.restart_backoff_s * (2 ** min(restarts, 10))
