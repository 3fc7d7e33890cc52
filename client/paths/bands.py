"""Parallel row bands of one large part, each read as its own request (over gRPC or the bulk port).

One ReadRegion stream is bound by one Python thread on each side; on the 2-core
machine two streams read a 64 MiB box 1.3-2x faster than one, four no faster
than two (python -m benchmarks.grpc_tuning; docs/perf/grpc_tuning.json). So a
part of at least BAND_MIN_BYTES * 2 whose region in the output is contiguous
is read as STREAMS bands along its first dim, on a pool of its own (the parts
themselves already run on the channel's pool).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from shardserve.client.channel import run_here_and_on
from shardserve.core.metadata import Box

STREAMS = 2
BAND_MIN_BYTES = 4 << 20

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
