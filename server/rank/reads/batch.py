"""ShardServer.ReadRegions: many small boxes of one rank in one unary call, their bytes concatenated.

A state dict of hundreds of small tensors read box by box pays one call (and
its client-side path choice) per box; one call per rank and batch answers
them together. Each region is checked as ReadRegion checks it; an error names
the region (`regions[i]: ...`). The bulk port answers the same request as a
KIND_READS frame through the same ReadPath (server/rank/reads/path.py).
"""

from __future__ import annotations

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.rank.error_status import rank_rpc
from shardserve.server.rank.metrics import GRPC
from shardserve.server.rank.reads.path import ReadPath
from shardserve.server.rank.store import ShardStore


class BatchReads:
    """ReadRegions of one rank."""

    def __init__(self, store: ShardStore) -> None:
        self.reads = ReadPath(store)

    @rank_rpc
    def ReadRegions(
        self, request: pb.ReadRegionsRequest, context: grpc.ServicerContext
    ) -> pb.ReadRegionsReply:
        return self.reads.regions(request, GRPC)


def handlers(reads: BatchReads) -> dict[str, grpc.RpcMethodHandler]:
    """The ShardServer method handler of ReadRegions."""
    return {
        "ReadRegions": grpc.unary_unary_rpc_method_handler(
            reads.ReadRegions,
            request_deserializer=pb.ReadRegionsRequest.FromString,
            response_serializer=pb.ReadRegionsReply.SerializeToString,
        )
    }
