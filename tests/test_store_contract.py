"""One contract, every store: the SQLite store and the in-memory fake must behave the same."""

import asyncio
import uuid

import pytest
from aetcd import rpc

from controller.errors import RevisionConflict, StoreError
from controller.nodes.states import DOWN, DRAINED, UP
from controller.store import EventRecord, JobRecord, MemoryStore, NodeRecord, SqliteStore
from controller.store.base import CredentialRecord
from controller.store.etcd import Etcd, EtcdStore, EtcdTls, Fence, NodeCache, NotLeader
from phalanx.ports import free_port

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def make_store(request, tmp_path):
    made = []
    if request.param == "etcd":
        member = request.getfixturevalue("etcd_server")
        prefix = f"/test/{uuid.uuid4().hex}/"  # a fresh keyspace per test, on the session's etcd

    def make(max_events=100_000):
        if request.param == "memory":
            store = MemoryStore(max_events)
        elif request.param == "sqlite":
            store = SqliteStore(tmp_path / "s.db", max_events)
        else:
            store = EtcdStore(Etcd([member.endpoint]), prefix, max_events)
        made.append(store)
        return store

    yield make
    for store in made:
        asyncio.run(store.close())


def run(coro):
    return asyncio.run(coro)


def ev(kind="node.state", node="n1", job="", **fields):
    return EventRecord(kind=kind, message=f"{kind} {node}", time_ns=1, node=node, job=job, fields=fields)


def test_create_then_compare_and_set(make_store):
    async def go():
        store = make_store()
        first = (await store.commit(nodes=[NodeRecord("n1", UP, incarnation=1)])).nodes[0]
        assert first.revision > 0
        second = (await store.commit(nodes=[first.replace(state=DRAINED, drain_reason="fan")])).nodes[0]
        assert second.revision > first.revision
        with pytest.raises(RevisionConflict) as info:
            await store.commit(nodes=[first.replace(state=DOWN)])  # stale revision
        assert (info.value.expected, info.value.actual) == (first.revision, second.revision)
        with pytest.raises(RevisionConflict):
            await store.commit(nodes=[NodeRecord("n1", UP)])  # revision 0 = must not exist
        assert await store.load_nodes() == [second]
    run(go())


def test_commit_is_all_or_nothing(make_store):
    async def go():
        store = make_store()
        a = (await store.commit(nodes=[NodeRecord("a", UP)])).nodes[0]
        with pytest.raises(RevisionConflict):
            await store.commit(nodes=[a.replace(state=DOWN), NodeRecord("b", UP, revision=7)], events=[ev()])
        assert await store.load_nodes() == [a]
        assert await store.list_events() == []
        with pytest.raises(StoreError):
            await store.commit(nodes=[a.replace(state=DOWN), a.replace(state=DRAINED)])
    run(go())


def test_jobs_compare_and_set_with_nodes_in_one_transaction(make_store):
    async def go():
        store = make_store()
        job = JobRecord("job-1", "PENDING", b"\x08\x01spec")
        out = await store.commit(jobs=[job], events=[ev(kind="job.submitted", node="", job="job-1")])
        first = out.jobs[0]
        assert first.revision > 0 and out.events[0].job == "job-1"
        node = (await store.commit(nodes=[NodeRecord("n1", UP)])).nodes[0]
        running = first.replace(state="RUNNING", data=b"more")
        with pytest.raises(RevisionConflict):  # a stale node record sinks the job write too
            await store.commit(nodes=[node.replace(revision=node.revision - 1)], jobs=[running])
        assert await store.load_jobs() == [first]
        both = await store.commit(nodes=[node.replace(state=DRAINED)], jobs=[running])
        assert both.jobs[0].revision == both.nodes[0].revision
        assert await store.load_jobs() == [both.jobs[0]]
        with pytest.raises(RevisionConflict):
            await store.commit(jobs=[first.replace(state="FAILED")])
    run(go())


def test_an_ended_jobs_record_is_deleted_on_its_revision_with_its_event(make_store):
    async def go():
        store = make_store()
        a, b = (await store.commit(jobs=[JobRecord("job-1", "SUCCEEDED", b"a"), JobRecord("job-2", "RUNNING", b"b")]
                                   )).jobs
        with pytest.raises(RevisionConflict):  # a stale revision deletes nothing
            await store.commit(jobs=[a.replace(revision=a.revision - 1, deleted=True)])
        changed = (await store.commit(jobs=[b.replace(data=b"bb")])).jobs[0]
        out = await store.commit(jobs=[a.replace(deleted=True)], events=[ev(kind="job.forgotten", node="",
                                                                             job="job-1")])
        assert out.events[0].kind == "job.forgotten"
        assert await store.load_jobs() == [changed]
        again = (await store.commit(jobs=[JobRecord("job-1", "PENDING", b"new")])).jobs[0]  # revision 0: gone
        assert {j.id: j.data for j in await store.load_jobs()} == {"job-1": b"new", "job-2": b"bb"}
        assert again.revision > 0
    run(go())


def test_credentials_compare_and_set_with_jobs_and_events(make_store):
    async def go():
        store = make_store()
        token = CredentialRecord("token/abc123", b'{"uses_left": 2}')
        out = await store.commit(credentials=[token], events=[ev(kind="cert.token", node="")])
        first = out.credentials[0]
        assert first.revision > 0 and first.key == "token/abc123"
        used = first.replace(data=b'{"uses_left": 1}')
        enrolled = CredentialRecord("node/gpu001", b'{"spki": "ab"}')
        job = (await store.commit(jobs=[JobRecord("job-1", "PENDING", b"x")])).jobs[0]
        with pytest.raises(RevisionConflict) as info:  # a stale job sinks the credentials with it
            await store.commit(jobs=[job.replace(revision=job.revision - 1)], credentials=[used, enrolled])
        assert "credential" not in str(info.value)
        assert await store.load_credentials() == [first]
        both = (await store.commit(credentials=[used, enrolled])).credentials
        assert [c.key for c in await store.load_credentials()] == ["node/gpu001", "token/abc123"]
        with pytest.raises(RevisionConflict) as info:  # two controllers spending the last use of a token
            await store.commit(credentials=[first.replace(data=b'{"uses_left": 0}')])
        assert "credential token/abc123" in str(info.value)
        with pytest.raises(RevisionConflict):
            await store.commit(credentials=[CredentialRecord("node/gpu001", b"taken")])  # must not exist yet
        assert sorted(await store.load_credentials(), key=lambda c: c.key) == sorted(both, key=lambda c: c.key)
        with pytest.raises(StoreError):
            await store.commit(credentials=[used, used])
    run(go())


def test_every_field_round_trips(make_store):
    async def go():
        store = make_store()
        record = NodeRecord("n-1.x_y", DRAINED, drain_reason="ECC 'storm' on GPU 3", incarnation=42,
                            state_since_ns=1_700_000_000_123_456_789, inventory=b"\x00\x01binary\xff")
        written = (await store.commit(nodes=[record])).nodes[0]
        assert written == record.replace(revision=written.revision)
        assert await store.load_nodes() == [written]
    run(go())


def test_events_get_increasing_seqs_and_filter(make_store):
    async def go():
        store = make_store()
        out = await store.commit(events=[ev(node="a"), ev(node="b", job="j1", why="x"), ev(node="a", job="j1")])
        seqs = [e.seq for e in out.events]
        assert seqs == sorted(seqs) and len(set(seqs)) == 3
        assert await store.last_event_seq() == seqs[-1]
        everything = await store.list_events()
        assert [e.seq for e in everything] == seqs
        assert everything[1].fields == {"why": "x"}
        assert [e.seq for e in await store.list_events(node="a")] == [seqs[0], seqs[2]]
        assert [e.seq for e in await store.list_events(job="j1")] == seqs[1:]
        assert [e.seq for e in await store.list_events(after_seq=seqs[0], limit=1)] == [seqs[1]]
    run(go())


def test_the_newest_events_are_read_backwards_with_every_filter(make_store):
    """`phalanx events` shows the newest (controller/api/control_service.py newest_events, on every store): the last
    `limit` matching events, oldest first, however sparse the matches, and none at or before after_seq."""
    from controller.api.control_service import newest_events

    async def go():
        store = make_store(max_events=1000)
        seqs = []
        for i in range(40):  # committed in batches, as the controller does; then pruned from the old end
            out = await store.commit(events=[ev(node=f"n{(i * 30 + k) % 7}", job="j1" if k == 0 else "",
                                                **({"by": "alice"} if (i * 30 + k) % 97 == 0 else {}))
                                             for k in range(30)])
            seqs += [e.seq for e in out.events]
        kept = await store.list_events(limit=10_000)
        assert len(kept) >= 1000 and [e.seq for e in kept] == list(range(kept[0].seq, seqs[-1] + 1))  # dense
        newest = await newest_events(store, 0, 5)
        assert [e.seq for e in newest] == seqs[-5:]
        assert [e.seq for e in await newest_events(store, seqs[-3], 5)] == seqs[-2:]
        for node, job, by in (("n3", "", ""), ("", "j1", ""), ("n2", "j1", ""), ("", "", "alice")):
            matching = [e.seq for e in kept if (not node or e.node == node) and (not job or e.job == job)
                        and (not by or e.fields.get("by") == by)]
            assert [e.seq for e in await newest_events(store, 0, 7, node, job, by)] == matching[-7:], (node, job, by)
            assert [e.seq for e in await newest_events(store, 0, 10_000, node, job, by)] == matching
        assert await newest_events(store, 0, 5, node="nobody") == []
        assert await newest_events(store, seqs[-1], 5) == []
    run(go())


@pytest.mark.parametrize("after_seq", [2**63 - 1, 2**63, 2**64 - 1])
def test_events_after_a_cursor_past_every_seq(make_store, after_seq):
    """ListEvents passes a uint64 from the wire straight through: past SQLite's int64, nothing comes back."""
    async def go():
        store = make_store()
        await store.commit(events=[ev()])
        assert await store.list_events(after_seq=after_seq) == []
    run(go())


def test_old_events_are_pruned(make_store):
    async def go():
        store = make_store(max_events=1000)
        for _ in range(5):
            await store.commit(events=[ev() for _ in range(1000)])
        events = await store.list_events(limit=10_000)
        assert 1000 <= len(events) <= 2000
        assert events[-1].seq == await store.last_event_seq() == 5000
    run(go())


def test_concurrent_commits_group_and_a_conflict_fails_alone(make_store):
    """Commits issued together may share a transaction (group commit): each still succeeds or fails on its own,
    in the order issued, and a record named by two of them is written by the first and conflicts in the second."""
    async def go():
        store = make_store()
        a = (await store.commit(nodes=[NodeRecord("a", UP)])).nodes[0]
        results = await asyncio.gather(
            *(store.commit(nodes=[NodeRecord(f"n{i}", UP)], events=[ev(node=f"n{i}")]) for i in range(50)),
            store.commit(nodes=[a.replace(revision=a.revision + 1000)], events=[ev(node="stale")]),  # stale
            store.commit(nodes=[a.replace(state=DRAINED)], events=[ev(node="a")]),
            store.commit(nodes=[a.replace(state=DOWN)], events=[ev(node="late")]),  # `a` just changed: conflicts
            return_exceptions=True)
        assert all(not isinstance(r, Exception) for r in results[:50])
        assert isinstance(results[50], RevisionConflict) and isinstance(results[52], RevisionConflict)
        assert results[51].nodes[0].state == DRAINED
        seqs = [r.events[0].seq for r in results[:50]] + [results[51].events[0].seq]
        assert seqs == sorted(seqs) and len(set(seqs)) == 51
        events = await store.list_events(limit=1000)
        assert [e.node for e in events] == [f"n{i}" for i in range(50)] + ["a"]  # nothing of the failed ones
        assert {n.name: n.state for n in await store.load_nodes()} == {"a": DRAINED, **{f"n{i}": UP for i in range(50)}}
    run(go())


def test_closed_store_refuses(make_store):
    async def go():
        store = make_store()
        await store.close()
        with pytest.raises(StoreError):
            await store.load_nodes()
    run(go())


def test_sqlite_survives_reopen(tmp_path):
    async def go():
        store = SqliteStore(tmp_path / "s.db")
        out = await store.commit(nodes=[NodeRecord("n1", DRAINED, drain_reason="fan")], events=[ev()],
                                 jobs=[JobRecord("job-1", "RUNNING", b"data")])
        node = out.nodes[0]
        await store.close()
        again = SqliteStore(tmp_path / "s.db")
        assert await again.load_nodes() == [node]
        assert await again.load_jobs() == out.jobs
        assert len(await again.list_events()) == 1
        later = (await again.commit(nodes=[node.replace(state=UP)])).nodes[0]
        assert later.revision > node.revision  # the revision counter is durable too
        await again.close()
    run(go())


def test_sqlite_bad_path_is_a_store_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot open state database"):
        SqliteStore(tmp_path / "file" / "s.db")


# -- etcd only ---------------------------------------------------------------------------------------

def _etcd_store(member, **kw):
    return EtcdStore(Etcd([member.endpoint]), f"/test/{uuid.uuid4().hex}/", **kw)


def test_etcd_commit_larger_than_a_transaction_is_split(etcd_server):
    async def go():
        store = _etcd_store(etcd_server, max_txn_ops=16)
        out = await store.commit(nodes=[NodeRecord(f"n{i:03d}", UP) for i in range(50)], events=[ev()])
        assert len(await store.load_nodes()) == 50 and len(out.events) == 1
        assert all(n.revision > 0 for n in out.nodes)
        again = await store.commit(nodes=[n.replace(state=DOWN) for n in out.nodes])
        assert [n.state for n in await store.load_nodes()] == [DOWN] * 50
        assert [n.revision for n in await store.load_nodes()] == [n.revision for n in again.nodes]
        await store.close()
    run(go())


def test_etcd_node_cache_reads_only_what_changed_and_sees_a_deletion(etcd_server):
    """A standby's warm cache of the node records (a takeover reads what changed since, not every record): always
    the same records as a full read, read over several pages, and a node deleted by hand is gone from it too."""
    async def go():
        store = _etcd_store(etcd_server)
        cache = NodeCache(store.etcd, store.prefix.decode(), page=50)  # several pages of changes
        warm = EtcdStore(store.etcd, store.prefix.decode(), own_client=False, node_cache=cache)
        assert await warm.load_nodes() == [] and cache.read == 0 and cache.revision > 0
        nodes = (await store.commit(nodes=[NodeRecord(f"n{i:04d}", UP, incarnation=1) for i in range(120)])).nodes
        await store.commit(events=[ev()])  # other keys change too: not read
        assert sorted(await cache.refresh(), key=lambda r: r.name) == await store.load_nodes()
        assert cache.read == 120
        changed = (await store.commit(nodes=[nodes[7].replace(state=DRAINED, drain_reason="fan")])).nodes[0]
        assert sorted(await warm.load_nodes(), key=lambda r: r.name) == await store.load_nodes()
        assert cache.read == 1 and cache.records["n0007"] == changed
        # Deleted by hand (etcdctl): nothing changed to read, but the prefix holds one key fewer.
        await store.etcd.call("kv", "DeleteRange", rpc.DeleteRangeRequest(key=store.key("nodes", "n0100")))
        assert sorted(await cache.refresh(), key=lambda r: r.name) == await store.load_nodes()
        assert "n0100" not in cache.records and len(cache.records) == 119
        assert await cache.refresh() and cache.read == 0  # nothing changed since
        # etcd behind the cache (restored from a backup): nothing looks changed since, so every record is read
        cache.revision += 1_000_000
        assert len(await cache.refresh()) == 119 and cache.read == 119
        await store.close()
    run(go())


def test_etcd_history_is_compacted_after_commits_of_events_alone(etcd_server, monkeypatch):
    """Every COMPACT_EVERY commits the store compacts etcd's history to HISTORY_KEPT revisions behind its own: it
    took the revision from the commit's records, so a commit of events alone (most of them) compacted nothing."""
    from controller.store import etcd as etcd_store
    monkeypatch.setattr(etcd_store, "COMPACT_EVERY", 3)
    monkeypatch.setattr(etcd_store, "HISTORY_KEPT", 1)

    async def go():
        store = _etcd_store(etcd_server)
        first = await store.etcd.call("kv", "Range", rpc.RangeRequest(key=store.key("meta", "events")))
        for _ in range(3):
            await store.commit(events=[ev()])
        old = rpc.RangeRequest(key=store.key("meta", "events"), revision=first.header.revision)
        for _ in range(200):  # the compaction runs in the background
            try:
                await store.etcd.call("kv", "Range", old)
            except StoreError as e:
                assert "compacted" in str(e)
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"history at revision {first.header.revision} was never compacted")
        await store.close()
    run(go())


def test_etcd_fenced_store_refuses_once_the_leader_key_changes(etcd_server):
    async def go():
        store = _etcd_store(etcd_server)
        leader = store.key("leader").rstrip(b"/")
        etcd = store.etcd
        put = await etcd.call("kv", "Put", rpc.PutRequest(key=leader, value=b"me"))
        store.fence = Fence(leader, put.header.revision)
        node = (await store.commit(nodes=[NodeRecord("n1", UP)], events=[ev()])).nodes[0]
        await etcd.call("kv", "DeleteRange", rpc.DeleteRangeRequest(key=leader))
        await etcd.call("kv", "Put", rpc.PutRequest(key=leader, value=b"someone else"))
        with pytest.raises(NotLeader, match="not the leader"):
            await store.commit(nodes=[node.replace(state=DRAINED)], events=[ev()])
        assert await store.load_nodes() == [node]  # nothing written
        assert len(await store.list_events()) == 1
        await store.close()
    run(go())


def test_etcd_skips_an_unreachable_endpoint_and_survives_reopen(etcd_server):
    async def go():
        prefix = f"/test/{uuid.uuid4().hex}/"
        dead = f"127.0.0.1:{free_port()}"
        store = EtcdStore(Etcd([dead, etcd_server.endpoint]), prefix)
        node = (await store.commit(nodes=[NodeRecord("n1", DRAINED, drain_reason="fan")], events=[ev()])).nodes[0]
        await store.close()
        again = EtcdStore(Etcd([etcd_server.endpoint]), prefix)
        assert await again.load_nodes() == [node]
        assert await again.last_event_seq() == 1
        out = await again.commit(events=[ev()])
        assert out.events[0].seq == 2
        await again.close()
        nowhere = EtcdStore(Etcd([dead]), prefix)
        with pytest.raises(StoreError, match="UNAVAILABLE"):
            await nowhere.load_nodes()
        await nowhere.close()
    run(go())


def test_etcd_leaves_a_member_that_does_not_answer_for_the_next(etcd_server):
    """A member that takes the connection and answers nothing (stopped, wedged, its host gone without a reset) timed
    out every request and was never left: only UNAVAILABLE moved the client on. Now a timeout moves it on too; a
    read or a lease is asked again at once, a write (which may have been applied) fails once; calls still on the old
    member are not cancelled by the move."""
    import socket

    async def go():
        with socket.socket() as hung:
            hung.bind(("127.0.0.1", 0))
            hung.listen(16)  # connections are taken by the kernel, and never answered
            prefix = f"/test/{uuid.uuid4().hex}/"
            etcd = Etcd([f"127.0.0.1:{hung.getsockname()[1]}", etcd_server.endpoint], timeout_s=2.0)
            # Two reads at once, one with a longer deadline: the first to time out moves the client on, and the
            # other, its channel closed under it once the grace is out, is asked again there (it was cancelled,
            # and its caller got CancelledError)
            ranges = [etcd.call("kv", "Range", rpc.RangeRequest(key=prefix.encode()), timeout_s=t) for t in (2, 30)]
            replies = await asyncio.gather(*ranges)
            assert all(r.header.revision > 0 for r in replies) and etcd.endpoint == etcd_server.endpoint
            await etcd._next_endpoint()  # back on the member that does not answer
            put = rpc.TxnRequest(success=[rpc.RequestOp(request_put=rpc.PutRequest(key=f"{prefix}k".encode(),
                                                                                   value=b"v"))])
            with pytest.raises(StoreError, match="DEADLINE_EXCEEDED"):
                await etcd.txn(put)
            assert (await etcd.txn(put)).succeeded and etcd.endpoint == etcd_server.endpoint
            store = EtcdStore(etcd, prefix, own_client=False)
            node = (await store.commit(nodes=[NodeRecord("n1", UP)])).nodes[0]
            assert await store.load_nodes() == [node]
            await etcd.close()
    run(go())


def test_etcd_a_member_without_a_raft_leader_is_left_at_once(tmp_path):
    """A member cut off from its peers has no raft leader: a request to it waited out its whole deadline (and the
    client stayed there). With etcd's require-leader metadata it answers UNAVAILABLE at once, which moves the
    client on. Here the member's two peers are stopped (SIGSTOP), so no leader is left to it."""
    import signal

    from phalanx import etcdlocal
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(str(e))
    members = etcdlocal.plan(tmp_path, 3)
    for member in members:
        etcdlocal.start(member, members)
    try:
        etcdlocal.wait_healthy(members)
        for member in members[1:]:
            member.proc.send_signal(signal.SIGSTOP)

        async def go():
            etcd = Etcd([f"127.0.0.1:{members[0].client_port}"], timeout_s=30)
            try:
                for _ in range(100):  # until the member's election timeout has passed: then it knows
                    try:
                        await etcd.call("kv", "Range", rpc.RangeRequest(key=b"/x"), timeout_s=0.5)
                    except StoreError as e:
                        if "no leader" in str(e):
                            break
                else:
                    pytest.fail("the member never said it has no leader")
                with pytest.raises(StoreError, match=r"UNAVAILABLE\): etcdserver: no leader"):  # not a timeout
                    await etcd.call("kv", "Range", rpc.RangeRequest(key=b"/x"))
            finally:
                await etcd.close()
        run(go())
    finally:
        for member in members[1:]:
            member.proc.send_signal(signal.SIGCONT)
        for member in members:
            etcdlocal.stop(member, kill=True)


def test_etcd_over_mutual_tls(tmp_path):
    from phalanx import etcdlocal, pki, tls
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(str(e))
    pki.init_ca(tmp_path / "pki")
    pki.issue(tmp_path / "pki", "etcd", "etcd", ("127.0.0.1",))
    pki.issue(tmp_path / "pki", "controller", "controller", ("127.0.0.1",))
    members = etcdlocal.plan(tmp_path, 1)
    etcdlocal.start(members[0], members, pki=tmp_path / "pki")
    try:
        etcdlocal.wait_healthy(members, pki=tmp_path / "pki")
        ident = tls.Identity.load(*(str(tmp_path / "pki" / f) for f in ("ca.crt", "controller.crt", "controller.key")))

        async def go():
            store = EtcdStore(Etcd([members[0].endpoint], EtcdTls(ident.ca, ident.cert, ident.key)), "/p/")
            assert (await store.commit(nodes=[NodeRecord("n1", UP)])).nodes[0].revision > 0
            await store.close()
            plain = EtcdStore(Etcd([members[0].endpoint], timeout_s=1), "/p/")  # no certificate: refused
            with pytest.raises(StoreError):
                await plain.load_nodes()
            await plain.close()
        run(go())
    finally:
        etcdlocal.stop(members[0])


def test_etcd_commits_larger_than_a_request_are_split_by_size(etcd_server):
    """etcd refuses a request over 1.5 MiB: one commit of 3 MB of records, and 40 concurrent ones of 100 KB, both
    go through (in several transactions)."""
    async def go():
        store = _etcd_store(etcd_server)
        big = b"\xab" * 100_000
        out = await store.commit(nodes=[NodeRecord(f"n{i:02d}", UP, inventory=big) for i in range(30)], events=[ev()])
        assert len(out.nodes) == 30 and out.events[0].seq == 1
        many = await asyncio.gather(*(store.commit(nodes=[NodeRecord(f"m{i:02d}", UP, inventory=big)])
                                      for i in range(40)))
        assert len(many) == 40
        assert len(await store.load_nodes()) == 70
        await store.close()
    run(go())


def test_etcd_with_a_ca_of_its_own_refuses_every_cluster_certificate(tmp_path):
    """Issue 39: with etcd trusting the cluster CA, any node's or user's certificate could write a job record (an
    empty run_as), delete revocations or hold the leader key. The documented set-up gives etcd a CA of its own that
    only controllers and etcd members hold (store.etcd_*): the controller reaches it, a node's certificate does
    not get past the handshake."""
    from controller import config as controller_config
    from controller.main import etcd_of
    from phalanx import etcdlocal, pki
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(str(e))
    cluster, own = tmp_path / "pki", tmp_path / "etcd-pki"
    pki.init_ca(cluster, cluster="test")
    pki.issue(cluster, "controller", "controller", ("127.0.0.1",))
    pki.issue(cluster, "node-b", "node")
    pki.init_ca(own, cluster="test-etcd")
    pki.issue(own, "etcd", "etcd", ("127.0.0.1",))
    pki.issue(own, "ctl1", "controller")
    members = etcdlocal.plan(tmp_path, 1)
    etcdlocal.start(members[0], members, pki=own)
    try:
        etcdlocal.wait_healthy(members, pki=own)
        (tmp_path / "controller.toml").write_text(
            f'[security]\nca_file = "{cluster / "ca.crt"}"\ncert_file = "{cluster / "controller.crt"}"\n'
            f'key_file = "{cluster / "controller.key"}"\n[store]\nbackend = "etcd"\n'
            f'etcd_endpoints = "{members[0].endpoint}"\netcd_ca_file = "{own / "ca.crt"}"\n'
            f'etcd_cert_file = "{own / "ctl1.crt"}"\netcd_key_file = "{own / "ctl1.key"}"\n')
        cfg = controller_config.load(str(tmp_path / "controller.toml"))

        async def go():
            store = EtcdStore(etcd_of(cfg), "/p/")
            assert (await store.commit(nodes=[NodeRecord("n1", UP)])).nodes[0].revision > 0
            await store.close()
            # the node's own certificate and key, trusting etcd's server certificate: the handshake is refused
            node = EtcdTls(*((own / "ca.crt").read_bytes(), (cluster / "node-b.crt").read_bytes(),
                             (cluster / "node-b.key").read_bytes()))
            stolen = EtcdStore(Etcd([members[0].endpoint], node, timeout_s=2), "/p/")
            with pytest.raises(StoreError):
                await stolen.load_nodes()
            await stolen.close()
        run(go())
    finally:
        etcdlocal.stop(members[0])
    (tmp_path / "half.toml").write_text(f'[store]\netcd_ca_file = "{own / "ca.crt"}"\n')
    with pytest.raises(Exception, match="go together"):
        controller_config.load(str(tmp_path / "half.toml"))
