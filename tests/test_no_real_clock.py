"""Decision code never reads the real clock or sleeps: `now` is passed in. The daemons' loops wait on an
injected clock. This test reads the source, so a new `time.monotonic()` in either fails here first."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent

# Pure decisions: state and `now` in, actions out.
DECISIONS = [
    "controller/recovery/lifecycle.py", "controller/recovery/detectors.py", "controller/recovery/progress.py",
    "controller/recovery/table.py", "controller/nodes/liveness.py", "controller/nodes/health.py",
    "controller/nodes/states.py", "controller/jobs/placement.py", "controller/jobs/topology.py",
    "controller/rendezvous/book.py", "controller/recovery/snapshots.py",
    "controller/sim/engine.py",  # the fleet simulator runs in virtual time only
]
# Loops and executors: they wait and read time through the injected clock.
LOOPS = [
    "controller/server.py", "controller/jobs/manager.py", "controller/recovery/executor.py",
    "controller/api/control_service.py", "controller/api/rendezvous_service.py", "controller/nodes/registry.py",
    "agent/link.py", "agent/main.py", "agent/supervisor.py", "agent/snapshots.py", "agent/warm.py",
    "agent/renewal.py", "controller/ha.py", "controller/nodes/session.py",
]
FORBIDDEN = {("time", "time"), ("time", "monotonic"), ("time", "time_ns"), ("time", "monotonic_ns"),
             ("time", "sleep"), ("asyncio", "sleep"), ("asyncio", "wait_for"), ("datetime", "now"),
             ("datetime", "utcnow")}


def clock_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                (node.value.id, node.attr) in FORBIDDEN:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio", "datetime"):
            for alias in node.names:
                if (node.module, alias.name) in FORBIDDEN:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {alias.name}")
    return found


@pytest.mark.parametrize("module", DECISIONS + LOOPS)
def test_no_real_clock_or_sleep(module):
    assert clock_reads(ROOT / module) == []


def test_the_check_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("import time, asyncio\nfrom time import monotonic\nasync def f():\n"
                      "    await asyncio.sleep(1)\n    return time.time()\n")
    found = sorted(line.split(": ", 1)[1] for line in clock_reads_rel(sample))
    assert found == ["asyncio.sleep", "from time import monotonic", "time.time"]


def clock_reads_rel(path: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return clock_reads(path)
    finally:
        ROOT = saved
