"""Parallel gRPC streams for one large part: row bands of the part, each its own ReadRegion.

One ReadRegion stream is bound by one Python thread on each side; on the 2-core
machine two streams read a 64 MiB box 1.3-2x faster than one, four no faster
than two (python -m benchmarks.grpc_tuning; docs/perf/grpc_tuning.json). So a
part of at least BAND_MIN_BYTES * 2 whose region in the output is contiguous
is read as STREAMS bands along its first dim, on a pool of its own (the parts
themselves already run on the transport's pool). A box of at most 1 MiB is
one unary ReadRegionSmall call: about half a stream's per-call cost.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Callable

import grpc
import numpy as np
import torch

from protos.chunk_codec import decode_chunk
from client.errors import ShardServeError, error_from_rpc
from client.channel import run_here_and_on
from protos import shardserve_pb2 as pb
from shardcore.metadata import Box

if TYPE_CHECKING:
    from client.channel import Transport

STREAMS = 2
BAND_MIN_BYTES = 4 << 20
SMALL_READ_BYTES = 1 << 20  # boxes up to this size come as one unary reply (ReadRegionSmall), larger ones stream

_pool = ThreadPoolExecutor(max_workers=4 * STREAMS, thread_name_prefix="shardserve-band")


def bands(part: Box, itemsize: int, streams: int = STREAMS, min_bytes: int = BAND_MIN_BYTES) -> list[Box]:
    """`part` cut along dim 0 into at most `streams` bands of at least `min_bytes` (just [part] if too small)."""
    if part.ndim == 0 or part.sizes[0] < 2:
        return [part]
    count = min(streams, part.sizes[0], part.numel() * itemsize // max(min_bytes, 1))
    if count < 2:
        return [part]
    rows, step = part.sizes[0], -(-part.sizes[0] // count)
    return [Box((part.offsets[0] + start, *part.offsets[1:]), (min(step, rows - start), *part.sizes[1:]))
            for start in range(0, rows, step)]


def read_bands(read_band: Callable[[Box], None], parts: list[Box]) -> None:
    """Run `read_band` for every band, the first on this thread and the rest on the band pool (its own: the parts
    already run on the transport's); raise the first error once every band has ended."""
    run_here_and_on([partial(read_band, band) for band in parts], _pool.submit)


def read_region(transport: "Transport", address: str, request: pb.ReadRegionRequest, dest: torch.Tensor) -> None:
    """One box into `dest` (a flat uint8 tensor of its size): unary when small, else a ReadRegion stream."""
    expected = dest.numel()
    if expected > SMALL_READ_BYTES:
        transport.read_region(address, request, dest)
        return
    call = transport.channel(address).unary_unary(
        f"/{pb.DESCRIPTOR.services_by_name['ShardServer'].full_name}/ReadRegionSmall",
        request_serializer=pb.ReadRegionRequest.SerializeToString, response_deserializer=decode_chunk)
    try:
        offset, data = call(request, timeout=transport.data_timeout(expected), metadata=transport.credentials.metadata())
    except grpc.RpcError as err:
        raise error_from_rpc(err, f"rank at {address}") from None
    if offset != 0 or len(data) != expected:
        raise ShardServeError(f"rank at {address} sent {len(data)} bytes at offset {offset} for a "
                              f"{expected}-byte region")
    if expected:
        dest.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
