"""A whole put of one tensor: create a PENDING version, write every shard to its ranks, commit.

On the same host the create opens the shards for this client's in-place writes (as a snapshot's does): the
writer fills them with no call to the ranks and the commit counts them written.

Cluster.put's path when it is not a delta (or a delta that must be made in full, client/put_delta.py). Nothing is
visible on failure: the version is aborted; a write told the version is gone reads as ABORTED when another put or
create of the name with overwrite=True replaced it meanwhile.
"""

from __future__ import annotations

import contextlib

import grpc
import torch

from shardserve.client import catalog_requests as catalog
from shardserve.client.errors import (
    AbortedError,
    ShardServeError,
    StaleVersionError,
    TensorNotFoundError,
)
from shardserve.client.new_tensor import NewTensor
from shardserve.client.paths.writes import shard_write
from shardserve.client.session import Session
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.protos import shardserve_pb2 as pb


def put_whole_tensor(
    session: Session,
    name: str,
    meta: ShardedTensorMetadata,
    shards: list[torch.Tensor],
    options: TensorOptions,
    *,
    overwrite: bool,
    chunk_bytes: int,
) -> pb.TensorInfo:
    """Create a version of `name` laid out as `meta`, write every shard whole (`shards`: the tensor cut by it;
    `chunk_bytes`: the message size of shards streamed over gRPC) and commit it; aborted on failure."""
    info = session.create_tensor(
        NewTensor(name, meta, overwrite=overwrite, options=options), in_place=True
    )
    try:
        opened = {shard.shard_index: shard.segment for shard in info.writable}
        writes = [
            (
                meta.shards_metadata[index].rank,
                shard_write(
                    name,
                    info.version,
                    index,
                    shard,
                    chunk_bytes,
                    dtype=meta.dtype,
                    segment=opened.get(index),
                ),
            )
            for index, shard in enumerate(shards)
        ]
        try:
            session.write_shards(writes)
        except (StaleVersionError, TensorNotFoundError) as err:
            raise _why_writes_failed(session, name, info.version, err) from None
        return session.commit(name, info.version, written_in_place=bool(opened))
    except BaseException:
        session.abort(name, info.version)
        raise


def _why_writes_failed(
    session: Session, name: str, version: int, err: ShardServeError
) -> ShardServeError:
    """A write told "no such version": AbortedError when the version is gone from the catalog (a concurrent put or
    create of the name with overwrite=True aborted it), else the write's own error."""
    with contextlib.suppress(ShardServeError):
        listed = session.call("ListTensors", catalog.list_tensors_request(True)).tensors
        if not any(t.name == name and t.version == version for t in listed):
            return AbortedError(
                f"put of {name!r} version {version} was aborted while it wrote: another put "
                f"or create of {name!r} with overwrite=True replaced it",
                grpc.StatusCode.ABORTED,
            )
    return err
