"""A rank's record on its node, as a table (issue 41): the states it passes through and what the supervisor does
at each look (`Supervisor.poll`), decided here without I/O.

    RUNNING --its process is gone, an exit code known--> EXITED --kept KEEP_EXITED_S--> (dropped)
    RUNNING --its process is gone, no code anywhere----> LOST   --kept KEEP_EXITED_S--> (dropped)

A parked rank (trainlib.run) ends its generation's record as EXITED while its process lives on to rejoin the next
generation (`Supervisor.park`); what the supervisor does about a record's process, its cgroup and its files is the
actions' I/O, each guarded in `poll` so that one failing action fails that rank's look, never the others' nor the
heartbeat.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RankState(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"  # its process is gone and nothing says how it ended (no exit file, no wrapper's status)


TRANSITIONS: dict[RankState, frozenset[RankState]] = {
    RankState.RUNNING: frozenset({RankState.EXITED, RankState.LOST}),
    RankState.EXITED: frozenset(),
    RankState.LOST: frozenset(),
}


class Action(enum.Enum):
    LEARN_RANK_PID = "learn_rank_pid"  # the wrapper's pid file names the rank's own process
    END = "end"  # record how it ended (the state's exit code, or lost) and when; stop its slowness; save
    CLEAR_CGROUP = "clear_cgroup"  # kill what it left in its cgroup and remove the cgroup (once its process is gone)
    DROP = "drop"  # forget it: its record, exit and pid files


@dataclass(frozen=True)
class Seen:
    """What one look at a rank's record found."""

    alive: bool  # its process runs (for a RUNNING record)
    exit_code: int | None = None  # its wrapper's exit file, else the wrapper's own status; None = neither
    age_s: float = 0.0  # since it ended (for an ended record)
    has_cgroup: bool = False
    knows_rank_pid: bool = False


def state_of(exit_code: int | None, lost: bool) -> RankState:
    return RankState.LOST if lost else RankState.EXITED if exit_code is not None else RankState.RUNNING


def decide(state: RankState, seen: Seen, keep_s: float) -> tuple[RankState, tuple[Action, ...]]:
    """The record's next state and the actions of this look, in order."""
    if state is not RankState.RUNNING:  # ended: kept a while (the controller hears of it), then forgotten
        if seen.age_s > keep_s:
            return state, (Action.DROP,)
        return state, (Action.CLEAR_CGROUP,) if seen.has_cgroup else ()
    learn = () if seen.knows_rank_pid else (Action.LEARN_RANK_PID,)
    if seen.alive:
        return state, learn
    ended = RankState.EXITED if seen.exit_code is not None else RankState.LOST
    return ended, (*learn, Action.END, Action.CLEAR_CGROUP)


def check(source: RankState, target: RankState) -> None:
    if source is not target and target not in TRANSITIONS[source]:
        raise ValueError(f"a rank cannot go from {source.value} to {target.value}")
