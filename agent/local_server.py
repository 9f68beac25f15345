"""The agent's Unix-socket service for trainlib inside the ranks (LocalService).

Ranks report their step timings in batches; the agent folds them into one summary per rank per
heartbeat for the controller (straggler and hang detection). The reply to a report carries the
controller's pending checkpoint request for the rank's job, and tells a rank of a stale generation
that it is stale, and hands the rank a slow=F fault injected on its GPU (trainlib stretches its steps).
A rank's "checkpoint committed" goes up to the controller at once. A rank that says it stops for good
(`fatal`) has the reason put on its rank status, which every heartbeat carries.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from agent import unix_socket
from phalanx import log
from phalanx.v1 import local_pb2, local_pb2_grpc, node_pb2

logger = log.get("local")


MAX_SAMPLES = 64  # per rank per heartbeat: enough for straggler statistics, bounded for the controller


@dataclass
class _Progress:
    last_step: int = 0
    steps: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    last_unix_ns: int = 0
    reports: int = 0
    saving: bool = False
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))


@dataclass
class LocalState:
    """What the local service shares with the agent: progress to report, requests to hand out."""

    progress: dict[tuple[str, int, int], _Progress] = field(default_factory=dict)
    requests: dict[str, node_pb2.RequestCheckpoint] = field(default_factory=dict)  # job -> pending request

    def drain(self) -> list[node_pb2.RankProgress]:
        """Progress since the last drain, one entry per rank that reported. A rank silent since then is
        forgotten (ended, or of an old generation): without that every rank ever seen stayed here."""
        out = []
        for key, p in sorted(self.progress.items()):
            job, generation, rank = key
            if not p.reports:
                del self.progress[key]
                continue
            out.append(node_pb2.RankProgress(job=job, generation=generation, rank=rank, last_step=p.last_step,
                                             steps=p.steps, mean_step_s=p.step_s / p.steps if p.steps else 0.0,
                                             mean_compute_s=p.compute_s / p.steps if p.steps else 0.0,
                                             last_step_unix_ns=p.last_unix_ns,
                                             compute_samples=p.samples, reports=p.reports, saving=p.saving))
            p.steps, p.step_s, p.compute_s, p.reports = 0, 0.0, 0.0, 0
            p.samples.clear()
        return out


class LocalService(local_pb2_grpc.LocalServiceServicer):
    def __init__(self, state: LocalState, current_generation: Callable[[str], int | None],
                 send: Callable[[node_pb2.AgentMessage], None],
                 fatal: Callable[[str, int, int, str], bool] = lambda job, generation, rank, reason: False,
                 slow_factor: Callable[[str, int, int], float] = lambda job, generation, rank: 0.0) -> None:
        self._state = state
        self._current = current_generation
        self._send = send
        self._fatal = fatal  # (job, generation, rank, reason) -> whether that rank is known here
        self._slow_factor = slow_factor  # (job, generation, rank) -> the slow=F injected on its GPU, or 0.0

    async def Report(self, request: local_pb2.ReportRequest, context) -> local_pb2.ReportReply:
        key = (request.job, request.generation, request.rank)
        if request.fatal and not self._fatal(request.job, request.generation, request.rank, request.fatal):
            logger.warning("fatal report from a rank this agent does not run; ignored", job=request.job,
                           generation=request.generation, rank=request.rank, reason=request.fatal)
        p = self._state.progress.setdefault(key, _Progress())
        p.reports += 1
        p.saving = request.saving
        for sample in request.steps:
            p.steps += 1
            p.step_s += sample.step_s
            p.compute_s += sample.compute_s
            p.last_step, p.last_unix_ns = sample.step, sample.end_unix_ns
            if sample.compute_s > 0:
                p.samples.append(sample.compute_s)
        reply = local_pb2.ReportReply()
        current = self._current(request.job)
        if current is not None and request.generation < current:
            reply.stale = True
            return reply
        reply.slow_factor = self._slow_factor(request.job, request.generation, request.rank)
        pending = self._state.requests.get(request.job)
        if pending is not None and pending.generation == request.generation:
            reply.checkpoint.CopyFrom(local_pb2.CheckpointRequest(id=pending.request_id, deadline_s=pending.deadline_s,
                                                                  reason=pending.reason, pause=pending.pause,
                                                                  at_step=pending.at_step))
        return reply

    async def CheckpointDone(self, request: local_pb2.CheckpointDoneRequest, context) -> local_pb2.CheckpointDoneReply:
        logger.info("rank committed a checkpoint", job=request.job, rank=request.rank, step=request.step,
                    request_id=request.request_id)
        self._send(node_pb2.AgentMessage(checkpoint_ack=node_pb2.CheckpointAck(
            job=request.job, generation=request.generation, rank=request.rank, request_id=request.request_id,
            step=request.step)))
        return local_pb2.CheckpointDoneReply()


async def serve(path: Path, service: LocalService, group: str = "") -> grpc.aio.Server:
    """Listen on the Unix socket `path` (mode 0660). Raises OSError if it cannot."""
    server = await unix_socket.serve(
        path, lambda s: local_pb2_grpc.add_LocalServiceServicer_to_server(service, s), group)
    logger.info("local service for trainlib serving", socket=str(path))
    return server
