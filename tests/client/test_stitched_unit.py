"""client.paths.stitched on memfds of this process: shards of whole rows mapped side by side in one tensor,
its rows the shards' own pages, the gaps unreadable, and what cannot be stitched refused."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from shardserve.client.paths.segments import SegmentError, SegmentSource
from shardserve.client.paths.stitched import stitch

DATA_OFFSET = mmap.PAGESIZE  # a header page before the rows, as a rank's segment has


@pytest.fixture
def fds() -> Iterator[list[int]]:
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


def _segment(fds: list[int], rows: torch.Tensor, data_offset: int = DATA_OFFSET) -> SegmentSource:
    """A memfd holding `rows` from `data_offset`, described as a rank describes its segment."""
    fd = os.memfd_create("stitched-test")
    fds.append(fd)
    data = rows.contiguous().view(torch.uint8).numpy().tobytes()
    os.pwrite(fd, data, data_offset)
    stat = os.fstat(fd)
    return SegmentSource(os.getpid(), fd, stat.st_ino, stat.st_dev, data_offset, len(data))


@pytest.mark.parametrize(
    ("dim", "dtype"), [(16, torch.float32), (12, torch.float32), (5, torch.float64)]
)
def test_rows_of_every_shard_in_one_tensor(fds: list[int], dim: int, dtype: torch.dtype) -> None:
    table = torch.randn(100, dim, dtype=dtype, generator=torch.Generator().manual_seed(dim))
    cuts = [0, 37, 38, 100]  # one shard of a single row
    sources = [_segment(fds, table[a:b]) for a, b in zip(cuts, cuts[1:])]
    row_bytes = dim * table.element_size()
    stitched = stitch(sources, row_bytes=row_bytes, dtype=dtype)
    assert stitched is not None
    for (a, b), first in zip(zip(cuts, cuts[1:]), stitched.first_rows):
        assert torch.equal(stitched.table[first : first + b - a], table[a:b])
    ids = torch.tensor([0, 99, 37, 36, 38, 5])
    shifted = torch.tensor([stitched.first_rows[[0, 2, 1, 0, 2, 0][k]] for k in range(6)])
    shifted += ids - torch.tensor([0, 38, 37, 0, 38, 0])
    offsets = torch.tensor([0, 2, 3])
    assert torch.equal(
        F.embedding_bag(shifted, stitched.table, offsets, mode="sum"),
        F.embedding_bag(ids, table, offsets, mode="sum"),
    )


def test_the_pages_are_the_segments_own(fds: list[int]) -> None:
    sources = [_segment(fds, torch.zeros(10, 4)), _segment(fds, torch.zeros(10, 4))]
    stitched = stitch(sources, row_bytes=16, dtype=torch.float32)
    assert stitched is not None
    os.pwrite(sources[1].fd, torch.full((4,), 7.0).numpy().tobytes(), DATA_OFFSET + 3 * 16)
    assert torch.equal(stitched.table[stitched.first_rows[1] + 3], torch.full((4,), 7.0))


def test_what_cannot_be_stitched(fds: list[int]) -> None:
    rows = torch.zeros(8, 4)
    unaligned = [_segment(fds, rows), _segment(fds, rows, data_offset=24)]
    assert stitch(unaligned, row_bytes=16, dtype=torch.float32) is None
    assert (
        stitch([_segment(fds, rows)], row_bytes=6, dtype=torch.float32) is None
    )  # not whole items
    other = _segment(fds, rows)
    wrong = SegmentSource(other.pid, other.fd, other.inode + 1, other.device_id, DATA_OFFSET, 128)
    with pytest.raises(SegmentError, match="no longer the segment"):
        stitch([_segment(fds, rows), wrong], row_bytes=16, dtype=torch.float32)
