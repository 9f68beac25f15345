"""Heartbeat counters, the lag window and histograms, cheap enough for the heartbeat path."""

from __future__ import annotations

from array import array
from bisect import bisect_left


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


LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DETECTION_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 3.5, 4.0, 5.0, 10.0, 30.0)
RECOVERY_BUCKETS_S = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
DETECTION_KINDS = ("node_down", "xid", "health")


class Buckets:
    """A Prometheus histogram's counts, kept per bucket and summed up only when read: one bisect and
    two additions per observation (prometheus_client's Histogram takes a lock and walks every bucket).
    For the event loop's thread only."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self.bounds, value)] += 1  # le is inclusive: `value == bound` counts in it
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, observations <= le), ..., ("+Inf", all)], as a HistogramMetricFamily takes them."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self._counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out
