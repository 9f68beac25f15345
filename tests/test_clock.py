"""The fake clock: sleepers, timers and wait_for move only with virtual time."""

import asyncio

import pytest

from phalanx.clock import FakeClock, RealClock, to_the_end, wait_for

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def run(test):
    """Each test is a coroutine run on a fresh event loop."""
    def wrapper():
        asyncio.run(test())
    wrapper.__name__ = test.__name__
    return wrapper


@run
async def test_a_sleeper_wakes_when_the_fake_clock_passes_its_time():
    clock = FakeClock()
    woke = []

    async def sleeper(name, seconds):
        await clock.sleep(seconds)
        woke.append((name, clock.monotonic()))

    tasks = [asyncio.create_task(sleeper("late", 5)), asyncio.create_task(sleeper("early", 2))]
    await clock.run_for(1)
    assert woke == []
    await clock.run_for(10)
    assert woke == [("early", 1002.0), ("late", 1005.0)]
    await asyncio.gather(*tasks)


@run
async def test_chained_waits_play_out_in_virtual_time():
    clock = FakeClock()
    ticks = []

    async def loop():
        for _ in range(100):
            await clock.sleep(0.5)
            ticks.append(clock.monotonic())

    task = asyncio.create_task(loop())
    await clock.run_for(50)
    assert len(ticks) == 100 and ticks[-1] == pytest.approx(1050.0)
    await task


@run
async def test_wait_for_times_out_on_the_clock_it_is_given():
    clock = FakeClock()
    never = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(wait_for(clock, never, 30))
    await clock.run_for(29)
    assert not waiting.done()
    await clock.run_for(2)
    with pytest.raises(TimeoutError, match="30s"):
        await waiting
    assert never.cancelled()


@run
async def test_wait_for_returns_the_answer_that_came_first():
    clock = FakeClock()

    async def answer():
        await clock.sleep(1)
        return 42

    waiting = asyncio.create_task(wait_for(clock, answer(), 30))
    await clock.run_for(2)
    assert await waiting == 42
    assert clock.next_deadline() is None  # the timeout's timer is gone


def test_a_cancelled_timer_never_fires_and_time_cannot_go_back():
    clock = FakeClock()
    fired = []
    timer = clock.call_later(1, lambda: fired.append("x"))
    clock.call_later(2, lambda: fired.append("y"))
    timer.cancel()
    clock.advance(3)
    assert fired == ["y"]
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1)


@run
async def test_the_real_clock_sleeps_and_sets_timers():
    clock = RealClock()
    fired = asyncio.Event()
    clock.call_later(0, fired.set)
    await clock.sleep(0)
    await asyncio.wait_for(fired.wait(), 10)


@run
async def test_autojump_moves_time_only_when_every_task_is_blocked():
    """A task that keeps working (many loop turns, no sleep) is never overtaken: time does not move while it can
    run, however long that takes in real time; once everyone waits, time jumps straight to the next timer."""
    clock = FakeClock()
    seen = []

    async def worker():
        for _ in range(2000):  # busy without sleeping on the clock: a slow machine's long step
            await asyncio.sleep(0)
        seen.append(("worked", clock.monotonic()))
        await clock.sleep(30)
        seen.append(("slept", clock.monotonic()))

    jumper = asyncio.create_task(clock.autojump())
    start = clock.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(worker(), clock.sleep(3600)), 30)
    finally:
        jumper.cancel()
    assert seen == [("worked", start), ("slept", start + 30)]
    assert clock.monotonic() == start + 3600


@run
async def test_to_the_end_holds_a_cancelled_caller_in_its_lock_until_the_work_is_done():
    # A store commit under a job's lock, its caller an RPC whose client gave up: the commit must finish, and the
    # lock stay held until memory has followed, before the caller's cancel is raised (controller.jobs.manager.save).
    lock, gate, done = asyncio.Lock(), asyncio.Event(), []

    async def commit() -> str:
        await gate.wait()
        done.append("committed")
        return "revision 2"

    async def caller() -> str:
        async with lock:
            return await to_the_end(commit())

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert lock.locked() and not task.done()  # asyncio.shield alone lets go of the lock here
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == ["committed"] and not lock.locked()
    assert await to_the_end(asyncio.sleep(0, "answer")) == "answer"


@run
async def test_to_the_end_raises_the_callers_cancel_even_when_the_work_failed():
    # a commit that failed (fenced, say) after its caller was cancelled: the caller is cancelled all the same, not
    # handed the error (a loop that logs errors and goes on would outlive the cancel, and a shutdown wait for it)
    gate = asyncio.Event()

    async def failing() -> None:
        await gate.wait()
        raise RuntimeError("fenced")

    task = asyncio.create_task(to_the_end(failing()))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(RuntimeError, match="fenced"):  # not cancelled: its error, as from the work itself
        await to_the_end(failing())
