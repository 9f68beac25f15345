from phalanx.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateEnrolTokenRequest(_message.Message):
    __slots__ = ("ttl_s", "uses", "description")
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    uses: int
    description: str
    def __init__(self, ttl_s: _Optional[float] = ..., uses: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class CreateEnrolTokenResponse(_message.Message):
    __slots__ = ("token", "expires_unix_ns", "ca_hash")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    CA_HASH_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_unix_ns: int
    ca_hash: str
    def __init__(self, token: _Optional[str] = ..., expires_unix_ns: _Optional[int] = ..., ca_hash: _Optional[str] = ...) -> None: ...

class RevokeCertificateRequest(_message.Message):
    __slots__ = ("name", "role", "serial", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    serial: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., serial: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RevokeCertificateResponse(_message.Message):
    __slots__ = ("message", "sessions_cut")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_CUT_FIELD_NUMBER: _ClassVar[int]
    message: str
    sessions_cut: int
    def __init__(self, message: _Optional[str] = ..., sessions_cut: _Optional[int] = ...) -> None: ...

class CheckpointJobRequest(_message.Message):
    __slots__ = ("id", "deadline_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    deadline_s: float
    def __init__(self, id: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class CheckpointJobReply(_message.Message):
    __slots__ = ("step", "seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    seconds: float
    def __init__(self, step: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "user")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.JobSpec
    user: str
    def __init__(self, spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., user: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "after_id")
    STATES_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.JobState]
    after_id: str
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.JobState, str]]] = ..., after_id: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_after_id")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Job]
    next_after_id: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[_common_pb2.Job, _Mapping]]] = ..., next_after_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ReadLogsRequest(_message.Message):
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

class LogChunk(_message.Message):
    __slots__ = ("data", "next_offset", "size", "node")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    next_offset: int
    size: int
    node: str
    def __init__(self, data: _Optional[bytes] = ..., next_offset: _Optional[int] = ..., size: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class GetHealthRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class GetHealthResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeHealth]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_common_pb2.NodeHealth, _Mapping]]] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class InjectFaultRequest(_message.Message):
    __slots__ = ("node", "gpu_index", "fault")
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    node: str
    gpu_index: int
    fault: str
    def __init__(self, node: _Optional[str] = ..., gpu_index: _Optional[int] = ..., fault: _Optional[str] = ...) -> None: ...

class InjectFaultResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("name", "state", "drain_reason", "incarnation", "inventory", "host", "gpus", "last_heartbeat_unix_ns", "state_since_unix_ns", "peer", "connected", "running_ranks", "health")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    STATE_SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_RANKS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: _common_pb2.NodeState
    drain_reason: str
    incarnation: int
    inventory: _common_pb2.NodeInventory
    host: _common_pb2.HostTelemetry
    gpus: _containers.RepeatedCompositeFieldContainer[_common_pb2.GpuTelemetry]
    last_heartbeat_unix_ns: int
    state_since_unix_ns: int
    peer: str
    connected: bool
    running_ranks: int
    health: _common_pb2.Health
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.NodeState, str]] = ..., drain_reason: _Optional[str] = ..., incarnation: _Optional[int] = ..., inventory: _Optional[_Union[_common_pb2.NodeInventory, _Mapping]] = ..., host: _Optional[_Union[_common_pb2.HostTelemetry, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[_common_pb2.GpuTelemetry, _Mapping]]] = ..., last_heartbeat_unix_ns: _Optional[int] = ..., state_since_unix_ns: _Optional[int] = ..., peer: _Optional[str] = ..., connected: _Optional[bool] = ..., running_ranks: _Optional[int] = ..., health: _Optional[_Union[_common_pb2.Health, str]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.NodeState]
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.NodeState, str]]] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ...) -> None: ...

class GetNodeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("name", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class UndrainNodeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("after_seq", "limit", "node", "job", "by", "newest")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    limit: int
    node: str
    job: str
    by: str
    newest: bool
    def __init__(self, after_seq: _Optional[int] = ..., limit: _Optional[int] = ..., node: _Optional[str] = ..., job: _Optional[str] = ..., by: _Optional[str] = ..., newest: _Optional[bool] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_common_pb2.Event]
    def __init__(self, events: _Optional[_Iterable[_Union[_common_pb2.Event, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_seq", "node", "job", "by")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    node: str
    job: str
    by: str
    def __init__(self, after_seq: _Optional[int] = ..., node: _Optional[str] = ..., job: _Optional[str] = ..., by: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControllerStats(_message.Message):
    __slots__ = ("nodes", "sessions", "heartbeats_total", "heartbeat_lag_p50_ms", "heartbeat_lag_p99_ms", "heartbeat_lag_max_ms", "heartbeat_lag_samples", "process_cpu_seconds", "process_rss_bytes", "uptime_s")
    NODES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_LAG_P50_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_LAG_P99_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_LAG_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_LAG_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    sessions: int
    heartbeats_total: int
    heartbeat_lag_p50_ms: float
    heartbeat_lag_p99_ms: float
    heartbeat_lag_max_ms: float
    heartbeat_lag_samples: int
    process_cpu_seconds: float
    process_rss_bytes: int
    uptime_s: float
    def __init__(self, nodes: _Optional[int] = ..., sessions: _Optional[int] = ..., heartbeats_total: _Optional[int] = ..., heartbeat_lag_p50_ms: _Optional[float] = ..., heartbeat_lag_p99_ms: _Optional[float] = ..., heartbeat_lag_max_ms: _Optional[float] = ..., heartbeat_lag_samples: _Optional[int] = ..., process_cpu_seconds: _Optional[float] = ..., process_rss_bytes: _Optional[int] = ..., uptime_s: _Optional[float] = ...) -> None: ...

class ListControllersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControllerMember(_message.Message):
    __slots__ = ("name", "address", "leader", "epoch", "started_unix_ns", "leader_since_unix_ns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    LEADER_SINCE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    leader: bool
    epoch: int
    started_unix_ns: int
    leader_since_unix_ns: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., leader: _Optional[bool] = ..., epoch: _Optional[int] = ..., started_unix_ns: _Optional[int] = ..., leader_since_unix_ns: _Optional[int] = ...) -> None: ...

class ListControllersResponse(_message.Message):
    __slots__ = ("members", "leader", "leader_address", "epoch", "store", "answered_by", "problem", "parked_sessions")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    PARKED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[ControllerMember]
    leader: str
    leader_address: str
    epoch: int
    store: str
    answered_by: str
    problem: str
    parked_sessions: int
    def __init__(self, members: _Optional[_Iterable[_Union[ControllerMember, _Mapping]]] = ..., leader: _Optional[str] = ..., leader_address: _Optional[str] = ..., epoch: _Optional[int] = ..., store: _Optional[str] = ..., answered_by: _Optional[str] = ..., problem: _Optional[str] = ..., parked_sessions: _Optional[int] = ...) -> None: ...
