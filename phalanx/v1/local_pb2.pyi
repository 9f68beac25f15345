from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParkRequest(_message.Message):
    __slots__ = ("job", "generation", "rank", "pid", "exit_code", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    pid: int
    exit_code: int
    reason: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ParkReply(_message.Message):
    __slots__ = ("rejoin", "env", "why")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    rejoin: bool
    env: _containers.ScalarMap[str, str]
    why: str
    def __init__(self, rejoin: _Optional[bool] = ..., env: _Optional[_Mapping[str, str]] = ..., why: _Optional[str] = ...) -> None: ...

class StepSample(_message.Message):
    __slots__ = ("step", "step_s", "compute_s", "end_unix_ns")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    step: int
    step_s: float
    compute_s: float
    end_unix_ns: int
    def __init__(self, step: _Optional[int] = ..., step_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., end_unix_ns: _Optional[int] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("job", "generation", "rank", "steps", "pid", "fatal", "saving", "finished")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FATAL_FIELD_NUMBER: _ClassVar[int]
    SAVING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    steps: _containers.RepeatedCompositeFieldContainer[StepSample]
    pid: int
    fatal: str
    saving: bool
    finished: bool
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepSample, _Mapping]]] = ..., pid: _Optional[int] = ..., fatal: _Optional[str] = ..., saving: _Optional[bool] = ..., finished: _Optional[bool] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("id", "deadline_s", "reason", "pause", "at_step", "no_in_memory", "due_unix_ns")
    ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    NO_IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DUE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    id: int
    deadline_s: float
    reason: str
    pause: bool
    at_step: int
    no_in_memory: str
    due_unix_ns: int
    def __init__(self, id: _Optional[int] = ..., deadline_s: _Optional[float] = ..., reason: _Optional[str] = ..., pause: _Optional[bool] = ..., at_step: _Optional[int] = ..., no_in_memory: _Optional[str] = ..., due_unix_ns: _Optional[int] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("checkpoint", "stale", "slow_factor")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    SLOW_FACTOR_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointRequest
    stale: bool
    slow_factor: float
    def __init__(self, checkpoint: _Optional[_Union[CheckpointRequest, _Mapping]] = ..., stale: _Optional[bool] = ..., slow_factor: _Optional[float] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job", "generation", "rank")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class SnapshotTakenRequest(_message.Message):
    __slots__ = ("job", "generation", "rank", "step", "path", "size", "crc32")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    step: int
    path: str
    size: int
    crc32: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., size: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class SnapshotTakenReply(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...

class FetchSnapshotRequest(_message.Message):
    __slots__ = ("job", "generation", "rank", "step", "source")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    step: int
    source: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class FetchSnapshotReply(_message.Message):
    __slots__ = ("path", "crc32", "error")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    path: str
    crc32: int
    error: str
    def __init__(self, path: _Optional[str] = ..., crc32: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class TellRequest(_message.Message):
    __slots__ = ("job", "generation", "rank", "kind", "message")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    kind: str
    message: str
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TellReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointDoneRequest(_message.Message):
    __slots__ = ("job", "generation", "rank", "request_id", "step", "in_memory", "check_only", "wait_s")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    request_id: int
    step: int
    in_memory: bool
    check_only: bool
    wait_s: float
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., request_id: _Optional[int] = ..., step: _Optional[int] = ..., in_memory: _Optional[bool] = ..., check_only: _Optional[bool] = ..., wait_s: _Optional[float] = ...) -> None: ...

class CheckpointDoneReply(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...
