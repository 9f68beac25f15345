"""trainlib in a worker that torchrun started with Phalanx's rendezvous (`--rdzv-backend=phalanx`).

Such a worker has no Phalanx agent of its own to talk to: torchrun launched it, not Phalanx. The plugin
(trainlib.torchrun_plugin) leaves the round it formed in the environment torchrun hands its workers
(PHALANX_RDZV_RUN, PHALANX_RDZV_ROUND, PHALANX_RDZV_ENDPOINT), and trainlib's reporter thread tells the
controller's rendezvous service where the worker is, twice a second (ReportWorker). The reply is how the
controller asks the round to checkpoint before it restarts without an unfit node (and how it sees a hang:
a step that stops going up while the reporter goes on): every worker saves the same
agreed step, says so in its next report, and takes no step after it; the controller then lets torchrun restart
the round. The per-step hook is untouched: the reporter only reads what it wrote.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

REPORT_INTERVAL_S = 0.5  # controller.rendezvous.book.WORKER_REPORT_S assumes this
RPC_TIMEOUT_S = 2.0

RUN_ENV, ROUND_ENV, ENDPOINT_ENV = "PHALANX_RDZV_RUN", "PHALANX_RDZV_ROUND", "PHALANX_RDZV_ENDPOINT"


@dataclass(frozen=True)
class WorkerRound:
    run_id: str
    round: int
    rank: int
    world_size: int
    node: str
    targets: tuple[str, ...]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerRound | None:
        """The round this worker belongs to, or None when torchrun with Phalanx's rendezvous did not start it."""
        run_id, number, endpoint = env.get(RUN_ENV, ""), env.get(ROUND_ENV, ""), env.get(ENDPOINT_ENV, "")
        if not (run_id and number.isdigit() and endpoint and env.get("TORCHELASTIC_RUN_ID")):
            return None
        rank, world = env.get("RANK", "0"), env.get("WORLD_SIZE", "1")
        if not (rank.isdigit() and world.isdigit()):
            return None
        return cls(run_id, int(number), int(rank), int(world), env.get("PHALANX_NODE", ""),
                   tuple(t for t in endpoint.split(",") if t))


Progress = Callable[[], tuple[int, float, bool, bool, list[float]]]  # -> (the last step done or -1, the recent
# median step time or 0, whether trainlib.save is writing, whether training has ended, the compute time of each step
# since the last call)
Heed = Callable[[int, int, bool], None]      # (request id, at step, pause) -> trainlib's checkpoint request


class Reporter:
    """The worker's reports to the controller, on a daemon thread, for the life of the process."""

    def __init__(self, rnd: WorkerRound, progress: Progress, heed: Heed) -> None:
        self.round = rnd
        self._progress = progress
        self._heed = heed
        self._done = (0, -1)  # (request id, step) committed
        self._wake = threading.Event()
        self._sent = threading.Condition()
        self._started = self._ended = 0  # reports begun, and reports answered or failed (one at a time, in order)
        self._thread = threading.Thread(target=self._loop, name="trainlib-rdzv-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def done(self, request_id: int, step: int) -> None:
        """This worker committed `step` for `request_id`: report it now rather than at the next interval."""
        self._done = (request_id, step)
        self._wake.set()

    def report_now(self, timeout_s: float = RPC_TIMEOUT_S) -> None:
        """Report at once and wait (at most `timeout_s`) until that report has gone: the end of training is said
        before the teardown and the exit, which a later report would miss."""
        if not self._thread.is_alive():  # it could not reach the controller at all (said at its start)
            return
        with self._sent:
            mark = self._started + 1  # not one under way, which may have read the progress before the change
            self._wake.set()
            self._sent.wait_for(lambda: self._ended >= mark, timeout_s)

    def _loop(self) -> None:
        from phalanx.leader import Follower
        from phalanx.rpc import CLIENT_OPTIONS
        from phalanx.tls import ClientSecurity
        from phalanx.v1 import rendezvous_pb2_grpc

        rnd = self.round
        try:  # the same credentials as the torchrun agent's plugin (PHALANX_CA/CERT/KEY/TOKEN, PHALANX_INSECURE)
            security = ClientSecurity.from_env()
            controllers = Follower(rnd.targets, lambda address: security.channel(address, CLIENT_OPTIONS))
        except Exception as e:
            print(f"trainlib: cannot report to the Phalanx controller at {','.join(rnd.targets)} ({e}); "
                  "this worker will not be asked to checkpoint before a restart", file=sys.stderr, flush=True)
            return
        warned = False
        while True:
            self._wake.wait(REPORT_INTERVAL_S)
            self._wake.clear()
            with self._sent:
                self._started += 1
            try:
                reply = controllers.call(lambda channel: rendezvous_pb2_grpc.RendezvousServiceStub(channel)
                                         .ReportWorker(self._request(), timeout=RPC_TIMEOUT_S), follow_s=0.0)
                warned = False
                if reply.checkpoint_id:  # in the try: a script's on_checkpoint_request callback may raise
                    self._heed(reply.checkpoint_id, reply.at_step, reply.pause)
            except Exception as e:  # a controller restarting or changing leader: keep training, try again
                if not warned:
                    detail = e.details() if callable(getattr(e, "details", None)) else e
                    print(f"trainlib: cannot report to the Phalanx controller at {','.join(rnd.targets)}: {detail}",
                          file=sys.stderr, flush=True)
                    warned = True
            with self._sent:
                self._ended += 1
                self._sent.notify_all()

    def _request(self) -> Any:
        from phalanx.v1 import rendezvous_pb2

        rnd = self.round
        step, step_s, saving, finished, compute_s = self._progress()
        done_id, done_step = self._done
        return rendezvous_pb2.WorkerReport(run_id=rnd.run_id, round=rnd.round, rank=rnd.rank,
                                           world_size=rnd.world_size, step=step, step_s=step_s, done_id=done_id,
                                           done_step=done_step, node=rnd.node, saving=saving, finished=finished,
                                           compute_s=compute_s)


def start(env: Mapping[str, str] = os.environ, *, progress: Progress, heed: Heed) -> Reporter | None:
    rnd = WorkerRound.from_env(env)
    if rnd is None:
        return None
    reporter = Reporter(rnd, progress, heed)
    reporter.start()
    return reporter
