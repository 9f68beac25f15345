"""A real controller's event log as the simulator's failure trace (`phalanx simulate --replay EVENTS.json`).

The log is what `phalanx events --json` prints (a JSON array) or `phalanx events --follow --json` (one object a
line). Only the events that are a fault's first sign become faults; what the controller did about them (drains,
the job's incidents for a lost node or a failed GPU, verdicts that name an XID already read) is its reaction, which
the simulation decides again with the scenario's policies:

- `gpu.xid`: that XID on that node, judged by the health policy (79 is FAILED, 13 alone is nothing);
- `node.health` to FAILING, not naming an XID: a warning (a pending row remap, a rising ECC rate); the fault it
  foretells strikes `failures.warning_s` later;
- `node.health` to FAILED, not naming an XID: a sudden GPU fault seen in telemetry (a lost GPU, a remap failure);
- `node.state` to DOWN: the node is lost;
- `job.incident` `crash` or `hang`: a rank of that job fails; the node stays good;
- `job.incident` `straggler`: one of that job's nodes turns slow.

Times are kept as they are, counted from the log's first event. The log's nodes are mapped to distinct nodes
of the simulated fleet (a seeded shuffle), its jobs to the simulated jobs in turn.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigError

LOST, XID, WARNING, FAILED, CRASH, STRAGGLER = "node-lost", "xid", "warning", "gpu-failed", "crash", "straggler"
KINDS = (LOST, XID, WARNING, FAILED, CRASH, STRAGGLER)


@dataclass(frozen=True)
class Fault:
    t: float  # seconds after the log's first event
    kind: str  # one of KINDS
    node: str = ""  # the log's node name (a node's faults)
    job: str = ""  # the log's job id (a job's incidents)
    xid: int = 0


@dataclass(frozen=True)
class Trace:
    source: str
    faults: tuple[Fault, ...]
    span_s: float  # first event to last
    nodes: tuple[str, ...]  # the nodes with faults, in order of first appearance
    jobs: tuple[str, ...]  # the jobs with incidents, likewise
    events: int  # events read

    def counts(self) -> dict[str, int]:
        out = {kind: 0 for kind in KINDS}
        for fault in self.faults:
            out[fault.kind] += 1
        return out


def load(path: str | Path) -> Trace:
    """The trace in an event log file. Raises ConfigError naming the file and, for a bad event, its place."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"replay.events: {path}: no such file") from None
    except PermissionError:
        raise ConfigError(f"replay.events: {path}: permission denied") from None
    except IsADirectoryError:
        raise ConfigError(f"replay.events: {path}: is a directory, not an event log") from None
    except UnicodeDecodeError:
        raise ConfigError(f"replay.events: {path}: not UTF-8 text") from None
    return parse(text, str(path))


def parse(text: str, source: str = "<events>") -> Trace:
    events = _decode(text, source)
    faults: list[Fault] = []
    start: float | None = None
    last = 0.0
    down: set[str] = set()
    for where, event in events:
        t = _time(event, f"{source}: {where}")
        start = t if start is None else start
        last = max(last, t)
        fault = _fault(event, t - start, down)
        if fault is not None:
            faults.append(fault)
    faults.sort(key=lambda f: f.t)
    nodes = tuple(dict.fromkeys(f.node for f in faults if f.node))
    jobs = tuple(dict.fromkeys(f.job for f in faults if f.job))
    return Trace(source, tuple(faults), (last - start) if start is not None else 0.0, nodes, jobs, len(events))


def _decode(text: str, source: str) -> list[tuple[str, dict[str, Any]]]:
    """[(where, event)] from a JSON array or JSON lines."""
    stripped = text.strip()
    if not stripped:
        raise ConfigError(f"replay.events: {source}: empty: write `phalanx events --json --limit N > FILE`")
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ConfigError(f"replay.events: {source}: not valid JSON: {e}") from None
        pairs = [(f"event {i + 1}", item) for i, item in enumerate(items)]
    else:
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                pairs.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ConfigError(f"replay.events: {source}: line {n}: not valid JSON: {e.msg}") from None
    for where, item in pairs:
        if not isinstance(item, dict):
            raise ConfigError(f"replay.events: {source}: {where}: an event is a JSON object (as `phalanx events "
                              f"--json` prints), not {type(item).__name__}")
    return pairs


def _time(event: dict[str, Any], where: str) -> float:
    value = event.get("time")
    if not isinstance(value, str):
        raise ConfigError(f"replay.events: {where}: needs \"time\", an ISO 8601 time such as "
                          "\"2026-12-01T10:00:00.000Z\"")
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"replay.events: {where}: time {value!r} is not an ISO 8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _fault(event: dict[str, Any], t: float, down: set[str]) -> Fault | None:
    kind = event.get("kind")
    node = event.get("node") or ""
    job = event.get("job") or ""
    fields = event.get("fields") if isinstance(event.get("fields"), dict) else {}
    if kind == "gpu.xid" and node:
        try:
            return Fault(t, XID, node=node, xid=int(fields.get("xid", "")))
        except ValueError:
            return None
    if kind == "node.health" and node and "XID" not in str(fields.get("reason", "")):
        target = fields.get("target")
        if target == "FAILING":
            return Fault(t, WARNING, node=node)
        if target == "FAILED":
            return Fault(t, FAILED, node=node)
        return None
    if kind == "node.state" and node:
        if fields.get("target") != "DOWN":
            down.discard(node)
            return None
        if node in down:
            return None
        down.add(node)
        return Fault(t, LOST, node=node)
    if kind == "job.incident" and job:
        incident = fields.get("incident")
        if incident in ("crash", "hang"):
            return Fault(t, CRASH, job=job)
        if incident == "straggler":
            return Fault(t, STRAGGLER, job=job)
    return None
