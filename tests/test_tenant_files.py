"""The root agent and the files a tenant's ranks can write (issue 39): the snapshot tree is the agent's, checked
component by component; under a job's own directory no link, FIFO or file of another account's is ever
followed, read, written or removed through. Each test is an attack that worked before: a rank (the account
TENANT here) plants something, the agent acts, and the victim, a root-only file or directory, is untouched."""

import asyncio
import os
import stat
import subprocess
import zlib
from pathlib import Path

import pytest

from agent import safefs
from agent import snapshots as snaps
from agent.supervisor import Account
from tests.test_tenancy import traversable

pytestmark = [pytest.mark.inproc,  # the tier (tests/conftest.py)
              pytest.mark.skipif(os.geteuid() != 0, reason="plays a tenant's account by chown: needs root")]

TENANT = 54321  # a uid no account has: the files a tenant's rank makes are its
TENANT_ACCOUNT = Account("phx-t", TENANT, TENANT, (), "/", "/bin/sh")


def key(step: int, rank: int = 0, generation: int = 1, job: str = "job-1") -> snaps.Key:
    return snaps.Key(job, generation, rank, step)


@pytest.fixture
def store(tmp_path):
    store = snaps.SnapshotStore(tmp_path / "snap", budget_bytes=1 << 20)
    TENANT_ACCOUNT.claim(store.own_dir / "job-1")  # as a launch of a job that runs as the account does
    return store


@pytest.fixture
def victim(tmp_path):
    """A root-only file and directory the tenant would like changed or gone."""
    directory = tmp_path / "victim"
    directory.mkdir(mode=0o700)
    secret = directory / "agent-state.json"
    secret.write_text("root's")
    secret.chmod(0o600)
    return secret


def as_tenant(path: Path) -> Path:
    """`path` and the directories above it up to own/<job> made the tenant's, as its rank would have made them."""
    for p in [path, *path.parents]:
        if p.name.startswith("snap") or p.name == "own":
            break
        os.chown(p, TENANT, TENANT, follow_symlinks=False)
    return path


def rank_writes(store: snaps.SnapshotStore, k: snaps.Key, data: bytes) -> Path:
    path = store.path(snaps.OWN, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return as_tenant(path)


def test_the_agent_writes_its_records_where_no_rank_can_put_a_link(store, victim):
    """A rank linked own/JOB/g1/r0/.s5.pt.json.tmp to a root-only file: root rewrote it with values the tenant
    chose. The agent's records of a snapshot now live in its own tree (meta/, 0700)."""
    k = key(5)
    link = store.path(snaps.OWN, k).parent / ".s5.pt.json.tmp"
    rank_writes(store, k, b"state")
    link.symlink_to(victim)
    store.accept_own(k, str(store.path(snaps.OWN, k)), 5, zlib.crc32(b"state"))
    assert victim.read_text() == "root's"
    assert stat.S_IMODE((store.root / "meta").stat().st_mode) == 0o700


@pytest.mark.parametrize("plant", ["link", "fifo", "another account's file"])
def test_a_snapshot_that_is_not_the_tenants_regular_file_is_refused_and_nothing_is_followed(store, victim, plant):
    k = key(5)
    path = store.path(snaps.OWN, k)
    rank_writes(store, key(4), b"x")  # the rank's directories
    if plant == "link":
        path.symlink_to(victim)
    elif plant == "fifo":
        os.mkfifo(path)  # an open for reading would block the agent's loop for good
    else:
        path.write_bytes(b"root's")  # left its owner: root's, not the tenant's
    size = 6 if plant != "fifo" else 0
    with pytest.raises(snaps.SnapshotError, match="refused"):
        store.accept_own(k, str(path), size, 0)
    assert victim.read_text() == "root's" and snaps.OWN not in {h.kind for h in store.held() if h.key == k}


def test_a_restarting_agent_never_deletes_through_a_linked_generation_directory(store, tmp_path, victim):
    """_rescan globbed through a symlinked g*: pointed at the agent's own state, it deleted every rank record."""
    held = store.path(snaps.OWN, key(1))
    rank_writes(store, key(1), b"state")
    store.accept_own(key(1), str(held), 5, zlib.crc32(b"state"))
    (store.own_dir / "job-1" / "g2").symlink_to(victim.parent, target_is_directory=True)
    (victim.parent / "r0").mkdir()
    (victim.parent / "r0" / "s9.pt").write_text("root's too")
    again = snaps.SnapshotStore(store.root, budget_bytes=1 << 20)
    assert victim.read_text() == "root's" and (victim.parent / "r0" / "s9.pt").exists()
    assert [h.key for h in again.held()] == [key(1)]
    assert (store.own_dir / "job-1" / "g2").is_symlink()  # the tenant's link, left as it is, never followed


@pytest.mark.parametrize("where", ["own", "root"])
def test_a_snapshot_tree_another_account_could_change_is_not_used(tmp_path, victim, where):
    """A local account made SNAPSHOT_DIR/NODE/own a link (in /dev/shm, 1777 and emptied at boot) before the agent's
    first start: the agent chmodded its target 1777. Now every component is checked and none is made 1777."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    root = shm / "phalanx" / "node-a"
    if where == "own":
        root.mkdir(parents=True)
        (root / "own").symlink_to(victim.parent, target_is_directory=True)
        os.chown(root / "own", TENANT, TENANT, follow_symlinks=False)
        match = "not a directory|link"
    else:
        (shm / "phalanx").mkdir()
        os.chown(shm / "phalanx", TENANT, TENANT)  # the account made the directory first
        match = f"owned by uid {TENANT}"
    with pytest.raises(OSError, match=match):
        snaps.SnapshotStore(root, budget_bytes=1 << 20)
    assert stat.S_IMODE(victim.parent.stat().st_mode) == 0o700


def test_the_snapshot_tree_is_made_with_nothing_writable_by_others(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    store = snaps.SnapshotStore(shm / "phalanx" / "node-a", budget_bytes=1 << 20)
    for p in [store.root, *(store.root / kind for kind in ("own", "replica", "meta"))]:
        assert not p.stat().st_mode & 0o022, p  # sticky 1777 is gone: ranks write in directories the agent gives
    TENANT_ACCOUNT.claim(store.own_dir / "job-2")
    st = (store.own_dir / "job-2").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (TENANT, 0o700)
    writable = tmp_path / "open"
    writable.mkdir()
    writable.chmod(0o777)  # writable by all and not sticky: anyone could swap what is below
    with pytest.raises(safefs.UnsafePath, match="writable by other accounts"):
        snaps.SnapshotStore(writable / "node-a", budget_bytes=1 << 20)


def test_a_replica_is_handed_to_a_tenants_rank_as_a_copy_of_its_own(store, victim):
    """Replicas are the agent's, 0600: a job that ran as an account never restored from memory after a node loss.
    The copy is made by descriptor: a link the rank planted at its name is replaced, never written through."""
    data = b"replica bytes"
    k = key(7)

    async def fill(tmp: Path) -> tuple[int, int]:
        tmp.write_bytes(data)
        return len(data), zlib.crc32(data)

    held = asyncio.run(store.accept_replica_by(k, len(data), zlib.crc32(data), fill))
    planted = store.own_dir / "job-1" / "restore-r0.pt"
    planted.symlink_to(victim)
    path = store.hand_over(held)
    assert path == planted and not path.is_symlink() and victim.read_text() == "root's"
    st = path.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (TENANT, 0o600)
    traversable(path.parent)  # the account reaches its directory
    read = subprocess.run(["cat", str(path)], user=TENANT, capture_output=True, timeout=30)
    assert read.returncode == 0 and read.stdout == data
    assert store.hand_over(held) == path  # asked again (a retry): a fresh copy, same place


def test_claiming_a_directory_replaces_what_another_account_put_there(tmp_path, victim):
    parent = tmp_path / "nccl"
    parent.mkdir()
    (parent / "job-1").symlink_to(victim.parent, target_is_directory=True)
    TENANT_ACCOUNT.claim(parent / "job-1")
    st = os.lstat(parent / "job-1")
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == TENANT
    assert stat.S_IMODE(victim.parent.stat().st_mode) == 0o700 and victim.parent.stat().st_uid == 0


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_the_nccl_dump_reader_opens_only_the_regular_file_it_saw(tmp_path, victim, plant):
    """The scan saw a regular file and opened the name afterwards: a rank that swapped it for a FIFO hung the
    agent's collector, for a link made root read the target."""
    from agent.collectors import nccl

    path = tmp_path / "dump-0"
    if plant == "link":
        path.symlink_to(victim)
    else:
        os.mkfifo(path)
    with pytest.raises(nccl.DumpParseError):
        nccl.read_dump(path)


def test_a_node_has_its_own_say_on_whom_ranks_run_as(tmp_path):
    """The agent ran whatever account the controller named, root included: its own policy refuses first."""
    from agent.supervisor import AccountPolicy, Supervisor
    from phalanx.v1 import node_pb2

    def launch(policy: AccountPolicy, run_as: str) -> str:
        supervisor = Supervisor(tmp_path / "state", accounts=policy)
        request = node_pb2.LaunchRanks(job="job-1", generation=1, command=["/bin/true"], run_as=run_as,
                                       ranks=[node_pb2.RankLaunch(rank=0)])
        with pytest.raises(ValueError) as e:
            supervisor.launch(request, {})
        return str(e.value)

    assert "root_ranks = false" in launch(AccountPolicy(), "root")
    assert "only as phx-alice" in launch(AccountPolicy(("phx-alice",)), "phx-bob")
    assert "agent_user_ranks = false" in launch(AccountPolicy(agent_user=False), "")
    assert AccountPolicy(root=True).refusal("root") == "" and AccountPolicy().refusal("") == ""


def test_a_ranks_log_is_cut_before_it_fills_the_disk(tmp_path):
    """Issue 39: rank logs were never capped: one tenant's output could fill the state disk every job on the node
    shares. A running rank's log past the cap keeps its last eighth in .log.1 and starts again; the rank writes on
    (O_APPEND) at the new end."""
    import contextlib
    import signal
    import sys

    from agent.supervisor import Supervisor
    from phalanx.v1 import node_pb2
    from tests.eventually import eventually

    supervisor = Supervisor(tmp_path / "state")
    script = "import sys, time\nfor i in range(10**9):\n    sys.stdout.write(f'line {i:08d}\\n' * 100); " \
             "sys.stdout.flush()\n    if i == 200: open(sys.argv[1], 'w').close()\n    time.sleep(0.001)\n"
    marker = tmp_path / "written"
    supervisor.launch(node_pb2.LaunchRanks(job="job-1", generation=1, command=[sys.executable, "-c", script,
                                                                                str(marker)],
                                           ranks=[node_pb2.RankLaunch(rank=0)]), {"PATH": "/usr/bin:/bin"})
    try:
        eventually(marker.exists, "the rank's first 300 kB written")
        log = supervisor.log_path("job-1", 0)
        assert supervisor.cap_logs(100_000) == [str(log)]
        kept = log.with_name(log.name + ".1").read_bytes()
        assert len(kept) == 12_500 and b"line " in kept
        grown = log.stat().st_size
        eventually(lambda: log.stat().st_size > grown + 2_000, "the rank writing on into the cut log")
        assert b"--- phalanx: log cut at " in log.read_bytes()[:10_000]  # the rank may write first, a line or two
    finally:
        for status in supervisor.statuses():  # the wrapper leads a process group of its own, the rank in it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(status.pid, signal.SIGKILL)
        eventually(lambda: supervisor.poll() is not None and not supervisor._live(), "the rank stopped")


def test_ended_jobs_logs_are_deleted_oldest_first_past_their_budget_and_no_link_is_followed(tmp_path):
    """Issue 39: the logs of ended jobs were never deleted: over weeks of jobs (each rank's log up to
    rank_log_max_mb) they filled the state disk every tenant shares. Past ended_logs_max_mb in all, the oldest
    ended jobs' log directories go; a job with a rank here keeps its logs, and a link a tenant left in its
    directory is removed, not followed."""
    import contextlib
    import signal
    import sys

    from agent.supervisor import Supervisor
    from phalanx.v1 import node_pb2
    from tests.eventually import eventually

    supervisor = Supervisor(tmp_path / "state")
    logs = tmp_path / "state" / "logs"
    precious = tmp_path / "precious"
    precious.write_bytes(b"x" * 1000)
    for age, job in enumerate(("job-4", "job-3", "job-2", "job-1")):  # job-1 the oldest
        (logs / job).mkdir(parents=True)
        (logs / job / "rank-0.log").write_bytes(b"y" * 40_000)
        if job == "job-1":
            (logs / job / "link").symlink_to(precious)
        os.utime(logs / job, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
    supervisor.launch(node_pb2.LaunchRanks(job="job-9", generation=1, command=[sys.executable, "-c",
                                                                                "import time; time.sleep(600)"],
                                           ranks=[node_pb2.RankLaunch(rank=0)]), {"PATH": "/usr/bin:/bin"})
    try:
        assert supervisor.prune_ended(logs, 1_000_000) == []  # 160 kB ended: under the budget
        assert supervisor.prune_ended(logs, 90_000) == ["job-1", "job-2"]  # the oldest two go, 80 kB stay
        assert sorted(p.name for p in logs.iterdir()) == ["job-3", "job-4", "job-9"]
        assert precious.read_bytes() == b"x" * 1000
        assert supervisor.prune_ended(logs, 0) == ["job-3", "job-4"]
        assert [p.name for p in logs.iterdir()] == ["job-9"]  # a job with a rank here keeps its logs
        dumps = tmp_path / "state" / "nccl"  # the NCCL dumps of ended jobs, under the same rule
        for job in ("job-7", "job-9"):
            (dumps / job).mkdir(parents=True)
            (dumps / job / "nccl_trace_rank_0").write_bytes(b"z" * 100)
        assert supervisor.prune_ended(dumps, 0) == ["job-7"]
        assert [p.name for p in dumps.iterdir()] == ["job-9"]
    finally:
        for status in supervisor.statuses():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(status.pid, signal.SIGKILL)
        eventually(lambda: supervisor.poll() is not None and not supervisor._live(), "the rank stopped")


def test_an_older_agents_snapshot_tree_is_taken_over_and_closed(tmp_path):
    """Before, own/ was 1777 (ranks made their own directories): an agent upgraded in place makes it 0755 and runs
    on with snapshots, rather than refusing its own tree."""
    root = tmp_path / "snap"
    (root / "own").mkdir(parents=True)
    (root / "own").chmod(0o1777)
    store = snaps.SnapshotStore(root, budget_bytes=1 << 20)
    assert stat.S_IMODE(store.own_dir.stat().st_mode) == 0o755
