"""Same-host writes in place: the rank hands a writer its pending shards' memory, the writer fills it.

The fastest write there is on one host: OpenShardsForWrite answers where each
pending shard's memfd is (server/rank/shared_memory.py); the writer maps it by
/proc/<pid>/fd/<fd> and copies its tensors in once (client/paths/in_place.py);
a WriteShards naming the same shards with `written_in_place` then counts them
written. A snapshot's writers skip both calls: the coordinator's AllocateMany
opens the shards with the allocation (`open_allocated`), and its PromoteMany
counts them written (`finish_in_place`) once every writer said it is done.
Until then a shard is torn, so a writer that dies half way publishes nothing.
A segment's writes are sealed once its version is served; memory a later
version reuses stays writable only through mappings made before, which is how
a writer republishing weights fills the same memory every step.

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
from shardserve.server.common.errors import item_errors
from shardserve.server.common.principals import ANONYMOUS
from shardserve.server.common.requests import parse_dtype
from shardserve.server.rank.error_status import service_errors
from shardserve.server.rank.shared_memory import Segment
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes.shards import ShardBytes, checked_batch
from shardserve.server.rank.writes.shared import SharedWritesUnavailable


def open_for_write(
    store: ShardStore, request: pb.OpenShardsForWriteRequest
) -> list[pb.WritableSegment]:
    """The memory of each requested pending shard, in order; PATH_UNAVAILABLE when this rank cannot offer it to
    this caller (the writer then sends the bytes)."""
    _check_available(store, request.host_id)
    shards = checked_batch(request.shards)
    segments = []
    for i, shard in enumerate(shards):
        dtype = parse_dtype(shard.header.dtype, f"shards[{i}].dtype")
        with item_errors(f"shards[{i}]"), service_errors():
            found = store.access.open_in_place(
                shard.name, shard.version, shard.shard_index, dtype, shard.nbytes
            )
        if found is None:
            raise SharedWritesUnavailable(
                f"shards[{i}]: shard {shard.shard_index} of {shard.name!r} is not in shared memory "
                f"on this rank; send its bytes",
                metadata={"tensor": shard.name, "field": f"shards[{i}]"},
            )
        segments.append(_writable(*found))
    return segments


def _writable(segment: Segment, sealed: bool) -> pb.WritableSegment:
    return pb.WritableSegment(
        pid=segment.pid,
        fd=segment.fd,
        inode=segment.inode,
        device_id=segment.device_id,
        data_offset=segment.data_offset,
        nbytes=segment.nbytes,
        sealed=sealed,
    )


def open_allocated(
    store: ShardStore, versions: Sequence[tuple[str, int]], writer_host: str
) -> list[pb.WritableShard]:
    """Every shard of the newly allocated `versions` in shared memory, opened for the same-host writer the
    coordinator named (it names one only for an unauthenticated caller); none when this rank cannot offer them
    to that writer (it then sends the bytes, as after a refused OpenShardsForWrite)."""
    try:
        _check_host(store, writer_host)
    except SharedWritesUnavailable:
        return []
    return [
        pb.WritableShard(
            name=name, version=version, shard_index=index, segment=_writable(segment, sealed)
        )
        for name, version in versions
        for index, segment, sealed in store.access.open_allocated_in_place(name, version)
    ]


def finish_written(store: ShardStore, shards: Sequence[ShardBytes]) -> int:
    """Count shards filled in place as written (each must have been opened for it); the bytes written."""
    written = 0
    for i, shard in enumerate(shards):
        dtype = parse_dtype(shard.header.dtype, f"shards[{i}].dtype")
        with item_errors(f"shards[{i}]"), service_errors():
            store.access.finish_in_place(
                shard.name, shard.version, shard.shard_index, dtype, shard.nbytes
            )
        store.metrics.written(shard.name, shard.nbytes)
        written += shard.nbytes
    return written


def _check_available(store: ShardStore, writer_host: str) -> None:
    _check_host(store, writer_host)
    principal = caller()
    if principal is not None and principal.name != ANONYMOUS:
        raise SharedWritesUnavailable(
            "this rank authenticates its callers: in-place writes are for unauthenticated "
            "clusters; send the bytes"
        )


def _check_host(store: ShardStore, writer_host: str) -> None:
    if not store.shared.enabled:
        raise SharedWritesUnavailable(
            "shared: this rank does not use shared memory; send the bytes"
        )
    if writer_host != host_id():
        raise SharedWritesUnavailable(
            "host_id: the writer is not on this rank's host (or in another network or PID "
            "namespace); send the bytes"
        )
