"""ShardServer.WriteShards: whole shards of pending versions written in one call, from any byte source.

A batch names its shards (WriteShardHeader each, validated before any byte is
written) whose bytes lie back to back in request order. Where they come from is
the source's business: inline in the request (gRPC), a same-host writer's memfd
(server/rank/writes/shared.py), or the bulk port's connection
(server/rank/reads/bulk.py); all go through the rank's WritePath
(server/rank/writes/path.py).
"""

from __future__ import annotations

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.error_status import rank_rpc
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes.path import WritePath


class ShardWrites:
    """WriteShards of one rank, for its inline and same-host sources (the bulk port brings its own bytes)."""

    def __init__(self, store: ShardStore) -> None:
        self.writes = WritePath(store)

    @rank_rpc
    def WriteShards(
        self, request: pb.WriteShardsRequest, context: grpc.ServicerContext
    ) -> pb.WriteShardsResponse:
        return self.writes.batch(request)

    @rank_rpc
    def OpenShardsForWrite(
        self, request: pb.OpenShardsForWriteRequest, context: grpc.ServicerContext
    ) -> pb.OpenShardsForWriteResponse:
        return self.writes.open_in_place(request)


def handlers(writes: ShardWrites) -> dict[str, grpc.RpcMethodHandler]:
    """The ShardServer method handlers of WriteShards and OpenShardsForWrite."""
    return {
        "WriteShards": grpc.unary_unary_rpc_method_handler(
            writes.WriteShards,
            request_deserializer=pb.WriteShardsRequest.FromString,
            response_serializer=pb.WriteShardsResponse.SerializeToString,
        ),
        "OpenShardsForWrite": grpc.unary_unary_rpc_method_handler(
            writes.OpenShardsForWrite,
            request_deserializer=pb.OpenShardsForWriteRequest.FromString,
            response_serializer=pb.OpenShardsForWriteResponse.SerializeToString,
        ),
    }
