"""The quorum of a job's replica groups (controller/quorum.py): torchft 0.2.0's rules, and the drop of a group the
controller has judged. Time is passed in: every case is exact."""

from __future__ import annotations

import pytest

from controller.quorum import Dropped, QuorumState, group_of
from phalanx.torchft import lighthouse_pb2 as ft

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def member(replica_id: str, step: int = 0, **fields) -> ft.QuorumMember:
    return ft.QuorumMember(replica_id=replica_id, address=f"http://{replica_id}", store_address="s:1", step=step,
                           world_size=2, **fields)


def ids(quorum: ft.Quorum | None) -> list[str] | None:
    return None if quorum is None else [p.replica_id for p in quorum.participants]


def formed(state: QuorumState, names: list[str], now: float, **fields) -> ft.Quorum:
    for name in names:
        state.join(member(name, **fields), now)
    quorum, reason = state.tick(now)
    assert quorum is not None, reason
    return quorum


def test_a_quorum_waits_for_every_group_alive_then_keeps_its_id_while_its_members_stay():
    state = QuorumState(min_replicas=1, join_timeout_s=60, heartbeat_timeout_s=60)
    state.heartbeat("j-group1:b", 0.0)
    state.join(member("j-group0:a"), 0.0)
    assert state.tick(0.0)[0] is None  # one of two alive: not more than half (torchft's split-brain rule)
    state.join(member("j-group1:b"), 0.1)
    quorum, reason = state.tick(0.1)
    assert ids(quorum) == ["j-group0:a", "j-group1:b"] and quorum.quorum_id == 1 and reason.startswith("Valid")
    again = formed(state, ["j-group1:b", "j-group0:a"], 0.2)  # the same members: a fast quorum, the same id
    assert ids(again) == ids(quorum) and again.quorum_id == 1
    bumped = formed(state, ["j-group0:a", "j-group1:b"], 0.3, commit_failures=1)  # a failed commit: a new id
    assert bumped.quorum_id == 2


def test_a_new_group_joins_at_the_next_quorum_with_a_new_id_and_a_straggler_is_waited_for_until_the_join_timeout():
    state = QuorumState(min_replicas=1, join_timeout_s=5, heartbeat_timeout_s=60)
    formed(state, ["g0:a", "g1:b"], 0.0)
    state.join(member("g2:c"), 1.0)  # a rebuilt group asks first: the others have not yet
    state.join(member("g0:a"), 1.0)
    assert state.tick(1.0)[0] is None
    state.join(member("g1:b"), 1.1)  # every member of the last quorum asked: it is issued, with the newcomer
    quorum = state.tick(1.1)[0]
    assert ids(quorum) == ["g0:a", "g1:b", "g2:c"] and quorum.quorum_id == 2
    # g2 goes silent but is still alive: the others wait for it until the join timeout
    state.join(member("g0:a"), 2.0)
    state.join(member("g1:b"), 2.0)
    assert state.tick(6.9)[0] is None and "join timeout" in state.tick(6.9)[1]
    late = state.tick(7.0)[0]
    assert ids(late) == ["g0:a", "g1:b"] and late.quorum_id == 3


def test_a_group_whose_heartbeats_stop_leaves_after_the_heartbeat_timeout_and_shrink_only_admits_nobody_new():
    state = QuorumState(min_replicas=1, join_timeout_s=60, heartbeat_timeout_s=1)
    formed(state, ["g0:a", "g1:b"], 0.0)
    state.heartbeat("g0:a", 0.9)
    state.join(member("g0:a"), 0.9)
    assert state.tick(0.9)[0] is None  # g1 still alive (0.9 s since heard)
    quorum = state.tick(1.0)[0]
    assert ids(quorum) == ["g0:a"] and quorum.quorum_id == 2
    state.join(member("g2:c"), 1.5)
    state.join(member("g0:a", shrink_only=True), 1.5)
    assert ids(state.tick(1.5)[0]) == ["g0:a"]  # fast quorum, shrunk to the last one's members
    with pytest.raises(AssertionError):
        formed(QuorumState(min_replicas=2), ["g0:a"], 0.0)  # fewer than min_replicas


def test_a_dropped_group_leaves_at_once_its_requests_are_answered_without_it_and_its_replacement_is_admitted():
    state = QuorumState(min_replicas=1, join_timeout_s=60, heartbeat_timeout_s=60)
    formed(state, ["j-group0:a", "j-group1:b", "j-group12:c"], 0.0)
    assert state.drop(1, "node-b lost") == ["j-group1:b"]  # group 1, not group 12
    state.heartbeat("j-group1:b", 0.1)  # its managers' heartbeats go on: they no longer count
    with pytest.raises(Dropped, match="node-b lost"):
        state.join(member("j-group1:b"), 0.1)
    assert ids(state.without("j-group1:b")) == ["j-group0:a", "j-group12:c"]  # what it is answered
    state.join(member("j-group0:a"), 0.2)
    state.join(member("j-group12:c"), 0.2)
    quorum = state.tick(0.2)[0]  # without waiting out its heartbeats (60 s)
    assert ids(quorum) == ["j-group0:a", "j-group12:c"] and quorum.quorum_id == 2
    assert state.drop(1, "again") == []  # nothing more of it known
    state.join(member("j-group1:d"), 5.0)  # launched again: a manager of its own, a replica id of its own
    state.join(member("j-group0:a"), 5.0)
    state.join(member("j-group12:c"), 5.0)
    assert ids(state.tick(5.0)[0]) == ["j-group0:a", "j-group12:c", "j-group1:d"]


def test_a_drop_takes_no_group_it_cannot_tell_apart():
    state = QuorumState(min_replicas=1, join_timeout_s=60, heartbeat_timeout_s=60)
    formed(state, ["trainer:a", "trainer:b", "7f3e-uuid-0"], 0.0)  # no digits before the uuid; a bare uuid
    assert state.drop(0, "x") == [] and state.drop(0, "x") == []
    state = QuorumState(min_replicas=1, join_timeout_s=60, heartbeat_timeout_s=60)
    formed(state, ["g0:a", "g0:b"], 0.0)  # every group named alike: dropping it would take them all
    assert state.drop(0, "x") == [] and not state.dropped


def test_a_waiting_member_whose_heartbeats_stopped_is_not_brought_back_by_a_quorum_it_is_not_in():
    state = QuorumState(min_replicas=1, join_timeout_s=60, heartbeat_timeout_s=1)
    formed(state, ["g0:a", "g1:b", "g2:c"], 0.0)
    state.join(member("g2:c"), 0.1)  # c asks, then falls silent (a process stopped); its request waits
    for t in (0.5, 1.0):
        state.heartbeat("g0:a", t)
        state.heartbeat("g1:b", t)
    state.join(member("g0:a"), 1.2)
    state.join(member("g1:b"), 1.2)
    quorum = state.tick(1.2)[0]  # c's heartbeat is 1.1 s old: out
    assert ids(quorum) == ["g0:a", "g1:b"] and quorum.quorum_id == 2
    state.rejoin(member("g2:c"), 1.2)  # (the lighthouse puts the waiting c back among the participants)
    state.join(member("g0:a"), 1.3)
    state.join(member("g1:b"), 1.3)
    again = state.tick(1.3)[0]  # a fast quorum of a and b: c, still silent, stays out
    assert ids(again) == ["g0:a", "g1:b"] and again.quorum_id == 2


def test_a_group_is_known_by_torchfts_rule():
    assert [group_of(r) for r in ("job-1-group0:u", "job-1-group17:u", "replica3:u", "no-digits:x", "7:1", "",
                                  "job-1-group3", "0b1c2d3e-uuid")] == [0, 17, 3, None, 7, None, None, None]


def test_a_lighthouse_started_again_waits_for_the_groups_that_trained_before_its_first_quorum():
    state = QuorumState(min_replicas=1, join_timeout_s=1, heartbeat_timeout_s=60, expect=frozenset({0, 1}),
                        expect_until=30.0)
    state.join(member("g1:b"), 0.0)  # the first manager to ask again: alone, it would form the quorum by itself
    state.join(member("g2:c"), 0.0)  # a group that was stopping (not expected) is no stand-in for group 0
    assert state.tick(0.0)[0] is None and "expecting groups [0, 1]" in state.tick(5.0)[1]
    state.drop(2, "stopping")  # (told again while it stops)
    state.join(member("g0:a"), 6.0)
    assert ids(state.tick(6.0)[0]) == ["g0:a", "g1:b"]
    late = QuorumState(min_replicas=1, join_timeout_s=1, heartbeat_timeout_s=60, expect=frozenset({0, 1}),
                       expect_until=30.0)
    late.join(member("g1:b"), 0.0)  # the other never comes back: not waited for past expect_until
    assert late.tick(29.0)[0] is None and ids(late.tick(30.0)[0]) == ["g1:b"]
    dropped = QuorumState(min_replicas=1, join_timeout_s=1, heartbeat_timeout_s=60, expect=frozenset({0, 1}),
                          expect_until=30.0)
    dropped.join(member("g1:b"), 0.0)
    dropped.drop(0, "its node was lost with the lighthouse")  # judged meanwhile: not waited for
    assert ids(dropped.tick(0.1)[0]) == ["g1:b"]
