"""How the CLI shows nodes and events: tables for people, stable JSON for scripts."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Sequence
from typing import Any

from phalanx import hostlist
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2, control_pb2


def state_name(value: int) -> str:
    return common_pb2.NodeState.Name(value).removeprefix("NODE_STATE_")


def health_name(value: int) -> str:
    return common_pb2.Health.Name(value).removeprefix("HEALTH_").replace("UNSPECIFIED", "-")


def iso(ns: int) -> str | None:
    if not ns:
        return None
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def age(ns: int, now_ns: int | None = None) -> str:
    if not ns:
        return "-"
    return duration(max(0.0, ((now_ns or time.time_ns()) - ns) / 1e9))


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def node_dict(node: control_pb2.Node) -> dict[str, Any]:
    telemetry = {g.index: g for g in node.gpus}
    gpus = []
    for info in node.inventory.gpus:
        gpu: dict[str, Any] = {"index": info.index, "uuid": info.uuid, "name": info.name,
                               "pci_bus_id": info.pci_bus_id, "serial": info.serial,
                               "memory_total_bytes": info.memory_total_bytes}
        if info.index in telemetry:
            t = telemetry[info.index]
            gpu.update(temperature_c=t.temperature_c, power_w=t.power_w,
                       utilization_percent=t.utilization_percent, memory_used_bytes=t.memory_used_bytes)
        gpus.append(gpu)
    host = node.host
    return {
        "name": node.name,
        "state": state_name(node.state),
        "health": health_name(node.health),
        "drain_reason": node.drain_reason or None,
        "connected": node.connected,
        "peer": node.peer or None,
        "incarnation": node.incarnation,
        "last_heartbeat": iso(node.last_heartbeat_unix_ns),
        "state_since": iso(node.state_since_unix_ns),
        "running_ranks": node.running_ranks,
        "labels": dict(node.inventory.labels),
        "gpu_backend": common_pb2.GpuBackendKind.Name(node.inventory.gpu_backend).removeprefix("GPU_BACKEND_KIND_"),
        "gpus": gpus,
        "host": {
            "hostname": node.inventory.hostname,
            "cpu_count": node.inventory.cpu_count,
            "memory_total_bytes": node.inventory.memory_total_bytes,
            "cpu_percent": host.cpu_percent,
            "memory_available_bytes": host.memory_available_bytes,
            "load1": host.load1,
            "checkpoint_dir": node.inventory.checkpoint_dir,
            "checkpoint_free_bytes": host.checkpoint_free_bytes,
        },
    }


def event_dict(event: common_pb2.Event) -> dict[str, Any]:
    return {"seq": event.seq, "time": iso(event.time_unix_ns), "kind": event.kind, "node": event.node or None,
            "job": event.job or None, "message": event.message, "fields": dict(event.fields)}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers], *[[("-" if c is None or c == "" else str(c)) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def nodes_table(nodes: Sequence[control_pb2.Node], wide: bool = False) -> str:
    """A line per node; `wide` adds the GPU model, ranks running, the topology labels, the agent's
    incarnation and since when the node is in its state."""
    now = time.time_ns()
    rows = []
    for n in nodes:
        row = [n.name, state_name(n.state), health_name(n.health), len(n.inventory.gpus), f"{n.host.cpu_percent:.0f}%",
               f"{n.host.load1:.2f}", age(n.last_heartbeat_unix_ns, now), n.peer.removeprefix("ipv4:")]
        if wide:
            models = sorted({g.name for g in n.inventory.gpus})
            labels = ",".join(f"{k}={v}" for k, v in sorted(n.inventory.labels.items()))
            row += [", ".join(models), n.running_ranks, labels, n.incarnation, age(n.state_since_unix_ns, now)]
        rows.append([*row, n.drain_reason])
    headers = ["NODE", "STATE", "HEALTH", "GPUS", "CPU", "LOAD", "LAST-HB", "PEER"]
    if wide:
        headers += ["GPU-MODEL", "RANKS", "LABELS", "INCARNATION", "IN-STATE"]
    return table([*headers, "DRAIN-REASON"], rows)


def controllers_dict(reply: control_pb2.ListControllersResponse) -> dict[str, Any]:
    return {
        "leader": reply.leader or None, "leader_address": reply.leader_address or None, "epoch": reply.epoch,
        "store": reply.store or None, "answered_by": reply.answered_by or None, "problem": reply.problem or None,
        "parked_sessions": reply.parked_sessions,
        "members": [{"name": m.name, "address": m.address, "role": "leader" if m.leader else "standby",
                     "epoch": m.epoch, "started": iso(m.started_unix_ns), "leader_since": iso(m.leader_since_unix_ns)}
                    for m in reply.members],
    }


def controllers_text(reply: control_pb2.ListControllersResponse) -> str:
    """A line per controller, then the leader, the store and any problem."""
    now = time.time_ns()
    rows = [(m.name, m.address, "leader" if m.leader else "standby", m.epoch or "",
             f"{age(m.started_unix_ns, now)} ago" if m.started_unix_ns else "") for m in reply.members]
    lines = [table(("NAME", "ADDRESS", "ROLE", "EPOCH", "STARTED"), rows)]
    if reply.leader:
        leading = next((m for m in reply.members if m.leader and m.leader_since_unix_ns), None)
        lines.append(f"leader: {reply.leader} at {reply.leader_address or '?'}"
                     + (f", epoch {reply.epoch}" if reply.epoch else "")
                     + (f" (leading for {age(leading.leader_since_unix_ns, now)})" if leading else ""))
    else:
        lines.append("leader: none elected")
    answered = f"answered by {reply.answered_by}" if reply.answered_by else ""
    if reply.parked_sessions:
        held = "1 agent's session" if reply.parked_sessions == 1 else f"{reply.parked_sessions} agents' sessions"
        answered += f", a standby holding {held} parked"
    lines.append(f"store: {reply.store or '?'}" + (f" ({answered})" if answered else ""))
    if reply.problem:
        lines.append(f"problem: {reply.problem}")
    return "\n".join(lines)


def health_dict(node: common_pb2.NodeHealth) -> dict[str, Any]:
    return {"node": node.node, "health": health_name(node.health), "reasons": list(node.reasons),
            "evaluated": iso(node.evaluated_unix_ns),
            "gpus": [{"index": g.index, "health": health_name(g.health), "reasons": list(g.reasons)}
                     for g in node.gpus]}


def health_text(nodes: Sequence[common_pb2.NodeHealth], detail: bool) -> str:
    """One line per node; with `detail`, one line per GPU and every reason."""
    if not detail:
        return table(("NODE", "HEALTH", "GPUS-NOT-HEALTHY", "FIRST-REASON"),
                     [(n.node, health_name(n.health),
                       ",".join(str(g.index) for g in n.gpus if g.health > common_pb2.HEALTH_HEALTHY),
                       n.reasons[0] if n.reasons else "") for n in nodes])
    lines = []
    for n in nodes:
        lines.append(f"{n.node}: {health_name(n.health)}")
        lines += [f"  - {r}" for r in n.reasons if not r.startswith("GPU ")]
        for g in n.gpus:
            lines.append(f"  GPU {g.index}: {health_name(g.health)}")
            lines += [f"    - {r}" for r in g.reasons]
    return "\n".join(lines)


def event_line(event: common_pb2.Event) -> str:
    stamp = iso(event.time_unix_ns) or "-"
    by = event.fields.get("by")
    return f"{event.seq:>6}  {stamp}  {event.kind:<24}  {event.message}" + (f"  [by {by}]" if by else "")


def dumps(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False)


def job_state(value: int) -> str:
    return common_pb2.JobState.Name(value).removeprefix("JOB_STATE_")


def rank_state(value: int) -> str:
    return common_pb2.RankState.Name(value).removeprefix("RANK_STATE_").replace("UNSPECIFIED", "-")


FINISHED = frozenset({common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED})


def seconds_in_state(job: common_pb2.Job, now_ns: int | None = None) -> dict[str, float]:
    """Seconds the job spent in each state over its life, its current state's so far included (not a finished
    job's: its time is up)."""
    spent = {p.phase: p.seconds for p in job.phase_times}
    if job.state_since_unix_ns and job.state not in FINISHED:
        current = job_state(job.state)
        now = now_ns or time.time_ns()
        spent[current] = spent.get(current, 0.0) + max(0.0, (now - job.state_since_unix_ns) / 1e9)
    return {phase: round(seconds, 3) for phase, seconds in spent.items()}


def job_dict(job: common_pb2.Job) -> dict[str, Any]:
    spec = job.spec
    return {
        "id": job.id, "name": spec.name or None, "state": job_state(job.state), "reason": job.reason or None,
        "generation": job.generation, "nodes": list(job.nodes), "spares": list(job.spares),
        "ranks_per_node": spec.ranks_per_node, "world_size": ranktable.count(job), "priority": spec.priority,
        "command": list(spec.command), "checkpoint_dir": spec.checkpoint_dir or None, "user": job.user or None,
        "run_as": spec.run_as or None,
        "limits": {"memory_bytes": spec.limits.memory_bytes or None, "tasks": spec.limits.tasks or None,
                   "open_files": spec.limits.open_files or None},
        "master_addr": job.master_addr or None, "master_port": job.master_port or None,
        "submitted": iso(job.submitted_unix_ns), "started": iso(job.started_unix_ns),
        "finished": iso(job.finished_unix_ns), "exit_code": job.exit_code,
        "restarts": job.restarts, "incident": job.incident or None, "incident_kind": job.incident_kind or None,
        "evicted": list(job.evicted),
        "standbys": dict(sorted(job.standbys.items())),
        "hang_culprit": {"rank": job.culprit.rank, "node": job.culprit.node, "process_group": job.culprit.process_group,
                         "op": job.culprit.op, "seq": job.culprit.seq, "state": job.culprit.state,
                         "peers_seq": job.culprit.peers_seq} if job.HasField("culprit") else None,
        "seconds_in_state": seconds_in_state(job),
        "ranks": [{"rank": r.rank, "node": r.node, "local_rank": r.local_rank, "gpu": r.gpu,
                   "state": rank_state(r.state), "pid": r.pid or None, "wrapper_pid": r.wrapper_pid or None,
                   "exit_code": r.exit_code, "generation": r.generation}
                  for r in ranktable.rows(job)],
        "replicas": spec.replicas or None,
        "groups": [{"group": g.index, "state": group_state(g.state), "generation": g.generation,
                    "nodes": list(job.nodes[g.index * len(job.nodes) // spec.replicas:
                                            (g.index + 1) * len(job.nodes) // spec.replicas]),
                    "reason": g.reason or None, "incident_kind": g.incident_kind or None}
                   for g in job.groups] if spec.replicas > 1 else None,
        "lighthouse": lighthouse_url(job),
    }


def lighthouse_url(job: common_pb2.Job) -> str | None:
    """Where a replica-group job's lighthouse runs (the ranks reach it through their node's relay)."""
    if not job.lighthouse_port:
        return None
    host = job.lighthouse_host or "?"
    return f"http://[{host}]:{job.lighthouse_port}" if ":" in host else f"http://{host}:{job.lighthouse_port}"


def group_state(state: int) -> str:
    """TRAINING, STOPPING, WAITING or REBUILDING (a replica group's state)."""
    return common_pb2.ReplicaGroupState.Name(state).removeprefix("REPLICA_GROUP_") if state else "UNKNOWN"


def jobs_table(jobs: Sequence[common_pb2.Job], wide: bool = False) -> str:
    """A line per job, its nodes as a hostlist (gpu[001-004]); `wide` adds the user, spares, generation,
    restarts and the last incident."""
    rows = []
    for j in jobs:
        row = [j.id, j.spec.name, job_state(j.state), f"{j.spec.nodes}x{j.spec.ranks_per_node}", j.spec.priority,
               hostlist.compress(j.nodes)]
        if wide:
            row += [j.user, hostlist.compress(j.spares), j.generation, j.restarts, j.incident_kind]
        rows.append([*row, j.reason])
    headers = ["JOB", "NAME", "STATE", "SIZE", "PRIO", "NODES"]
    if wide:
        headers += ["USER", "SPARES", "GEN", "RESTARTS", "INCIDENT"]
    return table([*headers, "REASON"], rows)


def limits_text(limits: common_pb2.ResourceLimits) -> str:
    """`memory 8 GiB, 512 tasks, 65536 open files`, or '' for none."""
    parts = []
    if limits.memory_bytes:
        parts.append(f"memory {limits.memory_bytes / (1 << 30):.3g} GiB")
    if limits.tasks:
        parts.append(f"{limits.tasks} tasks")
    if limits.open_files:
        parts.append(f"{limits.open_files} open files")
    return ", ".join(parts)


def job_text(job: common_pb2.Job) -> str:
    d = job_dict(job)
    lines = [f"{job.id}{' (' + job.spec.name + ')' if job.spec.name else ''}: {d['state']}",
             f"  reason:      {job.reason or '-'}",
             f"  command:     {' '.join(job.spec.command)}",
             f"  size:        {job.spec.nodes} nodes x {job.spec.ranks_per_node} ranks"
             + (f" + {job.spec.spares} spares" if job.spec.spares else "")
             + (f", {job.spec.replicas} replica groups" if job.spec.replicas > 1 else "")
             + f", priority {job.spec.priority}",
             *([f"  limits:      {limits_text(job.spec.limits)} per rank"] if limits_text(job.spec.limits) else []),
             *([f"  runs as:     {job.spec.run_as}"] if job.spec.run_as else []),
             f"  generation:  {job.generation} (restarts: {job.restarts})",
             f"  incident:    {job.incident or '-'}" + (f" (evicted: {hostlist.compress(job.evicted)})"
                                                         if job.evicted else ""),
             *([f"  culprit:     rank {job.culprit.rank} on {job.culprit.node}: stuck at collective {job.culprit.seq} "
                f"({job.culprit.op or '?'}, {job.culprit.state or '?'}) while its peers reached "
                f"{job.culprit.peers_seq} (NCCL flight recorder)"] if job.HasField("culprit") else []),
             f"  nodes:       {hostlist.compress(job.nodes) or '-'}"
             + (f" (spares: {hostlist.compress(job.spares)})" if job.spares else ""),
             f"  rendezvous:  {job.master_addr}:{job.master_port}" if job.master_port else "  rendezvous:  -",
             *(f"  group {g['group']}:     {g['state']} on {hostlist.compress(g['nodes'])}, generation "
               f"{g['generation']}" + (f" ({g['reason']})" if g["reason"] else "") for g in d["groups"] or ()),
             *([f"  lighthouse:  {d['lighthouse']}"] if d["lighthouse"] else []),
             *(["  warm:        " + ", ".join(f"{node} {n}" for node, n in sorted(job.standbys.items()))
                + " (standbys ready: a restart there skips starting Python and importing torch)"]
               if job.standbys else []),
             f"  submitted:   {d['submitted']}   started: {d['started'] or '-'}   finished: {d['finished'] or '-'}",
             *(["  in state:    " + ", ".join(f"{phase} {duration(seconds)}"
                                              for phase, seconds in d["seconds_in_state"].items())]
               if d["seconds_in_state"] else [])]
    if ranktable.count(job):
        # PID is the rank's own process (what to attach a debugger or py-spy to); WRAPPER is the agent's small
        # wrapper around it, which records its exit status.
        lines.append(table(("  RANK", "NODE", "GPU", "STATE", "PID", "WRAPPER", "EXIT"),
                           [(f"  {r.rank}", r.node, r.gpu, rank_state(r.state), r.pid or "", r.wrapper_pid or "",
                             r.exit_code if r.state == common_pb2.RANK_STATE_EXITED else "")
                            for r in ranktable.rows(job)]))
    return "\n".join(lines)
