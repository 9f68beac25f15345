"""The controller's Prometheus metrics: nodes, health, jobs, heartbeats, detection and recovery.

A scrape copies the counts it needs from the registry and the jobs on the event loop (`snapshot`,
a few milliseconds at 10,000 nodes) and renders them in a worker thread, so the heartbeat path pays
nothing for metrics but the histogram of its lag. Latencies are histograms observed where the
events happen (`controller.obs.stats.Buckets`: a bisect and two additions): heartbeat lag and detection
latency in the registry, recovery duration in the jobs' recovery.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from controller.ha import Elector
from controller.jobs.manager import ACTIVE, JobManager, state_name
from controller.nodes.health import HEALTHY, Health
from controller.nodes.registry import Registry
from controller.nodes.states import NodeState
from controller.obs.events import EventHub
from controller.obs.stats import Buckets
from controller.store.timed import TimedStore
from phalanx import __version__
from phalanx.metrics_http import MetricsServer, standard_registry
from phalanx.v1 import common_pb2

if TYPE_CHECKING:
    from controller.api.rendezvous_service import RendezvousService

JOB_STATES = [state_name(s) for s in common_pb2.JobState.values() if s != common_pb2.JOB_STATE_UNSPECIFIED]
Histogram = tuple[list[tuple[str, int]], float]  # cumulative buckets, sum


@dataclass(frozen=True)
class Snapshot:
    nodes: list[tuple[str, NodeState, Health]] = field(default_factory=list)
    gpus: dict[str, int] = field(default_factory=dict)  # by the verdict on each
    sessions: int = 0
    heartbeats: int = 0
    resumed: int = 0
    behind_s: float = 0.0  # silence liveness does not count against nodes: this controller's own backlog
    lag: Histogram = ([], 0.0)
    detection: dict[str, Histogram] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)  # by state
    incidents: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    recovery: dict[str, Histogram] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    culprits: list[tuple[str, common_pb2.HangCulprit]] = field(default_factory=list)  # (job, culprit) of active jobs
    active: list[tuple[str, str, int, int]] = field(default_factory=list)  # (job, state, restarts in a row, total)
    store: str = ""  # sqlite or etcd
    store_commit: Histogram = ([], 0.0)
    leadership: tuple[bool, int, int, int] | None = None  # (leading, epoch, terms won, failovers); None: no election


def _histogram(buckets: Buckets) -> Histogram:
    return buckets.cumulative(), buckets.sum


def take_snapshot(registry: Registry, jobs: JobManager, hub: EventHub, store: TimedStore | None = None,
                  elector: Elector | None = None, rendezvous: RendezvousService | None = None) -> Snapshot:
    """What a scrape shows, copied from the live state, torchrun runs counted as jobs. On the event loop only."""
    entries = registry.entries_by_name().values()
    nodes = [(e.record.name, e.record.state, e.verdict.health) for e in entries]  # names looked up in the thread
    gpus: Counter[str] = Counter()
    total = 0
    for e in entries:
        total += len(e.gpu_verdicts)
        if e.verdict.health is not HEALTHY:  # a node's verdict is its worst GPU's (or worse): skip healthy nodes
            gpus.update(v.health.name for v in e.gpu_verdicts.values())
    gpus[HEALTHY.name] += total - sum(gpus.values())
    every = [*jobs.list(set()), *(rendezvous.jobs() if rendezvous is not None else ())]
    active = [j for j in every if j.state in ACTIVE]
    incidents = Counter(jobs.incidents) + (rendezvous.book.incidents if rendezvous is not None else Counter())
    # a torchrun round restarted for an incident is the job's next generation: a restart of that cause
    restarts = Counter(jobs.restarts_by_cause) + (rendezvous.book.incidents if rendezvous is not None else Counter())
    return Snapshot(
        nodes=nodes, gpus=dict(gpus), sessions=registry.sessions, heartbeats=registry.heartbeats_total,
        resumed=registry.resumed_total, behind_s=registry.backlog.allowance,
        lag=_histogram(registry.lag_seconds),
        detection={kind: _histogram(b) for kind, b in registry.detection.items()},
        jobs=dict(Counter(state_name(j.state) for j in every)),
        incidents=dict(incidents), restarts=dict(restarts),
        recovery={cause: _histogram(b) for cause, b in jobs.recovery_s.items()},
        events=dict(hub.published),
        culprits=[(j.id, j.culprit) for j in active if j.HasField("culprit")],
        active=[(j.id, state_name(j.state), j.restarts_in_row, j.restarts) for j in active],
        store=store.kind if store is not None else "",
        store_commit=_histogram(store.commit_seconds) if store is not None else ([], 0.0),
        leadership=(elector.leading(), registry.epoch, elector.terms_won, elector.failovers) if elector else None)


def _counter(name: str, doc: str, label: str, counts: dict[str, int], known: Iterable[str] = ()) -> Metric:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value in sorted({*known, *counts}):
        family.add_metric([value], counts.get(value, 0))
    return family


def _histograms(name: str, doc: str, label: str, by_label: dict[str, Histogram]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=[label])
    for value, (buckets, total) in sorted(by_label.items()):
        family.add_metric([value], buckets, total)
    return family


def families(s: Snapshot) -> Iterator[Metric]:
    """The metric families of a snapshot (pure: any thread)."""
    yield _info()
    states = Counter(state for _, state, _ in s.nodes)
    by_state = GaugeMetricFamily("phalanx_nodes", "Nodes by state.", labels=["state"])
    for state in NodeState:
        by_state.add_metric([state.value], states[state])
    yield by_state
    node_state = GaugeMetricFamily("phalanx_node_state", "Each node's state (1 for the current one).",
                                   labels=["node", "state"])
    node_health = GaugeMetricFamily("phalanx_node_health", "The health verdict on each node (1 for the current "
                                    "one): HEALTHY, DEGRADED, FAILING or FAILED.", labels=["node", "verdict"])
    for name, state, verdict in sorted(s.nodes, key=lambda n: n[0]):
        node_state.add_metric([name, state.value], 1)
        node_health.add_metric([name, verdict.name], 1)
    yield node_state
    yield node_health
    gpus = GaugeMetricFamily("phalanx_gpus", "GPUs by the controller's latest verdict on each.", labels=["health"])
    for health in Health:
        gpus.add_metric([health.name], s.gpus.get(health.name, 0))
    yield gpus
    yield GaugeMetricFamily("phalanx_agents_connected", "Agents with an open session.", value=s.sessions)
    yield CounterMetricFamily("phalanx_heartbeats", "Heartbeats received from agents.", value=s.heartbeats)
    yield CounterMetricFamily("phalanx_sessions_resumed", "Agent sessions resumed with a known incarnation, with no "
                              "registration (after a controller restart, a takeover or a broken connection).",
                              value=s.resumed)
    yield GaugeMetricFamily("phalanx_liveness_held_back_seconds", "Seconds of silence the liveness sweep does not "
                            "count against nodes because this controller is behind at reading heartbeats (its event "
                            "loop stalled, or its queue of heartbeats grew); 0 when it keeps up.", value=s.behind_s)
    lag = HistogramMetricFamily("phalanx_heartbeat_lag_seconds", "From an agent sending a heartbeat to the "
                                "controller applying it (the hosts' clocks must agree).")
    lag.add_metric([], *s.lag)
    yield lag
    yield _histograms("phalanx_detection_latency_seconds", "From a fault's first sign to the controller's "
                      "decision: node_down (from the node's last heartbeat to DOWN), xid (from the agent seeing "
                      "the XID to the verdict acted on), health (from sending the heartbeat whose signals made a "
                      "node's verdict worse to that verdict).", "kind", s.detection)
    jobs = GaugeMetricFamily("phalanx_jobs", "Jobs by state.", labels=["state"])
    for state in JOB_STATES:
        jobs.add_metric([state], s.jobs.get(state, 0))
    yield jobs
    yield _counter("phalanx_job_incidents", "Incidents found in running jobs, by kind.", "kind", s.incidents,
                   JobManager.INCIDENT_KINDS)
    yield _counter("phalanx_job_restarts", "Job generations restarted by recovery, by the incident's kind "
                   "(resumed: a recovery a previous controller process began).", "cause", s.restarts,
                   JobManager.INCIDENT_KINDS)
    yield _histograms("phalanx_recovery_duration_seconds", "From an incident to the job's next generation running "
                      "(recoveries this controller process began).", "cause", s.recovery)
    yield _counter("phalanx_events", "Events written to the event log, by kind.", "kind", s.events)
    culprit = GaugeMetricFamily("phalanx_job_hang_culprit", "The rank an active job's hang was blamed on, from the "
                                "NCCL flight-recorder dumps (1 while the job recovers from it or runs on): its node "
                                "and its last collective.", labels=["job", "rank", "node", "op", "seq", "state"])
    for job, c in s.culprits:
        culprit.add_metric([job, str(c.rank), c.node, c.op, str(c.seq), c.state], 1)
    yield culprit
    in_row = GaugeMetricFamily("phalanx_job_restarts_in_row", "An active job's restarts in place since it last ran "
                               "for recovery.restart_window_s (what recovery.max_restarts counts).", labels=["job"])
    total = CounterMetricFamily("phalanx_job_generation_restarts", "An active job's restarts, every cause.",
                                labels=["job"])
    state = GaugeMetricFamily("phalanx_job_state", "Each active job's state (1 for the current one).",
                              labels=["job", "state"])
    for job, job_state, row, restarts in s.active:
        in_row.add_metric([job], row)
        total.add_metric([job], restarts)
        state.add_metric([job, job_state], 1)
    yield in_row
    yield total
    yield state
    if s.store:
        commit = HistogramMetricFamily("phalanx_store_commit_seconds", "Time of one store commit (a transaction of "
                                       "records and events).", labels=["store"])
        commit.add_metric([s.store], *s.store_commit)
        yield commit
    if s.leadership is not None:
        yield from leadership_families(*s.leadership)


def _info() -> Metric:
    info = InfoMetricFamily("phalanx_controller", "The controller: its version.")
    info.add_metric([], {"version": __version__})
    return info


def leadership_families(leading: bool, epoch: int, won: int, failovers: int,
                        parked: int | None = None) -> Iterator[Metric]:
    """A member of a control plane on etcd: whether it leads, the epoch, its wins; standing by, the sessions
    parked at it."""
    yield GaugeMetricFamily("phalanx_controller_leader", "1 while this controller leads the control plane, 0 while "
                            "it stands by.", value=int(leading))
    yield GaugeMetricFamily("phalanx_controller_epoch", "The leadership epoch: of this controller's term while it "
                            "leads, else of the leader it last saw (0: none seen).", value=epoch)
    yield CounterMetricFamily("phalanx_controller_terms", "Elections this controller process has won.", value=won)
    yield CounterMetricFamily("phalanx_controller_failovers", "Elections this controller process won from "
                              "another leader (takeovers).", value=failovers)
    if parked is not None:
        yield GaugeMetricFamily("phalanx_controller_parked_sessions", "Agents' sessions parked at this standby, "
                                "which it takes up if it is elected (one per agent when all is well).", value=parked)


class ControllerCollector:
    """Renders the snapshot taken last (`snapshot()`, on the event loop, before every scrape)."""

    def __init__(self, registry: Registry, jobs: JobManager, hub: EventHub, store: TimedStore | None = None,
                 elector: Elector | None = None) -> None:
        self._sources = registry, jobs, hub, store, elector
        self.rendezvous: RendezvousService | None = None  # torchrun's runs, once the server has its servicer
        self._snapshot: Snapshot | None = None

    def snapshot(self) -> None:
        self._snapshot = take_snapshot(*self._sources, rendezvous=self.rendezvous)

    def describe(self) -> list[Metric]:
        return []  # nothing to check for duplicates; keeps registration from collecting

    def collect(self) -> Iterator[Metric]:
        if self._snapshot is None:  # rendered without a scrape's snapshot (tests): this is the loop's thread
            self.snapshot()
        return families(self._snapshot)


class ControlPlaneCollector:
    """The metrics of a controller on etcd (controller/main.py serve_ha), served from its start, whether it leads
    or not, so that Prometheus may scrape every member: while it leads (`term` set), its term's
    ControllerCollector; standing by, its leadership alone (leader 0, the epoch of the leader it last saw, the
    sessions parked at it). A standby shows no nodes or jobs: those are the leader's, and a standby's would be
    stale and counted twice."""

    def __init__(self, elector: Elector, parked: Callable[[], int]) -> None:
        self._elector = elector
        self._parked = parked
        self.term: ControllerCollector | None = None
        self._render: Callable[[], Iterable[Metric]] | None = None

    def snapshot(self) -> None:
        term = self.term
        if term is not None:
            term.snapshot()
            self._render = term.collect
            return
        e = self._elector
        seen = e.leader.epoch if e.leader is not None else 0
        leading = e.leading()  # (elected, its store still loading: no parked sessions to count, no fleet yet)
        standing = (leading, seen, e.terms_won, e.failovers, None if leading else self._parked())
        self._render = lambda: [_info(), *leadership_families(*standing)]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        if self._render is None:  # rendered without a scrape's snapshot (tests): this is the loop's thread
            self.snapshot()
        return self._render()


def serving(collector: ControllerCollector | ControlPlaneCollector) -> MetricsServer:
    return MetricsServer(standard_registry(collector), collector.snapshot)


def server(registry: Registry, jobs: JobManager, hub: EventHub, store: TimedStore | None = None,
           elector: Elector | None = None) -> MetricsServer:
    return serving(ControllerCollector(registry, jobs, hub, store, elector))
