"""Mapping a shard version made of blocks shared with earlier versions (OpenShardResponse.extents).

A rank keeps a row update's version as blocks shared with the version it was
made from (server/rank/blocks.py); it describes the shard as runs of memfds in
order. The client reserves one range of its address space and maps every run
read-only into place (MAP_FIXED), so the shard is one contiguous tensor again,
as for a segment. Each memfd is opened once by /proc/<pid>/fd/<fd> and checked
by inode and device, like a segment.

Mapping a file's pages afresh costs their page tables on the first read (1 GiB
read through new mappings: ~170 ms on a 2-core VM, ~55 ms through mappings
already filled). A delta put's or a row update's next version shares most of
its blocks with the version the reader mapped before, so the reader moves the
filled page tables of those blocks from that composed mapping into the new one
(`FilePages`, mremap with MREMAP_DONTUNMAP: the old mapping stays, to fault in
again from the file if read) and maps only the blocks it has not mapped yet.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

import torch

from shardserve.core.address_space import AddressRange, moves_supported
from shardserve.protos import shardserve_pb2 as pb


class CompositionError(OSError):
    """The blocks the rank described could not be opened or mapped."""


def reserve(nbytes: int) -> AddressRange:
    """A reserved address range of `nbytes` for a shard (CompositionError when the address space has none)."""
    try:
        return AddressRange(nbytes)
    except OSError as err:
        raise CompositionError(err.errno, "cannot reserve address space for a shard") from None


@dataclass(frozen=True)
class FileBytes:
    """`nbytes` of the file (inode, device) from `offset`."""

    file: tuple[int, int]
    offset: int
    nbytes: int

    def within(self, other: FileBytes) -> bool:
        """Whether these bytes are part of `other`'s."""
        return (
            self.file == other.file
            and other.offset <= self.offset
            and self.offset + self.nbytes <= other.offset + other.nbytes
        )


@dataclass(frozen=True)
class _Window:
    """`mapped` read-only by one call at `position` of `space`."""

    space: weakref.ref[AddressRange]
    position: int
    mapped: FileBytes


class FilePages:
    """Where this process maps rank files read-only as composed shards, so that a new mapping of bytes mapped
    before takes the page tables filled there instead of faulting every page in again. The newest window of a
    file is tried first (a move leaves the old one's tables empty); a window whose range is gone is never used
    (a range is weakly held, and unmapped only after it is gone). Plain segments are left out: a reader
    registers those with CUDA for copies to a GPU (client/paths/registered.py), and their pages stay where the
    registration saw them."""

    MAX_WINDOWS = 64
    """Windows kept per file, newest first: a file of one shard's blocks is mapped by that shard's versions."""

    def __init__(self, *, sweep_files: int = 1024) -> None:
        """`sweep_files`: files known before the first sweep of those whose windows are all gone (each delta
        put's changed blocks come in new files); the files kept stay within twice the number that still has a
        live window, and at least this many."""
        self._windows: dict[tuple[int, int], list[_Window]] = {}
        self._lock = threading.Lock()
        self._sweep_files = self._sweep_at = sweep_files

    def remember(self, space: AddressRange, position: int, mapped: FileBytes) -> None:
        """`mapped` is mapped read-only at `position` of `space`."""
        window = _Window(weakref.ref(space), position, mapped)
        with self._lock:
            kept = [w for w in self._windows.get(mapped.file, []) if w.space() is not None]
            self._windows[mapped.file] = [window, *kept][: self.MAX_WINDOWS]
            if len(self._windows) >= self._sweep_at:
                self._sweep()

    @property
    def files(self) -> int:
        """How many files this process remembers windows of."""
        with self._lock:
            return len(self._windows)

    def _sweep(self) -> None:
        """(lock held) Forget the files none of whose windows' ranges is alive."""
        self._windows = {
            file: live
            for file, windows in self._windows.items()
            if (live := [w for w in windows if w.space() is not None])
        }
        self._sweep_at = max(self._sweep_files, 2 * len(self._windows))

    def move(self, space: AddressRange, position: int, wanted: FileBytes) -> bool:
        """Move the page tables of a window that maps the `wanted` bytes to `position` of `space`; whether one
        did (else the caller maps them)."""
        if not moves_supported():
            return False
        with self._lock:
            for window in self._windows.get(wanted.file, []):
                source = window.space()
                if source is None or not wanted.within(window.mapped):
                    continue
                start = source.address + window.position + wanted.offset - window.mapped.offset
                try:
                    space.move_from(position, wanted.nbytes, start)
                except OSError:
                    return False
                return True
        return False


FILE_PAGES = FilePages()


def map_extents(reply: pb.OpenShardResponse) -> torch.Tensor:
    """The shard's bytes as one read-only uint8 tensor over its blocks' memfds (CompositionError if one is not
    the file the rank described, or cannot be mapped): the blocks this process mapped before take their page
    tables from there (FilePages), with no call (that mapping holds its file: the inode names no other); each
    file of the others is opened once and checked by inode."""
    space = reserve(reply.nbytes)
    fds: dict[int, int] = {}
    try:
        position = 0
        for extent in reply.extents:
            wanted = FileBytes((extent.inode, extent.device_id), extent.offset, extent.nbytes)
            if not FILE_PAGES.move(space, position, wanted):
                if extent.fd not in fds:
                    fds[extent.fd] = _open(reply.pid, extent)
                _place(space, position, extent, fds[extent.fd], reply.pid)
            FILE_PAGES.remember(space, position, wanted)
            position += extent.nbytes
        if position != reply.nbytes:
            raise CompositionError(0, f"the blocks hold {position} bytes, the shard {reply.nbytes}")
    finally:
        for fd in fds.values():
            os.close(fd)
    return space.tensor(reply.nbytes)


def _place(space: AddressRange, position: int, extent: pb.ShardExtent, fd: int, pid: int) -> None:
    """Map `extent` at `position` of `space` from its file, opened as `fd`."""
    try:
        space.place(position, extent.nbytes, fd, extent.offset)
    except OSError as err:
        raise CompositionError(
            err.errno, f"cannot map a block of /proc/{pid}/fd/{extent.fd}"
        ) from None


def _open(pid: int, extent: pb.ShardExtent) -> int:
    path = f"/proc/{pid}/fd/{extent.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise CompositionError(err.errno, f"cannot open {path}: {err.strerror}") from None
    stat = os.fstat(fd)
    if (stat.st_ino, stat.st_dev) != (extent.inode, extent.device_id):
        os.close(fd)
        raise CompositionError(0, f"{path} is not the block file the rank described")
    return fd
