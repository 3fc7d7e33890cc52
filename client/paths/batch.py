"""The batched small-read path (server/rank/reads/batch.py answers it): many small boxes of one rank as one
ReadRegions call, each region's bytes copied into its own output view.

For hundreds of small tensors (a state dict) the per-read cost of a box read
by itself (its path choice, its race, its call) is most of the time; one call
per rank and batch of at most BATCH_READ_BYTES pays it once. A batch goes on
the rank's bulk TCP port (a KIND_READS frame) where reads may use it, else,
and when the port fails, over gRPC: the network chain, whose every path takes rank calls; shared memory is not
used for batches.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from shardserve.client import counters
from shardserve.client.errors import (
    DeadlineExceededError,
    RankUnavailableError,
    ShardServeError,
)
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.kinds import DataPath, rank_calls
from shardserve.client.paths.network import read_request
from shardserve.client.paths.policy import PathPolicy
from shardserve.core.metadata import Box
from shardserve.core.regions import local_view
from shardserve.core.wire import byte_view
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason

BATCH_READ_BYTES = 1 << 20  # the largest answer of one call (the ranks' BATCH_READ_BYTES)
MAX_BATCH_REGIONS = 16384  # regions of one call (the ranks' MAX_BATCH_REGIONS)
REPLY_OVERHEAD_BYTES = 16  # a ReadRegionsReply's framing beyond its data and offsets
REGION_OVERHEAD_BYTES = (
    11  # the most an offset adds to a ReadRegionsReply (a varint of up to 10 bytes)
)
REQUEST_OVERHEAD_BYTES = (
    6  # the most a region's framing adds to a ReadRegionsRequest (tag and length)
)


@dataclass(frozen=True)
class RegionRead:
    """One box of one shard (`request`) and where its bytes go (`dest`: a view of the box's shape, any
    strides or device, converted when it is not of the tensor's `dtype`); `piece` names the caller's piece it
    belongs to."""

    rank: int
    request: pb.ReadRegionRequest
    dest: torch.Tensor
    piece: int
    dtype: torch.dtype  # the tensor's: what the rank answers
    nbytes: int = field(init=False)  # the bytes the rank answers for it

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", self.dest.numel() * self.dtype.itemsize)


def region_reads(
    piece: int,
    summary: TensorSummary,
    parts: Sequence[tuple[int, Box]],
    box: Box,
    out: torch.Tensor,
) -> list[RegionRead]:
    """The RegionReads that fill `out` (global `box`) from the chosen (shard index, global part) of each shard."""
    shards = summary.metadata.shards_metadata
    return [
        RegionRead(
            shards[index].rank,
            read_request(summary, index, part),
            local_view(out, box, part),
            piece,
            summary.metadata.dtype,
        )
        for index, part in parts
        if not part.is_empty()
    ]


def batches(
    reads: Iterable[RegionRead],
    limit_bytes: int = BATCH_READ_BYTES,
    limit_regions: int = MAX_BATCH_REGIONS,
) -> list[list[RegionRead]]:
    """`reads` grouped per rank and cut, in order, into batches of at most `limit_bytes` of answer, as many of
    request, and `limit_regions` regions."""
    per_rank: dict[int, list[RegionRead]] = defaultdict(list)
    for read in reads:
        per_rank[read.rank].append(read)
    cut: list[list[RegionRead]] = []
    for rank in sorted(per_rank):
        batch: list[RegionRead] = []
        answer = asked = 0
        for read in per_rank[rank]:
            request = read.request.ByteSize() + REQUEST_OVERHEAD_BYTES
            if batch and (
                answer + read.nbytes > limit_bytes
                or asked + request > limit_bytes
                or len(batch) == limit_regions
            ):
                cut.append(batch)
                batch, answer, asked = [], 0, 0
            batch.append(read)
            answer, asked = answer + read.nbytes, asked + request
        cut.append(batch)
    return cut


def read_regions(policy: PathPolicy, rank: RankStatus, reads: Sequence[RegionRead]) -> int:
    """One ReadRegions call to `rank` for every read of `reads` (one rank's batch), on its bulk port where that
    may serve it (falling back to gRPC as reads do), each region's bytes copied into its `dest`; returns the
    bytes read."""
    request = pb.ReadRegionsRequest(regions=[read.request for read in reads])
    expected = sum(read.nbytes for read in reads)
    reply, path = policy.network.run(
        rank, lambda data_path: _ask(data_path, rank.address, request, expected)
    )
    _check_reply(rank.address, reads, reply)
    if expected:
        data = np.frombuffer(reply.data, dtype=np.uint8)  # a view of the reply's bytes, read-only
        address = data.ctypes.data
        for read, start in zip(reads, reply.offsets):
            if not read.nbytes:
                continue
            if _lands_as_is(
                read
            ):  # one memmove: a numpy or torch copy's dispatch costs more than 8 KiB
                ctypes.memmove(read.dest.data_ptr(), address + start, read.nbytes)
            else:
                copy_region(read.dest, data[start : start + read.nbytes], read.dtype)
    counters.count_read(path, expected)
    return expected


def _ask(
    path: DataPath, address: str, request: pb.ReadRegionsRequest, expected: int
) -> pb.ReadRegionsReply:
    """ReadRegions' reply over `path`, a path of the network chain: all of them take rank calls."""
    reply_bytes = expected + REPLY_OVERHEAD_BYTES + REGION_OVERHEAD_BYTES * len(request.regions)
    return rank_calls(path).read_regions(address, request, reply_bytes)


def copy_region(dest: torch.Tensor, raw: np.ndarray, dtype: torch.dtype) -> None:
    """The region's bytes `raw` (uint8 elements of `dtype`, at any offset of the reply) into `dest`: straight
    into a contiguous CPU `dest` of that dtype (one numpy copy: a small region costs a microsecond, not torch's
    dispatch), else through an aligned copy (a dtype view needs an element-aligned start), converted by
    `copy_` when `dest` is of another dtype."""
    if dest.dtype == dtype and dest.is_contiguous() and dest.device.type == "cpu":
        np.copyto(byte_view(dest).numpy(), raw)
    else:
        dest.copy_(torch.from_numpy(raw.copy()).view(dtype).view(dest.shape))


def _lands_as_is(read: RegionRead) -> bool:
    """Whether the region's bytes go unchanged into one run of host memory: `dest` of the tensor's dtype,
    contiguous, on the CPU."""
    dest = read.dest
    return dest.dtype == read.dtype and dest.device.type == "cpu" and dest.is_contiguous()


def _check_reply(address: str, reads: Sequence[RegionRead], reply: pb.ReadRegionsReply) -> None:
    """ShardServeError unless the reply holds every region at its size, in order."""
    ends = list(reply.offsets[1:]) + [len(reply.data)]
    sizes = [end - start for start, end in zip(reply.offsets, ends)]
    if sizes != [read.nbytes for read in reads] or (reply.offsets and reply.offsets[0] != 0):
        raise ShardServeError(
            f"rank at {address} answered {len(reply.offsets)} regions of {len(reply.data)} "
            f"bytes for {len(reads)} regions of {sum(read.nbytes for read in reads)} bytes"
        )


def read_alone_after(err: BaseException) -> bool:
    """Whether a failed batch is worth reading again box by box (its rank unreachable, slow, or without
    ReadRegions), rather than an error of the request itself."""
    unimplemented = isinstance(err, ShardServeError) and err.reason == Reason.PATH_UNAVAILABLE
    return isinstance(err, (RankUnavailableError, DeadlineExceededError)) or unimplemented


def read_batch(
    policy: PathPolicy, rank_of: Callable[[int], RankStatus], batch: Sequence[RegionRead]
) -> set[int]:
    """Read one rank's batch; returns the pieces to read again by themselves (all of them when the rank failed
    as read_alone_after says, which the policy notes), else raises the batch's error."""
    rank = rank_of(batch[0].rank)
    try:
        read_regions(policy, rank, batch)
    except ShardServeError as err:
        if not read_alone_after(err):
            raise
        policy.health.note_failure(rank.rank, err)
        return {read.piece for read in batch}
    return set()
