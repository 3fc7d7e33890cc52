"""Reserved ranges of this process's address space, with files mapped into them at fixed offsets.

Python's mmap module cannot place a mapping, so libc's mmap is called through ctypes, here once for both
halves: a rank composes a shard version from blocks shared with earlier versions (server/rank/blocks.py), and
a client maps such a shard's blocks, or several shards' rows, side by side (client/paths/composed.py,
stitched.py). Failures raise OSError with the errno.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

PAGE = mmap.PAGESIZE
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000
_PROT_NONE = 0  # <sys/mman.h>; Python's mmap module does not name it

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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
