"""A highly available control plane: controllers elect a leader on an etcd lease; the others stand by.

- **Campaign**: a controller grants itself a lease (``store.lease_ttl_s``) and creates the leader key bound
  to it, in one transaction that succeeds only if the key does not exist. The key's create revision is the
  leader's **epoch**: it only grows, and the leader's store is fenced on it (controller/store/etcd.py), so a
  deposed leader cannot commit anything, whatever it believes.
- **Hold**: the leader renews its lease every third of the TTL, on a thread of its own (a busy event loop
  must not cost it its lease; a wedged one, not running for LOOP_STALL_S, does). It believes it leads until the time it
  sent its last answered renewal plus the TTL granted (less a margin): etcd cannot expire the lease
  earlier, so no one else can have been elected by then. Past that instant it sends no command
  (controller/nodes/session.py checks at every send) and steps down.
- **Stand by**: the others watch the leader key and campaign the moment it is deleted (lease expired
  or revoked by a leader stopping cleanly). Meanwhile they answer ListControllers, and every other call
  with UNAVAILABLE and the leader's address in the ``phalanx-leader`` trailing metadata.
- **A dead leader's lease**: each standby also holds a TCP connection to the leader's port (``leader_gone``).
  When it closes and the port then refuses a new one, the leader's process is gone (killed, crashed): the
  standby revokes its lease rather than wait out the TTL. Safe whatever the probe gets wrong, as the fencing
  does not depend on it: a leader whose lease was revoked commits nothing more and stands by. A leader out of
  reach (a host down, a partition) refuses nothing: its lease lapses as before.
- **Members**: every controller keeps ``controllers/NAME`` (its address and start time) on a lease of
  its own, so ``phalanx controllers`` lists the standbys as well as the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from aetcd import rpc

from controller.api.node_service import ParkedSessions
from controller.errors import StoreError
from controller.store.etcd import REQUIRE_LEADER, Etcd, prefix_end
from phalanx import clock as clocks
from phalanx import log
from phalanx.clock import Clock, RealClock
from phalanx.leader import LEADER_METADATA
from phalanx.v1 import control_pb2, node_pb2

logger = log.get("ha")

MEMBER_TTL_S = 10
LOOP_STALL_S = 5.0  # a leader's event loop that has not run for this long no longer renews its lease
LOOP_TICK_S = 0.2  # how often the event loop says it runs, to the thread that renews the lease
RENEW_MARGIN = 0.1  # of the TTL: clocks drift, and the renewal's answer is not instant
PROBE_CONNECT_S = 1.0  # a connection to the leader's port not made within this long proves nothing
PROBE_PAUSE_S = 0.2  # between two connections to the leader's port (after one that was refused or short-lived)


@dataclass(frozen=True)
class Term:
    epoch: int  # the leader key's create revision
    lease: int
    since_ns: int


@dataclass(frozen=True)
class LeaderInfo:
    name: str
    address: str
    epoch: int
    since_ns: int
    parked: int = -1  # sessions parked at it when it won (-1: not said, a controller from an earlier release)


def advertise_address(listen: str, advertise: str) -> str:
    if advertise:
        return advertise
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = socket.gethostname()
    return f"{host}:{port}"


async def leader_gone(address: str, clock: Clock | None = None) -> None:
    """Returns once the process serving `address` (HOST:PORT) is gone: a connection to it was open, it closed,
    and the next one was refused (no process listens on the port any more: on the leader's host, its process
    ended). Anything else proves nothing and never returns: a port that refused from the start (a wrong
    address), a connection that cannot be made (a host down, a partition: then the lease decides), a connection
    that closes while the port still accepts (the server let an idle connection go). A name is resolved until a
    connection is made, then that connection's address is used: a refusal proves something only from the address
    the connection was open to (not from another address of the name, a moved DNS record or a shared name)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    clock = clock or RealClock()
    was_open = False  # the last connection was made, and has closed
    while True:
        try:
            reader, writer = await clocks.wait_for(clock, asyncio.open_connection(host, int(port)), PROBE_CONNECT_S)
        except ConnectionRefusedError:
            if was_open:
                return
            await clock.sleep(PROBE_PAUSE_S)
            continue
        except (OSError, TimeoutError, ValueError):
            was_open = False
            await clock.sleep(PROBE_PAUSE_S)
            continue
        opened = clock.monotonic()
        peer = writer.get_extra_info("peername")
        if peer:
            host, port = peer[0], peer[1]
        try:
            while await reader.read(4096):  # what the server sends (HTTP/2 settings) means nothing here
                pass
        except OSError:  # reset
            pass
        finally:
            writer.close()
        was_open = True
        if clock.monotonic() - opened < PROBE_PAUSE_S:  # a server that closes every connection at once: not a loop
            await clock.sleep(PROBE_PAUSE_S)


class Elector:
    def __init__(self, etcd: Etcd, prefix: str, name: str, address: str, ttl_s: int,
                 clock: Clock | None = None, probe: bool = True) -> None:
        self.etcd = etcd
        base = prefix if prefix.endswith("/") else prefix + "/"
        self.leader_key = f"{base}leader".encode()
        self.members_prefix = f"{base}controllers/".encode()
        self.name = name
        self.address = address
        self.ttl_s = ttl_s
        self.probe = probe  # revoke the lease of a leader whose process is gone (leader_gone)
        self._leader_lease = 0  # the lease of the leader seen last, while another one leads
        self._clock = clock or RealClock()
        self.term: Term | None = None
        self.valid_until = 0.0  # monotonic: this controller leads until then (if it has a term)
        self.leader: LeaderInfo | None = None  # the last leader seen (ourselves while leading)
        self.previous: LeaderInfo | None = None  # the leader seen before this controller's last win
        self.on_new_leader: Callable[[LeaderInfo], None] | None = None  # another controller was elected (Standby)
        self.parked_count: Callable[[], int] | None = None  # sessions parked here (Standby): said when it wins
        self.problem = ""  # why the control plane cannot decide (etcd unreachable), for ListControllers
        self.started_ns = self._clock.wall_ns()
        self.failovers = 0  # terms this controller won after another leader (for the metrics)
        self.terms_won = 0
        self.watches_cancelled = 0  # leader-key watches etcd cancelled (compacted past their start): each is a retry
        self._valid_lock = threading.Lock()  # valid_until: written by the renewing thread (hold)
        self._loop_seen = 0.0  # monotonic: the event loop last said it runs (hold)
        self._ended: asyncio.Future[str] | None = None  # the current term's end (hold), which depose may bring
        self._stop_renewing: threading.Event | None = None  # the current term's renewing thread stops on it

    @property
    def clock(self) -> Clock:
        """What its loops wait on (the standby's parked sessions and leader probe too)."""
        return self._clock

    def leading(self) -> bool:
        return self.term is not None and self._clock.monotonic() < self.valid_until

    # -- campaign ------------------------------------------------------------------------------

    async def campaign(self) -> Term:
        """Until this controller is the leader. Waits on the leader key while another one leads."""
        while True:
            try:
                term = await self._try()
                if self.problem:
                    logger.info("etcd reachable again", endpoint=self.etcd.endpoint)
                self.problem = ""
                if term is not None:
                    return term
                await self._wait_vacant()
            except StoreError as e:
                if not self.problem:  # once per outage, not once per try
                    logger.warning("cannot campaign: etcd unavailable; trying again", error=str(e))
                self.problem = f"etcd unavailable: {e}"
                await self._clock.sleep(0.2 + random.random() * 0.3)

    async def _try(self) -> Term | None:
        grant = await self.etcd.call("lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=self.ttl_s))
        sent = self._clock.monotonic()
        since = self._clock.wall_ns()
        parked = self.parked_count() if self.parked_count is not None else -1
        value = json.dumps({"name": self.name, "address": self.address, "since_ns": since, "parked": parked}).encode()
        reply = await self.etcd.txn(rpc.TxnRequest(
            compare=[rpc.Compare(key=self.leader_key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                 create_revision=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=self.leader_key, value=value, lease=grant.ID))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=self.leader_key))]))
        if reply.succeeded:
            self.term = Term(reply.header.revision, grant.ID, since)
            self.valid_until = sent + grant.TTL * (1 - RENEW_MARGIN)
            previous = self.previous = self.leader
            self.leader = LeaderInfo(self.name, self.address, self.term.epoch, since, parked)
            self.terms_won += 1
            if previous is not None and previous.name != self.name:
                self.failovers += 1
            logger.info("elected leader", epoch=self.term.epoch, previous=previous.name if previous else None)
            return self.term
        await self._revoke(grant.ID)
        kvs = reply.responses[0].response_range.kvs
        seen, before = self._parse_leader(kvs[0]) if kvs else None, self.leader
        self.leader = seen
        self._leader_lease = kvs[0].lease if kvs else 0
        # the store's revision as of this read, not the key's mod_revision: a leader holds its key for as long as
        # it leads, and once etcd has compacted past the key's revision a watch from there is cancelled at once,
        # and the standbys campaigned in a tight loop (a lease, a transaction and a probe each time round)
        self._seen_revision = reply.header.revision
        if seen is not None and before is not None and seen.epoch != before.epoch and seen.name != self.name \
                and self.on_new_leader is not None:
            self.on_new_leader(seen)
        return None

    @staticmethod
    def _parse_leader(kv) -> LeaderInfo | None:
        try:
            d = json.loads(kv.value)
            return LeaderInfo(d["name"], d["address"], kv.create_revision, d.get("since_ns", 0),
                              int(d.get("parked", -1)))
        except (ValueError, KeyError, TypeError):
            return None

    async def _wait_vacant(self) -> None:
        """Until the leader key is deleted (or a while has passed: then look again), or the leader's process is
        gone (then its lease is revoked: the key goes with it)."""
        if self.etcd.watch_stub is None:
            return
        leader, lease = self.leader, self._leader_lease
        probe = None
        if self.probe and leader is not None and lease and leader.name != self.name:
            probe = asyncio.create_task(leader_gone(leader.address, self._clock), name="leader probe")
        try:
            gone = await self._watch_vacant(probe)
        finally:
            if probe is not None:
                probe.cancel()
        if gone:
            logger.warning("the leader's process is gone or stopping (its port closed and refuses connections): "
                           "revoking its lease",
                           leader=leader.name, address=leader.address, epoch=leader.epoch)
            await self._revoke(lease)

    async def _watch_vacant(self, probe: asyncio.Task | None) -> bool:
        """Until the leader key is deleted, `probe` ends, or a while has passed. True if `probe` ended (the
        leader's process is gone) while the key is still there."""
        call = self.etcd.watch_stub.Watch(metadata=REQUIRE_LEADER)  # a member that loses its leader ends it
        try:
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=self.leader_key, start_revision=self._seen_revision + 1)))

            async def deleted() -> None:
                async for reply in call:
                    if reply.canceled:  # compacted past the start (or etcd let go of it): campaign again
                        self.watches_cancelled += 1
                        logger.info("the leader watch was cancelled by etcd; looking again",
                                    reason=reply.cancel_reason or f"compacted to {reply.compact_revision}")
                        return
                    if any(ev.type == rpc.Event.DELETE for ev in reply.events):
                        return

            watching = asyncio.ensure_future(deleted())
            waits = {watching} if probe is None else {watching, probe}
            gone = False  # the probe ended without an error: the leader's process is gone
            try:
                await asyncio.wait(waits, timeout=5 * self.ttl_s, return_when=asyncio.FIRST_COMPLETED)
                if probe is not None and probe.done() and not probe.cancelled():
                    if (error := probe.exception()) is None:
                        gone = True
                    else:  # a bug of the probe's: say so, and wait on the key alone (not a campaign in a tight loop)
                        logger.error("the leader probe failed", error=repr(error))
                        await asyncio.wait({watching}, timeout=5 * self.ttl_s)
            finally:
                watching.cancel()
            if watching.done() and not watching.cancelled():
                watching.result()  # (its AioRpcError)
                return False
            return gone
        except (TimeoutError, grpc.aio.AioRpcError):
            return False
        finally:
            call.cancel()

    # -- hold ----------------------------------------------------------------------------------

    async def hold(self) -> str:
        """Renew the lease while this controller leads; returns why it stopped leading.

        The renewals run on a thread of their own, with an etcd connection of their own. A leader whose event
        loop is busy (taking up ten thousand parked sessions, a ramp of registrations) must not lose its lease
        for that: the standby that wins next is as busy taking over, loses it in turn, and the control plane
        goes round in a cascade of takeovers. The thread renews only while the event loop shows that it runs
        (it has run within LOOP_STALL_S), so a leader whose loop is wedged still lets its lease lapse."""
        term = self.term
        assert term is not None
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()
        stop = threading.Event()
        self._ended, self._stop_renewing = ended, stop
        self._loop_seen = self._clock.monotonic()

        def renew() -> None:
            try:
                reason = self._renew(term, stop)
            except Exception as e:  # never silently: the main loop learns why the term ended
                reason = f"the lease renewals failed: {type(e).__name__}: {e}"
            with contextlib.suppress(RuntimeError):  # the event loop closed first (the process is ending)
                loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(reason))

        thread = threading.Thread(target=renew, name="lease", daemon=True)
        thread.start()
        try:
            while not ended.done():
                self._loop_seen = self._clock.monotonic()
                await asyncio.wait({ended}, timeout=LOOP_TICK_S)
            return ended.result()
        finally:
            with self._valid_lock:
                stop.set()
                self.term = None
                self.valid_until = 0.0
            # Its last renewal may be in flight (at most until the deadline it had): a resign, or the next term's
            # thread, should not overlap it. Bounded, so a stop never hangs on it.
            await asyncio.shield(asyncio.to_thread(thread.join, self.ttl_s))

    def depose(self, reason: str) -> None:
        """End the term now (the store found the leader key is not this term's any more: replaced while the lease
        lives, by a hand or another elector's bug): it sends no command from here on, and hold returns `reason`.
        The fencing kept the store safe already; this keeps the agents safe and the control plane honest."""
        with self._valid_lock:
            if self._stop_renewing is not None:
                self._stop_renewing.set()  # under the lock: no renewal in flight sets valid_until again
            self.valid_until = 0.0
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(reason)

    def _key_replaced(self, channel: grpc.Channel, term: Term, timeout: float) -> str | None:
        """Why this term is over though its lease lives: the leader key is gone or is another's (replaced by a
        hand on etcd). None while it is this term's, or when etcd does not answer (the renewals decide then)."""
        try:
            found = rpc.KVStub(channel).Range(rpc.RangeRequest(key=self.leader_key, keys_only=True),
                                              timeout=max(0.05, timeout), metadata=REQUIRE_LEADER)
        except grpc.RpcError:
            return None
        kv = found.kvs[0] if found.kvs else None
        if kv is not None and kv.create_revision == term.epoch:
            return None
        return (f"the leader key was {'deleted' if kv is None else 'replaced'} while its lease lived (epoch "
                f"{term.epoch}, the key now {'absent' if kv is None else kv.create_revision})")

    def _renew(self, term: Term, stop: threading.Event) -> str:
        """The lease's renewals, on the renewing thread (Elector.hold): blocking gRPC on a channel of its own (an
        asyncio one would tie it to an event loop, and gRPC's poller to that loop after the thread is gone)."""
        endpoints, index = self.etcd.endpoints, self.etcd._index
        channel = None
        try:
            while not stop.is_set():
                now = self._clock.monotonic()
                if now >= self.valid_until:
                    return "its lease could not be renewed in time"
                if now - self._loop_seen > LOOP_STALL_S:
                    return f"its event loop has not run for {now - self._loop_seen:.1f}s: the lease is let lapse"
                if channel is None:
                    channel = self.etcd.channel(endpoints[index])
                sent = self._clock.monotonic()
                left = self.valid_until - sent
                # With other members to try, a quarter of the TTL at most a try: one that does not answer leaves
                # time for another. Alone, all the time the lease has left (a slow but healthy etcd is no reason).
                timeout = min(left, self.ttl_s / 4) if len(endpoints) > 1 else left
                try:
                    replies = rpc.LeaseStub(channel).LeaseKeepAlive(
                        iter([rpc.LeaseKeepAliveRequest(ID=term.lease)]), timeout=max(0.05, timeout),
                        metadata=REQUIRE_LEADER)
                    reply = next(iter(replies), None)
                except grpc.RpcError as e:
                    logger.warning("lease renewal failed; trying again", error=f"{e.code().name}: {e.details()}",
                                   lapses_in_s=round(self.valid_until - self._clock.monotonic(), 2))
                    if len(endpoints) > 1:  # another member (a channel alone reconnects by itself)
                        channel.close()
                        channel = None
                        index = (index + 1) % len(endpoints)
                    stop.wait(0.05)
                    continue
                if reply is None or reply.TTL <= 0:
                    return "its lease expired (etcd revoked it)"
                if (replaced := self._key_replaced(channel, term, timeout)) is not None:
                    return replaced
                with self._valid_lock:
                    if stop.is_set():  # the term ended meanwhile: a later term's deadline is not this one's
                        break
                    self.valid_until = sent + reply.TTL * (1 - RENEW_MARGIN)
                stop.wait(self.ttl_s / 3)
            return "stopped"
        finally:
            if channel is not None:
                channel.close()

    async def resign(self, term: Term) -> None:
        """Give up leadership now (a clean stop): the standbys take over without waiting for the TTL."""
        self.term = None
        self.valid_until = 0.0
        await self._revoke(term.lease)

    async def _revoke(self, lease: int) -> None:
        try:
            await self.etcd.call("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease))
        except StoreError as e:
            if "lease not found" in str(e):  # revoked already (another standby, or it lapsed): what was wanted
                logger.debug("lease already gone", lease=lease)
            else:
                logger.info("could not revoke a lease (it will expire)", error=str(e))

    # -- members -------------------------------------------------------------------------------

    async def keep_member(self, stop: asyncio.Event) -> None:
        """Keep `controllers/NAME` in etcd while this process runs."""
        key = self.members_prefix + self.name.encode()
        value = json.dumps({"address": self.address, "started_ns": self.started_ns}).encode()
        lease = 0
        while not stop.is_set():
            try:
                if lease:
                    reply = await self.etcd.call("lease", "LeaseTimeToLive", rpc.LeaseTimeToLiveRequest(ID=lease))
                    if reply.TTL <= 0:
                        lease = 0
                    else:
                        async for _ in self.etcd.lease.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease)]),
                                                                       timeout=self.etcd.timeout_s,
                                                                       metadata=REQUIRE_LEADER):
                            break
                if not lease:
                    lease = (await self.etcd.call("lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=MEMBER_TTL_S))).ID
                    await self.etcd.call("kv", "Put", rpc.PutRequest(key=key, value=value, lease=lease))
            except (StoreError, grpc.aio.AioRpcError) as e:
                logger.debug("member record not renewed", error=str(e))
                lease = 0
            try:
                await clocks.wait_for(self._clock, stop.wait(), MEMBER_TTL_S / 3)
            except TimeoutError:
                pass
        if lease:
            await self._revoke(lease)

    async def describe(self) -> control_pb2.ListControllersResponse:
        """The members and the leader as etcd has them (read by leader and standbys alike)."""
        reply = control_pb2.ListControllersResponse(store="etcd", answered_by=self.name)
        try:
            members = await self.etcd.call("kv", "Range", rpc.RangeRequest(
                key=self.members_prefix, range_end=prefix_end(self.members_prefix)))
            leader = await self.etcd.call("kv", "Range", rpc.RangeRequest(key=self.leader_key))
        except StoreError as e:
            reply.problem = f"etcd unavailable: {e}"
            reply.members.append(control_pb2.ControllerMember(name=self.name, address=self.address,
                                                              leader=self.leading(),
                                                              started_unix_ns=self.started_ns))
            return reply
        info = self._parse_leader(leader.kvs[0]) if leader.kvs else None
        if info is not None:
            reply.leader, reply.leader_address, reply.epoch = info.name, info.address, info.epoch
        for kv in members.kvs:
            name = kv.key[len(self.members_prefix):].decode()
            try:
                d = json.loads(kv.value)
            except ValueError:
                continue
            is_leader = info is not None and info.name == name
            reply.members.append(control_pb2.ControllerMember(
                name=name, address=d.get("address", ""), leader=is_leader, epoch=info.epoch if is_leader else 0,
                started_unix_ns=d.get("started_ns", 0), leader_since_unix_ns=info.since_ns if is_leader else 0))
        reply.problem = self.problem
        return reply


class Standby:
    """What a controller that does not lead serves on its port: where the leader is, and the members; agents'
    sessions parked here (controller/api/node_service.py ParkedSessions), taken up if this controller leads."""

    def __init__(self, elector: Elector) -> None:
        self.elector = elector
        # A dead leader's lease lapses after its TTL (etcd looks for expired leases twice a second); then the new
        # leader loads the store and takes the parked sessions up at its event loop's pace (seconds, for 10,000).
        self.parked = ParkedSessions(elector.name, self.refuse, self._leader_address, elector.ttl_s + 5.0,
                                     elector.clock)
        elector.on_new_leader = self._new_leader
        elector.parked_count = lambda: self.parked.waiting

    def _new_leader(self, leader: LeaderInfo) -> None:
        """Another controller was elected. If fewer sessions were parked at it than here, some agents parked here
        cannot be taken up there: name it to the sessions parked here (agent/link.py follows only if its session
        is down and it is not parked at the new leader). If as many were, which is the steady state, nothing is
        sent: at 8,000 nodes the names cost this standby, and the agents, CPU in the seconds of the take-up."""
        if self.parked.waiting <= leader.parked:
            return
        self.parked.name_leader()

    def _leader_address(self) -> str:
        leader = self.elector.leader
        return leader.address if leader is not None and leader.name != self.elector.name else ""

    async def refuse(self, context: grpc.aio.ServicerContext) -> None:
        """End the call with UNAVAILABLE, and the leader's address in the trailing metadata."""
        elector = self.elector
        if address := self._leader_address():
            context.set_trailing_metadata(((LEADER_METADATA, address),))
            if elector.problem:  # what etcd said last: the leader may have lost its lease since (a hint to try)
                where = (f"the leader was {elector.leader.name} at {address} when etcd last answered "
                         f"({elector.problem})")
            else:
                where = f"the leader is {elector.leader.name} at {address}"
        else:  # the key with no value: "a standby, and it knows no leader"
            context.set_trailing_metadata(((LEADER_METADATA, ""),))
            where = ("no leader is elected yet" + (f" ({elector.problem})" if elector.problem else "")
                     + "; try again shortly")
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"controller {elector.name} is a standby: {where}")

    def handler(self) -> grpc.GenericRpcHandler:
        elector = self.elector

        async def list_controllers(request, context):
            reply = await elector.describe()
            reply.parked_sessions = self.parked.waiting
            return reply

        async def refuse(request_iterator, context):
            await self.refuse(context)

        listing = grpc.unary_unary_rpc_method_handler(
            list_controllers, request_deserializer=control_pb2.ListControllersRequest.FromString,
            response_serializer=control_pb2.ListControllersResponse.SerializeToString)
        parking = grpc.stream_stream_rpc_method_handler(
            self.parked.Session, request_deserializer=node_pb2.AgentMessage.FromString,
            response_serializer=node_pb2.ControllerMessage.SerializeToString)
        refusal = grpc.stream_stream_rpc_method_handler(refuse)

        class Handler(grpc.GenericRpcHandler):
            def service(self, call_details):
                if call_details.method == "/phalanx.v1.ControlService/ListControllers":
                    return listing
                if call_details.method == "/phalanx.v1.NodeService/Session":
                    return parking
                return refusal

        return Handler()
