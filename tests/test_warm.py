"""Warm starts (agent.warm, agent/warmstart.py) with real processes: a standby imports ahead and then runs the rank
as `python PROGRAM` would (argv, environment, sys.path, __main__, exit status, signals), reports its pid and exit
like the cold wrapper; the supervisor hands launches to standbys of the same recipe and starts cold otherwise; a
standby that cannot start turns its recipe cold, once."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from agent import rankwrap
from agent.supervisor import Supervisor
from agent.warm import COLD_AFTER, HOLD_S, QUIET_S, WarmPool, recipe, split_command
from phalanx.clock import FakeClock
from phalanx.v1 import common_pb2, node_pb2
from tests.eventually import eventually
from tests.grpc_busy import busy_grpc

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

PY = sys.executable
# A module that says, once, which process imported it: the standby (ahead) or the rank (cold).
HEAVY = "import os, sys\nwith open(os.environ['IMPORTED_BY'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n"
SCRIPT = """
import json, os, sys
import heavy
out = {"argv": sys.argv, "rank": os.environ.get("RANK"), "path0": sys.path[0], "name": __name__,
       "cwd": os.getcwd(), "pid": os.getpid(), "policy": os.sched_getscheduler(0)}
with open(os.environ["SAID"], "w") as f:
    json.dump(out, f)
if os.environ.get("HOLD"):
    import time
    time.sleep(120)
sys.exit(int(os.environ.get("CODE", "0")))
"""


def wait_until(predicate, what: str, timeout: float = 120.0):
    return eventually(predicate, what, timeout, interval=0.02)


@pytest.fixture
def job_dir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "heavy.py").write_text(HEAVY)
    (work / "train.py").write_text(SCRIPT)
    return work


def base_env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "IMPORTED_BY": str(tmp_path / "imported"),
            "PHALANX_WARM_IMPORTS": "heavy", "SAID": str(tmp_path / "said.json")}


def warm_ready(pool: WarmPool, job: str, count: int = 1) -> None:
    def ready():
        pool.tend(set())
        return pool.counts().get(job, (0, 0))[0] >= count
    wait_until(ready, f"{count} standbys of {job} to be ready")


def test_split_command_takes_python_programs_only():
    assert split_command([PY, "-u", "train.py", "--lr", "3"]) == ((PY, "-u"), ("train.py", "--lr", "3"))
    assert split_command(["python3.11", "-X", "dev", "-m", "pkg.main", "a"]) == (("python3.11", "-X", "dev"),
                                                                                 ("-m", "pkg.main", "a"))
    assert split_command(["python", "-c", "print(1)"]) == (("python",), ("-c", "print(1)"))
    for cold in (["torchrun", "train.py"], ["sh", "-c", "python x.py"], ["python"], ["python", "-i", "x.py"],
                 ["python", "-m"], ["python", "-"], ["python", "-X"], []):
        assert split_command(cold) is None, cold


def test_a_recipe_leaves_out_what_changes_between_launches():
    one = recipe("j", ["python", "t.py"], {"A": "1", "RANK": "0", "MASTER_PORT": "1", "PHALANX_GENERATION": "1"}, "/w")
    two = recipe("j", ["python", "t.py"], {"A": "1", "RANK": "3", "MASTER_PORT": "2", "PHALANX_GENERATION": "2"}, "/w")
    assert one == two and one.env == (("A", "1"),)
    assert recipe("j", ["python", "t.py"], {"A": "2"}, "/w") != one  # the job's own environment does count
    assert recipe("j", ["python", "t.py"], {"PHALANX_WARM_START": "0"}, "/w") is None


def test_a_standby_imports_ahead_and_then_runs_the_program_as_python_would(tmp_path, job_dir):
    pool = WarmPool(tmp_path / "state", FakeClock())
    env = base_env(tmp_path)
    kind = recipe("j", [PY, "train.py", "--x", "1"], env, str(job_dir))
    pool.want(kind, 1)
    try:
        warm_ready(pool, "j")
        standby = pool.take(kind)
        assert standby is not None and pool.take(kind) is None
        ahead = (tmp_path / "imported").read_text().split()
        assert ahead == [str(standby.proc.pid)]  # imported by the standby, before it had a rank
        if os.geteuid() == 0:  # it imports on CPU time nobody else wants
            assert os.sched_getscheduler(standby.proc.pid) == os.SCHED_IDLE
        exit_file = tmp_path / "r0.exit"
        pool.assign(standby, {"env": {**env, "RANK": "0", "CODE": "3"}, "cwd": str(job_dir),
                                  "log": str(tmp_path / "r0.log"), "exit_file": str(exit_file), "cpus": []})
        assert standby.proc.wait(timeout=120) == 3
        assert exit_file.read_text().strip() == "3"
        said = __import__("json").loads((tmp_path / "said.json").read_text())
        assert said["argv"] == ["train.py", "--x", "1"] and said["rank"] == "0" and said["name"] == "__main__"
        assert said["path0"] == str(job_dir) and said["cwd"] == str(job_dir)
        assert said["policy"] == os.SCHED_OTHER  # and the rank runs as any other
        assert int(Path(rankwrap.pid_path(str(exit_file))).read_text()) == said["pid"] != standby.proc.pid
        assert (tmp_path / "imported").read_text().split() == ahead  # not imported again by the rank
    finally:
        pool.close()


@pytest.mark.parametrize("program", [["-m", "train"], ["-c", "import runpy; runpy.run_path('train.py', "
                                                                  "run_name='__main__')"]])
def test_a_standby_runs_modules_and_code_too(tmp_path, job_dir, program):
    assert run_warm(tmp_path, job_dir, [PY, *program], base_env(tmp_path))["name"] == "__main__"


def run_warm(tmp_path: Path, job_dir: Path, command: list[str], env: dict[str, str]):
    """Run `command` once as a warm rank (a standby made ready, then assigned); what it wrote to $SAID."""
    assert assign_warm(tmp_path, job_dir, command, env) == 0, (tmp_path / "log").read_text()
    return __import__("json").loads((tmp_path / "said.json").read_text())


def assign_warm(tmp_path: Path, job_dir: Path, command: list[str], env: dict[str, str]) -> int:
    """Run `command` once as a warm rank, its log in tmp_path/log and its exit file tmp_path/exit; its exit status."""
    pool = WarmPool(tmp_path / "state", FakeClock())
    kind = recipe("j", command, env, str(job_dir))
    pool.want(kind, 1)
    try:
        warm_ready(pool, "j")
        standby = pool.take(kind)
        pool.assign(standby, {"env": env, "cwd": str(job_dir), "log": str(tmp_path / "log"),
                              "exit_file": str(tmp_path / "exit"), "cpus": []})
        return standby.proc.wait(timeout=120)
    finally:
        pool.close()


ENDINGS = {  # how the script ends -> (exit status, what its log must say)
    "sys.exit(main())": ("import sys\ndef main():\n    return 4\nsys.exit(main())\n", 4, ""),
    "sys.exit('message')": ("import sys\nsys.exit('cannot go on')\n", 1, "cannot go on"),
    "uncaught exception": ("raise ValueError('bad batch')\n", 1, "ValueError: bad batch"),
    "falls off the end": ("x = 1\n", 0, ""),
}
ENDING_PRELUDE = """
import atexit, os, threading, time
atexit.register(lambda: open(os.environ['SAID'] + '.atexit', 'w').close())
def late():
    time.sleep(0.3)
    open(os.environ['SAID'] + '.thread', 'w').close()
threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it before its atexit handlers
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(max_workers=1)  # as trainlib's snapshot writer: its idle worker ends at the interpreter's
pool.submit(lambda: None).result()  # threading hook, or the process never exits
class Teardown:
    def __del__(self, open=open, path=os.environ['SAID'] + '.teardown'):  # only the interpreter's teardown of this
        open(path, 'w').close()  # module calls it (bound here: by then the module's builtins may be gone)
kept = Teardown()
left_open = open(os.environ['SAID'] + '.open', 'w')  # never closed: what it holds is written out at the end all
left_open.write('text in the buffer')  # the same, as the interpreter's teardown does
left_open_binary = open(os.environ['SAID'] + '.open-binary', 'wb')
left_open_binary.write(b'bytes in the buffer')
import gzip, sys
left_open_gzip = gzip.open(os.environ['SAID'] + '.gz', 'wt')  # its close writes the gzip trailer
left_open_gzip.write('compressed')
class Tee:  # a stdout of the script's own, which flushes nothing: what the real one holds is written out all the same
    def write(self, text):
        return sys.__stdout__.write(text)
    def flush(self):
        pass
sys.stdout = Tee()
print('said through a stdout of its own')
"""


def assert_ended_as_python_would(tmp_path: Path, log: str) -> None:
    """What a script of ENDING_PRELUDE leaves behind (and in its `log`), ended as `python end.py` would end it but
    without the interpreter's teardown."""
    import gzip
    assert gzip.decompress((tmp_path / "said.json.gz").read_bytes()) == b"compressed"
    assert "said through a stdout of its own" in log
    assert (tmp_path / "said.json.thread").exists() and (tmp_path / "said.json.atexit").exists()
    assert (tmp_path / "said.json.open").read_text() == "text in the buffer"
    assert (tmp_path / "said.json.open-binary").read_bytes() == b"bytes in the buffer"
    assert not (tmp_path / "said.json.teardown").exists()  # left by os._exit, not torn down


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_warm_started_rank_ends_as_python_would_without_the_interpreters_teardown(tmp_path, job_dir, ending):
    """Issue 40: a warm rank is a forked child of the standby; it ends with the script's exit status, its non-daemon
    threads joined and its atexit handlers run (trainlib says there that training ended), and then leaves by
    os._exit: no teardown of every module the standby imported, nor torch's static destructors (which can abort)."""
    code, expected_status, said = ENDINGS[ending]
    (job_dir / "end.py").write_text(ENDING_PRELUDE + code)
    assert assign_warm(tmp_path, job_dir, [PY, "end.py"], base_env(tmp_path)) == expected_status
    assert (tmp_path / "exit").read_text().strip() == str(expected_status)
    assert said in (tmp_path / "log").read_text()
    assert_ended_as_python_would(tmp_path, (tmp_path / "log").read_text())


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_cold_started_python_rank_ends_as_a_warm_one_does(tmp_path, job_dir, ending):
    """A rank started cold runs `python end.py` through warmstart.py --run: the same exit status, threads joined and
    atexit handlers run, and no interpreter teardown (torch's static destructors abort a script that has ended now and
    then: SIGABRT in place of its `sys.exit(main())`)."""
    code, expected_status, said = ENDINGS[ending]
    (job_dir / "end.py").write_text(ENDING_PRELUDE + code)
    supervisor = Supervisor(tmp_path / "state", clock=FakeClock())
    request = node_pb2.LaunchRanks(job="j", generation=1, command=[PY, "end.py"], workdir=str(job_dir),
                                   ranks=[node_pb2.RankLaunch(rank=0, env={"RANK": "0"})])
    supervisor.launch(request, base_env(tmp_path))
    [ended] = wait_until(lambda: supervisor.poll(), "the rank to end")
    assert ended.exit_code == expected_status and not ended.warm
    assert said in Path(ended.log).read_text()
    assert_ended_as_python_would(tmp_path, Path(ended.log).read_text())


@pytest.mark.parametrize("script", ["shows.py", "missing.py"])
def test_a_program_run_by_warmstart_sees_what_python_would_show_it(tmp_path, script):
    """`warmstart.py --run -- script.py ARGS` against `python script.py ARGS`, in the same directory: the same
    argv, __file__ (absolute), sys.path[0], __name__, output and exit status; a script that is not there, python's
    message and status 2."""
    import subprocess

    from agent.warm import WARMSTART
    (tmp_path / "shows.py").write_text("import sys\nprint(sys.argv, __file__, sys.path[0], __name__)\nsys.exit(5)\n")
    plain = subprocess.run([PY, script, "a", "b"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    ran = subprocess.run([PY, WARMSTART, "--run", "--", script, "a", "b"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert (ran.returncode, ran.stdout, ran.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert plain.returncode == (5 if script == "shows.py" else 2)


def test_a_stop_reaches_a_warm_started_rank_and_its_end_is_written_down(tmp_path, job_dir):
    pool = WarmPool(tmp_path / "state", FakeClock())
    env = base_env(tmp_path)
    kind = recipe("j", [PY, "train.py"], env, str(job_dir))
    pool.want(kind, 1)
    try:
        warm_ready(pool, "j")
        standby = pool.take(kind)
        exit_file = tmp_path / "exit"
        pool.assign(standby, {"env": {**env, "HOLD": "1"}, "cwd": str(job_dir), "log": str(tmp_path / "log"),
                                  "exit_file": str(exit_file), "cpus": []})
        wait_until((tmp_path / "said.json").exists, "the rank to start")
        os.kill(standby.proc.pid, signal.SIGTERM)  # to the wrapper alone, as the supervisor's stop does
        assert standby.proc.wait(timeout=120) == 128 + signal.SIGTERM
        assert exit_file.read_text().strip() == str(-signal.SIGTERM)
    finally:
        pool.close()


def test_a_recipe_whose_standbys_keep_dying_turns_cold_once(tmp_path, job_dir):
    said = []
    pool = WarmPool(tmp_path / "state", FakeClock(), on_cold=lambda job, why: said.append((job, why)))
    kind = recipe("j", [PY, "train.py"], {**base_env(tmp_path), "PYTHONHOME": "/nonexistent"}, str(job_dir))
    pool.want(kind, 2)
    wait_until(lambda: pool.tend(set()) or said, "the standby's death to be noticed")
    for _ in range(3):
        pool.tend(set())
    assert len(said) == 1 and said[0][0] == "j" and "3 standbys in a row died" in said[0][1]
    assert pool._serial == COLD_AFTER  # one death is not enough: it was replaced, twice
    assert pool.counts().get("j", (0, 0)) == (0, 0)  # and no other is tried
    pool.close()


def test_standbys_wait_for_a_launch_to_settle_and_go_when_no_longer_wanted(tmp_path, job_dir):
    clock = FakeClock()
    pool = WarmPool(tmp_path / "state", clock)
    kind = recipe("j", [PY, "train.py"], base_env(tmp_path), str(job_dir))
    pool.launching()
    pool.want(kind, 1)
    pool.tend(set())
    assert pool.counts() == {}  # a launch is younger than QUIET_S
    clock.advance(QUIET_S)
    warm_ready(pool, "j")
    [standby] = pool._standbys[kind]
    clock.advance(HOLD_S / 2)
    pool.tend({"j"})  # its ranks run here: held on
    clock.advance(HOLD_S * 0.9)
    pool.tend(set())
    assert pool.counts() == {"j": (1, 1)}
    clock.advance(HOLD_S)
    pool.tend(set())
    assert pool.counts() == {} and standby.proc.poll() is not None


def test_a_job_that_ends_lets_its_standbys_go_at_once(tmp_path, job_dir):
    clock = FakeClock()
    pool = WarmPool(tmp_path / "state", clock)
    ours, other = (recipe(job, [PY, "train.py"], base_env(tmp_path), str(job_dir)) for job in ("j", "k"))
    pool.want(ours, 1)
    pool.want(other, 1)
    warm_ready(pool, "j")
    warm_ready(pool, "k")
    [standby] = pool._standbys[ours]
    assert pool.release("j") == 1  # a final stop (the job cancelled): not HOLD_S later
    assert standby.proc.poll() is not None and set(pool.counts()) == {"k"}
    pool.tend(set())
    assert set(pool.counts()) == {"k"}  # not wanted any more: no new standby of j starts
    assert pool.release("j") == 0
    pool.close()


def launch(job_dir: Path, generation: int, env: dict[str, str]) -> node_pb2.LaunchRanks:
    return node_pb2.LaunchRanks(job="j", generation=generation, command=[PY, "train.py"], env=env,
                                workdir=str(job_dir), ranks=[node_pb2.RankLaunch(rank=0, env={"RANK": "0"})])


def test_the_supervisor_starts_the_next_generation_warm(tmp_path, job_dir):
    clock = FakeClock()
    pool = WarmPool(tmp_path / "state", clock)
    supervisor = Supervisor(tmp_path / "state", clock=clock, warm=pool)
    env = base_env(tmp_path)
    try:
        assert "warm" not in supervisor.launch(launch(job_dir, 1, {"PHALANX_GENERATION": "1"}), env)
        wait_until(lambda: supervisor.poll(), "generation 1 to end")
        clock.advance(QUIET_S)
        warm_ready(pool, "j")
        message = supervisor.launch(launch(job_dir, 2, {"PHALANX_GENERATION": "2", "MASTER_PORT": "9"}), env)
        assert "1 warm" in message
        [ended] = wait_until(lambda: supervisor.poll(), "generation 2 to end")
        assert ended.generation == 2 and ended.warm and ended.exit_code == 0
        assert "(warm)" in Path(ended.log).read_text().splitlines()[-1]
        assert len((tmp_path / "imported").read_text().split()) == 2  # generation 1's rank, then the standby
        [status] = [s for s in supervisor.statuses() if s.generation == 2]
        assert status.rank_pid and status.rank_pid != status.pid  # the rank is the standby's child
    finally:
        pool.close()


def test_a_spare_prepared_by_the_controller_holds_standbys(tmp_path, job_dir):
    pool = WarmPool(tmp_path / "state", FakeClock())
    supervisor = Supervisor(tmp_path / "state", clock=FakeClock(), warm=pool)
    env = base_env(tmp_path)
    try:
        said = supervisor.prepare(node_pb2.PrepareRanks(job="j", command=[PY, "train.py"], workdir=str(job_dir),
                                                        count=2, hold_s=60), env)
        assert said == "holding 2 standbys of j"
        warm_ready(pool, "j", 2)
        cold = supervisor.prepare(node_pb2.PrepareRanks(job="k", command=["sh", "run.sh"], count=1), env)
        assert "start cold" in cold
    finally:
        pool.close()


def test_no_standby_runs_the_code_of_a_job_that_runs_as_another_account(tmp_path, job_dir):
    """A standby imports the job's program (and what lies beside it) as the agent's user, root on a node: a job
    that runs as a tenant's account must never get one, whatever the controller asks (issue 39)."""
    pool = WarmPool(tmp_path / "state", FakeClock())
    supervisor = Supervisor(tmp_path / "state", clock=FakeClock(), warm=pool)
    try:
        said = supervisor.prepare(node_pb2.PrepareRanks(job="j", command=[PY, "train.py"], workdir=str(job_dir),
                                                        count=2, hold_s=60, run_as="phx-alice"), base_env(tmp_path))
        assert "start cold" in said and "phx-alice" in said
        pool.tend({"j"})  # where the standbys wanted are started
        assert pool.counts() == {}
    finally:
        pool.close()


def test_a_parked_rank_rejoins_the_next_launch_here_or_is_told_to_exit(tmp_path, job_dir):
    """trainlib.run's side is in test_recovery_e2e; this is the agent's: the parked rank's generation ends in its
    record at once, the next launch of its rank hands the process the new environment, and a park nothing claims
    is answered after the agent's park_hold_s."""
    from phalanx.v1 import common_pb2, local_pb2
    clock = FakeClock()
    supervisor = Supervisor(tmp_path / "state", clock=clock, park_hold_s=7.0)
    env = {**base_env(tmp_path), "HOLD": "1"}
    supervisor.launch(launch(job_dir, 1, {"PHALANX_GENERATION": "1"}), env)
    try:
        def rank_pid():
            supervisor.poll()
            return next(s.rank_pid for s in supervisor.statuses())
        pid = wait_until(rank_pid, "the rank's pid")
        answers = []

        def deliver(environment, why):
            answers.append((environment, why))
            return True
        park = local_pb2.ParkRequest(job="j", generation=1, rank=0, pid=pid, exit_code=1, reason="RuntimeError")
        assert supervisor.park(local_pb2.ParkRequest(job="j", generation=1, rank=0, pid=pid + 1), deliver) == \
            f"pid {pid + 1} is not rank 0's process (pid {pid})"
        assert supervisor.park(local_pb2.ParkRequest(job="j", generation=3, rank=0, pid=pid), deliver).startswith(
            "rank 0 of j generation 3 does not run here")
        assert supervisor.park(park, deliver) == ""
        [ended] = supervisor.statuses()
        assert (ended.state, ended.exit_code) == (common_pb2.RANK_STATE_EXITED, 1)  # the generation is over here
        supervisor.launch(launch(job_dir, 2, {"PHALANX_GENERATION": "2"}), env)
        [(given, _)] = answers
        assert given["PHALANX_GENERATION"] == "2" and given["RANK"] == "0"
        current = next(s for s in supervisor.statuses() if s.generation == 2)
        assert current.state == common_pb2.RANK_STATE_RUNNING and current.rank_pid == pid  # the same process
        assert supervisor.park(local_pb2.ParkRequest(job="j", generation=2, rank=0, pid=pid), deliver) == ""
        clock.advance(6.9)
        assert answers[-1][0] is not None  # not yet
        clock.advance(0.1)
        assert answers[-1] == (None, "no generation of j was launched here with rank 0 within 7s (park_hold_s)")
    finally:
        for status in supervisor.statuses():
            try:
                os.killpg(status.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_standbys_start_whole_from_a_process_busy_with_grpc(tmp_path, job_dir):
    # Standbys were put under SCHED_IDLE by a preexec_fn: in a process with gRPC's threads (the agent), most of
    # them died before their exec (SIGSEGV; SIGABRT on a closed epoll fd), and a recipe could turn cold for it.
    said = []
    pool = WarmPool(tmp_path / "state", FakeClock(), on_cold=lambda job, why: said.append(why))
    kind = recipe("j", [PY, "train.py"], base_env(tmp_path), str(job_dir))
    pool.want(kind, 6)
    try:
        with busy_grpc():  # a child dies, if it does, between fork and exec: while the gRPC calls go on
            for _ in range(6):
                pool._start(kind)

        def ready():  # their imports, at SCHED_IDLE, then need a core nobody else wants: not inside busy_grpc
            pool.tend(set())
            return said or pool.counts().get("j", (0, 0))[0] >= 6
        wait_until(ready, "6 standbys to be ready")
        assert not said and pool._serial == 6  # none died and had to be replaced
        if os.geteuid() == 0:
            assert all(os.sched_getscheduler(s.proc.pid) == os.SCHED_IDLE for s in pool._standbys[kind])
    finally:
        pool.close()


def test_a_standby_imports_what_a_restarted_ranks_first_step_would_otherwise_wait_for(tmp_path, job_dir):
    # torch.optim imports torch._dynamo the first time an optimizer is made: 1.2-1.6 s of the first step here
    (job_dir / "first.py").write_text("import json, os, sys\nahead = sorted(m for m in ('torch', 'torch.distributed', "
                                      "'torch._dynamo', 'trainlib') if m in sys.modules)\n"
                                      "json.dump(ahead, open(os.environ['SAID'], 'w'))\n")
    env = {k: v for k, v in base_env(tmp_path).items() if k != "PHALANX_WARM_IMPORTS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)  # trainlib, as an installed one would be
    ahead = run_warm(tmp_path, job_dir, [PY, "first.py"], env)
    assert ahead == ["torch", "torch._dynamo", "torch.distributed", "trainlib"]


def test_a_rank_whose_record_cannot_be_written_does_not_keep_the_others_from_ending(tmp_path, job_dir):
    """Each rank's look is its own (agent/rank_table.py): a record that cannot be saved (here, one rank's, as a
    full disk would refuse it) fails that look, raised at the end for the agent to say, while the other rank is
    still seen to end. The failed one's end is known at once (the controller hears of it) and written to its
    record at the next look that can."""
    supervisor = Supervisor(tmp_path / "state", clock=FakeClock())
    env = base_env(tmp_path)
    two = node_pb2.LaunchRanks(job="j", generation=1, command=[PY, "train.py"], env=env, workdir=str(job_dir),
                               ranks=[node_pb2.RankLaunch(rank=r, env={"RANK": str(r)}) for r in (0, 1)])
    supervisor.launch(two, env)
    save = supervisor._save
    full = {"on": True}

    def refusing(record):
        if full["on"] and record.rank == 0 and record.exit_code is not None:
            raise OSError(28, "No space left on device")
        save(record)
    supervisor._save = refusing

    def states() -> dict[int, int]:
        try:
            supervisor.poll()
        except OSError:
            pass
        return {s.rank: s.state for s in supervisor.statuses()}
    with pytest.raises(OSError, match="No space left"):
        wait_until(lambda: supervisor.poll() is None, "a look that fails")  # poll raises once rank 0 ended
    wait_until(lambda: states() == {0: common_pb2.RANK_STATE_EXITED, 1: common_pb2.RANK_STATE_EXITED},
               "rank 1 seen to end beside rank 0's failing record")
    record = tmp_path / "state" / "ranks" / "j.g1.r0.json"
    assert json.loads(record.read_text())["exit_code"] is None  # not written while the disk refuses
    full["on"] = False
    assert supervisor.poll() == []  # nothing newly ended: rank 0's end is only written now
    assert json.loads(record.read_text())["exit_code"] == 0
