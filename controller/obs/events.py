"""Fan-out of committed events to live watchers (`phalanx events --follow`)."""

from __future__ import annotations

import asyncio
from collections import Counter

from controller.store.base import EventRecord

MAX_EVENT_KINDS = 256  # distinct kinds counted by name (agents name their own); the rest count as "other"


class WatcherOverflow(Exception):
    """A watcher fell too far behind and was cut off; it may resume from its last seq."""


class Watcher:
    def __init__(self, hub: EventHub, maxsize: int) -> None:
        self._hub = hub
        self._queue: asyncio.Queue[EventRecord | None] = asyncio.Queue(maxsize=maxsize)
        self.overflowed = False

    def _offer(self, event: EventRecord) -> None:
        if self.overflowed:
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True
            self._queue = asyncio.Queue(maxsize=1)
            self._queue.put_nowait(None)  # wake the reader so it notices

    async def next(self) -> EventRecord:
        event = await self._queue.get()
        if event is None or self.overflowed:
            raise WatcherOverflow()
        return event

    def close(self) -> None:
        self._hub._watchers.discard(self)


class EventHub:
    def __init__(self, watcher_queue: int = 10_000) -> None:
        self._watchers: set[Watcher] = set()
        self._watcher_queue = watcher_queue
        self.published: Counter[str] = Counter()  # events by kind, for the metrics

    def subscribe(self) -> Watcher:
        watcher = Watcher(self, self._watcher_queue)
        self._watchers.add(watcher)
        return watcher

    def publish(self, events: list[EventRecord]) -> None:
        for event in events:
            kind = event.kind if event.kind in self.published or len(self.published) < MAX_EVENT_KINDS else "other"
            self.published[kind] += 1
        for watcher in list(self._watchers):
            for event in events:
                watcher._offer(event)
