"""The shards of a WriteShards batch: checked headers, their bytes' offsets, and writing them in order.

A batch names its shards (WriteShardHeader each, validated before any byte is
written) whose bytes lie back to back in request order. Where they come from is
the source's business: inline in the request (gRPC), a same-host writer's memfd
(server/rank/writes/shared.py), or the bulk port's connection
(server/rank/reads/bulk.py). Each shard is written under the store's write
lease like a WriteShard stream: a shard whose bytes do not all arrive is left
torn, and a promote refuses it until it is written again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.requests import check_name, check_version, parse_dtype
from shardserve.server.rank.error_status import item_errors
from shardserve.server.rank.errors import InvalidArgument
from shardserve.server.rank.store import ShardStore

MAX_BATCH_SHARDS = 1 << 16
MAX_BATCH_BYTES = (
    1 << 40
)  # what one batch may declare (a refused bulk-port batch's bytes are drained)


@dataclass(frozen=True)
class ShardBytes:
    """One shard of a batch: where it goes and where its bytes start in the batch's data."""

    name: str
    version: int
    shard_index: int
    header: pb.WriteShardHeader
    offset: int

    @property
    def nbytes(self) -> int:
        return self.header.nbytes


def checked_batch(headers: Sequence[pb.WriteShardHeader]) -> list[ShardBytes]:
    """The batch's shards with their offsets; INVALID_ARGUMENT naming `shards[i]` for a bad header, a shard
    named twice, or too many of them."""
    if not headers:
        raise InvalidArgument("shards: a WriteShards batch names no shard")
    if len(headers) > MAX_BATCH_SHARDS:
        raise InvalidArgument(
            f"shards: {len(headers)} shards in one batch, over the limit of {MAX_BATCH_SHARDS}"
        )
    out, seen, offset = [], set(), 0
    for i, header in enumerate(headers):
        name = check_name(header.name, f"shards[{i}].name")
        version = check_version(header.version, f"shards[{i}].version")
        parse_dtype(header.dtype, f"shards[{i}].dtype")
        if header.nbytes < 0:
            raise InvalidArgument(f"shards[{i}].nbytes {header.nbytes} is negative")
        key = (name, version, header.shard_index)
        if key in seen:
            raise InvalidArgument(
                f"shards[{i}]: shard {header.shard_index} of {name!r} version {version} appears "
                f"twice in the batch"
            )
        seen.add(key)
        out.append(ShardBytes(name, version, header.shard_index, header, offset))
        offset += header.nbytes
    if offset > MAX_BATCH_BYTES:
        raise InvalidArgument(
            f"shards: the batch declares {offset} bytes, over the limit of {MAX_BATCH_BYTES}"
        )
    return out


def batch_bytes(shards: Sequence[ShardBytes]) -> int:
    """The bytes of every shard of the batch, back to back."""
    return shards[-1].offset + shards[-1].nbytes if shards else 0


def write_batch(
    store: ShardStore, shards: Sequence[ShardBytes], fill: Callable[[ShardBytes, memoryview], None]
) -> int:
    """Write each shard of the batch in order, `fill(shard, view)` putting its bytes into `view`; returns the
    bytes written. Stops at the first failure (the shards written before it stay written)."""
    written = 0
    for i, shard in enumerate(shards):
        dtype = parse_dtype(shard.header.dtype, f"shards[{i}].dtype")
        with (
            item_errors(f"shards[{i}]"),
            store.leases.write(
                shard.name, shard.version, shard.shard_index, dtype, shard.nbytes
            ) as writer,
        ):
            writer.fill(functools.partial(fill, shard))
        store.metrics.written(shard.name, shard.nbytes)
        written += shard.nbytes
    return written
