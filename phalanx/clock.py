"""One clock protocol, a real clock and a fake one.

Decisions never read the clock: a loop reads it once per tick and passes `now` down. Tests drive
time with `FakeClock.advance()` instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards; for timeouts and intervals."""
        ...

    def wall_ns(self) -> int:
        """Wall-clock time in Unix nanoseconds; for what people and logs read."""
        ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ns(self) -> int:
        return time.time_ns()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall_start_ns: int = 1_700_000_000 * 10**9) -> None:
        self._now = start
        self._wall_offset_ns = wall_start_ns - int(start * 1e9)

    def monotonic(self) -> float:
        return self._now

    def wall_ns(self) -> int:
        return self._wall_offset_ns + int(self._now * 1e9)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds}s)")
        self._now += seconds
