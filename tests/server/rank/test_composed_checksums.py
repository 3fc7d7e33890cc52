"""The promote of a row update's version hashes its bytes through the block files' own mappings, not through the
version's new range: the same checksum as the bytes', without faulting the range in."""

import pytest
import torch
from page_tables import resident_bytes

from shardserve.core.address_space import moves_supported
from shardserve.core.checksums import tensor_checksum
from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.rank.blocks import BLOCK_BYTES
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore

COLUMNS = 64
ROWS = 16 * BLOCK_BYTES // (COLUMNS * 4)  # sixteen blocks


def _meta(rows: int) -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((rows, COLUMNS), TensorProperties())


def _update(store: ShardStore, version: int, rows: torch.Tensor, values: torch.Tensor) -> int:
    """CreateTensor(INIT_COPY) + WriteRows + commit on one rank; the checksum its promote answers."""
    store.allocate_copy("t", version, _meta(ROWS), version - 1)
    with store.leases.rewrite("t", version, 0, rows) as shard:
        shard.index_copy_(0, rows, values)
    checksum = store.promote("t", version)[0]
    store.drop("t", version - 1)
    return checksum


def test_every_update_answers_the_checksum_of_its_bytes_over_many_versions():
    """Copied blocks, blocks shared with the first segment, a half-unused segment's blocks copied out and spare
    files taken again: each promote's checksum is that of the table as plain torch holds it."""
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(ROWS), fill=InitFill.ARANGE)
    store.promote("t", 1)
    expected = store.local_tensor("t", 1, 0).clone()
    generator = torch.Generator().manual_seed(0)
    for version in range(2, 40):
        ids = torch.randperm(ROWS, generator=generator)[:5]
        values = torch.randn(5, COLUMNS, generator=generator)
        expected[ids] = values
        assert _update(store, version, ids, values) == tensor_checksum(expected)
        assert torch.equal(store.local_tensor("t", version, 0), expected)


@pytest.mark.skipif(
    not moves_supported(), reason="block files keep no writable mapping before Linux 5.13"
)
def test_the_promote_leaves_the_new_versions_unwritten_pages_unmapped():
    """Hashing through the version's own range would fault in all sixteen blocks there; only the written block
    is (its copy was mapped in populated)."""
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(ROWS), fill=InitFill.ARANGE)
    store.promote("t", 1)
    expected = store.local_tensor("t", 1, 0).clone()
    ids, values = torch.tensor([0]), torch.randn(1, COLUMNS)
    expected[ids] = values
    assert _update(store, 2, ids, values) == tensor_checksum(expected)
    assert resident_bytes(store.local_tensor("t", 2, 0)) <= BLOCK_BYTES
