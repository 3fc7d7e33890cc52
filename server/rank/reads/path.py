"""The read half of a rank's data paths: one entry per kind of read, whatever carries the request.

ReadRegion (streamed), ReadRegionSmall, ReadRegions and LookupSmall over gRPC, and the same requests on the
bulk TCP port (server/rank/reads/bulk.py), all come through `ReadPath`: the request is checked once, the
version leased while its bytes are taken, and the bytes counted on the transport that carried them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.chunk_codec import LookupPart
from shardserve.server.common.requests import check_name, check_version
from shardserve.server.rank.cuda_staging import host_bytes
from shardserve.server.rank.error_status import item_errors
from shardserve.server.rank.errors import InvalidArgument, RequestTooLarge
from shardserve.server.rank.leases import LeasedReads
from shardserve.server.rank.reads.lookup import LookupService
from shardserve.server.rank.store import ShardStore

BATCH_READ_BYTES = (
    1 << 20
)  # the largest ReadRegions answer: well under gRPC's default 4 MiB messages
MAX_BATCH_REGIONS = 16384  # regions per call (each costs a lease and a check)


class ReadPath:
    """The reads of one rank: boxes, batches of boxes and lookups, leased from its store."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.lookups = LookupService(store)

    @contextmanager
    def box(self, request: pb.ReadRegionRequest) -> Iterator[torch.Tensor]:
        """The box a ReadRegionRequest names, leased meanwhile (name and version checked; version 0 = the
        served one)."""
        with self.store.leases.read(
            check_name(request.name),
            check_version(request.version, allow_zero=True),
            request.shard_index,
            tuple(request.offsets),
            tuple(request.sizes),
        ) as box:
            yield box

    @contextmanager
    def region(self, request: pb.ReadRegionRequest, transport: str) -> Iterator[memoryview]:
        """The requested box as host bytes, valid while the lease is held (zero-copy when the box is contiguous
        in the shard; CUDA shards through pinned memory); counted on `transport` once sent whole."""
        with self.box(request) as box:
            data = host_bytes(box)
            yield data
        self.store.metrics.served(transport, request.name, len(data))

    def regions(self, request: pb.ReadRegionsRequest, transport: str) -> pb.ReadRegionsReply:
        """The answer to a ReadRegions request: every region checked as ReadRegion checks it (errors name the
        region), their bytes back to back, at most BATCH_READ_BYTES in all."""
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
        served: dict[str, int] = {}  # bytes per tensor, counted once each
        with self.store.leases.reads() as leased:  # every byte copied before the leases end
            for index, region in enumerate(regions):
                offsets.append(len(data))
                try:
                    self._append(leased, region, data)
                except Exception as err:  # noqa: BLE001 - raised again as the error of regions[index]
                    with item_errors(f"regions[{index}]"):
                        raise err from None
                served[region.name] = served.get(region.name, 0) + len(data) - offsets[-1]
        for name, nbytes in served.items():
            self.store.metrics.served(transport, name, nbytes)
        return pb.ReadRegionsReply(data=bytes(data), offsets=offsets)

    @staticmethod
    def _append(leased: LeasedReads, region: pb.ReadRegionRequest, data: bytearray) -> None:
        """Append the bytes of one region of a batch to `data`, checked against the batch's size cap."""
        box = leased.box(
            check_name(region.name),
            check_version(region.version, allow_zero=True),
            region.shard_index,
            tuple(region.offsets),
            tuple(region.sizes),
        )
        nbytes = box.numel() * box.element_size()
        if len(data) + nbytes > BATCH_READ_BYTES:
            raise RequestTooLarge(
                f"offsets/sizes: the answer would reach {len(data) + nbytes} bytes; "
                f"ReadRegions answers at most {BATCH_READ_BYTES} (split the batch)"
            )
        data += host_bytes(box)

    def lookup_small(self, request: pb.LookupRequest, transport: str) -> list[LookupPart]:
        """The whole answer to a lookup in one message (LookupSmall, the bulk port's lookups)."""
        return self.lookups.lookup_small(request, transport)

    def lookup(self, request: pb.LookupRequest) -> Iterator[LookupPart]:
        """The answer to a lookup streamed item by item (Lookup)."""
        return self.lookups.lookup(request)
