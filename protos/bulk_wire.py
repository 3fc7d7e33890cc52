"""The bulk port's framing (protos/shardserve.proto, BulkSession), shared by server/bulk_reads.py and
client/tcp_reads.py so the two sides cannot drift: all integers little-endian."""
from __future__ import annotations

import socket
import struct
import time

TICKET_BYTES = 16                  # the one-time ticket a connection starts with
FRAME = struct.Struct("<II")       # before each request: its kind and length
KIND_READ, KIND_LOOKUP = 1, 2      # a ReadRegionRequest (answer: the box's bytes) or a LookupRequest (a LookupReply)
MAX_REQUEST_BYTES = 8 << 20        # one request frame (a lookup of ~1M ids)
HEADER = struct.Struct("<IIQ")     # before each answer: status (gRPC code, 0 = OK), reserved (0), length


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from `sock`: ConnectionError if the peer closes first, TimeoutError past `deadline`
    (time.monotonic; None = only the socket's own timeout per call)."""
    received = 0
    while received < len(view):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"bulk transfer timed out after {received} of {len(view)} bytes")
        count = sock.recv_into(view[received:])
        if not count:
            raise ConnectionError(f"the peer closed the connection after {received} of {len(view)} bytes")
        received += count
