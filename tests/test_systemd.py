"""systemd integration: the notify protocol against real daemons, and the unit files verified."""

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import sdnotify

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent


def receiver(tmp_path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)
    return sock, path


def test_notify_is_a_no_op_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.watchdog_interval_s() is None


def test_notify_and_watchdog_interval(tmp_path, monkeypatch):
    sock, path = receiver(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert sdnotify.notify("READY=1\nSTATUS=hello")
    assert sock.recv(4096) == b"READY=1\nSTATUS=hello"
    assert sdnotify.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert sdnotify.watchdog_interval_s() is None
    sock.close()


@pytest.mark.parametrize("module", ["controller.main", "agent.main"])
def test_daemons_say_ready_ping_the_watchdog_and_say_stopping(tmp_path, module):
    sock, path = receiver(tmp_path)
    from cli.local import free_port
    port = free_port()
    config = tmp_path / "c.toml"
    if module == "controller.main":
        config.write_text(f'listen = "127.0.0.1:{port}"\nstate_db = "{tmp_path / "c.db"}"\nsecurity.insecure = true\n')
    else:  # an agent whose controller is not there: it still comes up and keeps trying
        config.write_text(f'node_name = "n1"\ncontroller = "127.0.0.1:{port}"\nstate_dir = "{tmp_path / "s"}"\n'
                          f'snapshot_dir = ""\n'
                          f'checkpoint_dir = "{tmp_path / "c"}"\nnvrx_socket = ""\nsecurity.insecure = true\n'
                          '[gpu]\nbackend = "sim"\n')
    env = {**os.environ, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000"}
    proc = subprocess.Popen([sys.executable, "-m", module, "--config", str(config)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        messages = [sock.recv(4096).decode() for _ in range(3)]
        assert messages[0].startswith("READY=1\nSTATUS=")
        assert messages[1:] == ["WATCHDOG=1", "WATCHDOG=1"]  # every half second (half of WatchdogSec)
        proc.send_signal(signal.SIGTERM)
        while (message := sock.recv(4096).decode()) == "WATCHDOG=1":
            pass
        assert message == "STOPPING=1"
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
        sock.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_units_verify_clean(tmp_path):
    bin_dir = Path(sys.executable).parent  # the console scripts of this environment stand in for /opt/phalanx/bin
    units = []
    for unit in sorted((ROOT / "systemd").glob("*.service")):
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace("/opt/phalanx/bin/", f"{bin_dir}/"))
        units.append(str(copy))
    assert len(units) == 3  # agent, controller, and the controller as a member of a highly available control plane
    result = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize(("unit", "most"), [("phalanx-controller.service", 2.0),
                                            ("phalanx-controller-ha.service", 2.0),
                                            ("phalanx-agent.service", 7.2)])
def test_units_expose_no_more_than_they_need(unit, most):
    """Issue 39's least privilege, as systemd measures it: the controllers within 2.0; the agent, whose sandbox its
    ranks inherit (GPUs, the network, the whole file system), no more than with its capability bounding set."""
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(ROOT / "systemd" / unit)],
                         capture_output=True, text=True, timeout=120)
    if "--offline" in out.stderr and "unrecognized" in out.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 252)")
    line = next(line for line in out.stdout.splitlines() if "Overall exposure level" in line)
    assert float(line.split(":")[1].split()[0]) <= most, line
