"""`phalanx-agent --config FILE`: the node daemon."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
import zlib
from pathlib import Path

from agent import config as agent_config
from agent import nvrx as nvrx_service
from agent.backoff import Backoff
from agent.collectors import gpu
from agent.collectors.dcgm import DcgmHealth
from agent.collectors.host import HostCollector, inventory_basics
from agent.collectors.nccl import FlightRecorderWatcher
from agent.collectors.nvml import NvmlBackend
from agent.collectors.sim import SimBackend
from agent.collectors.topology import read_topology
from agent.link import Link
from phalanx import __version__, faults, log
from phalanx.config import default_toml
from phalanx.errors import ConfigError
from phalanx.v1 import common_pb2, node_pb2

PROG = "phalanx-agent"
logger = log.get("agent")


def health_digest(gpus: list[common_pb2.GpuTelemetry], host: common_pb2.HostTelemetry) -> int:
    """A number that changes whenever a health signal changes, and not with temperature, power or
    load: the controller re-judges the node's health only when it does."""
    parts = []
    for reading in gpus:
        signals = common_pb2.GpuTelemetry()
        signals.CopyFrom(reading)
        hot = reading.HasField("slowdown_temperature_c") and reading.temperature_c >= reading.slowdown_temperature_c > 0
        signals.ClearField("temperature_c")
        signals.ClearField("power_w")
        signals.ClearField("utilization_percent")
        signals.ClearField("memory_used_bytes")
        parts.append(signals.SerializeToString(deterministic=True) + (b"\x01" if hot else b"\x00"))
    parts.append((host.checkpoint_free_bytes >> 30).to_bytes(8, "little"))  # whole GiB
    return zlib.crc32(b"|".join(parts)) + 1  # never 0, which means "not computed"


class Agent:
    """Wires collectors to the link. Everything it reports is read fresh from the collectors."""

    def __init__(self, cfg: agent_config.AgentConfig, backend: gpu.GpuBackend) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.backend = backend
        self.host = HostCollector(cfg.checkpoint_dir)
        cpus, memory = inventory_basics()
        nvml = backend.library if isinstance(backend, NvmlBackend) else None
        self.topology = read_topology(cfg.sysfs_root, nvml=nvml)
        for warning in self.topology.warnings:
            logger.warning("topology", detail=warning)
        self._static = common_pb2.NodeInventory(
            hostname=socket.gethostname(), cpu_count=cpus, memory_total_bytes=memory,
            gpu_backend=backend.kind, labels=cfg.labels, agent_version=__version__,
            checkpoint_dir=cfg.checkpoint_dir, agent_pid=os.getpid(), topology=self.topology)
        self.nccl = FlightRecorderWatcher(Path(cfg.state_dir))
        self.dcgm = DcgmHealth.try_start() if nvml is not None else None
        self._dcgm_seen: set[tuple[int, str]] = set()
        self.link = Link(self.name, cfg.controller, self.inventory, self.heartbeat,
                         Backoff(cfg.reconnect.initial_backoff_s, cfg.reconnect.max_backoff_s), self.command)

    def inventory(self) -> common_pb2.NodeInventory:
        inventory = common_pb2.NodeInventory()
        inventory.CopyFrom(self._static)
        inventory.gpus.extend(self.backend.inventory())
        return inventory

    def heartbeat(self) -> node_pb2.Heartbeat:
        host, gpus = self.host.sample(), self.backend.sample()
        if self.dcgm is not None:
            self._report_dcgm()
        return node_pb2.Heartbeat(host=host, gpus=gpus, running_ranks=0, health_digest=health_digest(gpus, host),
                                  nccl=self.nccl.scan(time.time_ns()))

    def _report_dcgm(self) -> None:
        """DCGM health incidents go to the event log, each once while it lasts."""
        current = {(index, message) for index, messages in self.dcgm.check().items() for message in messages}
        for index, message in sorted(current - self._dcgm_seen):
            self.link.emit("dcgm", f"DCGM health incident on GPU {index}: {message}", gpu=str(index))
        self._dcgm_seen = current

    def command(self, command: node_pb2.Command) -> node_pb2.CommandResult:
        body = command.WhichOneof("body")
        if body != "inject":
            return node_pb2.CommandResult(ok=False, error=f"unknown command {body!r}")
        try:
            fault = faults.parse(command.inject.fault)
        except ValueError as e:
            return node_pb2.CommandResult(ok=False, error=str(e))
        if fault.on_ranks:
            return node_pb2.CommandResult(ok=False, error=f"no ranks are running on GPU {command.inject.gpu_index} "
                                          f"of {self.name}; {fault} needs a job there")
        if not isinstance(self.backend, SimBackend):
            return node_pb2.CommandResult(ok=False, error=f"{self.name} has real GPUs; faults can only be injected "
                                          "into simulated ones")
        try:
            done = self.backend.inject(command.inject.gpu_index, fault)
        except ValueError as e:
            return node_pb2.CommandResult(ok=False, error=str(e))
        logger.warning("fault injected", fault=str(fault), gpu=command.inject.gpu_index)
        return node_pb2.CommandResult(ok=True, message=f"{self.name}: injected {done}")

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()

        def gpu_event(event: common_pb2.GpuEvent) -> None:  # any thread
            logger.warning("GPU event", gpu=event.gpu_index, xid=event.xid, message=event.message)
            loop.call_soon_threadsafe(self.link.send, node_pb2.AgentMessage(gpu_event=event))

        self.backend.start_events(gpu_event)
        nvrx = None
        if self.cfg.nvrx_socket:
            try:
                nvrx = await nvrx_service.serve(self.cfg.nvrx_socket, nvrx_service.NvrxHealthService(
                    lambda: self.link.state.health, lambda: self.link.state.connected))
            except OSError as e:
                logger.warning("NVRx node health check not served", socket=self.cfg.nvrx_socket, error=str(e))
        try:
            await self.link.run(stop)
        finally:
            if nvrx is not None:
                await nvrx.stop(1.0)
            if self.dcgm is not None:
                self.dcgm.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="The Phalanx node agent: reports this node's GPUs "
                                     "and host to the controller.")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration (default: every key at its default)")
    parser.add_argument("--print-default-config", action="store_true", help="print the default configuration")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser.parse_args(argv)


async def serve(cfg: agent_config.AgentConfig) -> int:
    try:
        backend, note = gpu.select(cfg.gpu.backend, cfg.gpu.sim_count, cfg.name)
    except gpu.GpuBackendError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    for directory in (cfg.state_dir, cfg.checkpoint_dir):
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning("cannot create directory", path=directory, error=str(e))
    agent = Agent(cfg, backend)
    logger.info("agent starting", node=agent.name, controller=cfg.controller, gpu=note, version=__version__)
    agent.link.emit("started", f"agent {__version__} started on {agent.name}: {note}",
                    gpus=str(len(backend.inventory())))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.run(stop)
    finally:
        backend.close()
    logger.info("agent stopped", node=agent.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_default_config:
        sys.stdout.write(default_toml(agent_config.AgentConfig))
        return 0
    try:
        cfg = agent_config.load(args.config)
    except ConfigError as e:
        print(f"{PROG}: config error: {e}", file=sys.stderr)
        return 2
    log.configure(cfg.log_level, cfg.log_format)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop is Linux/macOS only; asyncio works, just slower
        runner = asyncio.run
    return runner(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
