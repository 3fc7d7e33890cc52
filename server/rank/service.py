"""The ShardServer gRPC servicer: a thin layer over one rank's ShardStore."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import grpc

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.wire import options_from_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.chunk_codec import (
    LookupPart,
    RawChunk,
    decode_write_request,
    encode_chunk,
    encode_lookup_chunk,
    encode_lookup_reply,
)
from shardserve.server.common import errors as common_errors
from shardserve.server.common.log_phrases import versions_phrase
from shardserve.server.common.requests import (
    check_init,
    check_name,
    check_options,
    check_version,
    parse_metadata,
)
from shardserve.server.rank.error_status import item_errors, rank_rpc
from shardserve.server.rank.errors import InvalidArgument
from shardserve.server.rank.jobs.checkpoint import run_checkpoint_load, run_checkpoint_save
from shardserve.server.rank.jobs.groups import ProcessGroups
from shardserve.server.rank.jobs.reshard import run_reshard_job
from shardserve.server.rank.jobs.service import CollectiveJobService, JobKinds
from shardserve.server.rank.jobs.service import handlers as collective_handlers
from shardserve.server.rank.metrics import GRPC
from shardserve.server.rank.reads.batch import BatchReads
from shardserve.server.rank.reads.batch import handlers as batch_read_handlers
from shardserve.server.rank.reads.bulk import BulkReads
from shardserve.server.rank.reads.bulk import handlers as bulk_read_handlers
from shardserve.server.rank.reads.path import ReadPath
from shardserve.server.rank.reads.shm import SharedMemoryService
from shardserve.server.rank.reads.shm import handlers as shared_memory_handlers
from shardserve.server.rank.reads.small import SmallReads
from shardserve.server.rank.reads.small import handlers as small_read_handlers
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.wire import (
    checksum_messages,
    held_messages,
    init_fill,
    shared_messages,
)
from shardserve.server.rank.writes.batch import ShardWrites
from shardserve.server.rank.writes.batch import handlers as shard_write_handlers
from shardserve.server.rank.writes.in_place import open_allocated
from shardserve.server.rank.writes.path import WritePath

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 16 << 20
MAX_BATCH_VERSIONS = 1 << 16  # versions one AllocateMany / PromoteMany / DropMany names
MIN_CHUNK_BYTES = (
    4096  # a floor, so a hostile chunk_bytes=1 cannot turn one read into millions of messages
)


def job_kinds() -> JobKinds:
    """The collective job kinds a rank runs."""
    kinds = JobKinds()
    kinds.register("reshard", run_reshard_job)
    kinds.register("checkpoint_load", run_checkpoint_load)
    kinds.register("checkpoint_save", run_checkpoint_save)
    return kinds


class ShardServerServicer(pb_grpc.ShardServerServicer):
    """Allocates, fills, promotes, drops and streams the shards of one rank."""

    def __init__(
        self,
        store: ShardStore,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bulk_reads: BulkReads | None = None,
        groups: ProcessGroups | None = None,
        *,
        memory_limit_source: str = "",
        kinds: JobKinds | None = None,
    ) -> None:
        """`kinds`: the collective job kinds it runs (default job_kinds(); a harness that simulates ranks
        without collectives registers its own)."""
        self.store = store
        self.memory_limit_source = (
            memory_limit_source  # where the store's limit came from, for GetStats
        )
        self.chunk_bytes = chunk_bytes
        self.reads = ReadPath(store)
        self.writes = WritePath(store)
        self.collectives = CollectiveJobService(
            store, kinds if kinds is not None else job_kinds(), groups
        )
        self.shared_memory = SharedMemoryService(store)
        self.small_reads = SmallReads(store)
        self.batch_reads = BatchReads(store)
        self.shard_writes = ShardWrites(store)
        self.bulk_reads = bulk_reads or BulkReads(
            store, None, off_reason="this server was built without one"
        )

    @rank_rpc
    def AllocateShards(
        self, request: pb.AllocateShardsRequest, context: grpc.ServicerContext
    ) -> pb.AllocateShardsResponse:
        return pb.AllocateShardsResponse(
            allocated_bytes=self._allocate(checked_allocation(request))
        )

    @rank_rpc
    def AllocateMany(
        self, request: pb.AllocateManyRequest, context: grpc.ServicerContext
    ) -> pb.AllocateManyResponse:
        """Every allocation of the batch, or none: the ones made before a failure are dropped again."""
        check_batch_size(len(request.tensors), "tensors")
        allocations = [
            checked_allocation(t, f"tensors[{i}].") for i, t in enumerate(request.tensors)
        ]
        self._drop_quietly(
            checked_versions(request.drop_first, allow_zero=True, field="drop_first")
        )
        made, total = [], 0
        try:
            for index, allocation in enumerate(allocations):
                with (
                    item_errors(
                        f"tensors[{index}] ({allocation.name!r} version {allocation.version})"
                    ),
                ):
                    total += self._allocate(allocation, log_level=logging.DEBUG)
                made.append(allocation)
        except BaseException:
            for done in made:
                self.store.drop(done.name, done.version)
            raise
        versions = [(a.name, a.version) for a in allocations]
        log.info(
            "rank %d allocated %d bytes for %s", self.store.rank, total, versions_phrase(versions)
        )
        writable = (
            open_allocated(self.store, versions, request.writer_host_id)
            if request.writer_host_id
            else []
        )
        return pb.AllocateManyResponse(allocated_bytes=total, writable=writable)

    def _allocate(self, allocation: Allocation, *, log_level: int = logging.INFO) -> int:
        request, name, version, meta = (
            allocation.request,
            allocation.name,
            allocation.version,
            allocation.meta,
        )
        options = options_from_proto(request.options)
        if request.init == pb.INIT_COPY:
            return self.store.allocate_copy(
                name,
                version,
                meta,
                check_version(request.source_version, "source_version"),
                options,
                source_name=check_name(request.source_name, "source_name")
                if request.source_name
                else None,
            )
        if request.reserve_only:  # a collective job (reshard) installs the shards later
            return self.store.reserve(name, version, meta, options)
        check_init(request.init, meta.dtype)
        fill = init_fill(request.init)
        return self.store.allocate(
            name, version, meta, fill, request.seed, options, log_level=log_level
        )

    @rank_rpc
    def PromoteVersion(
        self, request: pb.PromoteVersionRequest, context: grpc.ServicerContext
    ) -> pb.PromoteVersionResponse:
        name, version = check_name(request.name), check_version(request.version)
        checksums = self.store.promote(name, version)
        return pb.PromoteVersionResponse(checksums=checksum_messages({(name, version): checksums}))

    @rank_rpc
    def PromoteMany(
        self, request: pb.PromoteManyRequest, context: grpc.ServicerContext
    ) -> pb.PromoteManyResponse:
        """Promote the versions, persisted with one sync round for all; the first version that is not
        promotable fails the batch before any is served (the coordinator then drops them all). With
        `finish_in_place`, the shards their writers filled in place count as written first."""
        versions = list(checked_versions(request.versions))
        if request.finish_in_place:
            for index, (name, version) in enumerate(versions):
                with _item_errors(index):
                    self.store.leases.finish_all_in_place(name, version)
        checksums = self.store.promote_many(versions, item_errors=_item_errors)
        return pb.PromoteManyResponse(
            checksums=checksum_messages(checksums),
            shared=shared_messages(self.store.shared_bytes(versions)),
        )

    @rank_rpc
    def DropVersion(
        self, request: pb.DropVersionRequest, context: grpc.ServicerContext
    ) -> pb.DropVersionResponse:
        self.store.drop(check_name(request.name), check_version(request.version, allow_zero=True))
        return pb.DropVersionResponse()

    @rank_rpc
    def DropMany(
        self, request: pb.DropManyRequest, context: grpc.ServicerContext
    ) -> pb.DropManyResponse:
        self._drop_quietly(checked_versions(request.versions, allow_zero=True))
        return pb.DropManyResponse()

    def _drop_quietly(self, versions: list[tuple[str, int]]) -> None:
        """Drop each version this rank holds (one log line for all; a version not held is no error)."""
        dropped = sum(
            self.store.drop(name, version, log_level=logging.DEBUG) for name, version in versions
        )
        if dropped:
            log.info(
                "rank %d dropped %d held versions of %s",
                self.store.rank,
                dropped,
                versions_phrase(versions),
            )

    @rank_rpc
    def WriteShard(
        self, request_iterator: Iterable[pb.WriteShardRequest], context: grpc.ServicerContext
    ) -> pb.WriteShardResponse:
        return pb.WriteShardResponse(bytes_written=self.writes.stream(request_iterator))

    @rank_rpc
    def ReadRegion(
        self, request: pb.ReadRegionRequest, context: grpc.ServicerContext
    ) -> Iterator[RawChunk]:
        chunk_bytes = self._chunk_bytes(request.chunk_bytes)
        with self.reads.region(request, GRPC) as data:
            for offset in range(0, len(data), chunk_bytes):
                yield RawChunk(
                    offset, data[offset : offset + chunk_bytes]
                )  # encoded by encode_chunk

    def _chunk_bytes(self, requested: int) -> int:
        if requested < 0:
            raise InvalidArgument(f"chunk_bytes {requested} is negative")
        return max(MIN_CHUNK_BYTES, min(requested or self.chunk_bytes, MAX_CHUNK_BYTES))

    @rank_rpc
    def Lookup(
        self, request: pb.LookupRequest, context: grpc.ServicerContext
    ) -> Iterator[LookupPart]:
        yield from self.reads.lookup(request)

    @rank_rpc
    def LookupSmall(
        self, request: pb.LookupRequest, context: grpc.ServicerContext
    ) -> list[LookupPart]:
        return self.reads.lookup_small(request, GRPC)

    @rank_rpc
    def WriteRows(
        self, request: pb.WriteRowsRequest, context: grpc.ServicerContext
    ) -> pb.WriteRowsResponse:
        return pb.WriteRowsResponse(rows_written=self.writes.rows(request))

    @rank_rpc
    def WriteBytes(
        self, request: pb.WriteBytesRequest, context: grpc.ServicerContext
    ) -> pb.WriteBytesResponse:
        return pb.WriteBytesResponse(bytes_written=self.writes.byte_ranges(request))

    @rank_rpc
    def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.ServicerContext
    ) -> pb.GetStatsResponse:
        return pb.GetStatsResponse(
            rank=self.store.rank,
            memory_used_bytes=self.store.memory_used,
            memory_limit_bytes=self.store.memory_limit,
            memory_limit_source=self.memory_limit_source,
            held=held_messages(self.store.held()),
        )


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ShardServer"].full_name


@dataclass(frozen=True)
class Allocation:
    """An AllocateShardsRequest whose fields were checked."""

    request: pb.AllocateShardsRequest
    name: str
    version: int
    meta: ShardedTensorMetadata


def checked_allocation(request: pb.AllocateShardsRequest, prefix: str = "") -> Allocation:
    """The request's name, version and layout, checked; INVALID_ARGUMENT names `prefix` + the field."""
    name = check_name(request.name, f"{prefix}name")
    version = check_version(request.version, f"{prefix}version")
    meta = parse_metadata(request.metadata, f"{prefix}metadata")
    try:
        check_options(request.options, meta)
    except common_errors.InvalidArgument as err:
        raise InvalidArgument(f"{prefix}{err.message}") from None
    return Allocation(request, name, version, meta)


def _item_errors(index: int) -> AbstractContextManager[None]:
    """Errors of versions[index] of a batch, as the service errors that answer them, naming the entry (a plain
    context manager: a batch enters one per version, up to three times)."""
    return item_errors(f"versions[{index}]")


def checked_versions(
    requests: Sequence[pb.PromoteVersionRequest | pb.DropVersionRequest],
    allow_zero: bool = False,
    *,
    field: str = "versions",
) -> list[tuple[str, int]]:
    """(name, version) of each request of a batch, checked; INVALID_ARGUMENT names `<field>[i]`."""
    check_batch_size(len(requests), field)
    return [
        (
            check_name(r.name, f"{field}[{i}].name"),
            check_version(r.version, f"{field}[{i}].version", allow_zero=allow_zero),
        )
        for i, r in enumerate(requests)
    ]


def check_batch_size(count: int, field: str) -> None:
    if count > MAX_BATCH_VERSIONS:
        raise InvalidArgument(
            f"{field}: {count} in one call, over the limit of {MAX_BATCH_VERSIONS}"
        )


def add_shard_server(server: grpc.Server, servicer: ShardServerServicer) -> str:
    """Register the ShardServer service, with the bulk messages going through chunk_codec; return its name."""

    def unary(method: Any, request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            method,
            request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString,
        )

    handlers = {
        "AllocateShards": unary(
            servicer.AllocateShards, pb.AllocateShardsRequest, pb.AllocateShardsResponse
        ),
        "PromoteVersion": unary(
            servicer.PromoteVersion, pb.PromoteVersionRequest, pb.PromoteVersionResponse
        ),
        "DropVersion": unary(servicer.DropVersion, pb.DropVersionRequest, pb.DropVersionResponse),
        "AllocateMany": unary(
            servicer.AllocateMany, pb.AllocateManyRequest, pb.AllocateManyResponse
        ),
        "PromoteMany": unary(servicer.PromoteMany, pb.PromoteManyRequest, pb.PromoteManyResponse),
        "DropMany": unary(servicer.DropMany, pb.DropManyRequest, pb.DropManyResponse),
        "GetStats": unary(servicer.GetStats, pb.GetStatsRequest, pb.GetStatsResponse),
        "WriteShard": grpc.stream_unary_rpc_method_handler(
            servicer.WriteShard,
            request_deserializer=decode_write_request,
            response_serializer=pb.WriteShardResponse.SerializeToString,
        ),
        "ReadRegion": grpc.unary_stream_rpc_method_handler(
            servicer.ReadRegion,
            request_deserializer=pb.ReadRegionRequest.FromString,
            response_serializer=encode_chunk,
        ),
        "WriteRows": unary(servicer.WriteRows, pb.WriteRowsRequest, pb.WriteRowsResponse),
        "WriteBytes": unary(servicer.WriteBytes, pb.WriteBytesRequest, pb.WriteBytesResponse),
        "LookupSmall": grpc.unary_unary_rpc_method_handler(
            servicer.LookupSmall,
            request_deserializer=pb.LookupRequest.FromString,
            response_serializer=encode_lookup_reply,
        ),
        "Lookup": grpc.unary_stream_rpc_method_handler(
            servicer.Lookup,
            request_deserializer=pb.LookupRequest.FromString,
            response_serializer=encode_lookup_chunk,
        ),
    }
    handlers.update(collective_handlers(servicer.collectives))
    handlers.update(shared_memory_handlers(servicer.shared_memory))
    handlers.update(small_read_handlers(servicer.small_reads))
    handlers.update(batch_read_handlers(servicer.batch_reads))
    handlers.update(bulk_read_handlers(servicer.bulk_reads))
    handlers.update(shard_write_handlers(servicer.shard_writes))
    missing = set(pb.DESCRIPTOR.services_by_name["ShardServer"].methods_by_name) - set(handlers)
    if missing:
        raise RuntimeError(f"ShardServer methods without a handler: {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    return SERVICE_NAME
