"""The box a ReadRegionRequest names, leased from the rank's store: one reading path for the streamed
ReadRegion, the unary ReadRegionSmall and the bulk TCP port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.requests import check_name, check_version
from shardserve.server.rank.cuda_staging import host_bytes
from shardserve.server.rank.store import ShardStore


def requested_box(
    store: ShardStore, request: pb.ReadRegionRequest
) -> AbstractContextManager[torch.Tensor]:
    """store.read of the box a ReadRegionRequest names (name and version checked; version 0 = the served one)."""
    return store.read(
        check_name(request.name),
        check_version(request.version, allow_zero=True),
        request.shard_index,
        tuple(request.offsets),
        tuple(request.sizes),
    )


@contextmanager
def region_bytes(store: ShardStore, request: pb.ReadRegionRequest) -> Iterator[memoryview]:
    """The requested box as host bytes, valid while the lease is held (zero-copy when the box is contiguous in
    the shard; CUDA shards through pinned memory)."""
    with requested_box(store, request) as box:
        yield host_bytes(box)
