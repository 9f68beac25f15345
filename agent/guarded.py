"""Collector calls off the event loop, bounded in time, each failure told once.

An NVML sweep, a psutil read or the parsing of an NCCL dump blocks, and a driver gone strange can
block for seconds or for good. On the event loop that would hold back heartbeats, and the node
would look dead while it is only slow. So each collector runs in a worker thread, one call at a time;
a reader waits for it up to a budget of the clock's time and otherwise takes the last good reading.
A call still running is waited for again by the next reader, never started twice, so a stuck driver
holds one thread, not one per heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from phalanx import log
from phalanx.clock import Clock, wait_for

logger = log.get("collect")

T = TypeVar("T")

# (kind, message, collector): an event for the controller's log
Emit = Callable[[str, str, str], None]


class Guarded(Generic[T]):
    """One collector: its last good reading, and at most one call in flight in a worker thread."""

    def __init__(self, name: str, call: Callable[[], T], last: T, clock: Clock, node: str, emit: Emit) -> None:
        self.name = name
        self.last = last
        self.at: float | None = None  # the clock's monotonic() when `last` was read; None: never
        self._call = call
        self._clock = clock
        self._node = node
        self._emit = emit
        self._running: asyncio.Task | None = None
        self._again = False  # the call in flight began before a change: its task calls once more before it ends
        self._failure: str | None = None  # the kind of the current failure, told once while it lasts
        self._slow = False

    def refresh(self) -> asyncio.Task:
        """Start a call unless one is running; `last` changes when it answers. On the event loop."""
        if self._running is None:
            self._running = asyncio.create_task(self._run(), name=f"collect-{self.name}")
        return self._running

    def stale(self) -> None:
        """Something the collector reads has just changed (a GPU raised an XID): a call in flight may have read
        before it, so its readers get the answer of one more call, made after this one. On the event loop."""
        if self._running is not None:
            self._again = True

    async def read(self, budget_s: float) -> T:
        """A fresh reading if the collector answers within `budget_s` of the clock's time, else the last good one."""
        running = self.refresh()
        try:
            await wait_for(self._clock, asyncio.shield(running), budget_s)
        except TimeoutError:
            if not self._slow:
                self._slow = True
                logger.warning("collector slow; reporting its last good reading", collector=self.name,
                               budget_s=budget_s)
                self._emit("collector_slow", f"the {self.name} collector on {self._node} has not answered within "
                           f"{budget_s:g}s", self.name)
        return self.last

    async def _run(self) -> None:
        try:
            again = True
            while again:
                try:
                    value = await asyncio.to_thread(self._call)
                except Exception as e:
                    self._failed(e)
                else:
                    self.last, self.at = value, self._clock.monotonic()
                    self._answered()
                again, self._again = self._again, False
        finally:
            self._running = None

    def _failed(self, e: Exception) -> None:
        kind = type(e).__name__
        if self._failure == kind:  # by kind: messages may vary each time
            return
        self._failure = kind
        logger.error("collector failed; reporting its last good reading", collector=self.name, exc_info=e)
        self._emit("collector_failed", f"the {self.name} collector on {self._node} failed: {kind}: {e}"[:500],
                   self.name)

    def _answered(self) -> None:
        if self._failure is None and not self._slow:
            return
        logger.info("collector recovered", collector=self.name, failure=self._failure, slow=self._slow)
        self._emit("collector_recovered", f"the {self.name} collector on {self._node} works again", self.name)
        self._failure, self._slow = None, False
