"""`phalanx-agent --config FILE`: the node daemon."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import zlib
from pathlib import Path

import grpc

from agent import bulk, local_server, renewal
from agent import config as agent_config
from agent import metrics as agent_metrics
from agent import nvrx as nvrx_service
from agent import snapshots as snaps
from agent.backoff import Backoff
from agent.cgroups import Cgroups
from agent.collectors import gpu
from agent.collectors.dcgm import DcgmHealth
from agent.collectors.host import HostCollector, inventory_basics
from agent.collectors.nccl import FlightRecorderWatcher, rank_env
from agent.collectors.nvml import NvmlBackend
from agent.collectors.sim import SimBackend
from agent.collectors.topology import parse_cpulist, read_topology
from agent.guarded import Guarded
from agent.lighthouse_relay import Relays
from agent.link import Link
from agent.local_server import LocalState
from agent.supervisor import AccountPolicy, Supervisor, resolve_account
from agent.warm import WarmPool
from phalanx import __version__, daemon, faults, log, metrics_http, sdnotify, tls
from phalanx.clock import Clock, RealClock, Timer
from phalanx.config import comma_list, default_toml
from phalanx.errors import ConfigError
from phalanx.ports import free_port
from phalanx.v1 import common_pb2, node_pb2

PROG = "phalanx-agent"
READ_LOG_MAX = 1 << 20  # bytes per log read; the CLI pages through longer logs
PRUNE_LOGS_EVERY_S = 60.0  # how often ended jobs' rank logs are measured against ended_logs_max_mb
RANK_POLL_S = 0.1  # how often the agent looks for ranks that ended, to tell the controller at once
EVENT_BEAT_GAP_S = 0.25  # a GPU event sends a heartbeat at once, at most this often: an XID storm is no heartbeat storm
TELEMETRY_STALE_S = 5.0  # a scrape reads the last heartbeat's GPU readings, and starts a sweep when they are older
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
    """Wires collectors to the link. Everything it reports is read fresh from the collectors, each in a
    worker thread (agent.guarded), so that no collector can hold back a heartbeat."""

    def __init__(self, cfg: agent_config.AgentConfig, backend: gpu.GpuBackend,
                 identity: tls.ReloadingIdentity | None = None, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.identity = identity  # None: plaintext (security.insecure)
        self._local_service: local_server.LocalService | None = None
        self._job_sockets: dict[str, grpc.aio.Server] = {}  # jobs running as an account: their own socket
        self.name = cfg.name
        self.backend = backend
        self.clock = clock or RealClock()
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
        warm = WarmPool(Path(cfg.state_dir), self.clock, cfg.warm_start,
                        lambda job, why: self._emit("warm_start_off", f"ranks of {job} on {self.name} start cold: "
                                                    f"{why}", job=job), quiet_s=cfg.warm_quiet_s)
        sec = cfg.security
        self.supervisor = Supervisor(Path(cfg.state_dir), cpus_for_gpu, clock=self.clock, warm=warm,
                                     cgroups=Cgroups(cfg.cgroup_root, cfg.cgroup_parent, self.name),
                                     accounts=AccountPolicy(tuple(comma_list(sec.rank_accounts)), sec.root_ranks,
                                                            sec.agent_user_ranks), park_hold_s=cfg.park_hold_s)
        self.local = LocalState()
        # replica-group jobs' lighthouses, at a port here that does not move (relays that outlive the agent)
        self.relays = Relays(Path(cfg.state_dir) / "lighthouse-relays")
        self.snapshots: snaps.Snapshots | None = None
        self._snapshot_seen: dict[str, float] = {}  # job -> when its snapshots here last changed (or it ran here)
        self._snapshot_keys: dict[str, set] = {}
        self._snapshots_off = ""  # why this node keeps no snapshots though snapshot_dir is set
        self._tending_failed = False  # the last rank bookkeeping failed (a full state disk): said once
        self._prune_logs_at = 0.0  # monotonic: when ended jobs' logs are next measured (ended_logs_max_mb)
        self._pruning: asyncio.Future | None = None  # that measuring, in a thread while it runs
        if cfg.snapshot_dir:
            budget = cfg.snapshot_budget_mb * 1_000_000 or memory // 4
            try:
                store = snaps.SnapshotStore(Path(cfg.snapshot_dir) / self.name, budget, clock=self.clock)
            except OSError as e:  # safefs.UnsafePath: a tree another account could change; the node runs on
                self._snapshots_off = f"snapshot_dir is not safe to use: {e}"
                logger.error("in-memory snapshots off", reason=self._snapshots_off)
            else:
                self.snapshots = snaps.Snapshots(store, snaps.Replicator(store, self._emit), self._emit)
        self.nccl = FlightRecorderWatcher(Path(cfg.state_dir))
        self.dcgm = DcgmHealth.try_start() if nvml is not None else None
        self._dcgm_seen: set[tuple[int, str]] = set()
        self.link = Link(self.name, cfg.controllers(), self.inventory, self.heartbeat,
                         Backoff(cfg.reconnect.initial_backoff_s, cfg.reconnect.max_backoff_s), self.command,
                         credentials=identity.channel_credentials if identity is not None else None,
                         server_name=cfg.security.server_name, clock=self.clock, session_port=cfg.session_port,
                         session_tls=identity.session_context if identity is not None else None)
        self.xids = agent_metrics.XidTally()
        self._event_beat: Timer | None = None  # the clock's timer of a heartbeat held back by EVENT_BEAT_GAP_S
        self._event_beat_at = float("-inf")

        def emit(kind: str, message: str, collector: str) -> None:
            self.link.emit(kind, message, collector=collector)

        def guard(name: str, call, last) -> Guarded:
            return Guarded(name, call, last, self.clock, self.name, emit)

        self._host = guard("host", self.host.sample, common_pb2.HostTelemetry())
        self._gpu = guard("gpu", backend.sample, [])
        self._nccl = guard("nccl", lambda: self.nccl.scan(self.clock.wall_ns()), [])
        self._dcgm = guard("dcgm", self.dcgm.check, {}) if self.dcgm is not None else None

    def _emit(self, kind: str, message: str, **fields: str) -> None:
        self.link.emit(kind, message, **fields)

    @property
    def last_host(self) -> common_pb2.HostTelemetry | None:
        """The latest host reading; None before the first."""
        return self._host.last if self._host.at is not None else None

    def inventory(self) -> common_pb2.NodeInventory:
        inventory = common_pb2.NodeInventory()
        inventory.CopyFrom(self._static)
        inventory.gpus.extend(self.backend.inventory())
        return inventory

    def _prune_ended(self) -> None:
        """Ended jobs' rank logs and NCCL dumps past ended_logs_max_mb, each its own budget (in a thread)."""
        for root in (self.supervisor.logs_dir, Path(self.cfg.state_dir) / "nccl"):
            try:
                self.supervisor.prune_ended(root, self.cfg.ended_logs_max_mb * 1_000_000)
            except OSError as e:  # the next pass tries again
                logger.warning("ended jobs' files not deleted", root=str(root), error=str(e))

    def _tend_ranks(self) -> None:
        """Notice ranks that ended and keep the standbys wanted. Their bookkeeping writes files (exit records, rank
        records): a full or failing state disk must not silence the node (every tenant's sessions would flap), so an
        error is logged and said once while it lasts, and the heartbeat goes up with what is known."""
        try:
            self.supervisor.poll()
            self.supervisor.tend_warm()
            if self.cfg.rank_log_max_mb:
                self.supervisor.cap_logs(self.cfg.rank_log_max_mb * 1_000_000)
            if (self.cfg.ended_logs_max_mb and self.clock.monotonic() >= self._prune_logs_at
                    and (self._pruning is None or self._pruning.done())):
                self._prune_logs_at = self.clock.monotonic() + PRUNE_LOGS_EVERY_S
                # a walk of every ended job's files: in a thread, never in the heartbeat's loop
                self._pruning = asyncio.get_running_loop().run_in_executor(None, self._prune_ended)
        except OSError as e:
            if not self._tending_failed:
                logger.error("rank bookkeeping failing; heartbeats go on", error=str(e))
                self._emit("rank_bookkeeping_failing", f"{self.name} cannot keep its rank records ({e}); its "
                           "heartbeats go on, and ranks that end meanwhile are noticed once it can")
            self._tending_failed = True
            return
        if self._tending_failed:
            logger.info("rank bookkeeping works again")
        self._tending_failed = False

    async def heartbeat(self, budget_s: float) -> node_pb2.Heartbeat:
        """This second's heartbeat, built within `budget_s` of the clock's time. A collector that fails (a bug,
        a driver gone strange) or has not answered by then must not silence the node: its last good reading
        goes up instead, and the failure is logged and sent to the controller's event log once while it lasts."""
        readers = [self._host.read(budget_s), self._gpu.read(budget_s), self._nccl.read(budget_s)]
        if self._dcgm is not None:
            readers.append(self._dcgm.read(budget_s))
        host, gpus, nccl, *dcgm = await asyncio.gather(*readers)
        if dcgm:
            self._report_dcgm(dcgm[0])
        self._tend_ranks()
        ranks = self.supervisor.statuses()
        self.relays.keep({r.job for r in ranks})
        held = []
        if self.snapshots is not None:
            self._forget_snapshots(ranks)
            held = self.snapshots.store.report()
        standbys = [node_pb2.Standbys(job=job, ready=ready, starting=total - ready)
                    for job, (ready, total) in sorted(self.supervisor.warm.counts().items())]
        return node_pb2.Heartbeat(host=host, gpus=gpus, running_ranks=self.supervisor.running,
                                  health_digest=health_digest(gpus, host), nccl=nccl,
                                  ranks=ranks, progress=self.local.drain(), snapshots=held, standbys=standbys)

    def _forget_snapshots(self, ranks: list[node_pb2.RankStatus]) -> None:
        """Snapshots outlive their ranks (a restore needs them), not their job: a job with no rank here and no
        new snapshot for snapshot_idle_s has ended or moved on, and its memory is given back."""
        assert self.snapshots is not None
        now = self.clock.monotonic()
        keys: dict[str, set] = {}
        for held in self.snapshots.store.held():
            keys.setdefault(held.key.job, set()).add(held.key)
        running = {r.job for r in ranks if r.state == common_pb2.RANK_STATE_RUNNING}
        for job, held_keys in keys.items():
            if job in running or held_keys != self._snapshot_keys.get(job):  # its ranks here or elsewhere go on
                self._snapshot_seen[job] = now
        self._snapshot_keys = keys
        idle = {job for job in keys if now - self._snapshot_seen.get(job, now) > self.cfg.snapshot_idle_s}
        if idle:
            gone = self.snapshots.store.forget(set(keys) - idle)
            self.snapshots.replicator.forget(gone)
            logger.info("snapshots of idle jobs dropped", jobs=",".join(gone))
            for job in idle:
                self._snapshot_seen.pop(job, None)

    def gpu_telemetry(self) -> list[common_pb2.GpuTelemetry]:
        """The latest GPU readings for a scrape (on the event loop): the last heartbeat's. When they are older
        than TELEMETRY_STALE_S (no heartbeats: the controller is away) a sweep starts for the next scrape."""
        if self._gpu.at is None or self.clock.monotonic() - self._gpu.at > TELEMETRY_STALE_S:
            self._gpu.refresh()
        return self._gpu.last

    def watch_gpu_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """XIDs go up as they come, and the health readings that move with them (a pending row remap, a lost GPU)
        in a heartbeat sent now rather than at its time: a predictable failure is acted on that much sooner."""
        def on_loop(event: common_pb2.GpuEvent) -> None:
            self.xids.record(event)
            self.link.send(node_pb2.AgentMessage(gpu_event=event))
            self._gpu.stale()
            self._beat_for_event()

        def gpu_event(event: common_pb2.GpuEvent) -> None:  # any thread
            logger.warning("GPU event", gpu=event.gpu_index, xid=event.xid, message=event.message)
            loop.call_soon_threadsafe(on_loop, event)

        self.backend.start_events(gpu_event)

    def _beat_for_event(self) -> None:
        if self._event_beat is not None:  # one is due: it reads the GPUs after this event too
            return
        wait = self._event_beat_at + EVENT_BEAT_GAP_S - self.clock.monotonic()
        if wait <= 0:
            self._event_beat_at = self.clock.monotonic()
            self.link.beat_now()
            return

        def due() -> None:
            self._event_beat = None
            self._event_beat_at = self.clock.monotonic()
            self.link.beat_now()
        self._event_beat = self.clock.call_later(wait, due)

    def _report_dcgm(self, incidents: dict[int, list[str]]) -> None:
        """DCGM health incidents go to the event log, each once while it lasts."""
        current = {(index, message) for index, messages in incidents.items() for message in messages}
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
                told = command.launch.env.get("TORCHFT_LIGHTHOUSE")
                if told:  # the job's ranks reach its lighthouse through this node's relay, wherever it moves
                    command.launch.env["TORCHFT_LIGHTHOUSE"] = self.relays.relay(command.launch.job, told)
                env = self._rank_env(command.launch.job)
                if command.launch.run_as:
                    env["PHALANX_AGENT_SOCKET"] = self._job_socket(command.launch.job, command.launch.run_as)
                message = self.supervisor.launch(command.launch, env)
                if self.snapshots is not None:  # and where this node's ranks' snapshots are replicated to
                    self.snapshots.launched(command.launch.job, command.launch.generation,
                                            command.launch.env.get("PHALANX_SNAPSHOT_PEER", ""))
                self.local.notify()  # the older generation's ranks hear at once that they are stale
                return node_pb2.CommandResult(ok=True, message=message)
            if body == "prepare":
                return node_pb2.CommandResult(ok=True, message=self.supervisor.prepare(
                    command.prepare, self._rank_env(command.prepare.job)))
            if body == "stop":
                stop = command.stop
                message = self.supervisor.stop(stop.job, stop.generation, stop.grace_s or self.cfg.stop_grace_s)
                warm = self.supervisor.warm
                if stop.final and warm is not None and (ended := warm.release(stop.job)):
                    message += f"; {ended} warm standbys of {stop.job} ended"
                self.link.beat_now()  # the controller waits for a heartbeat after the stop to go on
                return node_pb2.CommandResult(ok=True, message=message)
            if body == "lighthouse":
                return node_pb2.CommandResult(ok=True, message=self.relays.point(command.lighthouse.job,
                                                                                 command.lighthouse.url))
            if body == "reserve_port":
                return node_pb2.CommandResult(ok=True, port=free_port(""))  # reachable from other nodes
            if body == "read_log":
                return self._read_log(command.read_log)
            if body == "revocations":
                revoked = command.revocations
                if self.snapshots is not None:
                    self.snapshots.store.revoke(revoked.serials, dict(revoked.names))
                return node_pb2.CommandResult(ok=True, message=f"{len(revoked.serials) + len(revoked.names)} "
                                                               "revocations known here")
            if body == "grant_snapshots":
                grant = command.grant_snapshots
                if self.snapshots is None:
                    return node_pb2.CommandResult(ok=True, message=f"{self.name} keeps no snapshots")
                self.snapshots.store.grant(grant.job, grant.nodes)
                return node_pb2.CommandResult(ok=True, message=f"{grant.job}'s snapshots here: for "
                                                               f"{', '.join(grant.nodes) or 'no node'}")
            if body == "pin_snapshot":
                pin = command.pin_snapshot
                if self.snapshots is None:
                    raise ValueError(f"{self.name} keeps no snapshots (snapshot_dir is empty)")
                self.snapshots.store.pin(pin.job, pin.generation, pin.step)
                return node_pb2.CommandResult(ok=True)
            if body == "checkpoint":
                request = command.checkpoint
                self.local.ask(request, self.clock.wall_ns())
                ranks = [r.rank for r in self.supervisor.statuses()
                         if r.job == request.job and r.generation == request.generation]
                return node_pb2.CommandResult(ok=True, message=f"checkpoint request {request.request_id} for "
                                              f"{request.job} pushed to ranks {ranks}")
        except (ValueError, OSError) as e:
            return node_pb2.CommandResult(ok=False, error=str(e))
        return node_pb2.CommandResult(ok=False, error=f"unknown command {body!r}")

    def _inject(self, inject: node_pb2.InjectFault) -> str:
        fault = faults.parse(inject.fault)
        if fault.on_ranks:
            if fault.name == "hang":
                ranks = self.supervisor.hang(inject.gpu_index)
            elif fault.name == "slow":
                ranks = self.supervisor.slow(inject.gpu_index, float(fault.value))
            else:
                ranks = self.supervisor.slow_bursts(inject.gpu_index, float(fault.value))
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

    def local_service(self) -> local_server.LocalService:
        """The service trainlib in the ranks talks to (served on `<state_dir>/agent.sock`)."""
        return local_server.LocalService(self.local, self.supervisor.current_generation, self.link.send,
                                         self.supervisor.mark_fatal, self.snapshots, self._emit,
                                         self.supervisor.slow_factor, self.supervisor.park)

    async def _serve_snapshots(self) -> grpc.aio.Server | None:
        """Serve peers' replicas (before the link starts: the inventory says where). With mutual TLS (this node's
        certificate, the cluster CA; only nodes may put or get) on `snapshot_listen`, else on all addresses; plain
        gRPC on a trial cluster (security.insecure), on loopback unless told otherwise."""
        if self.snapshots is None:
            if self._snapshots_off:
                self._emit("snapshot_replicas_off", f"{self.name} keeps no in-memory snapshots: {self._snapshots_off}")
            return None
        sec = self.cfg.security
        server_credentials = None
        if not sec.insecure:
            try:
                identity = tls.load_identity(sec.ca_file, sec.cert_file, sec.key_file, "this node's", logger)
            except ConfigError as e:
                self._no_replicas(str(e))
                return None
            self.snapshots.replicator.credentials = tls.channel_credentials(identity.ca, identity.cert, identity.key)
            self.snapshots.replicator.tls_files = bulk.TlsFiles(sec.ca_file, sec.cert_file, sec.key_file)
            if not tls.serves_tls(identity.cert):
                self._no_replicas(f"certificate {sec.cert_file} may not serve TLS (no serverAuth: issued before "
                                  "replicas used TLS); move the node's old certificate and key aside on the CA host "
                                  f"and issue it again (`phalanx certs issue {self.name}`)")
                return None
            server_credentials = tls.server_credentials(identity)
        default_host = "0.0.0.0" if server_credentials is not None else self.cfg.advertise_address or "127.0.0.1"
        listen = self.cfg.snapshot_listen or f"{default_host}:0"
        bulk_server = self._serve_bulk(listen.rpartition(":")[0], self.snapshots.replicator.tls_files)
        try:
            service = snaps.SnapshotService(self.snapshots.store, self._emit, nodes_only=server_credentials is not None,
                                            bulk_server=bulk_server, puller=self.snapshots.replicator)
            server, address = await snaps.serve(listen, service, server_credentials)
        except (OSError, RuntimeError) as e:
            if bulk_server is not None:
                bulk_server.close()
            self._no_replicas(f"cannot serve them at {listen}: {e}")
            return None
        self.snapshots.bulk = bulk_server
        host, _, port = address.rpartition(":")
        if bulk_server is not None:  # peers read this node's replicas from its bulk port (Pull)
            self.snapshots.replicator.own_port = int(port)
        # On all addresses: the controller tells peers the address it knows this node by.
        self._static.snapshot_address = f":{port}" if host in ("0.0.0.0", "[::]", "::") else address
        logger.info("snapshot service serving", address=address, tls=server_credentials is not None,
                    bulk_port=bulk_server.port if bulk_server is not None else None,
                    budget_mb=self.snapshots.store.budget // 1_000_000)
        return server

    def _serve_bulk(self, host: str, tls_files: bulk.TlsFiles | None) -> bulk.BulkServer | None:
        """The bulk port restores read snapshots from (agent/bulk.py); without it, they stream over gRPC."""
        if self.cfg.snapshot_bulk_port < 0:
            return None
        try:
            server = bulk.BulkServer(host, self.cfg.snapshot_bulk_port, tls_files)
        except OSError as e:
            logger.warning("snapshot bulk port not served; restores from this node stream over gRPC",
                           host=host, port=self.cfg.snapshot_bulk_port, error=str(e))
            return None
        if self.snapshots is not None:
            server.revoked = self.snapshots.store.revoked  # the node certificates the controller revoked
        return server

    def _no_replicas(self, why: str) -> None:
        logger.error("snapshot replicas not served; this node's snapshots stay unreplicated", reason=why)
        self._emit("snapshot_replicas_off", f"{self.name} keeps and serves no snapshot replicas: {why}")

    async def _watch_ranks(self) -> None:
        """A rank that ends is news for the controller now (a crash to recover from, a stop it waits to see done),
        not at the next heartbeat."""
        while True:
            await self.clock.sleep(RANK_POLL_S)
            try:
                ended = bool(self.supervisor.poll())
            except OSError:  # a rank's record the disk refused (the heartbeat's tending says so): a heartbeat now
                ended = True  # tells what is known, and this watch goes on
            if ended:
                self.link.beat_now()

    def _job_socket(self, job: str, account_name: str) -> str:
        """The socket of a job that runs as an account: made for it once, only that account may open it, and it
        stays while the agent runs (a rank between generations, parked to rejoin, still needs it; the shared socket
        goes on refusing the job). An agent that restarts makes it again for the ranks it re-adopts."""
        path = Path(self.cfg.state_dir) / "jobs" / job / "agent.sock"
        if job not in self._job_sockets:
            if self._local_service is None:
                raise OSError("the local service for trainlib is not served on this node")
            account = resolve_account(account_name)
            self._job_sockets[job] = local_server.serve_job_socket(path, self._local_service, job, account.uid,
                                                                   account.gid)
        return str(path)

    async def _watchdog(self, interval_s: float) -> None:
        """Ping systemd's watchdog from the event loop itself: a stuck loop stops the pings and gets restarted."""
        while True:
            sdnotify.notify("WATCHDOG=1")
            await self.clock.sleep(interval_s)

    def _rank_env(self, job: str) -> dict[str, str]:
        """What every rank of `job` on this node gets from the node itself (the controller adds the rest)."""
        env = dict(os.environ)
        env.update(rank_env(Path(self.cfg.state_dir), job))
        env.update(PHALANX_NODE=self.name, PHALANX_AGENT_SOCKET=str(Path(self.cfg.state_dir) / "agent.sock"),
                   PHALANX_CHECKPOINT_DIR=str(Path(self.cfg.checkpoint_dir) / job))
        if self.snapshots is not None:
            env["PHALANX_SNAPSHOT_DIR"] = str(self.snapshots.store.own_dir)
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
        self.watch_gpu_events(asyncio.get_running_loop())
        self._gpu.refresh()  # the first scrape finds readings
        adopted = self.supervisor.adopt()
        self.relays.restore()  # (those of jobs with no rank here close at the first heartbeat)
        if adopted:
            self.link.emit("adopted", f"agent on {self.name} re-adopted {len(adopted)} running ranks",
                           ranks=",".join(r.key for r in adopted))
        try:
            self._local_service = self.local_service()
            local = await local_server.serve(Path(self.cfg.state_dir) / "agent.sock", self._local_service,
                                             group=self.cfg.security.socket_group,
                                             agent_user_jobs=self.cfg.security.agent_user_ranks)
            for record in adopted:
                if record.run_as:
                    try:
                        self._job_socket(record.job, record.run_as)
                    except (OSError, ValueError) as e:
                        logger.error("job socket not served again", job=record.job, error=str(e))
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
        peers = await self._serve_snapshots()
        metrics = agent_metrics.server(agent_metrics.view(self))
        if self.cfg.metrics_listen:
            sec = self.cfg.security
            if not sec.insecure:
                metrics.registry.register(metrics_http.CertificateExpiry([sec.ca_file, sec.cert_file]))
            await metrics.serve(self.cfg.metrics_listen, lambda: metrics_http.access(
                self.cfg.metrics, sec.ca_file, sec.cert_file, sec.key_file))
        sdnotify.notify(f"READY=1\nSTATUS=node {self.name}, controller {self.cfg.controller}")
        interval = sdnotify.watchdog_interval_s()
        watchdog = asyncio.create_task(self._watchdog(interval)) if interval else None
        ranks = asyncio.create_task(self._watch_ranks())
        renew = asyncio.create_task(renewal.run(self.identity, self.name, self.cfg.controllers(),
                                                self.cfg.security.server_name, stop, clock=self.clock)) \
            if self.identity is not None and self.cfg.security.renew else None
        try:
            await self.link.run(stop)
        finally:
            sdnotify.notify("STOPPING=1")
            ranks.cancel()
            if renew is not None:
                renew.cancel()
            if watchdog is not None:
                watchdog.cancel()
            if local is not None:
                await local.stop(1.0)
            if nvrx is not None:
                await nvrx.stop(1.0)
            if peers is not None:
                await peers.stop(1.0)
            if self.snapshots is not None and self.snapshots.bulk is not None:
                self.snapshots.bulk.close()
            if self.snapshots is not None:
                await self.snapshots.replicator.close()
            self.supervisor.warm.close()
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


def link_credentials(cfg: agent_config.AgentConfig) -> tls.ReloadingIdentity | None:
    """This node's identity from the configured files, read again when they change; None when security.insecure.
    Raises ConfigError."""
    sec = cfg.security
    if sec.insecure:
        logger.warning("security.insecure = true: the session to the controller is plaintext and unauthenticated",
                       controller=",".join(cfg.controllers()))
        return None
    identity = tls.ReloadingIdentity(sec.ca_file, sec.cert_file, sec.key_file, "this node's", logger)
    ou_cn = tls.identity_of(identity.identity.cert)
    if ou_cn is not None and ou_cn != ("node", cfg.name):
        raise ConfigError(f"security: certificate {sec.cert_file} is for {ou_cn[0] or 'no role'} {ou_cn[1]!r}, not "
                          f"node {cfg.name!r}: the controller would refuse it (`phalanx certs issue {cfg.name}`)")
    return identity


async def serve(cfg: agent_config.AgentConfig, identity: tls.ReloadingIdentity | None = None) -> int:
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
    agent = Agent(cfg, backend, identity)
    logger.info("agent starting", node=agent.name, controller=",".join(cfg.controllers()), gpu=note,
                version=__version__)
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

    async def start(cfg: agent_config.AgentConfig) -> int:
        return await serve(cfg, link_credentials(cfg))  # a bad certificate is a ConfigError: one line, exit 2

    return daemon.run(PROG, agent_config.load, args.config, start)


if __name__ == "__main__":
    sys.exit(main())
