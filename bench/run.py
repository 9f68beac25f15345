"""Phalanx benchmarks: failure detection latency, controller capacity, agent footprint.

    .venv/bin/python bench/run.py                 # everything (under ~10 minutes on 2 cores)
    .venv/bin/python bench/run.py --quick         # a shorter pass of everything
    .venv/bin/python bench/run.py detection       # one or more of: detection capacity footprint

Prints progress while running, a table at the end, and writes bench/results/latest.json.
Every process started is in its own session and is killed (the whole group) on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable as `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Before gRPC loads: no fork handlers in this process, which forks (to start processes) while gRPC
# threads run; harmless, but gRPC says so on stderr. The processes we start get the original environment.
ORIGINAL_ENV = dict(os.environ)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from bench import (  # noqa: E402
    capacity,
    checkpoint,
    common,
    credentials,
    detection,
    ending,
    failover,
    failover_scale,
    footprint,
    health,
    hooks,
    jobbeats,
    placement,
    recovery,
    replicas,
    simulate,
    snapshots,
    takeup,
    tls,
)
from bench.common import REPO, log, machine  # noqa: E402

BENCHMARKS = ("detection", "footprint", "capacity", "tls", "health", "placement", "hooks", "checkpoint", "snapshots",
              "recovery", "replicas", "ending", "failover", "failover-scale", "takeup", "job-heartbeats",
              "store-heartbeats", "simulate",
              "credentials")
STORE_STEPS, QUICK_STORE_STEPS = [2000, 6000], [2000]
FAILOVER_STEPS, QUICK_FAILOVER_STEPS = [2000], [2000]  # 8,000 does not ramp on 2 cores (bench/RESULTS.md)
TLS_NODES, QUICK_TLS_NODES = 2000, 500
FULL_STEPS = [1000, 2000, 4000, 6000, 8000, 10000, 12000]
QUICK_STEPS = [500, 2000]
QUICK_MAX_HOLD_S = 35.0  # long enough that N=2000's lag window holds only its hold
TOTAL_BUDGET_S = 540.0  # the whole run should stay under ~10 minutes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Phalanx benchmarks", formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("benchmarks", nargs="*", metavar="BENCHMARK", help=f"any of {', '.join(BENCHMARKS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer trials, fewer steps, shorter holds")
    p.add_argument("--trials", type=int, help="detection: kill/detect trials (default 10, quick 3)")
    p.add_argument("--steps", help="capacity: comma-separated node counts (default "
                   f"{','.join(map(str, FULL_STEPS))}; quick {','.join(map(str, QUICK_STEPS))})")
    p.add_argument("--failover-steps", help="failover-scale: comma-separated node counts (default "
                   f"{','.join(map(str, FAILOVER_STEPS))}; quick {','.join(map(str, QUICK_FAILOVER_STEPS))})")
    p.add_argument("--kills", type=int, default=1,
                   help="failover-scale: kill the leader this many times per step, each killed controller started "
                   "again as a standby and parked at by every node before the next kill (default 1)")
    p.add_argument("--hold", type=float, help="capacity: seconds each step is measured (default 15, quick 10)")
    p.add_argument("--settle", type=float, default=3.0, help="capacity: seconds after the ramp before measuring")
    p.add_argument("--generators", type=int, default=1, help="capacity: load generator processes (all on CPU 1)")
    p.add_argument("--max-hold", type=float,
                   help="capacity: hold small steps up to this long so the controller's lag window (last 65,536 "
                   f"heartbeats) covers only the hold (default 70; quick {QUICK_MAX_HOLD_S:g}; with --hold: --hold)")
    p.add_argument("--open-concurrency", type=int, default=16,
                   help="capacity: nodes registering / opening their session at once during a ramp (default 16)")
    p.add_argument("--gc-trace", action="store_true",
                   help="capacity: run the controller through bench/gcwrap.py and report its GC pauses per step")
    p.add_argument("--ramp-timeout", type=float, default=60.0,
                   help="capacity: give up on a step whose sessions are not all open after this long")
    p.add_argument("--per-channel", type=int, default=1,
                   help="capacity: simulated node sessions per gRPC channel, i.e. per TCP connection (default 1, "
                   "like real agents; more is cheaper for both ends)")
    p.add_argument("--mtls", action="store_true",
                   help="capacity: the controller on mutual TLS, each simulated node with its own certificate, as in "
                   "production (default: plaintext)")
    p.add_argument("--session-port", action="store_true",
                   help="capacity, failover-scale: the nodes' sessions in frames on the controllers' session port "
                   "(session_listen), as agents with session_port set (default: on gRPC)")
    p.add_argument("--sample", type=float, help="footprint: seconds of sampling (default 30, quick 10)")
    p.add_argument("--warmup", type=float, default=5.0, help="footprint: seconds before sampling")
    p.add_argument("--budget", type=float, default=TOTAL_BUDGET_S,
                   help="seconds for the whole run; capacity skips steps that would overrun it")
    p.add_argument("--seed", type=int, help="detection: seed for the random kill phases")
    p.add_argument("--keep", action="store_true", help="keep the temp directories (configs, logs, databases)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "latest.json"), help="JSON results file")
    args = p.parse_args(argv)
    unknown = [b for b in args.benchmarks if b not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    args.benchmarks = [b for b in BENCHMARKS if b in args.benchmarks] or list(BENCHMARKS)
    args.trials = args.trials or (3 if args.quick else 10)
    if args.kills < 1:
        p.error(f"--kills must be at least 1, not {args.kills}")
    args.failover_steps = ([int(s) for s in args.failover_steps.split(",")] if args.failover_steps
                           else QUICK_FAILOVER_STEPS if args.quick else FAILOVER_STEPS)
    args.steps = [int(s) for s in args.steps.split(",")] if args.steps else (QUICK_STEPS if args.quick else FULL_STEPS)
    hold_given = args.hold is not None
    args.hold = args.hold or (10.0 if args.quick else 15.0)
    args.sample = args.sample or (10.0 if args.quick else 30.0)
    if args.max_hold is None:
        args.max_hold = args.hold if hold_given else QUICK_MAX_HOLD_S if args.quick else 70.0
    return args


async def run_all(args: argparse.Namespace, results: dict) -> None:
    t_begin = time.monotonic()
    for name in args.benchmarks:
        t0 = time.monotonic()
        log(f"== {name} ==")
        try:
            if name == "detection":
                results[name] = await detection.run(args.trials, args.seed)
            elif name == "footprint":
                results[name] = await footprint.run(args.warmup, args.sample)
            elif name == "health":
                results[name] = {"xid_to_drain": await health.run(args.trials), "sweep": health.sweep()}
            elif name == "placement":
                results[name] = placement.run(quick=args.quick)
            elif name == "hooks":
                results[name] = hooks.run()
            elif name == "checkpoint":
                results[name] = checkpoint.run(quick=args.quick)
            elif name == "snapshots":
                results[name] = await snapshots.run(quick=args.quick)
            elif name == "recovery":
                results[name] = recovery.run(quick=args.quick)
            elif name == "replicas":
                results[name] = await asyncio.to_thread(replicas.run, args.quick)
            elif name == "ending":
                results[name] = await asyncio.to_thread(ending.run, args.quick)
            elif name == "failover":
                results[name] = failover.run(args.trials)
            elif name == "failover-scale":
                results[name] = await failover_scale.run(args.failover_steps, session_port=args.session_port,
                                                           kills=args.kills)
            elif name == "takeup":
                results[name] = await asyncio.to_thread(takeup.run, args.quick)  # a loop of its own
            elif name == "job-heartbeats":
                results[name] = await asyncio.to_thread(jobbeats.run, args.quick)
            elif name == "store-heartbeats":
                results[name] = await capacity.by_store(QUICK_STORE_STEPS if args.quick else STORE_STEPS,
                                                        args.hold, args.settle, args.per_channel, 600.0)
            elif name == "simulate":
                results[name] = simulate.run(quick=args.quick)
            elif name == "credentials":
                results[name] = await asyncio.to_thread(credentials.run, 3 if args.quick else args.trials)
            elif name == "capacity":
                budget = max(60.0, args.budget - (time.monotonic() - t_begin))
                results[name] = await capacity.run(args.steps, args.hold, args.settle, args.generators,
                                                   args.per_channel, budget, args.max_hold, args.ramp_timeout,
                                                   args.open_concurrency, args.gc_trace, tls=args.mtls,
                                                   session_port=args.session_port)
            elif name == "tls":
                results[name] = await tls.run(QUICK_TLS_NODES if args.quick else TLS_NODES, args.hold,
                                              args.settle, budget_s=600.0)
        except Exception as e:
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stdout)
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        if name in results:
            results[name]["duration_s"] = round(time.monotonic() - t0, 1)
        log(f"== {name} done in {time.monotonic() - t0:.0f} s ==")


# -- the report ------------------------------------------------------------------------------------

def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("  [meets goal]" if ok else "  [MISSES goal]")


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 100 else line[:97] + "..."


def table_rows(results: dict) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    d = results.get("detection")
    if d and "error" not in d:
        rows.append(("detection", f"kill -9 -> DOWN event, median ({d['trials']} trials)", "<= 3 s",
                     f"{d['median_s']:.3f} s{_verdict(d['median_s'] <= d['goal_s'])}"))
        rows.append(("detection", "kill -9 -> DOWN event, max", "<= 3 s",
                     f"{d['max_s']:.3f} s{_verdict(d['max_s'] <= d['goal_s'])}"))
        rows.append(("detection", "samples (s)", "", " ".join(f"{v:.2f}" for v in d["samples_s"])))
    elif d:
        rows.append(("detection", "error", "", _first_line(d["error"])))
    c = results.get("capacity")
    if c and "error" not in c:
        top = max(c["steps_planned"])
        goal = capacity.GOAL_NODES
        verdict = _verdict(c["largest_sustained_nodes"] >= goal) if top >= goal else f"  (steps stop at {top:,})"
        rows.append(("capacity", "largest N sustained (measured)", f">= {goal:,} nodes",
                     f"{c['largest_sustained_nodes']:,} nodes{verdict}"))
        if c["largest_reached_nodes"] != c["largest_sustained_nodes"]:
            rows.append(("capacity", "largest N reached (not sustained)", "", f"{c['largest_reached_nodes']:,} nodes"))
        best = next((s for s in c["steps"] if s["nodes"] == c["largest_sustained_nodes"]), None)
        if best:
            rows.append(("capacity", f"lag p50/p99 at N={best['nodes']:,} (measured)", "p99 < 100 ms",
                         f"{best['lag_p50_ms']:.1f} / {best['lag_p99_ms']:.1f} ms"))
            rows.append(("capacity", f"controller CPU at N={best['nodes']:,} (measured)", "",
                         f"{best['controller_cpu_pct']:.0f}% of one core, RSS {best['controller_rss_mb']:.0f} MB"))
        if c["us_per_heartbeat"]:
            basis = c["us_per_heartbeat_basis_nodes"]
            rows.append(("capacity", f"controller CPU per heartbeat (measured at N={basis:,})", "",
                         f"{c['us_per_heartbeat']:.0f} us"))
            rows.append(("capacity", "nodes per core at 1 Hz (EXTRAPOLATED, 1e6/us)", "",
                         f"~{c['extrapolated_nodes_per_core']:,} nodes"))
        rows.append(("capacity", "limited by", "", c["limited_by"]))
    elif c:
        rows.append(("capacity", "error", "", _first_line(c["error"])))
    cr = results.get("credentials")
    if cr and "error" not in cr:
        met = " [meets goal]" if cr["revoke_cut_max_s"] <= cr["goal_s"] else " [MISSES goal]"
        rows.append(("credentials", f"revocation -> live agent cut off, median / max of {cr['trials']}",
                     f"<= {cr['goal_s']:g} s", f"{cr['revoke_cut_median_s'] * 1000:.0f} / "
                     f"{cr['revoke_cut_max_s'] * 1000:.0f} ms{met}"))
        rows.append(("credentials", "a node enrolling (CA by hash, key, CSR, signed), median / max", "",
                     f"{cr['enrol_median_s'] * 1000:.0f} / {cr['enrol_max_s'] * 1000:.0f} ms"))
    elif cr:
        rows.append(("credentials", "error", "", _first_line(cr["error"])))
    t = results.get("tls")
    if t and "error" not in t:
        rows.append(("tls", f"controller CPU per heartbeat, mTLS vs plaintext (N={t['nodes']:,})", "",
                     f"{t['tls_us_per_heartbeat']:.0f} vs {t['plaintext_us_per_heartbeat']:.0f} us "
                     f"= {t['cpu_ratio']:.2f}x"))
        rows.append(("tls", "registrations/s in the ramp, mTLS vs plaintext", "",
                     f"{t['tls_registrations_per_s']:.0f} vs {t['plaintext_registrations_per_s']:.0f} /s"))
        rows.append(("tls", "heartbeat lag p99, mTLS vs plaintext", "",
                     f"{t['tls_lag_p99_ms']:.1f} vs {t['plaintext_lag_p99_ms']:.1f} ms"))
        if t.get("session_cpu_ratio"):
            rows.append(("tls", "controller CPU per heartbeat on mTLS, session port vs gRPC", "",
                         f"{t['tls_session_us_per_heartbeat']:.0f} vs {t['tls_us_per_heartbeat']:.0f} us "
                         f"= {t['session_cpu_ratio']:.2f}x"))
            rows.append(("tls", "heartbeat lag p99 on mTLS, session port vs gRPC", "",
                         f"{t['tls_session_lag_p99_ms']:.1f} vs {t['tls_lag_p99_ms']:.1f} ms"))
    elif t:
        rows.append(("tls", "error", "", _first_line(t["error"])))
    rows += _later_rows(results)
    f = results.get("footprint")
    if f and "error" not in f:
        rows.append(("footprint", f"agent RSS, max over {f['sampled_s']:.0f} s", "<= 60 MB",
                     f"{f['rss_mb_max']:.1f} MB{_verdict(f['rss_mb_max'] <= f['rss_goal_mb'])}"))
        rows.append(("footprint", "agent CPU, share of one core", "<= 1 %",
                     f"{f['cpu_percent']:.2f} %{_verdict(f['cpu_percent'] <= f['cpu_goal_percent'])}"))
    elif f:
        rows.append(("footprint", "error", "", _first_line(f["error"])))
    return rows


def _later_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """Rows for the benchmarks of issues 3-6 (health, placement, hooks, checkpoint, recovery)."""
    rows: list[tuple[str, str, str, str]] = []
    h = results.get("health")
    if h and "error" not in h:
        x, s = h["xid_to_drain"], h["sweep"]
        rows.append(("health", f"injected XID 79 -> drain event, median ({x['trials']} trials)", "<= 1 s",
                     f"{x['median_s'] * 1000:.0f} ms (max {x['max_s'] * 1000:.0f} ms; controller decision "
                     f"{x['controller_decision_median_ms']:.1f} ms){_verdict(x['median_s'] <= x['goal_s'])}"))
        rows.append(("health", "collector sweep, 8 GPUs", "", f"sim {s['sim_sample_us']:.0f} us; NVML code path "
                     f"{s['nvml_sample_fake_driver_us']:.0f} us (fake driver); digest {s['health_digest_us']:.0f} us; "
                     f"controller verdict {s['controller_verdict_8_gpus_us']:.0f} us"))
    elif h:
        rows.append(("health", "error", "", _first_line(h["error"])))
    p = results.get("placement")
    if p and "error" not in p:
        for name, sc in p.get("scenarios", {}).items():
            rows.append(("placement", name, "< 50 ms", f"median {sc.get('median_ms')} ms, max {sc.get('max_ms')} ms; "
                         f"leaves {sc.get('leaves_used')} vs lower bound {sc.get('lower_bound')}"))
    elif p:
        rows.append(("placement", "error", "", _first_line(p["error"])))
    k = results.get("hooks")
    if k and "error" not in k:
        ns = k["ns_per_call"]
        rows.append(("trainlib", "per-step hook step()", "<= 2000 ns", f"{ns['step']:.0f} ns"
                     f"{_verdict(ns['step'] <= k['goal_ns'])}"))
    c = results.get("checkpoint")
    if c and "error" not in c:
        rows.append(("checkpoint", f"write throughput vs dd + fsync ({c['state_mib']} MiB)", ">= 90 %",
                     f"{c['checkpoint_mbps']:,.0f} vs {c['raw_mbps']:,.0f} MB/s = {c['ratio']:.0%} (plain torch.save "
                     f"+ fsync {c['torch_save_fsync_mbps']:,.0f} MB/s){_verdict(c['ok'])}"))
    s = results.get("snapshots")
    if s and "error" not in s:
        for o in s["overhead"]:
            steady = o["steady"]  # whole intervals measured once the interval settled: the figure is steady state
            pct = o["overhead_pct"] if steady else o["amortized_pct"]
            how = (f"measured over {o['steps']} steps after {o['warmup_steps']} of tuning" if steady else
                   f"amortized: the copy / ({o['interval_steps']} steps); {o['overhead_pct']:+.1f} % measured over "
                   f"{o['steps']} steps after the tuning")
            rows.append(("snapshots", f"step time with snapshots, {o['state_mb']} MB per rank", "<= 3 %",
                         f"{pct:+.1f} % ({how}; {o['step_ms']:.0f} ms step, every {o['interval_steps']} step(s), "
                         f"copy {o['copy_ms']:.1f} ms){_verdict(pct <= s['budget_pct'])}"))
        p = s["peer"]
        rows.append(("snapshots", f"peer restore over loopback ({p['size_mb']} MB)", ">= 1 GB/s",
                     f"{p['get_gbps']} GB/s" + (f" median of {p['get_gbps_each']}" if "get_gbps_each" in p else "")
                     + f" (gRPC stream {p.get('stream_gbps', '-')} GB/s; replica {p['put_gbps']} GB/s pulled from "
                     f"the bulk port, {p.get('put_stream_gbps', '-')} GB/s by stream)"
                     f"{_verdict(p['get_gbps'] >= s['restore_goal_gbps'])}"))
    f = results.get("failover")
    if f and "error" not in f:
        rows.append(("failover", f"kill -9 of the leader -> new leader, all {f['agents']} agents back, median "
                     f"({f['trials']})", f"<= {f['goal_s']:g} s", f"{f['median_s']:.2f} s"
                     f"{_verdict(f['median_s'] <= f['goal_s'])}"))
        rows.append(("failover", "... max", f"<= {f['goal_s']:g} s",
                     f"{f['max_s']:.2f} s{_verdict(f['max_s'] <= f['goal_s'])}"))
        rows.append(("failover", "live nodes declared SUSPECT/DOWN", "0",
                     f"{f['wrongly_down']}{_verdict(f['wrongly_down'] == 0)}"))
        rows.append(("failover", f"the same, the leader killed as soon as the one killed before stands by, median / "
                     f"max ({f['trials']})", f"<= {f['goal_s']:g} s",
                     f"{f['soon_median_s']:.2f} / {f['soon_max_s']:.2f} s (the restarted one won "
                     f"{f['soon_restarted_won']} of {f['soon_restarted_won_of']}: "
                     f"{', '.join(f'{t:.2f}' for t in f['soon_when_restarted_won_s']) or '-'} s); "
                     "declared SUSPECT/DOWN: "
                     f"{f['soon_wrongly_down']}"
                     f"{_verdict(f['soon_max_s'] <= f['goal_s'] and not f['soon_wrongly_down'])}"))
        rows.append(("failover", "drain latency, median: SQLite / etcd (3 members)", "",
                     f"{f['drain_sqlite_ms']:.1f} / {f['drain_etcd_ms']:.1f} ms"))
        rows.append(("failover", "job submission latency, median: SQLite / etcd (3 members)", "",
                     f"{f['submit_sqlite_ms']:.1f} / {f['submit_etcd_ms']:.1f} ms"))
    fs = results.get("failover-scale")
    if fs and "error" not in fs:
        for st in fs["steps"]:
            kill = f" (kill {st['kill']})" if st.get("kill", 1) > 1 else ""
            what = f"N={st['nodes']:,}{kill}"
            rows.append(("failover-scale", f"{what}: kill -9 of the leader -> all nodes back", "<= 3 s",
                         f"{st['all_back_s']:.2f} s{_verdict(st['all_back_s'] <= 3.0)}"))
            late = (f" (generator up to {st['generator_late_max_after_ms']:.0f} ms late sending)"
                    if "generator_late_max_after_ms" in st else "")
            rows.append(("failover-scale", f"{what}: live nodes declared SUSPECT/DOWN", "0",
                         f"{st['wrongly_suspect_or_down']}{_verdict(st['wrongly_suspect_or_down'] == 0)}{late}"))
            if "generator_cpu_s" in st and st.get("kill", 1) > 1:
                rows.append(("failover-scale", f"{what}: the generators' CPU from the kill, their slowest GC", "",
                             f"{st['generator_cpu_s']:.1f} s, {st['generator_gc_pause_max_ms']:.0f} ms"))
            if "state_events_naming_suspect_or_down" in st:
                rows.append(("failover-scale", f"N={st['nodes']:,}: node.state events naming SUSPECT/DOWN", "",
                             f"{st['state_events_naming_suspect_or_down']} (leaving SUSPECT too)"))
            if "declared_in_ramp" in st:
                rows.append(("failover-scale", f"N={st['nodes']:,}: declared by the leader in the ramp", "",
                             f"{st['declared_in_ramp']} (generator up to "
                             f"{st['generator_late_max_in_ramp_ms']:.0f} ms late sending)"))
            if "declared_before_kill" in st:
                rows.append(("failover-scale", f"N={st['nodes']:,}: declared by the old leader in the settle", "",
                             f"{st['declared_before_kill']} (generator up to "
                             f"{st['generator_late_max_ms']:.0f} ms late sending)"))
            if "taken_up_total" in st:
                rows.append(("failover-scale", f"N={st['nodes']:,}: parked sessions taken up (run total)", "",
                             f"{st['taken_up_total']:,}"))
            if "nodes_loaded_after_kill_s" in st:
                rows.append(("failover-scale", f"N={st['nodes']:,}: new leader's store loaded / take-up began", "",
                             f"{st['nodes_loaded_after_kill_s']:.2f} / {st.get('take_up_began_after_kill_s', -1):.2f}"
                             f" s after the kill ({st['node_records_read']:,} node records read: the rest warm)"))
            rows.append(("failover-scale", f"N={st['nodes']:,}: heartbeat lag p99 after", "< 100 ms",
                         f"{st['lag_p99_ms']:.0f} ms{_verdict(st['lag_p99_ms'] < 100)}"))
    tu = results.get("takeup")
    if tu and "error" not in tu:
        i, d = tu["inline"], tu["deferred"]
        rows.append(("takeup", f"{tu['nodes']:,} parked sessions taken up, per node (in process)", "",
                     f"{i['takeup_and_first_heartbeat_us']:.0f} us with the first judge inline; "
                     f"{d['takeup_and_first_heartbeat_us']:.0f} us deferred, then {d['deferred_judge_us']:.0f} us"))
    jb = results.get("job-heartbeats")
    if jb and "error" not in jb:
        rows.append(("job-heartbeats", f"a node's heartbeat into a running job of {jb['large_nodes']:,} x "
                     f"{jb['per_node']} ranks, against {jb['small_nodes']:,} (in process)", "about x1",
                     f"{jb['large_us']:.0f} vs {jb['small_us']:.0f} us (x{jb['ratio']:.2f}); "
                     f"{jb['large_rows_us']:.0f} us with its rank table in rows{_verdict(jb['ratio'] < 2)}"))
        snap = jb["snapshots"]
        rows.append(("job-heartbeats", f"the same with snapshots on ({snap['keep_steps']} steps of a node's ranks and "
                     "its peer's): a heartbeat; the first node's, which asks for the safe step", "about x1",
                     f"{snap['large']['heartbeat_us']:.0f} vs {snap['small']['heartbeat_us']:.0f} us "
                     f"(x{snap['ratio']:.2f}); {snap['large']['safe_step_us']:.0f} vs "
                     f"{snap['small']['safe_step_us']:.0f} us (x{snap['safe_step_ratio']:.2f})"
                     f"{_verdict(snap['ratio'] < 2 and snap['safe_step_ratio'] < 2)}"))
        rec = jb["record"]
        rows.append(("job-heartbeats", "the job's record as stored, in full / packed (etcd takes 1.5 MiB a request); "
                     "CPU to write / to read it back, held packed (held in rows)", "",
                     f"{rec['full_bytes'] / 1e6:.2f} / {rec['packed_bytes'] / 1e6:.2f} MB; {rec['pack_ms']:.1f} / "
                     f"{rec['unpack_ms']:.1f} ms ({rec['rows_pack_ms']:.0f} / {rec['rows_unpack_ms']:.0f} ms)"))
        q = jb["queue"]
        rows.append(("job-heartbeats", f"a scheduler pass over 1 / {q['queued']} pending jobs on a fleet of "
                     f"{jb['large_nodes']:,} nodes (CPU)", "under x10",
                     f"{q['one_ms']:.0f} / {q['queued_ms']:.0f} ms (x{q['queued_ms'] / q['one_ms']:.1f})"
                     f"{_verdict(q['queued_ms'] < 10 * q['one_ms'])}"))
        rows.append(("job-heartbeats", f"a scheduler step of the job of {jb['large_nodes']:,} nodes: view / decision "
                     "(its rank table in rows)", "",
                     f"{jb['step']['view_ms']:.0f} / {jb['step']['decision_ms']:.1f} ms "
                     f"({jb['step_rows']['decision_ms']:.1f} ms)"))
    sh = results.get("store-heartbeats")
    if sh and "error" not in sh and all("error" not in sh.get(k, {"error": 1}) for k in ("sqlite", "etcd")):
        etcd_steps = {st["nodes"]: st for st in sh["etcd"]["steps"]}
        for lite in sh["sqlite"]["steps"]:
            other = etcd_steps.get(lite["nodes"])
            if other is None:
                continue
            ratio = other["us_per_heartbeat"] / lite["us_per_heartbeat"] if lite["us_per_heartbeat"] else 0.0
            rows.append(("store-heartbeats", f"N={lite['nodes']:,}: controller CPU per heartbeat, SQLite / etcd",
                         "etcd <= 1.1x", f"{lite['us_per_heartbeat']:.0f} / {other['us_per_heartbeat']:.0f} us "
                         f"({ratio:.2f}x){_verdict(0 < ratio <= 1.1)}"))
            rows.append(("store-heartbeats", f"N={lite['nodes']:,}: heartbeat lag p99, SQLite / etcd", "< 100 ms",
                         f"{lite['lag_p99_ms']:.1f} / {other['lag_p99_ms']:.1f} ms"
                         f"{_verdict(max(lite['lag_p99_ms'], other['lag_p99_ms']) < 100)}"))
    elif sh:
        rows.append(("store-heartbeats", "error", "", _first_line(str(sh.get("error") or sh))))
    sim = results.get("simulate")
    if sim and "error" not in sim:
        sc_ = sim["scale"]
        rows.append(("simulate", f"100,000 GPUs for {sc_['days']:g} days, one core", f"<= {sim['goal_s']:g} s",
                     f"{sc_['wall_s']:.1f} s ({sc_['events']:,} events){_verdict(sc_['wall_s'] <= sim['goal_s'])}"))
        for name, regime in sim["regimes"].items():
            p, b = regime["phalanx"], regime["baseline"]
            rows.append(("simulate", f"{name}, {regime['days']:g} days: ETTR Phalanx / baseline", "",
                         f"{p['ettr'] * 100:.1f} % / {b['ettr'] * 100:.1f} %"
                         + (f" (baseline job failed: {b['failed'][0][:60]})" if b["failed"] else "")
                         + (f" (Phalanx job failed: {p['failed'][0][:60]})" if p["failed"] else "")))
            g = regime.get("groups")
            if g:
                rows.append(("simulate", f"{name}, {regime['days']:g} days, as {g['replicas']} replica groups: ETTR "
                             "(same scenario)", f">= {g['goal'] * 100:g} %",
                             f"{g['ettr'] * 100:.1f} % (recovery p50 {g['recovery_p50_s']:.0f} s against "
                             f"{p['recovery_p50_s']:.0f} s){_verdict(g['ettr'] >= g['goal'])}"))
        for mode, m in sim.get("month", {}).items():
            rows.append(("simulate", f"131,072 GPUs for 30 days as {mode}, one core: wall time (ETTR)",
                         f"<= {sim['goal_s']:g} s", f"{m['wall_s']:.1f} s, {m['events']:,} events (ETTR "
                         f"{m['ettr'] * 100:.1f} %){_verdict(m['wall_s'] <= sim['goal_s'])}"))
    rep = results.get("replicas")
    if rep and "faults" in rep:
        for fault, systems in rep["faults"].items():
            g, w = systems.get("groups", {}), systems.get("gang", {})
            if "error" in g or "error" in w:
                rows.append(("replicas", f"{fault}", "", _first_line(str(g.get("error") or w.get("error")))))
                continue
            step = g.get("step_s") or 0.0
            measured = bool(step) and g.get("pause_s") is not None
            rows.append(("replicas", f"{fault}: healthy ranks' longest pause, replica groups / one gang",
                         "groups <= 2 steps", f"{g.get('pause_s')} / {w.get('pause_s')} s" + (
                             f" ({g['pause_s'] / step:.0f} steps of {step * 1000:.0f} ms)"
                             f"{_verdict(g['pause_s'] <= 2 * step)}" if measured else "")))
            rows.append(("replicas", f"{fault}: back at full strength, replica groups / one gang", "",
                         f"{g['full_strength_s']} / {w['full_strength_s']} s"))
            rows.append(("replicas", f"{fault}: samples skipped (groups) / steps computed twice (gang)", "",
                         f"{g['samples_skipped']:,} ({g['steps_alone']} steps with one group) / "
                         f"{w['steps_computed_twice']}"))
            if "healthy_steps_taken_again" in g:
                rows.append(("replicas", f"{fault}: steps the healthy group took again", "0 where predictable",
                             f"{g['healthy_steps_taken_again']}" + (
                                 _verdict(g["healthy_steps_taken_again"] == 0)
                                 if fault in replicas.PREDICTABLE else "")))
    elif rep:
        rows.append(("replicas", "skipped", "", _first_line(str(rep.get("skipped") or rep.get("error") or rep))))
    r = results.get("recovery")
    if r and "error" not in r:
        for fault, systems in r["faults"].items():
            for system, o in systems.items():
                if o.get("skipped"):
                    rows.append(("recovery", f"{fault}: {system}", "", f"n/a ({o['skipped']})"))
                    continue
                result = ("never" if o.get("resumed_s") is None else
                          f"{o['resumed_s']:.1f} s to training, {o['steps_lost']:g} steps computed twice")
                if o.get("of", 1) > 1 and o.get("resumed_s") is not None:
                    result = (f"median {o['resumed_s']:.1f} s (max {o['resumed_max_s']:.1f}) to training, "
                              f"{o['steps_lost']:g} steps computed twice (max {o['steps_lost_max']}); "
                              f"{o['resumed']} of {o['of']} resumed" + (f", {o['warm']} warm" if "warm" in o else ""))
                if o.get("commit_s") is not None:
                    result += (f"; every rank committed in median {o['commit_s']:.2f} s (max {o['commit_max_s']:.2f}) "
                               f"after the request, {' / '.join(o['committed'])}")
                if o.get("seconds_in_state"):
                    states = {k: v for k, v in o["seconds_in_state"].items()
                              if k in ("CHECKPOINTING", "EVICTING", "RENDEZVOUS", "RESTARTING")}
                    result += " (" + ", ".join(f"{k} {v:.1f} s" for k, v in states.items()) + ")"
                rows.append(("recovery", f"{fault}: {system}", "", result))
    e = results.get("ending")
    if e and "error" not in e:
        for name, o in e["summary"].items():
            exits = ", ".join(f"{how} ranks median {o[f'exit_{how}_s']:.2f} s (max {o[f'exit_{how}_max_s']:.2f})"
                              for how in ("cold", "warm") if o.get(f"exit_{how}_s") is not None)
            rows.append(("ending", f"{name}: last line after training -> exit", "",
                         f"{exits or 'n/a'}; {o['succeeded']} of {o['of']} SUCCEEDED, {o['false_verdicts']} false "
                         f"verdicts; median step {o['step_s'] * 1e3:.1f} ms" if o.get("step_s") else "no steps"))
        for name, t in e.get("teardown", {}).items():
            rows.append(("ending", f"a script's last line -> exit, {name} (no cluster)", "",
                         f"median {t['median_s']:.2f} s (max {t['max_s']:.2f})"))
        if e.get("snapshot_slowdown") is not None:
            said = e["summary"].get("none, snapshots", {}).get("trainlib_said", [])
            rows.append(("ending", "the job's step time with trainlib.snapshot() every step against without", "<= 3 %",
                         f"{e['snapshot_slowdown']:+.1%}{_verdict(e['snapshot_slowdown'] <= 0.03)}; trainlib said "
                         + (", ".join(f"{x:.1%}" for x in said) or "nothing")))
    return rows


def render_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "-+-".join("-" * w for w in widths)]
    out += [" | ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def capacity_steps_table(c: dict) -> str:
    header = ("N", "sessions", "hold s", "recv/s", "sent/s", "ctl CPU%", "us/hb", "lag p50", "lag p99", "lag max",
              "RSS MB", "gen CPU%", "other CPU0%", "SUSP ramp/hold/end", "ok")
    rows = []
    for s in c["steps"]:
        rows.append((f"{s['nodes']:,}", f"{s['sessions_controller']:,}", f"{s['hold_s']:.0f}",
                     f"{s['achieved_hz']:,.0f}",
                     f"{s['generator_sent_hz']:,.0f}", f"{s['controller_cpu_pct']:.0f}",
                     f"{s['us_per_heartbeat']:.0f}" if s["us_per_heartbeat"] else "-",
                     f"{s['lag_p50_ms']:.1f}", f"{s['lag_p99_ms']:.1f}", f"{s['lag_max_ms']:.0f}",
                     f"{s['controller_rss_mb']:.0f}", f"{s['generator_cpu_pct']:.0f}",
                     f"{s.get('other_load_on_controller_core_pct', 0):.0f}",
                     f"{s['ramp_suspect_or_down_events']}/{s['suspect_or_down_events']}/{s['suspect_or_down_now']}",
                     "yes" if s["sustained"] else "NO"))
    return render_table(header, rows)


def report(results: dict) -> str:
    m = results["machine"]
    parts = ["", "=" * 100, "Phalanx benchmark results", "=" * 100,
             f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), {m['memory_gb']} GB RAM, {m['platform']}, "
             f"{m['python_impl']} {m['python']}, grpcio {m['grpcio']}",
             f"run: {results['started']}, {'quick' if results['quick'] else 'full'}, {results['duration_s']:.0f} s",
             ""]
    c = results.get("capacity")
    if c and "error" not in c and c["steps"]:
        parts += [f"capacity steps ({c['placement']}; {c['generators']} generator process(es), "
                  f"{c['sessions_per_channel']} node session(s) per TCP connection; each step measured over its "
                  f"hold (>= {c['hold_s']:g} s) after a {c['settle_s']:g} s settle):",
                  capacity_steps_table(c),
                  "  recv/s = heartbeats the controller applied per second; sent/s = what the generator sent; "
                  "ctl CPU% = controller process, % of one core;",
                  "  us/hb = controller CPU per heartbeat received (at small N it includes fixed per-tick costs); "
                  "lag = controller apply time - sent_unix_ns,",
                  "  over its last 65,536 heartbeats; other CPU0% = CPU 0 time (user+system) used by processes other "
                  "than the controller (kernel softirq not counted);",
                  "  SUSP = node.state SUSPECT/DOWN events during the ramp / during the hold, and nodes SUSPECT or "
                  "DOWN at the end of the hold.",
                  f"  {c['criteria']}."]
        if any(s["lag_window_includes_ramp"] for s in c["steps"]):
            ramped = [f"{s['nodes']:,}" for s in c["steps"] if s["lag_window_includes_ramp"]]
            parts.append(f"  note: the controller's lag window (last {capacity.LAG_WINDOW:,} heartbeats) reaches back "
                         f"into the ramp at N={', '.join(ramped)}: those lag figures include registration time.")
        disturbed = [f"{s['nodes']:,} ({s['other_load_on_controller_core_pct']:.0f}%)" for s in c["steps"]
                     if s.get("other_load_on_controller_core_pct", 0) > 10]
        if disturbed:
            parts.append(f"  WARNING: other processes on this machine took more than 10% of the controller's core at "
                         f"N={', '.join(disturbed)}; those steps measure a controller with less than a full core.")
        if c.get("stopped_because"):
            parts.append(f"  ramp stopped early: {c['stopped_because']}")
        parts.append(f"  {c['note']}")
        parts.append("")
    d = results.get("detection")
    if d and "error" not in d:
        parts.append(f"detection: {d['note']}")
        parts.append("")
    parts.append(render_table(("benchmark", "figure", "goal", "result"), table_rows(results)))
    if c and "error" not in c and c.get("first_unsustained_step"):
        parts.append(f"capacity: N={c['first_unsustained_step']:,} was not sustained: {c['first_unsustained_why']}.")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.KEEP = args.keep
    common.CHILD_ENV = ORIGINAL_ENV

    def terminate(signum, frame):  # run the `finally` blocks that stop our processes
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started with SIGINT ignored
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick,
                     "benchmarks": args.benchmarks, "machine": machine()}
    log(f"phalanx bench: {', '.join(args.benchmarks)} ({'quick' if args.quick else 'full'})")
    t0 = time.monotonic()
    try:
        try:
            import uvloop
            uvloop.run(run_all(args, results))
        except ImportError:
            asyncio.run(run_all(args, results))
    except KeyboardInterrupt:
        log("interrupted; processes stopped")
        results["interrupted"] = True
    results["duration_s"] = round(time.monotonic() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(report(results))
    print(f"\nresults written to {out}")
    failed = [name for name in args.benchmarks if "error" in results.get(name, {"error": ""})]
    return 1 if failed or results.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
