"""Write monitoring/grafana-phalanx.json, the Grafana dashboard for a Phalanx fleet, from the panels below.

    python tools/grafana_dashboard.py          # write it
    python tools/grafana_dashboard.py --check  # exit 1 if the file is not what this writes

Import it in Grafana (Dashboards, New, Import) and pick the Prometheus data source that scrapes the controller
(job "phalanx-controller") and the agents (job "phalanx-agent"). Rows: the fleet, the jobs, the recoveries, the
GPUs (with the job and rank on each), the control plane.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "monitoring" / "grafana-phalanx.json"
DS = {"type": "prometheus", "uid": "${datasource}"}

# (title, kind, [(expr, legend)], unit, width) per row; kinds: timeseries, stat, table
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str, int]]]] = [
    ("Fleet", [
        ("Nodes by state", "timeseries", [("phalanx_nodes", "{{state}}")], "short", 8),
        ("GPUs by verdict", "timeseries", [("phalanx_gpus", "{{health}}")], "short", 8),
        ("Agents connected", "stat", [("phalanx_agents_connected", "connected")], "short", 4),
        ("Nodes DOWN", "stat", [('sum(phalanx_nodes{state="DOWN"})', "DOWN")], "short", 4),
        ("Nodes not HEALTHY", "table", [('phalanx_node_health{verdict!="HEALTHY"} == 1', "")], "short", 12),
        ("Heartbeat lag p50 / p99", "timeseries", [
            ("histogram_quantile(0.5, sum by (le) (rate(phalanx_heartbeat_lag_seconds_bucket[5m])))", "p50"),
            ("histogram_quantile(0.99, sum by (le) (rate(phalanx_heartbeat_lag_seconds_bucket[5m])))", "p99")],
         "s", 12),
    ]),
    ("Jobs", [
        ("Jobs by state", "timeseries", [("phalanx_jobs", "{{state}}")], "short", 8),
        ("Active jobs", "table", [("phalanx_job_state == 1", "")], "short", 8),
        ("Restarts in a row (max_restarts counts these)", "timeseries",
         [("phalanx_job_restarts_in_row", "{{job}}")], "short", 8),
        ("Incidents by kind (per hour)", "timeseries",
         [("sum by (kind) (increase(phalanx_job_incidents_total[1h]))", "{{kind}}")], "short", 12),
        ("Restarts by cause (per hour)", "timeseries",
         [("sum by (cause) (increase(phalanx_job_restarts_total[1h]))", "{{cause}}")], "short", 12),
    ]),
    ("Recoveries", [
        ("Fault to training again, p50 by cause", "timeseries", [
            ("histogram_quantile(0.5, sum by (le, cause) (rate(phalanx_recovery_duration_seconds_bucket[1h])))",
             "{{cause}}")], "s", 12),
        ("Detection latency p99 by kind", "timeseries", [
            ("histogram_quantile(0.99, sum by (le, kind) (rate(phalanx_detection_latency_seconds_bucket[1h])))",
             "{{kind}}")], "s", 12),
        ("Hang culprits (NCCL flight recorder)", "table", [("phalanx_job_hang_culprit == 1", "")], "short", 24),
    ]),
    ("GPUs", [
        ("GPUs not HEALTHY, with their job and rank", "table",
         [('phalanx_gpu_health{verdict!="HEALTHY"} == 1', "")], "short", 24),
        ("GPU temperature", "timeseries", [("DCGM_FI_DEV_GPU_TEMP", "{{Hostname}} GPU {{gpu}} {{hpc_job}}")],
         "celsius", 12),
        ("XIDs (per hour)", "timeseries",
         [("sum by (Hostname, gpu, xid) (increase(phalanx_gpu_xid_errors_total[1h]))",
           "{{Hostname}} GPU {{gpu}} XID {{xid}}")], "short", 12),
        ("Corrected ECC errors (per minute)", "timeseries",
         [("rate(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL[5m]) * 60", "{{Hostname}} GPU {{gpu}}")], "short", 12),
        ("Power draw", "timeseries", [("DCGM_FI_DEV_POWER_USAGE", "{{Hostname}} GPU {{gpu}} {{hpc_job}}")],
         "watt", 12),
    ]),
    ("Control plane", [
        ("Leader", "stat", [("phalanx_controller_leader", "{{instance}}")], "short", 6),
        ("Failovers won", "stat", [("sum(phalanx_controller_failovers_total)", "failovers")], "short", 6),
        ("Store commit p99", "timeseries", [
            ("histogram_quantile(0.99, sum by (le, store) (rate(phalanx_store_commit_seconds_bucket[5m])))",
             "{{store}}")], "s", 12),
        ("Certificates: days to expiry", "table",
         [("(phalanx_certificate_expiry_timestamp_seconds - time()) / 86400", "")], "d", 24),
    ]),
]


def panel(pid: int, title: str, kind: str, targets: list[tuple[str, str]], unit: str, width: int, x: int,
          y: int) -> dict:
    height = 8
    p = {"id": pid, "type": kind, "title": title, "datasource": DS,
         "gridPos": {"h": height, "w": width, "x": x, "y": y},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
                      **({"format": "table", "instant": True} if kind == "table" else {})}
                     for i, (expr, legend) in enumerate(targets)],
         "options": {}}
    if kind == "table":
        p["transformations"] = [{"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True}}}]
    return p


def dashboard() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for title, kind, targets, unit, width in row_panels:
            if x + width > 24:
                x, y = 0, y + 8
            panels.append(panel(pid, title, kind, targets, unit, width, x, y))
            pid, x = pid + 1, x + width
        y += 8
    return {
        "title": "Phalanx: fleet, jobs, recoveries", "uid": "phalanx-fleet", "schemaVersion": 39, "version": 1,
        "editable": True, "tags": ["phalanx", "gpu"], "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}}]},
        "annotations": {"list": []}, "panels": panels,
    }


def expressions() -> list[str]:
    """Every query of the dashboard (tests check the metric names in them against real scrapes)."""
    return [expr for _, row in ROWS for _, _, targets, _, _ in row for expr, _ in targets]


def text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    if argv[1:] == ["--check"]:
        if not OUT.exists() or OUT.read_text() != text():
            print(f"{OUT} is out of date: run python tools/grafana_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
