"""A node agent's local service, faked for trainlib tests: it records what ranks report, and answers what the
test sets (a stale generation, a slow=F fault)."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc

from phalanx.v1 import local_pb2, local_pb2_grpc


class FakeAgent(local_pb2_grpc.LocalServiceServicer):
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.reports: list[local_pb2.ReportRequest] = []
        self.reported = threading.Event()  # a report arrived
        self.fatal = threading.Event()  # a report with `fatal` arrived
        self.stale = threading.Event()  # set by the test: answer every report with stale
        self.slow_factor = 0.0  # set by the test: the slow=F fault every reply hands on
        self.checkpoint = local_pb2.CheckpointRequest()  # set by the test: the checkpoint request every reply hands on
        self.gate: threading.Event | None = None  # set by the test: a report's reply waits until it is set
        self.snapshots: list[local_pb2.SnapshotTakenRequest] = []  # snapshots handed in, kept
        self.done: list[local_pb2.CheckpointDoneRequest] = []  # checkpoints committed
        self.done_error = ""  # set by the test: why an in-memory commit is refused (no replica kept)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        local_pb2_grpc.add_LocalServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{socket}")
        self._server.start()

    def Report(self, request, context):
        self.reports.append(request)
        self.reported.set()
        if request.fatal:
            self.fatal.set()
        if self.gate is not None:
            self.gate.wait(60)
        return local_pb2.ReportReply(stale=self.stale.is_set(), slow_factor=self.slow_factor,
                                     checkpoint=self.checkpoint)

    def SnapshotTaken(self, request, context):
        self.snapshots.append(request)
        return local_pb2.SnapshotTakenReply()

    def CheckpointDone(self, request, context):
        self.done.append(request)
        return local_pb2.CheckpointDoneReply(error=self.done_error if request.in_memory else "")

    def close(self) -> None:
        self._server.stop(grace=None)


@contextmanager
def serving() -> Iterator[FakeAgent]:
    """A fake agent on a socket in a short temporary directory (a Unix socket path must stay under 108 bytes)."""
    with tempfile.TemporaryDirectory(prefix="tl-") as short:
        fake = FakeAgent(Path(short) / "agent.sock")
        try:
            yield fake
        finally:
            fake.close()
