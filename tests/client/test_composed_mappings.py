"""A reader's mapping of a shard made of blocks: the blocks it mapped before take their filled page tables along
(client/paths/composed.py FilePages), the others are mapped from their files; the bytes are the files' either
way."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from page_tables import resident_bytes

from shardserve.client.paths.composed import CompositionError, FileBytes, FilePages, map_extents
from shardserve.core.address_space import PAGE, AddressRange, moves_supported
from shardserve.protos import shardserve_pb2 as pb

BLOCK = 64 * PAGE

pytestmark = pytest.mark.skipif(
    not moves_supported(), reason="moving a mapping's pages needs Linux 5.13"
)


def _file(blocks: int, seed: int) -> tuple[int, torch.Tensor]:
    """A memfd of `blocks` blocks of random bytes, and those bytes."""
    data = torch.randint(
        0, 256, (blocks * BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    fd = os.memfd_create("test-blocks")
    os.write(fd, data.numpy().tobytes())
    return fd, data


def _reply(extents: list[tuple[int, int, int]]) -> pb.OpenShardResponse:
    """An OpenShard answer of this process's files: (fd, first block, blocks) runs in order."""
    reply = pb.OpenShardResponse(pid=os.getpid())
    for fd, first, count in extents:
        stat = os.fstat(fd)
        reply.extents.add(
            fd=fd,
            inode=stat.st_ino,
            device_id=stat.st_dev,
            offset=first * BLOCK,
            nbytes=count * BLOCK,
        )
    reply.nbytes = sum(e.nbytes for e in reply.extents)
    return reply


def test_a_new_version_takes_the_filled_pages_of_the_blocks_mapped_before():
    old_fd, old = _file(8, seed=0)
    new_fd, new = _file(1, seed=1)
    try:
        first = map_extents(_reply([(old_fd, 0, 8)]))
        assert torch.equal(first, old) and resident_bytes(first) == 8 * BLOCK  # read: filled in
        # the next version: block 3 replaced by a block of another file
        second = map_extents(_reply([(old_fd, 0, 3), (new_fd, 0, 1), (old_fd, 4, 4)]))
        assert (
            resident_bytes(second) == 7 * BLOCK
        )  # the seven shared blocks came filled; the new one did not
        expected = old.clone()
        expected[3 * BLOCK : 4 * BLOCK] = new
        assert torch.equal(second, expected)
        assert torch.equal(
            first, old
        )  # the first mapping still reads its bytes, faulting them in again
    finally:
        os.close(old_fd)
        os.close(new_fd)


def test_a_mapping_that_is_gone_is_never_moved_from():
    fd, data = _file(4, seed=2)
    try:
        first = map_extents(_reply([(fd, 0, 4)]))
        assert torch.equal(first, data)
        del first
        gc.collect()
        second = map_extents(_reply([(fd, 0, 4)]))
        assert resident_bytes(second) == 0 and torch.equal(second, data)
    finally:
        os.close(fd)


def test_blocks_mapped_before_come_from_the_file_described_and_others_are_opened_and_checked():
    """A block this process maps already is taken from that mapping by the file's inode, which the mapping
    holds (no other file has it meanwhile), whatever fd the rank names; a block mapped anew is opened by its fd
    and refused when that fd is not the file described."""
    fd, data = _file(2, seed=3)
    other, _ = _file(2, seed=4)
    try:
        kept = map_extents(_reply([(fd, 0, 1)]))
        moved = _reply([(fd, 0, 1)])
        moved.extents[0].fd = other  # a stale fd number: not opened, the bytes are the inode's
        assert torch.equal(map_extents(moved), data[:BLOCK])
        lying = _reply([(fd, 1, 1)])  # a block never mapped: opened by its fd
        lying.extents[0].fd = other
        with pytest.raises(CompositionError, match="not the block file the rank described"):
            map_extents(lying)
        assert torch.equal(kept, data[:BLOCK])
    finally:
        os.close(fd)
        os.close(other)


def test_files_whose_mappings_are_all_gone_are_forgotten():
    pages = FilePages(sweep_files=8)
    kept = AddressRange(PAGE)
    pages.remember(kept, 0, FileBytes((1, 1), 0, PAGE))
    for inode in range(2, 40):
        pages.remember(AddressRange(PAGE), 0, FileBytes((inode, 1), 0, PAGE))  # gone at once
    assert pages.files < 8
    moved = AddressRange(PAGE)
    assert pages.move(moved, 0, FileBytes((1, 1), 0, PAGE))  # the live one is still known
    assert not pages.move(moved, 0, FileBytes((3, 1), 0, PAGE))
