"""Clients of a highly available control plane: reach whichever controller leads.

Several controllers share one store; one leads and the others are standbys. A standby answers every call
but ListControllers with UNAVAILABLE and, when it knows the leader, the leader's HOST:PORT in the trailing
metadata `phalanx-leader`. A client (the CLI, torchrun's rendezvous handler) given the list of controllers
tries the one that answered last, then a leader a standby names, then the rest of the list in order. After
a pass in which none led it waits a little and tries again: for as long as its patience lasts while some
standby answered (an election is under way), once more when nothing answered at all (so a single dead
controller is reported about as fast as before).

Only UNAVAILABLE sends a call elsewhere. A standby refuses before doing anything and a controller that is
not reached never saw the call, so another try cannot apply a write twice; every other error is the
leader's answer and is raised as it is. (A connection cut while a call runs also reads UNAVAILABLE, and
that call may have been applied; it is tried again like the others.)
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TypeVar

import grpc

from phalanx.config import comma_list

T = TypeVar("T")

LEADER_METADATA = "phalanx-leader"  # where a standby names the leader (controller/ha.py sends it)

FOLLOW_S = 10.0       # how long a call looks for a leader while standbys say an election is under way
FIRST_PAUSE_S = 0.2   # the wait after a pass over every controller: 0.2 s, doubling, at most MAX_PAUSE_S
MAX_PAUSE_S = 1.0
CONNECT_S = 2.0       # with several controllers: one not connected within this long is passed over
# In the details of every standby's refusal (controller/ha.py), also of one that knows no leader yet.
_STANDBY = " is a standby: "


def parse_controllers(text: str) -> list[str]:
    """'HOST:PORT, HOST:PORT,...' -> the addresses in order, without blanks or repeats."""
    addresses = comma_list(text)
    if not addresses:
        raise ValueError(f"no controller address in {text!r}: give HOST:PORT, or several as HOST:PORT,HOST:PORT")
    for address in addresses:  # gRPC would dial :443 without a port, and take 99999 modulo 65536
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"controller address {address!r} must be HOST:PORT with a port from 1 to 65535, "
                             "e.g. 10.0.0.1:50051")
    return addresses


def leader_hint(error: grpc.RpcError) -> str | None:
    """The leader's HOST:PORT that a standby sent with its UNAVAILABLE; None for any other error. Takes sync
    errors and grpc.aio's AioRpcError alike (both have code() and trailing_metadata())."""
    code = getattr(error, "code", None)
    trailing = getattr(error, "trailing_metadata", None)
    if code is None or trailing is None or code() != grpc.StatusCode.UNAVAILABLE:
        return None
    for key, value in trailing() or ():
        if key == LEADER_METADATA and value:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def from_standby(error: grpc.RpcError) -> bool:
    """Whether an UNAVAILABLE came from a standby (which may not know the leader yet), not from a dead line."""
    details = getattr(error, "details", None)
    return leader_hint(error) is not None or _STANDBY in ((details() if details else None) or "")


def next_address(addresses: Sequence[str], tried: Collection[str], hint: str | None) -> str | None:
    """Where a call goes after an UNAVAILABLE: to the leader a standby named (in the list or not) unless this
    pass tried it; else to the first address this pass has not tried; None when it tried them all."""
    if hint and hint not in tried:
        return hint
    return next((a for a in addresses if a not in tried), None)


def pause_after(passes: int, standby_answered: bool, now: float, deadline: float) -> float | None:
    """The wait before another pass over the controllers, or None to give up and raise the last error."""
    pause = min(FIRST_PAUSE_S * 2 ** (passes - 1), MAX_PAUSE_S)
    if (passes > 1 and not standby_answered) or now + pause > deadline:
        return None
    return pause


class NoConnection(grpc.RpcError):
    """A controller did not connect within CONNECT_S (a host that drops packets): nothing was sent to it."""

    def __init__(self, address: str, seconds: float) -> None:
        super().__init__(f"no connection to {address} within {seconds:g}s")
        self.address, self.seconds = address, seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)

    def trailing_metadata(self) -> tuple:
        return ()


def connects(channel: grpc.Channel, timeout_s: float) -> bool:
    """Whether `channel` connects, or fails to (a refused connection, which a call then reports at once),
    within `timeout_s`; False while it is still trying when that runs out.

    Once per channel: grpc watches it from a thread that outlives unsubscribe() by up to 0.2 s, and a second
    subscription meanwhile makes that thread fail (on stderr) when the channel is closed; a channel left open
    while it runs hangs the interpreter's exit."""
    settled = threading.Event()

    def seen(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                     grpc.ChannelConnectivity.SHUTDOWN):
            settled.set()

    channel.subscribe(seen, try_to_connect=True)
    try:
        return settled.wait(timeout_s)
    finally:
        channel.unsubscribe(seen)


class Follower:
    """Calls over a list of controllers that go to the leader. One channel per address, kept until close().
    With a choice of controllers, a channel's first call waits for connects(); one that does not connect in
    time is passed over and replaced (so the next try watches a new one). A controller whose host goes down
    after its channel connected is noticed by gRPC's reconnect (UNAVAILABLE once its connect attempt fails)."""

    def __init__(self, addresses: Sequence[str], connect: Callable[[str], grpc.Channel],
                 follow_s: float = FOLLOW_S, connect_s: float = CONNECT_S,
                 monotonic: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not addresses:
            raise ValueError("no controller address")
        self.addresses = list(addresses)
        self.current = self.addresses[0]  # the one that answered last
        self.follow_s, self.connect_s = follow_s, connect_s
        self._connect, self._monotonic, self._sleep = connect, monotonic, sleep
        self._channels: dict[str, grpc.Channel] = {}
        self._checked: set[str] = set()  # channels connects() has watched: never twice (see there)
        atexit.register(self.close)  # a channel connects() watched must be closed before the interpreter exits

    def channel(self, address: str | None = None) -> grpc.Channel:
        address = address or self.current
        if address not in self._channels:
            self._channels[address] = self._connect(address)
        return self._channels[address]

    def call(self, fn: Callable[[grpc.Channel], T], follow_s: float | None = None) -> T:
        """fn(channel) on the leader's channel. `follow_s` (default self.follow_s) bounds the passes after the
        first; 0 makes one pass."""
        deadline = self._monotonic() + (self.follow_s if follow_s is None else follow_s)
        passes = 0
        while True:
            tried: set[str] = set()
            standby = False
            address: str | None = self.current
            while address is not None:
                tried.add(address)
                try:
                    result = self._attempt(address, fn)
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and len(self.addresses) > 1:
                        # No answer in time: a leader whose host went down after its channel connected (gRPC says
                        # UNAVAILABLE only once its reconnect gives up, tens of seconds later). Not asked again
                        # here (the call may have been applied); the caller's next try goes to the next controller,
                        # on a fresh channel that must connect first.
                        self._drop(address)
                        self.current = self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)] \
                            if address in self.addresses else self.addresses[0]
                        raise
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        self.current = address  # it answered: not a standby
                        raise
                    last, standby = e, standby or from_standby(e)
                    address = next_address(self.addresses, tried, leader_hint(e))
                    continue
                self.current = address
                return result
            passes += 1
            pause = pause_after(passes, standby, self._monotonic(), deadline)
            if pause is None:
                raise last
            self._sleep(pause)

    def moved(self, error: grpc.RpcError) -> bool:
        """After `error` from the current controller outside call() (a stream that broke): go to the leader it
        named and say True, or else to the next controller in the list and say False."""
        hint = leader_hint(error)
        if hint and hint != self.current:
            self.current = hint
            return True
        i = self.addresses.index(self.current) if self.current in self.addresses else -1
        self.current = self.addresses[(i + 1) % len(self.addresses)]
        return False

    def _attempt(self, address: str, fn: Callable[[grpc.Channel], T]) -> T:
        channel = self.channel(address)
        # With a choice of controllers, one whose host is down must not hold a call until its deadline.
        if (len(self.addresses) > 1 or address not in self.addresses) and address not in self._checked:
            self._checked.add(address)
            if not connects(channel, self.connect_s):
                self._drop(address)
                raise NoConnection(address, self.connect_s)
        return fn(channel)

    def _drop(self, address: str) -> None:
        self._checked.discard(address)
        if (channel := self._channels.pop(address, None)) is not None:
            channel.close()

    def close(self) -> None:
        for address in list(self._channels):
            self._drop(address)
        atexit.unregister(self.close)
