import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuorumMember(_message.Message):
    __slots__ = ("replica_id", "address", "store_address", "step", "world_size", "shrink_only", "commit_failures", "data")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHRINK_ONLY_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    commit_failures: int
    data: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., store_address: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., shrink_only: _Optional[bool] = ..., commit_failures: _Optional[int] = ..., data: _Optional[str] = ...) -> None: ...

class Quorum(_message.Message):
    __slots__ = ("quorum_id", "participants", "created")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    participants: _containers.RepeatedCompositeFieldContainer[QuorumMember]
    created: _timestamp_pb2.Timestamp
    def __init__(self, quorum_id: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[QuorumMember, _Mapping]]] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LighthouseQuorumRequest(_message.Message):
    __slots__ = ("requester",)
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    requester: QuorumMember
    def __init__(self, requester: _Optional[_Union[QuorumMember, _Mapping]] = ...) -> None: ...

class LighthouseQuorumResponse(_message.Message):
    __slots__ = ("quorum",)
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    quorum: Quorum
    def __init__(self, quorum: _Optional[_Union[Quorum, _Mapping]] = ...) -> None: ...

class LighthouseHeartbeatRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class LighthouseHeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
