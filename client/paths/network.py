"""A part read over the network (the bulk port or gRPC): its request, where its bytes land, its bands.

Both network paths read a part the same way around their own one-box call: straight into the region when it is
contiguous on the CPU and of the tensor's dtype, else into a buffer copied in afterwards (pinned for a CUDA
region); a large part that is its read's only one as parallel row bands (client.paths.bands). A region of
another floating dtype (a cast in flight) takes its part band by band through bounded staging buffers of the
tensor's dtype, each converted into the region by `copy_` (bit for bit `src.to(dtype)`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.bands import (
    STAGED_BAND_BYTES,
    STREAMS,
    bands,
    read_bands,
    read_in_turns,
    staged_bands,
)
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


def landing(
    part: Box, region: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, Callable[[], None]]:
    """Where a part's bytes of `dtype` (the tensor's) land (`region` itself when contiguous on the CPU and of
    that dtype, else a buffer of its own: pinned for a CUDA region, one DMA up) and the call that moves them into
    `region` once they arrived (converting them when `region` is of another dtype)."""
    if region.dtype == dtype and region.is_contiguous() and region.device.type == "cpu":
        return region, lambda: None
    on_gpu = region.device.type == "cuda"
    target = torch.empty(part.sizes, dtype=dtype, pin_memory=on_gpu)

    def land() -> None:
        region.copy_(target, non_blocking=on_gpu)

    return target, land


def read_part(
    read_box: ReadBox, address: str, read: PartRead, cancel: Cancellation | None = None
) -> None:
    """One part by `read_box`: straight into its region when contiguous (a large part that is the read's only
    one as parallel row bands), else via one buffer, or through staging bands when the region's dtype is not
    the tensor's."""
    dtype = read.summary.metadata.dtype
    if read.region.dtype != dtype:
        read_cast_part(read_box, address, read, cancel)
        return
    target, land = landing(read.part, read.region, dtype)
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


def read_cast_part(
    read_box: ReadBox,
    address: str,
    read: PartRead,
    cancel: Cancellation | None = None,
    *,
    band_bytes: int = STAGED_BAND_BYTES,
) -> None:
    """One part into a region of another dtype: its bands (client.paths.bands.staged_bands) land in staging
    buffers of the tensor's dtype (of at most `band_bytes` each, but for a single larger row), at most STREAMS
    at once when the part is its read's only one, and each is converted into its place in the region by `copy_`
    (no buffer the size of the part)."""
    dtype = read.summary.metadata.dtype
    cut = staged_bands(read.part, dtype.itemsize, band_bytes)
    slots = min(STREAMS if read.only_part else 1, len(cut))
    size = max(band.numel() for band in cut) * dtype.itemsize
    on_gpu = read.region.device.type == "cuda"
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(slots)]

    def read_band(band: Box, slot: int) -> None:
        staged = buffers[slot][: band.numel() * dtype.itemsize]
        read_box(address, read_request(read.summary, read.index, band), staged, cancel)
        place = local_view(read.region, read.part, band)
        place.copy_(staged.view(dtype).view(band.sizes))
        if on_gpu:  # the next band reuses the buffer only once this copy has left it
            torch.cuda.current_stream(read.region.device).synchronize()

    read_in_turns(read_band, cut, slots)


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
