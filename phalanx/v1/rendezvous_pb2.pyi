from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_OUTCOME_UNSPECIFIED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_WAITING: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_FORMED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_TIMED_OUT: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_CLOSED: _ClassVar[RoundOutcome]
ROUND_OUTCOME_UNSPECIFIED: RoundOutcome
ROUND_OUTCOME_WAITING: RoundOutcome
ROUND_OUTCOME_FORMED: RoundOutcome
ROUND_OUTCOME_TIMED_OUT: RoundOutcome
ROUND_OUTCOME_CLOSED: RoundOutcome

class StoreAddress(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class RoundSettings(_message.Message):
    __slots__ = ("min_nodes", "max_nodes", "last_call_s", "hang_s")
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_S_FIELD_NUMBER: _ClassVar[int]
    HANG_S_FIELD_NUMBER: _ClassVar[int]
    min_nodes: int
    max_nodes: int
    last_call_s: float
    hang_s: float
    def __init__(self, min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., last_call_s: _Optional[float] = ..., hang_s: _Optional[float] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run_id", "participant_id", "settings", "join_timeout_s", "store", "attempt", "node")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_ID_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    participant_id: str
    settings: RoundSettings
    join_timeout_s: float
    store: StoreAddress
    attempt: int
    node: str
    def __init__(self, run_id: _Optional[str] = ..., participant_id: _Optional[str] = ..., settings: _Optional[_Union[RoundSettings, _Mapping]] = ..., join_timeout_s: _Optional[float] = ..., store: _Optional[_Union[StoreAddress, _Mapping]] = ..., attempt: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class AwaitRoundRequest(_message.Message):
    __slots__ = ("run_id", "participant_id", "round", "wait_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    participant_id: str
    round: int
    wait_s: float
    def __init__(self, run_id: _Optional[str] = ..., participant_id: _Optional[str] = ..., round: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class RoundReply(_message.Message):
    __slots__ = ("outcome", "round", "rank", "world_size", "store", "joined", "message")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    outcome: RoundOutcome
    round: int
    rank: int
    world_size: int
    store: StoreAddress
    joined: int
    message: str
    def __init__(self, outcome: _Optional[_Union[RoundOutcome, str]] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., store: _Optional[_Union[StoreAddress, _Mapping]] = ..., joined: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class NumNodesWaitingRequest(_message.Message):
    __slots__ = ("run_id", "participant_id", "round", "member")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    participant_id: str
    round: int
    member: RoundMember
    def __init__(self, run_id: _Optional[str] = ..., participant_id: _Optional[str] = ..., round: _Optional[int] = ..., member: _Optional[_Union[RoundMember, _Mapping]] = ...) -> None: ...

class RoundMember(_message.Message):
    __slots__ = ("rank", "world_size", "store", "settings", "node", "attempt")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    store: StoreAddress
    settings: RoundSettings
    node: str
    attempt: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., store: _Optional[_Union[StoreAddress, _Mapping]] = ..., settings: _Optional[_Union[RoundSettings, _Mapping]] = ..., node: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class NumNodesWaitingReply(_message.Message):
    __slots__ = ("waiting",)
    WAITING_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    def __init__(self, waiting: _Optional[int] = ...) -> None: ...

class SetClosedRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class SetClosedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "closed", "formed_round", "world_size", "open_round", "waiting")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    FORMED_ROUND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    closed: bool
    formed_round: int
    world_size: int
    open_round: int
    waiting: int
    def __init__(self, run_id: _Optional[str] = ..., closed: _Optional[bool] = ..., formed_round: _Optional[int] = ..., world_size: _Optional[int] = ..., open_round: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("run_id", "participant_id", "round", "close_run")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLOSE_RUN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    participant_id: str
    round: int
    close_run: bool
    def __init__(self, run_id: _Optional[str] = ..., participant_id: _Optional[str] = ..., round: _Optional[int] = ..., close_run: _Optional[bool] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("run_id", "round", "rank", "world_size", "step", "step_s", "done_id", "done_step", "node", "saving", "finished", "compute_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    DONE_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SAVING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    rank: int
    world_size: int
    step: int
    step_s: float
    done_id: int
    done_step: int
    node: str
    saving: bool
    finished: bool
    compute_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., step: _Optional[int] = ..., step_s: _Optional[float] = ..., done_id: _Optional[int] = ..., done_step: _Optional[int] = ..., node: _Optional[str] = ..., saving: _Optional[bool] = ..., finished: _Optional[bool] = ..., compute_s: _Optional[_Iterable[float]] = ...) -> None: ...

class WorkerReply(_message.Message):
    __slots__ = ("checkpoint_id", "at_step", "pause", "reason")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    at_step: int
    pause: bool
    reason: str
    def __init__(self, checkpoint_id: _Optional[int] = ..., at_step: _Optional[int] = ..., pause: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
