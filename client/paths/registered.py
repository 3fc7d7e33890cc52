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
from dataclasses import dataclass
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


@dataclass
class _Registration:
    """Pages registered for one owner: [address, address + nbytes), kept mapped by `flat` until unregistered,
    and the release that unregisters them when the owner goes."""

    address: int
    nbytes: int
    flat: torch.Tensor
    release: weakref.finalize


class RegisteredPages:
    """Which mappings' pages are registered with the device: each once, each until its owner goes."""

    def __init__(self, registrar: Registrar | None = None) -> None:
        self._registrar: Registrar = registrar if registrar is not None else CudaRegistrar()
        self._registered: dict[int, _Registration] = {}  # by id(owner)
        self._refused: set[int] = set()  # id(owner) of mappings the driver would not register
        self._lock = threading.Lock()

    @property
    def registered(self) -> dict[int, int]:
        """Address -> bytes of every range registered now."""
        with self._lock:
            return {r.address: r.nbytes for r in self._registered.values()}

    def pin(self, owner: object, flat: torch.Tensor, *, read_only: bool = False) -> bool:
        """Register the pages under `flat` (CPU bytes of a mapping that `owner` keeps) once for as long as
        `owner` lives; whether they are registered. `read_only`: the mapping is read-only (the device only reads
        it). False without a device, for memory not on the CPU, or when the driver refuses (then once per owner)."""
        if flat.device.type != "cpu" or not flat.numel():
            return False
        key = id(owner)
        with self._lock:
            if key in self._registered:
                return True
            if key in self._refused:
                return False
        if not self._registrar.available():
            return False
        address, nbytes = page_span(flat.data_ptr(), flat.numel() * flat.element_size())
        with self._lock:
            if key in self._registered:  # another thread registered it meanwhile
                return True
            done = self._registrar.register(
                address, nbytes, PORTABLE | (READ_ONLY if read_only else 0)
            )
            if done:  # kept and released together: hand_over never sees one without the other
                self._registered[key] = _Registration(
                    address, nbytes, flat, weakref.finalize(owner, self._release, key)
                )
            else:
                self._refused.add(key)
        if not done:
            log.info(
                "registering %d mapped bytes with CUDA failed; copying at pageable speed", nbytes
            )
            weakref.finalize(owner, self._forget_refusal, key)
        return done

    def hand_over(self, old: object, new: object) -> None:
        """The registration of `old`'s pages, if any, now lasts as long as `new`: a later mapping object over
        the same memory (a reader's mapping of a segment the rank reuses for a newer version). Registering
        anew costs ~40 ms per GiB, and unregistering waits for every device."""
        with self._lock:
            registration = self._registered.get(id(old))
            if registration is None or registration.release.detach() is None:
                return  # none, or its release ran already (it unregisters them)
            del self._registered[id(old)]
            key = id(new)
            registration.release = weakref.finalize(new, self._release, key)
            self._registered[key] = registration

    def _release(self, key: int) -> None:
        """Unregister the owner's pages; the registration's `flat` keeps them mapped until this returns."""
        with self._lock:
            registration = self._registered.pop(key, None)
        if registration is not None:
            self._registrar.unregister(registration.address)

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
