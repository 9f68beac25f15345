"""torchft's lighthouse as the controller runs it (controller/lighthouse.py): a process per replica-group job that
never imports torch, outlives its controller and is taken up by the next (or ends after its grace), is started on the
job's stored port again when it is gone, and a clear error without torchft."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys

import psutil
import pytest

from controller.config import ReplicasConfig
from controller.lighthouse import LighthouseError, Lighthouses, describe
from controller.lighthouse_main import extension
from phalanx.v1 import common_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)
needs_torchft = pytest.mark.skipif(extension() is None, reason="torchft is not installed (requirements-dev.txt)")

CFG = ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def closed(port: int) -> None:
    """Until nothing listens on `port` (a lighthouse told to stop, or ending by itself)."""
    for _ in range(600):
        if not listening(port):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"port {port} still listens")


@needs_torchft
def test_a_lighthouse_outlives_its_controller_and_the_next_one_takes_it_up():
    async def run() -> None:
        first = Lighthouses(CFG, "127.0.0.1")
        held = await first.ensure("job-1")
        port, pid = held.port, held.child.pid
        assert listening(port) and held.url() == f"http://127.0.0.1:{port}" and held.host == "127.0.0.1"
        assert await first.ensure("job-1", port) is held  # looked after here: the same one
        await first.close()  # the controller stops (or dies): the lighthouse serves on
        assert listening(port) and psutil.pid_exists(pid)
        job = common_pb2.Job()
        describe(job, held)
        assert (job.lighthouse_port, job.lighthouse_host, job.lighthouse_control) == (port, "127.0.0.1", held.control)
        # the next controller, from the record: the same process taken up, not another started
        second = Lighthouses(CFG, "127.0.0.1")
        taken = await second.ensure("job-1", job.lighthouse_port, job.lighthouse_host, job.lighthouse_control,
                                    job.lighthouse_token)
        assert taken.child is None and taken.port == port and second.held("job-1") is taken
        await second.stop("job-1")  # the job ended
        await closed(port)
        # a record naming a lighthouse that is gone: one started again, on the port the ranks were told
        again = await second.ensure("job-1", port, job.lighthouse_host, job.lighthouse_control,
                                    job.lighthouse_token)
        assert again.child is not None and again.port == port and again.token != job.lighthouse_token
        await second.stop("job-1")
        await closed(port)
        assert held.child.poll() is not None  # (reaped by the controller that started it)

    asyncio.run(run())


@needs_torchft
def test_a_lighthouse_no_controller_takes_up_ends_after_its_grace_and_the_token_guards_it():
    async def run() -> None:
        lighthouses = Lighthouses(ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1",
                                                 orphan_grace_s=1.0), "127.0.0.1")
        held = await lighthouses.ensure("job-1")
        # a connection without the token neither holds it nor stops it: the next controller cannot take it up
        control = ("127.0.0.1", int(held.control.rsplit(":", 1)[1]))
        with socket.create_connection(control) as s:
            s.sendall(b"wrong\nstop\n")
            assert s.recv(64) == b""  # closed on it
        with socket.create_connection(control) as s:  # nor one that never finishes its first line
            s.sendall(b"x" * 300)
            assert s.recv(64) == b""
        assert listening(held.port)
        with pytest.raises(LighthouseError):  # not taken up, and its port is in use
            await Lighthouses(CFG, "127.0.0.1").ensure("job-1", held.port, "127.0.0.1", held.control, "not-the-token")
        await lighthouses.close()
        await closed(held.port)  # nobody took it up within its grace: it ended
        held.child.poll()

    asyncio.run(run())


def test_the_lighthouse_process_refuses_to_start_without_its_token():
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_LIGHTHOUSE_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "controller.lighthouse_main", "--bind", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and "error: no PHALANX_LIGHTHOUSE_TOKEN" in out.stdout


@needs_torchft
def test_the_lighthouse_process_loads_torchfts_native_code_without_torch():
    code = ("import sys; from controller.lighthouse_main import extension, load; m = load(extension()); "
            "print(hasattr(m, 'LighthouseServer'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_without_a_lighthouse_the_reason_is_said():
    async def run() -> None:
        with pytest.raises(LighthouseError, match=r"pip install 'phalanx\[ft\]'\), or \[replicas\] lighthouse = false"):
            await Lighthouses(ReplicasConfig(lighthouse=False)).ensure("job-1")

    asyncio.run(run())


@needs_torchft
def test_a_port_taken_is_a_lighthouse_error_not_a_crash():
    async def run() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            with pytest.raises(LighthouseError):
                await Lighthouses(CFG, "127.0.0.1").ensure("job-1", s.getsockname()[1])

    asyncio.run(run())


@needs_torchft
def test_a_launch_cancelled_while_its_lighthouse_starts_leaves_it_looked_after_not_leaked():
    async def run() -> None:
        def started() -> set[int]:
            out = set()
            for p in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    if p.status() != psutil.STATUS_ZOMBIE and "lighthouse_main" in " ".join(p.cmdline()):
                        out.add(p.pid)
            return out

        before = started()
        lighthouses = Lighthouses(CFG, "127.0.0.1")
        first = asyncio.create_task(lighthouses.ensure("job-1"))
        await asyncio.sleep(0.01)  # spawned, not yet ready
        first.cancel()
        again = await lighthouses.ensure("job-1")  # the same start, finished: not a second process
        assert lighthouses.held("job-1") is again and started() - before == {again.child.pid}
        await lighthouses.stop("job-1")
        await closed(again.port)

    asyncio.run(run())
