"""A DCP storage reader that reads only the bytes a rank needs, straight into its shards.

torch's FileSystemReader loads every saved chunk that a read request overlaps
whole (torch.load into new memory) and then copies the overlapping region out.
A rank holding half the rows of a table that was saved as one chunk thus reads
the whole table and copies half of it; every rank of the cluster does the
same. `RegionReader` instead finds the chunk's storage bytes in the file
(torch.load with map_location="meta" reads only the archive's index and pickle:
sizes, strides and the data's offset) and reads the smallest byte span that
holds the region: straight into the destination when the region is one run of
bytes (rows of a row-major chunk), else into a buffer of that span, copied out.

Everything it cannot read that way goes through FileSystemReader's own path,
unchanged: byte items, transformed (e.g. compressed) items, dtype casts,
another byte order, destinations off the CPU, a torch without record offsets.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import sys
import zipfile
from typing import IO, Any, Protocol, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from shardserve.core.wire import byte_view
from shardserve.server.common.dcp_metadata import load_metadata


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """Where a saved chunk's elements lie: `layout` is a meta tensor of its sizes, strides and storage
    offset; its storage's bytes start at `data_start` in the file and span `storage_bytes`."""

    layout: torch.Tensor
    data_start: int
    storage_bytes: int


class RegionReader(FileSystemReader):
    """FileSystemReader for local checkpoint directories that reads each tensor request's region only, and its
    `.metadata` through server.common.dcp_metadata (allow-listed classes, no arbitrary pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(cast(IO[bytes], stream), self.path)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's tensor regions directly; hand what is left to FileSystemReader."""
        by_file: dict[str, list[ReadItem]] = {}
        others: list[ReadItem] = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.TENSOR and not info.transform_descriptors:
                by_file.setdefault(info.relative_path, []).append(item)
            else:
                others.append(item)
        for relative_path, items in by_file.items():
            with open(self.fs.concat_path(self.path, relative_path), "rb", buffering=0) as file:
                chunks: dict[
                    MetadataIndex, StoredChunk | None
                ] = {}  # several requests may read one chunk
                for item in items:
                    if not self._read_region(file, item, planner, chunks):
                        others.append(item)
        if others:
            return super().read_data(dataclasses.replace(plan, items=others), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_region(
        self,
        file: ReadableFile,
        item: ReadItem,
        planner: LoadPlanner,
        chunks: dict[MetadataIndex, StoredChunk | None],
    ) -> bool:
        """Read one request's region into its destination and commit it; False when it needs the general path.
        `chunks` holds the chunks of this file already looked at."""
        info = self.storage_data[item.storage_index]
        where = f"{item.storage_index.fqn!r} at {tuple(item.storage_index.offset or ())} in {info.relative_path}"
        if item.storage_index not in chunks:
            try:
                chunks[item.storage_index] = stored_chunk(file, info.offset, info.length)
            except (zipfile.BadZipFile, RuntimeError, TypeError, pickle.UnpicklingError) as exc:
                raise ValueError(
                    f"checkpoint chunk {where} is damaged or not a torch.save archive: {exc}"
                ) from None
        chunk = chunks[item.storage_index]
        if chunk is None:
            return False
        region = chunk.layout
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            region = region.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if (
            target.dtype != region.dtype
            or target.device.type != "cpu"
            or target.shape != region.shape
        ):
            return False
        first, count = element_span(region)
        if (first + count) * region.element_size() > chunk.storage_bytes:
            raise ValueError(
                f"checkpoint chunk {where} is damaged: its region lies outside its storage"
            )
        start = chunk.data_start + first * region.element_size()
        if count and region.is_contiguous() and target.is_contiguous():
            read_exactly(file, byte_view(target), start, where)
        elif count:
            span = torch.empty(count, dtype=region.dtype)
            read_exactly(file, byte_view(span), start, where)
            target.copy_(span.as_strided(region.shape, region.stride()))
        planner.commit_tensor(item, target)
        return True


class ReadableFile(Protocol):
    """A file read by position: what a checkpoint's data is read from."""

    def seek(self, offset: int, whence: int = ..., /) -> int: ...

    def readinto(self, buffer: Any, /) -> int | None: ...


class FileSlice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable read-only file of their own."""

    def __init__(self, file: ReadableFile, start: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._file.seek(self._start + self._position)
        got = self._file.readinto(memoryview(buffer)[:count]) or 0
        self._position += got
        return got


def stored_chunk(file: ReadableFile, item_offset: int, item_length: int) -> StoredChunk | None:
    """The layout and data position of the torch.save archive stored in `file` at bytes [item_offset,
    item_offset + item_length) (one item of a .distcp file); None when its bytes cannot be read as they lie
    (another byte order, or a torch that does not report record offsets)."""
    view = cast(IO[bytes], FileSlice(file, item_offset, item_length))
    order = _byte_order(view)
    if order is not None and order != sys.byteorder:
        return None
    view.seek(0)
    layout = torch.load(view, map_location="meta", weights_only=True)
    if not isinstance(layout, torch.Tensor):
        raise TypeError(
            f"checkpoint item at byte {item_offset} holds a {type(layout).__name__}, not a tensor"
        )
    storage = layout.untyped_storage()
    record_offset = getattr(storage, "_checkpoint_offset", None)
    if not isinstance(record_offset, int) or any(s < 0 for s in layout.stride()):
        return None
    if record_offset + storage.nbytes() > item_length:
        raise ValueError(
            f"checkpoint item at byte {item_offset} is damaged: its data runs past its end"
        )
    return StoredChunk(layout, item_offset + record_offset, storage.nbytes())


def _byte_order(view: IO[bytes]) -> str | None:
    """The byte order a torch.save archive records ("little" / "big"), or None when it records none."""
    view.seek(0)
    with zipfile.ZipFile(view) as archive:
        names = [n for n in archive.namelist() if n.endswith("/byteorder")]
        return archive.read(names[0]).decode() if names else None


def element_span(region: torch.Tensor) -> tuple[int, int]:
    """(first element, element count) of the smallest run of storage that holds every element of `region`
    (non-negative strides); (offset, 0) when it is empty."""
    if region.numel() == 0:
        return int(region.storage_offset()), 0
    last = sum((size - 1) * stride for size, stride in zip(region.shape, region.stride()))
    return int(region.storage_offset()), int(last) + 1


def read_exactly(file: ReadableFile, out: torch.Tensor, position: int, where: str) -> None:
    """Fill the uint8 tensor `out` with the file's bytes from `position` on (unbuffered reads, no copy)."""
    buffer = out.numpy().data
    file.seek(position)
    done = 0
    while done < len(buffer):
        count = file.readinto(buffer[done:])
        if not count:
            raise OSError(
                f"checkpoint chunk {where} is truncated: the file ends {len(buffer) - done} bytes short"
            )
        done += count
