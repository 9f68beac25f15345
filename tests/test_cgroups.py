"""Every rank in a cgroup of its own: the job's limits (memory, tasks, open files) hold, and what a rank started,
a daemon that left its process group included, ends with it. Real cgroups where the machine has them (cgroup v1
here, as root); the v2 layout is checked on a directory tree that stands in for /sys/fs/cgroup."""

import json
import os
from pathlib import Path

import psutil
import pytest

from agent.cgroups import CgroupError, Cgroups
from phalanx.v1 import common_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

CGROUP_FS = Path("/sys/fs/cgroup")
needs_cgroups = pytest.mark.skipif(
    os.geteuid() != 0 or not Cgroups(str(CGROUP_FS), f"phalanx-probe-{os.getpid()}").enabled,
    reason="needs root and a writable cgroup hierarchy with the memory and pids controllers")


def _v2_tree(root: Path) -> None:
    """The files of a cgroup v2 root offering memory and pids, as the kernel shows them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")


def test_v2_a_rank_gets_its_limits_and_each_level_gives_the_controllers(tmp_path, monkeypatch):
    _v2_tree(tmp_path)
    # the fake tree has no kernel to make each new directory's control files: the test makes them as it goes
    orig_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):
        orig_mkdir(self, *a, **kw)
        for name in ("cgroup.subtree_control", "cgroup.procs"):
            if not (self / name).exists():
                (self / name).write_text("")
    monkeypatch.setattr(Path, "mkdir", mkdir)
    cgroups = Cgroups(str(tmp_path), "phalanx", "node-a")
    assert cgroups.enabled, cgroups.why_not
    made = cgroups.make("job-1.g1.r0", common_pb2.ResourceLimits(memory_bytes=1 << 30, tasks=100))
    d = tmp_path / "phalanx" / "node-a" / "job-1.g1.r0"
    assert made is not None and made.dirs == (str(d),)
    assert (d / "memory.max").read_text() == str(1 << 30) and (d / "pids.max").read_text() == "100"
    for level in (tmp_path, tmp_path / "phalanx", tmp_path / "phalanx" / "node-a"):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_v1_when_v2_lacks_the_controllers(tmp_path):
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("")  # v2 mounted beside v1, with nothing in it
    for c in ("memory", "pids"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "cgroup.procs").write_text("")
    made = Cgroups(str(tmp_path), "phalanx", "n1").make("job-2.g3.r1", common_pb2.ResourceLimits(
        memory_bytes=512 << 20, tasks=64))
    assert made.dirs == (str(tmp_path / "memory/phalanx/n1/job-2.g3.r1"), str(tmp_path / "pids/phalanx/n1/job-2.g3.r1"))
    assert Path(made.dirs[0], "memory.limit_in_bytes").read_text() == str(512 << 20)
    assert Path(made.dirs[1], "pids.max").read_text() == "64"


def test_without_cgroups_a_limited_job_is_refused_and_others_run_without_one(tmp_path):
    off = Cgroups(str(tmp_path), "", "n1")
    assert not off.enabled and "cgroup_parent is empty" in off.why_not
    assert off.make("job-1.g1.r0", common_pb2.ResourceLimits(open_files=1000)) is None
    with pytest.raises(CgroupError, match=r"limits memory or tasks.*cgroup_parent is empty"):
        off.make("job-1.g1.r0", common_pb2.ResourceLimits(memory_bytes=1 << 30))
    bare = Cgroups(str(tmp_path), "phalanx", "n1")  # nothing mounted there
    assert "no v1 memory, pids hierarchy" in bare.why_not


def one_node(cluster, agent_extra: str = ""):
    """A controller and one agent, node-a, UP."""
    cluster.start_controller()
    cluster.start_agent("node-a", gpus=1, extra=agent_extra)
    cluster.wait_states({"node-a": "UP"})
    return cluster


RANK = """
import os, subprocess, sys, time
# a daemon that leaves the rank's process group and session: only the cgroup still knows it is the rank's
daemon = subprocess.Popen(["sleep", "600"], start_new_session=True)
open(os.environ["OUT"], "w").write(f"{os.getpid()} {daemon.pid}")
time.sleep(600)
"""


@needs_cgroups
def test_a_ranks_limits_hold_and_what_it_started_ends_with_it(cluster, tmp_path):
    c = one_node(cluster)
    out = tmp_path / "pids.txt"
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    submitted = c.cli("submit", "--memory", "256M", "--tasks", "64", "--open-files", "1000", "--env",
                      f"OUT={out}", "--", "python3", str(script))
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    c.wait_for(lambda: out.exists() and len(out.read_text().split()) == 2, "the rank started its daemon")
    rank_pid, daemon_pid = (int(p) for p in out.read_text().split())
    groups = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{rank_pid}/cgroup").read_text().splitlines())
    expected = f"/{c.cgroup_parent}/node-a/{job}.g1.r0"
    assert groups["memory"] == expected and groups["pids"] == expected, groups
    assert (CGROUP_FS / f"memory{expected}/memory.limit_in_bytes").read_text().strip() == str(256 << 20)
    assert (CGROUP_FS / f"pids{expected}/pids.max").read_text().strip() == "64"
    limits = Path(f"/proc/{rank_pid}/limits").read_text()
    assert any(line.startswith("Max open files") and line.split()[3:5] == ["1000", "1000"]
               for line in limits.splitlines()), limits
    shown = json.loads(c.cli("job", job, "-o", "json").stdout)["limits"]
    assert shown == {"memory_bytes": 256 << 20, "tasks": 64, "open_files": 1000}
    assert "memory 0.25 GiB, 64 tasks, 1000 open files per rank" in c.cli("job", job).stdout

    assert c.cli("cancel", job).returncode == 0
    c.wait_for(lambda: not psutil.pid_exists(daemon_pid) or psutil.Process(daemon_pid).status() == "zombie",
               "the rank's daemon killed with it")
    c.wait_for(lambda: not (CGROUP_FS / f"memory{expected}").exists(), "the rank's cgroup removed")


@needs_cgroups
def test_a_rank_beyond_its_memory_is_killed_and_the_job_says_so(cluster, tmp_path):
    c = one_node(cluster)
    grab = "b = bytearray(400 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')\n"
    submitted = c.cli("submit", "--memory", "128M", "--", "python3", "-c", grab)
    job = submitted.stdout.strip()
    c.wait_for(lambda: json.loads(c.cli("job", job, "-o", "json").stdout)["state"] in ("FAILED", "SUCCEEDED"),
               "the job ended")
    j = json.loads(c.cli("job", job, "-o", "json").stdout)
    assert j["state"] == "FAILED", j
    assert "survived" not in c.cli("logs", job).stdout


@needs_cgroups
def test_an_agent_without_cgroups_refuses_a_limited_job_with_the_reason(cluster, tmp_path):
    c = one_node(cluster, 'cgroup_parent = ""')
    job = c.cli("submit", "--tasks", "100", "--", "true").stdout.strip()
    c.wait_for(lambda: "cgroup" in (json.loads(c.cli("job", job, "-o", "json").stdout)["reason"] or "")
               or "cgroup" in c.cli("events").stdout, "the launch refused for want of a cgroup")
    assert "cgroup_parent is empty" in c.cli("events").stdout + c.cli("job", job).stdout


def test_submit_checks_sizes_and_limits(cluster):
    cluster.start_controller()
    bad = cluster.cli("submit", "--memory", "lots", "--", "true")
    assert bad.returncode == 2 and "'lots' is not a size" in bad.stderr
    small = cluster.cli("submit", "--memory", "1M", "--", "true")
    assert small.returncode != 0 and "less than 64 MiB" in small.stderr
    few = cluster.cli("submit", "--tasks", "2", "--", "true")
    assert few.returncode != 0 and "limits.tasks (2) is less than 8" in few.stderr


def test_an_agent_that_restarts_removes_the_cgroups_no_rank_record_names(tmp_path):
    for c in ("memory", "pids"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "cgroup.procs").write_text("")
    cgroups = Cgroups(str(tmp_path), "phalanx", "n1")
    kept = cgroups.make("job-1.g1.r0", common_pb2.ResourceLimits())
    cgroups.make("job-1.g1.r1", common_pb2.ResourceLimits())  # its record was never written (killed mid-launch)
    for d in (tmp_path / "memory/phalanx/n1/job-1.g1.r1", tmp_path / "pids/phalanx/n1/job-1.g1.r1"):
        assert d.is_dir()
    assert cgroups.sweep(set(kept.dirs)) == 2
    assert [p.name for p in (tmp_path / "memory/phalanx/n1").iterdir()] == ["job-1.g1.r0"]
    assert [p.name for p in (tmp_path / "pids/phalanx/n1").iterdir()] == ["job-1.g1.r0"]
