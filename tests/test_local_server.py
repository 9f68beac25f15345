"""The agent's side of trainlib's reports: folded per heartbeat, and nothing kept for ranks that went quiet."""

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from agent import local_server
from agent.local_server import LocalService, LocalState
from phalanx.v1 import local_pb2, node_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


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


def test_watch_pushes_a_request_the_moment_it_arrives_and_ends_when_the_generation_is_stale():
    current = {"job-1": 1}

    async def scenario():
        state = LocalState()
        service = LocalService(state, current_generation=current.get, send=lambda message: None)
        stream = service.Watch(local_pb2.WatchRequest(job="job-1", generation=1, rank=0), None)
        first = await anext(stream)
        assert not first.stale and not first.checkpoint.id  # nothing wanted yet: said once, at the start
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing changed: nothing pushed
        state.ask(node_pb2.RequestCheckpoint(job="job-2", generation=1, request_id=9))  # another job's
        state.ask(node_pb2.RequestCheckpoint(job="job-1", generation=1, request_id=4, at_step=120, pause=True))
        pushed = await waiting
        assert (pushed.checkpoint.id, pushed.checkpoint.at_step, pushed.checkpoint.pause) == (4, 120, True)
        current["job-1"] = 2
        state.notify()  # a newer generation was launched
        assert (await anext(stream)).stale
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(scenario())


def test_a_rank_hears_a_request_by_push_without_waiting_for_its_next_report(tmp_path):
    """The rank's reports are an hour apart here: only the Watch stream can bring the request."""
    state = LocalState()
    service = LocalService(state, current_generation=lambda job: 3, send=lambda message: None)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="ls-") as short:
        socket = Path(short) / "agent.sock"
        server = asyncio.run_coroutine_threadsafe(local_server.serve(socket, service), loop).result(30)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCH_"))}
        env.update({"PHALANX_JOB": "job-1", "PHALANX_GENERATION": "3", "RANK": "0", "WORLD_SIZE": "1",
                    "PHALANX_AGENT_SOCKET": str(socket), "PHALANX_CHECKPOINT_DIR": str(tmp_path)})
        rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
            import time, trainlib, trainlib._runtime as runtime
            runtime.REPORT_INTERVAL_S = 3600.0
            trainlib.init()
            print("ready", flush=True)
            step = 0
            while not trainlib.checkpoint_requested():
                trainlib.step(step)
                step += 1
                time.sleep(0.005)
            print("requested", runtime._request_id, runtime._at_step, flush=True)
        """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert rank.stdout.readline() == "ready\n"
            asyncio.run_coroutine_threadsafe(wait_for_watcher(service), loop).result(60)
            loop.call_soon_threadsafe(state.ask, node_pb2.RequestCheckpoint(job="job-1", generation=3, request_id=7,
                                                                            at_step=1))
            out, err = rank.communicate(timeout=60)
        finally:
            rank.kill()
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
    assert rank.returncode == 0, err
    assert out.splitlines()[-1] == "requested 7 1"


async def wait_for_watcher(service: LocalService) -> None:
    while not service.watchers:
        await asyncio.sleep(0.01)


def test_a_slow_fault_on_a_ranks_gpu_reaches_that_rank_in_its_report_reply():
    slowed = {("job-1", 1, 1): 0.5}
    service = LocalService(LocalState(), current_generation=lambda job: 1, send=lambda message: None,
                           slow_factor=lambda job, generation, rank: slowed.get((job, generation, rank), 0.0))
    assert [report(service, "job-1", 1, rank, 5).slow_factor for rank in (0, 1)] == [0.0, 0.5]
    slowed.clear()  # the fault ended (its rank was stopped, or hangs instead)
    assert report(service, "job-1", 1, 1, 6).slow_factor == 0.0


def test_one_jobs_flood_of_events_is_cut_and_every_other_jobs_get_through():
    """Issue 39: any rank could flood Tell and push other tenants' checkpoint acks and results out of the agent's
    outbox. Each job gets TELL_BURST at once and TELL_RATE a second; the others are untouched."""
    emitted = []
    service = LocalService(LocalState(), current_generation=lambda job: 1, send=lambda message: None,
                           emit=lambda kind, message, **labels: emitted.append(labels["job"]))

    async def flood():
        for i in range(5000):
            await service.Tell(local_pb2.TellRequest(job="greedy", rank=0, kind="x", message=str(i)), None)
        await service.Tell(local_pb2.TellRequest(job="quiet", rank=0, kind="x", message="hello"), None)

    asyncio.run(flood())
    assert "quiet" in emitted
    # what a burst allows, plus what the rate refilled while the loop ran (far below the 5000 sent)
    assert local_server.TELL_BURST <= emitted.count("greedy") < local_server.TELL_BURST + 1000


def test_on_a_node_that_runs_ranks_only_as_accounts_the_shared_socket_speaks_for_no_job():
    """Issue 39: the shared socket trusts the job named in a request; any member of socket_group could speak for a
    job that runs as the agent's user. A node with agent_user_ranks = false has no such job: it answers none."""
    class Context:
        async def abort(self, code, details):
            raise PermissionError(details)

    service = LocalService(LocalState(), current_generation=lambda job: 1, send=lambda message: None)
    closed = local_server.shared(service, agent_user_jobs=False)
    with pytest.raises(PermissionError, match="agent_user_ranks = false"):
        asyncio.run(closed.Report(local_pb2.ReportRequest(job="job-1", generation=1, rank=0), Context()))
    open_ = local_server.shared(service)
    assert asyncio.run(open_.Report(local_pb2.ReportRequest(job="job-1", generation=1, rank=0), Context())) is not None
