"""gRPC settings every Phalanx process shares: deadlines, message limits and keepalive."""

from __future__ import annotations

# Every client call takes this deadline unless the call site says why it needs another.
DEFAULT_TIMEOUT_S = 5.0

# Requests larger than this are refused by the application with INVALID_ARGUMENT and a message
# that says so; the transport limit above it is a backstop (gRPC answers RESOURCE_EXHAUSTED).
MAX_REQUEST_BYTES = 1 << 20
MAX_TRANSPORT_BYTES = 16 << 20

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
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
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
