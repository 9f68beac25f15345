"""The controller's modules depend downwards only: domain (pure rules and values) <- services (state and I/O)
<- api (servicers, the standby's server, /metrics) <- assembly (start-up). No module imports one of a layer
above it, TYPE_CHECKING imports included; so no jobs/ <-> recovery/ cycle: the executor needs of the job manager
only its `Jobs` protocol. This test reads the source: a new upward import fails here first."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
DOMAIN, SERVICES, API, ASSEMBLY = range(4)
LAYER_NAMES = ("domain", "services", "api", "assembly")
# Each module's layer, by its dotted name or the longest prefix listed; anything unlisted is domain.
LAYERS = {
    "controller.main": ASSEMBLY, "controller.server": ASSEMBLY, "controller.ha_role": ASSEMBLY,
    "controller.switchboard": ASSEMBLY,
    "controller.api": API, "controller.ha": API, "controller.obs.metrics": API,
    "controller.jobs.manager": SERVICES, "controller.jobs.slurm_watch": SERVICES,
    "controller.nodes.registry": SERVICES, "controller.nodes.session": SERVICES,
    "controller.recovery.executor": SERVICES, "controller.store": SERVICES, "controller.credentials": SERVICES,
    "controller.obs.events": SERVICES,
}


def layer(module: str) -> int | None:
    if module != "controller" and not module.startswith("controller."):
        return None
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:n])) in LAYERS:
            return LAYERS[prefix]
    return DOMAIN


def imported(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_no_controller_module_imports_from_a_layer_above_its_own():
    upward = []
    for path in sorted((ROOT / "controller").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mine = layer(module)
        for name in sorted(imported(ast.parse(path.read_text()))):
            theirs = layer(name)
            # `from controller import x` names module x: judged as such (the package itself is no layer)
            if theirs is not None and theirs > mine and name != "controller":
                upward.append(f"{module} ({LAYER_NAMES[mine]}) imports {name} ({LAYER_NAMES[theirs]})")
    assert not upward, "\n".join(upward)


def test_the_executor_does_not_know_the_job_manager():
    tree = ast.parse((ROOT / "controller/recovery/executor.py").read_text())
    assert not {n for n in imported(tree) if n.startswith("controller.jobs.manager")}


def test_the_shared_ground_floor_imports_none_of_the_applications_above_it():
    """phalanx/ is what both daemons, trainlib and the CLI import: it may import none of them (the CLI, which runs
    the simulator and reads the agent's defaults, is an application above the daemons: cli/)."""
    above = ("agent", "controller", "cli", "trainlib")
    found = []
    for path in sorted((ROOT / "phalanx").rglob("*.py")):
        for name in sorted(imported(ast.parse(path.read_text()))):
            if name.split(".")[0] in above:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not found, "\n".join(found)
