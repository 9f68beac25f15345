"""`phalanx-agent --config FILE`: the node daemon."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
import zlib
from pathlib import Path

import grpc

from agent import config as agent_config
from agent import local_server
from agent import metrics as agent_metrics
from agent import nvrx as nvrx_service
from agent.backoff import Backoff
from agent.collectors import gpu
from agent.collectors.dcgm import DcgmHealth
from agent.collectors.host import HostCollector, inventory_basics
from agent.collectors.nccl import FlightRecorderWatcher, rank_env
from agent.collectors.nvml import NvmlBackend
from agent.collectors.sim import SimBackend
from agent.collectors.topology import parse_cpulist, read_topology
from agent.link import Link
from agent.local_server import LocalState
from agent.supervisor import Supervisor
from phalanx import __version__, faults, log, sdnotify, tls
from phalanx.config import default_toml
from phalanx.errors import ConfigError
from phalanx.ports import free_port
from phalanx.v1 import common_pb2, node_pb2

PROG = "phalanx-agent"
READ_LOG_MAX = 1 << 20  # bytes per log read; the CLI pages through longer logs
TELEMETRY_STALE_S = 5.0  # a scrape reads the last heartbeat's GPU readings, or sweeps anew when they are older
logger = log.get("agent")


def health_digest(gpus: list[common_pb2.GpuTelemetry], host: common_pb2.HostTelemetry) -> int:
    """A number that changes whenever a health signal changes, and not with temperature, clocks, power
    or load: the controller re-judges the node's health only when it does."""
    parts = []
    for reading in gpus:
        signals = common_pb2.GpuTelemetry()
        signals.CopyFrom(reading)
        hot = reading.HasField("slowdown_temperature_c") and reading.temperature_c >= reading.slowdown_temperature_c > 0
        signals.ClearField("temperature_c")
        signals.ClearField("sm_clock_mhz")
        signals.ClearField("power_w")
        signals.ClearField("utilization_percent")
        signals.ClearField("memory_used_bytes")
        parts.append(signals.SerializeToString(deterministic=True) + (b"\x01" if hot else b"\x00"))
    parts.append((host.checkpoint_free_bytes >> 30).to_bytes(8, "little"))  # whole GiB
    return zlib.crc32(b"|".join(parts)) + 1  # never 0, which means "not computed"


class Agent:
    """Wires collectors to the link. Everything it reports is read fresh from the collectors."""

    def __init__(self, cfg: agent_config.AgentConfig, backend: gpu.GpuBackend,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
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
            checkpoint_dir=cfg.checkpoint_dir, agent_pid=os.getpid(), topology=self.topology,
            address=cfg.advertise_address)
        cpus_for_gpu = {}
        for locality in self.topology.locality if nvml is not None else ():
            with contextlib.suppress(ValueError):
                cpus_for_gpu[locality.gpu_index] = parse_cpulist(locality.cpulist)
        self.supervisor = Supervisor(Path(cfg.state_dir), cpus_for_gpu)
        self.local = LocalState()
        self.nccl = FlightRecorderWatcher(Path(cfg.state_dir))
        self.dcgm = DcgmHealth.try_start() if nvml is not None else None
        self._dcgm_seen: set[tuple[int, str]] = set()
        self.link = Link(self.name, cfg.controller, self.inventory, self.heartbeat,
                         Backoff(cfg.reconnect.initial_backoff_s, cfg.reconnect.max_backoff_s), self.command,
                         credentials=credentials, server_name=cfg.security.server_name)
        self.xids = agent_metrics.XidTally()
        self._gpus: list[common_pb2.GpuTelemetry] = []
        self._gpus_at: float | None = None  # monotonic time of the last GPU sweep
        self.last_host: common_pb2.HostTelemetry | None = None
        self._collector_failures: dict[str, str] = {}  # collector -> its current failure, reported once

    def inventory(self) -> common_pb2.NodeInventory:
        inventory = common_pb2.NodeInventory()
        inventory.CopyFrom(self._static)
        inventory.gpus.extend(self.backend.inventory())
        return inventory

    def heartbeat(self) -> node_pb2.Heartbeat:
        """This second's heartbeat. A collector that fails (a bug, a driver gone strange) must not silence
        the node: its last good reading goes up instead, and the failure is logged and sent to the
        controller's event log once while it lasts."""
        host = self._collect("host", self.host.sample, self.last_host or common_pb2.HostTelemetry())
        gpus = self._collect("gpu", self.backend.sample, self._gpus)
        self.last_host, self._gpus, self._gpus_at = host, gpus, time.monotonic()
        if self.dcgm is not None:
            self._collect("dcgm", self._report_dcgm, None)
        self.supervisor.poll()
        nccl = self._collect("nccl", lambda: self.nccl.scan(time.time_ns()), [])
        return node_pb2.Heartbeat(host=host, gpus=gpus, running_ranks=self.supervisor.running,
                                  health_digest=health_digest(gpus, host), nccl=nccl,
                                  ranks=self.supervisor.statuses(), progress=self.local.drain())

    def _collect(self, name: str, sample, fallback):
        try:
            value = sample()
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
            if self._collector_failures.get(name) != type(e).__name__:  # by kind: messages may vary each time
                self._collector_failures[name] = type(e).__name__
                logger.exception("collector failed; reporting its last good reading", collector=name)
                self.link.emit("collector_failed", f"the {name} collector on {self.name} failed: {failure}"[:500],
                               collector=name)
            return fallback
        if self._collector_failures.pop(name, None) is not None:
            logger.info("collector recovered", collector=name)
            self.link.emit("collector_recovered", f"the {name} collector on {self.name} works again",
                           collector=name)
        return value

    def gpu_telemetry(self) -> list[common_pb2.GpuTelemetry]:
        """The latest GPU readings for a scrape: the last heartbeat's, or a new sweep without recent heartbeats."""
        if self._gpus_at is None or time.monotonic() - self._gpus_at > TELEMETRY_STALE_S:
            self._gpus, self._gpus_at = self._collect("gpu", self.backend.sample, self._gpus), time.monotonic()
        return self._gpus

    def _report_dcgm(self) -> None:
        """DCGM health incidents go to the event log, each once while it lasts."""
        current = {(index, message) for index, messages in self.dcgm.check().items() for message in messages}
        for index, message in sorted(current - self._dcgm_seen):
            self.link.emit("dcgm", f"DCGM health incident on GPU {index}: {message}", gpu=str(index))
        self._dcgm_seen = current

    def command(self, command: node_pb2.Command) -> node_pb2.CommandResult:
        """Carry out a controller command. ValueError/OSError become a refusal with the reason."""
        body = command.WhichOneof("body")
        try:
            if body == "inject":
                return node_pb2.CommandResult(ok=True, message=self._inject(command.inject))
            if body == "launch":
                message = self.supervisor.launch(command.launch, self._rank_env(command.launch.job))
                return node_pb2.CommandResult(ok=True, message=message)
            if body == "stop":
                stop = command.stop
                return node_pb2.CommandResult(ok=True, message=self.supervisor.stop(
                    stop.job, stop.generation, stop.grace_s or self.cfg.stop_grace_s))
            if body == "reserve_port":
                return node_pb2.CommandResult(ok=True, port=free_port(""))  # reachable from other nodes
            if body == "read_log":
                return self._read_log(command.read_log)
            if body == "checkpoint":
                request = command.checkpoint
                self.local.requests[request.job] = request
                ranks = [r.rank for r in self.supervisor.statuses()
                         if r.job == request.job and r.generation == request.generation]
                return node_pb2.CommandResult(ok=True, message=f"checkpoint request {request.request_id} for "
                                              f"{request.job} handed to ranks {ranks} at their next report")
        except (ValueError, OSError) as e:
            return node_pb2.CommandResult(ok=False, error=str(e))
        return node_pb2.CommandResult(ok=False, error=f"unknown command {body!r}")

    def _inject(self, inject: node_pb2.InjectFault) -> str:
        fault = faults.parse(inject.fault)
        if fault.on_ranks:
            ranks = (self.supervisor.hang(inject.gpu_index) if fault.name == "hang"
                     else self.supervisor.slow(inject.gpu_index, float(fault.value)))
            if not ranks:
                raise ValueError(f"no ranks are running on GPU {inject.gpu_index} of {self.name}; {fault} needs a "
                                 "job there")
            logger.warning("fault injected", fault=str(fault), gpu=inject.gpu_index, ranks=ranks)
            return f"{self.name}: {fault} on GPU {inject.gpu_index} (ranks {', '.join(map(str, ranks))})"
        if not isinstance(self.backend, SimBackend):
            raise ValueError(f"{self.name} has real GPUs; faults can only be injected into simulated ones")
        done = self.backend.inject(inject.gpu_index, fault)
        logger.warning("fault injected", fault=str(fault), gpu=inject.gpu_index)
        return f"{self.name}: injected {done}"

    def _rank_env(self, job: str) -> dict[str, str]:
        """What every rank of `job` on this node gets from the node itself (the controller adds the rest)."""
        env = dict(os.environ)
        env.update(rank_env(Path(self.cfg.state_dir), job))
        env.update(PHALANX_NODE=self.name, PHALANX_AGENT_SOCKET=str(Path(self.cfg.state_dir) / "agent.sock"),
                   PHALANX_CHECKPOINT_DIR=str(Path(self.cfg.checkpoint_dir) / job))
        return env

    def _read_log(self, request: node_pb2.ReadLog) -> node_pb2.CommandResult:
        path = self.supervisor.log_path(request.job, request.rank)
        if path is None:
            raise ValueError(f"no log for rank {request.rank} of {request.job} on {self.name}")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(min(request.offset, size))
            data = f.read(min(request.max_bytes or READ_LOG_MAX, READ_LOG_MAX))
        return node_pb2.CommandResult(ok=True, data=data, size=size)

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()

        def gpu_event(event: common_pb2.GpuEvent) -> None:  # any thread
            logger.warning("GPU event", gpu=event.gpu_index, xid=event.xid, message=event.message)
            loop.call_soon_threadsafe(self.xids.record, event)
            loop.call_soon_threadsafe(self.link.send, node_pb2.AgentMessage(gpu_event=event))

        self.backend.start_events(gpu_event)
        adopted = self.supervisor.adopt()
        if adopted:
            self.link.emit("adopted", f"agent on {self.name} re-adopted {len(adopted)} running ranks",
                           ranks=",".join(r.key for r in adopted))
        try:
            local = await local_server.serve(Path(self.cfg.state_dir) / "agent.sock", local_server.LocalService(
                self.local, self.supervisor.current_generation, self.link.send), group=self.cfg.security.socket_group)
        except OSError as e:
            local = None
            logger.error("local service for trainlib not served; ranks run without it", error=str(e))
        nvrx = None
        if self.cfg.nvrx_socket:
            try:
                nvrx = await nvrx_service.serve(self.cfg.nvrx_socket, nvrx_service.NvrxHealthService(
                    lambda: self.link.state.health, lambda: self.link.state.connected),
                    group=self.cfg.security.socket_group)
            except OSError as e:
                logger.warning("NVRx node health check not served", socket=self.cfg.nvrx_socket, error=str(e))
        metrics = agent_metrics.server(agent_metrics.view(self))
        if self.cfg.metrics_listen:
            await metrics.serve(self.cfg.metrics_listen)
        sdnotify.notify(f"READY=1\nSTATUS=node {self.name}, controller {self.cfg.controller}")
        watchdog = asyncio.create_task(sdnotify.watchdog()) if sdnotify.watchdog_interval_s() else None
        try:
            await self.link.run(stop)
        finally:
            sdnotify.notify("STOPPING=1")
            if watchdog is not None:
                watchdog.cancel()
            if local is not None:
                await local.stop(1.0)
            if nvrx is not None:
                await nvrx.stop(1.0)
            await metrics.close()
            if self.dcgm is not None:
                self.dcgm.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="The Phalanx node agent: reports this node's GPUs "
                                     "and host to the controller.")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration (default: every key at its default)")
    parser.add_argument("--print-default-config", action="store_true", help="print the default configuration")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser.parse_args(argv)


def link_credentials(cfg: agent_config.AgentConfig) -> grpc.ChannelCredentials | None:
    """Mutual TLS credentials from the configured files; None when security.insecure. Raises ConfigError."""
    sec = cfg.security
    if sec.insecure:
        logger.warning("security.insecure = true: the session to the controller is plaintext and unauthenticated",
                       controller=cfg.controller)
        return None
    identity = tls.load_identity(sec.ca_file, sec.cert_file, sec.key_file, "this node's", logger)
    ou_cn = tls.identity_of(identity.cert)
    if ou_cn is not None and ou_cn != ("node", cfg.name):
        raise ConfigError(f"security: certificate {sec.cert_file} is for {ou_cn[0] or 'no role'} {ou_cn[1]!r}, not "
                          f"node {cfg.name!r}: the controller would refuse it (`phalanx certs issue {cfg.name}`)")
    return tls.channel_credentials(identity.ca, identity.cert, identity.key)


async def serve(cfg: agent_config.AgentConfig, credentials: grpc.ChannelCredentials | None = None) -> int:
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
    agent = Agent(cfg, backend, credentials)
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
        credentials = link_credentials(cfg)
    except ConfigError as e:
        print(f"{PROG}: config error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop is Linux/macOS only; asyncio works, just slower
        runner = asyncio.run
    return runner(serve(cfg, credentials))


if __name__ == "__main__":
    sys.exit(main())
