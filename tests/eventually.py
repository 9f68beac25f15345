"""The one way a test waits: poll a condition until it holds, then go on; never sleep a fixed time instead.

`eventually(check, what)` calls `check` until it returns something true and returns that. Past `timeout` seconds
it fails with `what` and, if given, `describe()` (logs, states: what the failure's reader needs). `abort()`, if
given, is asked between polls for a reason to stop at once (a daemon that exited: waiting longer cannot help).

The pause between polls grows with what a poll costs: a check that takes t seconds (a CLI process, a scrape)
waits at least 3t before the next, so polling takes at most a quarter of a core however dear the check is, and a
cheap one is retried within `interval`. The timeouts are generous on purpose: CI machines are shared and the
suite runs in parallel; no test asserts on how long a wait took.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT_S = 60.0
INTERVAL_S = 0.05
COST_FACTOR = 3.0  # a poll that took t seconds is followed by at least COST_FACTOR * t of rest


def _failure(what: str, timeout: float, describe: Callable[[], str] | None) -> AssertionError:
    detail = ""
    if describe is not None:
        try:
            detail = f"\n{describe()}"
        except Exception as e:  # a description is for a failure message only
            detail = f"\n(describing it failed: {e!r})"
    return AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")


def eventually(check: Callable[[], T], what: str, timeout: float = TIMEOUT_S, interval: float = INTERVAL_S,
               describe: Callable[[], str] | None = None, abort: Callable[[], str | None] | None = None) -> T:
    deadline = time.monotonic() + timeout
    while True:
        started = time.monotonic()
        value = check()
        if value:
            return value
        now = time.monotonic()
        if abort is not None and (why := abort()):
            raise AssertionError(f"{why} while waiting for {what}")
        if now >= deadline:
            raise _failure(what, timeout, describe)
        time.sleep(min(max(interval, COST_FACTOR * (now - started)), max(deadline - now, 0.0) + 0.001))


async def eventually_async(check: Callable[[], T], what: str, timeout: float = TIMEOUT_S,
                           interval: float = 0.01, describe: Callable[[], str] | None = None,
                           pause: Callable[[], Awaitable[object]] | None = None) -> T:
    """eventually() inside an event loop: the loop runs the world between polls (timeout on the loop's real time).
    `pause`: how to wait between polls instead of `interval` real seconds (a world on a virtual clock: a step of
    it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if loop.time() >= deadline:
            raise _failure(what, timeout, describe)
        await (pause() if pause is not None else asyncio.sleep(interval))
