"""The quorum of a job's replica groups, as torchft's lighthouse keeps it, and the one thing torchft's lacks: a
group the controller has judged is taken out at once (`drop`).

Each replica group's torchft manager asks for a quorum at every step (`join`, then waits for the next quorum that
names it) and says it is alive every ~100 ms (`heartbeat`). A quorum is issued (`tick`) when every group that was in
the last one has asked again (a fast quorum), or when at least `min_replicas` have, more than half of those alive,
and either every group alive has asked or `join_timeout_s` has passed since the first did. A group whose heartbeats
stop for `heartbeat_timeout_s` is no longer alive. The quorum's id changes when its members do (or a member reports
a failed commit): that is what makes the managers form their process group again.

This is torchft 0.2.0's `quorum_compute` and `_quorum_tick` (src/lighthouse.rs), in the same order and with the same
answers (tests/test_lighthouse.py runs both side by side). What torchft has no call for: a group whose node turned
FAILED would hold the healthy groups for `heartbeat_timeout_s` (it stays alive while its managers' heartbeats go on,
or until they stop), and a group stopped at a step boundary (a failing GPU, a straggler) likewise. `drop(group)` takes
the group's members out now: their heartbeats no longer count, their requests are answered with a quorum that does
not name them (so that their ranks' step fails at once: torchft's "not participating"), and a quorum of the others
is issued at once. A group is known by torchft's own rule, the digits its replica id ends with before the `:uuid` its
manager adds (`REPLICA_GROUP_ID` in the examples' `replica_id=f"{job}-group{group}"`); a replica id without both
(torchft's bare uuid when none is given, a name without digits) is never dropped, nor is the last group known. The
group launched again in its place has a manager of its own, so a replica id of its own: it is not dropped.

Pure: time is passed in (seconds of a monotonic clock), so tests drive it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from phalanx.torchft import lighthouse_pb2 as ft


class Dropped(Exception):
    """A request of a member the controller took out of the quorum."""


def group_of(replica_id: str) -> int | None:
    """The replica group a member belongs to, by torchft's rule (`extract_trailing_digits` of the replica id before
    the `:uuid` its manager adds); None for an id that has no such name (torchft's bare uuid) or whose name ends in
    no digits (torchft reads group 0 there, which would name every group so named)."""
    name, colon, _ = replica_id.partition(":")
    digits = len(name) - len(name.rstrip("0123456789"))
    return int(name[len(name) - digits:]) if colon and digits else None


@dataclass
class _Joined:
    joined: float
    member: ft.QuorumMember


class QuorumState:
    def __init__(self, min_replicas: int = 1, join_timeout_s: float = 1.0, heartbeat_timeout_s: float = 1.0,
                 first_id: int = 0, expect: frozenset[int] = frozenset(), expect_until: float = 0.0) -> None:
        """`first_id`: the quorum ids issued follow it (torchft's start at 0). A lighthouse started again in the
        place of one gone must never issue an id the managers have seen: a manager forms its process group under
        the quorum id's prefix in its store, where the keys of the earlier quorum of that id still are.

        `expect`: the groups training when a lighthouse is started again in the place of one gone. Its first quorum
        waits for them until `expect_until` (as many members, where the replica ids do not say their group): their
        managers come back one by one as each asks again, and a first quorum of the first to come would leave the
        others behind (they would take its state, and skip the step it took alone). A group dropped meanwhile is
        not waited for."""
        self.min_replicas = min_replicas
        self.join_timeout_s = join_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.participants: dict[str, _Joined] = {}  # asked since the last quorum
        self.heartbeats: dict[str, float] = {}  # replica id -> when last heard
        self.prev: ft.Quorum | None = None
        self.quorum_id = first_id
        self.dropped: dict[str, str] = {}  # replica id -> why the controller took it out
        self.expect, self.expect_until = set(expect), expect_until

    def heartbeat(self, replica_id: str, now: float) -> None:
        if replica_id not in self.dropped:
            self.heartbeats[replica_id] = now

    def join(self, member: ft.QuorumMember, now: float) -> None:
        """`member` asks for the next quorum (an implicit heartbeat). Raises Dropped for one taken out."""
        why = self.dropped.get(member.replica_id)
        if why is not None:
            raise Dropped(why)
        self.heartbeats[member.replica_id] = now
        self.participants[member.replica_id] = _Joined(now, member)

    def rejoin(self, member: ft.QuorumMember, now: float) -> None:
        """`member`, still waiting, was not in the quorum just issued: it asks for the next (torchft's re-insert, no
        heartbeat: one whose heartbeats stopped stays out)."""
        if member.replica_id not in self.dropped:
            self.participants[member.replica_id] = _Joined(now, member)

    def without(self, replica_id: str) -> ft.Quorum:
        """What a member taken out is answered: the quorum as it stands, without it (torchft's manager then fails
        its ranks' step at once: "not participating")."""
        quorum = ft.Quorum(quorum_id=self.quorum_id)
        if self.prev is not None:
            quorum.CopyFrom(self.prev)
            quorum.quorum_id = self.quorum_id
            kept = [p for p in self.prev.participants if p.replica_id != replica_id and p.replica_id not in
                    self.dropped]
            del quorum.participants[:]
            quorum.participants.extend(kept)
        return quorum

    def drop(self, group: int, why: str) -> list[str]:
        """Take replica group `group`'s members, as known now, out of the quorum (sorted; none when that would take
        every member known: the group is not told apart from the others)."""
        known = {*self.heartbeats, *self.participants, *(p.replica_id for p in self.prev.participants)} \
            if self.prev is not None else {*self.heartbeats, *self.participants}
        known -= self.dropped.keys()
        self.expect.discard(group)  # (started again, and it leaves before the first quorum: not waited for)
        out = sorted(r for r in known if group_of(r) == group)
        if len(out) == len(known):
            return []
        for replica_id in out:
            self.dropped[replica_id] = why
            self.heartbeats.pop(replica_id, None)
            self.participants.pop(replica_id, None)
        return out

    def compute(self, now: float) -> tuple[list[ft.QuorumMember] | None, str]:
        """The quorum that would be issued now (None: not yet), and why (torchft's `quorum_compute`)."""
        healthy = {r for r, last in self.heartbeats.items() if now - last < self.heartbeat_timeout_s}
        joined = {r: d for r, d in self.participants.items() if r in healthy}
        candidates = sorted((d.member for d in joined.values()), key=lambda m: m.replica_id)
        shrink_only = any(d.member.shrink_only for d in joined.values())
        metadata = (f"[{len(joined)}/{len(self.participants)} participants healthy][{len(healthy)} heartbeating]"
                    f"[shrink_only={str(shrink_only).lower()}]")
        if self.prev is not None:
            before = {p.replica_id for p in self.prev.participants}
            if shrink_only:
                candidates = [m for m in candidates if m.replica_id in before]
            if all(p.replica_id in joined for p in self.prev.participants):
                return candidates, f"Fast quorum found! {metadata}"
        if self.prev is None and self.expect and now < self.expect_until:
            placed = {group_of(r) for r in joined} - {None}
            waiting = not self.expect <= placed if placed else len(joined) < len(self.expect)
            if waiting:
                return None, (f"New quorum not ready, only have {len(joined)} participants, expecting groups "
                              f"{sorted(self.expect)}, which trained before this lighthouse started {metadata}")
        if len(joined) < self.min_replicas:
            return None, (f"New quorum not ready, only have {len(joined)} participants, need min_replicas "
                          f"{self.min_replicas} {metadata}")
        if len(joined) <= len(healthy) // 2:
            return None, (f"New quorum not ready, only have {len(joined)} participants, need at least half of "
                          f"{len(healthy)} healthy workers {metadata}")
        first = min((d.joined for d in joined.values()), default=now)
        if len(joined) != len(healthy) and now - first < self.join_timeout_s:
            return None, (f"Valid quorum with {len(joined)} participants, waiting for {len(healthy) - len(joined)} "
                          f"healthy but not participating stragglers due to join timeout {metadata}")
        return candidates, f"Valid quorum found {metadata}"

    def tick(self, now: float) -> tuple[ft.Quorum | None, str]:
        """Issue the quorum if it is met (torchft's `_quorum_tick`): its id bumped when its members changed or one
        reports a failed commit; the participants start over."""
        members, reason = self.compute(now)
        if members is None:
            return None, reason
        if self.prev is None or [m.replica_id for m in members] != [p.replica_id for p in self.prev.participants] \
                or any(m.commit_failures > 0 for m in members):
            self.quorum_id += 1
        quorum = ft.Quorum(quorum_id=self.quorum_id, participants=members)
        quorum.created.FromNanoseconds(time.time_ns())
        self.prev = quorum
        self.participants.clear()
        return quorum, reason
