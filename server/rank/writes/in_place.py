"""Same-host writes in place: the rank hands a writer its pending shards' memory, the writer fills it.

The fastest write there is on one host: OpenShardsForWrite answers where each
pending shard's memfd is (server/rank/shared_memory.py); the writer maps it by
/proc/<pid>/fd/<fd> and copies its tensors in once (client/paths/in_place.py);
a WriteShards naming the same shards with `written_in_place` then counts them
written. A snapshot's writers skip both calls: the coordinator's AllocateMany
opens the shards with the allocation (`open_allocated`), and its PromoteMany
counts them written (`finish_in_place`) once every writer said it is done.
Until then a shard is torn, so nothing a writer that dies half way wrote is promoted.
A CUDA shard is handed over as a CUDA IPC handle instead (only to a writer that
asks with `cuda_ipc`, and never with an allocation): the writer copies device
to device, or host to device, straight into it. Each handle handed out counts
one user of the shard's memory in torch's IPC reference counter, which the
writer's closing it ends: memory the rank lets go of is not reused by torch's
allocator while a writer still holds it. The rank itself reuses a dropped
version's CUDA buffer for a later version (server/rank/recycling.py), and the
writer that kept its handle writes the later version through it, as it does a
reused segment; memory handed to a writer that never said it finished is never
reused.
A segment's writes are sealed once its version is served; memory a later
version reuses stays writable only through mappings made before, which is how
a writer republishing weights fills the same memory every step. A writer handed
sealed memory it never mapped (another writer's, reused) asks for those shards
again with `fresh`: the rank moves them into new memory, which that writer maps
and keeps, and lets the sealed memory go.

Authenticated callers are refused (PATH_UNAVAILABLE; they send their bytes, which
the rank copies): a writer's mapping outlives its version, and a recycled
segment may later hold a tensor that writer has no right to. The coordinator
names a snapshot's writer to the ranks only when that writer is not
authenticated.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import host_id
from shardserve.server.common.access import caller
from shardserve.server.common.principals import ANONYMOUS
from shardserve.server.common.requests import parse_dtype
from shardserve.server.rank.cuda_ipc import cuda_ipc_handle
from shardserve.server.rank.error_status import item_errors
from shardserve.server.rank.errors import PathUnavailable
from shardserve.server.rank.leases import InPlace
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes.shards import ShardBytes, checked_batch


def open_for_write(
    store: ShardStore, request: pb.OpenShardsForWriteRequest
) -> list[pb.WritableSegment]:
    """The memory of each requested pending shard, in order; PATH_UNAVAILABLE when this rank cannot offer it to
    this caller (the writer then sends the bytes)."""
    _check_available(store, request.host_id)
    shards = checked_batch(request.shards)
    opened = []
    for i, shard in enumerate(shards):
        dtype = parse_dtype(shard.header.dtype, f"shards[{i}].dtype")
        _check_device(store, shard, i, request.cuda_ipc)
        with item_errors(f"shards[{i}]"):
            found = store.leases.open_in_place(
                shard.name,
                shard.version,
                shard.shard_index,
                dtype,
                shard.nbytes,
                fresh=request.fresh,
            )
        if found is None:
            raise PathUnavailable(
                f"shards[{i}]: shard {shard.shard_index} of {shard.name!r} is not in shared memory "
                f"on this rank; send its bytes",
                metadata={"tensor": shard.name, "field": f"shards[{i}]"},
            )
        opened.append(found)
    # handles last, once every shard is opened: each one handed out counts a user of the shard's memory that
    # only the writer's opening it ends
    return [writable_segment(found) for found in opened]


def _check_device(store: ShardStore, shard: ShardBytes, i: int, cuda_ipc: bool) -> None:
    """A rank holding CUDA shards hands them only to a writer that opens CUDA IPC handles."""
    if store.device.type == "cuda" and not cuda_ipc:
        raise PathUnavailable(
            f"shards[{i}]: shard {shard.shard_index} of {shard.name!r} is on {store.device}; ask "
            f"with cuda_ipc or send its bytes",
            metadata={"tensor": shard.name, "field": f"shards[{i}]"},
        )


def writable_segment(found: InPlace) -> pb.WritableSegment:
    """The answer handing the shard `found` to a same-host writer: its segment, and its CUDA IPC handle and
    size when the shard is on a GPU (a proto field, never pickled)."""
    segment = found.segment
    writable = pb.WritableSegment(
        pid=segment.pid,
        fd=segment.fd,
        inode=segment.inode,
        device_id=segment.device_id,
        data_offset=segment.data_offset,
        nbytes=segment.nbytes,
        sealed=found.sealed,
    )
    if found.cuda is not None:
        writable.nbytes = found.cuda.numel() * found.cuda.element_size()
        writable.cuda.CopyFrom(cuda_ipc_handle(found.cuda))
    return writable


def open_allocated(
    store: ShardStore, versions: Sequence[tuple[str, int]], writer_host: str
) -> list[pb.WritableShard]:
    """Every shard of the newly allocated `versions` in shared memory, opened for the same-host writer the
    coordinator named (it names one only for an unauthenticated caller); none when this rank cannot offer them
    to that writer (it then sends the bytes, as after a refused OpenShardsForWrite)."""
    try:
        _check_host(store, writer_host)
    except PathUnavailable:
        return []
    return [
        pb.WritableShard(
            name=name,
            version=version,
            shard_index=index,
            segment=writable_segment(InPlace(segment, sealed)),
        )
        for name, version in versions
        for index, segment, sealed in store.leases.open_allocated_in_place(name, version)
    ]


def finish_written(store: ShardStore, shards: Sequence[ShardBytes]) -> int:
    """Count shards filled in place as written (each must have been opened for it); the bytes written."""
    written = 0
    for i, shard in enumerate(shards):
        dtype = parse_dtype(shard.header.dtype, f"shards[{i}].dtype")
        with item_errors(f"shards[{i}]"):
            store.leases.finish_in_place(
                shard.name, shard.version, shard.shard_index, dtype, shard.nbytes
            )
        store.metrics.written(shard.name, shard.nbytes)
        written += shard.nbytes
    return written


def _check_available(store: ShardStore, writer_host: str) -> None:
    _check_host(store, writer_host)
    principal = caller()
    if principal is not None and principal.name != ANONYMOUS:
        raise PathUnavailable(
            "this rank authenticates its callers: in-place writes are for unauthenticated "
            "clusters; send the bytes"
        )


def _check_host(store: ShardStore, writer_host: str) -> None:
    if not store.hands_over_by_reference:
        raise PathUnavailable("shared: this rank does not use shared memory; send the bytes")
    if writer_host != host_id():
        raise PathUnavailable(
            "host_id: the writer is not on this rank's host (or in another network or PID "
            "namespace); send the bytes"
        )
