"""`make demo` checks that the story it tells took place: the failure seen four runs in four (the agreed checkpoint
step past the end of the run, the job simply finished) must fail the demo, naming what did not happen."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

spec = importlib.util.spec_from_file_location("demo", Path(__file__).resolve().parent.parent / "examples" / "demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def event(kind: str, message: str) -> dict:
    return {"kind": kind, "message": message, "job": "job-1"}


RECOVERED = [
    event("job.running", "job-1 generation 1 running: 2 ranks, MASTER_ADDR=127.0.0.1 MASTER_PORT=1"),
    event("job.checkpoint", "job-1: checkpoint 1 requested from 2 ranks after step 124 (...)"),
    event("job.checkpointed", "job-1: every rank committed step 124 (4.31s after the request)"),
    event("job.evicting", "job-1: every rank committed step 124 in 4.31s; evicting node-1"),
    event("job.rendezvous", "job-1: generation 1 stopped; choosing nodes for the next"),
    event("job.restarting", "job-1 generation 2 on node-0, node-2 (spare node-2 taken; restart 1, replacing node-1: "
                            "not counted toward max_restarts, after 0s)"),
    event("job.running", "job-1 generation 2 running: 2 ranks, MASTER_ADDR=127.0.0.1 MASTER_PORT=2"),
    event("job.succeeded", "job-1 SUCCEEDED: every rank exited 0"),
]


def test_a_recovery_that_took_place_passes_every_check():
    final = {"state": "SUCCEEDED", "evicted": ["node-1"], "nodes": ["node-0", "node-2"]}
    resumed = {0: "rank 0: resumed from step 124 (generation 2)", 1: "rank 1: resumed from step 124 (generation 2)"}
    parts, committed = demo.story("job-1", "node-1", "node-2", final, RECOVERED, resumed)
    assert committed == 124
    assert [what for what, ok, _ in parts if not ok] == []


def test_a_job_that_simply_finished_fails_every_part_of_the_story():
    events = [RECOVERED[0], event("job.checkpoint", "job-1: checkpoint 1 requested from 2 ranks after step 171"),
              event("job.succeeded", "job-1 SUCCEEDED: every rank exited 0")]
    final = {"state": "SUCCEEDED", "evicted": [], "nodes": ["node-0", "node-1"]}
    parts, committed = demo.story("job-1", "node-1", "node-2", final, events, {0: "", 1: ""})
    assert committed is None
    assert [what for what, ok, _ in parts if not ok] == [
        "checkpoint committed by every rank before the eviction", "failing node node-1 evicted",
        "restart on the spare node-2", "every rank resumed from the committed step"]


def test_a_resume_from_another_step_than_the_committed_one_is_caught():
    final = {"state": "SUCCEEDED", "evicted": ["node-1"], "nodes": ["node-0", "node-2"]}
    resumed = {0: "rank 0: resumed from step 99 (generation 2)", 1: "rank 1: resumed from step 99 (generation 2)"}
    parts, _ = demo.story("job-1", "node-1", "node-2", final, RECOVERED, resumed)
    assert [what for what, ok, _ in parts if not ok] == ["every rank resumed from the committed step"]
