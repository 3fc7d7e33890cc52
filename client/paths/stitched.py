"""Several same-host shards of whole rows mapped side by side in one address range: one tensor over them all.

A row-wise table's shards live in segments of their own (one per rank), so a bag whose ids span shards
would need one `F.embedding_bag` per shard and the partial sums added. Instead each shard's bytes are
mapped once more, read-only, into one reserved range (as client.paths.composed does for a shard's blocks),
every shard at a multiple of the row size and of the page size; the gaps between them stay PROT_NONE, so a
stray read faults and never reads other memory. Row r of shard k is then row first_rows[k] + r of one
tensor: a bag over several shards is one kernel call, bit for bit `F.embedding_bag` on the whole table.
The pages are the segments' own (nothing is copied); readers keep checking each segment's header around
every read, as for its first mapping.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardserve.client.paths.composed import reserve
from shardserve.client.paths.segments import SegmentError, SegmentSource, open_rank_file
from shardserve.core.address_space import AddressRange, round_up

MAX_GAP_BYTES = 1 << 30  # a row size whose page-aligned multiples are further apart is not stitched


@dataclass(frozen=True)
class StitchedRows:
    """One [rows, width] tensor over several shards' rows; shard k's row 0 is its row first_rows[k]."""

    table: torch.Tensor
    first_rows: list[int]


def stitch(
    sources: Sequence[SegmentSource], *, row_bytes: int, dtype: torch.dtype
) -> StitchedRows | None:
    """The shards `sources` (each whole rows of `row_bytes` bytes) in one tensor of `dtype`, or None where a
    row size is no whole number of `dtype` items or its page-aligned multiples are too far apart; SegmentError
    when a memfd is gone or another file."""
    itemsize = dtype.itemsize
    step = math.lcm(mmap.PAGESIZE, row_bytes)
    if row_bytes % itemsize or step > MAX_GAP_BYTES:
        return None
    starts, end = [], 0
    for source in sources:
        if source.data_offset % mmap.PAGESIZE or source.nbytes % row_bytes:
            return None
        starts.append(round_up(end, step))
        end = starts[-1] + source.nbytes
    space = reserve(end)
    for source, start in zip(sources, starts):
        _map_into(space, start, source)
    flat = space.tensor(end)
    table = flat.view(dtype).view(end // row_bytes, row_bytes // itemsize)
    return StitchedRows(table, [start // row_bytes for start in starts])


def _map_into(space: AddressRange, start: int, source: SegmentSource) -> None:
    """Map the shard's bytes read-only at `start` of the reserved range."""
    path = f"/proc/{source.pid}/fd/{source.fd}"
    fd = open_rank_file(
        source.pid,
        source.fd,
        source.inode,
        source.device_id,
        min_size=source.data_offset + source.nbytes,
    )
    try:
        space.place(start, source.nbytes, fd, source.data_offset, populate=True)
    except OSError as err:
        raise SegmentError(f"cannot map {path}: errno {err.errno}") from None
    finally:
        os.close(fd)
