"""The agent's Prometheus metrics: this node's GPUs under dcgm-exporter's names, and the agent itself.

A scrape copies, on the agent's event loop, the GPU readings of the last heartbeat (when there has
been none for a while, e.g. while the controller is unreachable, it also starts a sweep in a worker
thread, which the next scrape shows), the XIDs seen, the controller's verdict on each GPU, the
session and the ranks; it renders them in a thread.

GPU series carry dcgm-exporter's labels `gpu`, `UUID`, `pci_bus_id`, `device` and `Hostname` (the
node name), so dashboards and alerts written for dcgm-exporter work, and `hpc_job` and `rank`: the job
running on the GPU and its rank(s) there (empty when idle), so "which job is on the failing GPU" needs
no join. Three differences, all for
`promtool check metrics`: DCGM's counters (`DCGM_FI_DEV_ECC_SBE_VOL_TOTAL`, ...) are typed gauge
(the lint wants a counter's name to end in `_total`; rate() works the same); PCIe replays are
`phalanx_gpu_pcie_replays_total` (the lint refuses `..._COUNTER`, a type in the name); and the model
name is a label of `phalanx_gpu_info` rather than a camelCase `modelName` on every series.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from agent import snapshots as snaps
from phalanx import __version__
from phalanx.metrics_http import MetricsServer, standard_registry
from phalanx.v1 import common_pb2, node_pb2

if TYPE_CHECKING:
    from agent.main import Agent

# dcgm-exporter's labels, then the job on the GPU as dcgm-exporter's HPC job mapping names it (`hpc_job`; not
# `job`, which Prometheus keeps for the scrape job) and its ranks there: empty while the GPU is idle.
GPU_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "Hostname", "hpc_job", "rank"]
MIB = 1024 * 1024

# (metric, help, GpuTelemetry field, scale). Optional fields NVML does not support are left out.
DCGM_GAUGES: tuple[tuple[str, str, str, float], ...] = (
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c", 1),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz", 1),
    ("DCGM_FI_DEV_SLOWDOWN_TEMP", "Slowdown temperature threshold (in C).", "slowdown_temperature_c", 1),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w", 1),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Enforced power limit (in W).", "power_limit_w", 1),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "utilization_percent", 1),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_bytes", 1 / MIB),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Clocks event (throttle) reasons, NVML's bitmask.",
     "clocks_event_reasons", 1),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Single-bit (corrected) ECC errors since the driver loaded.",
     "ecc_sbe_volatile", 1),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Double-bit (uncorrected) ECC errors since the driver loaded.",
     "ecc_dbe_volatile", 1),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Single-bit (corrected) ECC errors over the GPU's life.", "ecc_sbe_aggregate", 1),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Double-bit (uncorrected) ECC errors over the GPU's life.",
     "ecc_dbe_aggregate", 1),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Rows remapped for correctable errors.", "remapped_rows_correctable", 1),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Rows remapped for uncorrectable errors.",
     "remapped_rows_uncorrectable", 1),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "1 if a row remap is pending (reset the GPU to apply it).", "remap_pending", 1),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "1 if remapping rows has failed.", "remap_failure", 1),
    ("DCGM_FI_DEV_RETIRED_SBE", "Pages retired for multiple single-bit errors.", "retired_pages_sbe", 1),
    ("DCGM_FI_DEV_RETIRED_DBE", "Pages retired for double-bit errors.", "retired_pages_dbe", 1),
    ("DCGM_FI_DEV_RETIRED_PENDING", "1 if a page retirement is pending.", "retired_pages_pending", 1),
    ("DCGM_FI_DEV_PCIE_LINK_GEN", "Current PCIe link generation.", "pcie_link_gen", 1),
    ("DCGM_FI_DEV_PCIE_LINK_WIDTH", "Current PCIe link width (lanes).", "pcie_link_width", 1),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "Maximum PCIe link generation.", "pcie_max_link_gen", 1),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "Maximum PCIe link width (lanes).", "pcie_max_link_width", 1),
    ("phalanx_gpu_nvlink_links", "NVLinks the GPU has.", "nvlink_links_total", 1),
    ("phalanx_gpu_nvlink_links_up", "NVLinks that are up.", "nvlink_links_up", 1),
)
# Counters without a DCGM name that passes promtool's lint: dcgm-exporter's DCGM_FI_DEV_PCIE_REPLAY_COUNTER
# has a type in its name, and DCGM counts NVLink errors per kind (CRC flit, CRC data, replay, recovery)
# where NVML's sum is what Phalanx has.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("phalanx_gpu_pcie_replays", "PCIe replays (retries); dcgm-exporter's DCGM_FI_DEV_PCIE_REPLAY_COUNTER.",
     "pcie_replay_count"),
    ("phalanx_gpu_nvlink_errors", "NVLink errors: replay, recovery and CRC counters summed over the GPU's links.",
     "nvlink_error_count"),
)
# Fields every reading of a present GPU has (proto3 scalars, no presence): always exported.
ALWAYS = frozenset({"temperature_c", "power_w", "utilization_percent", "memory_used_bytes"})


@dataclass
class XidTally:
    """XIDs this agent has seen, per GPU: the latest (DCGM_FI_DEV_XID_ERRORS) and how many of each."""

    last: dict[int, int] = field(default_factory=dict)
    counts: Counter[tuple[int, int]] = field(default_factory=Counter)  # (gpu, xid) -> events

    def record(self, event: common_pb2.GpuEvent) -> None:
        self.last[event.gpu_index] = event.xid
        self.counts[(event.gpu_index, event.xid)] += 1


@dataclass(frozen=True)
class AgentView:
    """What the collector reads from the agent, as callables so that every scrape sees the present."""

    node: str
    gpu_backend: str
    inventory: Callable[[], list[common_pb2.GpuInfo]]
    telemetry: Callable[[], list[common_pb2.GpuTelemetry]]
    host: Callable[[], common_pb2.HostTelemetry | None]
    xids: XidTally
    verdict: Callable[[], common_pb2.NodeHealth | None]
    connected: Callable[[], bool]
    node_state: Callable[[], int]
    sessions: Callable[[], int]
    heartbeats: Callable[[], int]
    ranks: Callable[[], list[node_pb2.RankStatus]]
    snapshots: Callable[[], SnapshotStats | None] = lambda: None


@dataclass(frozen=True)
class SnapshotStats:
    """The node's in-memory snapshots: what it holds against its budget, and how they travelled."""

    budget: int
    held: dict[str, int]  # own / replica -> bytes
    replicas_sent: int
    fetched: dict[str, int]  # snaps.VIA_BULK / VIA_STREAM -> snapshots fetched from peers
    bulk_sent: int  # files sent whole from this node's bulk port (restores and replicas pulled)


def snapshot_stats(agent: Agent) -> SnapshotStats | None:
    snapshots = agent.snapshots
    if snapshots is None:
        return None
    held = dict.fromkeys((snaps.OWN, snaps.REPLICA), 0)
    for h in snapshots.store.held():
        held[h.kind] += h.size
    return SnapshotStats(snapshots.store.budget, held, snapshots.replicator.sent, dict(snapshots.replicator.fetched),
                         snapshots.bulk.served if snapshots.bulk is not None else 0)


def view(agent: Agent) -> AgentView:
    link = agent.link
    return AgentView(
        node=agent.name,
        gpu_backend=common_pb2.GpuBackendKind.Name(agent.backend.kind).removeprefix("GPU_BACKEND_KIND_").lower(),
        inventory=agent.backend.inventory, telemetry=agent.gpu_telemetry, host=lambda: agent.last_host,
        xids=agent.xids, verdict=lambda: link.state.health, connected=lambda: link.state.connected,
        node_state=lambda: link.state.state, sessions=lambda: link.state.sessions,
        heartbeats=lambda: link.heartbeats_sent, ranks=agent.supervisor.statuses,
        snapshots=lambda: snapshot_stats(agent))


@dataclass(frozen=True)
class Snapshot:
    """What one scrape shows, copied from the agent on its event loop."""

    node: str
    gpu_backend: str
    inventory: list[common_pb2.GpuInfo]
    telemetry: list[common_pb2.GpuTelemetry]
    host: common_pb2.HostTelemetry | None
    xid_last: dict[int, int]
    xid_counts: dict[tuple[int, int], int]
    verdict: common_pb2.NodeHealth | None
    connected: bool
    node_state: int
    sessions: int
    heartbeats: int
    ranks: dict[str, int]  # by state
    on_gpu: dict[int, tuple[str, str]] = field(default_factory=dict)  # GPU -> (job, its ranks there) running now
    snapshots: SnapshotStats | None = None


def take_snapshot(v: AgentView) -> Snapshot:
    """On the event loop only. The protos it keeps are never changed in place (each reading is new)."""
    statuses = list(v.ranks())
    return Snapshot(
        node=v.node, gpu_backend=v.gpu_backend, inventory=list(v.inventory()), telemetry=list(v.telemetry()),
        host=v.host(), xid_last=dict(v.xids.last), xid_counts=dict(v.xids.counts), verdict=v.verdict(),
        connected=v.connected(), node_state=v.node_state(), sessions=v.sessions(), heartbeats=v.heartbeats(),
        ranks=dict(Counter(common_pb2.RankState.Name(r.state).removeprefix("RANK_STATE_") for r in statuses)),
        on_gpu=_on_gpu(statuses), snapshots=v.snapshots())


def _on_gpu(statuses: list[node_pb2.RankStatus]) -> dict[int, tuple[str, str]]:
    running: dict[int, dict[str, list[int]]] = {}
    for r in statuses:
        if r.state == common_pb2.RANK_STATE_RUNNING:
            running.setdefault(r.gpu, {}).setdefault(r.job, []).append(r.rank)
    return {gpu: (",".join(sorted(jobs)), ",".join(str(n) for job in sorted(jobs) for n in sorted(jobs[job])))
            for gpu, jobs in running.items()}


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def families(s: Snapshot) -> Iterator[Metric]:
    """The metric families of a snapshot (pure: any thread)."""
    info = InfoMetricFamily("phalanx_agent", "The agent: version, node name, GPU backend.")
    info.add_metric([], {"version": __version__, "node": s.node, "gpu_backend": s.gpu_backend})
    yield info
    yield GaugeMetricFamily("phalanx_agent_connected", "1 while the session with the controller is open.",
                            value=1 if s.connected else 0)
    yield CounterMetricFamily("phalanx_agent_sessions", "Sessions opened with the controller (reconnects + 1).",
                              value=s.sessions)
    yield CounterMetricFamily("phalanx_agent_heartbeats", "Heartbeats sent to the controller.", value=s.heartbeats)
    state = _gauge("phalanx_agent_node_state", "This node's state as the controller last said (1 for the current "
                   "one; UNSPECIFIED before the first session).", ["state"])
    state.add_metric([common_pb2.NodeState.Name(s.node_state).removeprefix("NODE_STATE_")], 1)
    yield state
    ranks = _gauge("phalanx_agent_ranks", "Rank processes this agent supervises, by state.", ["state"])
    for name in ("RUNNING", "EXITED", "LOST"):
        ranks.add_metric([name], s.ranks.get(name, 0))
    yield ranks
    if s.host is not None:
        yield GaugeMetricFamily("phalanx_agent_checkpoint_free_bytes", "Free bytes in the checkpoint directory.",
                                value=s.host.checkpoint_free_bytes)
    if s.snapshots is not None:
        yield from _snapshots(s.snapshots)
    yield from _gpus(s)


def _snapshots(s: SnapshotStats) -> Iterator[Metric]:
    yield GaugeMetricFamily("phalanx_agent_snapshot_budget_bytes", "Host memory this node's in-memory snapshots "
                            "may take (snapshot_budget_mb).", value=s.budget)
    held = _gauge("phalanx_agent_snapshot_bytes", "In-memory snapshots held: own (this node's ranks') and replica "
                  "(peers').", ["kind"])
    for kind, size in sorted(s.held.items()):
        held.add_metric([kind], size)
    yield held
    yield CounterMetricFamily("phalanx_agent_snapshot_replicas_sent", "Snapshots of this node's ranks kept by "
                              "their peer node.", value=s.replicas_sent)
    fetched = CounterMetricFamily("phalanx_agent_snapshot_fetches", "Snapshots fetched from peers to restore a "
                                  "rank, by the way they came: bulk port, or gRPC stream (its fallback).",
                                  labels=["via"])
    for via, label in ((snaps.VIA_BULK, "bulk"), (snaps.VIA_STREAM, "grpc")):
        fetched.add_metric([label], s.fetched.get(via, 0))
    yield fetched
    yield CounterMetricFamily("phalanx_agent_snapshot_bulk_sent", "Snapshot files sent whole from this node's bulk "
                              "port (restores, and replicas peers pulled).", value=s.bulk_sent)


def _gpus(s: Snapshot) -> Iterator[Metric]:
    inventory = {g.index: g for g in s.inventory}
    readings = {t.index: t for t in s.telemetry}

    def labels(index: int) -> list[str]:
        g = inventory.get(index)
        job, ranks = s.on_gpu.get(index, ("", ""))
        return [str(index), g.uuid if g else "", g.pci_bus_id if g else "", f"nvidia{index}", s.node, job, ranks]

    info = _gauge("phalanx_gpu_info", "A GPU's identity (value 1).", [*GPU_LABELS, "model_name", "serial"])
    for index, g in sorted(inventory.items()):
        info.add_metric([*labels(index), g.name, g.serial], 1)
    yield info
    lost = _gauge("phalanx_gpu_lost", "1 if NVML says the GPU is lost (fallen off the bus).", GPU_LABELS)
    for index, t in sorted(readings.items()):
        lost.add_metric(labels(index), 1 if t.lost else 0)
    yield lost
    present = [(i, t) for i, t in sorted(readings.items()) if not t.lost]
    for name, doc, proto_field, scale in DCGM_GAUGES:
        family = _gauge(name, doc, GPU_LABELS)
        for index, t in present:
            if proto_field in ALWAYS or t.HasField(proto_field):
                family.add_metric(labels(index), float(getattr(t, proto_field)) * scale)
        yield family
    free = _gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", GPU_LABELS)
    for index, t in present:
        if index in inventory and inventory[index].memory_total_bytes:
            free.add_metric(labels(index), (inventory[index].memory_total_bytes - t.memory_used_bytes) / MIB)
    yield free
    for name, doc, proto_field in COUNTERS:
        family = CounterMetricFamily(name, doc, labels=GPU_LABELS)
        for index, t in present:
            if t.HasField(proto_field):
                family.add_metric(labels(index), getattr(t, proto_field))
        yield family
    action = _gauge("phalanx_gpu_recovery_action", "NVML's recovery action for the GPU (1 for the current one): "
                    "NONE, GPU_RESET, NODE_REBOOT, DRAIN_P2P or DRAIN_AND_RESET.", [*GPU_LABELS, "action"])
    for index, t in present:
        if t.recovery_action:
            name = common_pb2.GpuRecoveryAction.Name(t.recovery_action).removeprefix("GPU_RECOVERY_ACTION_")
            action.add_metric([*labels(index), name], 1)
    yield action
    last = _gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered (0: none since the agent "
                  "started).", GPU_LABELS)
    for index in sorted(inventory):
        last.add_metric(labels(index), s.xid_last.get(index, 0))
    yield last
    xids = CounterMetricFamily("phalanx_gpu_xid_errors", "XID events seen since the agent started, by XID.",
                               labels=[*GPU_LABELS, "xid"])
    for (index, xid), n in sorted(s.xid_counts.items()):
        xids.add_metric([*labels(index), str(xid)], n)
    yield xids
    # The controller pushes every verdict of a session but its first, HEALTHY: a session without one
    # means HEALTHY; no session yet, UNKNOWN.
    judged = {g.index: g.health for g in s.verdict.gpus} if s.verdict is not None else {}
    default = common_pb2.HEALTH_HEALTHY if s.sessions else common_pb2.HEALTH_UNSPECIFIED
    health = _gauge("phalanx_gpu_health", "The controller's verdict on the GPU as last heard (1 for the current "
                    "one): HEALTHY, DEGRADED, FAILING, FAILED, or UNKNOWN before the first session.",
                    [*GPU_LABELS, "verdict"])
    for index in sorted(inventory):
        verdict = judged.get(index) or default
        name = "UNKNOWN" if verdict == common_pb2.HEALTH_UNSPECIFIED else \
            common_pb2.Health.Name(verdict).removeprefix("HEALTH_")
        health.add_metric([*labels(index), name], 1)
    yield health


class AgentCollector:
    """Renders the snapshot taken last (`snapshot()`, on the event loop, before every scrape)."""

    def __init__(self, view: AgentView) -> None:
        self.view = view
        self._snapshot: Snapshot | None = None

    def snapshot(self) -> None:
        self._snapshot = take_snapshot(self.view)

    def describe(self) -> list[Metric]:
        return []  # nothing to check for duplicates; keeps registration from collecting

    def collect(self) -> Iterator[Metric]:
        if self._snapshot is None:  # rendered without a scrape's snapshot (tests): this is the loop's thread
            self.snapshot()
        return families(self._snapshot)


def server(view: AgentView) -> MetricsServer:
    collector = AgentCollector(view)
    return MetricsServer(standard_registry(collector), collector.snapshot)
