"""Records and the store protocol."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controller.nodes.states import NodeState
from phalanx.v1 import common_pb2


@dataclass(frozen=True)
class NodeRecord:
    """What the controller keeps about a node across restarts."""

    name: str
    state: NodeState
    drain_reason: str = ""
    incarnation: int = 0
    state_since_ns: int = 0
    inventory: bytes = b""  # a serialized phalanx.v1.NodeInventory
    revision: int = 0  # store revision this record was read at; 0 = not stored yet

    def replace(self, **changes: object) -> NodeRecord:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class JobRecord:
    """A job as the controller keeps it across restarts: its id, state and the serialized Job message."""

    id: str
    state: str
    data: bytes  # a serialized phalanx.v1.Job
    revision: int = 0
    deleted: bool = False  # in a commit: remove the record (compared on `revision` like a write)

    def replace(self, **changes: object) -> JobRecord:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CredentialRecord:
    """Enrolment tokens, enrolled node keys and revocations (controller/credentials.py): a key such as
    ``token/ID``, ``node/NAME`` or ``revoked/name/ROLE/NAME``, and its JSON."""

    key: str
    data: bytes
    revision: int = 0

    def replace(self, **changes: object) -> CredentialRecord:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EventRecord:
    kind: str
    message: str
    time_ns: int
    node: str = ""
    job: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    seq: int = 0  # assigned by the store

    def to_proto(self) -> common_pb2.Event:
        return common_pb2.Event(seq=self.seq, time_unix_ns=self.time_ns, kind=self.kind, node=self.node,
                                job=self.job, message=self.message, fields=self.fields)


@dataclass(frozen=True)
class Committed:
    nodes: list[NodeRecord]
    events: list[EventRecord]
    jobs: list[JobRecord] = field(default_factory=list)
    credentials: list[CredentialRecord] = field(default_factory=list)


class Store(Protocol):
    async def load_nodes(self) -> list[NodeRecord]:
        """Every node record, at its current revision."""
        ...

    async def load_jobs(self) -> list[JobRecord]:
        """Every job record, at its current revision."""
        ...

    async def load_credentials(self) -> list[CredentialRecord]:
        """Every credential record, at its current revision, by key."""
        ...

    async def commit(self, *, nodes: Sequence[NodeRecord] = (), events: Sequence[EventRecord] = (),
                     jobs: Sequence[JobRecord] = (), credentials: Sequence[CredentialRecord] = ()) -> Committed:
        """Atomically write `nodes`, `jobs` and `credentials` and append `events`.

        Each record is compared on its `revision` (0 = must not exist yet); if any differs from the
        store's, nothing is written and RevisionConflict is raised. A job record with `deleted` set is
        removed (an ended job's, past the retention). Returns the records with their
        new revisions and the events with their sequence numbers.
        """
        ...

    async def list_events(
        self, *, after_seq: int = 0, limit: int = 1000, node: str = "", job: str = ""
    ) -> list[EventRecord]:
        """Events with seq > after_seq (any int >= 0), oldest first, at most `limit`, optionally for one node/job."""
        ...

    async def last_event_seq(self) -> int: ...

    async def close(self) -> None: ...
