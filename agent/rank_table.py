"""A rank's record on its node, as a table (issue 41): the states it passes through and what the supervisor does
at each look (`Supervisor.poll`), decided here without I/O.

    RUNNING --its process is gone, an exit code known--> EXITED --kept KEEP_EXITED_S--> (dropped)
    RUNNING --its process is gone, no code anywhere----> LOST   --kept KEEP_EXITED_S--> (dropped)

A parked rank (trainlib.run) ends its generation's record as EXITED while its process lives on to rejoin the next
generation (`Supervisor.park`); what the supervisor does about a record's process, its cgroup and its files is the
actions' I/O, each guarded in `poll` so that one failing action fails that rank's look, never the others' nor the
heartbeat.

The node's other decisions about ranks are here too, as pure functions of what it knows: whether a launch goes
ahead, and whether its ranks may start from standbys (`admit`: generation fencing, a rank already running, the
node's own account policy, limits it cannot enforce); whether a rank may wait to rejoin (`may_park`); and what a
stop of a job's generation fences, stops and releases (`stop_plan`).
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


@dataclass(frozen=True)
class LaunchAsk:
    """What a launch asks of this node, with what the node knows, for `admit`."""

    job: str
    generation: int
    has_command: bool = True
    stopped: int = 0  # the newest generation of the job this node was told to stop (0: none)
    running: tuple[int, ...] = ()  # of the launch's ranks, those that already run here in that generation
    account_refusal: str = ""  # the node's own policy on the account the job runs as ("": allowed)
    as_account: bool = False  # the ranks run as an account of their own (not the agent's user)
    limits: bool = False  # memory or task limits: only a cgroup of the rank's own enforces them
    open_files: bool = False  # an open-files limit (set on the process, no cgroup needed)
    no_cgroups: str = ""  # why ranks cannot have a cgroup here ("": they can)
    warm_pool: bool = False  # warm starts are on here


@dataclass(frozen=True)
class Admission:
    refusal: str = ""  # why the launch is refused ("": it goes ahead)
    warm: bool = False  # its ranks may be handed to standbys, started ahead as the agent's user in no cgroup


def admit(ask: LaunchAsk) -> Admission:
    """Whether a launch goes ahead, and how its ranks start. A generation at or below one this node was told to
    stop is refused (fencing: a launch a dead controller sent before its stop must not start beside the next
    generation); so is a rank already running, an account the node's own policy refuses, and limits the node
    cannot enforce. Standbys run the job's code as the agent's user with no cgroup of their own, so a job that runs
    as an account or has limits starts cold."""
    if not ask.has_command:
        return Admission("no command to run")
    if ask.generation <= ask.stopped:
        return Admission(f"{ask.job} generation {ask.generation} was told to stop here (generation {ask.stopped}); "
                         "a launch of it is refused")
    if ask.running:
        return Admission(f"rank {ask.running[0]} of {ask.job} generation {ask.generation} already runs")
    if ask.account_refusal:
        return Admission(f"{ask.job}: {ask.account_refusal}")
    if ask.limits and ask.no_cgroups:
        return Admission(f"{ask.job} limits its ranks' memory or tasks, but this node cannot give ranks a cgroup: "
                         f"{ask.no_cgroups}")
    return Admission(warm=ask.warm_pool and not ask.as_account and not (ask.limits or ask.open_files))


def may_park(job: str, generation: int, rank: int, alive: bool, rank_pid: int, pid: int) -> str:
    """Why rank `rank`'s process (`pid`) may not wait here to rejoin the next generation, or "": its generation's
    record must be running here, and the caller must be that rank's own process when the node knows it."""
    if not alive:
        return f"rank {rank} of {job} generation {generation} does not run here"
    if rank_pid and pid != rank_pid:
        return f"pid {pid} is not rank {rank}'s process (pid {rank_pid})"
    return ""


@dataclass(frozen=True)
class StopPlan:
    stopped: int  # the job's newest generation told to stop here, after this stop (fencing)
    targets: tuple[str, ...]  # the keys of the live ranks to stop
    release: tuple[int, ...]  # the parked ranks told to exit rather than rejoin (the job is over here)


def stop_plan(job: str, generation: int, stopped: int, live: list[tuple[str, str, int]],
              parked: list[tuple[str, int]]) -> StopPlan:
    """A stop of `job`'s `generation` (0: every generation: the job is over here). `live`: (key, job, generation)
    of the ranks running here; `parked`: (job, rank) of the processes waiting to rejoin."""
    return StopPlan(max(stopped, generation),
                    tuple(key for key, j, g in live if j == job and (generation == 0 or g == generation)),
                    tuple(rank for j, rank in parked if j == job) if generation == 0 else ())
