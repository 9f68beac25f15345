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
    __slots__ = ("hostname", "cpu_count", "memory_total_bytes", "gpu_backend", "gpus", "labels", "agent_version", "checkpoint_dir", "agent_pid")
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
    hostname: str
    cpu_count: int
    memory_total_bytes: int
    gpu_backend: GpuBackendKind
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    labels: _containers.ScalarMap[str, str]
    agent_version: str
    checkpoint_dir: str
    agent_pid: int
    def __init__(self, hostname: _Optional[str] = ..., cpu_count: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., gpu_backend: _Optional[_Union[GpuBackendKind, str]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., labels: _Optional[_Mapping[str, str]] = ..., agent_version: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ..., agent_pid: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("index", "temperature_c", "power_w", "utilization_percent", "memory_used_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    temperature_c: float
    power_w: float
    utilization_percent: float
    memory_used_bytes: int
    def __init__(self, index: _Optional[int] = ..., temperature_c: _Optional[float] = ..., power_w: _Optional[float] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ...) -> None: ...

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
