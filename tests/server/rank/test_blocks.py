"""Copy-on-write blocks in the store: row updates share what they do not change, and free what nobody uses."""

import errno
import mmap
import os

import pytest
import torch

from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.rank.blocks import BLOCK_BYTES
from shardserve.server.rank.errors import InvalidState
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore

COLUMNS = 64


def _meta(rows: int) -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((rows, COLUMNS), TensorProperties())


def _update(store: ShardStore, version: int, rows: torch.Tensor, values: torch.Tensor) -> None:
    """What CreateTensor(INIT_COPY) + WriteRows + commit do on one rank."""
    store.allocate_copy(
        "t", version, _meta(store.local_tensor("t", version - 1, 0).shape[0]), version - 1
    )
    with store.leases.rewrite("t", version, 0, rows) as shard:
        shard.index_copy_(0, rows, values)
    store.promote("t", version)
    store.drop("t", version - 1)


def test_an_update_copies_only_the_blocks_it_touches_and_leaves_the_old_version_whole():
    rows = 4 * BLOCK_BYTES // (COLUMNS * 4)  # four blocks
    store = ShardStore(0, shared_memory=True, version_grace=60)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote("t", 1)
    before = store.local_tensor("t", 1, 0).clone()
    ids, values = torch.tensor([3, rows - 1]), torch.randn(2, COLUMNS)
    _update(store, 2, ids, values)
    expected = before.clone()
    expected[ids] = values
    assert torch.equal(store.local_tensor("t", 2, 0), expected)
    assert torch.equal(
        store.local_tensor("t", 1, 0), before
    )  # still served in its grace period, unchanged
    assert (
        store.memory_used == before.numel() * 4 + 2 * BLOCK_BYTES
    )  # the table and its two copied blocks
    store.version_grace = 0
    store.end_graces()
    store.drop("t", 1)
    assert store.held() == [("t", 2, store.held()[0][2])]
    # version 1's two replaced blocks stay with its segment, which is sealed against writes (no hole punched)
    assert store.memory_used == before.numel() * 4 + 2 * BLOCK_BYTES
    _update(
        store, 3, torch.tensor([0]), torch.zeros(1, COLUMNS)
    )  # half the segment unused: its blocks leave it
    expected[0] = 0
    assert torch.equal(store.local_tensor("t", 3, 0), expected)
    assert (
        store.memory_used == before.numel() * 4
    )  # the segment went with version 2: four blocks of their own


def test_memory_stays_within_the_table_and_the_pinned_blocks_over_many_updates():
    rows = 16 * BLOCK_BYTES // (COLUMNS * 4)  # 4 MiB, sixteen blocks
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote("t", 1)
    expected = store.local_tensor("t", 1, 0).clone()
    table_bytes = expected.numel() * 4
    generator = torch.Generator().manual_seed(0)
    for version in range(2, 102):
        ids = torch.randperm(rows, generator=generator)[:3]
        values = torch.randn(3, COLUMNS, generator=generator)
        expected[ids] = values
        _update(store, version, ids, values)
        # the segment the table was put in is freed whole once half of it is unused (its blocks are copied out
        # by the next update): at most half of it, plus the blocks of the update that passed half, is unused
        assert store.memory_used <= table_bytes + table_bytes // 2 + 3 * BLOCK_BYTES
        assert (
            store.blocks.resident_bytes() <= table_bytes + table_bytes // 2 + 3 * BLOCK_BYTES + 4096
        )
    assert torch.equal(store.local_tensor("t", 101, 0), expected)
    assert (
        store.memory_used == store.blocks.resident_bytes() == table_bytes
    )  # every block alone, none unused


def test_blocks_of_served_versions_are_sealed_against_other_writers():
    """A same-host reader opens a version's files by /proc/PID/fd/N: a process that opened one for writing can
    neither write its bytes nor map it writable, whether it is the segment the table was put in or a block an
    update copied; the store's own writes go through its earlier mappings."""
    rows = 4 * BLOCK_BYTES // (COLUMNS * 4)
    store = ShardStore(0, shared_memory=True, version_grace=60)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote("t", 1)
    _update(store, 2, torch.tensor([0]), torch.ones(1, COLUMNS))
    extents = store.blocks.extents(store.local_tensor("t", 2, 0))
    assert len({e.inode for e in extents}) == 2  # the copied block and the segment
    for extent in extents:
        fd = os.open(f"/proc/self/fd/{extent.fd}", os.O_RDWR)
        try:
            with pytest.raises(OSError) as write:
                os.pwrite(fd, b"\x07" * 16, extent.offset)
            assert write.value.errno == errno.EPERM
            with pytest.raises(OSError):
                mmap.mmap(
                    fd,
                    mmap.PAGESIZE,
                    mmap.MAP_SHARED,
                    mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=extent.offset,
                )
        finally:
            os.close(fd)
    assert store.local_tensor("t", 2, 0)[0].eq(1).all()


def test_a_row_updates_copy_takes_rows_not_whole_shard_streams():
    store = ShardStore(0, shared_memory=True)
    store.allocate("t", 1, _meta(8), fill=InitFill.ONES)
    store.promote("t", 1)
    store.allocate_copy("t", 2, _meta(8), 1)
    with pytest.raises(InvalidState, match="WriteRows"):
        with store.leases.write("t", 2, 0, torch.float32, 8 * COLUMNS * 4):
            pass


def test_without_shared_memory_an_update_copies_the_shard():
    store = ShardStore(0, shared_memory=False)
    store.allocate("t", 1, _meta(8), fill=InitFill.ONES)
    store.promote("t", 1)
    _update(store, 2, torch.tensor([1]), torch.zeros(1, COLUMNS))
    assert (
        store.local_tensor("t", 2, 0)[1].sum() == 0
        and store.local_tensor("t", 2, 0).sum() == 7 * COLUMNS
    )


def test_past_the_file_budget_the_blocks_of_one_update_share_a_file():
    """Block files never take the fds the rank's sockets need: with no room left in the budget, an update's copied
    blocks go into one memfd together, freed when none of them is used."""
    rows = 4 * BLOCK_BYTES // (COLUMNS * 4)
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote("t", 1)
    expected = store.local_tensor("t", 1, 0).clone()
    store.blocks.max_files = store.blocks.open_files
    ids, values = torch.tensor([0, rows - 1]), torch.randn(2, COLUMNS)
    _update(store, 2, ids, values)
    expected[ids] = values
    inodes = [e.inode for e in store.blocks.extents(store.local_tensor("t", 2, 0))]
    assert (
        len(inodes) == 3 and inodes[0] == inodes[2] != inodes[1]
    )  # first and last block, then the segment
    assert store.blocks.open_files == 1
    assert torch.equal(store.local_tensor("t", 2, 0), expected)
    store.blocks.max_files = 1 << 20
    _update(
        store, 3, torch.tensor([0, rows - 1]), values
    )  # both blocks copied again: the shared file and the half-unused segment go, kept as spares
    assert store.blocks.spare.nbytes == 2 * BLOCK_BYTES + 4 * BLOCK_BYTES
    store.blocks.spare.trim(0)
    assert (
        store.blocks.open_files == 4
    )  # those two, and the two the half-unused segment was left by
    assert torch.equal(store.local_tensor("t", 3, 0), expected)


def _inodes(store: ShardStore, version: int) -> list[int]:
    return [e.inode for e in store.blocks.extents(store.local_tensor("t", version, 0))]


def test_a_block_file_no_version_uses_is_taken_again_for_the_next_copy_of_its_size():
    """Fresh pages cost several times a copy on first touch: a copied block's file, once unused, is kept and the
    next update's copy of that size goes into it, sealed against other writers as before, bit for bit."""
    rows = 4 * BLOCK_BYTES // (COLUMNS * 4)
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote("t", 1)
    expected = store.local_tensor("t", 1, 0).clone()
    ids = torch.tensor([rows - 1])  # the last block, alone in its copy's file
    for version, value in ((2, 1.0), (3, 2.0)):
        _update(store, version, ids, torch.full((1, COLUMNS), value))
    copied = _inodes(store, 3)[-1]
    assert store.blocks.spare.nbytes == BLOCK_BYTES  # version 2's copy: unused since version 2 went
    before = store.blocks.open_files
    _update(store, 4, ids, torch.full((1, COLUMNS), 3.0))
    expected[ids] = 3.0
    assert torch.equal(store.local_tensor("t", 4, 0), expected)
    assert _inodes(store, 4)[-1] not in (
        copied,
        _inodes(store, 4)[0],
    )  # version 2's file, taken again
    assert store.blocks.spare.nbytes == BLOCK_BYTES and store.blocks.open_files == before
    reused = store.blocks.extents(store.local_tensor("t", 4, 0))[-1]
    fd = os.open(f"/proc/self/fd/{reused.fd}", os.O_RDWR)
    try:
        with pytest.raises(OSError):
            os.pwrite(fd, b"\x07" * 16, reused.offset)
    finally:
        os.close(fd)
    assert torch.equal(store.local_tensor("t", 4, 0), expected)


def test_a_segment_whose_blocks_all_went_is_taken_again_for_a_copy_of_its_size():
    """A delta put that changes a whole shard copies none of it; the segment the shard was put in, once no version
    uses it, holds the next whole-shard change (its data after its header page)."""
    rows = 16 * BLOCK_BYTES // (COLUMNS * 4)  # a run of blocks long enough to share one file
    nbytes = rows * COLUMNS * 4
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote("t", 1)
    segment = store.shared.segment_of(store.local_tensor("t", 1, 0))
    assert segment is not None
    for version in (2, 3):
        store.allocate_copy("t", version, _meta(rows), version - 1)
        with store.leases.rewrite("t", version, 0, byte_ranges=[(0, nbytes)]) as shard:
            shard.copy_(torch.full((rows, COLUMNS), float(version)))
        store.promote("t", version)
        store.drop("t", version - 1)
    extents = store.blocks.extents(store.local_tensor("t", 3, 0))
    assert [(e.inode, e.offset, e.nbytes) for e in extents] == [(segment.inode, 4096, nbytes)]
    assert torch.equal(store.local_tensor("t", 3, 0), torch.full((rows, COLUMNS), 3.0))
    assert store.blocks.spare.nbytes == nbytes  # version 2's file, unused since version 2 went


def test_a_copy_tells_at_promote_the_bytes_it_still_shares() -> None:
    """What the coordinator counts once in a delta snapshot's size: the blocks a copy did not rewrite."""
    rows = 16 * BLOCK_BYTES // (COLUMNS * 4)
    nbytes = rows * COLUMNS * 4
    store = ShardStore(0, shared_memory=True, version_grace=60)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote_many([("t", 1)])
    assert store.shared_bytes([("t", 1)]) == {}  # a whole version shares nothing
    store.allocate_copy("t", 2, _meta(rows), 1)
    with store.leases.rewrite("t", 2, 0, byte_ranges=[(0, 3 * BLOCK_BYTES)]) as shard:
        shard.view(-1).view(torch.uint8)[: 3 * BLOCK_BYTES] = 7
    store.promote_many([("t", 2)])
    assert store.shared_bytes([("t", 2), ("t", 1), ("gone", 9)]) == {
        ("t", 2): {0: nbytes - 3 * BLOCK_BYTES}
    }


def test_a_whole_copy_lies_over_its_source_until_a_block_of_it_is_written() -> None:
    """A delta snapshot's unchanged tensor costs the rank no mapping; the first write gives it a range of its own,
    through the same tensor object, and leaves its sources' bytes as they were."""
    rows = 4 * BLOCK_BYTES // (COLUMNS * 4)
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(rows), fill=InitFill.ARANGE)
    store.promote("t", 1)
    expected = store.local_tensor("t", 1, 0).clone()
    store.allocate_copy("t", 2, _meta(rows), 1)
    store.promote("t", 2)
    first, copy = store.local_tensor("t", 1, 0), store.local_tensor("t", 2, 0)
    assert copy.data_ptr() == first.data_ptr() and torch.equal(copy, expected)
    store.allocate_copy("t", 3, _meta(rows), 2)  # a copy of the copy, written
    pending = store.local_tensor("t", 3, 0)
    assert pending.data_ptr() == first.data_ptr()
    with store.leases.rewrite("t", 3, 0, torch.tensor([1])) as shard:
        assert shard is pending and shard.data_ptr() != first.data_ptr()
        shard[1] = -1.0
    store.promote("t", 3)
    assert torch.equal(first, expected) and torch.equal(copy, expected)
    changed = expected.clone()
    changed[1] = -1.0
    for version in (1, 2):
        store.drop("t", version)
    assert torch.equal(store.local_tensor("t", 3, 0), changed)
    assert (
        store.memory_used == expected.numel() * 4 + BLOCK_BYTES
    )  # the first segment and one block copied
