"""The agent's side of trainlib's reports: folded per heartbeat, and nothing kept for ranks that went quiet."""

import asyncio

from agent.local_server import LocalService, LocalState
from phalanx.v1 import local_pb2


def report(service, job, generation, rank, *steps):
    request = local_pb2.ReportRequest(job=job, generation=generation, rank=rank,
                                      steps=[local_pb2.StepSample(step=s, step_s=0.5, compute_s=0.25) for s in steps])
    return asyncio.run(service.Report(request, None))


def test_progress_is_folded_per_heartbeat_and_quiet_ranks_are_forgotten():
    state = LocalState()
    service = LocalService(state, current_generation=lambda job: None, send=lambda message: None)
    report(service, "job-1", 1, 0, 1, 2)
    report(service, "job-1", 1, 0, 3)
    for rank in range(1000):  # ranks of an older generation, reported once each
        report(service, "job-1", 0, rank)
    first = state.drain()
    mine = next(p for p in first if p.generation == 1)
    assert (mine.last_step, mine.steps, mine.reports, mine.mean_step_s) == (3, 3, 2, 0.5)
    assert len(first) == 1001
    report(service, "job-1", 1, 0)  # a report without a finished step: still alive
    assert [(p.rank, p.steps, p.reports) for p in state.drain()] == [(0, 0, 1)]
    assert list(state.progress) == [("job-1", 1, 0)]  # the quiet ones are gone
    assert state.drain() == [] and state.progress == {}


def test_a_fatal_report_is_handed_on_to_the_ranks_status():
    told = []
    service = LocalService(LocalState(), current_generation=lambda job: 1, send=lambda message: None,
                           fatal=lambda job, generation, rank, reason: told.append((job, generation, rank, reason))
                           or True)
    report(service, "job-1", 1, 0, 5)
    asyncio.run(service.Report(local_pb2.ReportRequest(job="job-1", generation=1, rank=0, fatal="disk not shared"),
                               None))
    assert told == [("job-1", 1, 0, "disk not shared")]


def test_a_rank_writing_a_checkpoint_says_so_in_the_heartbeats_progress():
    state = LocalState()
    service = LocalService(state, current_generation=lambda job: None, send=lambda message: None)
    asyncio.run(service.Report(local_pb2.ReportRequest(job="job-1", generation=1, rank=0, saving=True), None))
    assert [(p.rank, p.saving) for p in state.drain()] == [(0, True)]
    asyncio.run(service.Report(local_pb2.ReportRequest(job="job-1", generation=1, rank=0), None))
    assert [(p.rank, p.saving) for p in state.drain()] == [(0, False)]


def test_a_slow_fault_on_a_ranks_gpu_reaches_that_rank_in_its_report_reply():
    slowed = {("job-1", 1, 1): 0.5}
    service = LocalService(LocalState(), current_generation=lambda job: 1, send=lambda message: None,
                           slow_factor=lambda job, generation, rank: slowed.get((job, generation, rank), 0.0))
    assert [report(service, "job-1", 1, rank, 5).slow_factor for rank in (0, 1)] == [0.0, 0.5]
    slowed.clear()  # the fault ended (its rank was stopped, or hangs instead)
    assert report(service, "job-1", 1, 1, 6).slow_factor == 0.0
