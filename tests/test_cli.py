"""The `phalanx` CLI as a user runs it: real processes, a real local cluster, exit codes that mean something."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cli import local
from tests.cluster import alive
from tests.eventually import eventually

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


def phalanx(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def home(tmp_path, monkeypatch):
    env = {**os.environ, "PHALANX_HOME": str(tmp_path)}
    env.pop("PHALANX_CONTROLLER", None)
    monkeypatch.setenv("PHALANX_HOME", str(tmp_path))
    yield env
    phalanx("local", "down", env=env)


def test_local_cluster_lifecycle(home):
    result = phalanx("local", "up", "--nodes", "3", "--gpus-per-node", "2", env=home)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "nodes UP: 3/3" in result.stdout and "local cluster up: 3 nodes (2 simulated GPUs each)" in result.stdout

    again = phalanx("local", "up", "--nodes", "1", env=home)
    assert again.returncode == 1 and "a local cluster is already running" in again.stderr

    status = json.loads(phalanx("local", "status", "--json", env=home).stdout)
    assert [(p["role"], p["name"], p["running"]) for p in status] == [
        ("controller", "controller", True), ("agent", "node-0", True), ("agent", "node-1", True),
        ("agent", "node-2", True)]
    assert all(os.path.exists(p["log"]) for p in status)
    assert len({p["metrics"] for p in status}) == 4  # every process its own metrics port
    with urllib.request.urlopen(f"http://{status[0]['metrics']}/metrics", timeout=10) as reply:
        assert 'phalanx_nodes{state="UP"} 3.0' in reply.read().decode()
    assert phalanx("local", "status", env=home).stdout.split()[:7] == ["ROLE", "NAME", "PID", "STATUS", "ADDRESS",
                                                                        "METRICS", "LOG"]

    nodes = json.loads(phalanx("nodes", "--json", env=home).stdout)
    assert [(n["name"], n["state"], len(n["gpus"]), n["gpu_backend"]) for n in nodes] == [
        ("node-0", "UP", 2, "SIM"), ("node-1", "UP", 2, "SIM"), ("node-2", "UP", 2, "SIM")]
    assert nodes[0]["labels"] == {"rack": "rack-0"}
    # one checkpoint directory for all, as a shared filesystem: a job without --checkpoint-dir can checkpoint
    assert {n["host"]["checkpoint_dir"] for n in nodes} == {str(Path(home["PHALANX_HOME"]) / "local" / "checkpoints")}

    # a relative --checkpoint-dir is the one under the directory submit ran in, not under each rank's
    submitted = phalanx("submit", "--checkpoint-dir", "runs/ckpt", "--", "true", env=home)
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(phalanx("job", submitted.stdout.strip(), "-o", "json", env=home).stdout)
    assert job["checkpoint_dir"] == os.path.join(os.getcwd(), "runs", "ckpt")
    assert phalanx("wait", job["id"], env=home).returncode == 0

    drained = phalanx("drain", "node-1", "--reason", "PSU fan", env=home)
    assert drained.returncode == 0 and drained.stdout.strip() == "node-1: DRAINED (drain reason: PSU fan)"
    table = phalanx("nodes", env=home).stdout.splitlines()
    assert table[0].split() == ["NODE", "STATE", "HEALTH", "GPUS", "CPU", "LOAD", "LAST-HB", "PEER", "DRAIN-REASON"]
    assert table[2].split()[:2] == ["node-1", "DRAINED"] and table[2].endswith("PSU fan")
    assert [n["name"] for n in json.loads(phalanx("nodes", "--state", "drained", "--json", env=home).stdout)] == [
        "node-1"]

    assert phalanx("undrain", "node-1", env=home).stdout.strip() == "node-1: UP"
    not_drained = phalanx("undrain", "node-1", env=home)
    assert not_drained.returncode == 1
    assert not_drained.stderr.strip() == "phalanx: error: node node-1 is not drained (state UP) (FAILED_PRECONDITION)"

    events = json.loads(phalanx("events", "--json", "--node", "node-1", env=home).stdout)
    kinds = [e["kind"] for e in events]
    assert "node.drain" in kinds and "node.undrain" in kinds and all(e["node"] == "node-1" for e in events)
    # as `tail`: the newest --limit events, unless --after asks for the first ones after a seq
    newest = [e["seq"] for e in json.loads(phalanx("events", "--json", "--limit", "3", env=home).stdout)]
    every = [e["seq"] for e in json.loads(phalanx("events", "--json", "--after", "0", "--limit", "100000",
                                                  env=home).stdout)]
    assert len(every) > 3 and newest == [s for s in every if s <= newest[-1]][-3:], (newest, every)
    first = [e["seq"] for e in json.loads(phalanx("events", "--json", "--after", "0", "--limit", "3", env=home).stdout)]
    assert first == every[:3]
    past_a_page = [e["seq"] for e in json.loads(phalanx("events", "--json", "--limit", "20000", env=home).stdout)]
    assert past_a_page[:len(every)] == every  # more than one page's worth asked: read in pages, all of them here

    # --follow prints what is there, then what happens next, one JSON object per line
    follow = subprocess.Popen([sys.executable, "-m", "cli.main", "events", "--follow", "--json", "--after",
                               str(events[-1]["seq"] - 1)], stdout=subprocess.PIPE, text=True, env=home)
    try:
        # what is there first (the last event before), then it follows (a drain before it does is replayed by
        # --after all the same: the same lines)
        assert json.loads(follow.stdout.readline())["seq"] == events[-1]["seq"]
        assert phalanx("drain", "node-2", "--reason", "follow me", env=home).returncode == 0
        # (--after replays what came meanwhile; other events, say a node SUSPECT on a busy machine, may come first)
        line = next(e for e in map(json.loads, follow.stdout) if e["kind"] == "node.drain")
        assert line["kind"] == "node.drain" and line["node"] == "node-2" and line["fields"]["reason"] == "follow me"
    finally:
        follow.kill()
        follow.wait()

    down = phalanx("local", "down", env=home)
    assert down.returncode == 0 and "stopped 4 processes" in down.stdout
    assert not any(local.Proc(**{k: v for k, v in p.items() if k != "running"}).alive() for p in status)
    assert phalanx("local", "status", env=home).returncode == 1


def test_usage_errors_exit_2(home):
    for args in (["drain", "node-1"], ["local", "up", "--nodes", "0"], ["nodes", "--state", "sleepy"], ["bogus"],
                 ["local", "up", "--nodes", "1", "--gpus-per-node", "0"],
                 ["local", "up", "--nodes", "1", "--gpus-per-node", "65"]):  # refused before anything starts
        result = phalanx(*args, env=home)
        assert result.returncode == 2, args
        assert "usage:" in result.stderr
    watch = phalanx("jobs", "--watch", "abc", env=home)  # a refresh interval: say seconds, not days
    assert watch.returncode == 2 and "'abc' is not a number of seconds, e.g. 2 or 0.5" in watch.stderr
    for deadline, why in (("-5", "'-5' must be more than 0"), ("nan", "'nan' is not a number of seconds"),
                          ("1e12", "'1e12' is longer than the controller allows (3600 s)")):
        # refused here, not sent for the controller to refuse (or to wait on for ever)
        result = phalanx("checkpoint", "job-1", "--deadline", deadline, env=home)
        assert result.returncode == 2 and why in result.stderr, result.stderr
    unknown = phalanx("submit", "--nodez", "2", "--", "true", env=home)  # said with the command's own usage
    assert unknown.returncode == 2 and "phalanx submit: error: unrecognized arguments: --nodez" in unknown.stderr
    assert unknown.stderr.startswith("usage: phalanx submit ")
    for config in ("/nonexistent/agent.toml", ""):  # named but not there: not the agent's defaults in silence
        missing = phalanx("slurm-healthcheck", "--agent-config", config, env=home)
        assert missing.returncode == 2 and f"--agent-config {config!r}: no such file" in missing.stderr
    # an unset variable in a batch script (--checkpoint-dir "$CKPT"): not the current directory in silence
    empty = phalanx("submit", "--checkpoint-dir", "", "--", "true", env=home)
    assert empty.returncode == 2 and "--checkpoint-dir: '' is empty: give a directory" in empty.stderr


def test_a_checkpoint_directory_is_made_whole_against_the_current_one_and_the_home_directory():
    from cli.main import directory
    assert directory("runs/ckpt") == os.path.join(os.getcwd(), "runs", "ckpt")
    assert directory("~/ckpt") == os.path.join(os.path.expanduser("~"), "ckpt")
    assert directory("/shared/ckpt/") == "/shared/ckpt"


def test_no_controller_is_a_clear_error(home):
    result = phalanx("nodes", env=home)
    assert result.returncode == 1
    assert result.stderr.strip() == ("phalanx: error: no controller: pass --controller HOST:PORT, set "
                                     "PHALANX_CONTROLLER, or start a local cluster with `phalanx local up --nodes N`")
    port = local.free_port()
    unreachable = phalanx("--insecure", "--controller", f"127.0.0.1:{port}", "nodes", env=home)
    assert unreachable.returncode == 1
    assert unreachable.stderr.startswith(f"phalanx: error: cannot reach the controller at 127.0.0.1:{port}")
    # a follow that never reached a controller is the same error, not a follow retrying for ever
    follow = phalanx("--insecure", "--controller", f"127.0.0.1:{port}", "events", "--follow", env=home)
    assert follow.returncode == 1
    assert follow.stderr.startswith(f"phalanx: error: cannot reach the controller at 127.0.0.1:{port}")
    via_env = phalanx("nodes", env={**home, "PHALANX_CONTROLLER": f"127.0.0.1:{port}", "PHALANX_INSECURE": "1"})
    assert via_env.returncode == 1 and f"127.0.0.1:{port}" in via_env.stderr
    # a named controller is TLS unless told otherwise: without the cluster CA, say where it was looked for
    no_ca = phalanx("--controller", f"127.0.0.1:{port}", "--ca", str(Path(home["PHALANX_HOME"]) / "ca.crt"), "nodes",
                    env=home)
    assert no_ca.returncode == 1 and "ca.crt: no such file (make one with `phalanx certs`" in no_ca.stderr


def test_local_status_and_down_find_a_controller_restarted_by_hand(home, tmp_path):
    """... and `phalanx wait` waits a controller restart out (it used to exit 1, as if the job had failed)."""
    assert phalanx("local", "up", "--nodes", "1", env=home).returncode == 0
    done = tmp_path / "done"
    script = f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.1)"
    job_id = phalanx("submit", "--nodes", "1", "--", sys.executable, "-c", script, env=home).stdout.strip()
    wait_until(lambda: '"RUNNING"' in phalanx("job", job_id, "-o", "json", env=home).stdout, "the job running")
    waiting = subprocess.Popen([sys.executable, "-m", "cli.main", "wait", job_id], env=home, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = waiting.stderr.readline()  # it has reached the controller: the kill comes after
    assert "RUNNING" in first, first
    before = json.loads(phalanx("local", "status", "--json", env=home).stdout)[0]
    assert before["role"] == "controller" and before["running"]
    os.kill(before["pid"], signal.SIGKILL)
    wait_until(lambda: not alive(before["pid"]), "the controller gone")
    assert json.loads(phalanx("local", "status", "--json", env=home).stdout)[0]["running"] is False
    # `wait` finds it gone at its next poll, and says so once (before the restart: its poll could miss a short outage)
    lost = waiting.stderr.readline()
    assert "lost the controller" in lost, first + lost

    # what an operator does: start it again by hand, with the same configuration
    root = Path(home["PHALANX_HOME"]) / "local"
    with open(root / "logs" / "controller.log", "ab") as log:
        again = subprocess.Popen([sys.executable, "-m", "controller.main", "--config", before["config"]], cwd=root,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=home)
    try:
        wait_until(lambda: phalanx("nodes", env=home).returncode == 0, "the restarted controller serving")
        status = phalanx("local", "status", "--json", env=home)
        controller = json.loads(status.stdout)[0]
        assert (controller["pid"], controller["running"]) == (again.pid, True)
        assert status.returncode == 0
        done.touch()
        _, err = waiting.communicate(timeout=120)
        assert waiting.returncode == 0 and "SUCCEEDED" in err, first + lost + err

        down = phalanx("local", "down", env=home)
        assert down.returncode == 0 and "stopped 2 processes" in down.stdout
        assert again.wait(timeout=60) is not None  # down stopped it
    finally:
        for process in (again, waiting):
            if process.poll() is None:
                process.kill()
                process.wait()


def wait_until(predicate, what: str, timeout: float = 120) -> None:
    eventually(predicate, what, timeout)


def test_local_up_with_the_session_port(home):
    """`phalanx local up --session-port`: the agent's session goes to the controller's session port. (And `up`
    starts from a clean state: the member configs of a bigger cluster before are gone, other files stay.)"""
    import psutil
    local_dir = Path(home["PHALANX_HOME"]) / "local"
    local_dir.mkdir(parents=True)
    for stale in ("node-7.toml", "controller-2.toml", "mine.toml"):
        (local_dir / stale).write_text("# left from before\n")
    up = phalanx("local", "up", "--nodes", "1", "--gpus-per-node", "1", "--session-port", env=home)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        assert sorted(p.name for p in local_dir.glob("*.toml")) == ["controller.toml", "mine.toml", "node-0.toml"]
        port = int(up.stdout.split("agents' sessions on session port ")[1].split()[0])
        agent = next(p for p in json.loads(phalanx("local", "status", "--json", env=home).stdout)
                     if p["role"] == "agent")
        deadline = time.monotonic() + 60  # UP is recorded at the gRPC registration; the session opens just after
        while True:
            peers = {c.raddr.port for c in psutil.Process(agent["pid"]).net_connections("tcp")
                     if c.raddr and c.status == psutil.CONN_ESTABLISHED}
            if port in peers or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert port in peers, (port, peers)
        nodes = phalanx("nodes", "--json", env=home)
        assert nodes.returncode == 0 and json.loads(nodes.stdout)[0]["state"] == "UP", nodes.stdout
    finally:
        assert phalanx("local", "down", env=home).returncode == 0
