"""ShardServer.ReadRegions: many small boxes of one rank in one unary call, their bytes concatenated.

A state dict of hundreds of small tensors read box by box pays one call (and
its client-side path choice) per box; one call per rank and batch answers
them together. Each region is checked as ReadRegion checks it; an error names
the region (`regions[i]: ...`). The bulk port answers the same request as a
KIND_READS frame (server/rank/reads/bulk.py).
"""

from __future__ import annotations

import grpc

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import (
    InvalidArgument,
    RequestTooLarge,
    item_errors,
    rpc_errors,
)
from shardserve.server.rank.cuda_staging import host_bytes
from shardserve.server.rank.metrics import GRPC
from shardserve.server.rank.reads.region import requested_box
from shardserve.server.rank.store import ShardStore

BATCH_READ_BYTES = 1 << 20  # the largest answer: well under gRPC's default 4 MiB message limit
MAX_BATCH_REGIONS = 16384  # regions per call (each costs a lease and a check)


class BatchReads:
    """ReadRegions of one rank."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    @rpc_errors
    def ReadRegions(
        self, request: pb.ReadRegionsRequest, context: grpc.ServicerContext
    ) -> pb.ReadRegionsReply:
        return self.answer(request, GRPC)

    def answer(self, request: pb.ReadRegionsRequest, path: str) -> pb.ReadRegionsReply:
        """The reply to `request` (over gRPC, or the bulk port's KIND_READS frame), served bytes counted on
        `path`; a ServiceError naming the field otherwise."""
        regions = request.regions
        if not regions:
            raise InvalidArgument("regions: the request names no region")
        if len(regions) > MAX_BATCH_REGIONS:
            raise RequestTooLarge(
                f"regions: {len(regions)} regions in one call, over the limit of "
                f"{MAX_BATCH_REGIONS}; split the batch",
                metadata={"field": "regions"},
            )
        data, offsets = bytearray(), []
        for index, region in enumerate(regions):
            offsets.append(len(data))
            self._append(index, region, data)
        for index, region in enumerate(regions):
            end = offsets[index + 1] if index + 1 < len(offsets) else len(data)
            self.store.metrics.served(path, region.name, end - offsets[index])
        return pb.ReadRegionsReply(data=bytes(data), offsets=offsets)

    def _append(self, index: int, region: pb.ReadRegionRequest, data: bytearray) -> None:
        """Append the bytes of regions[index] to `data`, checked as ReadRegion checks a box and against the
        batch's size cap; errors name the region."""
        with item_errors(f"regions[{index}]"), requested_box(self.store, region) as box:
            nbytes = box.numel() * box.element_size()
            if len(data) + nbytes > BATCH_READ_BYTES:
                raise RequestTooLarge(
                    f"offsets/sizes: the answer would reach {len(data) + nbytes} bytes; "
                    f"ReadRegions answers at most {BATCH_READ_BYTES} (split the batch)"
                )
            data += host_bytes(box)  # copied while the lease is held


def handlers(reads: BatchReads) -> dict[str, grpc.RpcMethodHandler]:
    """The ShardServer method handler of ReadRegions."""
    return {
        "ReadRegions": grpc.unary_unary_rpc_method_handler(
            reads.ReadRegions,
            request_deserializer=pb.ReadRegionsRequest.FromString,
            response_serializer=pb.ReadRegionsReply.SerializeToString,
        )
    }
