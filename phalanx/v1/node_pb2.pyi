from phalanx.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RenewCertificateRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class RenewCertificateResponse(_message.Message):
    __slots__ = ("cert_pem", "not_after_unix_ns")
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    cert_pem: bytes
    not_after_unix_ns: int
    def __init__(self, cert_pem: _Optional[bytes] = ..., not_after_unix_ns: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_name", "inventory")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    inventory: _common_pb2.NodeInventory
    def __init__(self, node_name: _Optional[str] = ..., inventory: _Optional[_Union[_common_pb2.NodeInventory, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("incarnation", "heartbeat_interval_s", "state", "drain_reason", "epoch")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    heartbeat_interval_s: float
    state: _common_pb2.NodeState
    drain_reason: str
    epoch: int
    def __init__(self, incarnation: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., state: _Optional[_Union[_common_pb2.NodeState, str]] = ..., drain_reason: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("open", "heartbeat", "inventory", "event", "gpu_event", "result", "checkpoint_ack")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    GPU_EVENT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ACK_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    heartbeat: Heartbeat
    inventory: _common_pb2.NodeInventory
    event: AgentEvent
    gpu_event: _common_pb2.GpuEvent
    result: CommandResult
    checkpoint_ack: CheckpointAck
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., inventory: _Optional[_Union[_common_pb2.NodeInventory, _Mapping]] = ..., event: _Optional[_Union[AgentEvent, _Mapping]] = ..., gpu_event: _Optional[_Union[_common_pb2.GpuEvent, _Mapping]] = ..., result: _Optional[_Union[CommandResult, _Mapping]] = ..., checkpoint_ack: _Optional[_Union[CheckpointAck, _Mapping]] = ...) -> None: ...

class CheckpointAck(_message.Message):
    __slots__ = ("job", "generation", "rank", "request_id", "step", "in_memory")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    request_id: int
    step: int
    in_memory: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., request_id: _Optional[int] = ..., step: _Optional[int] = ..., in_memory: _Optional[bool] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("node_name", "incarnation", "standby")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    incarnation: int
    standby: bool
    def __init__(self, node_name: _Optional[str] = ..., incarnation: _Optional[int] = ..., standby: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "sent_unix_ns", "host", "gpus", "running_ranks", "nccl", "health_digest", "ranks", "progress", "snapshots", "standbys", "commands_done")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_RANKS_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    HEALTH_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    STANDBYS_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_DONE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    sent_unix_ns: int
    host: _common_pb2.HostTelemetry
    gpus: _containers.RepeatedCompositeFieldContainer[_common_pb2.GpuTelemetry]
    running_ranks: int
    nccl: _containers.RepeatedCompositeFieldContainer[_common_pb2.NcclRankState]
    health_digest: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    progress: _containers.RepeatedCompositeFieldContainer[RankProgress]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotHeld]
    standbys: _containers.RepeatedCompositeFieldContainer[Standbys]
    commands_done: int
    def __init__(self, seq: _Optional[int] = ..., sent_unix_ns: _Optional[int] = ..., host: _Optional[_Union[_common_pb2.HostTelemetry, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[_common_pb2.GpuTelemetry, _Mapping]]] = ..., running_ranks: _Optional[int] = ..., nccl: _Optional[_Iterable[_Union[_common_pb2.NcclRankState, _Mapping]]] = ..., health_digest: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., progress: _Optional[_Iterable[_Union[RankProgress, _Mapping]]] = ..., snapshots: _Optional[_Iterable[_Union[SnapshotHeld, _Mapping]]] = ..., standbys: _Optional[_Iterable[_Union[Standbys, _Mapping]]] = ..., commands_done: _Optional[int] = ...) -> None: ...

class Standbys(_message.Message):
    __slots__ = ("job", "ready", "starting")
    JOB_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    job: str
    ready: int
    starting: int
    def __init__(self, job: _Optional[str] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ...) -> None: ...

class SnapshotHeld(_message.Message):
    __slots__ = ("job", "generation", "rank", "step", "size", "replica")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    step: int
    size: int
    replica: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., size: _Optional[int] = ..., replica: _Optional[bool] = ...) -> None: ...

class RankProgress(_message.Message):
    __slots__ = ("job", "generation", "rank", "last_step", "steps", "mean_step_s", "mean_compute_s", "last_step_unix_ns", "compute_samples", "reports", "saving", "finished")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STEP_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    SAVING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    last_step: int
    steps: int
    mean_step_s: float
    mean_compute_s: float
    last_step_unix_ns: int
    compute_samples: _containers.RepeatedScalarFieldContainer[float]
    reports: int
    saving: bool
    finished: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., last_step: _Optional[int] = ..., steps: _Optional[int] = ..., mean_step_s: _Optional[float] = ..., mean_compute_s: _Optional[float] = ..., last_step_unix_ns: _Optional[int] = ..., compute_samples: _Optional[_Iterable[float]] = ..., reports: _Optional[int] = ..., saving: _Optional[bool] = ..., finished: _Optional[bool] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("job", "generation", "rank", "state", "pid", "exit_code", "gpu", "rank_pid", "fatal")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    RANK_PID_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    state: _common_pb2.RankState
    pid: int
    exit_code: int
    gpu: int
    rank_pid: int
    fatal: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., state: _Optional[_Union[_common_pb2.RankState, str]] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., gpu: _Optional[int] = ..., rank_pid: _Optional[int] = ..., fatal: _Optional[str] = ...) -> None: ...

class AgentEvent(_message.Message):
    __slots__ = ("kind", "message", "fields")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    fields: _containers.ScalarMap[str, str]
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., fields: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("accepted", "status", "command", "standing_by")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    STANDING_BY_FIELD_NUMBER: _ClassVar[int]
    accepted: SessionAccepted
    status: NodeStatus
    command: Command
    standing_by: StandingBy
    def __init__(self, accepted: _Optional[_Union[SessionAccepted, _Mapping]] = ..., status: _Optional[_Union[NodeStatus, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ..., standing_by: _Optional[_Union[StandingBy, _Mapping]] = ...) -> None: ...

class StandingBy(_message.Message):
    __slots__ = ("controller", "leader", "takeover_s")
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_S_FIELD_NUMBER: _ClassVar[int]
    controller: str
    leader: str
    takeover_s: float
    def __init__(self, controller: _Optional[str] = ..., leader: _Optional[str] = ..., takeover_s: _Optional[float] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "epoch", "inject", "launch", "stop", "reserve_port", "read_log", "checkpoint", "pin_snapshot", "prepare", "grant_snapshots", "revocations", "lighthouse")
    ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INJECT_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RESERVE_PORT_FIELD_NUMBER: _ClassVar[int]
    READ_LOG_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PIN_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    GRANT_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_FIELD_NUMBER: _ClassVar[int]
    id: int
    epoch: int
    inject: InjectFault
    launch: LaunchRanks
    stop: StopRanks
    reserve_port: ReservePort
    read_log: ReadLog
    checkpoint: RequestCheckpoint
    pin_snapshot: PinSnapshot
    prepare: PrepareRanks
    grant_snapshots: GrantSnapshots
    revocations: Revocations
    lighthouse: LighthouseAddress
    def __init__(self, id: _Optional[int] = ..., epoch: _Optional[int] = ..., inject: _Optional[_Union[InjectFault, _Mapping]] = ..., launch: _Optional[_Union[LaunchRanks, _Mapping]] = ..., stop: _Optional[_Union[StopRanks, _Mapping]] = ..., reserve_port: _Optional[_Union[ReservePort, _Mapping]] = ..., read_log: _Optional[_Union[ReadLog, _Mapping]] = ..., checkpoint: _Optional[_Union[RequestCheckpoint, _Mapping]] = ..., pin_snapshot: _Optional[_Union[PinSnapshot, _Mapping]] = ..., prepare: _Optional[_Union[PrepareRanks, _Mapping]] = ..., grant_snapshots: _Optional[_Union[GrantSnapshots, _Mapping]] = ..., revocations: _Optional[_Union[Revocations, _Mapping]] = ..., lighthouse: _Optional[_Union[LighthouseAddress, _Mapping]] = ...) -> None: ...

class LighthouseAddress(_message.Message):
    __slots__ = ("job", "url")
    JOB_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    job: str
    url: str
    def __init__(self, job: _Optional[str] = ..., url: _Optional[str] = ...) -> None: ...

class Revocations(_message.Message):
    __slots__ = ("serials", "names")
    class NamesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SERIALS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    serials: _containers.RepeatedScalarFieldContainer[str]
    names: _containers.ScalarMap[str, int]
    def __init__(self, serials: _Optional[_Iterable[str]] = ..., names: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GrantSnapshots(_message.Message):
    __slots__ = ("job", "nodes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    job: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareRanks(_message.Message):
    __slots__ = ("job", "command", "env", "workdir", "count", "hold_s", "run_as")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_FIELD_NUMBER: _ClassVar[int]
    job: str
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    workdir: str
    count: int
    hold_s: float
    run_as: str
    def __init__(self, job: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., count: _Optional[int] = ..., hold_s: _Optional[float] = ..., run_as: _Optional[str] = ...) -> None: ...

class PinSnapshot(_message.Message):
    __slots__ = ("job", "generation", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    step: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class RequestCheckpoint(_message.Message):
    __slots__ = ("job", "generation", "request_id", "deadline_s", "reason", "pause", "at_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    request_id: int
    deadline_s: float
    reason: str
    pause: bool
    at_step: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., request_id: _Optional[int] = ..., deadline_s: _Optional[float] = ..., reason: _Optional[str] = ..., pause: _Optional[bool] = ..., at_step: _Optional[int] = ...) -> None: ...

class LaunchRanks(_message.Message):
    __slots__ = ("job", "generation", "command", "env", "workdir", "ranks", "run_as", "limits")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    workdir: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankLaunch]
    run_as: str
    limits: _common_pb2.ResourceLimits
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankLaunch, _Mapping]]] = ..., run_as: _Optional[str] = ..., limits: _Optional[_Union[_common_pb2.ResourceLimits, _Mapping]] = ...) -> None: ...

class RankLaunch(_message.Message):
    __slots__ = ("rank", "local_rank", "gpu", "env")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    gpu: int
    env: _containers.ScalarMap[str, str]
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., gpu: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StopRanks(_message.Message):
    __slots__ = ("job", "generation", "grace_s", "final")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    grace_s: float
    final: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., grace_s: _Optional[float] = ..., final: _Optional[bool] = ...) -> None: ...

class ReservePort(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadLog(_message.Message):
    __slots__ = ("job", "rank", "offset", "max_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    offset: int
    max_bytes: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class InjectFault(_message.Message):
    __slots__ = ("gpu_index", "fault")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    fault: str
    def __init__(self, gpu_index: _Optional[int] = ..., fault: _Optional[str] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("id", "ok", "error", "message", "port", "data", "size")
    ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    id: int
    ok: bool
    error: str
    message: str
    port: int
    data: bytes
    size: int
    def __init__(self, id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., message: _Optional[str] = ..., port: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class SessionAccepted(_message.Message):
    __slots__ = ("incarnation", "heartbeat_interval_s", "state", "drain_reason", "epoch", "health", "inventory_crc32", "revocations")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_CRC32_FIELD_NUMBER: _ClassVar[int]
    REVOCATIONS_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    heartbeat_interval_s: float
    state: _common_pb2.NodeState
    drain_reason: str
    epoch: int
    health: _common_pb2.NodeHealth
    inventory_crc32: int
    revocations: Revocations
    def __init__(self, incarnation: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., state: _Optional[_Union[_common_pb2.NodeState, str]] = ..., drain_reason: _Optional[str] = ..., epoch: _Optional[int] = ..., health: _Optional[_Union[_common_pb2.NodeHealth, _Mapping]] = ..., inventory_crc32: _Optional[int] = ..., revocations: _Optional[_Union[Revocations, _Mapping]] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("state", "drain_reason", "health")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.NodeState
    drain_reason: str
    health: _common_pb2.NodeHealth
    def __init__(self, state: _Optional[_Union[_common_pb2.NodeState, str]] = ..., drain_reason: _Optional[str] = ..., health: _Optional[_Union[_common_pb2.NodeHealth, _Mapping]] = ...) -> None: ...
