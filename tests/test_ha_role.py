"""The HA role loop as a table (controller/ha_role.py): every transition, and a member's life in virtual time.

The real member (controller/main.py HaMember) is driven by the same `run` in tests/test_ha.py's etcd clusters;
here a fake member scripts what each role waits for on a FakeClock that jumps whenever everyone waits."""

from __future__ import annotations

import asyncio

import pytest

from controller import ha_role
from controller.ha_role import Action, Happened, Role
from phalanx.clock import FakeClock

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def test_every_role_answers_what_it_waits_for_and_nothing_else():
    for role, waits in ha_role.WAITS_FOR.items():
        for happened in Happened:
            if happened in waits:
                after, _ = ha_role.step(role, happened)
                assert after in Role
            else:
                with pytest.raises(ValueError, match="cannot happen while"):
                    ha_role.step(role, happened)
    # every role can be left for STOPPED (TAKING_OVER through its load's end), and STOPPED is final
    reach = {Role.STANDING_BY}
    while True:
        more = {ha_role.step(r, h)[0] for r in reach for h in ha_role.WAITS_FOR[r]} - reach
        if not more:
            break
        reach |= more
    assert reach == set(Role) and not ha_role.WAITS_FOR[Role.STOPPED]


def test_a_term_is_given_up_by_the_lease_only_when_it_still_holds_one():
    """Resigning deletes the leader key: right when this member holds it (a failed load, a stop), wrong after the
    lease was lost (the key may be another member's by then). The server closes before the controller stops, so
    no call of the term reaches a stopping controller."""
    _, lost = ha_role.step(Role.LEADING, Happened.LEASE_LOST)
    assert Action.RESIGN not in lost and lost.index(Action.CLOSE_SERVER_NOW) < lost.index(Action.END_TERM_NOW)
    _, failed = ha_role.step(Role.TAKING_OVER, Happened.LOAD_FAILED)
    assert failed[-1] is Action.RESIGN and Action.RELEASE_PARKED in failed
    _, stopped = ha_role.step(Role.LEADING, Happened.STOP)
    assert stopped == (Action.CLOSE_SERVER_GRACEFULLY, Action.END_TERM_GRACEFULLY, Action.RESIGN)


class ScriptedMember:
    """A member whose waits end at scripted virtual times, recording what it is told to do and when."""

    def __init__(self, clock: FakeClock, script: list[tuple[float, Happened]]) -> None:
        self.clock, self.script = clock, list(script)
        self.log: list[tuple[float, str]] = []

    async def _next(self) -> Happened:
        at, happened = self.script.pop(0)
        await self.clock.sleep(at - self.clock.monotonic())
        return happened

    campaign = take_over = lead = _next

    async def act(self, action: Action) -> None:
        self.log.append((self.clock.monotonic(), action.value))
        await self.clock.sleep(0.5)  # each action takes a while: the next waits for it

    def became(self, role: Role, happened: Happened) -> None:
        self.log.append((self.clock.monotonic(), role.value))


def test_a_members_life_elected_deposed_failed_to_load_and_stopped_in_virtual_time():
    clock = FakeClock(start=0.0)
    member = ScriptedMember(clock, [(1, Happened.ELECTED), (2, Happened.LOADED), (10, Happened.LEASE_LOST),
                                    (20, Happened.ELECTED), (21, Happened.LOAD_FAILED), (30, Happened.ELECTED),
                                    (31, Happened.LOADED), (40, Happened.STOP)])

    async def main():
        jumper = asyncio.create_task(clock.autojump())
        try:
            await asyncio.wait_for(ha_role.run(member), 30)
        finally:
            jumper.cancel()

    asyncio.run(main())
    assert member.log == [
        (1, "taking over"),
        (2, "take_up_parked"), (2.5, "leading"),
        (10, "close_server_now"), (10.5, "end_term_now"), (11, "standing by"),
        (20, "taking over"),
        (21, "release_parked"), (21.5, "end_term_now"), (22, "resign"), (22.5, "standing by"),
        (30, "taking over"),
        (31, "take_up_parked"), (31.5, "leading"),
        (40, "close_server_gracefully"), (40.5, "end_term_gracefully"), (41, "resign"), (41.5, "stopped"),
    ]
