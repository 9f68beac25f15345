"""Controller configuration (`phalanx-controller --config FILE`). Every key has a default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from phalanx import config
from phalanx.config import MetricsAccessConfig, comma_list, host_port, positive, require, section, setting
from phalanx.log import LEVELS


@dataclass(frozen=True)
class LivenessConfig:
    heartbeat_interval_s: float = setting(1.0, "seconds between an agent's heartbeats (the controller tells agents)")
    suspect_after_s: float = setting(2.0, "seconds of silence after which a node is SUSPECT")
    down_after_s: float = setting(3.0, "seconds of silence after which a node is DOWN")
    tick_s: float = setting(0.1, "seconds between liveness sweeps")

    def __post_init__(self) -> None:
        for key in ("heartbeat_interval_s", "suspect_after_s", "down_after_s", "tick_s"):
            positive(f"liveness.{key}", getattr(self, key))
        require(
            self.suspect_after_s > self.heartbeat_interval_s,
            f"liveness.suspect_after_s ({self.suspect_after_s}) must be larger than "
            f"liveness.heartbeat_interval_s ({self.heartbeat_interval_s})",
        )
        require(
            self.down_after_s > self.suspect_after_s,
            f"liveness.down_after_s ({self.down_after_s}) must be larger than "
            f"liveness.suspect_after_s ({self.suspect_after_s})",
        )
        require(
            self.tick_s <= self.heartbeat_interval_s,
            f"liveness.tick_s ({self.tick_s}) must not be larger than "
            f"liveness.heartbeat_interval_s ({self.heartbeat_interval_s})",
        )


@dataclass(frozen=True)
class HealthConfig:
    window_s: float = setting(60.0, "seconds of history for rates and recent XIDs")
    ecc_sbe_degraded_per_min: float = setting(10.0, "corrected ECC errors per minute that make a GPU DEGRADED")
    ecc_sbe_failing_per_min: float = setting(600.0, "corrected ECC errors per minute that make a GPU FAILING")
    pcie_replay_degraded_per_min: float = setting(60.0, "PCIe replays per minute that make a GPU DEGRADED")
    nvlink_errors_degraded_per_min: float = setting(60.0, "NVLink errors per minute that make a GPU DEGRADED")
    nvlink_errors_failing_per_min: float = setting(6000.0, "NVLink errors per minute that make a GPU FAILING")
    remap_pending: str = setting("FAILING", "verdict for a pending row remap: FAILING (checkpoint, evict, reset) "
                                 "or DEGRADED (watch)", choices=("FAILING", "DEGRADED"))
    application_xid_repeats: int = setting(3, "application XIDs (13, 31, 43, 45, 68) in the window that make a "
                                           "GPU DEGRADED")
    checkpoint_free_min_gib: float = setting(10.0, "free GiB in the checkpoint directory below which a node is "
                                             "DEGRADED")

    def __post_init__(self) -> None:
        positive("health.window_s", self.window_s)
        require(self.ecc_sbe_failing_per_min > self.ecc_sbe_degraded_per_min,
                f"health.ecc_sbe_failing_per_min ({self.ecc_sbe_failing_per_min}) must be larger than "
                f"health.ecc_sbe_degraded_per_min ({self.ecc_sbe_degraded_per_min})")
        require(self.nvlink_errors_failing_per_min > self.nvlink_errors_degraded_per_min,
                f"health.nvlink_errors_failing_per_min ({self.nvlink_errors_failing_per_min}) must be larger than "
                f"health.nvlink_errors_degraded_per_min ({self.nvlink_errors_degraded_per_min})")
        require(self.application_xid_repeats >= 1,
                f"health.application_xid_repeats ({self.application_xid_repeats}) must be at least 1")


@dataclass(frozen=True)
class JobsConfig:
    topology_conf: str = setting("", "Slurm topology.conf (tree or block syntax) describing the network; empty = "
                                 "agents' labels (switch, spine, block), else one domain")
    schedule_interval_s: float = setting(0.5, "seconds between scheduler passes (it also runs on every change; a "
                                         "pass whose views and decisions took 50 ms of CPU or more, over a job of "
                                         "thousands of nodes, is followed by as long a rest, at most 1 s, so that the "
                                         "heartbeats are read meanwhile)")
    launch_timeout_s: float = setting(30.0, "seconds an agent has to start its ranks")
    fence_repeat_s: float = setting(10.0, "a node still running a generation that is no longer current "
                                   "(a fenced one, after a partition) is told to stop it again after this long")
    missing_reports_lost: int = setting(5, "heartbeats in a row from a rank's node without news of the rank before "
                                        "the rank counts as lost")
    stop_grace_s: float = setting(30.0, "seconds between SIGTERM and SIGKILL when a job's ranks are stopped")
    keep_spares: bool = setting(True, "a running job short of spares (restarts used them) holds free healthy nodes "
                                "again, on its own leaf switches first")
    slurm_drain: bool = setting(True, "a node evicted from a job that runs in a Slurm allocation (`phalanx run`) is "
                                "drained in Slurm too (`scontrol update ... State=DRAIN Reason=\"phalanx: ...\"`), "
                                "so Slurm schedules nothing more on it")
    scontrol: str = setting("scontrol", "the scontrol command the controller drains nodes with (its host needs "
                            "Slurm's config and munge key, as an admin host has)")
    slurm_watch_s: float = setting(15.0, "seconds between checks (`scontrol show job`) that the Slurm job of each "
                                   "running `phalanx run` job still holds its allocation; 0 = no checks")
    slurm_orphan_s: float = setting(60.0, "a job whose Slurm job has ended for this long (its `phalanx run` was "
                                    "killed, say) is cancelled: its ranks must not run on nodes Slurm gave back; "
                                    "longer than Slurm's KillWait, so a `phalanx run` ending the job itself is "
                                    "not cut short")
    max_active_per_user: int = setting(1000, "jobs one user may have that have not ended (pending, running, "
                                       "recovering); a submission past it is refused: one user cannot fill the "
                                       "store or the scheduler for everyone")
    ended_kept: int = setting(1000, "records of ended jobs kept in the store (`phalanx jobs`, `phalanx job`); the "
                              "oldest beyond it are deleted (`job.forgotten`), their events stay in the event log")
    ended_kept_s: float = setting(30 * 86400.0, "seconds an ended job's record is kept after it ended; 0 = no age "
                                  "limit (ended_kept still applies)")

    def __post_init__(self) -> None:
        positive("jobs.schedule_interval_s", self.schedule_interval_s)
        require(self.max_active_per_user >= 1,
                f"jobs.max_active_per_user ({self.max_active_per_user}) must be at least 1")
        require(self.ended_kept >= 0, f"jobs.ended_kept ({self.ended_kept}) must not be negative")
        require(self.ended_kept_s >= 0, f"jobs.ended_kept_s ({self.ended_kept_s}) must not be negative (0 = no age "
                "limit)")
        positive("jobs.launch_timeout_s", self.launch_timeout_s)
        positive("jobs.fence_repeat_s", self.fence_repeat_s)
        require(self.missing_reports_lost >= 1,
                f"jobs.missing_reports_lost ({self.missing_reports_lost}) must be at least 1")
        require(self.stop_grace_s >= 0, f"jobs.stop_grace_s ({self.stop_grace_s}) must not be negative")
        require(self.slurm_watch_s >= 0, f"jobs.slurm_watch_s ({self.slurm_watch_s}) must not be negative (0 = off)")
        require(self.slurm_orphan_s >= 0, f"jobs.slurm_orphan_s ({self.slurm_orphan_s}) must not be negative")


@dataclass(frozen=True)
class RecoveryConfig:
    max_restarts: int = setting(3, "restarts in place of a job in a row before it is declared FAILED (restarts with "
                                "less than restart_window_s of running between them; a restart that replaces a bad "
                                "node does not count)")
    restart_backoff_s: float = setting(1.0, "wait before the first restart in place, doubled for each later one in a "
                                       "row (a restart that replaces a bad node does not wait)")
    restart_window_s: float = setting(600.0, "a job that ran this long since its last restart starts counting "
                                      "restarts (and backoff) from zero again: a months-long job outlives many "
                                      "hardware faults")
    checkpoint_deadline_s: float = setting(30.0, "seconds ranks have to commit a checkpoint before an eviction")
    checkpoint_lead_s: float = setting(1.0, "how far ahead of a request, in seconds of steps at the ranks' pace, the "
                                       "agreed checkpoint step lies (time for the pushed request to reach every rank)")
    pace_wait_s: float = setting(3.0, "how long a checkpoint request soon after a (re)start waits for a progress "
                                 "report past the ranks' start-up (a job whose trainlib reported before: up to "
                                 "half the request's deadline, if longer)")
    evict_margin_s: float = setting(10.0, "seconds beyond jobs.stop_grace_s an eviction waits for every node to "
                                    "confirm its ranks stopped (then they are fenced when reported)")
    silent_s: float = setting(2.0, "seconds without a trainlib report that make a hung rank the culprit (trainlib "
                              "reports twice a second; at most hang_min_s, or a hang is judged before its culprit "
                              "can be)")
    hang_min_s: float = setting(2.0, "a rank without step progress this long (at least) is hung (not while a rank "
                                "of the job writes a checkpoint, nor in a generation's first 10 steps)")
    hang_factor: float = setting(3.0, "... or this many times the job's typical step time (90th percentile of "
                                 "recent ones), if longer")
    exit_grace_s: float = setting(120.0, "once training has ended in a rank (trainlib says so at "
                                  "destroy_process_group and at exit, or the rank exited 0), how long every rank of "
                                  "the job has to exit (a final save, the teardown); no hang or straggler verdict "
                                  "meanwhile. A rank still running then is stopped: the job SUCCEEDED if every rank "
                                  "had finished training, else FAILED")
    evicted_wait_s: float = setting(1800.0, "a job that waits for nodes because those its own recovery evicted stay "
                                    "drained (and no others are free) fails after waiting this long, saying so, "
                                    "rather than waiting without end")
    startup_s: float = setting(180.0, "seconds a rank may take to its first step before it counts as hung")
    straggler_ratio: float = setting(1.05, "compute time against the other ranks' median counted as slow (a "
                                     "10% slower rank is found; healthy noise is not; the verdict also needs the "
                                     "rank to cost the job about straggler_cost of its step time)")
    straggler_min_delta_s: float = setting(0.002, "... and at least this many seconds slower per step (a ratio "
                                           "of tiny computes is noise; straggler_cost needs no such floor)")
    straggler_window: int = setting(30, "steps a straggler verdict looks at")
    straggler_min_samples: int = setting(10, "steps per rank needed before any straggler verdict")
    straggler_share: float = setting(0.6, "share of the window's steps that must be slow")
    straggler_cost: float = setting(0.10, "... or: share of the job's step time a rank's compute costs it (its "
                                    "pace less the other ranks', in every third of the window), e.g. when it is "
                                    "slow in bursts or the steps are short")
    straggler_max_evictions: int = setting(2, "straggler evictions of one job within straggler_evictions_window_s; "
                                           "a verdict beyond the bound is held back (an event says so)")
    straggler_evictions_window_s: float = setting(3600.0, "the window of straggler_max_evictions, in seconds")
    straggler_gain: float = setting(0.05, "how much faster (share of step time) the job must have become after a "
                                    "straggler eviction before another straggler verdict is acted on")

    def __post_init__(self) -> None:
        require(self.max_restarts >= 0, f"recovery.max_restarts ({self.max_restarts}) must not be negative")
        for key in ("restart_backoff_s", "restart_window_s", "checkpoint_deadline_s", "hang_min_s", "hang_factor",
                    "startup_s", "checkpoint_lead_s", "pace_wait_s", "evict_margin_s", "silent_s", "exit_grace_s",
                    "evicted_wait_s"):
            positive(f"recovery.{key}", getattr(self, key))
        require(self.straggler_ratio > 1.0, f"recovery.straggler_ratio ({self.straggler_ratio}) must be above 1")
        require(1 <= self.straggler_min_samples <= self.straggler_window,
                f"recovery.straggler_min_samples ({self.straggler_min_samples}) must be between 1 and "
                f"recovery.straggler_window ({self.straggler_window})")
        require(0 < self.straggler_share <= 1, f"recovery.straggler_share ({self.straggler_share}) must be in (0, 1]")
        require(0 < self.straggler_cost < 1, f"recovery.straggler_cost ({self.straggler_cost}) must be in (0, 1)")
        require(self.straggler_window >= 6, f"recovery.straggler_window ({self.straggler_window}) must be at least 6: "
                "straggler_cost splits it in thirds and leaves out each third's slowest step")
        require(self.silent_s <= self.hang_min_s,
                f"recovery.silent_s ({self.silent_s}) must not be larger than recovery.hang_min_s ({self.hang_min_s}): "
                "a hang would be judged before its culprit could be named")
        require(self.straggler_max_evictions >= 0,
                f"recovery.straggler_max_evictions ({self.straggler_max_evictions}) must not be negative")
        positive("recovery.straggler_evictions_window_s", self.straggler_evictions_window_s)
        require(0 <= self.straggler_gain < 1, f"recovery.straggler_gain ({self.straggler_gain}) must be in [0, 1)")


@dataclass(frozen=True)
class ReplicasConfig:
    lighthouse: bool = setting(True, "run a lighthouse (the replica groups' quorum: torchft's service, served by "
                               "Phalanx) for each job submitted with --replicas, as a process of its own on this "
                               "host; its ranks are told TORCHFT_LIGHTHOUSE (torchft is needed on the nodes, not "
                               "here)")
    lighthouse_host: str = setting("", "the address the nodes reach this controller's lighthouses at (default: "
                                   "store.advertise's host, else listen's, else this host's name). A lighthouse "
                                   "outlives its controller, and the next leader takes it up by its control port, "
                                   "at the address of the host it runs on; one that is gone (its host lost) is "
                                   "started again by the leader, at the leader's own lighthouse_host, and each "
                                   "node's agent relays the ranks there")
    orphan_grace_s: float = setting(600.0, "how long a lighthouse whose controller is gone serves on without one, "
                                    "for the controller that restarts, or takes over, to take it up; then it ends")
    lighthouse_bind: str = setting("0.0.0.0", "the interface the lighthouses listen on, each on a port of its own "
                                   "and a control port (torchft's service has no authentication; the control port "
                                   "takes a token: docs/concepts/threat-model.md)")
    heartbeat_timeout_ms: int = setting(1000, "torchft's: a group whose heartbeats stop this long leaves the quorum. "
                                        "A group the controller has judged leaves at once (the lighthouse is told), "
                                        "so this counts only where that word is lost, or where the group's "
                                        "replica_id does not end in its REPLICA_GROUP_ID (torchft's default 5000)")
    join_timeout_ms: int = setting(1000, "torchft's: how long a quorum waits for more groups to join")
    quorum_tick_ms: int = setting(100, "torchft's: how often the lighthouse looks at its quorum")

    def __post_init__(self) -> None:
        for key in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
            require(getattr(self, key) >= 1, f"replicas.{key} ({getattr(self, key)}) must be at least 1")
        require(self.orphan_grace_s > 0, f"replicas.orphan_grace_s ({self.orphan_grace_s}) must be positive")


@dataclass(frozen=True)
class SecurityConfig:
    insecure: bool = setting(False, "plaintext gRPC with no authentication at all: only for a trial on loopback "
                             "(`phalanx local up` sets it); otherwise mutual TLS with the files below")
    ca_file: str = setting("/etc/phalanx/pki/ca.crt", "the cluster CA (`phalanx certs init`); every agent and "
                           "client certificate must be signed by it")
    cert_file: str = setting("/etc/phalanx/pki/controller.crt", "the controller's certificate (`phalanx certs "
                             "issue controller --role controller --san HOST`)")
    key_file: str = setting("/etc/phalanx/pki/controller.key", "the controller's private key (mode 0600; 0640 "
                            "with group phalanx for the unit, which runs as that user)")
    tokens_file: str = setting("", "file of 'NAME TOKEN' lines; a token may stand in for a client certificate on "
                               "the control API and rendezvous, on token_listen; empty = no tokens")
    token_listen: str = setting("", "host:port of a second, TLS-only port (no client certificate asked) for "
                                "clients with a token and for nodes that enrol themselves; empty = off. Agents "
                                "can never register there")
    ca_key_file: str = setting("", "the cluster CA's private key (`phalanx certs init`'s ca.key): lets the "
                               "controller sign certificates for nodes that enrol themselves with a bootstrap "
                               "token (`phalanx certs token create`, on token_listen); empty = no enrolment")
    enrol_days: int = setting(365, "validity of the certificates nodes get by enrolling")
    access_file: str = setting("", "who may do what and run jobs as whom: [identities.NAME] tables with role "
                               "(admin, user, viewer), accounts and allow_root (README, \"Users, roles and "
                               "accounts\"); empty = every authenticated client is an admin and ranks run as the "
                               "agent's user")

    def __post_init__(self) -> None:
        require(not self.token_listen or bool(self.tokens_file) or bool(self.ca_key_file),
                "security.token_listen is set but neither security.tokens_file nor security.ca_key_file: a token "
                "port serves tokens or enrolment")
        require(1 <= self.enrol_days <= 825, f"security.enrol_days ({self.enrol_days}) must be from 1 to 825")
        require(not (self.token_listen and self.insecure),
                "security.token_listen needs TLS; it cannot be used with security.insecure = true")
        if self.token_listen:
            host_port("security.token_listen", self.token_listen, "0.0.0.0:7373")


@dataclass(frozen=True)
class StoreConfig:
    backend: str = setting("sqlite", "sqlite: one controller, its state in `state_db`; etcd: a highly available "
                           "control plane, state in etcd and a leader elected among the controllers",
                           choices=("sqlite", "etcd"))
    etcd_endpoints: str = setting("127.0.0.1:2379", "comma-separated host:port of the etcd members (the v3 API)")
    etcd_prefix: str = setting("/phalanx/", "key prefix of this cluster's records in etcd")
    etcd_tls: bool = setting(True, "mutual TLS to etcd: with etcd_ca_file, etcd_cert_file and etcd_key_file, else "
                             "security.ca_file, cert_file and key_file; false = plaintext, only for etcd on loopback")
    etcd_ca_file: str = setting("", "the CA etcd trusts, one of its own that only controllers and etcd members hold "
                                "(`phalanx certs init --dir /etc/phalanx/etcd-pki`): with the cluster CA, every node's "
                                "and user's certificate could read and write etcd. Empty = security.ca_file (warned)")
    etcd_cert_file: str = setting("", "this controller's client certificate for etcd, from etcd_ca_file's CA")
    etcd_key_file: str = setting("", "its key")
    etcd_timeout_s: float = setting(2.0, "deadline of one etcd request")
    etcd_max_txn_ops: int = setting(128, "etcd's --max-txn-ops: commits with more records are split into "
                                    "transactions of this size")
    lease_ttl_s: int = setting(2, "seconds of the leader's etcd lease: a dead leader is replaced this long after "
                               "its last renewal (2 to 60: etcd's minimum is about 2, and agents take older "
                               "epochs for a reset after a minute)")
    name: str = setting("", "this controller's name among the members (default: the host name)")
    advertise: str = setting("", "host:port clients and agents reach this controller at, told to them by "
                             "standbys (default: the host name and the port of `listen`)")
    takeover_grace_s: float = setting(5.0, "seconds a new leader adds to every node's reconnect window at a "
                                      "takeover (agents first notice the old leader is gone)")
    probe_leader: bool = setting(True, "standbys hold a TCP connection to the leader's port: when it closes and the "
                                 "port then refuses connections (the leader's process is gone), they revoke its "
                                 "lease instead of waiting out lease_ttl_s")

    def __post_init__(self) -> None:
        given = [bool(f) for f in (self.etcd_ca_file, self.etcd_cert_file, self.etcd_key_file)]
        require(all(given) or not any(given), "store.etcd_ca_file, etcd_cert_file and etcd_key_file go together: "
                "give all three (etcd's own CA and this controller's certificate from it), or none")
        if self.backend == "etcd":
            require(bool(endpoints(self.etcd_endpoints)), "store.etcd_endpoints is empty")
            for e in endpoints(self.etcd_endpoints):
                host_port("store.etcd_endpoints", e, "10.0.0.1:2379")
            if self.advertise:
                host_port("store.advertise", self.advertise, "ctl1.example:7370")
        require(2 <= self.lease_ttl_s <= 60, f"store.lease_ttl_s ({self.lease_ttl_s}) must be from 2 (etcd refuses "
                "shorter leases) to 60 (a deposed leader must learn it well within the minute after which agents "
                "take older epochs for a reset)")
        positive("store.etcd_timeout_s", self.etcd_timeout_s)
        require(self.etcd_max_txn_ops >= 16, f"store.etcd_max_txn_ops ({self.etcd_max_txn_ops}) must be at least 16")
        require(self.takeover_grace_s >= 0, "store.takeover_grace_s must not be negative")
        require(self.etcd_prefix.startswith("/"), f"store.etcd_prefix ({self.etcd_prefix!r}) must start with /")


def endpoints(text: str) -> list[str]:
    return comma_list(text)


@dataclass(frozen=True)
class ControllerConfig:
    listen: str = setting("0.0.0.0:7370", "host:port the gRPC server listens on (node and control services)")
    state_db: str = setting("/var/lib/phalanx/controller/controller.db", "SQLite database with nodes, drains and "
                            "events (the unit's StateDirectory=phalanx/controller)")
    max_events: int = setting(100_000, "events kept in the log; older ones are pruned")
    log_level: str = setting("info", "debug, info, warning or error", choices=LEVELS)
    log_format: str = setting("json", "json (one object per line) or console", choices=("json", "console"))
    metrics_listen: str = setting("", "host:port serving Prometheus metrics at /metrics, e.g. 0.0.0.0:7371 (plain "
                                  "HTTP and no authentication unless [metrics] says otherwise); empty = off, the "
                                  "default: the operator picks the interface, and no fixed port collides with "
                                  "another daemon")
    metrics: MetricsAccessConfig = section(MetricsAccessConfig, "who may scrape metrics_listen, and over what")
    session_listen: str = setting("", "host:port of the session port, e.g. 0.0.0.0:7374: agents' sessions (heartbeats "
                                  "up, commands down) in frames on the same mutual TLS, at about half of gRPC's "
                                  "controller CPU per heartbeat (10,000 nodes on one core: bench/RESULTS.md); agents "
                                  "with session_port set use it. Empty = off, the default: every session over gRPC "
                                  "on `listen`")
    liveness: LivenessConfig = section(LivenessConfig, "heartbeat cadence and failure detection")
    health: HealthConfig = section(HealthConfig, "GPU and node health policy")
    jobs: JobsConfig = section(JobsConfig, "gang jobs: topology, scheduling, launching")
    recovery: RecoveryConfig = section(RecoveryConfig, "detecting hangs and stragglers; restarting jobs")
    security: SecurityConfig = section(SecurityConfig, "mutual TLS, tokens, and who may call what")
    store: StoreConfig = section(StoreConfig, "where the controller keeps its state; high availability on etcd")
    replicas: ReplicasConfig = section(ReplicasConfig, "replica-group jobs (`phalanx submit --replicas`): torchft's "
                                       "lighthouse")

    RETIRED: ClassVar[dict[str, str]] = {
        "rendezvous": "torchrun rounds are judged by [recovery] as every job is (hang_min_s, hang_factor, "
                      "checkpoint_deadline_s; docs/reference/configuration.md)"}

    def __post_init__(self) -> None:
        host_port("listen", self.listen, "0.0.0.0:7370")
        require(self.max_events >= 1000, f"max_events ({self.max_events}) must be at least 1000")
        if self.metrics_listen:
            host_port("metrics_listen", self.metrics_listen, "0.0.0.0:7371")
        if self.session_listen:
            host_port("session_listen", self.session_listen, "0.0.0.0:7374")


def load(path: str | None) -> ControllerConfig:
    return config.load(ControllerConfig, path)
