"""The job and rank state tables: the single place where a job's or a rank's state may change.

    PENDING -> STARTING        placed; its launch goes to the agents
    PENDING -> FAILED          bound to a Slurm allocation too short of usable nodes to run it
    STARTING -> RUNNING        every node started its ranks
    RUNNING -> CHECKPOINTING   a predictable failure: a FAILING GPU, a straggler (with a deadline)
    RUNNING -> EVICTING        a sudden one: a lost node, a FAILED GPU, a crashed or hung rank
    CHECKPOINTING -> EVICTING  every rank committed, or the deadline passed
    EVICTING -> RENDEZVOUS     the generation's ranks are gone; bad nodes drained
    RENDEZVOUS -> RESTARTING   the next generation's nodes are chosen (a spare first)
    RESTARTING -> RUNNING      its ranks run; they resume from the newest complete checkpoint
    STARTING/RESTARTING -> EVICTING   the launch failed, or a controller restart lost it
    any active state -> CANCELLING -> CANCELLED;  -> SUCCEEDED / FAILED as the ranks end
"""

from __future__ import annotations

from controller.errors import IllegalTransition
from phalanx.v1 import common_pb2 as pb

PENDING, STARTING, RUNNING = pb.JOB_STATE_PENDING, pb.JOB_STATE_STARTING, pb.JOB_STATE_RUNNING
CHECKPOINTING, EVICTING = pb.JOB_STATE_CHECKPOINTING, pb.JOB_STATE_EVICTING
RENDEZVOUS, RESTARTING = pb.JOB_STATE_RENDEZVOUS, pb.JOB_STATE_RESTARTING
CANCELLING, CANCELLED = pb.JOB_STATE_CANCELLING, pb.JOB_STATE_CANCELLED
SUCCEEDED, FAILED = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED

TRANSITIONS: dict[int, frozenset[int]] = {
    PENDING: frozenset({STARTING, CANCELLED, FAILED}),
    STARTING: frozenset({RUNNING, EVICTING, FAILED, CANCELLING}),
    RUNNING: frozenset({CHECKPOINTING, EVICTING, SUCCEEDED, FAILED, CANCELLING}),
    CHECKPOINTING: frozenset({EVICTING, CANCELLING, SUCCEEDED, FAILED}),
    EVICTING: frozenset({RENDEZVOUS, CANCELLING, FAILED}),
    RENDEZVOUS: frozenset({RESTARTING, CANCELLING, FAILED}),
    RESTARTING: frozenset({RUNNING, EVICTING, FAILED, CANCELLING}),
    CANCELLING: frozenset({CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}

RECOVERING = frozenset({CHECKPOINTING, EVICTING, RENDEZVOUS, RESTARTING})
ACTIVE = frozenset({STARTING, RUNNING, CANCELLING}) | RECOVERING
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
LAUNCHING = frozenset({STARTING, RESTARTING})


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_STATE_")


def check(job: str, source: int, target: int) -> None:
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(f"job {job}", state_name(source), state_name(target))


# A rank of one generation: launched (UNSPECIFIED until its node says it runs), then RUNNING, then it
# ends, EXITED with a code or LOST with its node or its reports. An ended rank never runs again: a
# restart is a new generation with a new rank table.
RANK_UNKNOWN, RANK_RUNNING = pb.RANK_STATE_UNSPECIFIED, pb.RANK_STATE_RUNNING
RANK_EXITED, RANK_LOST = pb.RANK_STATE_EXITED, pb.RANK_STATE_LOST

RANK_TRANSITIONS: dict[int, frozenset[int]] = {
    RANK_UNKNOWN: frozenset({RANK_RUNNING, RANK_EXITED, RANK_LOST}),
    RANK_RUNNING: frozenset({RANK_EXITED, RANK_LOST}),
    RANK_EXITED: frozenset(),
    RANK_LOST: frozenset({RANK_EXITED}),  # its node came back and told how it ended
}


def rank_state_name(state: int) -> str:
    return pb.RankState.Name(state).removeprefix("RANK_STATE_")


def check_rank(job: str, rank: int, source: int, target: int) -> None:
    if target not in RANK_TRANSITIONS[source]:
        raise IllegalTransition(f"job {job} rank {rank}", rank_state_name(source), rank_state_name(target))


def rank_may_move(source: int, target: int) -> bool:
    return source == target or target in RANK_TRANSITIONS[source]
