"""What this controller process sees of one job beside its stored record: the current generation's missing
reports, progress, flight-recorder states and fatal reasons, the launch and checkpoint under way, the stops sent,
the snapshots held and standbys ready on its nodes. The job manager keeps one per job (controller/jobs/manager.py)
and fills it from heartbeats; the executor builds the lifecycle's view from it (controller/recovery/executor.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from controller.recovery import lifecycle
from controller.recovery import progress as monitors
from controller.recovery import snapshots as snapshot_plan
from phalanx.v1 import common_pb2

T = TypeVar("T")

pb = common_pb2


@dataclass
class PendingCheckpoint:
    """One checkpoint request of this process: the acknowledgements so far, and who waits for them."""

    request_id: int
    generation: int
    ranks: int
    acks: dict[int, int] = field(default_factory=dict)  # rank -> committed step
    in_memory: set[int] = field(default_factory=set)  # ranks that committed an in-memory snapshot, replicated
    future: asyncio.Future | None = None  # a user's `phalanx checkpoint` waits on it
    job: str = ""
    request: object = None  # the lifecycle's JobCheckpoint: told again to the nodes it has not reached
    untold: set[str] = field(default_factory=set)  # nodes whose agent it has not reached (not connected then)

    def view(self) -> lifecycle.CheckpointView:
        return lifecycle.CheckpointView(self.request_id, dict(self.acks), len(self.in_memory & set(self.acks)))



@dataclass
class JobEntry:
    job: pb.Job
    revision: int = 0
    # What this process sees of the current generation; reset when the generation changes.
    generation: int = 0
    missing: dict[int, int] = field(default_factory=dict)  # rank -> heartbeats without news of it
    ended: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (state, exit code) its node says,
    # not in the record yet: the lifecycle's step takes it in (ranks_ended), and the next commit stores it
    tracks: dict[int, monitors.RankTrack] = field(default_factory=dict)  # progress, from trainlib's reports
    nccl: dict[int, pb.NcclRankState] = field(default_factory=dict)  # rank -> newest flight-recorder state
    fatal: dict[int, str] = field(default_factory=dict)  # rank -> why it stopped for good
    launch: lifecycle.LaunchView | None = None
    launch_task: asyncio.Task | None = None
    stops: dict[str, tuple | None] = field(default_factory=dict)  # node -> (session, beats, when, command id)
    checkpoint: PendingCheckpoint | None = None
    # trainlib has reported progress for some generation of this job (kept across generations, and stored as
    # Job.progress_reported at the next commit for a controller that restarts or takes over): a request to a new
    # generation waits for its pace rather than saying "at once"
    reported: bool = False
    incident_at: float | None = None  # monotonic time the recovery under way began (this process), for metrics
    incident_kind: str = ""
    # node -> the in-memory snapshots of this job it holds, from its newest heartbeat (kept across generations:
    # a new generation restores from the last one's)
    snapshots: snapshot_plan.Held = field(default_factory=snapshot_plan.Held)
    pinned: tuple[int, int] = (0, 0)  # (generation, step) the job's nodes were last told to keep
    safe: tuple[int, int] | None = None  # (generation, step) of the newest step held twice over, from the heartbeats
    prepared: dict[str, float] = field(default_factory=dict)  # spare -> when (the job manager's now) it was last asked
    # to hold standbys (lifecycle.upkeep)
    standbys: dict[str, int] = field(default_factory=dict)  # node -> warm standbys of the job ready there
    lighthouse_told: str = ""  # replica groups: the lighthouse's URL the job's nodes were last told (their relays)
    lighthouse_untold: set[str] = field(default_factory=set)  # nodes of the job yet to hear it
    # what is derived from the record, by name, with the record it was derived from (recomputed when it changes)
    derived: dict[str, tuple[object, object]] = field(default_factory=dict)

    def of_record(self, name: str, compute: Callable[[common_pb2.Job], T]) -> T:
        """`compute(self.job)`, once per record: the heartbeat path and a stop of every node ask per node."""
        cached = self.derived.get(name)
        if cached is None or cached[0] is not self.job:
            cached = self.derived[name] = (self.job, compute(self.job))
        return cached[1]  # type: ignore[return-value]

    def new_generation(self, generation: int, rebuilt: set[int] | None = None, nodes: set[str] | None = None) -> None:
        """Forget what this process saw of the generation before; with `rebuilt` (a replica group's rebuild), only of
        those ranks, and the stops of the `nodes` they were launched on: the other groups train on."""
        if generation == self.generation:
            return
        if self.launch_task is not None and self.launch is not None and self.launch.generation != generation:
            self.launch_task.cancel()
        self.generation = generation
        if rebuilt:
            self.missing, self.tracks, self.nccl, self.fatal, self.ended = (
                {r: v for r, v in d.items() if r not in rebuilt}
                for d in (self.missing, self.tracks, self.nccl, self.fatal, self.ended))
            self.stops = {n: v for n, v in self.stops.items() if n not in (nodes or set())}
            return  # (a checkpoint under way asked the groups in the quorum: it goes on)
        self.missing, self.tracks, self.nccl, self.fatal, self.stops, self.ended = {}, {}, {}, {}, {}, {}
        self.checkpoint = None
        if self.launch is not None and self.launch.generation != generation:
            self.launch = None

