"""Block files: the memfds that hold copy-on-write blocks (server/rank/blocks.py), how many versions use each
block, and the writable mapping that writes a file again once its writes are sealed.

A file is either a shard's segment, cut into blocks when a copy first shares it, or a memfd of blocks an
update or a delta put copied. Both are sealed against writes by other processes (F_SEAL_FUTURE_WRITE), which
also refuses write(2), new writable mappings and hole punching in this process: the mapping made before the
seal (WritableMapping, for a segment its own mapping) is how the rank writes the file again for another
version, where the kernel can move it into that version's address range.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardserve.core.address_space import WritableMapping, moves_supported
from shardserve.server.rank.shared_memory import HEADER_BYTES, seal_writes

BLOCK_BYTES = 256 << 10


class BlockFile:
    """A memfd holding blocks (a shard's segment, or blocks an update copied), and how many versions use the
    block at each file offset. Both kinds are sealed against writes by other processes once written
    (F_SEAL_FUTURE_WRITE), which also forbids punching holes: a file's memory goes back when none of its blocks
    is used any more. A file of copies keeps the writable mapping it was made with (`writer`, where the kernel
    moves mappings), so that once unused it can be written again for another version (`Blocks` keeps it for a
    while) although its writes are sealed."""

    def __init__(
        self,
        fd: int,
        keep: object = None,
        nbytes: int = 0,
        on_close: Callable[[], None] | None = None,
        writer: WritableMapping | None = None,
    ) -> None:
        self.fd = fd
        stat = os.fstat(fd)
        self.inode, self.device_id = stat.st_ino, stat.st_dev
        self.keep = keep  # the segment tensor that owns fd (None: this object owns it)
        self.refs: dict[int, int] = {}
        self.nbytes = nbytes  # bytes of its blocks
        self.unused = 0  # bytes of its blocks no version uses any more (held until the file goes)
        self.writer = writer
        # written only through `writer` (a segment is sealed once served, before it is cut into blocks)
        self.sealed = keep is not None
        self.start = 0  # file offset of its first block (a segment's header page comes first)
        # an fd this object owns is closed once, by close() or when the object goes (a kept file let go of)
        self._closer = weakref.finalize(self, _close_file, fd, on_close) if keep is None else None

    @classmethod
    def create(cls, nbytes: int, on_close: Callable[[], None] | None = None) -> BlockFile:
        """A new memfd of `nbytes` (pages reserved up front), sealed against resizing by other processes; the
        caller fills it, maps it, then calls `seal_writes`."""
        fd = os.memfd_create("shardserve-block", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            writer = WritableMapping(fd, nbytes) if moves_supported() else None
            return cls(fd, nbytes=nbytes, on_close=on_close, writer=writer)
        except BaseException:
            os.close(fd)
            raise

    def seal_writes(self) -> None:
        """No write or new writable mapping through any handle from now on: mappings made before (the rank's own,
        of a pending version, and `writer`) stay writable."""
        if not self.sealed:
            seal_writes(self.fd)
            self.sealed = True

    def wasteful(self) -> bool:
        """Whether half its bytes or more are unused: a segment an update should stop sharing (`Blocks.share`)."""
        return self.nbytes > BLOCK_BYTES and 2 * self.unused >= self.nbytes

    def unref(self, offset: int, nbytes: int) -> int:
        """One version less uses the block at `offset`; returns the bytes no version uses any more (the whole
        file's, when this was its last used block; else 0). The owner then closes or keeps the file."""
        self.refs[offset] -= 1
        if self.refs[offset]:
            return 0
        del self.refs[offset]
        self.unused += nbytes
        return 0 if self.refs else self.unused

    def reset(self) -> None:
        """Unused as a whole, taken for new blocks: no block counted."""
        self.refs, self.unused = {}, 0

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
        self.fd, self.keep, self.writer = -1, None, None


def _close_file(fd: int, on_close: Callable[[], None] | None) -> None:
    os.close(fd)
    if on_close is not None:
        on_close()


@dataclass
class Block:
    file: BlockFile
    offset: int  # in the file
    nbytes: int


def segment_writer(source: torch.Tensor, nbytes: int) -> WritableMapping | None:
    """The rank's own writable mapping of the segment a shard tensor lies in (its header page, then `nbytes` of
    data), which writes it after its writes are sealed; None where the kernel cannot move mappings or the tensor
    is not laid out so."""
    if not moves_supported():
        return None
    storage = source.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    if (
        whole.numel() != HEADER_BYTES + nbytes
        or source.data_ptr() != whole.data_ptr() + HEADER_BYTES
    ):
        return None
    return WritableMapping.over(whole)


def copy_block(block: Block, file: BlockFile, offset: int, mapped: torch.Tensor) -> None:
    """Copy `block` to `offset` of `file`: file to file in the kernel (no page faults on a fresh mapping), else
    from its mapped bytes `mapped`; through the file's own writable mapping once its writes are sealed (a file
    kept and taken again)."""
    if file.sealed and file.writer is not None:
        file.writer.tensor()[offset : offset + block.nbytes].copy_(mapped)
        return
    done = 0
    with contextlib.suppress(OSError):
        while done < block.nbytes:
            copied = os.copy_file_range(
                block.file.fd, file.fd, block.nbytes - done, block.offset + done, offset + done
            )
            if copied <= 0:
                break
            done += copied
    if done < block.nbytes:
        os.pwrite(file.fd, mapped[done:].numpy().data, offset + done)
