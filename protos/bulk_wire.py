"""The bulk port's framing (protos/shardserve.proto, BulkSession), shared by server/rank/reads/bulk.py and
client/paths/bulk.py so the two sides cannot drift: all integers little-endian."""

from __future__ import annotations

import socket
import ssl
import struct
import time

TICKET_BYTES = 16  # the one-time ticket a connection starts with
FRAME = struct.Struct("<II")  # before each request: its kind and length
KIND_READ, KIND_LOOKUP = (
    1,
    2,
)  # a ReadRegionRequest (answer: the box's bytes) or a LookupRequest (a LookupReply)
KIND_WRITE = 3  # a WriteShardsRequest, its shards' bytes after it (answer: a WriteShardsResponse)
KIND_READS = 4  # a ReadRegionsRequest (answer: a ReadRegionsReply)
MAX_REQUEST_BYTES = 8 << 20  # one request frame (a lookup of ~1M ids)
# Before each answer: status (gRPC code, 0 = OK), body kind (0, or STATUS_BODY for an error whose body
# is a serialized google.rpc.Status with its ErrorInfo), length.
HEADER = struct.Struct("<IIQ")
STATUS_BODY = 1
_MAX_IOV = 1024  # buffers per sendmsg (Linux IOV_MAX)
_JOIN_UNDER = (
    256 << 10
)  # over TLS (no sendmsg), parts smaller than this in all go out as one record


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from `sock`: ConnectionError if the peer closes first, TimeoutError past `deadline`
    (time.monotonic; None = only the socket's own timeout per call)."""
    received = 0
    while received < len(view):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"bulk transfer timed out after {received} of {len(view)} bytes")
        count = sock.recv_into(view[received:])
        if not count:
            raise ConnectionError(
                f"the peer closed the connection after {received} of {len(view)} bytes"
            )
        received += count


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """Send every byte of `parts`, in order, gathered by sendmsg: a header and its data go out in one call
    without being joined into a copy first (over TLS, one sendall each)."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    if isinstance(
        sock, ssl.SSLSocket
    ):  # TLS sockets have no sendmsg: small answers joined, large ones in turn
        if sum(len(view) for view in views) < _JOIN_UNDER:
            views = [memoryview(b"".join(views))]
        for view in views:
            sock.sendall(view)
        return
    while views:
        sent = sock.sendmsg(views[:_MAX_IOV])
        while sent:
            if sent < len(views[0]):
                views[0] = views[0][sent:]
                break
            sent -= len(views.pop(0))
