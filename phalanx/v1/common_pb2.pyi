from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_UP: _ClassVar[NodeState]
    NODE_STATE_SUSPECT: _ClassVar[NodeState]
    NODE_STATE_DOWN: _ClassVar[NodeState]
    NODE_STATE_DRAINING: _ClassVar[NodeState]
    NODE_STATE_DRAINED: _ClassVar[NodeState]

class GpuBackendKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_BACKEND_KIND_UNSPECIFIED: _ClassVar[GpuBackendKind]
    GPU_BACKEND_KIND_NONE: _ClassVar[GpuBackendKind]
    GPU_BACKEND_KIND_SIM: _ClassVar[GpuBackendKind]
    GPU_BACKEND_KIND_NVML: _ClassVar[GpuBackendKind]

class GpuRecoveryAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_RECOVERY_ACTION_UNSPECIFIED: _ClassVar[GpuRecoveryAction]
    GPU_RECOVERY_ACTION_NONE: _ClassVar[GpuRecoveryAction]
    GPU_RECOVERY_ACTION_GPU_RESET: _ClassVar[GpuRecoveryAction]
    GPU_RECOVERY_ACTION_NODE_REBOOT: _ClassVar[GpuRecoveryAction]
    GPU_RECOVERY_ACTION_DRAIN_P2P: _ClassVar[GpuRecoveryAction]
    GPU_RECOVERY_ACTION_DRAIN_AND_RESET: _ClassVar[GpuRecoveryAction]

class Health(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_UNSPECIFIED: _ClassVar[Health]
    HEALTH_HEALTHY: _ClassVar[Health]
    HEALTH_DEGRADED: _ClassVar[Health]
    HEALTH_FAILING: _ClassVar[Health]
    HEALTH_FAILED: _ClassVar[Health]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_STARTING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_CANCELLING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_CHECKPOINTING: _ClassVar[JobState]
    JOB_STATE_EVICTING: _ClassVar[JobState]
    JOB_STATE_RENDEZVOUS: _ClassVar[JobState]
    JOB_STATE_RESTARTING: _ClassVar[JobState]

class RankState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_STATE_UNSPECIFIED: _ClassVar[RankState]
    RANK_STATE_RUNNING: _ClassVar[RankState]
    RANK_STATE_EXITED: _ClassVar[RankState]
    RANK_STATE_LOST: _ClassVar[RankState]

class ReplicaGroupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_GROUP_STATE_UNSPECIFIED: _ClassVar[ReplicaGroupState]
    REPLICA_GROUP_TRAINING: _ClassVar[ReplicaGroupState]
    REPLICA_GROUP_STOPPING: _ClassVar[ReplicaGroupState]
    REPLICA_GROUP_WAITING: _ClassVar[ReplicaGroupState]
    REPLICA_GROUP_REBUILDING: _ClassVar[ReplicaGroupState]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_UP: NodeState
NODE_STATE_SUSPECT: NodeState
NODE_STATE_DOWN: NodeState
NODE_STATE_DRAINING: NodeState
NODE_STATE_DRAINED: NodeState
GPU_BACKEND_KIND_UNSPECIFIED: GpuBackendKind
GPU_BACKEND_KIND_NONE: GpuBackendKind
GPU_BACKEND_KIND_SIM: GpuBackendKind
GPU_BACKEND_KIND_NVML: GpuBackendKind
GPU_RECOVERY_ACTION_UNSPECIFIED: GpuRecoveryAction
GPU_RECOVERY_ACTION_NONE: GpuRecoveryAction
GPU_RECOVERY_ACTION_GPU_RESET: GpuRecoveryAction
GPU_RECOVERY_ACTION_NODE_REBOOT: GpuRecoveryAction
GPU_RECOVERY_ACTION_DRAIN_P2P: GpuRecoveryAction
GPU_RECOVERY_ACTION_DRAIN_AND_RESET: GpuRecoveryAction
HEALTH_UNSPECIFIED: Health
HEALTH_HEALTHY: Health
HEALTH_DEGRADED: Health
HEALTH_FAILING: Health
HEALTH_FAILED: Health
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_STARTING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_CANCELLING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_CHECKPOINTING: JobState
JOB_STATE_EVICTING: JobState
JOB_STATE_RENDEZVOUS: JobState
JOB_STATE_RESTARTING: JobState
RANK_STATE_UNSPECIFIED: RankState
RANK_STATE_RUNNING: RankState
RANK_STATE_EXITED: RankState
RANK_STATE_LOST: RankState
REPLICA_GROUP_STATE_UNSPECIFIED: ReplicaGroupState
REPLICA_GROUP_TRAINING: ReplicaGroupState
REPLICA_GROUP_STOPPING: ReplicaGroupState
REPLICA_GROUP_WAITING: ReplicaGroupState
REPLICA_GROUP_REBUILDING: ReplicaGroupState

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "pci_bus_id", "serial", "memory_total_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    serial: str
    memory_total_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., pci_bus_id: _Optional[str] = ..., serial: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class NodeInventory(_message.Message):
    __slots__ = ("hostname", "cpu_count", "memory_total_bytes", "gpu_backend", "gpus", "labels", "agent_version", "checkpoint_dir", "agent_pid", "topology", "address", "snapshot_address")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_BACKEND_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    AGENT_PID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    cpu_count: int
    memory_total_bytes: int
    gpu_backend: GpuBackendKind
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    labels: _containers.ScalarMap[str, str]
    agent_version: str
    checkpoint_dir: str
    agent_pid: int
    topology: Topology
    address: str
    snapshot_address: str
    def __init__(self, hostname: _Optional[str] = ..., cpu_count: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., gpu_backend: _Optional[_Union[GpuBackendKind, str]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., agent_version: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ..., agent_pid: _Optional[int] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., address: _Optional[str] = ..., snapshot_address: _Optional[str] = ...) -> None: ...

class HostTelemetry(_message.Message):
    __slots__ = ("cpu_percent", "memory_used_bytes", "memory_available_bytes", "load1", "load5", "load15", "checkpoint_free_bytes", "checkpoint_total_bytes")
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD1_FIELD_NUMBER: _ClassVar[int]
    LOAD5_FIELD_NUMBER: _ClassVar[int]
    LOAD15_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    cpu_percent: float
    memory_used_bytes: int
    memory_available_bytes: int
    load1: float
    load5: float
    load15: float
    checkpoint_free_bytes: int
    checkpoint_total_bytes: int
    def __init__(self, cpu_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., load1: _Optional[float] = ..., load5: _Optional[float] = ..., load15: _Optional[float] = ..., checkpoint_free_bytes: _Optional[int] = ..., checkpoint_total_bytes: _Optional[int] = ...) -> None: ...

class GpuTelemetry(_message.Message):
    __slots__ = ("index", "temperature_c", "power_w", "utilization_percent", "memory_used_bytes", "lost", "ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate", "remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending", "remap_failure", "retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending", "slowdown_temperature_c", "clocks_event_reasons", "power_limit_w", "pcie_link_gen", "pcie_link_width", "pcie_max_link_gen", "pcie_max_link_width", "pcie_replay_count", "nvlink_links_total", "nvlink_links_up", "nvlink_error_count", "recovery_action", "sm_clock_mhz")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    ECC_SBE_VOLATILE_FIELD_NUMBER: _ClassVar[int]
    ECC_DBE_VOLATILE_FIELD_NUMBER: _ClassVar[int]
    ECC_SBE_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    ECC_DBE_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_CORRECTABLE_FIELD_NUMBER: _ClassVar[int]
    REMAPPED_ROWS_UNCORRECTABLE_FIELD_NUMBER: _ClassVar[int]
    REMAP_PENDING_FIELD_NUMBER: _ClassVar[int]
    REMAP_FAILURE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_SBE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_DBE_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PAGES_PENDING_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_EVENT_REASONS_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_W_FIELD_NUMBER: _ClassVar[int]
    PCIE_LINK_GEN_FIELD_NUMBER: _ClassVar[int]
    PCIE_LINK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PCIE_MAX_LINK_GEN_FIELD_NUMBER: _ClassVar[int]
    PCIE_MAX_LINK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PCIE_REPLAY_COUNT_FIELD_NUMBER: _ClassVar[int]
    NVLINK_LINKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NVLINK_LINKS_UP_FIELD_NUMBER: _ClassVar[int]
    NVLINK_ERROR_COUNT_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_ACTION_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    index: int
    temperature_c: float
    power_w: float
    utilization_percent: float
    memory_used_bytes: int
    lost: bool
    ecc_sbe_volatile: int
    ecc_dbe_volatile: int
    ecc_sbe_aggregate: int
    ecc_dbe_aggregate: int
    remapped_rows_correctable: int
    remapped_rows_uncorrectable: int
    remap_pending: bool
    remap_failure: bool
    retired_pages_sbe: int
    retired_pages_dbe: int
    retired_pages_pending: bool
    slowdown_temperature_c: float
    clocks_event_reasons: int
    power_limit_w: float
    pcie_link_gen: int
    pcie_link_width: int
    pcie_max_link_gen: int
    pcie_max_link_width: int
    pcie_replay_count: int
    nvlink_links_total: int
    nvlink_links_up: int
    nvlink_error_count: int
    recovery_action: GpuRecoveryAction
    sm_clock_mhz: int
    def __init__(self, index: _Optional[int] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., lost: _Optional[bool] = ..., ecc_sbe_volatile: _Optional[int] = ..., ecc_dbe_volatile: _Optional[int] = ..., ecc_sbe_aggregate: _Optional[int] = ..., ecc_dbe_aggregate: _Optional[int] = ..., remapped_rows_correctable: _Optional[int] = ..., remapped_rows_uncorrectable: _Optional[int] = ..., remap_pending: _Optional[bool] = ..., remap_failure: _Optional[bool] = ..., retired_pages_sbe: _Optional[int] = ..., retired_pages_dbe: _Optional[int] = ..., retired_pages_pending: _Optional[bool] = ..., slowdown_temperature_c: _Optional[float] = ..., clocks_event_reasons: _Optional[int] = ..., power_limit_w: _Optional[float] = ..., pcie_link_gen: _Optional[int] = ..., pcie_link_width: _Optional[int] = ..., pcie_max_link_gen: _Optional[int] = ..., pcie_max_link_width: _Optional[int] = ..., pcie_replay_count: _Optional[int] = ..., nvlink_links_total: _Optional[int] = ..., nvlink_links_up: _Optional[int] = ..., nvlink_error_count: _Optional[int] = ..., recovery_action: _Optional[_Union[GpuRecoveryAction, str]] = ..., sm_clock_mhz: _Optional[int] = ...) -> None: ...

class GpuEvent(_message.Message):
    __slots__ = ("gpu_index", "xid", "time_unix_ns", "message")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    XID_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    xid: int
    time_unix_ns: int
    message: str
    def __init__(self, gpu_index: _Optional[int] = ..., xid: _Optional[int] = ..., time_unix_ns: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("numa_nodes", "gpus", "nics", "matrix", "locality", "warnings")
    NUMA_NODES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NICS_FIELD_NUMBER: _ClassVar[int]
    MATRIX_FIELD_NUMBER: _ClassVar[int]
    LOCALITY_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    numa_nodes: _containers.RepeatedCompositeFieldContainer[NumaNode]
    gpus: _containers.RepeatedCompositeFieldContainer[PciDevice]
    nics: _containers.RepeatedCompositeFieldContainer[PciDevice]
    matrix: TopologyMatrix
    locality: _containers.RepeatedCompositeFieldContainer[GpuLocality]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, numa_nodes: _Optional[_Iterable[_Union[NumaNode, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[PciDevice, _Mapping]]] = ..., nics: _Optional[_Iterable[_Union[PciDevice, _Mapping]]] = ..., matrix: _Optional[_Union[TopologyMatrix, _Mapping]] = ..., locality: _Optional[_Iterable[_Union[GpuLocality, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class NumaNode(_message.Message):
    __slots__ = ("id", "cpulist", "distances", "memory_total_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    CPULIST_FIELD_NUMBER: _ClassVar[int]
    DISTANCES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: int
    cpulist: str
    distances: _containers.RepeatedScalarFieldContainer[int]
    memory_total_bytes: int
    def __init__(self, id: _Optional[int] = ..., cpulist: _Optional[str] = ..., distances: _Optional[_Iterable[int]] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class PciDevice(_message.Message):
    __slots__ = ("name", "bdf", "kind", "numa_node", "local_cpulist", "link_speed", "link_width", "max_link_speed", "max_link_width", "sysfs_path", "port_states", "gpu_index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BDF_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CPULIST_FIELD_NUMBER: _ClassVar[int]
    LINK_SPEED_FIELD_NUMBER: _ClassVar[int]
    LINK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LINK_SPEED_FIELD_NUMBER: _ClassVar[int]
    MAX_LINK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    SYSFS_PATH_FIELD_NUMBER: _ClassVar[int]
    PORT_STATES_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    bdf: str
    kind: str
    numa_node: int
    local_cpulist: str
    link_speed: str
    link_width: int
    max_link_speed: str
    max_link_width: int
    sysfs_path: str
    port_states: _containers.RepeatedScalarFieldContainer[str]
    gpu_index: int
    def __init__(self, name: _Optional[str] = ..., bdf: _Optional[str] = ..., kind: _Optional[str] = ..., numa_node: _Optional[int] = ..., local_cpulist: _Optional[str] = ..., link_speed: _Optional[str] = ..., link_width: _Optional[int] = ..., max_link_speed: _Optional[str] = ..., max_link_width: _Optional[int] = ..., sysfs_path: _Optional[str] = ..., port_states: _Optional[_Iterable[str]] = ..., gpu_index: _Optional[int] = ...) -> None: ...

class TopologyMatrix(_message.Message):
    __slots__ = ("labels", "rows")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    rows: _containers.RepeatedCompositeFieldContainer[TopologyRow]
    def __init__(self, labels: _Optional[_Iterable[str]] = ..., rows: _Optional[_Iterable[_Union[TopologyRow, _Mapping]]] = ...) -> None: ...

class TopologyRow(_message.Message):
    __slots__ = ("cells",)
    CELLS_FIELD_NUMBER: _ClassVar[int]
    cells: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cells: _Optional[_Iterable[str]] = ...) -> None: ...

class GpuLocality(_message.Message):
    __slots__ = ("gpu_index", "nearest_nic", "nic_relation", "numa_node", "cpulist")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    NEAREST_NIC_FIELD_NUMBER: _ClassVar[int]
    NIC_RELATION_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    CPULIST_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    nearest_nic: str
    nic_relation: str
    numa_node: int
    cpulist: str
    def __init__(self, gpu_index: _Optional[int] = ..., nearest_nic: _Optional[str] = ..., nic_relation: _Optional[str] = ..., numa_node: _Optional[int] = ..., cpulist: _Optional[str] = ...) -> None: ...

class NcclRankState(_message.Message):
    __slots__ = ("job", "rank", "process_group", "last_started_seq", "last_completed_seq", "last_op", "last_state", "last_age_s", "dump_time_unix_ns", "dump_path")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PROCESS_GROUP_FIELD_NUMBER: _ClassVar[int]
    LAST_STARTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPLETED_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_OP_FIELD_NUMBER: _ClassVar[int]
    LAST_STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DUMP_TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    DUMP_PATH_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    process_group: str
    last_started_seq: int
    last_completed_seq: int
    last_op: str
    last_state: str
    last_age_s: float
    dump_time_unix_ns: int
    dump_path: str
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., process_group: _Optional[str] = ..., last_started_seq: _Optional[int] = ..., last_completed_seq: _Optional[int] = ..., last_op: _Optional[str] = ..., last_state: _Optional[str] = ..., last_age_s: _Optional[float] = ..., dump_time_unix_ns: _Optional[int] = ..., dump_path: _Optional[str] = ...) -> None: ...

class GpuVerdict(_message.Message):
    __slots__ = ("index", "health", "reasons")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    index: int
    health: Health
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., health: _Optional[_Union[Health, str]] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeHealth(_message.Message):
    __slots__ = ("node", "health", "reasons", "gpus", "evaluated_unix_ns")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    node: str
    health: Health
    reasons: _containers.RepeatedScalarFieldContainer[str]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuVerdict]
    evaluated_unix_ns: int
    def __init__(self, node: _Optional[str] = ..., health: _Optional[_Union[Health, str]] = ..., reasons: _Optional[_Iterable[str]] = ..., gpus: _Optional[_Iterable[_Union[GpuVerdict, _Mapping]]] = ..., evaluated_unix_ns: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "time_unix_ns", "kind", "node", "job", "message", "fields")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_unix_ns: int
    kind: str
    node: str
    job: str
    message: str
    fields: _containers.ScalarMap[str, str]
    def __init__(self, seq: _Optional[int] = ..., time_unix_ns: _Optional[int] = ..., kind: _Optional[str] = ..., node: _Optional[str] = ..., job: _Optional[str] = ..., message: _Optional[str] = ..., fields: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PhaseTime(_message.Message):
    __slots__ = ("phase", "seconds")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    phase: str
    seconds: float
    def __init__(self, phase: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "command", "nodes", "ranks_per_node", "spares", "checkpoint_dir", "priority", "env", "workdir", "segment", "run_as", "limits", "within", "slurm_job_id", "replicas")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    SLURM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    command: _containers.RepeatedScalarFieldContainer[str]
    nodes: int
    ranks_per_node: int
    spares: int
    checkpoint_dir: str
    priority: int
    env: _containers.ScalarMap[str, str]
    workdir: str
    segment: int
    run_as: str
    limits: ResourceLimits
    within: _containers.RepeatedScalarFieldContainer[str]
    slurm_job_id: str
    replicas: int
    def __init__(self, name: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., nodes: _Optional[int] = ..., ranks_per_node: _Optional[int] = ..., spares: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., priority: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., segment: _Optional[int] = ..., run_as: _Optional[str] = ..., limits: _Optional[_Union[ResourceLimits, _Mapping]] = ..., within: _Optional[_Iterable[str]] = ..., slurm_job_id: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class ResourceLimits(_message.Message):
    __slots__ = ("memory_bytes", "tasks", "open_files")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FILES_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    tasks: int
    open_files: int
    def __init__(self, memory_bytes: _Optional[int] = ..., tasks: _Optional[int] = ..., open_files: _Optional[int] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "node", "local_rank", "gpu", "state", "pid", "exit_code", "generation", "wrapper_pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WRAPPER_PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    local_rank: int
    gpu: int
    state: RankState
    pid: int
    exit_code: int
    generation: int
    wrapper_pid: int
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., local_rank: _Optional[int] = ..., gpu: _Optional[int] = ..., state: _Optional[_Union[RankState, str]] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., generation: _Optional[int] = ..., wrapper_pid: _Optional[int] = ...) -> None: ...

class JobCheckpoint(_message.Message):
    __slots__ = ("id", "at_step", "deadline_unix_ns", "pause", "reason", "generation", "asked_unix_ns")
    ID_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ASKED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    id: int
    at_step: int
    deadline_unix_ns: int
    pause: bool
    reason: str
    generation: int
    asked_unix_ns: int
    def __init__(self, id: _Optional[int] = ..., at_step: _Optional[int] = ..., deadline_unix_ns: _Optional[int] = ..., pause: _Optional[bool] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., asked_unix_ns: _Optional[int] = ...) -> None: ...

class HangCulprit(_message.Message):
    __slots__ = ("rank", "node", "process_group", "op", "seq", "state", "peers_seq")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_GROUP_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PEERS_SEQ_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    process_group: str
    op: str
    seq: int
    state: str
    peers_seq: int
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., process_group: _Optional[str] = ..., op: _Optional[str] = ..., seq: _Optional[int] = ..., state: _Optional[str] = ..., peers_seq: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "spec", "state", "reason", "generation", "nodes", "spares", "master_addr", "master_port", "submitted_unix_ns", "started_unix_ns", "finished_unix_ns", "exit_code", "ranks", "user", "restarts", "incident", "evicted", "state_since_unix_ns", "phase_times", "incident_predictable", "incident_nodes", "checkpoint", "launched_generation", "incident_kind", "culprit", "straggler_evictions_unix_ns", "straggler_step_s", "straggler_held", "standbys", "restarts_in_row", "progress_reported", "ending_since_unix_ns", "incident_step", "groups", "lighthouse_port", "lighthouse_host", "lighthouse_control", "lighthouse_token", "packed_ranks")
    class StandbysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    STATE_SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMES_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_PREDICTABLE_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_NODES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_KIND_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_EVICTIONS_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_HELD_FIELD_NUMBER: _ClassVar[int]
    STANDBYS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_IN_ROW_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    ENDING_SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_PORT_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_HOST_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PACKED_RANKS_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: JobSpec
    state: JobState
    reason: str
    generation: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    spares: _containers.RepeatedScalarFieldContainer[str]
    master_addr: str
    master_port: int
    submitted_unix_ns: int
    started_unix_ns: int
    finished_unix_ns: int
    exit_code: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    user: str
    restarts: int
    incident: str
    evicted: _containers.RepeatedScalarFieldContainer[str]
    state_since_unix_ns: int
    phase_times: _containers.RepeatedCompositeFieldContainer[PhaseTime]
    incident_predictable: bool
    incident_nodes: _containers.RepeatedScalarFieldContainer[str]
    checkpoint: JobCheckpoint
    launched_generation: int
    incident_kind: str
    culprit: HangCulprit
    straggler_evictions_unix_ns: _containers.RepeatedScalarFieldContainer[int]
    straggler_step_s: float
    straggler_held: str
    standbys: _containers.ScalarMap[str, int]
    restarts_in_row: int
    progress_reported: bool
    ending_since_unix_ns: int
    incident_step: int
    groups: _containers.RepeatedCompositeFieldContainer[ReplicaGroup]
    lighthouse_port: int
    lighthouse_host: str
    lighthouse_control: str
    lighthouse_token: str
    packed_ranks: PackedRanks
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., spares: _Optional[_Iterable[str]] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., submitted_unix_ns: _Optional[int] = ..., started_unix_ns: _Optional[int] = ..., finished_unix_ns: _Optional[int] = ..., exit_code: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., user: _Optional[str] = ..., restarts: _Optional[int] = ..., incident: _Optional[str] = ..., evicted: _Optional[_Iterable[str]] = ..., state_since_unix_ns: _Optional[int] = ..., phase_times: _Optional[_Iterable[_Union[PhaseTime, _Mapping]]] = ..., incident_predictable: _Optional[bool] = ..., incident_nodes: _Optional[_Iterable[str]] = ..., checkpoint: _Optional[_Union[JobCheckpoint, _Mapping]] = ..., launched_generation: _Optional[int] = ..., incident_kind: _Optional[str] = ..., culprit: _Optional[_Union[HangCulprit, _Mapping]] = ..., straggler_evictions_unix_ns: _Optional[_Iterable[int]] = ..., straggler_step_s: _Optional[float] = ..., straggler_held: _Optional[str] = ..., standbys: _Optional[_Mapping[str, int]] = ..., restarts_in_row: _Optional[int] = ..., progress_reported: _Optional[bool] = ..., ending_since_unix_ns: _Optional[int] = ..., incident_step: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[ReplicaGroup, _Mapping]]] = ..., lighthouse_port: _Optional[int] = ..., lighthouse_host: _Optional[str] = ..., lighthouse_control: _Optional[str] = ..., lighthouse_token: _Optional[str] = ..., packed_ranks: _Optional[_Union[PackedRanks, _Mapping]] = ...) -> None: ...

class PackedRanks(_message.Message):
    __slots__ = ("states", "exit_codes", "generations", "pids", "wrapper_pids")
    STATES_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODES_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    WRAPPER_PIDS_FIELD_NUMBER: _ClassVar[int]
    states: bytes
    exit_codes: _containers.RepeatedScalarFieldContainer[int]
    generations: _containers.RepeatedScalarFieldContainer[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    wrapper_pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, states: _Optional[bytes] = ..., exit_codes: _Optional[_Iterable[int]] = ..., generations: _Optional[_Iterable[int]] = ..., pids: _Optional[_Iterable[int]] = ..., wrapper_pids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaGroup(_message.Message):
    __slots__ = ("index", "state", "generation", "reason", "since_unix_ns", "bad", "incident_kind", "finish_until_unix_ns")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    BAD_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_KIND_FIELD_NUMBER: _ClassVar[int]
    FINISH_UNTIL_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    index: int
    state: ReplicaGroupState
    generation: int
    reason: str
    since_unix_ns: int
    bad: _containers.RepeatedScalarFieldContainer[str]
    incident_kind: str
    finish_until_unix_ns: int
    def __init__(self, index: _Optional[int] = ..., state: _Optional[_Union[ReplicaGroupState, str]] = ..., generation: _Optional[int] = ..., reason: _Optional[str] = ..., since_unix_ns: _Optional[int] = ..., bad: _Optional[_Iterable[str]] = ..., incident_kind: _Optional[str] = ..., finish_until_unix_ns: _Optional[int] = ...) -> None: ...
