"""Prometheus metrics: the /metrics server, both collectors (the controller's under a fake clock), and
the real daemons scraped while real things happen to them."""

import asyncio
import dataclasses
import shutil
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from agent import config as agent_config
from agent import metrics as agent_metrics
from agent.collectors.sim import SimBackend
from controller import config as controller_config
from controller.config import HealthConfig, JobsConfig, LivenessConfig, RecoveryConfig
from controller.jobs.manager import JobManager
from controller.jobs.topology import flat
from controller.nodes.registry import Registry
from controller.nodes.session import Session
from controller.obs import metrics as controller_metrics
from controller.obs.events import EventHub
from controller.obs.stats import Buckets
from controller.store.memory import MemoryStore
from phalanx import faults, metrics_http
from phalanx.clock import FakeClock
from phalanx.errors import ConfigError
from phalanx.v1 import common_pb2, node_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package "
                                    "`prometheus`; tools/install-system-deps installs it)")


# -- helpers ---------------------------------------------------------------------------------------

def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample `name` whose labels include `labels`; None if there is none."""
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else None


def labels_of(text: str, name: str, **labels: str) -> dict[str, str]:
    """All the labels of the one sample `name` whose labels include `labels`."""
    found = [s.labels for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels} matches {len(found)} samples"
    return found[0]


def names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def promtool_check(text: str) -> None:
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"] == CONTENT_TYPE_LATEST
        return reply.read().decode()


def scraped(address: str) -> str:
    """A scrape, or "" while the endpoint is not up yet (for wait_for)."""
    try:
        return scrape(address)
    except OSError:
        return ""


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def raw(address: str, data: bytes, close_early: bool = False) -> bytes:
    """Send `data` on a connection of its own and return whatever comes back."""
    with connect(address) as s:
        try:
            s.sendall(data)
            if close_early:
                return b""
            s.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            return reply
        except OSError:  # the server may cut off what it will not read: that is an answer too
            return b""


# -- the buckets -----------------------------------------------------------------------------------

def test_buckets_count_like_a_prometheus_histogram():
    b = Buckets((1.0, 0.1))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        b.observe(v)
    assert b.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]  # le is inclusive; buckets sorted
    assert (b.count, b.sum) == (5, pytest.approx(8.65))


# -- the HTTP server -------------------------------------------------------------------------------

class Flaky:
    """A collector that fails when told to."""

    fail = False

    def collect(self):
        if self.fail:
            raise RuntimeError("collector bug")
        family = GaugeMetricFamily("phalanx_test_value", "A test value.", labels=["kind"])
        family.add_metric(["x"], 42)
        yield family


async def exchange(port: int, data: bytes) -> bytes:
    """Send `data` and return the answer (b"": closed without one)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        if data:
            writer.write_eof()
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def test_server_answers_metrics_and_nothing_else(monkeypatch):
    monkeypatch.setattr(metrics_http, "READ_TIMEOUT_S", 0.2)
    collector = Flaky()
    registry = CollectorRegistry()
    registry.register(collector)
    snapshots = []
    server = metrics_http.MetricsServer(registry, lambda: snapshots.append(1))

    async def go():
        port = await server.start("127.0.0.1:0")
        ok = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        head, body = ok.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and f"Content-Type: {CONTENT_TYPE_LATEST}".encode() in head
        assert f"Content-Length: {len(body)}".encode() in head
        assert value(body.decode(), "phalanx_test_value", kind="x") == 42
        assert snapshots == [1]  # the daemon's snapshot was taken for the scrape
        assert (await exchange(port, b"GET /metrics?name[]=x HTTP/1.0\n\n")).startswith(b"HTTP/1.1 200 OK")
        head_only = await exchange(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert head_only.startswith(b"HTTP/1.1 200 OK") and head_only.endswith(b"\r\n\r\n")
        assert (await exchange(port, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404 Not Found")
        post = await exchange(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc")
        assert post.startswith(b"HTTP/1.1 405 Method Not Allowed") and b"Allow: GET, HEAD" in post
        assert (await exchange(port, b"\x00\xff\xfe garbage\r\n\r\n")).startswith(b"HTTP/1.1 400 Bad Request")
        assert (await exchange(port, b"GET /metrics\r\n\r\n")).startswith(b"HTTP/1.1 400")  # HTTP/0.9
        huge = await exchange(port, b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n")
        assert huge.startswith(b"HTTP/1.1 431")
        many_headers = await exchange(port, b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 2000 + b"\r\n")
        assert many_headers.startswith(b"HTTP/1.1 431")
        assert await exchange(port, b"GET /metrics HTTP/1.1\r\n") == b""  # ended before the headers did
        assert await exchange(port, b"") == b""  # says nothing: cut off after READ_TIMEOUT_S
        collector.fail = True
        broken = await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert broken.startswith(b"HTTP/1.1 500") and b"RuntimeError: collector bug" in broken
        collector.fail = False
        assert (await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        await server.close()

    asyncio.run(go())


def test_server_turns_away_clients_beyond_its_limit(monkeypatch):
    monkeypatch.setattr(metrics_http, "MAX_CLIENTS", 2)
    server = metrics_http.MetricsServer(CollectorRegistry())

    async def go():
        port = await server.start("127.0.0.1:0")
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0)  # let the server take them
        assert await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n") == b""  # a third: closed at once
        for _, writer in idle:
            writer.close()
        while server._handlers:
            await asyncio.sleep(0.01)
        assert (await exchange(port, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        await server.close()

    asyncio.run(go())


def test_a_taken_port_is_an_error_naming_the_address():
    async def go():
        first = metrics_http.MetricsServer(CollectorRegistry())
        port = await first.start("127.0.0.1:0")
        second = metrics_http.MetricsServer(CollectorRegistry())
        with pytest.raises(OSError) as info:
            await second.start(f"127.0.0.1:{port}")
        assert str(info.value) == f"cannot serve metrics on 127.0.0.1:{port}: address already in use"
        assert await second.serve(f"127.0.0.1:{port}") is False  # what the daemons call: logged, not raised
        await first.close()

    asyncio.run(go())


# -- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("load,text,message", [
    (controller_config.load, 'metrics_listen = "7371"', "metrics_listen ('7371') must be host:port, e.g. "
                                                        "0.0.0.0:7371"),
    (controller_config.load, 'metrics_listen = "0.0.0.0:99999"', "metrics_listen ('0.0.0.0:99999') must be "
                                                                 "host:port, e.g. 0.0.0.0:7371"),
    (agent_config.load, 'metrics_listen = "localhost:"', "metrics_listen ('localhost:') must be host:port, e.g. "
                                                         "0.0.0.0:7372"),
    (agent_config.load, 'metrics_listen = "[::1:80"', "metrics_listen ('[::1:80') must be host:port, e.g. "
                                                      "0.0.0.0:7372"),
    (agent_config.load, "metrics_listen = 9400", "metrics_listen must be a string, not int 9400"),
])
def test_bad_metrics_listen_is_named(tmp_path, load, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(str(path))
    assert str(info.value) == f"{path}: {message}"


def test_metrics_are_off_by_default_and_take_any_bindable_address(tmp_path):
    assert controller_config.load(None).metrics_listen == agent_config.load(None).metrics_listen == ""
    path = tmp_path / "c.toml"
    for address in ("0.0.0.0:7371", "[::1]:0", "localhost:9400"):
        path.write_text(f'metrics_listen = "{address}"')
        assert controller_config.load(str(path)).metrics_listen == agent_config.load(str(path)).metrics_listen


@pytest.mark.parametrize("module", ["controller.main", "agent.main"])
def test_daemon_with_a_bad_metrics_listen_says_so_in_one_line_and_exits_2(tmp_path, module):
    path = tmp_path / "c.toml"
    path.write_text('metrics_listen = "nope"\n')
    result = subprocess.run([sys.executable, "-m", module, "--config", str(path)], capture_output=True, text=True,
                            timeout=60)
    example = "0.0.0.0:7371" if module == "controller.main" else "0.0.0.0:7372"
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"phalanx-{module.split('.')[0]}: config error: {path}: metrics_listen ('nope') must be "
                             f"host:port, e.g. {example}\n")


# -- the controller's collector, under a fake clock ------------------------------------------------

def test_controller_metrics_follow_nodes_health_and_detection():
    clock, store, hub = FakeClock(), MemoryStore(), EventHub()
    registry = Registry(store, clock, LivenessConfig(), hub, HealthConfig())
    jobs = JobManager(store, registry, clock, hub, JobsConfig(), lambda: flat({}), RecoveryConfig())
    server = controller_metrics.server(registry, jobs, hub)

    def v(name, **labels):
        server.snapshot()  # what a scrape does on the event loop before rendering
        return server.registry.get_sample_value(name, labels)

    def inventory(gpus):
        return common_pb2.NodeInventory(gpus=[common_pb2.GpuInfo(index=i) for i in range(gpus)])

    async def join(name):
        entry = await registry.register(name, inventory(2), "ipv4:127.0.0.1:1")
        registry.attach(name, entry.record.incarnation, Session("ipv4:127.0.0.1:1"))
        return entry

    async def beat(entry, lag_ms, **gpu0):
        heartbeat = node_pb2.Heartbeat(sent_unix_ns=clock.wall_ns() - lag_ms * 1_000_000,
                                       health_digest=1 + len(gpu0), gpus=[
            common_pb2.GpuTelemetry(index=0, **gpu0), common_pb2.GpuTelemetry(index=1)])
        if registry.heartbeat(entry, heartbeat):
            await registry.settle(entry)

    async def go():
        n1, n2 = await join("n1"), await join("n2")
        await beat(n1, 2)
        await beat(n2, 4)
        assert v("phalanx_nodes", state="UP") == 2 and v("phalanx_nodes", state="DOWN") == 0
        assert v("phalanx_node_state", node="n1", state="UP") == 1
        assert v("phalanx_node_health", node="n1", verdict="HEALTHY") == 1
        assert v("phalanx_gpus", health="HEALTHY") == 4 and v("phalanx_gpus", health="FAILED") == 0
        assert (v("phalanx_agents_connected"), v("phalanx_heartbeats_total")) == (2, 2)
        assert v("phalanx_liveness_held_back_seconds") == 0  # keeping up
        # n2's connection breaks and its agent resumes the session: counted, with no registration
        assert v("phalanx_sessions_resumed_total") == 0
        registry.detach(n2, n2.session)
        registry.attach("n2", n2.record.incarnation, Session("ipv4:127.0.0.1:2"))
        assert v("phalanx_sessions_resumed_total") == 1 and v("phalanx_agents_connected") == 2
        assert v("phalanx_heartbeat_lag_seconds_count") == 2
        assert v("phalanx_heartbeat_lag_seconds_sum") == pytest.approx(0.006)
        assert v("phalanx_heartbeat_lag_seconds_bucket", le="0.0025") == 1
        assert v("phalanx_heartbeat_lag_seconds_bucket", le="0.005") == 2

        # an XID 79 the agent saw 5 ms before the controller judged it: FAILED, drained at once
        await registry.gpu_event(n1, common_pb2.GpuEvent(gpu_index=1, xid=79, time_unix_ns=clock.wall_ns() - 5_000_000))
        assert v("phalanx_detection_latency_seconds_count", kind="xid") == 1
        assert v("phalanx_detection_latency_seconds_sum", kind="xid") == pytest.approx(0.005)
        assert v("phalanx_node_health", node="n1", verdict="FAILED") == 1
        assert v("phalanx_node_health", node="n1", verdict="HEALTHY") is None
        assert v("phalanx_node_state", node="n1", state="DRAINED") == 1 and v("phalanx_nodes", state="DRAINED") == 1
        assert v("phalanx_gpus", health="FAILED") == 1 and v("phalanx_gpus", health="HEALTHY") == 3
        assert v("phalanx_events_total", kind="gpu.xid") == 1 and v("phalanx_events_total", kind="node.drain") == 1

        # a pending row remap in a heartbeat sent 3 ms ago makes n2 FAILING: detected from that heartbeat
        await beat(n2, 3, remap_pending=True)
        assert v("phalanx_detection_latency_seconds_count", kind="health") == 1
        assert v("phalanx_detection_latency_seconds_sum", kind="health") == pytest.approx(0.003)
        assert v("phalanx_node_health", node="n2", verdict="FAILING") == 1

        # both fall silent: DOWN after exactly 3 s without a heartbeat
        clock.advance(2.0)
        await registry.tick()
        assert v("phalanx_nodes", state="SUSPECT") == 2
        clock.advance(1.0)
        await registry.tick()
        assert v("phalanx_nodes", state="DOWN") == 2 and v("phalanx_agents_connected") == 0
        assert v("phalanx_detection_latency_seconds_count", kind="node_down") == 2
        assert v("phalanx_detection_latency_seconds_bucket", kind="node_down", le="3.0") == 2
        assert v("phalanx_detection_latency_seconds_bucket", kind="node_down", le="2.0") == 0
        assert v("phalanx_jobs", state="PENDING") == 0 and v("phalanx_job_restarts_total", cause="crash") == 0
        assert v("phalanx_recovery_duration_seconds_count", cause="node-lost") == 0
        return generate_latest(server.registry).decode()

    text = asyncio.run(go())
    if PROMTOOL:
        promtool_check(text)


def test_controller_snapshot_of_an_empty_cluster_has_every_series_at_zero():
    clock, store, hub = FakeClock(), MemoryStore(), EventHub()
    registry = Registry(store, clock, LivenessConfig(), hub, HealthConfig())
    jobs = JobManager(store, registry, clock, hub, JobsConfig(), lambda: flat({}), RecoveryConfig())
    snapshot = controller_metrics.take_snapshot(registry, jobs, hub)
    assert snapshot.nodes == [] and snapshot.gpus == {"HEALTHY": 0}
    assert snapshot.detection.keys() == {"node_down", "xid", "health"}


def test_a_hang_culprit_from_the_flight_recorder_is_a_series_while_its_job_is_active():
    from controller.jobs.manager import JobEntry

    clock, store, hub = FakeClock(), MemoryStore(), EventHub()
    registry = Registry(store, clock, LivenessConfig(), hub, HealthConfig())
    jobs = JobManager(store, registry, clock, hub, JobsConfig(), lambda: flat({}), RecoveryConfig())
    server = controller_metrics.server(registry, jobs, hub)
    culprit = common_pb2.HangCulprit(rank=3, node="n2", op="nccl:all_reduce", seq=41, state="started")
    jobs.entries["job-1"] = JobEntry(common_pb2.Job(id="job-1", state=common_pb2.JOB_STATE_EVICTING, culprit=culprit))
    jobs.entries["job-2"] = JobEntry(common_pb2.Job(id="job-2", state=common_pb2.JOB_STATE_FAILED, culprit=culprit))
    server.snapshot()
    labels = {"job": "job-1", "rank": "3", "node": "n2", "op": "nccl:all_reduce", "seq": "41", "state": "started"}
    assert server.registry.get_sample_value("phalanx_job_hang_culprit", labels) == 1
    assert server.registry.get_sample_value("phalanx_job_hang_culprit", {**labels, "job": "job-2"}) is None


# -- the agent's collector -------------------------------------------------------------------------

def agent_view(backend, *, verdict=None, sessions=1, telemetry=None, xids=None):
    return agent_metrics.AgentView(
        node="n1", gpu_backend="sim", inventory=backend.inventory, telemetry=telemetry or backend.sample,
        host=lambda: common_pb2.HostTelemetry(checkpoint_free_bytes=5 << 30), xids=xids or agent_metrics.XidTally(),
        verdict=lambda: verdict, connected=lambda: sessions > 0, node_state=lambda: common_pb2.NODE_STATE_UP,
        sessions=lambda: sessions, heartbeats=lambda: 7,
        ranks=lambda: [node_pb2.RankStatus(state=common_pb2.RANK_STATE_RUNNING),
                       node_pb2.RankStatus(state=common_pb2.RANK_STATE_EXITED)])


def render(view) -> str:
    server = agent_metrics.server(view)
    server.snapshot()
    return generate_latest(server.registry).decode()


def test_agent_metrics_show_the_nodes_snapshots_and_how_they_travelled():
    stats = agent_metrics.SnapshotStats(budget=8 << 30, held={"own": 3 << 20, "replica": 5 << 20}, replicas_sent=4,
                                        fetched={"bulk port": 2, "gRPC stream": 1}, bulk_sent=6)
    view = agent_view(SimBackend(1, "n1", seed=1))
    text = render(agent_metrics.AgentView(**{**view.__dict__, "snapshots": lambda: stats}))
    assert value(text, "phalanx_agent_snapshot_budget_bytes") == 8 << 30
    assert value(text, "phalanx_agent_snapshot_bytes", kind="own") == 3 << 20
    assert value(text, "phalanx_agent_snapshot_bytes", kind="replica") == 5 << 20
    assert value(text, "phalanx_agent_snapshot_replicas_sent_total") == 4
    assert value(text, "phalanx_agent_snapshot_fetches_total", via="bulk") == 2
    assert value(text, "phalanx_agent_snapshot_fetches_total", via="grpc") == 1
    assert value(text, "phalanx_agent_snapshot_bulk_sent_total") == 6
    assert value(render(view), "phalanx_agent_snapshot_budget_bytes") is None  # a node without snapshots
    if PROMTOOL:
        promtool_check(text)


def test_agent_metrics_use_dcgm_exporter_names_and_labels():
    sim = SimBackend(3, "n1", seed=1)
    sim.inject(0, faults.parse("remap-pending"))
    sim.inject(1, faults.parse("gpu-lost"))
    sim.inject(2, faults.parse("pcie-replay=7"))
    sim.inject(2, faults.parse("thermal"))
    xids = agent_metrics.XidTally()
    xids.record(common_pb2.GpuEvent(gpu_index=1, xid=79))
    xids.record(common_pb2.GpuEvent(gpu_index=0, xid=63))
    xids.record(common_pb2.GpuEvent(gpu_index=0, xid=63))
    text = render(agent_view(sim, xids=xids))
    gpu2 = sim.inventory()[2]
    assert value(text, "DCGM_FI_DEV_GPU_TEMP", gpu="2", UUID=gpu2.uuid, pci_bus_id=gpu2.pci_bus_id, device="nvidia2",
                 Hostname="n1") == 90.0  # thermal: above the 87 C slowdown threshold
    assert value(text, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", gpu="2") == 0x60
    assert value(text, "DCGM_FI_DEV_SM_CLOCK", gpu="2") < value(text, "DCGM_FI_DEV_SM_CLOCK", gpu="0")
    assert value(text, "phalanx_gpu_pcie_replays_total", gpu="2") == 7
    assert value(text, "DCGM_FI_DEV_ROW_REMAP_PENDING", gpu="0") == 1
    assert value(text, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", gpu="0") == 1
    assert value(text, "DCGM_FI_DEV_ROW_REMAP_PENDING", gpu="2") == 0
    assert value(text, "DCGM_FI_DEV_FB_FREE", gpu="0") == 80 * 1024
    # a lost GPU answers nothing but that it is lost
    assert value(text, "phalanx_gpu_lost", gpu="1") == 1 and value(text, "phalanx_gpu_lost", gpu="0") == 0
    assert value(text, "DCGM_FI_DEV_GPU_TEMP", gpu="1") is None
    assert value(text, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 79 and value(text, "DCGM_FI_DEV_XID_ERRORS", gpu="2") == 0
    assert value(text, "phalanx_gpu_xid_errors_total", gpu="0", xid="63") == 2
    assert value(text, "phalanx_gpu_info", gpu="0", model_name="NVIDIA H100 80GB HBM3 (simulated)") == 1
    assert value(text, "phalanx_agent_info", node="n1", gpu_backend="sim") == 1
    assert value(text, "phalanx_agent_ranks", state="RUNNING") == 1 and value(text, "phalanx_agent_ranks",
                                                                              state="LOST") == 0
    assert value(text, "phalanx_agent_heartbeats_total") == 7
    assert value(text, "phalanx_agent_checkpoint_free_bytes") == 5 << 30
    assert {"process_resident_memory_bytes", "python_info"} <= names(text)
    if PROMTOOL:
        promtool_check(text)


def test_agent_metrics_leave_out_what_nvml_does_not_report():
    sim = SimBackend(1, "n1")
    text = render(agent_view(sim, telemetry=lambda: [common_pb2.GpuTelemetry(index=0, temperature_c=40.0)]))
    assert value(text, "DCGM_FI_DEV_GPU_TEMP", gpu="0") == 40.0
    assert value(text, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", gpu="0") is None  # NotSupported is not zero
    assert value(text, "phalanx_gpu_pcie_replays_total", gpu="0") is None


def test_the_sm_clock_is_a_reading_not_a_health_signal():
    from agent.main import health_digest

    host = common_pb2.HostTelemetry()
    boost = common_pb2.GpuTelemetry(index=0, sm_clock_mhz=1980, remap_pending=False)
    slowed = common_pb2.GpuTelemetry(index=0, sm_clock_mhz=1200, remap_pending=False)
    assert health_digest([boost], host) == health_digest([slowed], host)  # the controller is not bothered
    assert health_digest([boost], host) != health_digest([common_pb2.GpuTelemetry(index=0, remap_pending=True)],
                                                         host)


def test_agent_gpu_health_is_the_controllers_verdict_as_last_heard():
    sim = SimBackend(2, "n1")

    def health(**kw):
        text = render(agent_view(sim, **kw))
        return [next(v for v in ("UNKNOWN", "HEALTHY", "DEGRADED", "FAILING", "FAILED")
                     if value(text, "phalanx_gpu_health", gpu=str(i), verdict=v) == 1) for i in range(2)]

    assert health(sessions=0) == ["UNKNOWN", "UNKNOWN"]  # never heard from the controller
    assert health(sessions=1) == ["HEALTHY", "HEALTHY"]  # a session without a verdict pushed: nothing found
    failed = common_pb2.NodeHealth(health=common_pb2.HEALTH_FAILED, gpus=[
        common_pb2.GpuVerdict(index=0, health=common_pb2.HEALTH_HEALTHY),
        common_pb2.GpuVerdict(index=1, health=common_pb2.HEALTH_FAILED)])
    assert health(sessions=1, verdict=failed) == ["HEALTHY", "FAILED"]


# -- the real daemons ------------------------------------------------------------------------------

def wait_value(cluster, address, name, expected, what="", **labels):
    cluster.wait_for(lambda: value(scraped(address), name, **labels) == expected,
                     f"{name}{labels} == {expected} at {address} {what}")


def test_scrapes_of_both_daemons_follow_a_gpu_fault_and_a_lost_node(cluster):
    cluster.start_controller(metrics=True)
    cluster.start_agent("n1", gpus=2, metrics=True)
    cluster.wait_states({"n1": "UP"})
    controller, agent = cluster.metrics["controller"], cluster.metrics["n1"]
    wait_value(cluster, agent, "phalanx_agent_connected", 1)
    wait_value(cluster, controller, "phalanx_nodes", 1, state="UP")
    text = scrape(agent)
    uuid = labels_of(text, "phalanx_gpu_info", gpu="1")["UUID"]
    assert uuid.startswith("GPU-")
    assert value(text, "DCGM_FI_DEV_XID_ERRORS", gpu="1", UUID=uuid, Hostname="n1") == 0
    assert value(text, "DCGM_FI_DEV_GPU_TEMP", gpu="1") > 0
    assert value(text, "phalanx_gpu_health", gpu="1", verdict="HEALTHY") == 1

    injected = cluster.cli("inject", "n1", "--gpu", "1", "xid=79")
    assert injected.returncode == 0, injected.stderr
    # The verdict is set before the drain's commit returns, and the XID's latency is counted after it: one scrape
    # that shows all of them, not the first that shows the verdict.
    after_xid = {("phalanx_node_health", ("node", "n1"), ("verdict", "FAILED")): 1,
                 ("phalanx_nodes", ("state", "DRAINED")): 1, ("phalanx_gpus", ("health", "FAILED")): 1,
                 ("phalanx_detection_latency_seconds_count", ("kind", "xid")): 1,
                 ("phalanx_events_total", ("kind", "gpu.xid")): 1}

    def seen_after_xid() -> dict:
        text = scraped(controller)
        return {key: value(text, key[0], **dict(key[1:])) for key in after_xid}

    cluster.wait_for(lambda: seen_after_xid() == after_xid, "the controller's metrics after XID 79")
    wait_value(cluster, agent, "phalanx_gpu_health", 1, "after XID 79", gpu="1", verdict="FAILED")
    wait_value(cluster, agent, "phalanx_gpu_lost", 1, "in the next reading", gpu="1")
    text = scrape(agent)
    assert value(text, "DCGM_FI_DEV_XID_ERRORS", gpu="1", UUID=uuid) == 79
    assert value(text, "phalanx_gpu_health", gpu="0", verdict="HEALTHY") == 1
    assert value(text, "phalanx_agent_node_state", state="DRAINED") == 1

    cluster.kill("n1")
    wait_value(cluster, controller, "phalanx_nodes", 1, "after kill -9 of the agent", state="DOWN")
    text = scrape(controller)
    assert value(text, "phalanx_detection_latency_seconds_count", kind="node_down") == 1
    assert value(text, "phalanx_agents_connected") == 0


CRASH_ONCE = ("import os, sys, time\n"
              "if os.environ['PHALANX_GENERATION'] == '1':\n"
              "    sys.exit(3)\n"
              "time.sleep(600)\n")


def test_scrapes_follow_a_jobs_states_and_its_recovery(cluster):
    cluster.start_controller("[jobs]\nstop_grace_s = 2.0\n[recovery]\nrestart_backoff_s = 0.2\n", metrics=True)
    cluster.start_agent("n1", gpus=1, metrics=True)
    cluster.wait_states({"n1": "UP"})
    controller, agent = cluster.metrics["controller"], cluster.metrics["n1"]
    submitted = cluster.cli("submit", "--nodes", "1", "--", sys.executable, "-c", CRASH_ONCE)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    # generation 1 exits 3: a crash, restarted in place; generation 2 runs
    wait_value(cluster, controller, "phalanx_job_restarts_total", 1, "after the crash", cause="crash")
    wait_value(cluster, controller, "phalanx_jobs", 1, "after the restart", state="RUNNING")
    text = scrape(controller)
    assert value(text, "phalanx_job_incidents_total", kind="crash") == 1
    assert value(text, "phalanx_recovery_duration_seconds_count", cause="crash") == 1
    assert value(text, "phalanx_recovery_duration_seconds_sum", cause="crash") > 0
    assert value(text, "phalanx_events_total", kind="job.incident") == 1
    wait_value(cluster, agent, "phalanx_agent_ranks", 1, "with generation 2 running", state="RUNNING")
    # the GPU's series say which job and rank run on it: no join needed to find the job on a failing GPU
    assert value(scrape(agent), "DCGM_FI_DEV_GPU_TEMP", gpu="0", hpc_job=job, rank="0") is not None
    assert value(scrape(agent), "phalanx_agent_snapshot_budget_bytes") > 0  # the real agent's snapshot store

    assert cluster.cli("cancel", job).returncode == 0
    wait_value(cluster, controller, "phalanx_jobs", 1, "after the cancel", state="CANCELLED")
    assert value(scrape(controller), "phalanx_jobs", state="RUNNING") == 0
    wait_value(cluster, agent, "phalanx_agent_ranks", 0, "after the cancel", state="RUNNING")
    assert labels_of(scrape(agent), "DCGM_FI_DEV_GPU_TEMP", gpu="0")["hpc_job"] == ""  # idle again


JUNK = [b"\x00" * 10_000, b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"y" * 100_000 + b"\r\n\r\n",
        b"GET /../../etc/passwd HTTP/1.1\r\n\r\n", b"DELETE /metrics HTTP/1.1\r\n\r\n", b"\r\n" * 5000,
        b"GET /metrics HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "GET /métriques HTTP/1.1\r\n\r\n".encode(),
        bytes(range(256)) * 40]


def test_junk_requests_do_not_hurt_either_daemon(cluster):
    cluster.start_controller(metrics=True)
    cluster.start_agent("n1", metrics=True)
    cluster.wait_states({"n1": "UP"})
    for name, address in cluster.metrics.items():
        cluster.wait_for(lambda a=address: scraped(a), f"{name}'s metrics")
        for junk in JUNK:
            reply = raw(address, junk)
            assert reply == b"" or reply.startswith((b"HTTP/1.1 4", b"HTTP/1.1 200")), (junk[:40], reply[:80])
            raw(address, junk, close_early=True)
        # a crowd of connections that never finish their request
        idle = [connect(address) for _ in range(metrics_http.MAX_CLIENTS + 4)]
        for s in idle:
            s.close()
        # the server drops them as it reads their ends: until then a scrape may be one connection too many
        cluster.wait_for(lambda a=address: scraped(a), f"{name}'s metrics after the idle crowd left")
        assert value(scrape(address), "process_cpu_seconds_total") is not None
        assert cluster.procs[name].poll() is None, cluster.log(name)
    cluster.wait_states({"n1": "UP"})
    cluster.wait_for(cluster._serving, "the controller serving after the crowd")  # each try has a 1 s deadline


def test_a_taken_metrics_port_costs_the_metrics_not_the_daemon(cluster):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        cluster.start_controller(f'metrics_listen = "{address}"\n')  # waits until it serves gRPC
        cluster.start_agent("n1", extra=f'metrics_listen = "{address}"\n')
        cluster.wait_states({"n1": "UP"})
        for name in ("controller", "n1"):
            cluster.wait_for(lambda n=name: "metrics not served" in cluster.log(n, lines=200), f"{name}'s log")
            assert f"cannot serve metrics on {address}: address already in use" in cluster.log(name, lines=200)


@needs_promtool
def test_promtool_finds_nothing_wrong_with_either_endpoint(cluster):
    cluster.start_controller(metrics=True)
    cluster.start_agent("n1", gpus=4, metrics=True)
    cluster.wait_connected(["n1"])  # an injected fault goes down the session
    for gpu, fault in enumerate(("xid=79", "remap-pending", "ecc-sbe-rate=50", "nvlink-errors=10")):
        assert cluster.cli("inject", "n1", "--gpu", str(gpu), fault).returncode == 0
    wait_value(cluster, cluster.metrics["controller"], "phalanx_nodes", 1, state="DRAINED")
    wait_value(cluster, cluster.metrics["n1"], "phalanx_gpu_health", 1, gpu="0", verdict="FAILED")
    for address in cluster.metrics.values():
        promtool_check(scrape(address))


def test_leadership_and_store_latency_series_on_an_elected_controller():
    from controller.obs.stats import LAG_BUCKETS_S, Buckets
    commits = Buckets(LAG_BUCKETS_S)
    commits.observe(0.004)
    clock, store, hub = FakeClock(), MemoryStore(), EventHub()
    registry = Registry(store, clock, LivenessConfig(), hub, HealthConfig())
    jobs = JobManager(store, registry, clock, hub, JobsConfig(), lambda: flat({}), RecoveryConfig())
    solo_snapshot = controller_metrics.take_snapshot(registry, jobs, hub)
    snapshot = dataclasses.replace(solo_snapshot, store="etcd", store_commit=(commits.cumulative(), commits.sum),
                                   leadership=(True, 42, 3, 2))
    found = {s.name: s for family in controller_metrics.families(snapshot) for s in family.samples}
    assert found["phalanx_controller_leader"].value == 1 and found["phalanx_controller_epoch"].value == 42
    assert found["phalanx_controller_terms_total"].value == 3
    assert found["phalanx_controller_failovers_total"].value == 2
    assert found["phalanx_store_commit_seconds_count"].value == 1
    assert found["phalanx_store_commit_seconds_count"].labels == {"store": "etcd"}
    solo = {s.name for family in controller_metrics.families(solo_snapshot) for s in family.samples}
    assert not {n for n in solo if n.startswith(("phalanx_controller_leader", "phalanx_controller_epoch"))}


# -- who may scrape: TLS, client certificates, basic auth ----------------------------------------------------

def https_get(port: int, context, auth: tuple[str, str] | None = None) -> tuple[int, bytes, str]:
    """(status, body, WWW-Authenticate) of GET /metrics over TLS."""
    import base64
    import http.client
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    headers = {"Authorization": "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()} if auth else {}
    try:
        conn.request("GET", "/metrics", headers=headers)
        reply = conn.getresponse()
        return reply.status, reply.read(), reply.headers.get("WWW-Authenticate", "")
    finally:
        conn.close()


def test_metrics_over_tls_with_a_client_certificate_and_basic_auth(tmp_path):
    import hashlib
    import ssl

    from phalanx import pki
    from phalanx.config import MetricsAccessConfig
    from phalanx.metrics_http import access
    pki.init_ca(tmp_path)
    server = pki.issue(tmp_path, "controller", "controller", ("127.0.0.1",))
    scraper = pki.issue(tmp_path, "prometheus", "client")
    other_ca = tmp_path / "other"
    pki.init_ca(other_ca, "elsewhere")
    stranger = pki.issue(other_ca, "prometheus", "client")
    users = tmp_path / "metrics-users"
    users.write_text("# scrapers\nprometheus " + hashlib.sha256(b"s3cret-long-random").hexdigest() + "\n")
    cfg = MetricsAccessConfig(tls=True, client_cert=True, basic_auth_file=str(users))

    def client(cert=None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        if cert is not None:
            context.load_cert_chain(str(cert.cert), str(cert.key))
        return context

    async def main():
        metrics = metrics_http.MetricsServer(metrics_http.standard_registry())
        port = await metrics.start("127.0.0.1:0", access(cfg, str(tmp_path / "ca.crt"), str(server.cert),
                                                         str(server.key)))
        try:
            ok = await asyncio.to_thread(https_get, port, client(scraper), ("prometheus", "s3cret-long-random"))
            assert ok[0] == 200 and b"process_cpu_seconds_total" in ok[1]
            wrong = await asyncio.to_thread(https_get, port, client(scraper), ("prometheus", "guess"))
            assert wrong[0] == 401 and wrong[2] == 'Basic realm="phalanx metrics"'
            assert (await asyncio.to_thread(https_get, port, client(scraper)))[0] == 401  # no credentials
            for refused in (client(), client(stranger)):  # no certificate; one from another CA
                with pytest.raises((ssl.SSLError, ConnectionError)):
                    await asyncio.to_thread(https_get, port, refused, ("prometheus", "s3cret-long-random"))
            plain = await asyncio.to_thread(raw, f"127.0.0.1:{port}", b"GET /metrics HTTP/1.1\r\n\r\n")
            assert b"process_cpu_seconds_total" not in plain  # never in clear
            again = await asyncio.to_thread(https_get, port, client(scraper), ("prometheus", "s3cret-long-random"))
            assert again[0] == 200  # nothing of that hurt the server
        finally:
            await metrics.close()

    asyncio.run(main())


@pytest.mark.parametrize("text, message", [
    ("[metrics]\nclient_cert = true\n", "metrics.client_cert needs metrics.tls = true"),
    ("[metrics]\nbasic_auth_file = \"/etc/phalanx/metrics-users\"\n", "metrics.basic_auth_file needs metrics.tls "
                                                                      "= true: a password over plain HTTP is "
                                                                      "anyone's on the path"),
])
def test_metrics_protection_that_cannot_hold_is_refused(tmp_path, text, message):
    from controller.config import load
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(str(path))
    assert message in str(e.value)


def test_bad_basic_auth_files_are_named_with_the_line(tmp_path):
    from phalanx.config import MetricsAccessConfig
    from phalanx.metrics_http import access
    bad = tmp_path / "users"
    bad.write_text("# who may scrape\nprometheus hunter2\n")
    with pytest.raises(ConfigError) as e:
        access(_no_tls(basic_auth_file=str(bad)), "", "", "")
    assert str(e.value) == (f"metrics.basic_auth_file: {bad}:2: write 'USER SHA256', the SHA-256 of the password "
                            "in hex (printf %s PASSWORD | sha256sum)")
    with pytest.raises(ConfigError) as e:
        access(_no_tls(basic_auth_file=str(tmp_path / "none")), "", "", "")
    assert str(e.value) == f"metrics.basic_auth_file: cannot read {tmp_path / 'none'}: No such file or directory"
    with pytest.raises(ConfigError) as e:
        access(MetricsAccessConfig(tls=True), str(tmp_path / "ca.crt"), str(tmp_path / "x.crt"),
               str(tmp_path / "x.key"))
    assert str(e.value).startswith(f"metrics.tls: cannot use [security] cert_file {tmp_path / 'x.crt'}")


def _no_tls(**values):
    """A [metrics] table past its own checks: what `access` reads of the users file is checked apart."""
    from phalanx.config import MetricsAccessConfig
    cfg = MetricsAccessConfig(tls=True)
    for key, value in values.items():
        object.__setattr__(cfg, key, value)
    object.__setattr__(cfg, "tls", False)
    return cfg


def test_torchrun_runs_count_in_the_job_metrics_as_every_job():
    """A torchrun run is a job in `phalanx jobs`: it is one in the metrics too (the jobs by state, each active job's
    state and restarts, incidents and restarts by kind)."""
    from controller.api.rendezvous_service import RendezvousService
    from controller.rendezvous.book import Settings, StoreAddress, Worker
    clock, store, hub = FakeClock(), MemoryStore(), EventHub()
    registry = Registry(store, clock, LivenessConfig(), hub, HealthConfig())
    jobs = JobManager(store, registry, clock, hub, JobsConfig(), lambda: flat({}), RecoveryConfig())
    collector = controller_metrics.ControllerCollector(registry, jobs, hub)
    collector.rendezvous = rendezvous = RendezvousService(clock)
    server = controller_metrics.serving(collector)

    def v(name, **labels):
        server.snapshot()
        return server.registry.get_sample_value(name, labels)

    book = rendezvous.book
    for pid in ("A", "B"):
        book.join("run", pid, 1, Settings(2, 2, 0.0), 60.0, StoreAddress("127.0.0.1", 2000), clock.monotonic(),
                  node=f"node-{pid.lower()}")
    assert v("phalanx_jobs", state="RUNNING") == 1
    assert v("phalanx_job_state", job="torchrun-run", state="RUNNING") == 1
    for step in range(20):  # both workers step, then stop stepping while they report: a hang
        clock.advance(0.1)
        for rank in (0, 1):
            book.report_worker("run", 1, Worker(rank, 2, step, 0.1, clock.monotonic()), clock.monotonic())
    clock.advance(RecoveryConfig().hang_min_s + 1)
    for rank in (0, 1):
        book.report_worker("run", 1, Worker(rank, 2, 19, 0.1, clock.monotonic()), clock.monotonic())
    assert book.num_waiting("run", "A", 1, clock.monotonic()) >= 1  # the round restarts
    assert v("phalanx_job_incidents_total", kind="hang") == 1 and v("phalanx_job_restarts_total", cause="hang") == 1
    assert v("phalanx_job_generation_restarts_total", job="torchrun-run") == 1
