"""An in-memory store: the fake for tests, held to the same contract as SQLite."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from controller.errors import RevisionConflict, StoreError
from controller.store.base import Committed, CredentialRecord, EventRecord, JobRecord, NodeRecord


class MemoryStore:
    def __init__(self, max_events: int = 100_000) -> None:
        self._nodes: dict[str, NodeRecord] = {}
        self._jobs: dict[str, JobRecord] = {}
        self._credentials: dict[str, CredentialRecord] = {}
        self._events: list[EventRecord] = []
        self._revision = 0
        self._seq = 0
        self._max_events = max_events
        self._closed = False

    async def load_nodes(self) -> list[NodeRecord]:
        self._check_open()
        return sorted(self._nodes.values(), key=lambda r: r.name)

    async def load_jobs(self) -> list[JobRecord]:
        self._check_open()
        return sorted(self._jobs.values(), key=lambda r: r.id)

    async def load_credentials(self) -> list[CredentialRecord]:
        self._check_open()
        return sorted(self._credentials.values(), key=lambda r: r.key)

    async def commit(self, *, nodes: Sequence[NodeRecord] = (), events: Sequence[EventRecord] = (),
                     jobs: Sequence[JobRecord] = (), credentials: Sequence[CredentialRecord] = ()) -> Committed:
        self._check_open()
        for cred in credentials:
            actual = self._credentials[cred.key].revision if cred.key in self._credentials else 0
            if actual != cred.revision:
                raise RevisionConflict(f"credential {cred.key}", cred.revision, actual)
        for record in nodes:
            actual = self._nodes[record.name].revision if record.name in self._nodes else 0
            if actual != record.revision:
                raise RevisionConflict(f"node {record.name}", record.revision, actual)
        for job in jobs:
            actual = self._jobs[job.id].revision if job.id in self._jobs else 0
            if actual != job.revision:
                raise RevisionConflict(f"job {job.id}", job.revision, actual)
        if len({r.name for r in nodes}) != len(nodes) or len({j.id for j in jobs}) != len(jobs) or \
                len({c.key for c in credentials}) != len(credentials):
            raise StoreError("one commit names the same record twice")
        self._revision += 1
        written_credentials = [c.replace(revision=self._revision) for c in credentials]
        for cred in written_credentials:
            self._credentials[cred.key] = cred
        written = [r.replace(revision=self._revision) for r in nodes]
        for record in written:
            self._nodes[record.name] = record
        written_jobs = [j.replace(revision=self._revision) for j in jobs]
        for job in written_jobs:
            if job.deleted:
                del self._jobs[job.id]
            else:
                self._jobs[job.id] = job
        appended = []
        for event in events:
            self._seq += 1
            appended.append(EventRecord(**{**event.__dict__, "fields": dict(event.fields), "seq": self._seq}))
        self._events.extend(appended)
        if len(self._events) > self._max_events:
            del self._events[: len(self._events) - self._max_events]
        return Committed(written, copy.deepcopy(appended), written_jobs, written_credentials)

    async def list_events(
        self, *, after_seq: int = 0, limit: int = 1000, node: str = "", job: str = ""
    ) -> list[EventRecord]:
        self._check_open()
        out = []
        for event in self._events:
            if event.seq <= after_seq or (node and event.node != node) or (job and event.job != job):
                continue
            out.append(event)
            if len(out) >= limit:
                break
        return copy.deepcopy(out)

    async def last_event_seq(self) -> int:
        return self._seq

    async def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")
