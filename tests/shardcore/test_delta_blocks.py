"""Delta blocks (shardserve.core.delta): whole rows of dim 0 per ~1 MiB block, changed blocks as merged byte
ranges, and batches of them."""

from __future__ import annotations

import torch

from shardserve.core.delta import (
    DELTA_BLOCK_BYTES,
    block_bytes,
    block_hashes,
    changed_ranges,
    split_pieces,
)


def test_blocks_are_whole_rows_of_about_a_mebibyte() -> None:
    assert block_bytes((4096, 256), 4) == DELTA_BLOCK_BYTES
    assert block_bytes((10, 300), 4) == (DELTA_BLOCK_BYTES // 1200) * 1200
    assert block_bytes((2, 1 << 20), 4) == 4 << 20  # one row larger than a block
    assert block_bytes((), 8) == (DELTA_BLOCK_BYTES // 8) * 8
    assert block_bytes((0, 5), 4) == (DELTA_BLOCK_BYTES // 20) * 20


def test_hashes_find_the_changed_block_only() -> None:
    tensor = torch.randn(1024, 512)  # 2 MiB: two blocks of 512 rows
    before = block_hashes(tensor)
    tensor[600, 3] += 1
    after = block_hashes(tensor)
    assert len(before) == 2 and before[0] == after[0] and before[1] != after[1]
    step = block_bytes(tuple(tensor.shape), 4)
    assert changed_ranges(before, after, step=step, nbytes=4 << 20 >> 1) == [(step, 2 * step)]
    assert changed_ranges(None, after, step=step, nbytes=100) == [(0, 100)]
    assert block_hashes(torch.empty(0, 3)) == ()


def test_neighbours_merge_and_the_last_block_is_short() -> None:
    ranges = changed_ranges([1, 2, 3, 4], [0, 0, 3, 0], step=10, nbytes=35)
    assert ranges == [(0, 20), (30, 35)]
    flat = torch.arange(35, dtype=torch.uint8)
    batches = split_pieces([(0, flat[0:25]), (30, flat[30:35])], 10)
    assert [[(start, data.tolist()) for start, data in batch] for batch in batches] == [
        [(0, list(range(0, 10)))],
        [(10, list(range(10, 20)))],
        [(20, list(range(20, 25))), (30, list(range(30, 35)))],
    ]
