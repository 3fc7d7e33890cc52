"""Mapping a shard version made of blocks shared with earlier versions (OpenShardResponse.extents).

A rank keeps a row update's version as blocks shared with the version it was
made from (server/rank/blocks.py); it describes the shard as runs of memfds in
order. The client reserves one range of its address space and maps every run
read-only into place (MAP_FIXED), so the shard is one contiguous tensor again,
as for a segment. Each memfd is opened once by /proc/<pid>/fd/<fd> and checked
by inode and device, like a segment.
"""

from __future__ import annotations

import os

import torch

from shardserve.core.address_space import AddressRange
from shardserve.protos import shardserve_pb2 as pb


class CompositionError(OSError):
    """The blocks the rank described could not be opened or mapped."""


def reserve(nbytes: int) -> AddressRange:
    """A reserved address range of `nbytes` for a shard (CompositionError when the address space has none)."""
    try:
        return AddressRange(nbytes)
    except OSError as err:
        raise CompositionError(err.errno, "cannot reserve address space for a shard") from None


def map_extents(reply: pb.OpenShardResponse) -> torch.Tensor:
    """The shard's bytes as one read-only uint8 tensor over its blocks' memfds (CompositionError if one is not
    the file the rank described, or cannot be mapped)."""
    space = reserve(reply.nbytes)
    fds: dict[int, int] = {}
    try:
        position = 0
        for extent in reply.extents:
            fd = fds.get(extent.fd)
            if fd is None:
                fd = fds[extent.fd] = _open(reply.pid, extent)
            try:
                space.place(position, extent.nbytes, fd, extent.offset)
            except OSError as err:
                raise CompositionError(
                    err.errno, f"cannot map a block of /proc/{reply.pid}/fd/{extent.fd}"
                ) from None
            position += extent.nbytes
        if position != reply.nbytes:
            raise CompositionError(0, f"the blocks hold {position} bytes, the shard {reply.nbytes}")
    finally:
        for fd in fds.values():
            os.close(fd)
    return space.tensor(reply.nbytes)


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
