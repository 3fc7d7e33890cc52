"""The byte ranges of a WriteBytes request, checked before any byte is written (so no refusal tears a shard)."""

from __future__ import annotations

from collections.abc import Sequence

from shardserve.server.rank.errors import InvalidArgument


def checked_ranges(
    starts: Sequence[int], lengths: Sequence[int], shard_bytes: int, data_bytes: int
) -> list[tuple[int, int]]:
    """[(start, stop)] of the request: as many starts as lengths, each range non-empty, inside the shard's
    `shard_bytes`, sorted and apart, and their lengths adding up to the `data_bytes` sent; InvalidArgument
    naming the field otherwise."""
    if len(starts) != len(lengths):
        raise InvalidArgument(
            f"starts: {len(starts)} given for {len(lengths)} lengths", metadata={"field": "starts"}
        )
    ranges, end = [], 0
    for k, (start, length) in enumerate(zip(starts, lengths)):
        if length <= 0:
            raise InvalidArgument(f"lengths[{k}] is 0", metadata={"field": "lengths"})
        if start < end:
            raise InvalidArgument(
                f"starts[{k}]={start} overlaps or precedes the range before it (ranges are sorted)",
                metadata={"field": "starts"},
            )
        end = start + length
        if end > shard_bytes:
            raise InvalidArgument(
                f"range {k} [{start}, {end}) is past the shard's {shard_bytes} bytes",
                metadata={"field": "lengths"},
            )
        ranges.append((start, end))
    total = sum(stop - start for start, stop in ranges)
    if total != data_bytes:
        raise InvalidArgument(
            f"data: {data_bytes} bytes for ranges of {total} bytes", metadata={"field": "data"}
        )
    return ranges
