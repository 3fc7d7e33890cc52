"""A promote hashes the unhashed shards of all its versions together: a weight sync's PromoteMany names one
version per tensor, each with one shard on a rank, and hashing version after version ran those shards one at a
time (on a CUDA rank, one trip through host memory each)."""

from __future__ import annotations

import pytest
import torch

from shardserve.core.checksums import tensor_checksum
from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.rank import promotion
from shardserve.server.rank.hashing import missing_checksums
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore


def _meta(rows: int) -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((rows, 4), TensorProperties())


def test_missing_checksums_answers_each_versions_unknown_shards_only():
    first = {0: torch.randn(5, 3), 1: torch.arange(7)}
    second = {0: torch.randn(2), 2: torch.ones(4, dtype=torch.bfloat16)}
    found = missing_checksums([(first, {1: 99}), (second, {}), ({}, {})])
    assert found == [
        {0: tensor_checksum(first[0])},
        {0: tensor_checksum(second[0]), 2: tensor_checksum(second[2])},
        {},
    ]


def test_missing_checksums_of_no_versions_is_empty():
    assert missing_checksums([]) == []


@pytest.mark.parametrize("fresh", [True, False], ids=["pending", "pending-and-served"])
def test_a_promote_many_hashes_all_its_versions_shards_in_one_call(monkeypatch, fresh):
    store = ShardStore(0, version_grace=0)
    names = [f"layer{i}.w" for i in range(6)]
    for i, name in enumerate(names):
        store.allocate(name, 1, _meta(8 + i), InitFill.ARANGE)
    if not fresh:  # a version served already is passed over, not hashed again
        store.promote(names[0], 1)
    calls = []

    def recording(versions, **options):
        calls.append([dict(shards) for shards, _ in versions])
        return missing_checksums(versions, **options)

    monkeypatch.setattr(promotion, "missing_checksums", recording)
    answered = store.promote_many([(name, 1) for name in names])

    hashed = names if fresh else names[1:]
    assert len(calls) == 1 and len(calls[0]) == len(hashed)
    for name in names:
        shard = store.local_tensor(name, 1, 0)
        assert torch.equal(shard, torch.arange(shard.numel(), dtype=torch.float32).view(-1, 4))
        assert answered[(name, 1)] == {0: tensor_checksum(shard)}
