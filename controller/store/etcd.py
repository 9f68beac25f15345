"""The etcd store: the controller's records in an etcd cluster (v3 API), for a highly available control plane.

Layout under a prefix (default ``/phalanx/``)::

    nodes/NAME            one node record (JSON)
    jobs/ID               one job record (JSON: state, data)
    credentials/KEY       one credential record (its JSON as it is): tokens, enrolled keys, revocations
    events/LAST_SEQ       the events of one commit (JSON list), keyed by the last seq they hold
    meta/events           {"last_seq": N}: the event counter
    leader                the elected controller (controller/ha.py), bound to its lease

A record's revision is its key's ``mod_revision``; every write is one etcd transaction comparing the
revision of each record it writes (``create_revision == 0`` for a new one), the event counter's, and,
for a fenced store (the elected leader's), the leader key's ``create_revision``: a controller that
lost its lease cannot commit anything, whatever it still believes.

etcd refuses a transaction of more than ``--max-txn-ops`` operations (128 by default): a commit of more
records than that is written in several transactions, each all-or-nothing, its events with the last.
Old events are deleted as new ones arrive (``max_events``) and etcd's history is compacted behind them.

The gRPC messages and stubs are etcd's own API as generated in the ``aetcd`` package (which imports with
the protobuf major version Phalanx pins); the connection is ours, because it needs mutual TLS and
several endpoints, which aetcd's client does not do.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from aetcd import rpc

from controller.errors import RevisionConflict, StoreError
from controller.nodes.states import NodeState
from controller.store.base import Committed, CredentialRecord, EventRecord, JobRecord, NodeRecord
from phalanx import log

logger = log.get("etcd")

_SEQ_DIGITS = 20
_ENDPOINT_CODES = (grpc.StatusCode.UNAVAILABLE,)  # the request never reached a member that could serve it
# Every request asks the member to have a raft leader (etcd's "require leader" metadata): one cut off from its peers
# answers UNAVAILABLE ("etcdserver: no leader") at once, and the next member is asked, where without it the request
# waited out its deadline on that member, every time.
REQUIRE_LEADER = (("hasleader", "true"),)
# A member that answers nothing in time (stopped, wedged, or a host gone without a reset) is left for the next one
# too; the request is asked again there only if asking twice cannot apply it twice.
_ASK_AGAIN = frozenset({"Range", "LeaseGrant", "LeaseRevoke", "LeaseTimeToLive", "MemberList", "Status"})
# etcd refuses a request above --max-request-bytes (1.5 MiB by default): a group commit stops short of this, and a
# commit larger than this alone is written in pieces.
TXN_BYTES = 1 << 20
COMPACT_EVERY = 1000  # commits between history compactions
HISTORY_KEPT = 10_000  # revisions of history left behind a compaction (watchers that fell behind less resume)


class NotLeader(StoreError):
    """The store is fenced to a leadership that no longer holds: this controller was deposed."""


@dataclass(frozen=True)
class EtcdTls:
    ca: bytes
    cert: bytes
    key: bytes


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class Etcd:
    """A connection to an etcd cluster: one endpoint at a time, the next when one is unreachable."""

    def __init__(self, endpoints: Sequence[str], tls: EtcdTls | None = None, timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise StoreError("no etcd endpoints configured")
        self.endpoints = list(endpoints)
        self.tls = tls
        self.timeout_s = timeout_s
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self.kv: rpc.KVStub | None = None
        self.lease: rpc.LeaseStub | None = None
        self.watch_stub: rpc.WatchStub | None = None
        self.cluster: rpc.ClusterStub | None = None
        self.maintenance: rpc.MaintenanceStub | None = None
        self._closed = False
        self._closing: dict[asyncio.Task, grpc.aio.Channel] = {}  # old channels closing after a grace (_next_endpoint)

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._index]

    OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
               ("grpc.keepalive_time_ms", 5000), ("grpc.keepalive_timeout_ms", 2000),
               ("grpc.max_receive_message_length", 64 << 20)]

    def _connect(self) -> None:
        self._channel = self.channel(self.endpoint, grpc.aio)
        self._connect_stubs()

    def channel(self, target: str, flavour=grpc) -> grpc.Channel | grpc.aio.Channel:
        """A channel to `target` as this client makes them: `grpc` (blocking, for a thread of its own) or `grpc.aio`."""
        if self.tls is None:
            return flavour.insecure_channel(target, options=self.OPTIONS)
        creds = grpc.ssl_channel_credentials(self.tls.ca, self.tls.key, self.tls.cert)
        return flavour.secure_channel(target, creds, options=self.OPTIONS)

    def _connect_stubs(self) -> None:
        self.kv = rpc.KVStub(self._channel)
        self.lease = rpc.LeaseStub(self._channel)
        self.watch_stub = rpc.WatchStub(self._channel)
        self.cluster = rpc.ClusterStub(self._channel)
        self.maintenance = rpc.MaintenanceStub(self._channel)

    async def _next_endpoint(self, failed: grpc.aio.Channel | None = None) -> None:
        """Go to the next endpoint, unless another call that failed on `failed` (the channel it used) went on
        already. The old channel is closed in the background, after a grace as long as a request's deadline:
        closing it at once would cancel every call still on it, and those callers would get CancelledError."""
        old = self._channel
        if failed is not None and old is not failed:
            return
        self._index = (self._index + 1) % len(self.endpoints)
        self._connect()
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close(grace=self.timeout_s + 1.0))
            self._closing[task] = old
            task.add_done_callback(lambda t: self._closing.pop(t, None))

    async def call(self, service: str, method: str, request, timeout_s: float | None = None):
        """One unary call; an unreachable member is skipped for the next one (each endpoint once).

        UNAVAILABLE is retried on the next member: the member could not serve the request, so it was not applied.
        After a timeout the next call goes to the next member too, but only a request that may be asked twice (a
        read, a lease) is asked again now: a write may have been applied, and is a StoreError. Anything else is a
        StoreError."""
        if self._closed:
            raise StoreError("store is closed")
        if self._channel is None:
            self._connect()
        why = ""
        for _ in range(len(self.endpoints)):
            stub, channel = getattr(self, service), self._channel
            try:
                return await getattr(stub, method)(request, timeout=timeout_s or self.timeout_s,
                                                   metadata=REQUIRE_LEADER)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed or channel is self._channel or (task is not None and task.cancelling()):
                    raise  # this task was cancelled, or the client closed: not ours to absorb
                # The channel was closed under the call (another call left this member, and the call outlasted
                # the channel's grace): as for a timeout, ask the next member again only what may be asked twice.
                why = "CANCELLED: the client left this member for the next one"
                if method not in _ASK_AGAIN:
                    break
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name}: {e.details()}"
                timed_out = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if e.code() not in _ENDPOINT_CODES and not timed_out:
                    break
                if len(self.endpoints) > 1:
                    logger.info("etcd endpoint did not answer in time; the next one is asked from now on" if timed_out
                                else "etcd endpoint unavailable; trying the next", endpoint=self.endpoint,
                                method=method, error=e.details())
                    await self._next_endpoint(channel)
                if timed_out and method not in _ASK_AGAIN:
                    break
        code, _, details = why.partition(": ")
        raise StoreError(f"etcd {method} failed ({code}): {details} (endpoints {','.join(self.endpoints)})") from None

    async def txn(self, request: rpc.TxnRequest, timeout_s: float | None = None) -> rpc.TxnResponse:
        return await self.call("kv", "Txn", request, timeout_s)

    async def range(self, key: bytes, range_end: bytes = b"", *, limit: int = 0,
                    keys_only: bool = False) -> rpc.RangeResponse:
        return await self.call("kv", "Range", rpc.RangeRequest(key=key, range_end=range_end, limit=limit,
                                                               keys_only=keys_only))

    async def get_prefix(self, prefix: bytes, page: int = 1000) -> list:
        """Every key-value under `prefix`, in key order, read in pages at one revision."""
        return (await self.read_prefix(prefix, page=page))[0]

    async def read_prefix(self, prefix: bytes, *, modified_after: int = 0, page: int = 1000) -> tuple[list, int, int]:
        """The key-values under `prefix` last modified after revision `modified_after` (0: all of them), in key
        order, read in pages at one revision; with how many keys the prefix holds then, and that revision."""
        out, start, end, revision, count = [], prefix, prefix_end(prefix), 0, 0
        while True:
            reply = await self.call("kv", "Range", rpc.RangeRequest(
                key=start, range_end=end, limit=page, revision=revision,
                min_mod_revision=modified_after + 1 if modified_after else 0))
            if not revision:  # the first page's count is the whole prefix's (etcd counts before the filter and limit)
                count, revision = reply.count, reply.header.revision
            out.extend(reply.kvs)
            if not reply.more or not reply.kvs:
                return out, count, revision
            start = reply.kvs[-1].key + b"\0"

    async def close(self) -> None:
        self._closed = True
        for old in list(self._closing.values()):  # no grace left: the client is done
            await old.close()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


@dataclass
class _Request:
    """One commit waiting for its transaction: (key, expected revision, value) per record, its events, and
    the future that gets ({key: revision}, events with their seqs)."""

    writes: list[tuple[bytes, int, bytes | None]]  # value None: delete the key
    events: list[EventRecord]
    future: asyncio.Future

    @property
    def nbytes(self) -> int:
        """About what it adds to a transaction's size (events at a generous 300 bytes each)."""
        return sum(len(k) + len(v or b"") for k, _, v in self.writes) + 300 * len(self.events)


@dataclass(frozen=True)
class Fence:
    """Writes are conditioned on `key` having been created at `revision` (the leader's epoch)."""

    key: bytes
    revision: int


def _prefix(prefix: str) -> bytes:
    return (prefix if prefix.endswith("/") else prefix + "/").encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _node_value(r: NodeRecord) -> bytes:
    return json.dumps({"state": r.state.value, "drain_reason": r.drain_reason, "incarnation": r.incarnation,
                       "state_since_ns": r.state_since_ns, "inventory": _b64(r.inventory)}).encode()


def _node_record(name: str, kv) -> NodeRecord:
    d = json.loads(kv.value)
    return NodeRecord(name, NodeState(d["state"]), d["drain_reason"], d["incarnation"], d["state_since_ns"],
                      base64.b64decode(d["inventory"]), kv.mod_revision)


class NodeCache:
    """The node records as of `revision`, brought up to date by reading only the records modified since. A
    standby refreshes one while it waits (controller/main.py), so that its takeover reads and parses the few
    records the leader changed lately, not all of them (at 8,000 nodes, about 0.4 s on the critical path).

    Nothing is missed: a record unchanged since `revision` holds the value cached, and one changed since is read.
    Only a deletion (an operator's, by hand: the controller deletes no node record) leaves no record to read; it
    shows as the prefix holding fewer keys than the cache and the changes together, and then every record is
    read again, as when etcd's revision is behind the cache's (a cluster restored from a backup)."""

    def __init__(self, etcd: Etcd, prefix: str = "/phalanx/", page: int = 1000) -> None:
        self._etcd, self._base, self._page = etcd, _prefix(prefix) + b"nodes/", page
        self.records: dict[str, NodeRecord] = {}
        self.revision = 0  # of etcd's, as of which `records` are every node record there is (0: none read yet)
        self.read = 0  # records the last refresh read

    async def refresh(self) -> list[NodeRecord]:
        """Every node record as of now. A cancelled refresh leaves the cache as it was (it is replaced whole)."""
        kvs, count, revision = await self._etcd.read_prefix(self._base, modified_after=self.revision, page=self._page)
        records = dict(self.records)
        names = [kv.key[len(self._base):].decode() for kv in kvs]
        # Some were deleted, or etcd is behind the cache (restored from a backup): read them all again.
        if len(records.keys() | set(names)) != count or revision < self.revision:
            kvs, count, revision = await self._etcd.read_prefix(self._base, page=self._page)
            records, names = {}, [kv.key[len(self._base):].decode() for kv in kvs]
        for name, kv in zip(names, kvs, strict=True):
            records[name] = _node_record(name, kv)
        self.records, self.revision, self.read = records, revision, len(kvs)
        return list(records.values())


def _event_json(e: EventRecord) -> dict:
    return {"seq": e.seq, "kind": e.kind, "message": e.message, "time_ns": e.time_ns, "node": e.node,
            "job": e.job, "fields": e.fields}


class EtcdStore:
    """The Store protocol on etcd. Commits are applied in the order issued; those issued while a transaction is
    in flight are written together in the next one (group commit)."""

    def __init__(self, etcd: Etcd, prefix: str = "/phalanx/", max_events: int = 100_000,
                 fence: Fence | None = None, max_txn_ops: int = 128, own_client: bool = True,
                 node_cache: NodeCache | None = None, on_not_leader: Callable[[str], None] | None = None) -> None:
        self.etcd = etcd
        self.prefix = _prefix(prefix)
        self._max_events = max_events
        self.fence = fence
        self.on_not_leader = on_not_leader  # told when a commit finds the leader key is not the fence's any more
        self._max_txn_ops = max(8, max_txn_ops)
        self._own_client = own_client
        self.node_cache = node_cache  # a standby's, kept warm while it waited; None: load_nodes reads every record
        self._queue: collections.deque[_Request] = collections.deque()
        self._flusher: asyncio.Task | None = None
        self._meta: tuple[int, int] | None = None  # (last seq, mod_revision of meta/events)
        self._pruned_below = 0
        self._revision = 0  # etcd's revision after this store's last transaction (what compaction keeps history of)
        self._commits = 0
        self._closed = False

    def key(self, kind: str, name: str = "") -> bytes:
        """PREFIX + KIND/NAME; with no name, PREFIX + KIND/ (the prefix of every record of that kind)."""
        return self.prefix + f"{kind}/{name}".encode()

    # -- reads ----------------------------------------------------------------------------------

    async def load_nodes(self) -> list[NodeRecord]:
        self._check_open()
        if self.node_cache is not None:
            warm = bool(self.node_cache.revision)
            records = await self.node_cache.refresh()
            logger.info("node records loaded", nodes=len(records), read=self.node_cache.read, warm=warm)
            return records
        base = self.key("nodes", "")
        return [_node_record(kv.key[len(base):].decode(), kv) for kv in await self.etcd.get_prefix(base)]

    async def load_jobs(self) -> list[JobRecord]:
        self._check_open()
        base = self.key("jobs", "")
        out = []
        for kv in await self.etcd.get_prefix(base):
            d = json.loads(kv.value)
            out.append(JobRecord(kv.key[len(base):].decode(), d["state"], base64.b64decode(d["data"]),
                                 kv.mod_revision))
        return out

    async def load_credentials(self) -> list[CredentialRecord]:
        self._check_open()
        base = self.key("credentials", "")
        return [CredentialRecord(kv.key[len(base):].decode(), bytes(kv.value), kv.mod_revision)
                for kv in await self.etcd.get_prefix(base)]

    async def list_events(self, *, after_seq: int = 0, limit: int = 1000, node: str = "",
                          job: str = "") -> list[EventRecord]:
        self._check_open()
        if after_seq >= 10**_SEQ_DIGITS - 1:
            return []
        start = self.key("events", f"{after_seq + 1:0{_SEQ_DIGITS}d}")
        end = prefix_end(self.key("events", ""))
        out: list[EventRecord] = []
        while len(out) < limit:
            reply = await self.etcd.range(start, end, limit=64)
            for kv in reply.kvs:
                for d in json.loads(kv.value):
                    if d["seq"] <= after_seq or (node and d["node"] != node) or (job and d["job"] != job):
                        continue
                    out.append(EventRecord(d["kind"], d["message"], d["time_ns"], d["node"], d["job"],
                                           d["fields"], d["seq"]))
                    if len(out) >= limit:
                        return out
            if not reply.more or not reply.kvs:
                break
            start = reply.kvs[-1].key + b"\0"
        return out

    async def last_event_seq(self) -> int:
        self._check_open()
        return (await self._load_meta())[0]

    async def _load_meta(self) -> tuple[int, int]:
        if self._meta is None:
            reply = await self.etcd.range(self.key("meta", "events"))
            self._meta = ((json.loads(reply.kvs[0].value)["last_seq"], reply.kvs[0].mod_revision) if reply.kvs
                          else (0, 0))
        return self._meta

    # -- writes ---------------------------------------------------------------------------------

    async def commit(self, *, nodes: Sequence[NodeRecord] = (), events: Sequence[EventRecord] = (),
                     jobs: Sequence[JobRecord] = (), credentials: Sequence[CredentialRecord] = ()) -> Committed:
        self._check_open()
        if len({r.name for r in nodes}) != len(nodes) or len({j.id for j in jobs}) != len(jobs) or \
                len({c.key for c in credentials}) != len(credentials):
            raise StoreError("one commit names the same record twice")
        writes = ([(self.key("nodes", r.name), r.revision, _node_value(r)) for r in nodes]
                  + [(self.key("jobs", j.id), j.revision, None if j.deleted else
                      json.dumps({"state": j.state, "data": _b64(j.data)}).encode()) for j in jobs]
                  + [(self.key("credentials", c.key), c.revision, c.data) for c in credentials])
        request = _Request(writes, list(events), asyncio.get_running_loop().create_future())
        self._queue.append(request)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        revisions, appended = await request.future
        self._commits += 1
        if self._commits % COMPACT_EVERY == 0:
            # the store's revision, not the records': a commit of events alone (most of them) writes no record
            asyncio.get_running_loop().create_task(self._compact(self._revision))
        return Committed([r.replace(revision=revisions[self.key("nodes", r.name)]) for r in nodes], appended,
                         [j.replace(revision=revisions[self.key("jobs", j.id)]) for j in jobs],
                         [c.replace(revision=revisions[self.key("credentials", c.key)]) for c in credentials])

    async def _flush(self) -> None:
        """Group commit: the commits that queued up while a transaction was in flight go together in the next
        one (in the order they were issued), as long as they fit in one transaction and name different records.
        A burst of registrations after a takeover costs a few transactions, not one round trip each."""
        room = self._max_txn_ops - 4  # the event counter, the events, a prune and the fence
        while self._queue:
            batch = [self._queue.popleft()]
            keys = {w[0] for w in batch[0].writes}
            size, nbytes = len(batch[0].writes), batch[0].nbytes
            while self._queue and size + len(self._queue[0].writes) <= room and \
                    nbytes + self._queue[0].nbytes <= TXN_BYTES and \
                    keys.isdisjoint(w[0] for w in self._queue[0].writes):
                nxt = self._queue.popleft()
                batch.append(nxt)
                keys.update(w[0] for w in nxt.writes)
                size += len(nxt.writes)
                nbytes += nxt.nbytes
            try:
                if size > room or nbytes > TXN_BYTES:  # one commit too large for a transaction: in pieces
                    await self._write_large(batch[0], room)
                else:
                    await self._write(batch)
            except BaseException as e:  # every waiter hears of it, and the flusher goes on
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(e if isinstance(e, Exception) else StoreError(repr(e)))
                if not isinstance(e, Exception):
                    raise

    async def _write_large(self, request: _Request, room: int) -> None:
        """Its records in transactions of at most `room` records and TXN_BYTES, its events with the last."""
        pieces: list[list] = [[]]
        nbytes = 0
        for write in request.writes:
            size = len(write[0]) + len(write[2] or b"")
            if pieces[-1] and (len(pieces[-1]) >= room or nbytes + size > TXN_BYTES):
                pieces.append([])
                nbytes = 0
            pieces[-1].append(write)
            nbytes += size
        revisions: dict[bytes, int] = {}
        appended: list[EventRecord] = []
        for i, writes in enumerate(pieces):
            last = i == len(pieces) - 1
            part = _Request(writes, request.events if last else [], asyncio.get_running_loop().create_future())
            await self._write([part])
            part_revisions, part_events = part.future.result()
            revisions.update(part_revisions)
            appended = part_events
        request.future.set_result((revisions, appended))

    async def _write(self, batch: list[_Request]) -> None:
        """One transaction for every request of `batch`; a request whose records changed under it fails alone
        (RevisionConflict) and the others are written without it."""
        for _attempt in range(len(batch) + 3):
            compares, ops, failure = [], [], []
            for request in batch:
                for key, revision, value in request.writes:
                    compares.append(rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL,
                                                mod_revision=revision) if revision else
                                    rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                                create_revision=0))
                    ops.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)) if value is None
                               else rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value)))
                    failure.append(rpc.RequestOp(request_range=rpc.RangeRequest(key=key, keys_only=True)))
            last_seq, meta_revision = await self._load_meta()
            appended: list[list[EventRecord]] = []
            seq = last_seq
            for request in batch:
                appended.append([EventRecord(**{**e.__dict__, "fields": dict(e.fields), "seq": seq + i + 1})
                                 for i, e in enumerate(request.events)])
                seq += len(request.events)
            pruned = False
            if seq > last_seq:
                compares.append(rpc.Compare(key=self.key("meta", "events"), target=rpc.Compare.MOD,
                                            result=rpc.Compare.EQUAL, mod_revision=meta_revision))
                ops.append(rpc.RequestOp(request_put=rpc.PutRequest(
                    key=self.key("meta", "events"), value=json.dumps({"last_seq": seq}).encode())))
                ops.append(rpc.RequestOp(request_put=rpc.PutRequest(
                    key=self.key("events", f"{seq:0{_SEQ_DIGITS}d}"),
                    value=json.dumps([_event_json(e) for events in appended for e in events]).encode())))
                cutoff = seq - self._max_events + 1
                if cutoff > self._pruned_below + max(1, self._max_events // 100):
                    # batches whose last seq is below the cutoff: wholly older than the newest max_events
                    ops.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
                        key=self.key("events", ""), range_end=self.key("events", f"{cutoff:0{_SEQ_DIGITS}d}"))))
                    pruned = True
            if self.fence is not None:
                compares.append(rpc.Compare(key=self.fence.key, target=rpc.Compare.CREATE,
                                            result=rpc.Compare.EQUAL, create_revision=self.fence.revision))
                failure.append(rpc.RequestOp(request_range=rpc.RangeRequest(key=self.fence.key, keys_only=True)))
            reply = await self.etcd.txn(rpc.TxnRequest(compare=compares, success=ops, failure=failure))
            if reply.succeeded:
                self._revision = max(self._revision, reply.header.revision)
                if seq > last_seq:
                    self._meta = (seq, reply.header.revision)
                    if pruned:
                        self._pruned_below = seq - self._max_events + 1
                for request, events in zip(batch, appended, strict=True):
                    request.future.set_result(({w[0]: reply.header.revision for w in request.writes}, events))
                return
            failed = self._conflicts(batch, reply)
            for request, error in failed:
                request.future.set_exception(error)
            batch = [r for r in batch if not r.future.done()]
            if not batch:
                return
            if not failed:  # only the event counter moved (another writer appended events): read it again
                self._meta = None
        raise StoreError("the event counter keeps changing under this controller: is another controller writing "
                         "to the same etcd prefix without being elected?")

    def _conflicts(self, batch: list[_Request], reply: rpc.TxnResponse) -> list[tuple[_Request, Exception]]:
        found = [r.response_range.kvs[0] if r.response_range.kvs else None for r in reply.responses]
        if self.fence is not None:
            leader = found.pop()
            if leader is None or leader.create_revision != self.fence.revision:
                error = NotLeader(f"not the leader any more (elected at revision {self.fence.revision}, "
                                  f"leader key now {'absent' if leader is None else leader.create_revision})")
                if self.on_not_leader is not None:
                    self.on_not_leader(str(error))
                raise error
        failed = []
        kvs = iter(found)
        for request in batch:
            for key, expected, _ in request.writes:
                kv = next(kvs)
                actual = kv.mod_revision if kv is not None else 0
                if actual != expected and not any(r is request for r, _ in failed):
                    what = key[len(self.prefix):].decode().replace("nodes/", "node ", 1).replace("jobs/", "job ", 1) \
                        .replace("credentials/", "credential ", 1)
                    failed.append((request, RevisionConflict(what, expected, actual)))
        return failed

    async def _compact(self, revision: int) -> None:
        if revision <= HISTORY_KEPT:
            return
        try:
            await self.etcd.call("kv", "Compact", rpc.CompactionRequest(revision=revision - HISTORY_KEPT))
        except StoreError as e:
            if "compacted" not in str(e):
                logger.warning("etcd history compaction failed; will try again later", error=str(e))

    async def close(self) -> None:
        self._closed = True
        if self._own_client:
            await self.etcd.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")
