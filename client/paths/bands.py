"""Parallel row bands of one large part, each read as its own request (over gRPC or the bulk port).

One ReadRegion stream is bound by one Python thread on each side; on the 2-core
machine two streams read a 64 MiB box 1.3-2x faster than one, four no faster
than two (python -m benchmarks.grpc_tuning; docs/perf/grpc_tuning.json). So a
part of at least BAND_MIN_BYTES * 2 whose region in the output is contiguous
is read as STREAMS bands along its first dim, on a pool of its own (the parts
themselves already run on the channel's pool).

A part read into an output of another dtype (a cast in flight) lands band by band in staging buffers of at most
STAGED_BAND_BYTES each, STREAMS of them reused in turn, and is converted from there into the output: what a cast
read holds beyond its output stays bounded, whatever the part's size.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from shardserve.client.channel import run_here_and_on
from shardserve.core.metadata import Box

STREAMS = 2
BAND_MIN_BYTES = 4 << 20
STAGED_BAND_BYTES = (
    8 << 20
)  # the largest staging buffer of a cast read (a band of one row may be larger)

_pool = ThreadPoolExecutor(max_workers=4 * STREAMS, thread_name_prefix="shardserve-band")


def bands(
    part: Box, itemsize: int, streams: int = STREAMS, min_bytes: int = BAND_MIN_BYTES
) -> list[Box]:
    """`part` cut along dim 0 into at most `streams` bands of at least `min_bytes` (just [part] if too small)."""
    if part.ndim == 0 or part.sizes[0] < 2:
        return [part]
    count = min(streams, part.sizes[0], part.numel() * itemsize // max(min_bytes, 1))
    if count < 2:
        return [part]
    rows, step = part.sizes[0], -(-part.sizes[0] // count)
    return [
        Box(
            (part.offsets[0] + start, *part.offsets[1:]), (min(step, rows - start), *part.sizes[1:])
        )
        for start in range(0, rows, step)
    ]


def read_bands(read_band: Callable[[Box], None], parts: list[Box]) -> None:
    """Run `read_band` for every band, the first on this thread and the rest on the band pool (its own: the parts
    already run on the channel's); raise the first error once every band has ended."""
    run_here_and_on([partial(read_band, band) for band in parts], _pool.submit)


def staged_bands(part: Box, itemsize: int, max_bytes: int = STAGED_BAND_BYTES) -> list[Box]:
    """`part` cut along dim 0 into bands of at most `max_bytes` each (of one row at least)."""
    if part.ndim == 0 or part.sizes[0] < 2:
        return [part]
    row_bytes = part.numel() // part.sizes[0] * itemsize
    step = max(1, max_bytes // max(row_bytes, 1))
    rows = part.sizes[0]
    return [
        Box(
            (part.offsets[0] + start, *part.offsets[1:]), (min(step, rows - start), *part.sizes[1:])
        )
        for start in range(0, rows, step)
    ]


def read_in_turns(read_band: Callable[[Box, int], None], parts: list[Box], slots: int) -> None:
    """Run `read_band(band, slot)` for every band, `slots` at once (band i in slot i % slots, so a slot's
    buffer serves one band at a time): in turns of `slots` bands, each turn as read_bands runs them."""
    for start in range(0, len(parts), slots):
        turn = parts[start : start + slots]
        run_here_and_on(
            [partial(read_band, band, slot) for slot, band in enumerate(turn)], _pool.submit
        )
