"""Heartbeat counters and the lag window, cheap enough for the heartbeat path."""

from __future__ import annotations

from array import array


class LagWindow:
    """The last `size` samples in a ring; percentiles are computed on read, not on write."""

    def __init__(self, size: int = 65_536) -> None:
        self._samples = array("d", bytes(8 * size))
        self._size = size
        self._count = 0

    def add(self, value: float) -> None:
        self._samples[self._count % self._size] = value
        self._count += 1

    @property
    def count(self) -> int:
        return min(self._count, self._size)

    def percentiles(self, *qs: float) -> list[float]:
        data = sorted(self._samples[: self.count])
        if not data:
            return [0.0 for _ in qs]
        return [data[min(len(data) - 1, int(q * len(data)))] for q in qs]

    def reset(self) -> None:
        self._count = 0
