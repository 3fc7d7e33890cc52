"""Delta puts of one tensor: Cluster.put(name, tensor, overwrite=True, delta=True) sends only the blocks whose
bytes changed since this client's previous put of `name`.

The client keeps, per name, the block hashes (shardserve.core.delta) of every shard of the version it put last,
with that version, its layout and options. The next delta put with the same layout and options makes the new
version as a copy of that one on the ranks (CreateTensor INIT_COPY with `source_version`: the ranks share its
blocks copy-on-write, as row updates do), sends the changed blocks into every copy (client/delta_writes.py) and
commits it. It is a full put when there is nothing to compare with (the first put of the name on this client,
another layout, dtype or options) or when the coordinator refuses the copy (another writer put the name since,
it was deleted or resharded); a rank that refuses byte writes into the copy (a durable row-update copy on a
persisting rank) makes it a full put too. Either way the new hashes are kept for the next put.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from shardserve.client.delta_writes import (
    ChangedShard,
    Hashes,
    PreviousPuts,
    Source,
    hash_all,
    previous_puts_of,
    write_changed,
)
from shardserve.client.errors import (
    AbortedError,
    InvalidArgumentError,
    PreconditionError,
    StaleVersionError,
    TensorNotFoundError,
)
from shardserve.client.new_tensor import NewTensor
from shardserve.client.session import Session
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.protos import shardserve_pb2 as pb

# what makes the coordinator or a rank refuse a delta (the put is then made in full)
REFUSALS = (
    AbortedError,
    InvalidArgumentError,
    PreconditionError,
    StaleVersionError,
    TensorNotFoundError,
)


@dataclass(frozen=True)
class PreviousTensorPut:
    """What this client put last as `name`: the version, its layout and options, and every shard's hashes with
    the stamps of their sources."""

    version: int
    layout: ShardedTensorMetadata
    options: TensorOptions
    hashes: Hashes[int]


def previous_tensor_puts(session: Session) -> PreviousPuts[PreviousTensorPut]:
    """The single-tensor delta puts' memory of `session`, by name (gone with the session)."""
    return previous_puts_of(session, "tensor")


def put_delta(
    session: Session,
    name: str,
    shards: list[torch.Tensor],
    *,
    layout: ShardedTensorMetadata,
    options: TensorOptions,
    put_whole: Callable[[], pb.TensorInfo],
    trusted: bool = False,
) -> pb.TensorInfo:
    """Put `shards` (the tensor cut by `layout`) as a new version of `name` sending only the changed blocks
    where this client's previous put of it allows, else by `put_whole()`; the committed version's TensorInfo.
    `trusted`: a shard whose version counter shows no write since the previous put keeps its hashes unread."""
    memory = previous_tensor_puts(session)
    previous = memory.take(name)
    if previous is not None and (previous.layout != layout or previous.options != options):
        previous = None  # nothing to compare with
    sources = {i: Source(shard, layout.dtype) for i, shard in enumerate(shards)}
    hashes = hash_all(
        sources, trusted=previous.hashes if trusted and previous is not None else None
    )
    committed = None
    if previous is not None:
        committed = _put_changed(session, name, previous, sources, hashes.blocks)
    if committed is None:
        committed = put_whole()
    memory.keep(name, PreviousTensorPut(committed.version, layout, options, hashes))
    return committed


def _put_changed(
    session: Session,
    name: str,
    previous: PreviousTensorPut,
    sources: Mapping[int, Source],
    hashes: Mapping[int, tuple[int, ...]],
) -> pb.TensorInfo | None:
    """A copy of `previous.version` with the changed blocks written, committed; None when it is refused (nothing
    of it is left then)."""
    try:
        info = session.create_tensor(
            NewTensor(
                name,
                previous.layout,
                init="copy",
                overwrite=True,
                options=previous.options,
                source_version=previous.version,
            )
        )
    except REFUSALS:
        return None
    missing = set(info.unavailable_shards)  # copies on dead ranks: the coordinator repairs them
    changed = [
        ChangedShard(
            rank=shard.rank,
            name=name,
            version=info.version,
            index=index,
            data=sources[index].data,
            dtype=sources[index].dtype,
            before=previous.hashes.blocks.get(index),
            after=hashes[index],
        )
        for index, shard in enumerate(previous.layout.shards_metadata)
        if index not in missing
    ]
    try:
        write_changed(session, changed)
        return session.commit(name, info.version)
    except REFUSALS:
        session.abort(name, info.version)
        return None
    except BaseException:
        session.abort(name, info.version)
        raise
