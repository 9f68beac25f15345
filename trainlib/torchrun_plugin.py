"""Phalanx as torchrun's rendezvous backend.

    torchrun --rdzv-backend=phalanx --rdzv-endpoint=CONTROLLER:7370 --rdzv-id=JOB --nnodes=2 \\
             --nproc-per-node=8 train.py

With a highly available control plane, give every controller: --rdzv-endpoint=CTL1:7370,CTL2:7370,CTL3:7370;
each call goes to the leader (phalanx/leader.py), also after a change of leader.

torch finds this module through the `torchrun.handlers` entry point (`handler_creator`). Each torchrun
agent is one participant: it joins a round at the controller, waits (in bounded server-side waits,
so no call outlives its deadline), and gets its group rank, the world size and a store.

The store is fresh for every round: before joining, the agent starts a TCPStore server of its own on
a port the kernel picks, and the formed round hands everyone rank 0's. Workers reach the same store
through MASTER_ADDR/MASTER_PORT (`use_agent_store`), so a relaunched generation never reads what
the previous one wrote; reusing one store across restarts is what broke torchrun's relaunch.
The previous round's store stays up until the next round forms, so workers of other nodes that hang
on it are restarted by their agent (which sees `num_nodes_waiting`) rather than failing.

Health: each join names the Phalanx node it runs on ($PHALANX_NODE, else the short hostname). The
controller leaves a node that is FAILING, FAILED, drained or DOWN out of rounds (its torchrun agent
is told the round timed out, with the reason), and restarts a running round that has such a node,
so a spare torchrun node waiting beyond --nnodes's MAX takes its place. Before that restart, workers whose
script uses trainlib are asked to checkpoint (trainlib._rdzv_worker): the plugin leaves the round it formed in
the environment torchrun gives them (PHALANX_RDZV_RUN, PHALANX_RDZV_ROUND, PHALANX_RDZV_ENDPOINT, PHALANX_NODE).

--rdzv-conf keys: `last_call_timeout` (seconds to wait for more than min nodes, default 2),
`join_timeout` (default: torchrun's `timeout`, else 600), `read_timeout` (store operations, 60),
`hang_timeout` (a trainlib worker whose step has not gone up for max(this, 10 x the step time) is hung and
the round restarts; default 10).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils.logging import get_logger

# Under torch's logger tree, so our lines come out with torchrun's own (format, LOGLEVEL).
logger = get_logger("torch.distributed.elastic.rendezvous.phalanx")

BACKEND = "phalanx"
DEFAULT_PORT = 7370          # the controller's default listen port
DEFAULT_LAST_CALL_S = 2.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_READ_TIMEOUT_S = 60.0
WAIT_S = 2.0                 # one AwaitRound waits this long in the server; the client loops
NUM_WAITING_CACHE_S = 1.0    # torchrun asks every 0.1 s; one RPC a second per node is plenty
MAX_BACKOFF_S = 2.0


@dataclass(frozen=True)
class PluginConfig:
    targets: tuple[str, ...]  # the controllers, as gRPC targets
    run_id: str
    min_nodes: int
    max_nodes: int
    last_call_s: float
    join_timeout_s: float
    read_timeout_s: float
    local_addr: str  # what other nodes reach this node's store at
    node: str = ""  # the Phalanx node this agent runs on: the controller leaves it out of rounds while unfit
    hang_s: float = 0.0  # --rdzv-conf hang_timeout: the floor of the controller's hang rule (0 = its default)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> PluginConfig:
        """Check torchrun's parameters up front, with messages that quote the value and the rule."""
        if not params.run_id:
            raise ValueError("--rdzv-id is empty; give the job a name every node shares")
        join = _seconds(params, "join_timeout", None)
        return cls(
            targets=parse_endpoints(params.endpoint),
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            last_call_s=_seconds(params, "last_call_timeout", DEFAULT_LAST_CALL_S, allow_zero=True),
            join_timeout_s=join if join is not None else _seconds(params, "timeout", DEFAULT_JOIN_TIMEOUT_S),
            read_timeout_s=_seconds(params, "read_timeout", DEFAULT_READ_TIMEOUT_S),
            local_addr=params.local_addr or socket.getfqdn(),
            node=os.environ.get("PHALANX_NODE") or socket.gethostname().split(".")[0],
            hang_s=_seconds(params, "hang_timeout", 0.0, allow_zero=True),
        )

    @property
    def target(self) -> str:
        """The controllers as the user wrote them, for messages."""
        return ",".join(self.targets)


def _seconds(params: RendezvousParameters, key: str, default: float | None, allow_zero: bool = False) -> Any:
    value = params.get(key, default)
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key} ({value!r}) must be a number of seconds") from None
    if not (seconds >= 0 if allow_zero else seconds > 0) or seconds > 7 * 86400:
        rule = "at least 0" if allow_zero else "more than 0"
        raise ValueError(f"--rdzv-conf {key} ({value!r}) must be {rule} and at most a week")
    return seconds


_EMPTY = ("--rdzv-endpoint is empty; give the Phalanx controller's address as HOST:PORT "
          "(or set PHALANX_CONTROLLER)")


def parse_endpoints(endpoint: str) -> tuple[str, ...]:
    """Every controller of a highly available control plane, comma-separated, each as parse_endpoint takes it
    (repeats dropped); empty means $PHALANX_CONTROLLER, which may be such a list too."""
    text = endpoint.strip() or os.environ.get("PHALANX_CONTROLLER", "").strip()
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(_EMPTY)
    return tuple(dict.fromkeys(parse_endpoint(item) for item in items))


def parse_endpoint(endpoint: str) -> str:
    """HOST:PORT, [IPv6]:PORT or HOST (the controller's default port); empty means $PHALANX_CONTROLLER."""
    text = endpoint.strip() or os.environ.get("PHALANX_CONTROLLER", "").strip()
    if not text:
        raise ValueError(_EMPTY)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ("" if not rest else None)
        host_part = f"[{host}]"
    elif text.count(":") > 1:
        raise ValueError(f"--rdzv-endpoint {text!r}: write an IPv6 address as [ADDRESS]:PORT")
    else:
        host, _, port = text.partition(":")
        host_part = host
    if not host or port is None:
        raise ValueError(f"--rdzv-endpoint {text!r} must be HOST:PORT, the Phalanx controller's address")
    if not port:
        return f"{host_part}:{DEFAULT_PORT}"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--rdzv-endpoint {text!r}: the port ({port!r}) must be a number from 1 to 65535")
    return f"{host_part}:{int(port)}"


class _Forgotten(Exception):
    """The controller does not know our round (it restarted): join again."""


class PhalanxRendezvousHandler(RendezvousHandler):
    """One torchrun agent's side of the rendezvous. Every RPC carries a deadline."""

    def __init__(self, config: PluginConfig) -> None:
        from phalanx.leader import Follower
        from phalanx.rpc import CLIENT_OPTIONS
        from phalanx.tls import ClientSecurity

        self.config = config
        self.participant_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Mutual TLS (or a token) from PHALANX_CA / PHALANX_CERT / PHALANX_KEY / PHALANX_TOKEN, as for the CLI;
        # plaintext only with PHALANX_INSECURE=1.
        security = ClientSecurity.from_env()
        self._controllers = Follower(config.targets, lambda address: security.channel(address, CLIENT_OPTIONS))
        self._controllers.channel()  # the first one now: a missing certificate is an error here, not at Join
        self._round = 0
        self._attempt = 0  # next_rendezvous calls: lets the controller tell a retried Join from a new one
        self._store: Store | None = None  # this round's: the server on rank 0, a client elsewhere
        self._member: Any = None  # our place in the formed round (a RoundMember), for a controller that lost it
        self._waiting = (float("-inf"), 0)  # (asked at, answer): num_nodes_waiting's cache

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.config.run_id

    @property
    def use_agent_store(self) -> bool:
        """Workers use the round's store too: it is fresh per round, so no key prefix is needed."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        from phalanx.v1 import rendezvous_pb2 as pb

        cfg = self.config
        until = time.monotonic() + cfg.join_timeout_s
        self._attempt += 1
        server = TCPStore(cfg.local_addr, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=cfg.read_timeout_s))
        ours = pb.StoreAddress(host=cfg.local_addr, port=server.port)
        logger.info("rendezvous %r: joining as %s at %s (store %s:%d)", cfg.run_id, self.participant_id,
                    cfg.target, ours.host, ours.port)
        reply = self._join(ours, until)
        while reply.outcome == pb.ROUND_OUTCOME_WAITING:
            if time.monotonic() > until + WAIT_S:  # the server's verdict is late: say so ourselves
                raise RendezvousTimeoutError(f"rendezvous {cfg.run_id!r} did not form within {cfg.join_timeout_s:g}s "
                                             f"(round {reply.round}, {reply.joined} of {cfg.min_nodes} node(s))")
            request = pb.AwaitRoundRequest(run_id=cfg.run_id, participant_id=self.participant_id, round=reply.round,
                                           wait_s=WAIT_S)
            try:  # the deadline covers the server's bounded wait plus the usual allowance
                reply = self._call("AwaitRound", request, WAIT_S + _default_timeout(), until)
            except _Forgotten:
                reply = self._join(ours, until)
        if reply.outcome == pb.ROUND_OUTCOME_CLOSED:
            raise RendezvousClosedError(reply.message)
        if reply.outcome == pb.ROUND_OUTCOME_TIMED_OUT:
            raise RendezvousTimeoutError(reply.message)
        if reply.outcome != pb.ROUND_OUTCOME_FORMED:
            raise RendezvousStateError(f"rendezvous {cfg.run_id!r}: unexpected answer {reply.outcome}")
        host, port = reply.store.host, reply.store.port
        store: Store = server if (host, port) == (ours.host, ours.port) else TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=cfg.read_timeout_s))
        self._round, self._store = reply.round, store  # the previous round's store goes now, not earlier
        self._member = pb.RoundMember(rank=reply.rank, world_size=reply.world_size, store=ours, node=cfg.node,
                                      attempt=self._attempt, settings=pb.RoundSettings(
                                          min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes,
                                          last_call_s=cfg.last_call_s, hang_s=cfg.hang_s))
        # torchrun starts the workers after this returns, with this process's environment: trainlib in them reports
        # to the controller for this round, which asks them to checkpoint before restarting it for an unfit node.
        os.environ.update({"PHALANX_RDZV_RUN": cfg.run_id, "PHALANX_RDZV_ROUND": str(reply.round),
                           "PHALANX_RDZV_ENDPOINT": ",".join(cfg.targets), "PHALANX_NODE": cfg.node})
        self._waiting = (float("-inf"), 0)  # an answer about the old round would restart the new one at once
        logger.info("rendezvous %r: round %d formed; group rank %d of %d, store %s:%d", cfg.run_id, reply.round,
                    reply.rank, reply.world_size, host, port)
        return RendezvousInfo(store, reply.rank, reply.world_size, RendezvousStoreInfo(host, port))

    def _join(self, store: Any, until: float) -> Any:
        from phalanx.v1 import rendezvous_pb2 as pb

        cfg = self.config
        request = pb.JoinRequest(
            run_id=cfg.run_id, participant_id=self.participant_id, store=store, attempt=self._attempt,
            settings=pb.RoundSettings(min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, last_call_s=cfg.last_call_s,
                                      hang_s=cfg.hang_s),
            join_timeout_s=max(0.001, until - time.monotonic()), node=cfg.node)
        try:
            return self._call("Join", request, _default_timeout(), until)
        except _Forgotten as e:  # Join creates what it names; NOT_FOUND here is a bug, not a restart
            raise RendezvousStateError(f"rendezvous {cfg.run_id!r}: {e}") from None

    def num_nodes_waiting(self) -> int:
        from phalanx.v1 import rendezvous_pb2 as pb

        asked, answer = self._waiting
        now = time.monotonic()
        if now - asked < NUM_WAITING_CACHE_S or self._round == 0:
            return answer
        request = pb.NumNodesWaitingRequest(run_id=self.config.run_id, participant_id=self.participant_id,
                                            round=self._round, member=self._member)
        try:
            answer = self._call("NumNodesWaiting", request, _default_timeout()).waiting
        except (RendezvousError, _Forgotten) as e:  # a controller blip must not stop a healthy group
            logger.warning("rendezvous %r: cannot ask for waiting nodes: %s", self.config.run_id, e)
            answer = 0
        self._waiting = (now, answer)
        return answer

    def is_closed(self) -> bool:
        from phalanx.v1 import rendezvous_pb2 as pb

        try:
            return self._call("GetRun", pb.GetRunRequest(run_id=self.config.run_id), _default_timeout()).closed
        except _Forgotten:
            return False

    def set_closed(self) -> None:
        from phalanx.v1 import rendezvous_pb2 as pb

        self._call("SetClosed", pb.SetClosedRequest(run_id=self.config.run_id), _default_timeout())

    def shutdown(self) -> bool:
        """torchrun's agent is done: leave, and close the run so nodes still waiting stop at once (torch's
        own backends do the same). The controller forgets the run when its last node has left."""
        from phalanx.v1 import rendezvous_pb2 as pb

        request = pb.LeaveRequest(run_id=self.config.run_id, participant_id=self.participant_id, round=self._round,
                                  close_run=True)
        try:
            self._call("Leave", request, _default_timeout())
            return True
        except (RendezvousError, _Forgotten) as e:
            logger.warning("rendezvous %r: leaving failed: %s", self.config.run_id, e)
            return False
        finally:
            self._store = None
            self._controllers.close()

    def _call(self, method: str, request: Any, timeout_s: float, until: float | None = None) -> Any:
        """One RPC with its deadline, on the leading controller. While `until` allows, an unreachable controller
        is retried with backoff (it may be restarting); other errors become torch's rendezvous errors with the
        controller's message."""
        import grpc

        from phalanx.v1 import rendezvous_pb2_grpc

        def attempt(channel: grpc.Channel) -> Any:
            return getattr(rendezvous_pb2_grpc.RendezvousServiceStub(channel), method)(request, timeout=timeout_s)

        backoff = 0.2
        while True:
            try:
                # With `until`, one pass over the controllers per try (this loop waits); without, the follower's.
                return self._controllers.call(attempt, follow_s=0.0 if until is not None else None)
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
                transient = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if transient and until is not None and time.monotonic() + backoff < until:
                    logger.warning("rendezvous %r: %s to %s failed (%s); retrying", self.config.run_id, method,
                                   self.config.target, code.name)
                    time.sleep(backoff)
                    backoff = min(2 * backoff, MAX_BACKOFF_S)
                    continue
                if code == grpc.StatusCode.NOT_FOUND:
                    raise _Forgotten(details) from None
                if transient:
                    raise RendezvousConnectionError(f"cannot reach the Phalanx controller at {self.config.target} "
                                                    f"({code.name}: {details})") from None
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise RendezvousStateError(details) from None
                raise RendezvousError(f"the Phalanx controller at {self.config.target} refused {method}: "
                                      f"{code.name}: {details}") from None


def _default_timeout() -> float:
    from phalanx.rpc import DEFAULT_TIMEOUT_S

    return DEFAULT_TIMEOUT_S


def create_handler(params: RendezvousParameters) -> PhalanxRendezvousHandler:
    return PhalanxRendezvousHandler(PluginConfig.from_params(params))


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torch calls it with no arguments and registers what it returns
    (always the same function, so registering twice is harmless)."""
    return create_handler
