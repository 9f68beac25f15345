import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster

# The test pyramid. Every test has one tier, the heaviest thing it needs: its module's mark (`pytestmark`), or a
# heavier one its fixtures bring (FIXTURE_TIERS). `pytest --tier inproc` (or `--tier procs,etcd`) runs those alone.
TIERS = ("inproc", "procs", "etcd", "netns", "slurm")  # lightest first
FIXTURE_TIERS = {"cluster": "procs", "etcd_server": "etcd", "ha_cluster": "etcd"}


def pytest_addoption(parser):
    parser.addoption("--tier", default="", help=f"run only the tests of these tiers (comma-separated: "
                     f"{', '.join(TIERS)}): in one process; real processes on loopback; with a real etcd; in network "
                     "namespaces (root); with a real Slurm cluster")


def tier_of(item) -> str | None:
    named = {m.name for m in item.iter_markers() if m.name in TIERS}
    named |= {FIXTURE_TIERS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_TIERS}
    return max(named, key=TIERS.index) if named else None


def pytest_collection_modifyitems(config, items):
    """Every test must have a tier (a test module without one is an error that says so); `--tier` keeps only the
    tiers asked for. Tests marked `slow` run only when asked for: `-m slow` (or any -m naming it), or
    PHALANX_SLOW=1."""
    untiered = sorted({item.nodeid.split("::")[0] for item in items if tier_of(item) is None})
    if untiered:
        raise pytest.UsageError(f"tests without a tier: {', '.join(untiered)}; give each module a "
                                f"`pytestmark = pytest.mark.TIER`, TIER one of {', '.join(TIERS)} (tests/conftest.py)")
    if wanted := {t.strip() for t in config.getoption("tier").split(",") if t.strip()}:
        if unknown := wanted - set(TIERS):
            raise pytest.UsageError(f"--tier {', '.join(sorted(unknown))}: no such tier; the tiers: {', '.join(TIERS)}")
        other = [item for item in items if tier_of(item) not in wanted]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if tier_of(item) in wanted]
    items.sort(key=schedule_key)
    if os.environ.get("PHALANX_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


# Longest first: xdist hands tests out in this order, one at a time (pytest_xdist_make_scheduler), so the end-to-end
# tests start early and the short ones fill in around them at the end, instead of a minute-long test starting last.
LONG_FIRST = ("test_faults_e2e", "test_slurm", "test_recovery_e2e", "test_torchrun", "test_jobs_e2e",
              "test_health_e2e", "test_ha")


# Modules whose tests share state through a module fixture and check it at the end: all on one xdist worker.
SAME_WORKER = ("tests/test_fuzz_rpc.py",)


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: unknown where xdist is not loaded)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling, one test at a time in the order above, but a SAME_WORKER module as one unit (its
    tests in order on one worker). (Its own `--dist loadgroup` cannot do it with this pytest: xdist 3.8 renames the
    grouped tests through an attribute pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if module in SAME_WORKER else nodeid

    return Scheduler(config, log)


def schedule_key(item) -> tuple[int, int]:
    module = item.nodeid.split("::")[0].rpartition("/")[2].removesuffix(".py")
    return (LONG_FIRST.index(module) if module in LONG_FIRST else len(LONG_FIRST), -TIERS.index(tier_of(item)))


EXIT_HANG_S = 60.0
_exit_status = [0]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A short base temporary directory: the agent's unix sockets live under a test's tmp_path, and a socket's path
    is limited to 107 bytes; pytest's own (/tmp/pytest-of-USER/pytest-N) under xdist's popen-gwK/ leaves too
    little for a long test name (`Failed to bind to address unix://...`, seen). /tmp/phx-UID/PID/gwK instead, one
    per run by the run's pid: the three newest runs that have ended are kept, and a run still going (its pid
    alive) is never removed, whatever else starts meanwhile (pytest's numbering removed a running run's files
    when three more had started)."""
    if config.option.basetemp is not None:
        worker = getattr(config, "workerinput", None)
        if worker is not None:  # xdist's "<base>/popen-gwK": "<base>/gwK"
            base = Path(config.option.basetemp)
            if base.name.startswith("popen-"):
                config.option.basetemp = str(base.with_name(base.name.removeprefix("popen-")))
        return
    import shutil

    import psutil
    root = Path(tempfile.gettempdir()) / f"phx-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    if root.is_symlink() or root.stat().st_uid != os.getuid():  # someone else's: pytest's own place then
        return
    ended = sorted((d for d in root.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()
                    and int(d.name) != os.getpid() and not psutil.pid_exists(int(d.name))),
                   key=lambda d: d.stat().st_mtime)
    for old in ended[:-3]:
        shutil.rmtree(old, ignore_errors=True)
    config.option.basetemp = str(root / str(os.getpid()))


def pytest_sessionfinish(session, exitstatus):
    _exit_status[0] = int(exitstatus)


def pytest_unconfigure(config):
    """A gRPC aio server or channel a failed test left behind can hang the interpreter's exit for good (seen on
    CI: the suite's summary printed, then nothing until the job's time ran out). Past EXIT_HANG_S after pytest's
    own end (its summary printed) the process says so and exits with the suite's own status, so a hang costs a
    minute, not the CI run. Under xdist, in the controlling process only: a worker that is done idles until the
    last one is, and xdist ends the workers itself."""
    if hasattr(config, "workerinput"):
        return
    status = _exit_status[0]

    def watchdog() -> None:
        time.sleep(EXIT_HANG_S)
        sys.stderr.write(f"conftest: the test process did not exit within {EXIT_HANG_S:.0f} s of the suite's end "
                         f"(something a test left running); exiting with the suite's status {status}\n")
        sys.stderr.flush()
        os._exit(status)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


@pytest.fixture(params=["rows", "packed"])
def rank_tables(request, monkeypatch):
    """The test runs twice: with jobs' rank tables in rows, and packed (phalanx/ranks.py), as a job of PACKED_FROM
    ranks or more holds its table: the same decisions and records either way."""
    from phalanx import ranks

    if request.param == "packed":
        monkeypatch.setattr(ranks, "PACKED_FROM", 1)
    return request.param


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """One real etcd member on loopback for the whole session (tests keep apart by key prefix)."""
    from phalanx import etcdlocal
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(f"{e}")
    members = etcdlocal.plan(tmp_path_factory.mktemp("etcd"), 1)
    etcdlocal.start(members[0], members)
    try:
        etcdlocal.wait_healthy(members)
        yield members[0]
    finally:
        etcdlocal.stop(members[0])


TRAIN = str(Path(__file__).resolve().parent.parent / "examples" / "train_phalanx.py")


def _run_base(tmp_path_factory) -> Path:
    """The run's base temporary directory, shared by xdist's workers (each has gwN/ under it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("gw") else base


TEST_ACCOUNTS = ("phx-alice", "phx-bob")


@pytest.fixture(scope="session")
def accounts(tmp_path_factory):
    """Local accounts phx-alice and phx-bob (phx-alice also in group phx-data), for tests of ranks run as a user's
    account: made by the first worker that needs them and removed by the last one done with them (a count under a
    lock in the run's base directory), so that one module's teardown never removes them under another's tests."""
    import fcntl
    import pwd
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("makes local accounts: needs root and useradd")
    base = _run_base(tmp_path_factory)
    state = base / "accounts.json"

    def change(step) -> None:
        with open(base / "accounts.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = json.loads(state.read_text()) if state.exists() else {"users": 0, "made": []}
            step(held)
            state.write_text(json.dumps(held))

    def enter(held) -> None:
        if held["users"] == 0:
            for name in TEST_ACCOUNTS:
                try:
                    pwd.getpwnam(name)
                except KeyError:
                    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
                    held["made"].append(name)
            subprocess.run(["groupadd", "-f", "phx-data"], check=True)
            subprocess.run(["usermod", "-aG", "phx-data", "phx-alice"], check=True)
        held["users"] += 1

    def leave(held) -> None:
        held["users"] -= 1
        if held["users"] == 0:
            for name in held["made"]:
                subprocess.run(["userdel", name], check=False)
            subprocess.run(["groupdel", "phx-data"], check=False, capture_output=True)
            held["made"] = []

    change(enter)
    yield {n: pwd.getpwnam(n) for n in TEST_ACCOUNTS}
    change(leave)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """`reference(steps)`: the checksum of examples/train_phalanx.py's model trained `steps` steps uninterrupted, as 2
    ranks on loopback (torch's own launch). One run gives every step count's (--digests), and the table is shared
    by the whole run (xdist's workers included: a file under the run's base directory, made under a lock), so the
    reference model is trained once per run, not once per test or module; longer when a test needs more steps."""
    import fcntl

    from phalanx.ports import free_port
    base = _run_base(tmp_path_factory)
    table_path, known = base / "reference-digests.txt", {}

    def load() -> dict[int, str]:
        if not table_path.exists():
            return {}
        return {int(n): d for n, d in (line.split() for line in table_path.read_text().splitlines())}

    def train(steps: int) -> None:
        scratch = tmp_path_factory.mktemp("reference")
        digests, port = scratch / "digests.txt", free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
        procs = [subprocess.Popen([sys.executable, TRAIN, "--steps", str(steps), "--digests", str(digests)],
                                  env={**env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port)}, cwd=scratch, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for rank in range(2)]
        for p in procs:
            assert p.wait(timeout=600) == 0, p.stderr.read()
        os.replace(digests, table_path)  # whole, or not there

    def at(steps: int) -> str:
        if steps not in known:
            with open(base / "reference.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                known.update(load())
                if steps not in known:
                    train(max(steps, 2 * max(known, default=200)))
                    known.update(load())
        return known[steps]

    return at
