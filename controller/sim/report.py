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
from controller.sim.engine import CAUSES, START, Simulation, ettr


def results(sim: Simulation, wall_s: float = 0.0) -> dict[str, Any]:
    """The figures of a finished run, as plain data (what --json prints)."""
    s = sim.scenario
    jobs, recoveries = [], []
    for job in sim.jobs:
        t = job.tally
        recoveries += t.recoveries_s
        jobs.append({
            "id": job.job.id, "state": table.state_name(job.job.state), "failed": t.failed, "gpus": job.gpus,
            "ettr": t.work_s / job.wall_s(), "work_h": t.work_s / sc.HOUR_S,
            "finished_day": None if job.ended_at is None else (job.ended_at - START) / sc.DAY_S,
            "lost_h": {cause: t.seconds[cause] / sc.HOUR_S for cause in CAUSES},
            "incidents": dict(sorted(t.incidents.items())), "recoveries": len(t.recoveries_s),
            "spares_used": t.spares_used, "fresh_placements": t.fresh_placements, "launches": t.launches,
            "warm_launches": t.warm_launches})
    lost = {cause: sum(j.tally.seconds[cause] * j.gpus for j in sim.jobs) / sc.HOUR_S for cause in CAUSES}
    gpus = len(sim.nodes) * s.fleet.gpus_per_node
    fleet_gpu_h = gpus * s.run.days * sc.DAY_S / sc.HOUR_S
    first = s.shapes[0]
    return {
        "scenario": {"gpus": gpus, "nodes": len(sim.nodes), "days": s.run.days, "jobs": len(sim.jobs),
                     "job_gpus": first.nodes * s.fleet.gpus_per_node, "spares": first.spares, "seed": s.run.seed,
                     "snapshots": first.snapshots, "predictive_eviction": s.policy.predictive_eviction,
                     "checkpoint_interval_s": first.checkpoint_interval_s,
                     "shapes": [{"name": j.name or "job", "count": j.count, "gpus": j.nodes * s.fleet.gpus_per_node,
                                 "spares": j.spares, "length_h": j.length_h} for j in s.shapes]},
        "ettr": ettr(sim.jobs),
        "goodput": sum(j.tally.work_s * j.gpus for j in sim.jobs) / sc.HOUR_S / fleet_gpu_h,
        "gpu_hours_lost": lost,
        "recovery_s": _distribution(recoveries),
        "nodes_drained": sim.nodes_drained,
        "leaf_failures": sim.leaf_failures,
        "jobs": jobs,
        "timeline": [[round(day, 4), value] for day, value in sim.timeline],
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
    sim = Simulation(scenario, on_progress, trace).run()
    return results(sim, time.perf_counter() - t0)


ROWS: list[tuple[str, Callable[[dict], str]]] = [
    ("ETTR", lambda r: f"{r['ettr'] * 100:.2f} %"),
    ("goodput (of the fleet's GPU-hours)", lambda r: f"{r['goodput'] * 100:.2f} %"),
    *[(f"GPU-hours lost: {cause}", lambda r, c=cause: f"{r['gpu_hours_lost'][c]:,.0f}") for cause in CAUSES],
    *[(f"incidents: {kind}", lambda r, k=kind: f"{incidents(r).get(k, 0):,}") for kind in KINDS],
    ("recovery, fault to training: p50 / p90 / max", lambda r: _recovery(r["recovery_s"])),
    ("spares used / fresh placements", lambda r: f"{sum(j['spares_used'] for j in r['jobs'])} / "
                                                 f"{sum(j['fresh_placements'] for j in r['jobs'])}"),
    ("launches: warm (standbys on held nodes) / cold", lambda r: f"{sum(j['warm_launches'] for j in r['jobs']):,} / "
     f"{sum(j['launches'] - j['warm_launches'] for j in r['jobs']):,}"),
    ("nodes drained / leaf switches failed", lambda r: f"{r['nodes_drained']:,} / {r['leaf_failures']:,}"),
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
    head = f"{s['gpus']:,} GPUs ({s['nodes']:,} nodes), {shapes_text(s)}, {s['days']:g} days, seed {s['seed']}"
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


def shapes_text(s: dict[str, Any]) -> str:
    """The jobs in a line: "1 job(s) of 16,384 GPUs", or "3 jobs: 2 x pretrain of 1,024 GPUs, 1 x ..."."""
    shapes = s.get("shapes") or []
    if len(shapes) <= 1:
        return f"{s['jobs']} job(s) of {s['job_gpus']:,} GPUs"
    return f"{s['jobs']} jobs: " + ", ".join(f"{j['count']} x {j['name']} of {j['gpus']:,} GPUs" for j in shapes)


def sweep_values(text: str) -> tuple[str, list[Any]]:
    """`KEY=V1,V2,...` -> (KEY, [values]). Raises ValueError with the rule."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ValueError(f"--sweep {text!r}: write KEY=V1,V2,... (e.g. job.spares=0,1,2,4)")
    return key.strip(), [sc.parse_value(v.strip()) for v in values.split(",") if v.strip()]
