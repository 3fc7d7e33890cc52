"""Raw-gRPC helpers for the server tests: stubs, put by WriteShard, read by ReadRegion."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import grpc
import torch
from google.rpc import status_pb2
from grpc_status.rpc_status import GRPC_DETAILS_METADATA_KEY as GRPC_DETAILS_KEY
from reference import shards_of

from shardserve.core.dtypes import dtype_to_wire
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.wire import metadata_from_proto, metadata_to_proto, tensor_bytes
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import ErrorDetail, detail_of_status

TIMEOUT = 30.0
OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


class _AddMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (a credential) to every call that brings none of its own."""

    def __init__(self, metadata: tuple) -> None:
        self._metadata = metadata

    def _details(self, details):
        return _Details(details, details.metadata or self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = (
        intercept_unary_unary
    )


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata):
        self.method, self.timeout, self.metadata = base.method, base.timeout, metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class Stubs:
    """A coordinator stub and one ShardServer stub per rank, with optional call metadata; `default_metadata`
    goes on every call that passes none (e.g. a cluster's internal credential)."""

    def __init__(
        self,
        address: str,
        metadata: tuple = (),
        credentials: grpc.ChannelCredentials | None = None,
        default_metadata: tuple = (),
    ):
        self.metadata = metadata
        self._credentials = credentials
        self._default_metadata = default_metadata
        self._raw_channels: list[grpc.Channel] = []
        self._own_channels: list[grpc.Channel] = []  # rank_stub's
        self.coordinator_channel = self._channel(address)
        self.rank_channels: dict[
            int, grpc.Channel
        ] = {}  # for raw calls a stub cannot make (bad bytes)
        self.coord = pb_grpc.CoordinatorStub(self.coordinator_channel)
        self.ranks: dict[int, pb_grpc.ShardServerStub] = {}
        self._rank_addresses: dict[int, str] = {}
        for info in self.coord.ListRanks(
            pb.ListRanksRequest(), timeout=TIMEOUT, metadata=metadata
        ).ranks:
            self._rank_addresses[info.rank] = info.address
            self.rank_channels[info.rank] = self._channel(info.address)
            self.ranks[info.rank] = pb_grpc.ShardServerStub(self.rank_channels[info.rank])

    def rank_stub(
        self, rank: int, *, options: Sequence[tuple[str, Any]]
    ) -> pb_grpc.ShardServerStub:
        """A ShardServer stub of `rank` on a channel of its own, with gRPC channel `options` added (closed with
        the others)."""
        channel = self._channel(self._rank_addresses[rank], options)
        self._own_channels.append(channel)
        return pb_grpc.ShardServerStub(channel)

    def _channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        if self._credentials is not None:
            channel = grpc.secure_channel(address, self._credentials, options=[*OPTIONS, *options])
        else:
            channel = grpc.insecure_channel(address, options=[*OPTIONS, *options])
        if self._default_metadata:
            self._raw_channels.append(channel)
            return grpc.intercept_channel(channel, _AddMetadata(self._default_metadata))
        return channel

    def close(self) -> None:
        for channel in [
            self.coordinator_channel,
            *self.rank_channels.values(),
            *self._own_channels,
            *self._raw_channels,
        ]:
            channel.close()


def write_requests(
    name: str,
    version: int,
    index: int,
    data: torch.Tensor,
    *,
    chunk: int = 1 << 20,
    dtype: int | None = None,
    nbytes: int | None = None,
):
    """Header then in-order chunks of one shard's bytes."""
    raw = tensor_bytes(data)
    yield pb.WriteShardRequest(
        header=pb.WriteShardHeader(
            name=name,
            version=version,
            shard_index=index,
            dtype=dtype if dtype is not None else dtype_to_wire(data.dtype),
            nbytes=nbytes if nbytes is not None else len(raw),
        )
    )
    for offset in range(0, len(raw), chunk):
        yield pb.WriteShardRequest(
            chunk=pb.TensorChunk(offset=offset, data=bytes(raw[offset : offset + chunk]))
        )


def create(
    stubs: Stubs,
    name: str,
    meta: ShardedTensorMetadata,
    init: int = pb.INIT_NONE,
    seed: int = 0,
    overwrite: bool = False,
) -> pb.TensorInfo:
    return stubs.coord.CreateTensor(
        pb.CreateTensorRequest(
            name=name, metadata=metadata_to_proto(meta), init=init, seed=seed, overwrite=overwrite
        ),
        timeout=TIMEOUT,
        metadata=stubs.metadata,
    )


def write_shards(
    stubs: Stubs,
    info: pb.TensorInfo,
    tensor: torch.Tensor,
    only: list[int] | None = None,
    chunk: int = 1 << 20,
) -> None:
    meta = metadata_from_proto(info.metadata)
    for index, part in enumerate(shards_of(tensor, meta)):
        if only is not None and index not in only:
            continue
        rank = meta.shards_metadata[index].rank
        stubs.ranks[rank].WriteShard(
            write_requests(info.name, info.version, index, part, chunk=chunk),
            timeout=TIMEOUT,
            metadata=stubs.metadata,
        )


def put(
    stubs: Stubs,
    name: str,
    tensor: torch.Tensor,
    meta: ShardedTensorMetadata,
    overwrite: bool = False,
    chunk: int = 1 << 20,
) -> pb.TensorInfo:
    """Create PENDING, write every shard to its owner, commit."""
    info = create(stubs, name, meta, overwrite=overwrite)
    write_shards(stubs, info, tensor, chunk=chunk)
    return stubs.coord.CommitTensor(
        pb.CommitTensorRequest(name=name, version=info.version),
        timeout=TIMEOUT,
        metadata=stubs.metadata,
    )


def read_region(
    stubs: Stubs,
    rank: int,
    name: str,
    version: int,
    shard_index: int,
    *,
    offsets,
    sizes,
    dtype: torch.dtype,
    chunk_bytes: int = 0,
) -> torch.Tensor:
    """One ReadRegion call, assembled into a tensor of `sizes`."""
    out = torch.empty(tuple(sizes), dtype=dtype)
    flat = out.view(-1).view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)
    received = 0
    for chunk in stubs.ranks[rank].ReadRegion(
        pb.ReadRegionRequest(
            name=name,
            version=version,
            shard_index=shard_index,
            offsets=offsets,
            sizes=sizes,
            chunk_bytes=chunk_bytes,
        ),
        timeout=TIMEOUT,
        metadata=stubs.metadata,
    ):
        flat[chunk.offset : chunk.offset + len(chunk.data)] = torch.frombuffer(
            bytearray(chunk.data), dtype=torch.uint8
        )
        received += len(chunk.data)
    assert received == flat.numel()
    return out


def read_full(stubs: Stubs, info: pb.TensorInfo) -> torch.Tensor:
    """The whole tensor, shard by shard."""
    meta = metadata_from_proto(info.metadata)
    out = torch.empty(meta.size, dtype=meta.dtype)
    for index, shard in enumerate(meta.shards_metadata):
        part = read_region(
            stubs,
            shard.rank,
            info.name,
            info.version,
            index,
            offsets=shard.shard_offsets,
            sizes=shard.shard_sizes,
            dtype=meta.dtype,
        )
        view = out
        for d, (o, s) in enumerate(zip(shard.shard_offsets, shard.shard_sizes)):
            view = view.narrow(d, o, s)
        view.copy_(part)
    return out


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    """The RpcError a call raises (fails the test if it succeeds); consumes streaming answers."""
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, pb.TensorInfo):
            for _ in result:
                pass
    except grpc.RpcError as err:
        return err
    raise AssertionError(f"{call} succeeded; expected an error")


class Aborted(Exception):
    """What ServicerContext.abort raises: a servicer called in-process refused the request. `reason` and
    `metadata` are those of the status's ErrorInfo (None and {} for a plain abort)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, detail: ErrorDetail = ErrorDetail(None)
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details
        self.reason, self.metadata = detail.reason, detail.metadata


class ServicerContext:
    """The part of grpc.ServicerContext a servicer called in-process uses (rpc_errors aborts through it)."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def abort_with_status(self, status: grpc.Status) -> None:
        proto = status_pb2.Status.FromString(dict(status.trailing_metadata)[GRPC_DETAILS_KEY])
        raise Aborted(status.code, status.details, detail_of_status(proto))

    def peer(self) -> str:
        return "ipv4:127.0.0.1:4242"


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock` (fails the test if the peer closes first)."""
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        assert part, f"connection closed after {len(data)} of {n} bytes"
        data += part
    return data


def held_numbers(address: str, prefix: str) -> set[int]:
    """The snapshot numbers of `prefix` whose tensors some rank holds (committed, pending or reserved)."""
    with grpc.insecure_channel(address) as channel:
        ranks = pb_grpc.CoordinatorStub(channel).ListRanks(pb.ListRanksRequest(), timeout=10).ranks
    numbers = set()
    for rank in ranks:
        with grpc.insecure_channel(rank.address) as channel:
            stats = pb_grpc.ShardServerStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
        numbers |= {
            int(h.name.split("@")[1].split("/")[0])
            for h in stats.held
            if h.name.startswith(f"{prefix}@")
        }
    return numbers
