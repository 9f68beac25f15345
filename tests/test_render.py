"""How `phalanx job` shows a job's ranks: the table for people and the JSON for scripts."""

from phalanx.cli.render import job_dict, job_text
from phalanx.v1 import common_pb2


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
