from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetClusterCaRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterCaResponse(_message.Message):
    __slots__ = ("ca_pem",)
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    ca_pem: bytes
    def __init__(self, ca_pem: _Optional[bytes] = ...) -> None: ...

class EnrolRequest(_message.Message):
    __slots__ = ("token", "csr_pem")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    token: str
    csr_pem: bytes
    def __init__(self, token: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class EnrolResponse(_message.Message):
    __slots__ = ("cert_pem", "ca_pem", "not_after_unix_ns")
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    cert_pem: bytes
    ca_pem: bytes
    not_after_unix_ns: int
    def __init__(self, cert_pem: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ..., not_after_unix_ns: _Optional[int] = ...) -> None: ...
