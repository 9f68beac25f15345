"""How `phalanx job` shows a job's ranks: the table for people and the JSON for scripts."""

import time

import pytest

from cli.render import job_dict, job_text, seconds_in_state
from phalanx.v1 import common_pb2

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def a_job() -> common_pb2.Job:
    return common_pb2.Job(
        id="job-3", state=common_pb2.JOB_STATE_RUNNING, generation=2, nodes=["node-0", "node-1"],
        spec=common_pb2.JobSpec(command=["python", "train.py"], nodes=2, ranks_per_node=1),
        ranks=[common_pb2.RankInfo(rank=0, node="node-0", gpu=0, state=common_pb2.RANK_STATE_RUNNING, pid=4242,
                                   wrapper_pid=4240, generation=2),
               common_pb2.RankInfo(rank=1, node="node-1", gpu=0, state=common_pb2.RANK_STATE_UNSPECIFIED,
                                   wrapper_pid=5150, generation=2)])  # not started yet: only its wrapper is known


def test_job_json_gives_the_ranks_pid_and_its_wrappers():
    ranks = job_dict(a_job())["ranks"]
    assert [(r["rank"], r["pid"], r["wrapper_pid"]) for r in ranks] == [(0, 4242, 4240), (1, None, 5150)]


def test_job_table_shows_the_ranks_pid_and_its_wrappers():
    lines = job_text(a_job()).splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["RANK"])
    assert lines[header].split() == ["RANK", "NODE", "GPU", "STATE", "PID", "WRAPPER", "EXIT"]
    assert lines[header + 1].split() == ["0", "node-0", "0", "RUNNING", "4242", "4240", "-"]
    assert lines[header + 2].split() == ["1", "node-1", "0", "-", "-", "5150", "-"]


def test_a_hang_culprit_named_by_the_flight_recorder_is_shown_and_in_the_json():
    job = a_job()
    job.incident, job.incident_kind = "rank 1 made no progress for 9.0s", "hang"
    job.culprit.CopyFrom(common_pb2.HangCulprit(rank=1, node="node-1", process_group="0", op="nccl:all_reduce",
                                                seq=41, state="started", peers_seq=41))
    assert "  culprit:     rank 1 on node-1: stuck at collective 41 (nccl:all_reduce, started) while its peers " \
           "reached 41 (NCCL flight recorder)" in job_text(job).splitlines()
    d = job_dict(job)
    assert d["incident_kind"] == "hang" and d["hang_culprit"]["op"] == "nccl:all_reduce"
    assert job_dict(a_job())["hang_culprit"] is None
    assert not any(line.startswith("  culprit:") for line in job_text(a_job()).splitlines())


def test_the_time_spent_in_each_state_is_shown_as_the_json_gives_it():
    job = a_job()
    job.phase_times.add(phase="RUNNING", seconds=754.2)
    job.phase_times.add(phase="RESTARTING", seconds=1.234)
    assert "  in state:    RUNNING 13m, RESTARTING 1.2s" in job_text(job).splitlines()
    assert job_dict(job)["seconds_in_state"] == {"RUNNING": 754.2, "RESTARTING": 1.234}
    assert not any(line.startswith("  in state:") for line in job_text(a_job()).splitlines())


def test_the_time_in_each_state_counts_the_current_state_so_far_but_not_a_finished_jobs():
    job = a_job()
    job.phase_times.add(phase="STARTING", seconds=2.5)
    job.state_since_unix_ns = 1_000_000_000
    assert seconds_in_state(job, now_ns=9_000_000_000) == {"STARTING": 2.5, "RUNNING": 8.0}
    job.phase_times.add(phase="RUNNING", seconds=4.0)  # it ran before: the time adds up
    assert seconds_in_state(job, now_ns=9_000_000_000) == {"STARTING": 2.5, "RUNNING": 12.0}
    job.state = common_pb2.JOB_STATE_SUCCEEDED
    assert seconds_in_state(job, now_ns=9_000_000_000) == {"STARTING": 2.5, "RUNNING": 4.0}
    running = a_job()
    running.state_since_unix_ns = time.time_ns()
    assert any(line.startswith("  in state:    RUNNING ") for line in job_text(running).splitlines())


def test_a_job_whose_rank_table_is_packed_is_shown_with_every_rank_as_one_in_rows():
    """A job of 1,024 ranks or more comes from the API with its rank table packed (Job.packed_ranks, Job.ranks
    empty): `phalanx job` shows and gives the same ranks as for the same table in rows."""
    from phalanx import ranks as ranktable

    rows = a_job()
    packed = common_pb2.Job()
    packed.CopyFrom(rows)
    ranktable.build(packed, common_pb2.RANK_STATE_UNSPECIFIED, packed_from=1)
    ranktable.set_states(packed, {0: (common_pb2.RANK_STATE_RUNNING, 0)})
    ranktable.set_pids(packed, 0, 4242, 4240)
    ranktable.set_pids(packed, 1, 0, 5150)
    assert ranktable.is_packed(packed) and not packed.ranks
    assert job_dict(packed)["ranks"] == job_dict(rows)["ranks"] and job_dict(packed)["world_size"] == 2
    assert job_text(packed) == job_text(rows)


def test_a_replica_group_jobs_lighthouse_is_shown_and_in_the_json():
    job = common_pb2.Job(id="job-1", spec=common_pb2.JobSpec(nodes=2, ranks_per_node=1, replicas=2),
                         nodes=["a", "b"], lighthouse_port=29510, lighthouse_host="10.0.0.1",
                         lighthouse_token="secret")
    job.groups.add(index=0)
    job.groups.add(index=1)
    assert job_dict(job)["lighthouse"] == "http://10.0.0.1:29510"
    assert "  lighthouse:  http://10.0.0.1:29510" in job_text(job) and "secret" not in job_text(job)
    job.lighthouse_host = "fd00::1"
    assert job_dict(job)["lighthouse"] == "http://[fd00::1]:29510"
    assert job_dict(common_pb2.Job(id="job-2"))["lighthouse"] is None
