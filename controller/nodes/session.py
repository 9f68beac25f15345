"""The controller's half of one agent session: commands waiting to go down, their answers, a kill switch."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc

from controller.errors import FailedPrecondition, details
from phalanx import clock as clocks
from phalanx.clock import Clock, RealClock
from phalanx.v1 import node_pb2

COMMAND_TIMEOUT_S = 5.0


class CommandFailed(FailedPrecondition):
    """The agent answered a command with an error."""


def _always() -> bool:
    return True


class NotLeading(FailedPrecondition):
    """This controller's leadership has lapsed: it sends no command (a deposed leader must not act)."""


class Session:
    def __init__(self, peer: str, epoch: int = 0, leading: Callable[[], bool] = _always,
                 clock: Clock | None = None) -> None:
        self.peer = peer
        self._clock = clock or RealClock()  # commands' deadlines
        self.epoch = epoch  # the leader's epoch, stamped on every command
        self._leading = leading
        self.outbox: asyncio.Queue[node_pb2.ControllerMessage | None] = asyncio.Queue()  # None: closed
        self.closed = asyncio.Event()
        self.close_code = grpc.StatusCode.OK
        self.close_message = ""
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[node_pb2.CommandResult]] = {}

    @property
    def unanswered(self) -> int:
        """Commands sent that wait for the agent's answer."""
        return len(self._pending)

    def push(self, message: node_pb2.ControllerMessage) -> None:
        if message.WhichOneof("body") == "command":
            # Checked here, synchronously, at the last moment: a leader paused past its lease (SIGSTOP, a VM
            # freeze) runs whatever was ready before it learns it was deposed, and none of it may reach a node.
            if not self._leading():
                raise NotLeading("this controller's leadership has lapsed; it sends no commands")
            message.command.epoch = self.epoch
        self.outbox.put_nowait(message)

    async def next_message(self) -> node_pb2.ControllerMessage | None:
        """The next message to write to the agent, or None once the session is closed. A command queued while
        this controller led is dropped here if its lease lapsed since (the process paused between the queue and
        the write): its sender gets NotLeading, the agent nothing."""
        while (message := await self.outbox.get()) is not None:
            if message.WhichOneof("body") != "command" or self._leading():
                return message
            future = self._pending.get(message.command.id)
            if future is not None and not future.done():
                future.set_exception(NotLeading("this controller's leadership lapsed before the command was sent"))
        return None

    def kick(self, code: grpc.StatusCode, message: str) -> None:
        if not self.closed.is_set():
            self.close_code, self.close_message = code, details(message)
            self.closed.set()
            self.outbox.put_nowait(None)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(FailedPrecondition(f"the session ended before the agent answered: {message}"))

    async def request(self, command: node_pb2.Command, timeout: float = COMMAND_TIMEOUT_S) -> node_pb2.CommandResult:
        """Send a command and wait for the agent's answer. Raises CommandFailed if the agent refused it."""
        if self.closed.is_set():
            raise FailedPrecondition("the node's session has ended")
        command.id = next(self._ids)
        self.push(node_pb2.ControllerMessage(command=command))  # raises NotLeading before anything is queued
        future: asyncio.Future[node_pb2.CommandResult] = asyncio.get_running_loop().create_future()
        self._pending[command.id] = future
        try:
            result = await clocks.wait_for(self._clock, future, timeout)
        except TimeoutError:
            raise FailedPrecondition(f"the agent did not answer within {timeout:g}s") from None
        finally:
            self._pending.pop(command.id, None)
        if not result.ok:
            raise CommandFailed(result.error or "the agent refused the command")
        return result

    def resolve(self, result: node_pb2.CommandResult) -> None:
        future = self._pending.get(result.id)
        if future is not None and not future.done():
            future.set_result(result)
