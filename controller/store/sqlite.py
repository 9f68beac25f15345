"""SQLite store (WAL, synchronous=FULL): the default, on one controller host.

All database work runs on one dedicated thread, in submission order, so the event loop never
blocks on fsync and commits apply in the order the controller issued them. Commits issued while a
transaction is being written are written together in the next one (group commit: one fsync).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import json
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from controller.errors import RevisionConflict, StoreError
from controller.nodes.states import NodeState
from controller.store.base import Committed, CredentialRecord, EventRecord, JobRecord, NodeRecord

T = TypeVar("T")

SCHEMA_VERSION = 1
MAX_GROUP = 1000  # commits written in one transaction at most
_MAX_SEQ = 2**63 - 1  # SQLite INTEGER is a signed 64-bit number
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    drain_reason TEXT NOT NULL,
    incarnation INTEGER NOT NULL,
    state_since_ns INTEGER NOT NULL,
    inventory BLOB NOT NULL,
    revision INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    time_ns INTEGER NOT NULL,
    kind TEXT NOT NULL,
    node TEXT NOT NULL,
    job TEXT NOT NULL,
    message TEXT NOT NULL,
    fields TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    data BLOB NOT NULL,
    revision INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS credentials (
    key TEXT PRIMARY KEY,
    data BLOB NOT NULL,
    revision INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_node ON events (node, seq);
CREATE INDEX IF NOT EXISTS events_job ON events (job, seq);
"""


class SqliteStore:
    def __init__(self, path: str | Path, max_events: int = 100_000) -> None:
        self._path = Path(path)
        self._max_events = max_events
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._db: sqlite3.Connection | None = None
        self._queue: collections.deque = collections.deque()  # (nodes, events, jobs, future) awaiting a transaction
        self._flusher: asyncio.Task | None = None
        try:
            self._pool.submit(self._open).result()
        except (sqlite3.Error, OSError) as e:
            self._pool.shutdown()
            raise StoreError(f"cannot open state database {self._path}: {e}") from e

    def _open(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(_SCHEMA)
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta VALUES ('schema_version', ?), ('revision', 0)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {row[0]}, this controller reads {SCHEMA_VERSION}")
        self._db = db

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._db is None:
            raise StoreError("store is closed")
        db = self._db
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, db)
        except sqlite3.Error as e:
            raise StoreError(f"state database {self._path}: {e}") from e
        except RuntimeError as e:  # executor shut down under us
            raise StoreError(f"state database {self._path}: {e}") from e

    async def load_nodes(self) -> list[NodeRecord]:
        def read(db: sqlite3.Connection) -> list[NodeRecord]:
            rows = db.execute(
                "SELECT name, state, drain_reason, incarnation, state_since_ns, inventory, revision"
                " FROM nodes ORDER BY name"
            ).fetchall()
            return [
                NodeRecord(name, NodeState(state), reason, inc, since, bytes(inv), rev)
                for name, state, reason, inc, since, inv, rev in rows
            ]

        return await self._run(read)

    async def load_jobs(self) -> list[JobRecord]:
        def read(db: sqlite3.Connection) -> list[JobRecord]:
            rows = db.execute("SELECT id, state, data, revision FROM jobs ORDER BY id").fetchall()
            return [JobRecord(id_, state, bytes(data), rev) for id_, state, data, rev in rows]

        return await self._run(read)

    async def load_credentials(self) -> list[CredentialRecord]:
        def read(db: sqlite3.Connection) -> list[CredentialRecord]:
            rows = db.execute("SELECT key, data, revision FROM credentials ORDER BY key").fetchall()
            return [CredentialRecord(key, bytes(data), rev) for key, data, rev in rows]

        return await self._run(read)

    async def commit(self, *, nodes: Sequence[NodeRecord] = (), events: Sequence[EventRecord] = (),
                     jobs: Sequence[JobRecord] = (), credentials: Sequence[CredentialRecord] = ()) -> Committed:
        if len({r.name for r in nodes}) != len(nodes) or len({j.id for j in jobs}) != len(jobs) or \
                len({c.key for c in credentials}) != len(credentials):
            raise StoreError("one commit names the same record twice")
        if self._db is None:
            raise StoreError("store is closed")
        future: asyncio.Future[Committed] = asyncio.get_running_loop().create_future()
        self._queue.append((list(nodes), list(events), list(jobs), list(credentials), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        """Group commit: the commits queued while one transaction was being written go in the next one, each
        in a savepoint of its own (one that conflicts is rolled back alone), with one fsync for all."""
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_GROUP))]
            try:
                results = await self._run(functools.partial(self._write, batch=batch))
            except BaseException as e:  # every waiter hears of it, and the flusher goes on
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(e if isinstance(e, Exception) else StoreError(repr(e)))
                if not isinstance(e, Exception):
                    raise
                continue
            for (*_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _write(self, db: sqlite3.Connection, batch: list) -> list[Committed | Exception]:
        db.execute("BEGIN IMMEDIATE")
        try:
            results: list[Committed | Exception] = []
            for nodes, events, jobs, credentials, _ in batch:
                db.execute("SAVEPOINT one")
                try:
                    results.append(self._apply(db, nodes, events, jobs, credentials))
                    db.execute("RELEASE one")
                except RevisionConflict as e:
                    db.execute("ROLLBACK TO one")
                    db.execute("RELEASE one")
                    results.append(e)
            db.execute("COMMIT")
            return results
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _apply(self, db: sqlite3.Connection, nodes: list[NodeRecord], events: list[EventRecord],
               jobs: list[JobRecord], credentials: list[CredentialRecord]) -> Committed:
        for cred in credentials:
            row = db.execute("SELECT revision FROM credentials WHERE key=?", (cred.key,)).fetchone()
            actual = row[0] if row else 0
            if actual != cred.revision:
                raise RevisionConflict(f"credential {cred.key}", cred.revision, actual)
        for record in nodes:
            row = db.execute("SELECT revision FROM nodes WHERE name=?", (record.name,)).fetchone()
            actual = row[0] if row else 0
            if actual != record.revision:
                raise RevisionConflict(f"node {record.name}", record.revision, actual)
        for job in jobs:
            row = db.execute("SELECT revision FROM jobs WHERE id=?", (job.id,)).fetchone()
            actual = row[0] if row else 0
            if actual != job.revision:
                raise RevisionConflict(f"job {job.id}", job.revision, actual)
        revision = db.execute("SELECT value FROM meta WHERE key='revision'").fetchone()[0] + 1
        db.execute("UPDATE meta SET value=? WHERE key='revision'", (revision,))
        written = [r.replace(revision=revision) for r in nodes]
        db.executemany(
            "INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(r.name, r.state.value, r.drain_reason, r.incarnation, r.state_since_ns, r.inventory, revision)
             for r in written],
        )
        written_jobs = [j.replace(revision=revision) for j in jobs]
        db.executemany("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?)",
                       [(j.id, j.state, j.data, revision) for j in written_jobs if not j.deleted])
        db.executemany("DELETE FROM jobs WHERE id=?", [(j.id,) for j in written_jobs if j.deleted])
        written_credentials = [c.replace(revision=revision) for c in credentials]
        db.executemany("INSERT OR REPLACE INTO credentials VALUES (?, ?, ?)",
                       [(c.key, c.data, revision) for c in written_credentials])
        appended = []
        for e in events:
            cur = db.execute(
                "INSERT INTO events (time_ns, kind, node, job, message, fields) VALUES (?, ?, ?, ?, ?, ?)",
                (e.time_ns, e.kind, e.node, e.job, e.message, json.dumps(e.fields, sort_keys=True)),
            )
            appended.append(EventRecord(e.kind, e.message, e.time_ns, e.node, e.job, dict(e.fields), cur.lastrowid))
            if cur.lastrowid % 1000 == 0:
                db.execute("DELETE FROM events WHERE seq <= ?", (cur.lastrowid - self._max_events,))
        return Committed(written, appended, written_jobs, written_credentials)

    async def list_events(
        self, *, after_seq: int = 0, limit: int = 1000, node: str = "", job: str = ""
    ) -> list[EventRecord]:
        def read(db: sqlite3.Connection) -> list[EventRecord]:
            sql = "SELECT seq, time_ns, kind, node, job, message, fields FROM events WHERE seq > ?"
            # a uint64 cursor from the wire may pass SQLite's int64; no seq is past the largest one
            args: list[object] = [min(after_seq, _MAX_SEQ)]
            if node:
                sql += " AND node = ?"
                args.append(node)
            if job:
                sql += " AND job = ?"
                args.append(job)
            sql += " ORDER BY seq LIMIT ?"
            args.append(limit)
            return [
                EventRecord(kind, message, time_ns, node_, job_, json.loads(fields), seq)
                for seq, time_ns, kind, node_, job_, message, fields in db.execute(sql, args)
            ]

        return await self._run(read)

    async def last_event_seq(self) -> int:
        return await self._run(lambda db: db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0])

    async def close(self) -> None:
        if self._db is None:
            return
        db, self._db = self._db, None
        await asyncio.get_running_loop().run_in_executor(self._pool, db.close)
        self._pool.shutdown(wait=True)
