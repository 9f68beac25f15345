"""Agent configuration (`phalanx-agent --config FILE`). Every key has a default."""

from __future__ import annotations

import grp
import socket
from dataclasses import dataclass

from phalanx import config
from phalanx.config import MetricsAccessConfig, comma_list, host_port, positive, require, section, setting
from phalanx.errors import ConfigError
from phalanx.log import LEVELS
from phalanx.names import NAME

_NODE_NAME = NAME


@dataclass(frozen=True)
class GpuConfig:
    backend: str = setting("auto", "auto (NVML if a driver is present, else no GPUs), nvml, or sim",
                           choices=("auto", "nvml", "sim"))
    sim_count: int = setting(8, "number of simulated GPUs when backend = sim")

    def __post_init__(self) -> None:
        require(0 <= self.sim_count <= 64, f"gpu.sim_count ({self.sim_count}) must be between 0 and 64")


@dataclass(frozen=True)
class ReconnectConfig:
    initial_backoff_s: float = setting(0.2, "first wait before reconnecting to the controller")
    max_backoff_s: float = setting(5.0, "longest wait between reconnect attempts (jittered)")

    def __post_init__(self) -> None:
        positive("reconnect.initial_backoff_s", self.initial_backoff_s)
        require(self.max_backoff_s >= self.initial_backoff_s,
                f"reconnect.max_backoff_s ({self.max_backoff_s}) must not be smaller than "
                f"reconnect.initial_backoff_s ({self.initial_backoff_s})")


@dataclass(frozen=True)
class SecurityConfig:
    insecure: bool = setting(False, "plaintext gRPC to the controller: only for a trial on loopback (`phalanx "
                             "local up` sets it); otherwise mutual TLS with the files below")
    ca_file: str = setting("/etc/phalanx/pki/ca.crt", "the cluster CA that signed the controller's certificate")
    cert_file: str = setting("/etc/phalanx/pki/node.crt", "this node's certificate (`phalanx certs issue NODE`); "
                             "its name must be this node's name")
    key_file: str = setting("/etc/phalanx/pki/node.key", "this node's private key (mode 0600)")
    server_name: str = setting("", "the name to expect in the controller's certificate instead of the one every "
                               "controller certificate carries (controller.phalanx.invalid), which is how the agent "
                               "knows a controller from a node: only for a controller certificate made before "
                               "they did (set it to a host name in that certificate until it is issued again)")
    socket_group: str = setting("", "group allowed to use the trainlib and NVRx sockets (mode 0660), e.g. the "
                                "group the ranks run as; empty = the agent's own group")
    renew: bool = setting(True, "renew this node's certificate two thirds into its validity, from the controller "
                          "(which needs [security] ca_key_file), writing cert_file and key_file anew; false: "
                          "renewal is someone else's business (an external CA's agent)")
    rank_accounts: str = setting("*", "the accounts this node runs ranks as when the controller names one: * = any "
                                 "that exists here (root only with root_ranks); a comma-separated list = those only. "
                                 "This node's own policy, whatever the controller's access file says")
    root_ranks: bool = setting(False, "run ranks as root when the controller names the account root (an access "
                               "file's allow_root); false = refused here, whatever the controller says")
    agent_user_ranks: bool = setting(True, "run ranks of jobs that name no account as the agent's own user (a "
                                     "cluster without an access file); false on a multi-tenant node: every job "
                                     "must run as an account")

    def __post_init__(self) -> None:
        if not comma_list(self.rank_accounts):
            raise ConfigError("security.rank_accounts is empty: give * (any account) or the accounts' names, "
                              "comma-separated")
        if self.socket_group:
            try:
                grp.getgrnam(self.socket_group)
            except KeyError:
                raise ConfigError(f"security.socket_group ({self.socket_group!r}) is not a group on this host") \
                    from None


@dataclass(frozen=True)
class AgentConfig:
    node_name: str = setting("", "this node's name in the cluster (default: the short hostname)")
    controller: str = setting("127.0.0.1:7370", "host:port of the controller; for a highly available control plane, "
                              "every controller's, comma-separated (the agent follows the leader)")
    session_port: int = setting(0, "the controllers' session port (their session_listen, e.g. 7374; the same port on "
                                "every controller's host): the session (heartbeats, commands) goes there, in frames on "
                                "the same mutual TLS, at about half of gRPC's controller CPU per heartbeat; "
                                "registration stays on `controller`. 0 = the session over gRPC, the default")
    state_dir: str = setting("/var/lib/phalanx/agent", "where the agent keeps its own state")
    checkpoint_dir: str = setting("/var/lib/phalanx/checkpoints", "checkpoint directory given to ranks; its "
                                  "free space is reported")
    log_level: str = setting("info", "debug, info, warning or error", choices=LEVELS)
    log_format: str = setting("json", "json (one object per line) or console", choices=("json", "console"))
    gpu: GpuConfig = section(GpuConfig, "GPU backend")
    reconnect: ReconnectConfig = section(ReconnectConfig, "reconnecting to the controller")
    advertise_address: str = setting("", "address other nodes reach this node's ranks at (MASTER_ADDR); empty = "
                                     "the address it connects to the controller from")
    stop_grace_s: float = setting(30.0, "seconds between SIGTERM and SIGKILL when ranks are stopped")
    sysfs_root: str = setting("/sys", "where sysfs is mounted (topology is read from it)")
    nvrx_socket: str = setting("/run/phalanx/nvhcd.sock", "Unix socket serving NVRx's node health check "
                               "(nvhcd.HealthCheckService); empty = off")
    metrics_listen: str = setting("", "host:port serving Prometheus metrics (this node's GPUs under dcgm-exporter's "
                                  "names) at /metrics, e.g. 0.0.0.0:7372 (plain HTTP and no authentication unless "
                                  "[metrics] says otherwise); empty = off, the default, as for the controller")
    labels: dict[str, str] = setting({}, "free-form labels reported to the controller (rack, switch, block)")
    snapshot_dir: str = setting("/dev/shm/phalanx", "tmpfs directory holding ranks' in-memory snapshots and peers' "
                                "replicas (a subdirectory per node name); empty = no snapshots on this node")
    snapshot_budget_mb: int = setting(0, "host memory the node's snapshots may take, its ranks' and peers' replicas "
                                      "together; 0 = a quarter of the node's memory")
    snapshot_listen: str = setting("", "host:port serving snapshot replicas to peer agents, over mutual TLS with "
                                   "this node's certificate (plain gRPC with security.insecure); empty = every "
                                   "address (insecure: the advertise address, else 127.0.0.1), on a free port")
    snapshot_bulk_port: int = setting(0, "TCP port on the host of snapshot_listen that peers restoring a rank read "
                                      "snapshots from, faster than gRPC (mutual TLS as the service; a one-time "
                                      "ticket from the service); 0 = a free port, -1 = none (restores stream over "
                                      "gRPC)")
    rank_log_max_mb: int = setting(1024, "a running rank's log is cut past this size (its last eighth kept in "
                                   ".log.1): one job's output cannot fill the state disk every job shares; 0 = "
                                   "never cut")
    ended_logs_max_mb: int = setting(10240, "the rank logs of jobs that ended on this node (10 minutes after their "
                                     "ranks' exit) are deleted, oldest job first, past this much in all, and so are "
                                     "their NCCL flight-recorder dumps (a budget of the same size); 0 = never "
                                     "deleted")
    park_hold_s: float = setting(60.0, "a rank that trainlib.run parked after its generation ended (it survived a "
                                 "restart in its own process) waits this long for the next generation to be launched "
                                 "here with its rank, then exits")
    snapshot_idle_s: float = setting(600.0, "a job's in-memory snapshots here are dropped (their memory given back) "
                                     "once they have not changed this long and no rank of the job runs here")
    warm_quiet_s: float = setting(3.0, "no warm standby starts within this long of a launch on this node (a launch's "
                                  "ranks get the CPU first)")
    warm_start: bool = setting(True, "keep each job's Python ranks started and imported ahead (as many as it runs "
                               "here, or the controller asks a spare for), so a restart skips starting Python and "
                               "importing torch; a job opts out with PHALANX_WARM_START=0 in its environment")
    cgroup_parent: str = setting("phalanx", "the cgroup under which every rank gets one of its own (in the v2 "
                                 "hierarchy with the memory and pids controllers, else in v1's memory and pids): "
                                 "it enforces a job's --memory and --tasks, and lets the agent kill all a rank "
                                 "started; empty = off (jobs with those limits are then refused here)")
    cgroup_root: str = setting("/sys/fs/cgroup", "where the cgroup hierarchies are mounted")
    security: SecurityConfig = section(SecurityConfig, "mutual TLS to the controller; access to the node's sockets")
    metrics: MetricsAccessConfig = section(MetricsAccessConfig, "who may scrape metrics_listen, and over what")

    def controllers(self) -> list[str]:
        return comma_list(self.controller)

    def __post_init__(self) -> None:
        if self.node_name:
            require(bool(_NODE_NAME.fullmatch(self.node_name)),
                    f"node_name ({self.node_name!r}) must be 1-63 letters, digits, '.', '_' or '-', "
                    "starting with a letter or digit")
        require(bool(self.controllers()), "controller is empty; give the controller's host:port, e.g. 10.0.0.1:7370")
        for address in self.controllers():
            host, sep, port = address.rpartition(":")
            require(bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536,
                    f"controller ({address!r}) must be host:port, e.g. 10.0.0.1:7370")
        require(0 <= self.session_port < 65536, f"session_port ({self.session_port}) must be a port (1-65535), "
                "or 0 for the session over gRPC")
        require(len(self.labels) <= 64, f"labels has {len(self.labels)} entries; the limit is 64")
        require(self.stop_grace_s >= 0, f"stop_grace_s ({self.stop_grace_s}) must not be negative")
        if self.metrics_listen:
            host_port("metrics_listen", self.metrics_listen, "0.0.0.0:7372")
        if self.snapshot_listen:
            host_port("snapshot_listen", self.snapshot_listen, "10.0.0.5:7373")
        require(-1 <= self.snapshot_bulk_port < 65536, f"snapshot_bulk_port ({self.snapshot_bulk_port}) must be a "
                "port (1-65535), 0 for a free one or -1 for none")
        if self.cgroup_parent:
            require(bool(_NODE_NAME.fullmatch(self.cgroup_parent.strip("/").replace("/", "-"))),
                    f"cgroup_parent ({self.cgroup_parent!r}) must be a relative cgroup path of letters, digits, "
                    "'.', '_', '-' and '/', e.g. phalanx")
        require(self.snapshot_budget_mb >= 0, f"snapshot_budget_mb ({self.snapshot_budget_mb}) must not be negative")
        for key in ("park_hold_s", "snapshot_idle_s", "warm_quiet_s"):
            require(getattr(self, key) >= 0, f"{key} ({getattr(self, key)}) must not be negative")
        require(self.ended_logs_max_mb >= 0, f"ended_logs_max_mb ({self.ended_logs_max_mb}) must not be negative "
                "(0 = never deleted)")

    @property
    def name(self) -> str:
        return self.node_name or default_node_name()


def default_node_name() -> str:
    short = socket.gethostname().split(".")[0]
    return short if _NODE_NAME.fullmatch(short) else "node"


def load(path: str | None) -> AgentConfig:
    return config.load(AgentConfig, path)
