"""A part read over the network (the bulk port or gRPC): its request, where its bytes land, its bands.

Both network paths read a part the same way around their own one-box call: straight into the region when it is
contiguous on the CPU, else into a buffer copied in afterwards (pinned for a CUDA region); a large part that is
its read's only one as parallel row bands (client.paths.bands).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.bands import bands, read_bands
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.kinds import PartRead
from shardserve.core.metadata import Box
from shardserve.core.regions import local_view
from shardserve.core.wire import byte_view
from shardserve.protos import shardserve_pb2 as pb

# read_box(address, request, dest, cancel): one box's bytes into `dest` (flat uint8 CPU)
ReadBox = Callable[[str, pb.ReadRegionRequest, torch.Tensor, "Cancellation | None"], None]


def read_request(summary: TensorSummary, index: int, box: Box) -> pb.ReadRegionRequest:
    """The ReadRegionRequest of global `box` inside shard `index` at the summary's version."""
    return pb.ReadRegionRequest(
        name=summary.name,
        version=summary.version,
        shard_index=index,
        offsets=box.offsets,
        sizes=box.sizes,
    )


def landing(part: Box, region: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """Where a part's bytes land (`region` itself when contiguous on the CPU, else a buffer of its own: pinned
    for a CUDA region, one DMA up) and the call that moves them into `region` once they arrived."""
    if region.is_contiguous() and region.device.type == "cpu":
        return region, lambda: None
    on_gpu = region.device.type == "cuda"
    target = torch.empty(part.sizes, dtype=region.dtype, pin_memory=on_gpu)

    def land() -> None:
        region.copy_(target, non_blocking=on_gpu)

    return target, land


def read_part(
    read_box: ReadBox, address: str, read: PartRead, cancel: Cancellation | None = None
) -> None:
    """One part by `read_box`: straight into its region when contiguous (a large part that is the read's only
    one as parallel row bands), else via one buffer."""
    target, land = landing(read.part, read.region)
    read_bands(
        lambda band: read_box(
            address,
            read_request(read.summary, read.index, band),
            byte_view(local_view(target, read.part, band)),
            cancel,
        ),
        bands(read.part, read.region.element_size()) if read.only_part else [read.part],
    )
    land()


class NetworkPath(abc.ABC):
    """What the bulk-port and gRPC paths share: any rank with an address may be tried, and a part is read
    around the path's own one-box call (`read_box`) by read_part."""

    def supports(self, rank: RankStatus, summary: TensorSummary | None = None) -> bool:
        """Whether `rank` may be tried on this path (whether it serves it shows when asked)."""
        return bool(rank.address)

    def read(self, address: str, read: PartRead, cancel: Cancellation | None = None) -> None:
        """One part into its region (bands, landing: read_part)."""
        read_part(self.read_box, address, read, cancel)

    @abc.abstractmethod
    def read_box(
        self,
        address: str,
        request: pb.ReadRegionRequest,
        dest: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> None:
        """The box of `request` into `dest` (a flat contiguous uint8 CPU tensor of its size)."""
