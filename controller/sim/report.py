"""What a simulation says: ETTR, goodput and the losses by cause, per job and for the fleet; a sweep side by side."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from controller.recovery import table
from controller.recovery.detectors import KINDS
from controller.sim import replay
from controller.sim import scenario as sc
from controller.sim.engine import CAUSES, Simulation
from phalanx.errors import ConfigError


def results(sim: Simulation, wall_s: float = 0.0) -> dict[str, Any]:
    """The figures of a finished run, as plain data (what --json prints)."""
    s = sim.scenario
    span = s.run.days * sc.DAY_S
    gpus_per_job = s.job.nodes * s.fleet.gpus_per_node
    jobs, recoveries = [], []
    for job in sim.jobs:
        t = job.tally
        recoveries += t.recoveries_s
        jobs.append({
            "id": job.job.id, "state": table.state_name(job.job.state), "failed": t.failed,
            "ettr": t.work_s / span, "work_h": t.work_s / sc.HOUR_S,
            "lost_h": {cause: t.seconds[cause] / sc.HOUR_S for cause in CAUSES},
            "incidents": dict(sorted(t.incidents.items())), "recoveries": len(t.recoveries_s),
            "spares_used": t.spares_used, "fresh_placements": t.fresh_placements})
    work = sum(j.tally.work_s for j in sim.jobs)
    lost = {cause: sum(j.tally.seconds[cause] for j in sim.jobs) * gpus_per_job / sc.HOUR_S for cause in CAUSES}
    fleet_gpu_h = s.fleet.nodes * s.fleet.gpus_per_node * span / sc.HOUR_S
    return {
        "scenario": {"gpus": s.fleet.nodes * s.fleet.gpus_per_node, "nodes": s.fleet.nodes, "days": s.run.days,
                     "jobs": s.job.count, "job_gpus": gpus_per_job, "spares": s.job.spares, "seed": s.run.seed,
                     "snapshots": s.job.snapshots, "predictive_eviction": s.policy.predictive_eviction,
                     "checkpoint_interval_s": s.job.checkpoint_interval_s},
        "ettr": work / (span * len(sim.jobs)),
        "goodput": work * gpus_per_job / sc.HOUR_S / fleet_gpu_h,  # useful GPU-hours / the fleet's GPU-hours
        "gpu_hours_lost": lost,
        "recovery_s": _distribution(recoveries),
        "nodes_drained": sim.nodes_drained,
        "jobs": jobs,
        "timeline": [[round(day, 4), ettr] for day, ettr in sim.timeline],
        "events": sim.events,
        "wall_s": round(wall_s, 3),
        "replay": None if sim.trace is None else {
            "source": sim.trace.source, "span_s": sim.trace.span_s, "log_events": sim.trace.events,
            "log_faults": sim.trace.counts(), "repeat": s.replay.repeat, **sim.replayed},
    }


def _distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def q(f: float) -> float:
        return ordered[min(len(ordered) - 1, int(f * len(ordered)))]

    return {"count": len(values), "mean": statistics.fmean(values), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": ordered[-1]}


def simulate(scenario: sc.Scenario, on_progress: Callable[[float], None] | None = None,
             trace: replay.Trace | None = None) -> dict[str, Any]:
    """Run `scenario`; its replay.events is read here unless `trace` is that log, read already. Raises ConfigError
    for a bad event log or one that does not fit the fleet."""
    if trace is None and scenario.replay.events:
        trace = replay.load(scenario.replay.events)
    t0 = time.perf_counter()
    try:
        sim = Simulation(scenario, on_progress, trace)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sim.run()
    return results(sim, time.perf_counter() - t0)


ROWS: list[tuple[str, Callable[[dict], str]]] = [
    ("ETTR", lambda r: f"{r['ettr'] * 100:.2f} %"),
    ("goodput (of the fleet's GPU-hours)", lambda r: f"{r['goodput'] * 100:.2f} %"),
    *[(f"GPU-hours lost: {cause}", lambda r, c=cause: f"{r['gpu_hours_lost'][c]:,.0f}") for cause in CAUSES],
    *[(f"incidents: {kind}", lambda r, k=kind: f"{incidents(r).get(k, 0):,}") for kind in KINDS],
    ("recovery, fault to training: p50 / p90 / max", lambda r: _recovery(r["recovery_s"])),
    ("spares used / fresh placements", lambda r: f"{sum(j['spares_used'] for j in r['jobs'])} / "
                                                 f"{sum(j['fresh_placements'] for j in r['jobs'])}"),
    ("nodes drained", lambda r: f"{r['nodes_drained']:,}"),
    ("jobs failed", lambda r: ", ".join(f"{j['id']}: {j['failed']}" for j in r["jobs"] if j["failed"]) or "none"),
    ("simulated in", lambda r: f"{r['wall_s']:.1f} s ({r['events']:,} events)"),
]
REPLAY_ROWS: list[tuple[str, Callable[[dict], str]]] = [
    ("replayed faults: hit / watched only", lambda r: f"{r['replay']['faults']:,} / {r['replay']['watched']:,}"),
    ("replayed faults missed: node out of service / no job training",
     lambda r: f"{r['replay']['out_of_service']:,} / {r['replay']['no_job']:,}"),
]


def incidents(r: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for job in r["jobs"]:
        for kind, n in job["incidents"].items():
            out[kind] = out.get(kind, 0) + n
    return dict(sorted(out.items()))


def _recovery(d: dict) -> str:
    if not d.get("count"):
        return "none"
    return f"{d['p50']:.0f} / {d['p90']:.0f} / {d['max']:.0f} s"


def table_text(runs: list[tuple[str, dict]]) -> str:
    """One column per run (a sweep's values), one row per figure."""
    s = runs[0][1]["scenario"]
    head = (f"{s['gpus']:,} GPUs ({s['nodes']:,} nodes), {s['jobs']} job(s) of {s['job_gpus']:,} GPUs, "
            f"{s['days']:g} days, seed {s['seed']}")
    rows = ROWS + (REPLAY_ROWS if runs[0][1].get("replay") else [])
    labels = [label for label, _ in rows]
    columns = [[name] + [fmt(r) for _, fmt in rows] for name, r in runs]
    width = max(len(x) for x in ["", *labels])
    widths = [max(len(x) for x in col) for col in columns]
    lines = [head, ""]
    trace = runs[0][1].get("replay")
    if trace:
        found = ", ".join(f"{n} {kind}" for kind, n in trace["log_faults"].items() if n) or "no faults"
        lines[1:1] = [f"failures replayed from {trace['source']} ({trace['log_events']:,} events over "
                      f"{trace['span_s'] / sc.HOUR_S:,.2f} h: {found}"
                      f"{'; repeated' if trace['repeat'] else ''})"]
    for i, label in enumerate(["", *labels]):
        cells = [col[i].rjust(w) for col, w in zip(columns, widths, strict=True)]
        lines.append(f"{label.ljust(width)}  " + "  ".join(cells))
        if i == 0:
            lines.append("-" * (width + 2 + sum(widths) + 2 * (len(widths) - 1)))
    return "\n".join(lines)


def sweep_values(text: str) -> tuple[str, list[Any]]:
    """`KEY=V1,V2,...` -> (KEY, [values]). Raises ValueError with the rule."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ValueError(f"--sweep {text!r}: write KEY=V1,V2,... (e.g. job.spares=0,1,2,4)")
    return key.strip(), [sc.parse_value(v.strip()) for v in values.split(",") if v.strip()]
