"""gRPC settings every Phalanx process shares: deadlines, message limits and keepalive."""

from __future__ import annotations

# Every client call takes this deadline unless the call site says why it needs another.
DEFAULT_TIMEOUT_S = 5.0

# Requests larger than this are refused by the application with INVALID_ARGUMENT and a message
# that says so; the transport limit above it is a backstop (gRPC answers RESOURCE_EXHAUSTED).
MAX_REQUEST_BYTES = 1 << 20
MAX_TRANSPORT_BYTES = 16 << 20
MAX_EVENTS_PAGE = 10_000  # the most events one ListEvents answers with (a client reads more in pages)
# CheckpointJob: the seconds the ranks have to commit when the request does not say, and the most it may say
DEFAULT_CHECKPOINT_DEADLINE_S = 120.0
MAX_CHECKPOINT_DEADLINE_S = 3600.0

_KEEPALIVE = [
    # Ping an idle connection every 10 s and give up after 5 s without an answer, so a dead peer
    # is noticed even when the application is quiet (controller restart, cable pull).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS = [
    *_KEEPALIVE,
    ("grpc.max_receive_message_length", MAX_TRANSPORT_BYTES),
    ("grpc.max_send_message_length", MAX_TRANSPORT_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # Agents ping their controller every SESSION_KEEPALIVE_MS (below): allow it, with no strikes.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
]

CLIENT_OPTIONS = [
    *_KEEPALIVE,
    ("grpc.max_receive_message_length", MAX_TRANSPORT_BYTES),
    ("grpc.max_send_message_length", MAX_TRANSPORT_BYTES),
    # The agent does its own reconnect with backoff and jitter; keep gRPC's short.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]

# The agent's session to its controller: a controller that stops answering (paused, partitioned, a
# leader frozen past its lease) is given up within about 4 s, so the agent finds the new leader well
# inside the reconnect window a takeover grants, and no live node is declared DOWN.
SESSION_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    # The controller sends little down a session; without this a client pings again only after data
    # arrives (gRPC's default: 5 minutes between pings without data).
    ("grpc.http2.min_time_between_pings_ms", 1_000),
    # ... and an unanswered ping of any kind (gRPC's own probes included) ends the connection this soon, not
    # after its default minute.
    ("grpc.http2.ping_timeout_ms", 2_000),
]


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: "ipv4:10.0.0.7:52344" -> "10.0.0.7", "ipv6:[::1]:5" -> "::1" (which
    gRPC writes URL-escaped: "ipv6:%5B::1%5D:5")."""
    from urllib.parse import unquote
    peer = unquote(peer)
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return address.rsplit(":", 1)[0].strip("[]")
