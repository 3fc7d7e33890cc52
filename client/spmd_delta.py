"""Delta puts of state dicts: spmd.put_state_dict(..., delta=True) sends only the blocks that changed.

Each job rank keeps, per prefix, the block hashes (shardserve.core.delta) of every server shard it wrote in its
last delta put, with that snapshot's number, layouts and what decided them (the put's basis, as reservations
keep theirs: client/reservations.py). The next delta put with the same basis asks the coordinator for a
snapshot whose tensors are copies of the previous snapshot's, sharing their blocks on the ranks
(CreateSnapshotRequest.delta_of), hashes what it would write, and sends only the byte ranges of the blocks
whose hash changed (ShardServer.WriteBytes, client/delta_writes.py), in batches. The coordinator refuses a
previous snapshot that is no longer the prefix's newest (or whose tensors a rank lost), and the put is then made
in full, as is one with no previous hashes or another basis (a changed shape, dtype, layout or set of live
ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardserve.client.delta_writes import (
    ChangedShard,
    Hashes,
    PreviousPuts,
    Source,
    hash_all,
    previous_puts_of,
    start_hash_all,
)
from shardserve.client.delta_writes import write_changed as send_changed
from shardserve.client.errors import ShardServeError
from shardserve.client.ops.snapshots import create_snapshot
from shardserve.client.paths.writes import shard_write
from shardserve.client.session import Session
from shardserve.client.spmd_pieces import Piece
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.regions import local_view
from shardserve.core.snapshots import JobTensor, writer_of
from shardserve.core.wire import metadata_from_proto
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)

ShardKey = tuple[str, int]  # (state dict key, server shard index)


@dataclass(frozen=True)
class MyShard:
    """A server shard this job rank writes: where it goes and its bytes as stored (cast, contiguous)."""

    key: str
    name: str
    version: int
    index: int
    rank: int
    data: torch.Tensor  # the job's view, in the job's dtype
    dtype: torch.dtype  # the stored dtype
    segment: pb.WritableSegment | None


@dataclass(frozen=True)
class PreviousPut:
    """What this job rank wrote in its last delta put of a prefix: the snapshot, its layouts, the basis that
    decided them, and the block hashes of every shard it wrote with the stamps of their sources."""

    number: int
    basis: Any
    layouts: Mapping[str, ShardedTensorMetadata]
    tensors: Mapping[str, JobTensor]
    hashes: Hashes[ShardKey]


def previous_puts(session: Session) -> PreviousPuts[PreviousPut]:
    """The state-dict delta puts' memory of `session`, by prefix (gone with the session)."""
    return previous_puts_of(session, "prefix")


def create_delta(
    session: Session,
    previous: PreviousPut,
    prefix: str,
    *,
    keep: int,
    skeleton: str,
    durable: bool,
) -> bytes | None:
    """Job rank 0: a snapshot of `prefix` copying `previous` on the ranks (as bytes, for the broadcast), or
    None when the coordinator refuses it (no longer the newest, dropped, a rank lost it): the put is then in
    full. Its shards are never opened for in-place writes: they share the previous snapshot's blocks."""
    try:
        created = create_snapshot(
            session,
            prefix,
            previous.layouts,
            keep,
            skeleton=skeleton,
            durable=durable,
            delta_of=previous.number,
        )
    except ShardServeError as err:
        log.info("%r: no delta of snapshot %d (%s); putting in full", prefix, previous.number, err)
        return None
    return created.SerializeToString()


def my_shards(
    snapshot: pb.SnapshotInfo,
    tensors: Mapping[str, JobTensor],
    local: Mapping[str, list[Piece]],
    rank: int,
) -> Iterator[MyShard]:
    """Every server shard of `snapshot` whose writer is job `rank`, with the piece of the job's tensor it holds."""
    entries = {entry.key: entry for entry in snapshot.entries}
    layouts = {key: metadata_from_proto(entry.tensor.metadata) for key, entry in entries.items()}
    opened = {
        key: {shard.shard_index: shard.segment for shard in entry.writable}
        for key, entry in entries.items()
    }
    for key, index, data in my_pieces(layouts, tensors, local, rank):
        entry = entries[key]
        yield MyShard(
            key,
            entry.tensor.name,
            entry.tensor.version,
            index,
            layouts[key].shards_metadata[index].rank,
            data,
            layouts[key].dtype,
            opened[key].get(index),
        )


def my_pieces(
    layouts: Mapping[str, ShardedTensorMetadata],
    tensors: Mapping[str, JobTensor],
    local: Mapping[str, list[Piece]],
    rank: int,
) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(key, shard index, the job's view of its box) of every server shard of `layouts` whose writer is job
    `rank`."""
    for key, meta in layouts.items():
        held = dict(local[key])
        for index, shard in enumerate(meta.shards_metadata):
            writer, job_box = writer_of(shard.box, tensors[key])
            if writer != rank:
                continue
            yield (
                key,
                index,
                local_view(held[job_box], job_box, shard.box)
                if not shard.box.is_empty()
                else torch.empty(shard.box.sizes, dtype=meta.dtype),
            )


@dataclass(frozen=True)
class DeltaBase:
    """What a delta put writes against: this job rank's `previous` put of the prefix, and `hashes`, which waits
    for the block hashes of the shards the rank writes now (being made while the snapshot is created)."""

    previous: PreviousPut
    hashes: Callable[[], Hashes[ShardKey]]


def start_hashing(
    previous: PreviousPut,
    local: Mapping[str, list[Piece]],
    rank: int,
    *,
    counters: Mapping[str, torch.Tensor],
    trusted: bool,
) -> DeltaBase:
    """Start hashing the shards job `rank` would write into a delta snapshot of `previous` (its layouts), on the
    hashing pool, so that the hashes are made while the snapshot is created; `trusted`: a source whose version
    counters (its own and its state-dict tensor's in `counters`, by key) show no write since the previous put
    keeps its hashes unread."""
    layouts = previous.layouts
    hashes = start_hash_all(
        {
            (key, index): Source(data, layouts[key].dtype, counters.get(key))
            for key, index, data in my_pieces(layouts, previous.tensors, local, rank)
        },
        trusted=previous.hashes if trusted else None,
    )
    return DeltaBase(previous, hashes)


def hash_shards(shards: list[MyShard], counters: Mapping[str, torch.Tensor]) -> Hashes[ShardKey]:
    """The block hashes of every shard's stored bytes, shards hashed in parallel (xxhash releases the GIL), with
    the stamps of their sources (`counters`: the state dict's tensors by key)."""
    return hash_all(
        {(s.key, s.index): Source(s.data, s.dtype, counters.get(s.key)) for s in shards}
    )


def write_whole(session: Session, shards: list[MyShard]) -> dict[str, int]:
    """Write every shard whole, each server rank's shards batched together on its fastest path (into the
    memory the create opened for it, where it did); returns the bytes written per path."""
    writes = [
        (
            shard.rank,
            shard_write(
                shard.name,
                shard.version,
                shard.index,
                shard.data,
                segment=shard.segment,
                dtype=shard.dtype,
            ),
        )
        for shard in shards
    ]
    return session.write_shards(writes)


def write_changed(
    session: Session,
    shards: list[MyShard],
    hashes: Mapping[ShardKey, tuple[int, ...]],
    previous: Mapping[ShardKey, tuple[int, ...]],
) -> int:
    """Send the changed blocks of every shard (its new `hashes` against the `previous` ones) into the delta
    snapshot's copies; returns the bytes sent."""
    changed = [
        ChangedShard(
            rank=shard.rank,
            name=shard.name,
            version=shard.version,
            index=shard.index,
            data=shard.data,
            dtype=shard.dtype,
            before=previous.get((shard.key, shard.index)),
            after=hashes[(shard.key, shard.index)],
        )
        for shard in shards
    ]
    return send_changed(session, changed)


def snapshot_layouts(snapshot: pb.SnapshotInfo) -> dict[str, ShardedTensorMetadata]:
    """{key: layout} of a created snapshot's entries."""
    return {entry.key: metadata_from_proto(entry.tensor.metadata) for entry in snapshot.entries}
