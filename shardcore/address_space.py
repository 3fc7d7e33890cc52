"""Reserved ranges of this process's address space, with files mapped into them at fixed offsets.

Python's mmap module cannot place a mapping, so libc's mmap is called through ctypes, here once for both
halves: a rank composes a shard version from blocks shared with earlier versions (server/rank/blocks.py), and
a client maps such a shard's blocks, or several shards' rows, side by side (client/paths/composed.py,
stitched.py). A rank also keeps a writable mapping of each block file it makes (WritableMapping) and moves
windows of it into ranges: the only way to write the file again once its writes are sealed. Failures raise
OSError with the errno.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from typing import Any

import torch

PAGE = mmap.PAGESIZE
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000
_PROT_NONE = 0  # <sys/mman.h>; Python's mmap module does not name it

_libc = ctypes.CDLL(None, use_errno=True)
_VOID, _SIZE, _INT = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int


def _declare(name: str, restype: Any, *argtypes: Any) -> None:
    function = getattr(_libc, name)
    function.restype, function.argtypes = restype, list(argtypes)


_declare("mmap", _VOID, _VOID, _SIZE, _INT, _INT, _INT, ctypes.c_long)
_declare("munmap", _INT, _VOID, _SIZE)
_declare("mprotect", _INT, _VOID, _SIZE, _INT)
_declare("mremap", _VOID, _VOID, _SIZE, _SIZE, _INT, _VOID)
_declare("madvise", _INT, _VOID, _SIZE, _INT)
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14 and later
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4  # <linux/mman.h>
_MAP_FAILED = ctypes.c_void_p(-1).value


def round_up(n: int, to: int) -> int:
    """`n` rounded up to a multiple of `to`."""
    return -(-n // to) * to


def _check(result: int | None, what: str) -> None:
    if result is None or result == -1 or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class AddressRange:
    """A reserved range of this process's address space (inaccessible until files are placed into it),
    unmapped when the object (and every tensor over it) is gone."""

    def __init__(self, nbytes: int) -> None:
        self.size = round_up(max(nbytes, 1), PAGE)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        address = _libc.mmap(None, self.size, _PROT_NONE, flags, -1, 0)
        _check(address, "reserving address space")
        self.address: int = address
        weakref.finalize(self, _libc.munmap, address, self.size)

    def place(
        self,
        offset: int,
        nbytes: int,
        fd: int,
        file_offset: int,
        *,
        writable: bool = False,
        populate: bool = False,
    ) -> None:
        """Map `nbytes` of file `fd` from `file_offset` at `offset` of the range (replacing what was there),
        shared; `populate` fills the page tables now."""
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | _MAP_FIXED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        result = _libc.mmap(
            self.address + offset, round_up(nbytes, PAGE), prot, flags, fd, file_offset
        )
        _check(result, "mapping a block")

    def move_in(
        self, offset: int, nbytes: int, source: WritableMapping, source_offset: int
    ) -> None:
        """Move `nbytes` of `source` (from `source_offset`) to `offset` of the range (replacing what was there),
        writable: the pages mapped there go with it, and `source` keeps its window, to fault in again from the
        file. A move is not a new mapping, so it works on a file whose writes are sealed since `source` was
        made (what `place` is refused). Linux 5.13 or later (`moves_supported`)."""
        self.move_from(offset, nbytes, source.address + source_offset)

    def move_from(self, offset: int, nbytes: int, address: int) -> None:
        """Move the shared file mapping at `address` (`nbytes`, within one mapping call's range) to `offset` of
        the range, with its protection and the page tables filled there: the source keeps its window, empty, to
        fault in again from the file. Linux 5.13 or later (`moves_supported`)."""
        size = round_up(nbytes, PAGE)
        result = _libc.mremap(
            address,
            size,
            size,
            _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP,
            self.address + offset,
        )
        _check(result, "moving a mapped window")

    def protect_read_only(self) -> None:
        """Make the whole range read-only."""
        _check(
            _libc.mprotect(self.address, self.size, mmap.PROT_READ), "protecting a served version"
        )

    def tensor(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the range as a flat uint8 tensor (which keeps the range alive)."""
        array = (ctypes.c_char * nbytes).from_address(self.address)
        setattr(array, "keeps", self)  # noqa: B010 - the tensor holds the array, the array the range
        return torch.frombuffer(array, dtype=torch.uint8)


class WritableMapping:
    """A shared writable mapping of a whole file, made before its writes are sealed (F_SEAL_FUTURE_WRITE refuses
    write(2) and new writable mappings, not one made before): how the file's owner still writes it, or moves a
    writable window of it into an AddressRange (`AddressRange.move_in`). Unmapped when the object (and every
    tensor over it) is gone."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.size = round_up(max(nbytes, 1), PAGE)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        address = _libc.mmap(None, self.size, prot, mmap.MAP_SHARED, fd, 0)
        _check(address, "mapping a file writable")
        self.address: int = address
        self._flat: torch.Tensor | None = None
        weakref.finalize(self, _libc.munmap, address, self.size)

    @classmethod
    def over(cls, flat: torch.Tensor) -> WritableMapping:
        """The shared writable mapping of a whole file that `flat` (a uint8 tensor) spans from its first byte,
        made elsewhere (Python's mmap); it stays mapped while this object or `flat` lives."""
        mapping = cls.__new__(cls)
        mapping.address, mapping.size, mapping._flat = flat.data_ptr(), flat.numel(), flat
        return mapping

    def populate(self, offset: int, nbytes: int) -> bool:
        """Fault the pages of [offset, offset + nbytes) in for writing now, in one call: a window moved out
        (`AddressRange.move_in`) leaves this mapping without its pages, and writes into the window moved in after
        would fault them in one at a time, at several times the cost. False where the kernel cannot (before
        Linux 5.14): the writes then fault them in."""
        start = offset - offset % PAGE
        size = round_up(offset + nbytes - start, PAGE)
        return bool(nbytes) and _libc.madvise(self.address + start, size, _MADV_POPULATE_WRITE) == 0

    def tensor(self) -> torch.Tensor:
        """The whole mapping as a flat uint8 tensor (which keeps the mapping alive)."""
        if self._flat is not None:
            return self._flat
        array = (ctypes.c_char * self.size).from_address(self.address)
        setattr(array, "keeps", self)  # noqa: B010 - the tensor holds the array, the array the mapping
        return torch.frombuffer(array, dtype=torch.uint8)


_moves: list[bool] = []


def moves_supported() -> bool:
    """Whether this kernel moves a shared file mapping while keeping its source (mremap's MREMAP_DONTUNMAP on a
    shared mapping: Linux 5.13 and later); probed once with a one-page memfd."""
    if not _moves:
        _moves.append(_probe_moves())
    return _moves[0]


def _probe_moves() -> bool:
    if not hasattr(os, "memfd_create"):
        return False
    fd = os.memfd_create("shardserve-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, PAGE)
        AddressRange(PAGE).move_in(0, PAGE, WritableMapping(fd, PAGE), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
