"""agent.rankwrap and the supervisor's launch: the wrapper passes a stop on, even one that comes while it starts the
rank; nothing in the job's working directory can stand in for it; ranks get none of the agent's systemd variables;
the rank's own pid and a fatal report reach the rank's status and outlive an agent restart; a slow=F fault reaches
the rank's trainlib."""

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agent import config as agent_config
from agent.collectors.sim import SimBackend
from agent.main import Agent
from agent.supervisor import Supervisor
from phalanx.clock import FakeClock
from phalanx.v1 import common_pb2, local_pb2, node_pb2
from tests.cluster import alive
from tests.grpc_busy import busy_grpc

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

ROOT = str(Path(__file__).resolve().parent.parent)
# The wrapper's own main(), with a Popen that is hit by a SIGTERM as it returns: the agent's stop landing
# while the rank is being started. The rank's pid goes to a file, so the test can look for it.
SCRIPT = """
import os, signal, subprocess, sys
from agent import rankwrap
real = subprocess.Popen
def popen(command):
    child = real(command)
    with open(sys.argv[2], "w") as f:
        f.write(str(child.pid))
    os.kill(os.getpid(), signal.SIGTERM)
    return child
rankwrap.subprocess.Popen = popen
sys.exit(rankwrap.main([sys.argv[1], "--", sys.executable, "-c", "import time; time.sleep(120)"]))
"""


def test_a_stop_that_comes_while_the_rank_starts_still_reaches_the_rank(tmp_path):
    exit_file, pid_file = tmp_path / "exit", tmp_path / "pid"
    wrapper = subprocess.Popen([sys.executable, "-c", SCRIPT, str(exit_file), str(pid_file)], cwd=ROOT,
                               start_new_session=True)
    try:
        assert wrapper.wait(timeout=60) == 128 + signal.SIGTERM
        assert exit_file.read_text().strip() == str(-signal.SIGTERM)  # the rank itself died of it
        rank = int(pid_file.read_text())
        deadline = time.monotonic() + 60
        while alive(rank):
            assert time.monotonic() < deadline, "the rank outlived its wrapper"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(wrapper.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- ranks launched by the supervisor: a workdir that shadows `agent`, the agent's systemd variables,
# -- the rank's own pid, and a fatal report ------------------------------------------------------

# The rank waits for its wrapper's pid file (so the agent can know its pid by then), then writes its pid, cwd
# and environment into a FIFO the test reads: the test waits for that, not for a time.
RANK = """
import json, os, signal, sys, time
if os.environ.get("IGNORE_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
with open(sys.argv[2], "w") as f:
    json.dump({"pid": os.getpid(), "cwd": os.getcwd(), "env": dict(os.environ)}, f)
time.sleep(600)
"""
SYSTEMD_ENV = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1",
               "LISTEN_FDS": "2", "LISTEN_PID": "1", "LISTEN_FDNAMES": "grpc:metrics"}


def shadowing_workdir(tmp_path: Path) -> Path:
    """A job's working directory with its own `agent.py` and `agent/` (a user's, nothing to do with ours)."""
    workdir = tmp_path / "work"
    (workdir / "agent").mkdir(parents=True)
    (workdir / "agent" / "helper.py").write_text("raise SystemExit('the user agent package was imported')\n")
    (workdir / "agent.py").write_text("raise SystemExit('the user agent.py was imported')\n")
    return workdir


def launch(supervisor, tmp_path: Path, workdir: Path, job: str = "job-1", env: dict[str, str] | None = None):
    """Launch one rank of `job` in `workdir`; returns (what the rank said of itself, its record)."""
    fifo = tmp_path / f"{job}.fifo"
    os.mkfifo(fifo)
    pid_file = tmp_path / "state" / "ranks" / f"{job}.g1.r0.pid"
    request = node_pb2.LaunchRanks(job=job, generation=1, workdir=str(workdir),
                                   command=[sys.executable, "-c", RANK, str(pid_file), str(fifo)],
                                   env={"PYTHONPATH": "."},  # as a user may set it: "." is the workdir
                                   ranks=[node_pb2.RankLaunch(rank=0, local_rank=0, gpu=0)])
    supervisor.launch(request, {**os.environ, **(env or {})})
    record = supervisor._ranks[f"{job}.g1.r0"]
    return read_fifo(fifo, record), record


def read_fifo(fifo: Path, record) -> dict:
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready, f"the rank never said it started; its log:\n{Path(record.log).read_text()}"
            chunk = os.read(fd, 1 << 16)
            if not chunk and chunks:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks))


def kill(record) -> None:
    try:
        os.killpg(record.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_workdir_with_its_own_agent_module_does_not_shadow_the_wrapper(tmp_path):
    workdir = shadowing_workdir(tmp_path)
    supervisor = Supervisor(tmp_path / "state", clock=FakeClock())
    said, record = launch(supervisor, tmp_path, workdir)
    try:
        assert said["cwd"] == str(workdir)  # the rank itself runs where the job said
        assert said["env"]["PYTHONPATH"] == "."  # and gets its environment untouched
        supervisor.poll()
        [status] = supervisor.statuses()
        assert status.state == common_pb2.RANK_STATE_RUNNING
    finally:
        kill(record)


def test_ranks_do_not_inherit_the_agents_systemd_variables(tmp_path):
    supervisor = Supervisor(tmp_path / "state", clock=FakeClock())
    said, record = launch(supervisor, tmp_path, tmp_path, env={**SYSTEMD_ENV, "KEEP_ME": "1"})
    try:
        assert not set(SYSTEMD_ENV) & set(said["env"])
        assert said["env"]["KEEP_ME"] == "1"
    finally:
        kill(record)


def test_the_ranks_own_pid_is_learnt_and_survives_an_agent_restart(tmp_path):
    first = Supervisor(tmp_path / "state", clock=FakeClock())
    said, record = launch(first, tmp_path, tmp_path)
    try:
        # the agent dies before it polled once: the record on disk does not know the rank's pid yet
        restarted = Supervisor(tmp_path / "state", clock=FakeClock())
        assert [r.key for r in restarted.adopt()] == ["job-1.g1.r0"]
        [status] = restarted.statuses()
        assert (status.pid, status.rank_pid) == (record.pid, said["pid"])
        assert psutil.Process(status.rank_pid).ppid() == status.pid  # the wrapper's child
        again = Supervisor(tmp_path / "state", clock=FakeClock())  # and once more, now from the record
        again.adopt()
        assert again.statuses()[0].rank_pid == said["pid"]
    finally:
        kill(record)


def test_a_fatal_report_goes_up_on_the_ranks_status_and_survives_an_agent_restart(tmp_path):
    cfg = agent_config.AgentConfig(node_name="node-f", state_dir=str(tmp_path / "state"), snapshot_dir="",
                                   checkpoint_dir=str(tmp_path), nvrx_socket="")
    agent = Agent(cfg, SimBackend(1, "node-f", seed=1), clock=FakeClock())
    said, record = launch(agent.supervisor, tmp_path, tmp_path)
    reason = "checkpoint directory /ckpt/job-1 is not shared by the job's nodes"

    async def report_and_beat():
        await agent.local_service().Report(local_pb2.ReportRequest(job="job-1", generation=1, rank=0, fatal=reason),
                                           None)
        return await agent.heartbeat(1.0)

    try:
        beat = asyncio.run(report_and_beat())
        [status] = beat.ranks
        assert (status.fatal, status.rank_pid, status.state) == (reason, said["pid"], common_pb2.RANK_STATE_RUNNING)
        restarted = Supervisor(tmp_path / "state", clock=FakeClock())
        restarted.adopt()
        assert restarted.statuses()[0].fatal == reason
    finally:
        kill(record)


def test_a_slow_fault_reaches_the_ranks_trainlib_until_another_fault_replaces_it(tmp_path):
    cfg = agent_config.AgentConfig(node_name="node-f", state_dir=str(tmp_path / "state"),
                                   checkpoint_dir=str(tmp_path), nvrx_socket="")
    agent = Agent(cfg, SimBackend(1, "node-f", seed=1), clock=FakeClock())
    _, record = launch(agent.supervisor, tmp_path, tmp_path)

    def factor() -> float:
        return asyncio.run(agent.local_service().Report(local_pb2.ReportRequest(job="job-1", generation=1, rank=0),
                                                        None)).slow_factor

    try:
        assert factor() == 0.0
        assert agent._inject(node_pb2.InjectFault(gpu_index=0, fault="slow=0.5")) == \
            "node-f: slow=0.5 on GPU 0 (ranks 0)"
        assert factor() == 0.5
        agent._inject(node_pb2.InjectFault(gpu_index=0, fault="slow-bursts=0.5"))  # SIGSTOP bursts instead
        assert factor() == 0.0
        agent._inject(node_pb2.InjectFault(gpu_index=0, fault="slow=0.2"))
        agent.supervisor.stop("job-1", 1, grace_s=30)
        assert factor() == 0.0
    finally:
        kill(record)


def test_a_rank_that_ignores_sigterm_is_killed_when_the_grace_period_has_passed_on_the_clock(tmp_path):
    clock = FakeClock()
    supervisor = Supervisor(tmp_path / "state", clock=clock)
    _, record = launch(supervisor, tmp_path, tmp_path, env={"IGNORE_SIGTERM": "1"})
    wrapper = supervisor._children[record.pid]
    try:
        assert supervisor.stop("job-1", 0, grace_s=30) == "stopping 1 ranks of job-1"
        clock.advance(29.9)
        assert wrapper.poll() is None  # SIGTERM only, so far: the rank ignores it, its wrapper waits for it
        clock.advance(0.2)
        assert wrapper.wait(timeout=60) == -signal.SIGKILL
        supervisor.poll()
        assert supervisor.statuses()[0].state == common_pb2.RANK_STATE_EXITED
    finally:
        kill(record)


def test_a_launch_of_a_generation_told_to_stop_is_refused(tmp_path):
    """A controller that dies after sending a launch: its successor stops the generation, and the launch,
    should it arrive only now, must not start ranks beside the next generation."""
    supervisor = Supervisor(tmp_path / "state", clock=FakeClock())
    assert supervisor.stop("job-1", 2, grace_s=0) == "stopping 0 ranks of job-1 generation 2"
    for generation in (1, 2):
        request = node_pb2.LaunchRanks(job="job-1", generation=generation, command=["true"],
                                       ranks=[node_pb2.RankLaunch(rank=0, local_rank=0, gpu=0)])
        with pytest.raises(ValueError, match=f"job-1 generation {generation} was told to stop here"):
            supervisor.launch(request, dict(os.environ))
    assert supervisor._ranks == {}
    supervisor.stop("job-2", 0, grace_s=0)  # "every generation" (a cancel of an unknown job) fences nothing ahead
    assert supervisor._stopped == {"job-1": 2}


def test_pinned_ranks_start_whole_from_a_process_busy_with_grpc(tmp_path):
    # The agent pinned ranks with a preexec_fn: in a process with gRPC's threads, most such children died of
    # SIGSEGV before their exec (43 of 60 here). The wrapper pins itself now.
    cpu = min(os.sched_getaffinity(0))  # one this test may run on (a container may not have CPU 0)
    supervisor = Supervisor(tmp_path / "state", cpus_for_gpu={0: [cpu]}, clock=FakeClock())
    said = "import os, sys\nopen(sys.argv[1], 'w').write(repr(sorted(os.sched_getaffinity(0))))\n"
    with busy_grpc():
        for n in range(12):
            out = tmp_path / f"cpus-{n}"
            supervisor.launch(node_pb2.LaunchRanks(job=f"job-{n}", generation=1, workdir=str(tmp_path),
                                                   command=[sys.executable, "-c", said, str(out)],
                                                   ranks=[node_pb2.RankLaunch(rank=0, local_rank=0, gpu=0)]),
                              dict(os.environ))
            record = supervisor._ranks[f"job-{n}.g1.r0"]
            code = supervisor._children[record.pid].wait(timeout=120)
            assert code == 0, f"launch {n}: the wrapper ended with {code}: {Path(record.log).read_text()}"
            assert out.read_text() == f"[{cpu}]"


def test_a_rank_the_wrapper_cannot_pin_runs_unpinned_and_says_so(tmp_path):
    exit_file = tmp_path / "r0.exit"
    wrapper = str(Path(ROOT) / "agent" / "rankwrap.py")
    done = subprocess.run([sys.executable, "-I", wrapper, str(exit_file), "--cpus", "4095", "--", sys.executable, "-c",
                           "print('ran')"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "ran\n" and exit_file.read_text().strip() == "0"
    assert "rank not pinned to CPUs 4095" in done.stderr
