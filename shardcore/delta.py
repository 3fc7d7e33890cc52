"""Delta puts' blocks: which bytes of a shard changed since the writer's previous put of it.

A shard's raw C-contiguous bytes are cut into blocks of whole rows of dim 0, as many rows as fit in
DELTA_BLOCK_BYTES (at least one; a 0-d shard is one block). The writer keeps the xxh3-64 hash of every block of
what it put; the next delta put hashes what it writes the same way and sends only the blocks whose hash
differs, merged into byte ranges. Why 1 MiB of whole rows: a rank shares copy-on-write blocks of 256 KiB
(server/rank/blocks.py), so a changed delta block costs the rank at most five of its blocks copied (four, plus
one where the rows do not fall on a block boundary), while 1 GiB is 1024 hashes (about 20 us of Python each)
and one changed row sends at most 1 MiB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import xxhash

DELTA_BLOCK_BYTES = 1 << 20

ByteRange = tuple[int, int]  # [start, stop) of a shard's bytes


def block_bytes(shape: Sequence[int], itemsize: int) -> int:
    """The bytes of one delta block of a shard of `shape` with elements of `itemsize` bytes: whole rows of
    dim 0, as many as fit in DELTA_BLOCK_BYTES, at least one."""
    row = math.prod(shape[1:]) * itemsize if len(shape) else itemsize
    return max(1, DELTA_BLOCK_BYTES // max(1, row)) * max(1, row)


def block_hashes(tensor: torch.Tensor) -> tuple[int, ...]:
    """The xxh3-64 of every delta block of a contiguous CPU `tensor`'s bytes, in order (none when empty)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("block_hashes reads a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return ()
    data = tensor.reshape(-1).view(torch.uint8).numpy().data
    step = block_bytes(tuple(tensor.shape), tensor.element_size())
    return tuple(xxhash.xxh3_64_intdigest(data[at : at + step]) for at in range(0, nbytes, step))


def changed_ranges(
    old: Sequence[int] | None, new: Sequence[int], *, step: int, nbytes: int
) -> list[ByteRange]:
    """The byte ranges of the blocks (of `step` bytes, the last one shorter) whose hash differs between the
    `old` and `new` hashes, neighbours merged; every block when `old` is None or of another count."""
    if old is None or len(old) != len(new):
        return [(0, nbytes)] if nbytes else []
    ranges: list[ByteRange] = []
    for k, (before, after) in enumerate(zip(old, new)):
        if before == after:
            continue
        start, stop = k * step, min(nbytes, (k + 1) * step)
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((start, stop))
    return ranges


def split_pieces(
    pieces: Sequence[tuple[int, torch.Tensor]], limit: int
) -> list[list[tuple[int, torch.Tensor]]]:
    """(start, flat bytes) pieces of a shard cut into batches of at most `limit` bytes each, in order (a piece
    longer than `limit` is cut too): what one request carries where the bytes travel inline."""
    batches: list[list[tuple[int, torch.Tensor]]] = []
    current: list[tuple[int, torch.Tensor]] = []
    room = limit
    for start, data in pieces:
        at = 0
        while at < data.numel():
            take = min(data.numel() - at, room)
            current.append((start + at, data[at : at + take]))
            at += take
            room -= take
            if room == 0:
                batches.append(current)
                current, room = [], limit
    if current:
        batches.append(current)
    return batches
