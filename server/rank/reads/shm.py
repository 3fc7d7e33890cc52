"""ShardServer.OpenShard(s) / ReleaseShard: hand served shards to a same-host client by reference.

OpenShard leases the (name, version) in the store for a bounded time and answers
where the shard's memory is (server/rank/shared_memory.py): a memfd the client opens
as /proc/<pid>/fd/<fd>, or, for a CUDA shard and a client that asks, a CUDA IPC
handle. The lease keeps the version (its tensor, mapping and fd) alive until
ReleaseShard or expiry, so the fd cannot name other data meanwhile.
"""

from __future__ import annotations

import logging
from typing import cast

import grpc

from shardserve.core.dtypes import dtype_to_wire
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.requests import check_name, check_version
from shardserve.server.rank.cuda_ipc import cuda_ipc_handle
from shardserve.server.rank.error_status import item_errors, rank_rpc
from shardserve.server.rank.errors import InvalidArgument, PathUnavailable
from shardserve.server.rank.metrics import SHM
from shardserve.server.rank.reads.open_leases import Leases, lease_seconds
from shardserve.server.rank.shared_memory import Segment
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.version_table import StoredVersion

log = logging.getLogger(__name__)

MAX_OPEN_SHARDS = (
    4096  # shards one OpenShards call may open: a large state dict's shards on one rank
)


class SharedMemoryService:
    """The same-host data plane RPCs of one rank."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.leases = Leases()

    @rank_rpc
    def OpenShard(
        self, request: pb.OpenShardRequest, context: grpc.ServicerContext
    ) -> pb.OpenShardResponse:
        self.leases.expire()
        return self._open(request)

    @rank_rpc
    def OpenShards(
        self, request: pb.OpenShardsRequest, context: grpc.ServicerContext
    ) -> pb.OpenShardsResponse:
        """Every shard of the batch opened and leased, or none: the leases taken before a failure are released."""
        if len(request.shards) > MAX_OPEN_SHARDS:
            raise InvalidArgument(
                f"shards: {len(request.shards)} in one call, over the limit of {MAX_OPEN_SHARDS}"
            )
        self.leases.expire()
        answer = pb.OpenShardsResponse()
        try:
            for i, shard in enumerate(request.shards):
                with item_errors(f"shards[{i}]"):
                    answer.shards.append(self._open(shard))
        except BaseException:
            self.leases.release([s.lease_id for s in answer.shards if s.lease_id])
            raise
        return answer

    def _open(self, request: pb.OpenShardRequest) -> pb.OpenShardResponse:
        """One shard described and leased (no lease when the client already maps its segment)."""
        name = check_name(request.name)
        version = check_version(request.version)
        try:
            seconds = lease_seconds(request.lease_s)
        except ValueError as err:
            raise InvalidArgument(str(err)) from None
        lease = self.store.leases.lease(name, version)
        entry = lease.__enter__()
        try:
            reply = self._describe(entry, request)
        except BaseException:
            lease.__exit__(None, None, None)
            raise
        self.store.metrics.served(SHM, name, reply.nbytes)
        if reply.inode and reply.inode == request.cached_inode:
            lease.__exit__(None, None, None)  # the client already maps it: nothing to keep alive
        else:
            try:
                reply.lease_id = self.leases.hold(lease, seconds)
            except BaseException:  # over the cap: the version must not stay held for nobody
                lease.__exit__(None, None, None)
                raise
            reply.lease_expires_s = seconds
        return reply

    def _describe(self, entry: StoredVersion, request: pb.OpenShardRequest) -> pb.OpenShardResponse:
        shard = self.store.leases.shard_of(entry, request.shard_index)
        reply = pb.OpenShardResponse(
            nbytes=shard.numel() * shard.element_size(),
            dtype=cast(pb.DType, dtype_to_wire(shard.dtype)),  # the wire enum's number
            shard_sizes=list(shard.shape),
            version=entry.version,
            max_request_bytes=self.store.leases.max_request_bytes,
        )
        segment: Segment | None
        if self.store.blocks.is_composed(shard):  # the state words apart; the data in blocks
            segment = self.store.leases.state_header(
                entry, request.shard_index, slot=request.header_slots
            )
            if segment.header_offset and not request.header_slots:
                raise PathUnavailable(
                    f"shard_index {request.shard_index} of {entry.name!r} has its header in a slot of a "
                    f"header file; ask with header_slots or read it over ReadRegion"
                )
            reply.extents.extend(
                pb.ShardExtent(
                    fd=e.fd, inode=e.inode, device_id=e.device_id, offset=e.offset, nbytes=e.nbytes
                )
                for e in self.store.blocks.extents(shard)
            )
        elif shard.device.type == "cuda":
            if not request.cuda_ipc:
                raise PathUnavailable(
                    f"shard_index {request.shard_index} of {entry.name!r} is on "
                    f"{shard.device}; ask with cuda_ipc or read it over ReadRegion"
                )
            reply.cuda.CopyFrom(cuda_ipc_handle(shard))
            # the state word alone, no data
            segment = self.store.leases.state_header(entry, request.shard_index)
        else:
            segment = self.store.leases.shared_segment(entry, request.shard_index)
        if segment is None:
            if reply.nbytes == 0:
                return reply
            raise PathUnavailable(
                f"rank {self.store.rank} does not serve shards through shared memory"
            )
        reply.pid, reply.fd, reply.inode, reply.device_id = (
            segment.pid,
            segment.fd,
            segment.inode,
            segment.device_id,
        )
        reply.data_offset, reply.header_offset = segment.data_offset, segment.header_offset
        return reply

    @rank_rpc
    def ReleaseShard(
        self, request: pb.ReleaseShardRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseShardResponse:
        return pb.ReleaseShardResponse(released=self.leases.release(list(request.lease_ids)))


def handlers(service: SharedMemoryService) -> dict[str, grpc.RpcMethodHandler]:
    """The ShardServer method handlers of the same-host data plane RPCs."""
    return {
        "OpenShard": grpc.unary_unary_rpc_method_handler(
            service.OpenShard,
            request_deserializer=pb.OpenShardRequest.FromString,
            response_serializer=pb.OpenShardResponse.SerializeToString,
        ),
        "OpenShards": grpc.unary_unary_rpc_method_handler(
            service.OpenShards,
            request_deserializer=pb.OpenShardsRequest.FromString,
            response_serializer=pb.OpenShardsResponse.SerializeToString,
        ),
        "ReleaseShard": grpc.unary_unary_rpc_method_handler(
            service.ReleaseShard,
            request_deserializer=pb.ReleaseShardRequest.FromString,
            response_serializer=pb.ReleaseShardResponse.SerializeToString,
        ),
    }
