"""The gRPC data path (server/rank/reads/small.py and lookup.py answer it): boxes and lookups over the channel,
and batched whole-shard writes (server/rank/writes/batch.py).

A box of at most SMALL_READ_BYTES is one unary ReadRegionSmall call (about
half a stream's per-call cost), a larger one a ReadRegion stream written
straight into the preallocated output. A lookup whose answer fits
SMALL_ANSWER_BYTES is one LookupSmall message, a larger one a Lookup stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
import torch

from shardserve.client.channel import Channel
from shardserve.client.errors import RankUnavailableError, ShardServeError, error_from_rpc
from shardserve.client.info import RankStatus
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.kinds import CPU_AND_CUDA, Capabilities, PathKind
from shardserve.client.paths.network import NetworkPath
from shardserve.client.paths.writes import INLINE_BATCH_BYTES, ShardWrite, batched, write_request
from shardserve.core.wire import tensor_bytes
from shardserve.protos import shardserve_pb2 as pb

SMALL_READ_BYTES = (
    1 << 20
)  # boxes up to this size come as one unary reply (ReadRegionSmall), larger ones stream
# Answers up to this many bytes (the ranks' SMALL_REPLY_BYTES) come in one LookupSmall message, larger ones stream:
# one message beat the stream at 512 KiB and at 2 MiB per rank (a stream costs about twice a unary call).
SMALL_ANSWER_BYTES = 4 << 20


def answers_in_one_message(answer_bytes: int) -> bool:
    """Whether a lookup answer of `answer_bytes` comes as one message (LookupSmall, or the bulk port's reply)."""
    return answer_bytes <= SMALL_ANSWER_BYTES


class GrpcPath(NetworkPath):
    """Reads, lookups and writes as gRPC calls to the ranks (a DataPath: client.paths.kinds); it serves every
    rank."""

    kind = PathKind.GRPC
    # the rank copies CUDA shards out itself; every call can also be a stream, so any answer fits
    capabilities = Capabilities(devices=CPU_AND_CUDA, rank_calls=True, streamed=True)

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def close(self) -> None:
        """Nothing to let go of: the channel is the client's."""

    def refusal(self, rank: RankStatus) -> ShardServeError:
        return RankUnavailableError(f"rank {rank.rank} has no address")

    def read_box(
        self,
        address: str,
        request: pb.ReadRegionRequest,
        dest: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> None:
        """One box into `dest` (a flat uint8 tensor of its size): unary when small, else a ReadRegion stream;
        `cancel` can stop the call from another thread."""
        if dest.numel() > SMALL_READ_BYTES:
            self.read_stream(address, request, dest, cancel)
        else:
            self.read_small(address, request, dest, cancel)

    def read_small(
        self,
        address: str,
        request: pb.ReadRegionRequest,
        dest: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> None:
        """One box as one ReadRegionSmall reply into `dest`."""
        expected = dest.numel()
        call = self.channel.shard_methods(address).read_region_small
        try:
            offset, data = unary(
                call, request, self.channel.data_timeout(expected), self.channel.metadata, cancel
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"rank at {address}") from None
        if offset != 0 or len(data) != expected:
            raise ShardServeError(
                f"rank at {address} sent {len(data)} bytes at offset {offset} for a "
                f"{expected}-byte region"
            )
        if expected:
            dest.numpy()[:] = np.frombuffer(data, dtype=np.uint8)

    def read_stream(
        self,
        address: str,
        request: pb.ReadRegionRequest,
        dest: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> None:
        """One box as a ReadRegion stream into `dest`, each chunk written in place."""
        expected = dest.numel()
        target = dest.numpy() if expected else np.empty(0, dtype=np.uint8)
        read = self.channel.shard_methods(address).read_region
        call = read(
            request, timeout=self.channel.data_timeout(expected), metadata=self.channel.metadata
        )
        if cancel is not None:
            cancel.on_cancel(call.cancel)
        received = 0
        try:
            for offset, data in call:
                end = offset + len(data)
                if offset < 0 or end > expected:
                    raise ShardServeError(
                        f"rank at {address} sent a chunk at bytes [{offset}, {end}) of a {expected}-byte region"
                    )
                if len(data):
                    target[offset:end] = np.frombuffer(data, dtype=np.uint8)
                received += len(data)
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"rank at {address}") from None
        finally:
            call.cancel()
        if received != expected:
            raise ShardServeError(
                f"rank at {address} sent {received} bytes for a {expected}-byte region"
            )

    def write_shards(self, address: str, writes: Sequence[ShardWrite]) -> int:
        """Write whole shards to the rank at `address`: those up to INLINE_BATCH_BYTES in WriteShards requests of
        at most that many bytes inline, larger ones each as a WriteShard stream; returns the bytes written."""
        small = [write for write in writes if write.nbytes <= INLINE_BATCH_BYTES]
        written = 0
        for batch in batched(small, INLINE_BATCH_BYTES):
            request = write_request(batch)
            request.data = b"".join(tensor_bytes(write.stored()) for write in batch)
            reply = self.channel.unary(
                self.channel.shard_methods(address).write_shards,
                request,
                f"rank at {address}",
                timeout=self.channel.data_timeout(len(request.data)),
            )
            written += reply.bytes_written
        for write in writes:
            if write.nbytes > INLINE_BATCH_BYTES:
                written += self.channel.write_shard(
                    address, write.header, tensor_bytes(write.stored()), write.chunk_bytes
                )
        return written

    def read_regions(
        self, address: str, request: pb.ReadRegionsRequest, reply_bytes: int
    ) -> pb.ReadRegionsReply:
        """ReadRegions' answer to `request` as one RPC (at most `reply_bytes` serialized)."""
        try:
            return self.channel.shard_methods(address).read_regions(
                request,
                timeout=self.channel.data_timeout(reply_bytes),
                metadata=self.channel.metadata,
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"rank at {address}") from None

    def lookup(
        self,
        address: str,
        request: pb.LookupRequest,
        answer_bytes: int,
        take: Callable[[Any], None],
        where: str,
        cancel: Cancellation | None = None,
    ) -> None:
        """LookupSmall (an answer up to SMALL_ANSWER_BYTES) or the Lookup stream; `take(chunk)` gets every
        RawLookupChunk as it arrives (a streamed answer waits for its next chunk outside `take`)."""
        methods = self.channel.shard_methods(address)
        timeout = self.channel.data_timeout(answer_bytes)
        try:
            if answers_in_one_message(answer_bytes):
                chunks = unary(
                    methods.lookup_small, request, timeout, self.channel.metadata, cancel
                )
            else:
                chunks = methods.lookup(request, timeout=timeout, metadata=self.channel.metadata)
                if cancel is not None:
                    cancel.on_cancel(chunks.cancel)
            for chunk in chunks:
                take(chunk)
        except grpc.RpcError as err:
            raise error_from_rpc(err, where) from None


def unary(
    method: Any, request: Any, timeout: float, metadata: Any, cancel: Cancellation | None
) -> Any:
    """A unary call, made as a future that `cancel` can cancel when one is given (a plain call otherwise)."""
    if cancel is None:
        return method(request, timeout=timeout, metadata=metadata)
    future = method.future(request, timeout=timeout, metadata=metadata)
    cancel.on_cancel(future.cancel)
    try:
        return future.result()
    except grpc.FutureCancelledError:
        raise ShardServeError(
            "the call was cancelled: another copy answered first, or its rank was reported dead"
        ) from None
