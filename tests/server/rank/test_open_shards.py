"""ShardServer.OpenShards, in-process: many shards opened and leased in one call, in the request's order; a shard
that cannot be opened fails the call naming it (shards[i]) and leaves no lease behind; the batch is bounded."""

from __future__ import annotations

import pytest
import torch
from server_helpers import Aborted, ServicerContext

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.server.rank.reads import shm
from shardserve.server.rank.reads.shm import SharedMemoryService
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore


def _store(names: tuple[str, ...]) -> ShardStore:
    """A rank serving version 1 of each of `names`: 6 x 4 float32, one shard, arange."""
    store = ShardStore(0, shared_memory=True)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (6, 4), TensorProperties(dtype=torch.float32)
    )
    for name in names:
        store.allocate(name, 1, meta, fill=InitFill.ARANGE)
        store.promote(name, 1)
    return store


def _request(*names: str, version: int = 1) -> pb.OpenShardsRequest:
    return pb.OpenShardsRequest(
        shards=[pb.OpenShardRequest(name=n, version=version, shard_index=0) for n in names]
    )


def test_every_shard_of_the_batch_is_opened_and_leased_in_order() -> None:
    store = _store(("a", "b", "c"))
    service = SharedMemoryService(store)
    answer = service.OpenShards(_request("c", "a", "b"), ServicerContext())
    single = service.OpenShard(pb.OpenShardRequest(name="a", version=1), ServicerContext())
    assert [s.nbytes for s in answer.shards] == [96, 96, 96]
    assert answer.shards[1].inode == single.inode  # the order of the request: "a" second
    assert len({s.inode for s in answer.shards}) == 3 and all(s.lease_id for s in answer.shards)
    store.drop("a", 1)
    assert store.memory_used == 3 * 96  # the leases hold "a" (twice)
    released = service.ReleaseShard(
        pb.ReleaseShardRequest(lease_ids=[s.lease_id for s in answer.shards] + [single.lease_id]),
        ServicerContext(),
    )
    assert released.released == 4 and store.memory_used == 2 * 96


def test_a_shard_that_cannot_be_opened_fails_the_call_by_name_and_keeps_no_lease() -> None:
    store = _store(("a", "b"))
    service = SharedMemoryService(store)
    with pytest.raises(Aborted) as refused:
        service.OpenShards(_request("a", "gone", "b"), ServicerContext())
    assert (
        refused.value.code.name == "NOT_FOUND" and refused.value.reason == Reason.TENSOR_NOT_FOUND
    )
    assert refused.value.details.startswith("shards[1]: ")
    assert refused.value.metadata["item"] == "shards[1]"
    assert len(service.leases) == 0  # "a" was leased first, and let go again
    store.drop("a", 1)
    assert store.memory_used == 96


def test_a_batch_over_the_limit_is_refused_naming_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "MAX_OPEN_SHARDS", 2)
    service = SharedMemoryService(_store(("a", "b", "c")))
    with pytest.raises(Aborted, match="shards: 3 in one call, over the limit of 2") as refused:
        service.OpenShards(_request("a", "b", "c"), ServicerContext())
    assert refused.value.reason == Reason.INVALID_ARGUMENT and len(service.leases) == 0
