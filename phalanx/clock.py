"""One clock protocol, a real clock and a fake one: reading time, sleeping and timers.

Decisions never read the clock: a loop reads it once per tick and passes `now` down. Everything
that waits (loops, deadlines, backoffs) waits on an injected clock, so tests drive time with
`FakeClock.advance()` / `run_for()` instead of sleeping, and a whole recovery runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards; for timeouts and intervals."""
        ...

    def wall_ns(self) -> int:
        """Wall-clock time in Unix nanoseconds; for records, and what people and logs read."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time."""
        ...

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        """Call `callback` (on the running event loop) after `seconds` of this clock's time."""
        ...


def wall_s(clock: Clock) -> float:
    """The clock's wall time in Unix seconds."""
    return clock.wall_ns() / 1e9


async def wait_for(clock: Clock, awaitable: Awaitable[T], timeout: float) -> T:
    """asyncio.wait_for on `clock`'s time: TimeoutError once `timeout` seconds of it have passed."""
    task = asyncio.ensure_future(awaitable)
    timer = asyncio.ensure_future(clock.sleep(timeout))
    try:
        done, _ = await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        timer.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise TimeoutError(f"no answer within {timeout:g}s")


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ns(self) -> int:
        return time.time_ns()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(max(seconds, 0.0), callback)


class _FakeTimer:
    def __init__(self, callback: Callable[[], object]) -> None:
        self.callback: Callable[[], object] | None = callback

    def cancel(self) -> None:
        self.callback = None


class FakeClock:
    """A clock that moves only when told to. Sleepers and timers fire as `advance` passes their time;
    `run_for` also lets the woken tasks run between steps, so chains of waits play out in order."""

    def __init__(self, start: float = 1000.0, wall_start_ns: int = 1_700_000_000 * 10**9) -> None:
        self._now = start
        self._wall_offset_ns = wall_start_ns - int(start * 1e9)
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def wall_ns(self) -> int:
        return self._wall_offset_ns + int(self._now * 1e9)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        timer = self.call_later(seconds, lambda: future.done() or future.set_result(None))
        try:
            await future
        finally:
            timer.cancel()

    def call_later(self, seconds: float, callback: Callable[[], object]) -> Timer:
        timer = _FakeTimer(callback)
        heapq.heappush(self._timers, (self._now + max(seconds, 0.0), next(self._order), timer))
        return timer

    def next_deadline(self) -> float | None:
        """When the earliest live timer fires, or None."""
        while self._timers and self._timers[0][2].callback is None:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def advance(self, seconds: float) -> None:
        """Move time forward and fire every timer due by then (their callbacks run now; the tasks they
        wake run when the caller next yields to the event loop)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds}s)")
        target = self._now + seconds
        while (deadline := self.next_deadline()) is not None and deadline <= target:
            _, _, timer = heapq.heappop(self._timers)
            self._now = max(self._now, deadline)
            callback, timer.callback = timer.callback, None
            if callback is not None:
                callback()
        self._now = target

    jump = advance  # Trio's name

    async def autojump(self, idle_s: float = 0.001) -> None:
        """Trio's `MockClock(autojump_threshold=0)` for asyncio: whenever no other task of the running loop can
        run, jump to the next timer. Virtual time then moves exactly as fast as the work allows, and no task can be
        outrun by it (a busy machine slows the world, never reorders it). Work in threads or on sockets is not
        waited for (it is not on the loop's ready queue): this is for in-process worlds. Runs until cancelled."""
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)  # asyncio's queue of callbacks to run next (CPython's loops)
        if ready is None:
            raise RuntimeError("FakeClock.autojump needs asyncio's own event loop (it reads what is ready to run)")
        while True:
            await asyncio.sleep(0)  # behind everything runnable now
            if ready:
                continue  # someone can still run
            deadline = self.next_deadline()
            if deadline is None:
                await asyncio.sleep(idle_s)  # nothing to jump to: a little real time, for a new timer
            else:
                self.advance(max(deadline - self._now, 0.0))

    async def run_for(self, seconds: float, settle: int = 20) -> None:
        """Advance `seconds`, timer by timer, letting woken tasks run (`settle` loop turns) after each."""
        target = self._now + seconds
        while True:
            await _settle(settle)
            deadline = self.next_deadline()
            if deadline is None or deadline > target:
                break
            self.advance(deadline - self._now)
        self.advance(target - self._now)
        await _settle(settle)


async def _settle(turns: int) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def first_of(*aws) -> None:
    """Until the first of `aws` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def to_the_end(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even if the caller is cancelled meanwhile; the cancel is raised once it has ended
    (whatever `aw` ended with: a caller that was cancelled is cancelled, so that what cancelled it, a shutdown or a
    demotion waiting for its task, is not left waiting behind a caller that took an error for its answer).

    Unlike asyncio.shield alone, the caller stays inside whatever it holds (a lock) until `aw` is done: shielded,
    a commit went on after its cancelled caller had left the job's lock, and the next holder committed beside it
    against the revision that commit was replacing (the fuzzer found it)."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break  # `aw` itself was cancelled, not (only) its caller
            cancelled = True
        except Exception:
            break  # its error, raised below (or the cancel, which comes first)
    if cancelled:
        error = None if task.cancelled() else task.exception()  # (retrieved: never "exception never retrieved")
        raise asyncio.CancelledError from error
    return task.result()
