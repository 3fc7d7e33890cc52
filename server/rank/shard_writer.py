"""Filling one shard's bytes in order, and checking the box a read asks for: the byte-level rules of a shard."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardserve.core.checksums import bytes_checksum
from shardserve.core.metadata import Box
from shardserve.core.wire import byte_view
from shardserve.server.rank.errors import InvalidArgument


def checked_box(shard_box: Box, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
    """The requested box, or InvalidArgument naming offsets/sizes when it is not inside the shard."""
    if len(offsets) != shard_box.ndim:
        raise InvalidArgument(
            f"offsets has {len(offsets)} dims but the tensor has {shard_box.ndim}",
            metadata={"field": "offsets"},
        )
    if len(sizes) != shard_box.ndim:
        raise InvalidArgument(
            f"sizes has {len(sizes)} dims but the tensor has {shard_box.ndim}",
            metadata={"field": "sizes"},
        )
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        if o < 0:
            raise InvalidArgument(f"offsets[{d}]={o} is negative", metadata={"field": "offsets"})
        if s < 0:
            raise InvalidArgument(f"sizes[{d}]={s} is negative", metadata={"field": "sizes"})
    box = Box(offsets, sizes)
    if not shard_box.contains(box):
        raise InvalidArgument(
            f"offsets/sizes: box offsets={list(offsets)} sizes={list(sizes)} is not inside "
            f"the shard (offsets={list(shard_box.offsets)} sizes={list(shard_box.sizes)})",
            metadata={"field": "offsets"},
        )
    return box


class ShardWriter:
    """Writes received chunks, in order, straight into a preallocated shard tensor."""

    def __init__(self, shard: torch.Tensor, nbytes: int) -> None:
        self.nbytes = nbytes
        self.written = 0
        self._bytes = byte_view(shard)
        self._host = shard.device.type == "cpu"
        self._view = self._bytes.numpy().data if self._host and nbytes else None

    def write(self, offset: int, data: bytes) -> None:
        """Copy one chunk to its offset; chunks must arrive in order without gaps or overlap."""
        if offset != self.written:
            raise InvalidArgument(
                f"chunk.offset {offset} is not where the stream is: expected {self.written} "
                f"(chunks must arrive in order)",
                metadata={"field": "chunk.offset"},
            )
        end = offset + len(data)
        if end > self.nbytes:
            raise InvalidArgument(
                f"chunk.offset+len(chunk.data)={end} is past the end of the shard "
                f"({self.nbytes} bytes)",
                metadata={"field": "chunk.data"},
            )
        if not data:
            return
        if self._view is not None:
            self._view[offset:end] = data
        else:
            self._bytes[offset:end].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.written = end

    def fill(self, receive: Callable[[memoryview], None]) -> None:
        """Write the whole shard at once: `receive(view)` fills a writable byte view of it (the shard's own memory
        when it is in host memory, else a host buffer copied to the device after)."""
        if self.written:
            raise InvalidArgument("the shard is being written in chunks; fill() writes it whole")
        if self._view is not None:
            receive(self._view)
        elif self.nbytes:
            staging = torch.empty(self.nbytes, dtype=torch.uint8)
            receive(staging.numpy().data)
            self._bytes.copy_(staging)
        self.written = self.nbytes

    def checksum(self) -> int | None:
        """The checksum of the shard once written whole (shardserve.core.checksums), read from its host
        memory; None before, and for a shard on a device (the promote hashes those)."""
        if self.written != self.nbytes or not self._host:
            return None
        return bytes_checksum(self._view if self._view is not None else b"")
