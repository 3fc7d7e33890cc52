"""Host pages of mapped segments registered with CUDA, so a CUDA tensor copies into and out of them at pinned speed.

A rank's shared-memory segment mapped into this process is pageable memory: a copy between it and a CUDA tensor
goes through the driver's small staging buffers at a fraction of what the bus carries. Registered once with
`cudaHostRegister`, the same pages are page-locked and the GPU's copy engines reach them directly (registering
costs about 40 ms per GiB, once per mapping; the mappings are cached, so a weight sync that copies into the same
segments every step pays it once). Registration follows the mapping's life: the pages are unregistered when the
mapping object that owns them goes, before their memory can be unmapped (the finalizer holds the bytes until it
has unregistered them). Nothing is registered without CUDA or for memory that is not the CPU's; a registration
the driver refuses leaves the copies at pageable speed, never failing them.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from typing import Protocol

import torch

log = logging.getLogger(__name__)

PORTABLE = (
    0x01  # cudaHostRegisterPortable: pinned for every device's context, not only the current one
)
READ_ONLY = (
    0x08  # cudaHostRegisterReadOnly: the pages are only read by the device (a read-only mapping)
)


class Registrar(Protocol):
    """Registers and unregisters host memory with the device (CUDA's runtime, or a test's stand-in)."""

    def available(self) -> bool:
        """Whether this process can register memory at all."""
        ...

    def register(self, address: int, nbytes: int, flags: int) -> bool:
        """Page-lock [address, address + nbytes) for the device; whether it was."""
        ...

    def unregister(self, address: int) -> None:
        """Undo the registration that began at `address`, once the device no longer copies from or to it."""
        ...


class CudaRegistrar:
    """The CUDA runtime's cudaHostRegister / cudaHostUnregister, through torch.cuda.cudart()."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def register(self, address: int, nbytes: int, flags: int) -> bool:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, flags)) == 0

    def unregister(self, address: int) -> None:
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)  # no copy may still be reading or writing the pages
        error = int(torch.cuda.cudart().cudaHostUnregister(address))
        if error:
            log.warning("cudaHostUnregister(%#x) failed with CUDA error %d", address, error)


class RegisteredPages:
    """Which mappings' pages are registered with the device: each once, each until its owner goes."""

    def __init__(self, registrar: Registrar | None = None) -> None:
        self._registrar: Registrar = registrar if registrar is not None else CudaRegistrar()
        self._by_owner: dict[int, tuple[int, int]] = {}  # id(owner) -> (address, bytes) registered
        self._releases: dict[int, weakref.finalize] = {}  # id(owner) -> its registration's release
        self._refused: set[int] = set()  # id(owner) of mappings the driver would not register
        self._lock = threading.Lock()

    @property
    def registered(self) -> dict[int, int]:
        """Address -> bytes of every range registered now."""
        with self._lock:
            return dict(self._by_owner.values())

    def pin(self, owner: object, flat: torch.Tensor, *, read_only: bool = False) -> bool:
        """Register the pages under `flat` (CPU bytes of a mapping that `owner` keeps) once for as long as
        `owner` lives; whether they are registered. `read_only`: the mapping is read-only (the device only reads
        it). False without a device, for memory not on the CPU, or when the driver refuses (then once per owner)."""
        if flat.device.type != "cpu" or not flat.numel():
            return False
        key = id(owner)
        with self._lock:
            if key in self._by_owner:
                return True
            if key in self._refused:
                return False
        if not self._registrar.available():
            return False
        address, nbytes = page_span(flat.data_ptr(), flat.numel() * flat.element_size())
        with self._lock:
            if key in self._by_owner:  # another thread registered it meanwhile
                return True
            done = self._registrar.register(
                address, nbytes, PORTABLE | (READ_ONLY if read_only else 0)
            )
            if done:
                self._by_owner[key] = (address, nbytes)
            else:
                self._refused.add(key)
        if not done:
            log.info(
                "registering %d mapped bytes with CUDA failed; copying at pageable speed", nbytes
            )
            weakref.finalize(owner, self._forget_refusal, key)
            return False
        with self._lock:
            self._releases[key] = weakref.finalize(owner, self._release, key, flat)
        return True

    def hand_over(self, old: object, new: object) -> None:
        """The registration of `old`'s pages, if any, now lasts as long as `new`: a later mapping object over
        the same memory (a reader's mapping of a segment the rank reuses for a newer version). Registering
        anew costs ~40 ms per GiB, and unregistering waits for every device."""
        with self._lock:
            release = self._releases.pop(id(old), None)
            span = self._by_owner.pop(id(old), None)
            if release is None or span is None:
                return
            detached = release.detach()  # (owner, callback, (key, flat), kwargs); None once it ran
            if detached is None:
                return
            flat = detached[2][1]
            key = id(new)
            self._by_owner[key] = span
            self._releases[key] = weakref.finalize(new, self._release, key, flat)

    def _release(self, key: int, flat: torch.Tensor) -> None:
        """Unregister the owner's pages; `flat` (held until now) keeps them mapped until this returns."""
        with self._lock:
            self._releases.pop(key, None)
            span = self._by_owner.pop(key, None)
        if span is not None:
            self._registrar.unregister(span[0])
        del flat

    def _forget_refusal(self, key: int) -> None:
        with self._lock:
            self._refused.discard(key)


def page_span(address: int, nbytes: int) -> tuple[int, int]:
    """[address, address + nbytes) widened to whole pages: (first page's address, bytes)."""
    start = address - address % mmap.PAGESIZE
    end = -(-(address + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    return start, end - start


PAGES = (
    RegisteredPages()
)  # this process's registrations (one set per process: the pages are the process's)
