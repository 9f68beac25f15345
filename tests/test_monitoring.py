"""What ships for Prometheus and Grafana (monitoring/): the alert rules pass promtool's check and their unit
tests, the dashboard is what tools/grafana_dashboard.py writes, and every metric the rules and the dashboard
query is one the daemons export."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from agent import metrics as agent_metrics
from controller.obs import metrics as controller_metrics
from phalanx.metrics_http import CertificateExpiry
from phalanx.v1 import common_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "monitoring"
PROMTOOL = shutil.which("promtool")
sys.path.insert(0, str(ROOT / "tools"))
import grafana_dashboard  # noqa: E402


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (tools/install-system-deps)")
def test_the_alert_rules_pass_promtool_check_and_their_unit_tests():
    check = subprocess.run([PROMTOOL, "check", "rules", "phalanx.rules.yml"], cwd=MONITORING, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 10 rules found" in check.stdout, check.stdout + check.stderr
    tested = subprocess.run([PROMTOOL, "test", "rules", "phalanx.rules.test.yml"], cwd=MONITORING,
                            capture_output=True, text=True, timeout=60)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_dashboard_is_what_the_generator_writes():
    assert grafana_dashboard.main(["grafana_dashboard.py", "--check"]) == 0


def exported_names() -> set[str]:
    """Every sample name the daemons can export (both collectors fed everything they show)."""
    controller = controller_metrics.Snapshot(
        nodes=[], gpus={"HEALTHY": 1}, lag=([("0.1", 1), ("+Inf", 1)], 0.01), store="etcd",
        store_commit=([("0.1", 1), ("+Inf", 1)], 0.01), leadership=(True, 1, 1, 0),
        detection={"xid": ([("0.1", 1), ("+Inf", 1)], 0.01)}, recovery={"crash": ([("1", 1), ("+Inf", 1)], 1.0)},
        culprits=[("job-1", common_pb2.HangCulprit(rank=1, node="n"))], active=[("job-1", "RUNNING", 1, 2)])
    gpu = common_pb2.GpuTelemetry(index=0, temperature_c=50, ecc_sbe_volatile=1, ecc_dbe_volatile=0, power_w=300,
                                  recovery_action=common_pb2.GPU_RECOVERY_ACTION_GPU_RESET)
    agent = agent_metrics.Snapshot(
        node="n", gpu_backend="sim", inventory=[common_pb2.GpuInfo(index=0, uuid="GPU-0", memory_total_bytes=1)],
        telemetry=[gpu], host=common_pb2.HostTelemetry(), xid_last={0: 79}, xid_counts={(0, 79): 1}, verdict=None,
        connected=True, node_state=common_pb2.NODE_STATE_UP, sessions=1, heartbeats=1, ranks={"RUNNING": 1},
        on_gpu={0: ("job-1", "0")})
    names: set[str] = set()
    families = [*controller_metrics.families(controller), *controller_metrics.leadership_families(False, 1, 1, 0, 5),
                *agent_metrics.families(agent),
                *CertificateExpiry([str(ROOT / "LICENSE")]).collect()]
    for family in families:
        names.add(family.name)
        if isinstance(family, CounterMetricFamily):
            names.add(family.name + "_total")
        if isinstance(family, HistogramMetricFamily):
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def queried() -> dict[str, tuple[str, set[str]]]:
    """{where: (query, the metric names in it)} for every alert rule and dashboard panel query."""
    rules = (MONITORING / "phalanx.rules.yml").read_text()
    exprs = {f"rule {m[1]}": m[2] for m in re.finditer(r"- alert: (\w+)\n\s+expr: (.+)", rules)}
    exprs.update({f"dashboard: {e}": e for e in grafana_dashboard.expressions()})
    return {where: (e, set(re.findall(r"\b(phalanx_[a-z_]+|DCGM_FI_[A-Z_]+)\b", e))) for where, e in exprs.items()}


def test_every_metric_the_rules_and_the_dashboard_query_is_exported():
    known = exported_names()
    queries = queried()
    assert sum(w.startswith("rule ") for w in queries) == 10 and len(queries) > 30
    unknown = {where: names - known for where, (_, names) in queries.items() if names - known}
    assert not unknown, unknown
    # each queries one of ours, but the scrape's own `up`
    assert all(names or e.startswith("up{") for e, names in queries.values()), queries


def test_certificate_expiry_is_read_from_the_file_at_each_scrape(tmp_path):
    from phalanx import pki
    pki.init_ca(tmp_path)
    issued = pki.issue(tmp_path, "gpu001", "node", (), 30)
    collector = CertificateExpiry([str(issued.cert), str(tmp_path / "gone.crt")])
    expiry, readable = collector.collect()
    assert [(s.labels["file"], s.value) for s in expiry.samples] == [(str(issued.cert), issued.not_after.timestamp())]
    assert [(s.labels["file"], s.value) for s in readable.samples] == [(str(issued.cert), 1),
                                                                     (str(tmp_path / "gone.crt"), 0)]
    issued.cert.unlink()  # renewed in place: the next scrape reads the new one
    issued.key.unlink()
    again = pki.issue(tmp_path, "gpu001", "node", (), 60)
    expiry, _ = collector.collect()
    assert expiry.samples[0].value == again.not_after.timestamp() > issued.not_after.timestamp()
