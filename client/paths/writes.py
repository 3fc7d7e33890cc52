"""Whole-shard writes in batches (WriteShards; server/rank/writes/ answers): the value types and the batching,
used by Cluster.put and spmd.put_state_dict.

A write names a shard of a pending version and the tensor holding exactly its
box. Writes to one rank travel together: all of them in place on the same host
(client/paths/in_place.py); else in batches of at most DIRECT_BATCH_BYTES, one
staging memfd per batch on the same host (client/paths/staging.py) or one
request frame and its bytes on the bulk port; or inline gRPC requests of at
most INLINE_BATCH_BYTES (larger shards stream over WriteShard).
PathPolicy.write picks the path per rank; write_shards runs every rank at once,
each rank's batches in turn.

A write may store its shard as another floating dtype than its tensor's (a put's `dtype=`): the header names
the stored dtype and its size. Copies into memory (in place, a staging file) convert while copying (`copy_`);
the network paths send `stored()`, each shard converted as its batch is sent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardserve.client.channel import CHUNK_BYTES
from shardserve.client.info import RankStatus
from shardserve.core.dtypes import dtype_from_wire, dtype_to_wire
from shardserve.protos import shardserve_pb2 as pb

INLINE_BATCH_BYTES = 1 << 20  # one gRPC WriteShards request carries at most this many bytes inline
DIRECT_BATCH_BYTES = (
    64 << 20
)  # one staging memfd or bulk-port batch carries at most this many: a rank's batches
# go one after another, reusing one staging file (warm pages)
# in-place writes this small on average are made on the calling thread, one rank after another
SMALL_IN_PLACE_BYTES = 64 << 10


@dataclass(frozen=True)
class ShardWrite:
    """One whole shard of a pending version and the tensor holding exactly its box (any strides, any device)."""

    header: pb.WriteShardHeader
    data: torch.Tensor
    chunk_bytes: int = CHUNK_BYTES  # the message size when it streams over gRPC (WriteShard)
    # the shard's memory, opened for this writer with its allocation (CreateSnapshot's answer): filled in
    # place with no call to the rank, counted written by the snapshot's commit
    segment: pb.WritableSegment | None = None

    @property
    def nbytes(self) -> int:
        """The bytes stored (of the stored dtype)."""
        return self.header.nbytes

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the shard is stored as (the header's; `data`'s own unless the put casts)."""
        return dtype_from_wire(self.header.dtype)

    def stored(self) -> torch.Tensor:
        """`data` as the shard is stored: itself, or converted to the stored dtype (a tensor of the shard's
        size, for paths that send bytes)."""
        return self.data if self.data.dtype == self.dtype else self.data.to(self.dtype)


def shard_write(
    name: str,
    version: int,
    shard_index: int,
    data: torch.Tensor,
    chunk_bytes: int = CHUNK_BYTES,
    *,
    segment: pb.WritableSegment | None = None,
    dtype: torch.dtype | None = None,
) -> ShardWrite:
    """The write of `data` as shard `shard_index` of (name, version) (into `segment`, opened already, if given),
    stored as `dtype` (None: data's own; else a floating dtype that data's floating elements convert to)."""
    stored = data.dtype if dtype is None else dtype
    header = pb.WriteShardHeader(
        name=name,
        version=version,
        shard_index=shard_index,
        dtype=dtype_to_wire(stored),  # type: ignore[arg-type]
        nbytes=data.numel() * stored.itemsize,
    )
    return ShardWrite(header, data, chunk_bytes, segment)


def batched(writes: Sequence[ShardWrite], max_bytes: int) -> list[list[ShardWrite]]:
    """`writes` in order, cut into batches of at most `max_bytes` (a larger shard is a batch of its own)."""
    batches: list[list[ShardWrite]] = []
    size = 0
    for write in writes:
        if not batches or size + write.nbytes > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(write)
        size += write.nbytes
    return batches


def write_request(writes: Sequence[ShardWrite]) -> pb.WriteShardsRequest:
    """The WriteShardsRequest naming `writes` (their bytes back to back in this order), without a source."""
    return pb.WriteShardsRequest(shards=[write.header for write in writes])


Written = list[tuple[str, int]]  # (path, bytes) of each batch written to one rank


def write_shards(
    write_batch: Callable[[RankStatus, list[ShardWrite]], tuple[str, int]],
    rank_of: Callable[[int], RankStatus],
    writes: Sequence[tuple[int, ShardWrite]],
    run_all: Callable[[Sequence[Callable[[], Written]]], list[Written]],
) -> dict[str, int]:
    """Write every (rank, write), all ranks at once through `run_all`, each rank's writes by
    `write_batch(rank, writes)` (PathPolicy.write: the fastest path that serves the rank, which cuts them into
    its batches); returns the bytes written per path ("shm", "bulk", "grpc")."""
    by_rank: dict[int, list[ShardWrite]] = defaultdict(list)
    for rank, write in writes:
        by_rank[rank].append(write)

    def write_rank(rank: int, mine: list[ShardWrite]) -> Written:
        return [write_batch(rank_of(rank), mine)]  # each path cuts its own batches

    jobs = [
        lambda rank=rank, mine=mine: write_rank(rank, mine)
        for rank, mine in sorted(by_rank.items())
    ]
    run = _one_after_another if _small_in_place([write for _, write in writes]) else run_all
    per_path: dict[str, int] = defaultdict(int)
    for path, nbytes in [done for batches in (run(jobs) if jobs else []) for done in batches]:
        per_path[path] += nbytes
    return dict(per_path)


def _small_in_place(writes: Sequence[ShardWrite]) -> bool:
    """Whether every write fills memory its allocation opened on this host (no call to wait for) and they
    average at most SMALL_IN_PLACE_BYTES: their cost is Python's per write, which threads only make wait for
    each other (the GIL), where large copies run on all cores and network writes overlap their round trips."""
    return all(write.segment is not None for write in writes) and sum(
        write.nbytes for write in writes
    ) <= SMALL_IN_PLACE_BYTES * len(writes)


def _one_after_another(jobs: Sequence[Callable[[], Written]]) -> list[Written]:
    return [job() for job in jobs]
