"""The bulk port's WriteShards: a batch's request frame, then its shards' bytes on the same connection.

The connection was opened with a ticket that OpenBulkSession issued to an
authenticated caller; that caller's principal (None without client auth) must
hold the write right and cover every tensor of the batch, as WriteShards over
gRPC requires. The bytes are received straight into each shard's memory. When
the batch fails part way (a shard refused), the rest of its bytes are read and
discarded, so the answer reaches the writer and the connection stays in step.
"""

from __future__ import annotations

import socket

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.bulk_wire import recv_exactly
from shardserve.server.common.principals import WRITE, Principal
from shardserve.server.rank.errors import InvalidArgument, PermissionDenied
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes.shards import ShardBytes, checked_batch, write_batch

DRAIN_BYTES = 1 << 20


def receive_batch(
    conn: socket.socket,
    store: ShardStore,
    request: pb.WriteShardsRequest,
    principal: Principal | None,
) -> pb.WriteShardsResponse:
    """Write the batch whose bytes follow on `conn`; on a failure of the batch (not of the connection) its
    remaining bytes are drained first and the failure raised (a ConnectionError when the peer stops sending)."""
    received = 0
    try:
        if request.WhichOneof("source") is not None:
            raise InvalidArgument(
                "source: a bulk-port batch sends its bytes after the request, not in it",
                metadata={"field": "source"},
            )
        shards = checked_batch(request.shards)
        _authorize(principal, shards)

        def fill(shard: ShardBytes, view: memoryview) -> None:
            nonlocal received
            recv_exactly(conn, view)
            received += len(view)

        return pb.WriteShardsResponse(bytes_written=write_batch(store, shards, fill))
    except OSError:
        raise  # the connection itself failed: nothing left to keep in step
    except Exception:
        _drain(conn, _declared(request) - received)
        raise


def _authorize(principal: Principal | None, shards: list[ShardBytes]) -> None:
    """PERMISSION_DENIED unless the ticket's principal may write every tensor of the batch."""
    if principal is None:
        return
    if not principal.may(WRITE):
        raise PermissionDenied(
            f"principal {principal.name!r} (role {principal.role}) lacks the 'write' right that "
            f"WriteShards needs",
            metadata={"principal": principal.name, "right": WRITE},
        )
    for name in sorted({shard.name for shard in shards}):
        if not principal.covers(name):
            raise PermissionDenied(
                f"principal {principal.name!r} lacks the 'write' right on tensor {name!r} "
                f"(WriteShards)",
                metadata={"principal": principal.name, "tensor": name},
            )


def _declared(request: pb.WriteShardsRequest) -> int:
    """The bytes the writer sends after the request: what its headers declare."""
    return sum(max(0, header.nbytes) for header in request.shards)


def _drain(conn: socket.socket, nbytes: int) -> None:
    """Read and discard `nbytes` from `conn`."""
    scratch = memoryview(bytearray(min(max(nbytes, 0), DRAIN_BYTES)))
    while nbytes > 0:
        chunk = scratch[: min(nbytes, len(scratch))]
        recv_exactly(conn, chunk)
        nbytes -= len(chunk)
