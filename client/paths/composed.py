"""Mapping a shard version made of blocks shared with earlier versions (OpenShardResponse.extents).

A rank keeps a row update's version as blocks shared with the version it was
made from (server/rank/blocks.py); it describes the shard as runs of memfds in
order. The client reserves one range of its address space and maps every run
read-only into place (MAP_FIXED), so the shard is one contiguous tensor again,
as for a segment. Each memfd is opened once by /proc/<pid>/fd/<fd> and checked
by inode and device, like a segment.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

from shardserve.protos import shardserve_pb2 as pb

MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000
PROT_NONE = 0  # <sys/mman.h>; Python's mmap module does not name it

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


class CompositionError(OSError):
    """The blocks the rank described could not be opened or mapped."""


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class AddressRange:
    """A reserved address range, unmapped when collected (with every tensor over it)."""

    def __init__(self, nbytes: int) -> None:
        self.size = round_up(max(nbytes, 1), mmap.PAGESIZE)
        address = LIBC.mmap(
            None, self.size, PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE, -1, 0
        )
        if address in (None, MAP_FAILED):
            raise CompositionError(ctypes.get_errno(), "cannot reserve address space for a shard")
        self.address = address
        weakref.finalize(self, LIBC.munmap, address, self.size)


def map_extents(reply: pb.OpenShardResponse) -> torch.Tensor:
    """The shard's bytes as one read-only uint8 tensor over its blocks' memfds (CompositionError if one is not
    the file the rank described, or cannot be mapped)."""
    space = AddressRange(reply.nbytes)
    fds: dict[int, int] = {}
    try:
        position = 0
        for extent in reply.extents:
            fd = fds.get(extent.fd)
            if fd is None:
                fd = fds[extent.fd] = _open(reply.pid, extent)
            result = LIBC.mmap(
                space.address + position,
                round_up(extent.nbytes, mmap.PAGESIZE),
                mmap.PROT_READ,
                mmap.MAP_SHARED | MAP_FIXED,
                fd,
                extent.offset,
            )
            if result in (None, MAP_FAILED):
                raise CompositionError(
                    ctypes.get_errno(), f"cannot map a block of /proc/{reply.pid}/fd/{extent.fd}"
                )
            position += extent.nbytes
        if position != reply.nbytes:
            raise CompositionError(0, f"the blocks hold {position} bytes, the shard {reply.nbytes}")
    finally:
        for fd in fds.values():
            os.close(fd)
    array = (ctypes.c_char * reply.nbytes).from_address(space.address)
    setattr(array, "keeps", space)  # noqa: B010 - the range lives as long as the array
    return torch.frombuffer(array, dtype=torch.uint8)


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
