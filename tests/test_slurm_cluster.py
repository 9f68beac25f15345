"""The real Slurm cluster fixture (tests/slurm_cluster.py): it comes up with every node idle, runs an `srun` step on
every node of a 3-node batch job, drains and resumes a node, connects every namespace to every other over TCP,
and two clusters run side by side. Skips, saying why, without root, Slurm or munge (tools/install-system-deps)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.eventually import eventually
from tests.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm,  # the tier (tests/conftest.py)
              pytest.mark.skipif(bool(slurm_cluster.available()), reason=slurm_cluster.available() or "available")]


@pytest.fixture
def slurm():
    with SlurmCluster(3) as c:
        yield c


def test_all_nodes_idle(slurm):
    assert slurm.node_names == ["n1", "n2", "n3"]
    assert slurm.nodelist == "n[1-3]"
    for name in slurm.node_names:
        info = slurm.node_info(name)
        assert info["State"] == "IDLE", info
        assert info["NodeAddr"] == slurm.ip(name)
    assert slurm.sinfo("-h", "-o", "%D %t %N").split() == ["3", "idle", "n[1-3]"]
    assert str(slurm.conf_path) == slurm.env["SLURM_CONF"]


def _job_on_every_node(c: SlurmCluster, out) -> None:
    script = f"#!/bin/bash\nsrun bash -c 'echo \"$SLURMD_NODENAME $SLURM_JOB_NODELIST $SLURM_PROCID\"' > {out}\n"
    job = c.sbatch(script, "-N", str(len(c.node_names)), "-o", str(out) + ".batch")
    assert c.wait_job(job) == "COMPLETED", c.job_info(job)
    rows = sorted(line.split() for line in out.read_text().splitlines())
    assert rows == [[name, c.nodelist, str(rank)] for rank, name in enumerate(c.node_names)], rows
    info = c.job_info(job)
    assert info["NodeList"] == c.nodelist and info["ExitCode"] == "0:0", info


def test_srun_on_every_node(slurm, tmp_path):
    _job_on_every_node(slurm, tmp_path / "ranks.txt")


def test_drain_and_resume(slurm):
    slurm.scontrol("update", "NodeName=n2", "State=DRAIN", "Reason=phalanx says GPU 3 is failing")
    info = slurm.wait_node("n2", "IDLE+DRAIN", timeout=30)
    assert info["Reason"].startswith("phalanx says GPU 3 is failing"), info
    assert slurm.node_state("n1") == "IDLE"
    slurm.scontrol("update", "NodeName=n2", "State=RESUME")
    info = slurm.wait_node("n2", "IDLE", timeout=30)
    assert "Reason" not in info, info


# Listens on the given address, port 0, says the port, and answers every connection with its own name.
_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], 0))
    print(s.getsockname()[1], flush=True)
    while True:
        conn, _ = s.accept()
        conn.sendall(sys.argv[2].encode())
        conn.close()
""")
# Connects to every host:port:name given; prints what answered.
_CLIENT = textwrap.dedent("""
    import socket, sys
    for target in sys.argv[1:]:
        host, port, name = target.split(":")
        with socket.create_connection((host, int(port)), timeout=20) as c:
            got = c.recv(100).decode()
        assert got == name, (target, got)
        print(got)
""")


def test_every_namespace_reaches_every_other(slurm):
    """The controller's gRPC in the hub, the agents in the nodes (both ways), ranks' gloo node to node."""
    places = ["hub", *slurm.node_names]
    addr = {"hub": slurm.hub_ip, **{n: slurm.ip(n) for n in slurm.node_names}}
    ports = {}
    for place in places:
        p = slurm.popen_in(place, [sys.executable, "-c", _SERVER, addr[place], place], stdout=subprocess.PIPE,
                           text=True)
        ports[place] = int(p.stdout.readline())
    for place in places:
        others = [o for o in places if o != place]
        out = slurm.run_in(place, [sys.executable, "-c", _CLIENT, *(f"{addr[o]}:{ports[o]}:{o}" for o in others)])
        assert out.stdout.split() == others
    # The machine's own namespace reaches none of it: the cluster's network is its own.
    with pytest.raises(OSError):
        socket.create_connection((slurm.hub_ip, ports["hub"]), timeout=2).close()


def test_two_clusters_side_by_side(tmp_path):
    with SlurmCluster(3) as a, SlurmCluster(4, prefix="gpu") as b:
        assert a.hub_ns != b.hub_ns and a.subnet != b.subnet and a.dir != b.dir
        assert b.nodelist == "gpu[1-4]"
        _job_on_every_node(a, tmp_path / "a.txt")
        _job_on_every_node(b, tmp_path / "b.txt")
        assert a.sinfo("-h", "-o", "%N").strip() == "n[1-3]"
        assert b.sinfo("-h", "-o", "%N").strip() == "gpu[1-4]"
        inodes = _namespaces(a) | _namespaces(b)
    _gone(a, inodes)
    _gone(b, inodes)


def _namespaces(c: SlurmCluster) -> set[int]:
    return {os.stat(f"/run/netns/{c.netns(w)}").st_ino for w in ["hub", *c.node_names]}


def _gone(c: SlurmCluster, inodes: set[int]) -> None:
    """Nothing of a closed cluster is left: no namespace (by name or with a process in it), no directory, no
    munged."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert c.hub_ns not in names and not any(c.netns(n) in names for n in c.node_names)
    assert not c.dir.exists()

    def left() -> list[str]:
        # an inode of a namespace deleted here may already name another test's new one (tests run side by side)
        ours = inodes - _named_namespaces()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{pid}/ns/net").st_ino in ours:
                    found.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        return found
    # a process still exiting holds its namespace a moment after its memory is gone (its cmdline reads empty)
    eventually(lambda: not left(), "no process left in the closed cluster's namespaces", 10,
               describe=lambda: str(left()))
    assert c._munged is not None and c._munged.poll() is not None


def _named_namespaces() -> set[int]:
    """The inodes of the network namespaces named now (`ip netns add`, by any test)."""
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/run/netns"):
            with contextlib.suppress(OSError):
                found.add(os.stat(f"/run/netns/{name}").st_ino)
    return found


def test_close_after_a_failure_leaves_nothing():
    c = SlurmCluster(3)
    with pytest.raises(RuntimeError, match="boom"), c:
        c.popen_in("n1", ["sleep", "600"])
        job = c.sbatch("#!/bin/bash\nsrun sleep 600\n", "-N", "3", "-o", "/dev/null")
        c.wait_job(job, {"RUNNING"})
        inodes = _namespaces(c)
        raise RuntimeError("boom")
    _gone(c, inodes)


@pytest.mark.slow
def test_dead_slurmd_goes_down_and_comes_back():
    with SlurmCluster(3, slurmd_timeout=10) as c:
        c.kill_slurmd("n3")
        info = c.wait_node("n3", lambda i: i.get("State", "").startswith("DOWN"), timeout=120)
        assert "NOT_RESPONDING" in info["State"] or info["State"].startswith("DOWN*"), info
        c.start_slurmd("n3")
        c.wait_node("n3", "IDLE", timeout=60)
