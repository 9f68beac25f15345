"""The agent's rank records as a table (agent/rank_table.py): every look's decision, and whether a launch, a park
or a stop goes ahead and what it touches, without processes."""

from __future__ import annotations

import dataclasses

import pytest

from agent import rank_table
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


def test_a_launch_is_fenced_below_a_stopped_generation_and_refused_for_what_the_node_cannot_do():
    ask = rank_table.LaunchAsk("job-1", 3, stopped=3, warm_pool=True)
    assert "generation 3 was told to stop here (generation 3)" in rank_table.admit(ask).refusal
    assert rank_table.admit(dataclasses.replace(ask, stopped=2)) == rank_table.Admission(warm=True)
    assert "no command" in rank_table.admit(dataclasses.replace(ask, stopped=0, has_command=False)).refusal
    assert "rank 1 of job-1 generation 3 already runs" in rank_table.admit(
        dataclasses.replace(ask, stopped=0, running=(1,))).refusal
    assert rank_table.admit(dataclasses.replace(ask, stopped=0, account_refusal="root ranks are off here")).refusal \
        == "job-1: root ranks are off here"
    assert "cannot give ranks a cgroup: cgroup v1" in rank_table.admit(
        dataclasses.replace(ask, stopped=0, limits=True, no_cgroups="cgroup v1")).refusal


def test_standbys_serve_only_ranks_that_run_as_the_agents_user_without_limits():
    ask = rank_table.LaunchAsk("job-1", 1, warm_pool=True)
    assert rank_table.admit(ask).warm
    for cold in ({"as_account": True}, {"limits": True}, {"open_files": True}, {"warm_pool": False}):
        assert not rank_table.admit(dataclasses.replace(ask, **cold)).warm, cold


def test_only_a_running_ranks_own_process_parks_and_a_stop_of_every_generation_releases_the_parked():
    assert rank_table.may_park("job-1", 2, 0, alive=True, rank_pid=41, pid=41) == ""
    assert rank_table.may_park("job-1", 2, 0, alive=True, rank_pid=0, pid=41) == ""  # not known yet: its word
    assert "pid 99 is not rank 0's process (pid 41)" in rank_table.may_park("job-1", 2, 0, True, 41, 99)
    assert "does not run here" in rank_table.may_park("job-1", 2, 0, False, 41, 41)
    live = [("job-1.g2.r0", "job-1", 2), ("job-1.g3.r0", "job-1", 3), ("job-2.g1.r0", "job-2", 1)]
    parked = [("job-1", 0), ("job-2", 1)]
    assert rank_table.stop_plan("job-1", 2, 1, live, parked) == rank_table.StopPlan(2, ("job-1.g2.r0",), ())
    assert rank_table.stop_plan("job-1", 2, 5, live, parked).stopped == 5  # fencing never goes back
    assert rank_table.stop_plan("job-1", 0, 3, live, parked) == rank_table.StopPlan(
        3, ("job-1.g2.r0", "job-1.g3.r0"), (0,))
