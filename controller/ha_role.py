"""The role of one member of a highly available control plane, as a table (issue 41).

    STANDING_BY --elected--> TAKING_OVER --loaded--> LEADING --lease lost--> STANDING_BY
                                  \\--load failed--> STANDING_BY
    STANDING_BY, TAKING_OVER, LEADING --stop--> STOPPED

`step(role, happened)` is the whole policy: the next role and the actions that get there, in order. What a
role waits for (`Member.campaign`, `take_over`, `lead`) and what each action does (the server, the controller
of the term, the lease, the parked sessions) are the member's, behind the `Member` protocol: controller/main.py
gives the real one, tests a fake on virtual time. A stop asked for while a term loads is acted on once the load
has ended either way (loading is not cut off half-way, as before this table).
"""

from __future__ import annotations

import enum
from typing import Protocol


class Role(enum.Enum):
    STANDING_BY = "standing by"  # serving the standby's handlers (parking sessions), campaigning
    TAKING_OVER = "taking over"  # elected: the term's store and controller loading
    LEADING = "leading"  # holding the lease, serving the term
    STOPPED = "stopped"


class Happened(enum.Enum):
    ELECTED = "elected"
    LOADED = "loaded"
    LOAD_FAILED = "load failed"
    LEASE_LOST = "lease lost"
    STOP = "stop"


class Action(enum.Enum):
    RELEASE_PARKED = "release_parked"  # the sessions parked here go back to looking for the leader
    TAKE_UP_PARKED = "take_up_parked"  # the term takes them up, then judges their nodes' health
    CLOSE_SERVER_NOW = "close_server_now"  # every call of the term ends at once, before the controller stops
    CLOSE_SERVER_GRACEFULLY = "close_server_gracefully"  # the calls under way may finish (a lone controller's do)
    END_TERM_NOW = "end_term_now"  # the lease's keeper and the term's controller, stopped without grace
    END_TERM_GRACEFULLY = "end_term_gracefully"
    RESIGN = "resign"  # the leader key given up at once, so another member need not wait out the lease


_R, _H, _A = Role, Happened, Action
TABLE: dict[tuple[Role, Happened], tuple[Role, tuple[Action, ...]]] = {
    (_R.STANDING_BY, _H.ELECTED): (_R.TAKING_OVER, ()),
    (_R.STANDING_BY, _H.STOP): (_R.STOPPED, (_A.RELEASE_PARKED,)),
    (_R.TAKING_OVER, _H.LOADED): (_R.LEADING, (_A.TAKE_UP_PARKED,)),
    (_R.TAKING_OVER, _H.LOAD_FAILED): (_R.STANDING_BY, (_A.RELEASE_PARKED, _A.END_TERM_NOW, _A.RESIGN)),
    (_R.LEADING, _H.LEASE_LOST): (_R.STANDING_BY, (_A.CLOSE_SERVER_NOW, _A.END_TERM_NOW)),
    (_R.LEADING, _H.STOP): (_R.STOPPED, (_A.CLOSE_SERVER_GRACEFULLY, _A.END_TERM_GRACEFULLY, _A.RESIGN)),
}
# What each role waits for; anything else happening there is a bug in the member, not a transition.
WAITS_FOR: dict[Role, frozenset[Happened]] = {
    _R.STANDING_BY: frozenset({_H.ELECTED, _H.STOP}),
    _R.TAKING_OVER: frozenset({_H.LOADED, _H.LOAD_FAILED}),
    _R.LEADING: frozenset({_H.LEASE_LOST, _H.STOP}),
    _R.STOPPED: frozenset(),
}


def step(role: Role, happened: Happened) -> tuple[Role, tuple[Action, ...]]:
    """The next role and the actions that lead there. Raises ValueError for what cannot happen in `role`."""
    try:
        return TABLE[(role, happened)]
    except KeyError:
        raise ValueError(f"{happened.value!r} cannot happen while {role.value}") from None


class Member(Protocol):
    """The effects of a role: what controller/main.py does, and what a test fakes."""

    async def campaign(self) -> Happened:
        """Stand by (route the standby's handlers, open the server if it is closed) until elected or stopped."""
        ...

    async def take_over(self) -> Happened:
        """Open the term (its store, its controller, the lease's keeper) and load it: LOADED or LOAD_FAILED."""
        ...

    async def lead(self) -> Happened:
        """Until the lease is lost or a stop is asked for."""
        ...

    async def act(self, action: Action) -> None: ...

    def became(self, role: Role, happened: Happened) -> None:
        """Told after each transition's actions (logs, systemd status, metrics)."""
        ...


async def run(member: Member) -> None:
    """Drive `member` through its roles from STANDING_BY until STOPPED."""
    role = Role.STANDING_BY
    waits = {Role.STANDING_BY: member.campaign, Role.TAKING_OVER: member.take_over, Role.LEADING: member.lead}
    while role is not Role.STOPPED:
        happened = await waits[role]()
        role, actions = step(role, happened)
        for action in actions:
            await member.act(action)
        member.became(role, happened)
