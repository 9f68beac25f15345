"""torchft's lighthouse (the quorum of a job's replica groups), one child process per running replica-group job.

The controller starts a job's lighthouse when it places the job and stops it when the job ends; the port is stored in
the job's record, so a controller that restarts, or takes over, serves the job's quorum at the same port again (the
ranks were told `TORCHFT_LIGHTHOUSE=http://[replicas] lighthouse_host:PORT`: a name that follows the leader keeps the
quorum across a takeover). The lighthouse keeps no state a quorum needs across its restart: the groups' next quorum
forms at the new one. Health verdicts reach the quorum by the groups' own processes: the controller stops a group it
has judged at once, and the lighthouse drops it `heartbeat_timeout_ms` later (torchft has no call to remove a member).

Without torchft on the controller's host (`pip install 'phalanx[ft]'`), replica-group jobs run without a lighthouse
of Phalanx's (the ranks are not told one), which the job's event log says once.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from dataclasses import dataclass

from controller import lighthouse_main
from controller.config import ReplicasConfig
from controller.lighthouse_main import extension
from phalanx import log

logger = log.get("lighthouse")

START_TIMEOUT_S = 30.0  # the child loads a native extension and binds: well under a second, but a Python start on
# a loaded host can take seconds


class LighthouseError(Exception):
    """A lighthouse could not be started (torchft missing, the port taken): the job runs without one."""


@dataclass
class Lighthouse:
    job: str
    port: int
    process: asyncio.subprocess.Process
    reader: asyncio.Task  # reads what it writes (torchft logs each quorum)


class Lighthouses:
    def __init__(self, cfg: ReplicasConfig, host: str = "") -> None:
        """`host`: where the nodes reach this controller, for a config without lighthouse_host."""
        self.cfg = cfg
        self.host = cfg.lighthouse_host or host or socket.gethostname()
        self.running: dict[str, Lighthouse] = {}
        self._available: bool | None = None
        self.closed = False  # the controller stopped (or was demoted): none starts any more

    def available(self) -> bool:
        if self._available is None:
            self._available = self.cfg.lighthouse and extension() is not None
        return self._available

    def url(self, port: int) -> str:
        host = self.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def ensure(self, job: str, port: int = 0) -> int:
        """The job's lighthouse runs (on `port`, when it had one: the ranks were told it); returns its port. Raises
        LighthouseError when it cannot run."""
        running = self.running.get(job)
        if running is not None and running.process.returncode is None:
            return running.port
        if self.closed:
            raise LighthouseError("the controller is stopping")
        if not self.available():
            raise LighthouseError("torchft is not installed on the controller's host (pip install 'phalanx[ft]'), "
                                  "or [replicas] lighthouse = false")
        bind = self.cfg.lighthouse_bind
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", lighthouse_main.__name__, "--bind", f"{bind}:{port}",
            "--heartbeat-timeout-ms", str(self.cfg.heartbeat_timeout_ms),
            "--join-timeout-ms", str(self.cfg.join_timeout_ms), "--quorum-tick-ms", str(self.cfg.quorum_tick_ms),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        log = asyncio.create_task(_drain(process.stderr))  # torchft's log, read so it never blocks on a full pipe
        try:
            line = (await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)).decode(errors="replace")
        except TimeoutError:
            line = f"error: not ready within {START_TIMEOUT_S:g}s"
        line = line.strip()
        if not line.startswith("ready "):
            await _end(process)
            log.cancel()
            why = line.removeprefix("error: ") or f"it exited at start (code {process.returncode})"
            raise LighthouseError(why)
        started = int(line.rsplit(":", 1)[1])
        self.running[job] = Lighthouse(job, started, process, log)
        logger.info("lighthouse started", job=job, port=started, url=self.url(started))
        return started

    def port(self, job: str) -> int:
        """The port of the job's lighthouse running here (0: none)."""
        running = self.running.get(job)
        return running.port if running is not None and running.process.returncode is None else 0

    async def stop(self, job: str) -> None:
        running = self.running.pop(job, None)
        if running is not None:
            await _end(running.process)
            logger.info("lighthouse stopped", job=job, port=running.port)

    async def close(self) -> None:
        self.closed = True
        await asyncio.gather(*(self.stop(job) for job in list(self.running)))


async def _drain(stream: asyncio.StreamReader | None) -> None:
    """Read (and drop) what a running lighthouse writes: torchft logs each quorum."""
    while stream is not None and await stream.read(65536):
        pass


async def _end(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return
    if process.stdin is not None:
        process.stdin.close()  # it ends when its standard input closes
    try:
        await asyncio.wait_for(process.wait(), 5.0)
    except TimeoutError:
        process.kill()
        await process.wait()
