"""The batched small-read path (server/rank/reads/batch.py answers it): many small boxes of one rank as one
ReadRegions call, each region's bytes copied into its own output view.

For hundreds of small tensors (a state dict) the per-read cost of a box read
by itself (its path choice, its race, its call) is most of the time; one call
per rank and batch of at most BATCH_READ_BYTES pays it once. A batch goes on
the rank's bulk TCP port (a KIND_READS frame) where reads may use it, else,
and when the port fails, over gRPC: the network chain, whose every path takes rank calls; shared memory is not
used for batches. The bulk port's requests of all batches go out before any answer is taken
(client.paths.pipeline), so the ranks answer at once while this thread copies what came.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from shardserve.client import counters
from shardserve.client.errors import (
    DeadlineExceededError,
    RankUnavailableError,
    ShardServeError,
)
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.kinds import PathKind, PipelinedCalls, StreamedCalls
from shardserve.client.paths.network import read_request
from shardserve.client.paths.pipeline import NetworkCall, SentCalls
from shardserve.client.paths.policy import PathPolicy
from shardserve.core.metadata import Box
from shardserve.core.regions import local_view
from shardserve.core.wire import byte_view
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason

T = TypeVar("T")
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


def filled_batches(
    reads: Iterable[RegionRead],
    limit_bytes: int = BATCH_READ_BYTES,
    limit_regions: int = MAX_BATCH_REGIONS,
) -> Iterator[list[RegionRead]]:
    """`reads` grouped per rank and cut, in order, into batches of at most `limit_bytes` of answer, as many of
    request, and `limit_regions` regions: each batch given as soon as it is full (a caller can send it while
    `reads` is still being made), then the rest rank by rank."""
    filling: dict[int, _Filling] = {}
    for read in reads:
        batch = filling.setdefault(read.rank, _Filling())
        request = read.request.ByteSize() + REQUEST_OVERHEAD_BYTES
        if batch.reads and (
            batch.answer + read.nbytes > limit_bytes
            or batch.asked + request > limit_bytes
            or len(batch.reads) == limit_regions
        ):
            yield batch.reads
            batch = filling[read.rank] = _Filling()
        batch.reads.append(read)
        batch.answer += read.nbytes
        batch.asked += request
    for rank in sorted(filling):
        yield filling[rank].reads


@dataclass
class _Filling:
    """One rank's batch being filled: its regions, and the bytes of its answer and of its request so far."""

    reads: list[RegionRead] = field(default_factory=list)
    answer: int = 0
    asked: int = 0


def read_batches(
    policy: PathPolicy,
    rank_of: Callable[[int], RankStatus],
    cut: Iterable[Sequence[RegionRead]],
    submit: Callable[[Callable[[], object]], Future[object]],
) -> set[int]:
    """Read every batch of `cut` (one rank's regions each) as one ReadRegions call: a batch going on a bulk port
    is sent as soon as `cut` gives it (client.paths.pipeline: the ranks answer while the caller still plans
    and this thread copies the answers that came), the gRPC calls all at once on `submit`'s threads once `cut`
    is done; falling back as reads do. Returns the pieces to read again by themselves: those of batches whose
    rank failed as read_alone_after says (the policy notes it); any other failure of a batch is raised once
    every batch has ended."""
    batches_sent = _BatchesSent()
    try:
        for batch in cut:
            batches_sent.add(policy, rank_of(batch[0].rank), batch, submit)
    except BaseException:  # the batches out are answered before this is raised: none lands after
        batches_sent.wait_quietly()
        raise
    return batches_sent.wait(policy, submit)


class _BatchesSent:
    """The batches of one read: those on a pipelined path sent as they come, the others kept to be called at
    once; each batch's last error by its position."""

    def __init__(self) -> None:
        self.batches: list[Sequence[RegionRead]] = []
        self.errors: dict[int, BaseException] = {}
        self.sent: list[tuple[list[int], SentCalls]] = []
        self.streamed: list[tuple[int, NetworkCall]] = []

    def add(
        self,
        policy: PathPolicy,
        rank: RankStatus,
        batch: Sequence[RegionRead],
        submit: Callable[[Callable[[], object]], Future[object]],
    ) -> None:
        position = len(self.batches)
        self.batches.append(batch)
        call = _batch_call(rank, batch, partial(self.errors.__setitem__, position))
        if policy.sends_now(rank):
            self.sent.append(([position], policy.send_all([call], submit)))
        else:
            self.streamed.append((position, call))

    def wait_quietly(self) -> None:
        """Wait for every batch sent, whatever its outcome."""
        for _, calls in self.sent:
            with suppress(Exception):
                calls.wait()

    def wait(
        self, policy: PathPolicy, submit: Callable[[Callable[[], object]], Future[object]]
    ) -> set[int]:
        """Call the kept batches, wait for every batch; the pieces of those whose rank failed (read_alone_after),
        else the first other failure raised."""
        if self.streamed:
            positions, calls = zip(*self.streamed)
            self.sent.append((list(positions), policy.send_all(list(calls), submit)))
        paths: dict[int, PathKind | None] = {}
        failure: Exception | None = None
        for positions_sent, calls_sent in self.sent:
            try:
                calls_sent.wait()
            except Exception as err:  # noqa: BLE001 - each failed batch is judged below by its own error
                failure = failure or err
            paths.update(zip(positions_sent, calls_sent.paths))
        failed = sorted(position for position, path in paths.items() if path is None)
        if failure is not None and any(position not in self.errors for position in failed):
            raise failure
        alone: set[int] = set()
        for position in failed:
            if not read_alone_after(self.errors[position]):
                raise self.errors[position]
            alone |= {read.piece for read in self.batches[position]}
        return alone


def _batch_call(
    rank: RankStatus, reads: Sequence[RegionRead], note: Callable[[BaseException], None]
) -> NetworkCall:
    """One batch's ReadRegions call to `rank`: sent on a pipelined path (its answer landed when taken) or made
    whole on a streamed one; `note` keeps the error of each attempt that failed."""
    request = pb.ReadRegionsRequest(regions=[read.request for read in reads])
    expected = sum(read.nbytes for read in reads)
    reply_bytes = expected + REPLY_OVERHEAD_BYTES + REGION_OVERHEAD_BYTES * len(reads)

    def land(reply: pb.ReadRegionsReply, path: PathKind) -> None:
        _check_reply(rank.address, reads, reply)
        _copy_regions(reads, reply)
        counters.count_read(str(path), expected)

    def send(path: PipelinedCalls, cancel: Cancellation) -> Callable[[], None]:
        answer = _noted(
            note, partial(path.send_read_regions, rank.address, request, reply_bytes, cancel)
        )
        return lambda: _noted(note, lambda: land(answer(), path.kind))

    def call(path: StreamedCalls, cancel: Cancellation) -> None:
        _noted(note, lambda: land(path.read_regions(rank.address, request, reply_bytes), path.kind))

    return NetworkCall(rank, send, call, None, expected)


def _noted(note: Callable[[BaseException], None], action: Callable[[], T]) -> T:
    """`action()`, its error given to `note` before it is raised."""
    try:
        return action()
    except BaseException as err:
        note(err)
        raise


def _copy_regions(reads: Sequence[RegionRead], reply: pb.ReadRegionsReply) -> None:
    """Each region's bytes of a checked reply into its `dest`."""
    if not reply.data:
        return
    data = np.frombuffer(reply.data, dtype=np.uint8)  # a view of the reply's bytes, read-only
    address = data.ctypes.data
    for read, start in zip(reads, reply.offsets):
        if not read.nbytes:
            continue
        if _lands_as_is(read.dest, read.dtype):
            # one memmove: a numpy or torch copy's dispatch costs more than copying 8 KiB
            ctypes.memmove(read.dest.data_ptr(), address + start, read.nbytes)
        else:
            copy_region(read.dest, data[start : start + read.nbytes], read.dtype)


def copy_region(dest: torch.Tensor, raw: np.ndarray, dtype: torch.dtype) -> None:
    """The region's bytes `raw` (uint8 elements of `dtype`, at any offset of the reply) into `dest`: straight
    into a contiguous CPU `dest` of that dtype (one numpy copy: a small region costs a microsecond, not torch's
    dispatch), else through an aligned copy (a dtype view needs an element-aligned start), converted by
    `copy_` when `dest` is of another dtype."""
    if _lands_as_is(dest, dtype):
        np.copyto(byte_view(dest).numpy(), raw)
    else:
        dest.copy_(torch.from_numpy(raw.copy()).view(dtype).view(dest.shape))


def _lands_as_is(dest: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a region's bytes of `dtype` go unchanged into `dest`, one run of host memory: `dest` of that
    dtype, contiguous, on the CPU."""
    return dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous()


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
