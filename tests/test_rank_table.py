"""The agent's rank records as a table (agent/rank_table.py): every look's decision, without processes."""

from __future__ import annotations

import pytest

from agent.rank_table import Action, RankState, Seen, check, decide, state_of

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

KEEP = 600.0


def test_a_running_rank_is_watched_until_its_process_is_gone_then_ends_as_its_exit_says():
    assert decide(RankState.RUNNING, Seen(alive=True), KEEP) == (RankState.RUNNING, (Action.LEARN_RANK_PID,))
    assert decide(RankState.RUNNING, Seen(alive=True, knows_rank_pid=True), KEEP) == (RankState.RUNNING, ())
    assert decide(RankState.RUNNING, Seen(alive=False, exit_code=0, knows_rank_pid=True), KEEP) == \
        (RankState.EXITED, (Action.END, Action.CLEAR_CGROUP))
    assert decide(RankState.RUNNING, Seen(alive=False, exit_code=-9), KEEP)[0] is RankState.EXITED
    # gone, and nothing says how: lost (its node reports it so; the controller decides what follows)
    assert decide(RankState.RUNNING, Seen(alive=False), KEEP) == \
        (RankState.LOST, (Action.LEARN_RANK_PID, Action.END, Action.CLEAR_CGROUP))


def test_an_ended_rank_is_kept_for_the_controller_to_hear_of_then_dropped():
    for state in (RankState.EXITED, RankState.LOST):
        assert decide(state, Seen(alive=False, age_s=10.0), KEEP) == (state, ())
        assert decide(state, Seen(alive=False, age_s=10.0, has_cgroup=True), KEEP) == (state, (Action.CLEAR_CGROUP,))
        assert decide(state, Seen(alive=False, age_s=KEEP + 1), KEEP) == (state, (Action.DROP,))


def test_an_ended_rank_never_runs_again():
    assert state_of(None, False) is RankState.RUNNING
    assert state_of(3, False) is RankState.EXITED and state_of(None, True) is RankState.LOST
    for ended in (RankState.EXITED, RankState.LOST):
        with pytest.raises(ValueError, match="cannot go from"):
            check(ended, RankState.RUNNING)
