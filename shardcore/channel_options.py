"""The gRPC channel options both halves use: the largest message, and how soon a channel tries again to connect.

gRPC's own backoff between tries grows to 2 minutes: a rank restarted after a long outage, or a standby
coordinator taking over, would be reached only at the end of a backoff that grew while it was down. Every
channel of a client and of a server to its peers tries again within a second of a failed try.

Each try keeps gRPC's own 20 s to finish connecting (its MIN_CONNECT_TIMEOUT, which C-core reads from
`grpc.min_reconnect_backoff_ms`; gRPC's doc/connection-backoff.md): set to the backoff, a try was abandoned
after 0.1-1 s, and a peer on a loaded host that accepted the connection but sent its handshake later was never
reached ("connection attempt timed out before receiving SETTINGS frame").
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
