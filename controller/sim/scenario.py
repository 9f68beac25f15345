"""A simulation scenario (`phalanx simulate SCENARIO.toml`): the fleet, how it fails, the job, recovery timings.

Every key has a default; the defaults are the published figures the README names (Llama 3's 54 days on
16,384 H100s, Meta's fleet study) and this project's own `make bench` results. A bad file is a one-line
error naming the key and the rule, as for the daemons' configs (`phalanx.config`).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.config import JobsConfig, RecoveryConfig
from phalanx import config
from phalanx.config import positive, require, section, setting
from phalanx.errors import ConfigError

DAY_S = 86_400.0
HOUR_S = 3_600.0


def share(key: str, value: float) -> None:
    require(0.0 <= value <= 1.0, f"{key} ({value}) must be between 0 and 1")


@dataclass(frozen=True)
class FleetConfig:
    nodes: int = setting(2_080, "nodes in the fleet (16,384 GPUs of Llama 3's job on 2,048 nodes, and 32 more)")
    gpus_per_node: int = setting(8, "GPUs per node")
    nodes_per_leaf: int = setting(32, "nodes under one leaf switch (the generated tree topology); 0 = one flat "
                                  "network")
    nodes_per_block: int = setting(0, "nodes in one NVLink block (NVL72: 18), generated as Slurm's topology/block "
                                   "would describe them; 0 = no blocks")
    topology_conf: str = setting("", "a Slurm topology.conf (tree or block syntax) whose nodes and switches are "
                                 "the fleet, instead of the generated one (fleet.nodes, nodes_per_leaf and "
                                 "nodes_per_block are then unused); a path relative to the scenario file")

    def __post_init__(self) -> None:
        require(self.nodes >= 1, f"fleet.nodes ({self.nodes}) must be at least 1")
        require(self.gpus_per_node >= 1, f"fleet.gpus_per_node ({self.gpus_per_node}) must be at least 1")
        require(self.nodes_per_leaf >= 0, f"fleet.nodes_per_leaf ({self.nodes_per_leaf}) must not be negative")
        require(self.nodes_per_block >= 0, f"fleet.nodes_per_block ({self.nodes_per_block}) must not be negative")
        if self.nodes_per_block and not self.topology_conf:
            require(self.nodes % self.nodes_per_block == 0, f"fleet.nodes ({self.nodes}) must be a multiple of "
                    f"fleet.nodes_per_block ({self.nodes_per_block})")


@dataclass(frozen=True)
class FailureConfig:
    per_1000_node_days: float = setting(3.79, "interruptions per 1,000 node-days, every cause (Llama 3: 419 "
                                        "unexpected interruptions in 54 days on 2,048 nodes; Meta's clusters: "
                                        "2.34 and 6.50)")
    software_share: float = setting(0.13, "share that is software: a rank crashes, the node stays good and the job "
                                    "restarts in place (Llama 3: 12.9 %)")
    node_loss_share: float = setting(0.16, "share where the whole node is lost (network, host: Llama 3's 8.4 % + "
                                     "7.6 %); the rest are GPU and memory faults, judged by the health policy")
    hang_share: float = setting(0.0, "share of the software faults that hang (every rank stuck in a collective) "
                                "rather than crash: found by the hang detector, not the exit; no fleet publishes it, "
                                "so none by default")
    leaf_per_1000_leaf_days: float = setting(0.0, "leaf switches failing per 1,000 switch-days, each taking every "
                                             "node under it at once (until repaired); none by default: Llama 3 "
                                             "counts network faults per node")
    predictable_share: float = setting(0.25, "share of the hardware faults that give warning first (a row remap "
                                       "pending, a rising corrected-ECC rate); an assumption: no fleet publishes it")
    warning_s: float = setting(1_800.0, "how long before such a fault its warning shows")
    repair_h: float = setting(24.0, "hours before a node taken out returns to service (repaired or replaced)")
    straggler_per_1000_node_days: float = setting(0.5, "nodes turning slow (thermal, a bad link) per 1,000 "
                                                  "node-days; an assumption")
    straggler_slowdown: float = setting(0.3, "how much slower a straggler makes its whole job (0.3 = 30 %)")

    def __post_init__(self) -> None:
        require(self.per_1000_node_days >= 0, f"failures.per_1000_node_days ({self.per_1000_node_days}) must not be "
                "negative")
        for key in ("software_share", "node_loss_share", "predictable_share", "hang_share"):
            share(f"failures.{key}", getattr(self, key))
        require(self.software_share + self.node_loss_share <= 1.0,
                f"failures.software_share ({self.software_share}) + failures.node_loss_share "
                f"({self.node_loss_share}) must not exceed 1")
        require(self.leaf_per_1000_leaf_days >= 0, "failures.leaf_per_1000_leaf_days "
                f"({self.leaf_per_1000_leaf_days}) must not be negative")
        positive("failures.warning_s", self.warning_s)
        positive("failures.repair_h", self.repair_h)
        require(self.straggler_per_1000_node_days >= 0, "failures.straggler_per_1000_node_days "
                f"({self.straggler_per_1000_node_days}) must not be negative")
        require(self.straggler_slowdown > 0, f"failures.straggler_slowdown ({self.straggler_slowdown}) must be "
                "larger than 0")


@dataclass(frozen=True)
class JobConfig:
    name: str = setting("", "what to call jobs of this shape: NAME-1, NAME-2, ... (default job-1, job-2, ... over "
                        "every shape)")
    nodes: int = setting(2_048, "nodes the job trains on (one simulated rank per node stands for its GPUs)")
    spares: int = setting(8, "hot spares held beside it, in its topology domain")
    segment: int = setting(0, "nodes per segment, each inside one block (`phalanx submit --segment`, Slurm's "
                           "--segment); 0 = the job and its spares in one block, where the fleet has blocks")
    count: int = setting(1, "jobs of this shape on the fleet")
    step_s: float = setting(5.0, "seconds of one training step")
    checkpoint_interval_s: float = setting(1_800.0, "seconds of training between durable checkpoints")
    checkpoint_cost_s: float = setting(30.0, "seconds a durable checkpoint stops training (what is left after "
                                       "asynchronous saving)")
    snapshots: bool = setting(True, "in-memory snapshots replicated to a peer node (issue 11): a sudden fault loses "
                              "at most snapshot_every steps")
    snapshot_every: int = setting(1, "steps between snapshots")
    snapshot_overhead: float = setting(0.02, "share of step time snapshots cost (bench: 1.5-2 %)")
    length_h: float = setting(0.0, "hours of training the job needs; then it ends and frees its nodes (0: it "
                              "trains for the whole run)")
    replicas: int = setting(0, "data-parallel replica groups (torchft's, on the job's nodes in equal groups in "
                            "order): a fault restarts only its group while the others train on, and the group "
                            "recovers the state from a healthy one (no in-memory snapshots: `snapshots` is not used); "
                            "0 = none, a fault restarts the whole job")

    def __post_init__(self) -> None:
        require(self.nodes >= 1, f"job.nodes ({self.nodes}) must be at least 1")
        require(self.length_h >= 0, f"job.length_h ({self.length_h}) must not be negative")
        require(self.spares >= 0, f"job.spares ({self.spares}) must not be negative")
        require(self.segment >= 0, f"job.segment ({self.segment}) must not be negative")
        require(not self.segment or self.nodes % self.segment == 0, f"job.nodes ({self.nodes}) must be a multiple "
                f"of job.segment ({self.segment})")
        require(self.count >= 1, f"job.count ({self.count}) must be at least 1")
        for key in ("step_s", "checkpoint_interval_s"):
            positive(f"job.{key}", getattr(self, key))
        require(self.checkpoint_cost_s >= 0, f"job.checkpoint_cost_s ({self.checkpoint_cost_s}) must not be "
                "negative")
        require(self.replicas >= 0, f"job.replicas ({self.replicas}) must not be negative")
        require(self.replicas <= 1 or self.nodes % self.replicas == 0, f"job.nodes ({self.nodes}) must be a "
                f"multiple of job.replicas ({self.replicas})")
        require(self.snapshot_every >= 1, f"job.snapshot_every ({self.snapshot_every}) must be at least 1")
        require(0 <= self.snapshot_overhead < 1, f"job.snapshot_overhead ({self.snapshot_overhead}) must be in "
                "[0, 1)")


@dataclass(frozen=True)
class TimingConfig:
    gpu_fault_detect_s: float = setting(1.0, "from a GPU fault to the verdict (the XID reaches the controller at "
                                        "once; bench: 3 ms to drained)")
    node_loss_detect_s: float = setting(3.0, "from a lost node to DOWN (liveness.down_after_s; bench: 2.35 s)")
    crash_detect_s: float = setting(0.5, "from a rank crashing to the controller knowing (the next heartbeat)")
    straggler_detect_s: float = setting(60.0, "from a node turning slow to the straggler verdict (30 steps)")
    stop_s: float = setting(2.0, "from a stop to the node saying the ranks are gone")
    launch_s: float = setting(60.0, "from launch to every rank in its process group (process start and "
                              "init_process_group at scale; NVRx's in-job restart is ~1 min): the first start, and "
                              "a restart on nodes no standby was waiting on (a fresh placement)")
    warm_launch_s: float = setting(40.0, "the same when every node of the restart is one the job held (its nodes "
                                   "and spares, where standbys are started and imported ahead); bench: a warm "
                                   "restart is 1.7 s against a cold 2.7 s (-37 %) on 4 ranks, and the process "
                                   "group's set-up at scale stays")
    load_s: float = setting(60.0, "loading a durable checkpoint after a restart")
    snapshot_load_s: float = setting(5.0, "restoring from in-memory snapshots (bench: 1.4 GB/s from a peer)")
    eviction_checkpoint_s: float = setting(5.0, "a checkpoint asked for before an eviction: every rank commits "
                                           "(with snapshots: the next one; bench: 1.1 s on 4 ranks)")
    regroup_s: float = setting(5.0, "replica groups: from the verdict on a group's sudden fault to the other "
                               "groups training without it (the controller takes it out of the quorum at once, "
                               "which forms again at the next step); a predictable fault's group leaves at a step "
                               "boundary and costs none")
    peer_recovery_s: float = setting(60.0, "replica groups: from a rebuilt group's launch to its joining the quorum "
                                     "with the state of a healthy group, sent over the network while that group "
                                     "trains (torchft's live recovery)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            require(getattr(self, f.name) >= 0, f"timings.{f.name} ({getattr(self, f.name)}) must not be negative")


@dataclass(frozen=True)
class PolicyConfig:
    predictive_eviction: bool = setting(True, "act on warnings (health FAILING): checkpoint, then evict, before "
                                        "the fault")
    evict_stragglers: bool = setting(True, "act on straggler verdicts (checkpoint, then evict)")
    warm_starts: bool = setting(True, "standbys started and imported ahead on the job's nodes and spares "
                                "(timings.warm_launch_s); false: every launch costs timings.launch_s")
    max_restarts: int = setting(RecoveryConfig().max_restarts, "recovery.max_restarts of the controller")
    restart_window_s: float = setting(RecoveryConfig().restart_window_s, "recovery.restart_window_s of the "
                                      "controller")
    restart_backoff_s: float = setting(RecoveryConfig().restart_backoff_s, "recovery.restart_backoff_s of the "
                                       "controller")
    keep_spares: bool = setting(JobsConfig().keep_spares, "jobs.keep_spares of the controller")

    def recovery(self) -> RecoveryConfig:
        return RecoveryConfig(max_restarts=self.max_restarts, restart_window_s=self.restart_window_s,
                              restart_backoff_s=self.restart_backoff_s)

    def jobs(self) -> JobsConfig:
        return JobsConfig(keep_spares=self.keep_spares)

    def __post_init__(self) -> None:
        try:
            self.recovery()
        except ConfigError as e:
            raise ConfigError(f"policy: {e}") from None


@dataclass(frozen=True)
class RunConfig:
    days: float = setting(30.0, "simulated days")
    seed: int = setting(1, "random seed: the same seed, the same run")

    def __post_init__(self) -> None:
        positive("run.days", self.days)


@dataclass(frozen=True)
class ReplayConfig:
    events: str = setting("", "a real controller's event log (`phalanx events --json`) whose faults replace the "
                          "drawn ones: XIDs, verdicts, lost nodes, crashes, hangs and stragglers at their times; a "
                          "path relative to the scenario file")
    repeat: bool = setting(False, "play the log again from the start each time it ends, until run.days")


@dataclass(frozen=True)
class Scenario:
    fleet: FleetConfig = section(FleetConfig, "the nodes and their network")
    failures: FailureConfig = section(FailureConfig, "how the fleet fails")
    job: JobConfig = section(JobConfig, "the jobs")
    timings: TimingConfig = section(TimingConfig, "recovery timings")
    policy: PolicyConfig = section(PolicyConfig, "Phalanx's policy knobs")
    run: RunConfig = section(RunConfig, "the run")
    replay: ReplayConfig = section(ReplayConfig, "a failure trace from a real event log")
    jobs: tuple[JobConfig, ...] = dataclasses.field(default=(), metadata={
        "doc": "several job shapes ([[jobs]] tables, each with [job]'s keys; what one leaves out comes from [job]); "
               "none: [job] alone"})

    @property
    def shapes(self) -> tuple[JobConfig, ...]:
        return self.jobs or (self.job,)

    def check_fit(self, fleet_nodes: int) -> None:
        """Every job with its spares fits in the fleet at once. Raises ConfigError naming the keys."""
        need = sum((j.nodes + j.spares) * j.count for j in self.shapes)
        if self.jobs:
            require(need <= fleet_nodes, f"the [[jobs]] need {need} nodes with their spares; the fleet has "
                    f"{fleet_nodes}")
        else:
            require(need <= fleet_nodes, f"job.count ({self.job.count}) x (job.nodes ({self.job.nodes}) + "
                    f"job.spares ({self.job.spares})) = {need} must fit in fleet.nodes ({fleet_nodes})")


# The baseline the README compares with: periodic durable checkpoints only, no spares, no prediction.
BASELINE = {"job.spares": 0, "job.snapshots": False, "policy.predictive_eviction": False,
            "policy.evict_stragglers": False, "policy.warm_starts": False}


def parse_value(text: str) -> Any:
    """A --sweep value as TOML reads it (1, 2.5, true, "x"); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def with_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`data` (a parsed scenario) with dotted keys set: {"job.spares": 2}."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, value in overrides.items():
        head, dot, tail = key.partition(".")
        if not dot or not tail or "." in tail:
            raise ConfigError(f"{key}: a key is SECTION.NAME, e.g. job.spares")
        table = out.setdefault(head, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{head} must be a table ([{head}]), not a value")
        table[tail] = value
    return out


def read(path: str | Path | None) -> dict[str, Any]:
    """The scenario file's table (empty for None: every default), with replay.events made relative to the file.
    Raises ConfigError."""
    if path is None:
        return {}
    data = config.read_toml(path)
    for table, key in (("replay", "events"), ("fleet", "topology_conf")):
        part = data.get(table)
        if isinstance(part, dict) and isinstance(part.get(key), str) and part[key]:
            part[key] = str(Path(path).parent / Path(part[key]).expanduser())
    return data


def build(data: dict[str, Any], source: str = "") -> Scenario:
    try:
        data = dict(data)
        shapes = data.pop("jobs", None)
        scenario = config.build(Scenario, data)
        if shapes is not None:
            scenario = dataclasses.replace(scenario, jobs=_shapes(shapes, data.get("job", {})))
        if not scenario.fleet.topology_conf:  # else the simulation checks it, once it has read the file
            scenario.check_fit(scenario.fleet.nodes)
        return scenario
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def _shapes(tables: Any, defaults: Any) -> tuple[JobConfig, ...]:
    """[[jobs]] tables as JobConfigs, each on top of [job]."""
    if not isinstance(tables, list) or not tables:
        raise ConfigError("jobs must be an array of tables ([[jobs]]), each a job shape")
    shapes: list[JobConfig] = []
    for i, table in enumerate(tables, 1):
        if not isinstance(table, dict):
            raise ConfigError(f"jobs[{i}] must be a table ([[jobs]]), not {type(table).__name__}")
        try:
            shape = config.build(JobConfig, {**defaults, **table}, prefix=f"jobs[{i}].")
        except ConfigError as e:  # the checks of JobConfig name [job]'s keys
            raise ConfigError(str(e).replace("job.", f"jobs[{i}].")) from None
        taken = next((k for k, other in enumerate(shapes, 1) if shape.name and other.name == shape.name), None)
        require(taken is None, f"jobs[{i}].name ({shape.name!r}) is the name of jobs[{taken}] too")
        shapes.append(shape)
    return tuple(shapes)
