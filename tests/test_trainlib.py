"""trainlib inside a rank: the per-step hook, the shim outside Phalanx, NCCL defaults, SIGUSR1.

Each case runs in a fresh interpreter: trainlib keeps per-process state, as a rank would.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from phalanx.v1 import local_pb2, rendezvous_pb2_grpc
from tests.fake_agent import serving
from trainlib._runtime import STALE_EXIT_CODE

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


def run(code: str, env: dict[str, str] | None = None, prefix: list[str] | None = None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCH_NCCL_", "TORCH_FR_"))}
    full_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="tl-ckpt-") as scratch:  # under Phalanx, init writes a marker there
        full_env.setdefault("PHALANX_CHECKPOINT_DIR", scratch)
        return subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, env=full_env, timeout=120)


UNDER_PHALANX = {"PHALANX_JOB": "job-7", "PHALANX_GENERATION": "3", "RANK": "1", "WORLD_SIZE": "4",
                 "LOCAL_RANK": "1"}


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_the_step_hook_makes_no_system_call(tmp_path):
    trace = tmp_path / "trace"
    result = run("""
        import os, trainlib
        trainlib.init()
        for i in range(70_000):  # past one lap of the ring
            trainlib.step(i)
        os.write(2, b"BEGIN\\n")
        for i in range(100_000):
            trainlib.compute_done()
            trainlib.step(i)
            trainlib.checkpoint_requested()
        os.write(2, b"END\\n")
    """, UNDER_PHALANX, prefix=["strace", "-f", "-o", str(trace)])
    assert result.returncode == 0, result.stderr
    lines = trace.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if "BEGIN" in line)
    end = next(i for i, line in enumerate(lines) if "END" in line)
    assert end > begin
    assert lines[begin + 1:end] == []


def test_outside_phalanx_it_is_a_shim_with_one_warning(tmp_path):
    result = run("""
        import warnings, trainlib
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = trainlib.init()
            trainlib.init()
        print(len(caught), str(caught[0].message))
        print(ctx.active, ctx.rank, ctx.world_size, ctx.generation)
        for i in range(10):
            trainlib.compute_done()
            trainlib.step(i)
        print(trainlib.checkpoint_requested())
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("1 trainlib: not running under Phalanx (no PHALANX_JOB)")
    assert lines[1:] == ["False 0 1 1", "False"]


def test_under_phalanx_it_reads_the_environment_and_sets_nccl_defaults():
    result = run("""
        import os, trainlib
        ctx = trainlib.init()
        print(ctx.active, ctx.job, ctx.generation, ctx.rank, ctx.local_rank, ctx.world_size)
        print(os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"], os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"])
        print(os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"], os.environ.get("TORCH_FR_BUFFER_SIZE"))
    """, {**UNDER_PHALANX, "TORCH_NCCL_TRACE_BUFFER_SIZE": "77"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True job-7 3 1 1 4", "1 1", "77 None"]  # the user's own value wins


# A process group of one (gloo) is enough: torch reads the flight recorder's settings, and warns about a
# deprecated name, when it creates one, whatever the backend.
PROCESS_GROUP = """
    import os, sys, trainlib
    from datetime import timedelta
    trainlib.init()
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1],
                            timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(2))
    dist.destroy_process_group()
    print(os.environ.get("TORCH_FR_BUFFER_SIZE"), os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
"""


def run_process_group(env: dict[str, str]):
    from phalanx.ports import free_port
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCH_NCCL_", "TORCH_FR_"))}
    full_env.update(env)
    with tempfile.TemporaryDirectory(prefix="tl-ckpt-") as scratch:  # under Phalanx, init writes a marker there
        full_env.setdefault("PHALANX_CHECKPOINT_DIR", scratch)
        return subprocess.run([sys.executable, "-c", textwrap.dedent(PROCESS_GROUP), str(free_port())],
                              capture_output=True, text=True, env=full_env, timeout=120)


def test_only_the_flight_recorder_name_torch_reads_is_set_and_torch_does_not_warn():
    result = run_process_group(UNDER_PHALANX)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["2000 None"]  # torch 2.13 reads TORCH_FR_BUFFER_SIZE
    assert "deprecated" not in result.stderr, result.stderr


def test_a_flight_recorder_size_the_user_set_under_the_new_name_is_kept_alone():
    result = run_process_group({**UNDER_PHALANX, "TORCH_FR_BUFFER_SIZE": "64"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["64 None"]
    assert "deprecated" not in result.stderr, result.stderr


def test_sigusr1_is_a_checkpoint_request():
    result = run("""
        import os, signal, trainlib
        trainlib.init()
        seen = []
        trainlib.on_checkpoint_request(seen.append)
        print(trainlib.checkpoint_requested())
        os.kill(os.getpid(), signal.SIGUSR1)
        print(trainlib.checkpoint_requested(), seen)
    """, UNDER_PHALANX)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["False", "True [0]"]


def test_a_request_that_arrives_past_its_agreed_step_says_so():
    """A rank that hears a request after the step the ranks agreed on saves a later step than those that heard it
    in time, and their saves wait for each other: trainlib says so in the rank's log, with what to change."""
    result = run("""
        import trainlib
        from trainlib import _runtime
        trainlib.init()
        for i in range(30):
            trainlib.step(i)
        _runtime._heed_request(5, 40, False)  # in time: nothing to say
        _runtime._heed_request(6, 20, False)  # step 29 already done
        print(trainlib.checkpoint_requested())
    """, UNDER_PHALANX)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True"]
    late = [line for line in result.stderr.splitlines() if "checkpoint request" in line]
    assert late == ["trainlib: checkpoint request 6 (after step 20) reached rank 1 only at step 29: its save will "
                    "not match the other ranks' (recovery.checkpoint_lead_s may be too short for this machine)"]


def test_a_script_that_handles_sigusr1_itself_keeps_its_handler():
    result = run("""
        import os, signal, trainlib
        signal.signal(signal.SIGUSR1, lambda *a: print("mine"))
        trainlib.init()
        os.kill(os.getpid(), signal.SIGUSR1)
        print(trainlib.checkpoint_requested())
    """, UNDER_PHALANX)
    assert result.stdout.splitlines() == ["mine", "False"]


@pytest.fixture
def agent():
    with serving() as fake:
        yield fake


def start_rank(code: str, env: dict[str, str]) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCH_NCCL_", "TORCH_FR_"))}
    full_env.update(env)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env)


def test_a_rank_told_its_generation_is_stale_stops_even_while_blocked_in_training(agent, tmp_path):
    rank = start_rank("""
        import threading, trainlib
        trainlib.init()
        trainlib.step(0)
        print("training", flush=True)
        threading.Event().wait()  # blocked for good, like a collective whose peers are gone
    """, {**UNDER_PHALANX, "PHALANX_AGENT_SOCKET": str(agent.socket), "PHALANX_CHECKPOINT_DIR": str(tmp_path)})
    try:
        assert rank.stdout.readline() == "training\n"
        assert agent.reported.wait(60), "the rank never reported"
        agent.stale.set()
        _out, err = rank.communicate(timeout=60)
    finally:
        rank.kill()
    assert rank.returncode == STALE_EXIT_CODE, err
    assert err.splitlines() == [
        f"trainlib: generation 3 of job-7 is no longer current (a newer generation runs); rank 1 (pid {rank.pid}) "
        f"stops now without another step or checkpoint (exit code {STALE_EXIT_CODE})"]


def test_a_stale_rank_commits_no_checkpoint(tmp_path):
    # The moment between the agent's answer and the end of the process: a save started then writes nothing.
    result = run("""
        import trainlib, trainlib._runtime as runtime
        from trainlib.checkpoint import StaleGenerationError
        trainlib.init()
        runtime._stale = True
        try:
            trainlib.save({"w": 1}, 5)
        except StaleGenerationError as e:
            print(e)
    """, {**UNDER_PHALANX, "WORLD_SIZE": "1", "RANK": "0", "PHALANX_CHECKPOINT_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["generation 3 is no longer current; refusing to save step 5"]
    assert not list(tmp_path.glob("step-*"))


def test_a_save_marks_the_rank_as_saving_for_its_reports_while_it_writes(monkeypatch):
    """The hang detector holds off while a rank writes a checkpoint: the reporter thread sends `saving`."""
    from trainlib import _runtime

    seen = []

    class Recorder:
        def save(self, state, step):
            seen.append(_runtime._saving)
            if step == 6:
                raise OSError("disk full")
            return "committed"

    monkeypatch.setattr(_runtime, "_checkpoint", lambda: Recorder())
    monkeypatch.setattr(_runtime, "_check_shared", lambda: None)
    monkeypatch.setattr(_runtime, "checkpoint_requested", lambda: False)
    assert _runtime.save({}, 5) == "committed"
    with pytest.raises(OSError, match="disk full"):
        _runtime.save({}, 6)
    assert seen == [True, True] and _runtime._saving is False


class FakeTime:
    """The clock trainlib's hooks read, in virtual time: a sleep moves it on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def time_ns(self) -> int:
        return int(self.now * 1e9)


def test_a_slow_fault_stretches_each_steps_compute_or_the_whole_step_when_none_is_marked(monkeypatch):
    from trainlib import _runtime
    clock = FakeTime()
    monkeypatch.setattr(_runtime, "time", clock)
    for name, value in (("_last_end", clock.now), ("_compute_mark", 0.0), ("_head", _runtime._head),
                        ("_steps_seen", _runtime._steps_seen), ("_last_step", _runtime._last_step), ("_slow", 0.5)):
        monkeypatch.setattr(_runtime, name, value)

    def last_sample() -> tuple[float, float]:
        slot = (_runtime._head - 1) % _runtime.RING
        return _runtime._ring_compute_s[slot], _runtime._ring_step_s[slot]

    clock.now += 0.020  # compute
    _runtime.compute_done()
    clock.now += 0.004  # the gradient sync: not the GPU's work
    _runtime.step(0)
    assert last_sample() == (pytest.approx(0.030), pytest.approx(0.034))
    clock.now += 0.020  # a script that marks no compute
    _runtime.step(1)
    assert last_sample() == (0.0, pytest.approx(0.030))
    _runtime._slow = 0.0  # the fault ended: the hooks sleep no more
    slept = len(clock.slept)
    clock.now += 0.020
    _runtime.compute_done()
    clock.now += 0.004
    _runtime.step(2)
    assert last_sample() == (pytest.approx(0.020), pytest.approx(0.024)) and len(clock.slept) == slept


def test_the_slow_factor_in_the_agents_reply_reaches_the_hooks(agent, monkeypatch, tmp_path):
    from trainlib import _runtime
    monkeypatch.setattr(_runtime, "_ctx", _runtime.Context(
        active=True, job="job-7", generation=3, rank=1, local_rank=1, world_size=4, checkpoint_dir=str(tmp_path),
        agent_socket=str(agent.socket)))
    for name in ("_stub", "_slow", "_tail"):
        monkeypatch.setattr(_runtime, name, getattr(_runtime, name))
    _runtime._stub = None
    agent.slow_factor = 0.5
    _runtime._flush()
    assert _runtime._slow == 0.5
    agent.slow_factor = 0.0
    _runtime._flush()
    assert _runtime._slow == 0.0


def test_a_stale_answer_about_a_generation_the_rank_has_left_does_not_end_it(agent, monkeypatch, tmp_path):
    """trainlib.run: the reporter asked about generation 3 and the answer, stale, came back after the rank had parked
    and rejoined generation 4 in the same process. It is news about the old generation: the rank trains on. (CI saw
    a rejoined rank end with exit code 75 a tenth of a second into its new generation.)"""
    import threading

    from trainlib import _runtime

    def generation(number: int):
        return _runtime.Context(active=True, job="job-7", generation=number, rank=1, local_rank=1, world_size=4,
                                checkpoint_dir=str(tmp_path), agent_socket=str(agent.socket))

    monkeypatch.setattr(_runtime, "_ctx", generation(3))
    for name in ("_stub", "_tail", "_stale", "_parked"):
        monkeypatch.setattr(_runtime, name, getattr(_runtime, name))
    _runtime._stub = None
    exits = []
    monkeypatch.setattr(_runtime.os, "_exit", exits.append)
    agent.stale.set()
    agent.gate = threading.Event()
    reporter = threading.Thread(target=_runtime._flush)
    reporter.start()
    assert agent.reported.wait(60), "the report never reached the agent"
    _runtime._ctx = generation(4)  # what _next_generation does once the agent hands over the new environment
    agent.gate.set()
    reporter.join(60)
    assert exits == [] and not _runtime._stale
    _runtime._flush()  # stale about the generation it is in: that ends it
    assert exits == [STALE_EXIT_CODE] and _runtime._stale


def under_phalanx_with_snapshots(agent, monkeypatch, tmp_path):
    """This process as rank 1 of job-7 generation 3, its agent `agent`, snapshots every 4 steps."""
    from trainlib import _runtime
    monkeypatch.setattr(_runtime, "_ctx", _runtime.Context(
        active=True, job="job-7", generation=3, rank=1, local_rank=1, world_size=4, checkpoint_dir=str(tmp_path),
        agent_socket=str(agent.socket)))
    for name in ("_stub", "_snapshotter", "_requested", "_request_id", "_pause_after", "_at_step", "_last_step",
                 "_handled", "_head", "_eviction_said", "_steps_seen", "_last_end", "_deadline", "_no_in_memory",
                 "_tail", "_slow"):
        monkeypatch.setattr(_runtime, name, getattr(_runtime, name))
    _runtime._stub, _runtime._snapshotter, _runtime._handled = None, None, set()
    monkeypatch.setattr(_runtime, "EVICTION_WAIT_S", 0.0)  # no stop is coming here
    monkeypatch.setenv("PHALANX_SNAPSHOT_DIR", str(tmp_path / "snapshots"))
    monkeypatch.setenv("PHALANX_SNAPSHOT_EVERY", "4")
    return _runtime


@pytest.mark.parametrize("outcome", ["committed", "replica not kept", "another rank's not kept"])
def test_an_eviction_checkpoint_is_answered_by_the_snapshot_of_the_agreed_step(agent, monkeypatch, tmp_path, capsys,
                                                                              outcome):
    """A checkpoint request before an eviction (pause) is answered by the in-memory snapshot of the agreed step,
    taken whatever the snapshot interval: the rank asks its agent whether the replica is kept, the ranks agree
    that every one's is, and only then does each commit it (no durable save). If any rank's is not kept, no rank
    commits in memory: the request stays for every rank's save() to answer durably."""
    import torch

    runtime = under_phalanx_with_snapshots(agent, monkeypatch, tmp_path)
    votes = []
    monkeypatch.setattr(runtime, "_agreement", lambda: lambda ok: votes.append(ok) or (
        ok and outcome != "another rank's not kept"))
    agent.done_error = "its replica was not kept by node-b within 10s" if outcome == "replica not kept" else ""
    for step in range(6):
        runtime.step(step)
        runtime.snapshot({"w": torch.tensor([step])}, step)
    runtime._snapshotter.wait()
    assert [r.step for r in agent.snapshots] == [0, 4]
    runtime._heed_request(9, 6, True)
    runtime.step(6)
    assert runtime.snapshot(lambda: {"w": torch.tensor([6])}, 6)  # step 6 is no multiple of 4: taken for the request
    assert [r.step for r in agent.snapshots] == [0, 4, 6]
    assert torch.load(agent.snapshots[-1].path)["w"].tolist() == [6]
    asked = [(d.request_id, d.step, d.in_memory, d.check_only) for d in agent.done]
    assert 9 < agent.done[0].wait_s <= 10  # no deadline said: the agent's own limit
    err = capsys.readouterr().err
    if outcome == "committed":
        assert votes == [True] and asked == [(9, 6, True, True), (9, 6, True, False)]
        assert not runtime.checkpoint_requested() and 9 in runtime._handled
        assert "step 6 committed in host memory, replicated; waiting to be stopped" in err
        return
    assert asked == [(9, 6, True, True)]  # asked whether it could, never committed
    assert runtime.checkpoint_requested()  # every rank's save() answers it, durably
    assert votes == [outcome != "replica not kept"]
    why = "its replica was not kept by node-b within 10s" if outcome == "replica not kept" else \
        "another rank could not keep its snapshot of step 6"
    assert f"checkpoint request 9 is not answered in memory ({why}); every rank saves durably" in err, err


def test_a_rank_that_keeps_no_snapshots_still_votes_on_an_eviction_checkpoint(agent, monkeypatch, tmp_path, capsys):
    """Its agent keeps no snapshots (no PHALANX_SNAPSHOT_DIR): it votes no, rather than leaving the others waiting
    in the collective."""
    runtime = under_phalanx_with_snapshots(agent, monkeypatch, tmp_path)
    monkeypatch.delenv("PHALANX_SNAPSHOT_DIR")
    votes = []
    monkeypatch.setattr(runtime, "_agreement", lambda: lambda ok: votes.append(ok) or ok)
    runtime._heed_request(9, 6, True)
    runtime.step(6)
    assert not runtime.snapshot({"w": 1}, 6)
    assert votes == [False] and not agent.done and runtime.checkpoint_requested()
    assert "(this node keeps no snapshots); every rank saves durably" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["no peer", "past its deadline", "due in 4s"])
def test_an_eviction_checkpoint_leaves_the_durable_save_its_time_and_skips_a_snapshot_that_cannot_be_kept(
        agent, monkeypatch, tmp_path, capsys, case):
    """The ranks wait for their replicas until half the time left to commit has passed (the rest is for the durable
    save, should any rank's fail), and a rank whose agent says the job has no peer node for the replica writes
    nothing: it votes for the durable save at once. Both come with the request in the agent's reply."""
    import torch

    runtime = under_phalanx_with_snapshots(agent, monkeypatch, tmp_path)
    votes = []
    monkeypatch.setattr(runtime, "_agreement", lambda: lambda ok: votes.append(ok) or ok)
    no_peer = "job-7 has no peer node on which to keep a replica"
    due_in_s = {"no peer": 30.0, "past its deadline": -1.0, "due in 4s": 4.0}[case]
    agent.checkpoint = local_pb2.CheckpointRequest(id=9, at_step=6, pause=True, deadline_s=30.0,
                                                   due_unix_ns=time.time_ns() + int(due_in_s * 1e9),
                                                   no_in_memory=no_peer if case == "no peer" else "")
    runtime._flush()
    runtime.step(6)
    taken = runtime.snapshot(lambda: {"w": torch.tensor([6])}, 6)
    err = capsys.readouterr().err
    if case == "due in 4s":
        assert taken and votes == [True] and [d.check_only for d in agent.done] == [True, False]
        assert 0 < agent.done[0].wait_s <= 2.0  # half of the 4 s, less the write
        return
    assert not taken and not agent.snapshots and not agent.done and votes == [False]
    assert runtime.checkpoint_requested()  # every rank's save() answers it
    why = no_peer if case == "no peer" else "the checkpoint's deadline has passed"
    assert f"checkpoint request 9 is not answered in memory ({why}); every rank saves durably" in err, err


def test_an_eviction_checkpoint_is_saved_durably_when_the_job_says_so(agent, monkeypatch, tmp_path, capsys):
    import torch

    runtime = under_phalanx_with_snapshots(agent, monkeypatch, tmp_path)
    monkeypatch.setenv("PHALANX_EVICTION_CHECKPOINT", "durable")
    runtime._heed_request(9, 6, True)
    runtime.step(6)
    assert not runtime.snapshot({"w": torch.tensor([6])}, 6)  # not due, and not asked to answer the request
    assert runtime.checkpoint_requested() and not agent.snapshots and not agent.done
    monkeypatch.setenv("PHALANX_EVICTION_CHECKPOINT", "disk")
    assert runtime._eviction_in_memory() and runtime._eviction_in_memory()
    assert capsys.readouterr().err.count("PHALANX_EVICTION_CHECKPOINT='disk' is not one of memory, durable") == 1



def test_destroying_the_process_group_says_at_once_that_training_has_ended(agent, tmp_path):
    """Issue 40: the end of a job (a barrier, a final save, the teardown, the exit) makes no step progress; unless
    the controller hears that training ended, it judges the end a hang. The script is a user's, as written: it calls
    dist.destroy_process_group(), nothing of Phalanx's. The report is in before the call returns."""
    rank = start_rank(f"""
        import threading, torch.distributed as dist, trainlib
        trainlib.init()
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        trainlib.step(0)
        dist.destroy_process_group()
        print("destroyed", flush=True)
        threading.Event().wait()  # not exiting: the exit would say it too
    """, {**UNDER_PHALANX, "WORLD_SIZE": "1", "PHALANX_AGENT_SOCKET": str(agent.socket),
          "PHALANX_CHECKPOINT_DIR": str(tmp_path)})
    try:
        assert rank.stdout.readline() == "destroyed\n", rank.stderr.read()
        assert [r.finished for r in agent.reports if r.finished], [r.finished for r in agent.reports]
    finally:
        rank.kill()
        rank.communicate()


def test_a_step_after_the_end_undoes_it_and_the_exit_says_it_again(agent, monkeypatch, tmp_path):
    from trainlib import _runtime
    monkeypatch.setattr(_runtime, "_ctx", _runtime.Context(
        active=True, job="job-7", generation=3, rank=1, local_rank=1, world_size=4, checkpoint_dir=str(tmp_path),
        agent_socket=str(agent.socket)))
    for name in ("_stub", "_tail", "_head", "_finished_head", "_last_step", "_steps_seen", "_last_end"):
        monkeypatch.setattr(_runtime, name, getattr(_runtime, name))
    _runtime._stub = None
    _runtime.finish()
    assert agent.reports[-1].finished
    _runtime.step(5)  # a script that made a new process group and trains on
    _runtime._flush()
    assert not agent.reports[-1].finished and agent.reports[-1].steps[-1].step == 5
    _runtime._flush_at_exit()
    assert agent.reports[-1].finished


def test_a_process_group_destroyed_on_the_way_out_of_an_exception_or_an_uncaught_one_is_no_end_of_training(
        agent, tmp_path):
    """`try: train() finally: dist.destroy_process_group()` after a collective failed (a peer died), then the
    uncaught exception: a crash, which the controller must recover, not the end of training."""
    rank = start_rank(f"""
        import torch.distributed as dist, trainlib
        trainlib.init()
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        trainlib.step(0)
        try:
            raise RuntimeError("Connection closed by peer")
        finally:
            dist.destroy_process_group()
    """, {**UNDER_PHALANX, "WORLD_SIZE": "1", "PHALANX_AGENT_SOCKET": str(agent.socket),
          "PHALANX_CHECKPOINT_DIR": str(tmp_path)})
    _out, err = rank.communicate(timeout=120)
    assert rank.returncode == 1 and "Connection closed by peer" in err, err
    assert agent.reports and not any(r.finished for r in agent.reports), [r.finished for r in agent.reports]


class RecordingRendezvous(rendezvous_pb2_grpc.RendezvousServiceServicer):
    """The controller's rendezvous service as a torchrun worker's trainlib sees it: records each ReportWorker."""

    def __init__(self) -> None:
        self.reports: list = []

    def ReportWorker(self, request, context):
        from phalanx.v1 import rendezvous_pb2
        self.reports.append(request)
        return rendezvous_pb2.WorkerReply()


@pytest.mark.parametrize("ending", ["destroy", "exit", "crash"])
def test_a_torchrun_workers_end_of_training_reaches_the_rendezvous_before_it_exits(tmp_path, ending):
    """Issue 40 for torchrun: a worker's end of training (destroy_process_group, or the exit of `sys.exit(main())`)
    is told to the controller's rendezvous at once, so that the round's end is no hang; an uncaught exception
    is not the end of training."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    recorder = RecordingRendezvous()
    rendezvous_pb2_grpc.add_RendezvousServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    end = {"destroy": "dist.destroy_process_group()\n            print('destroyed', flush=True)\n"
                      "            threading.Event().wait()",
           "exit": "return 0",
           "crash": "raise RuntimeError('Connection closed by peer')"}[ending]
    worker = start_rank(f"""
        import sys, threading, torch.distributed as dist, trainlib

        def main():
            trainlib.init()
            dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
            for step in range(3):
                trainlib.step(step)
            {end}

        sys.exit(main())
    """, {"PHALANX_RDZV_RUN": "r", "PHALANX_RDZV_ROUND": "1", "PHALANX_RDZV_ENDPOINT": f"127.0.0.1:{port}",
          "TORCHELASTIC_RUN_ID": "r", "PHALANX_INSECURE": "1", "RANK": "0", "WORLD_SIZE": "1",
          "PHALANX_NODE": "h1", "PHALANX_CHECKPOINT_DIR": str(tmp_path)})
    try:
        if ending == "destroy":
            assert worker.stdout.readline() == "destroyed\n", worker.stderr.read()
        else:
            _out, err = worker.communicate(timeout=120)
            assert worker.returncode == (0 if ending == "exit" else 1), err
        said = [(r.step, r.finished) for r in recorder.reports]
        if ending == "crash":
            assert not any(finished for _, finished in said), said
        else:
            assert said and said[-1] == (2, True), said
    finally:
        worker.kill()
        worker.communicate()
        server.stop(None)
