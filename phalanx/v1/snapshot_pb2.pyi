from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullRequest(_message.Message):
    __slots__ = ("key", "port")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    key: SnapshotKey
    port: int
    def __init__(self, key: _Optional[_Union[SnapshotKey, _Mapping]] = ..., port: _Optional[int] = ...) -> None: ...

class SnapshotKey(_message.Message):
    __slots__ = ("job", "generation", "rank", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    rank: int
    step: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("key", "size", "crc32", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: SnapshotKey
    size: int
    crc32: int
    data: bytes
    def __init__(self, key: _Optional[_Union[SnapshotKey, _Mapping]] = ..., size: _Optional[int] = ..., crc32: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class BulkTicket(_message.Message):
    __slots__ = ("size", "crc32", "port", "token")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    size: int
    crc32: int
    port: int
    token: bytes
    def __init__(self, size: _Optional[int] = ..., crc32: _Optional[int] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("ok", "error", "stream")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    stream: bool
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., stream: _Optional[bool] = ...) -> None: ...
