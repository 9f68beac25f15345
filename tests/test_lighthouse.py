"""torchft's lighthouse as the controller runs it (controller/lighthouse.py): a child process per replica-group job
that never imports torch, started on the job's stored port again after a restart, and a clear error without torchft."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from controller.config import ReplicasConfig
from controller.lighthouse import LighthouseError, Lighthouses
from controller.lighthouse_main import extension

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)
needs_torchft = pytest.mark.skipif(extension() is None, reason="torchft is not installed (requirements-dev.txt)")

CFG = ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@needs_torchft
def test_a_jobs_lighthouse_serves_until_stopped_and_comes_back_on_its_port():
    async def run() -> None:
        lighthouses = Lighthouses(CFG)
        port = await lighthouses.ensure("job-1")
        assert listening(port) and lighthouses.url(port) == f"http://127.0.0.1:{port}"
        assert await lighthouses.ensure("job-1", port) == port  # running: the same one
        await lighthouses.stop("job-1")
        assert not listening(port)
        assert await lighthouses.ensure("job-1", port) == port  # a restarted controller: the port the ranks know
        assert listening(port)
        await lighthouses.close()
        assert not listening(port) and not lighthouses.running

    asyncio.run(run())


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
                await Lighthouses(CFG).ensure("job-1", s.getsockname()[1])

    asyncio.run(run())
