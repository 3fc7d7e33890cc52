"""Shared-memory shards for the same-host data plane: memfd-backed tensors (the leases OpenShard hands out on
them: server/rank/reads/open_leases.py).

A CPU shard lives in an anonymous memfd mapped into the rank (`SharedMemory.empty`);
a client on the same host opens it read-only as /proc/<pid>/fd/<fd> and maps it,
so no byte crosses gRPC. The memfd has no name in any filesystem: it is freed
when the rank's tensor and every client mapping are gone, so a crashed rank
leaks nothing. Safety: served versions are immutable (the store writes only to
pending ones); while a lease is held the version (hence its tensor, mapping and
fd) stays alive, so the fd number cannot be reused for other data; the client
checks inode and device after opening, so a stale fd number fails cleanly; a
mapping keeps its pages after the rank frees the version. Leases expire.
The memfd is closed when its memory goes (the last view of it), not when the
first tensor made over it does, so a recycled segment keeps its fd.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from shardserve.core.dtypes import itemsize
from shardserve.protos.same_host import (
    HEADER_MAGIC,
    HEADER_WORDS,
    STATE_DROPPED,
    STATE_PENDING,
    STATE_REPLACED,
    STATE_SERVED,
    WORD_CHECKSUM_TAG,
    left_checksum,
    write_label,
    write_successor,
)
from shardserve.server.rank.header_slots import HeaderSlot, HeaderSlots
from shardserve.server.rank.recycling import CPU, Buffer, RecycledBuffers

log = logging.getLogger(__name__)

ENV_SWITCH = "SHARDSERVE_SHARED_MEMORY"  # "0" turns the same-host path off on a rank
# Each segment starts with a header page: int64 HEADER_MAGIC, int64 state, int64 generation, then the words an
# in-place writer leaves its checksum in (protos/same_host.py); the shard's bytes follow it. The rank sets the
# state SERVED when the version is promoted and DROPPED when it is dropped, so a client holding a mapping sees a
# dropped version without asking (and then refreshes, as gRPC's stale answer makes it). The generation grows
# each time a freed segment is taken for another version (server/rank/recycling.py), before any of its bytes
# change: a client checks (state, generation) before and after each read, like a seqlock.
HEADER_BYTES = 4096
FDS_KEPT_FOR_SOCKETS = (
    4096  # open files left to connections, pidfds and DCP files when shards take theirs
)
F_SEAL_FUTURE_WRITE = 0x0010  # <linux/fcntl.h>; Python's fcntl module does not name it
CUDA_REUSES = 256
"""How many versions one CUDA buffer serves before it goes back to the device. torch wraps a storage in one more
IPC reference-counting record (a counter slot in a shared file, maybe a CUDA event) each time the rank hands its
handle out, and frees them only with the storage: a buffer reused forever would grow them by a writer's and each
reader's handle per step. Past this many reuses the clients open a fresh buffer's handle once (~1/256 of the
steps), and the records of the old one go with it."""


def enabled_by_env() -> bool:
    """Whether this process may serve shards through shared memory (SHARDSERVE_SHARED_MEMORY != 0)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Segment:
    """Where a client finds a shard's memory: /proc/<pid>/fd/<fd>, checked by (inode, device)."""

    pid: int
    fd: int
    inode: int
    device_id: int
    nbytes: int
    data_offset: int = HEADER_BYTES
    # a header-only segment's: where its words begin (a slot of a header file, server/rank/header_slots.py)
    header_offset: int = 0


class SharedMemory:
    """Allocates CPU shard tensors in memfds and remembers each tensor's Segment."""

    def __init__(self, enabled: bool = True, recycled: RecycledBuffers | None = None) -> None:
        self.enabled = enabled and hasattr(os, "memfd_create")
        self.recycled = recycled if recycled is not None else RecycledBuffers()
        # two fds per segment (ours and the mapping's); past the budget shards go to private memory, so that
        # a layout of thousands of tiny shards cannot take the fds the rank's sockets need
        self.max_segments = _segment_budget(_raise_fd_limit()) if self.enabled else 0
        self._over_budget_logged = False
        self._segments: dict[
            int, Segment
        ] = {}  # by id() of a live tensor made by `empty` or given a header
        # the int64 header words of those segments, as numpy: a word set through numpy costs ~1/50 of torch's
        # indexing, once per shard on every allocation, promotion and drop
        self._headers: dict[int, np.ndarray] = {}
        # re-entrant: attach_header tracks under its own hold, and a tensor's finalizer (_forget) may run
        # whenever a collection happens, also inside a hold in this thread
        self._lock = threading.RLock()
        # composed versions' headers, in slots of header files made when none is free
        self.header_slots = HeaderSlots(_header_file)
        self._slots: dict[int, HeaderSlot] = {}  # by id() of a live tensor given a slot

    def empty(
        self, sizes: tuple[int, ...], dtype: torch.dtype, overwrite: bool = False
    ) -> torch.Tensor:
        """A C-contiguous CPU tensor, in a memfd when enabled (else plain memory): zero-filled, unless the
        caller will `overwrite` every byte. A freed version's buffer of its size is taken first (a recycled
        segment when enabled, a private buffer when not) and then handed over as it is when overwritten: a
        tensor put every step reuses its memory instead of faulting in and zeroing fresh pages each time."""
        if _nbytes(sizes, dtype) == 0:
            return torch.zeros(sizes, dtype=dtype)
        tensor = self._reuse(sizes, dtype, shared=self.enabled)
        if tensor is not None:
            return tensor if overwrite else tensor.zero_()
        return self._new(sizes, dtype) if self.enabled else torch.zeros(sizes, dtype=dtype)

    def fresh(self, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A zero-filled tensor in a new memfd, never a recycled one (its writes not sealed: any same-host
        writer can map it), or None when shared memory is off or over its budget."""
        nbytes = _nbytes(sizes, dtype)
        if not self.enabled or nbytes == 0 or len(self._segments) >= self.max_segments:
            return None
        tensor = self._new(sizes, dtype)
        return tensor if self.segment_of(tensor) is not None else None

    def _new(self, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor in a new memfd, or in private memory past the segment budget or when the memfd
        cannot be made."""
        nbytes = _nbytes(sizes, dtype)
        if len(self._segments) >= self.max_segments:
            if not self._over_budget_logged:
                self._over_budget_logged = True
                log.warning(
                    "%d shared-memory segments (the budget of this rank's open files); further shards "
                    "are in private memory and read over the network",
                    len(self._segments),
                )
            return torch.zeros(sizes, dtype=dtype)
        try:
            flat, segment = _memfd_bytes(HEADER_BYTES + nbytes)
        except OSError as err:
            log.warning(
                "shared memory allocation of %d bytes failed (%s); using private memory",
                nbytes,
                err,
            )
            return torch.zeros(sizes, dtype=dtype)
        tensor = flat[HEADER_BYTES:].view(dtype).view(sizes)
        segment = Segment(segment.pid, segment.fd, segment.inode, segment.device_id, nbytes)
        self._track(tensor, segment, _new_header(flat, STATE_PENDING))
        return tensor

    def recycled_empty(
        self, sizes: tuple[int, ...], dtype: torch.dtype, *, device: torch.device = CPU
    ) -> torch.Tensor | None:
        """A recycled buffer of the right size on `device` as a tensor whose every byte the caller will overwrite
        (shared memory or private; for a CUDA device, a freed CUDA shard's buffer), or None when none is kept."""
        return self._reuse(sizes, dtype, shared=None, device=device)

    def recycle(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep the buffers of a freed version's shards for reuse (CPU buffers, and CUDA buffers with the header
        their readers check); the caller guarantees nothing in this process uses them any more (no lease on
        their version)."""
        for tensor in tensors:
            if not tensor.is_contiguous():
                continue
            with self._lock:
                segment, header = self._segments.get(id(tensor)), self._headers.get(id(tensor))
            if tensor.device.type == "cuda":
                self._recycle_cuda(tensor, segment, header)
            elif tensor.device.type != "cpu":
                continue
            elif segment is not None and segment.data_offset == HEADER_BYTES and header is not None:
                header[1] = STATE_DROPPED
                self.recycled.keep(Buffer(tensor, header, segment))
            elif segment is None and _owns_storage(tensor):
                self.recycled.keep(Buffer(tensor))

    def _recycle_cuda(
        self, tensor: torch.Tensor, segment: Segment | None, header: np.ndarray | None
    ) -> None:
        """Keep a freed CUDA shard's whole buffer with its header-only segment (None when no reader or writer
        ever asked for one), the header marked DROPPED: the next version of its size reuses the memory, and
        same-host clients the IPC handle they opened for it. A buffer reused CUDA_REUSES times goes back to
        the device instead (see CUDA_REUSES)."""
        if not _owns_storage(tensor):
            return
        if header is not None and int(header[2]) >= CUDA_REUSES:
            return
        if header is not None:
            header[1] = STATE_DROPPED
        self.recycled.keep(Buffer(tensor, header, segment))

    def _reuse(
        self,
        sizes: tuple[int, ...],
        dtype: torch.dtype,
        shared: bool | None,
        *,
        device: torch.device = CPU,
    ) -> torch.Tensor | None:
        """A kept buffer as a tensor of `sizes`; a segment gets a new generation before anything is written."""
        buffer = self.recycled.take(_nbytes(sizes, dtype), shared, device=device)
        if buffer is None:
            return None
        tensor = buffer.shaped(sizes, dtype)
        if buffer.header is not None:
            buffer.header[1] = STATE_PENDING
            buffer.header[2] += 1
            if tensor is not buffer.tensor:  # the kept tensor is tracked still: it has lived on
                self._track(tensor, buffer.segment, buffer.header)
        return tensor

    def attach_header(self, tensor: torch.Tensor, served: bool, replaced: bool = False) -> Segment:
        """A header-only segment (the state word, no data) for a tensor whose bytes live elsewhere (a CUDA
        shard handed over as a CUDA IPC handle), so a client's cached mapping checks the version's state
        without an RPC. One per tensor; `mark` keeps it current; it is closed when the tensor goes."""
        with (
            self._lock
        ):  # checked and made under one hold: two readers of a new shard make one header
            known = self._segments.get(id(tensor))
            if known is not None:
                return known
            flat, segment = _memfd_bytes(HEADER_BYTES)
            segment = Segment(
                segment.pid, segment.fd, segment.inode, segment.device_id, 0, data_offset=0
            )
            state = _state_word(served, replaced)
            self._track(tensor, segment, _new_header(flat, state))
            seal_writes(segment.fd)
        return segment

    def attach_slot_header(
        self, tensor: torch.Tensor, served: bool, replaced: bool = False
    ) -> Segment:
        """As attach_header, in a slot of a header file (server/rank/header_slots.py) rather than a segment of
        its own; the tensor's header, of either kind, when it has one already. The slot is free again when the
        tensor goes."""
        with self._lock:
            known = self._segments.get(id(tensor))
            if known is not None:
                return known
            state = _state_word(served, replaced)
            slot = self.header_slots.take(state)
            file = slot.file
            segment = Segment(
                file.pid, file.fd, file.inode, file.device_id, 0, 0, header_offset=slot.offset
            )
            self._slots[id(tensor)] = slot
            self._track(tensor, segment, slot.words)
        return segment

    def announce_copy(
        self, copied: torch.Tensor, tensor: torch.Tensor, name: str, version: int, index: int
    ) -> None:
        """Tell same-host readers of `copied` (when it has header words: a reader maps it) that served shard
        `index` of (`name`, `version`), `tensor`, is a whole copy of it: `tensor` gets a slot header now, and the
        copied header names it and its slot (same_host.write_successor), so a reader reads it through the
        mapping of `copied` it holds, without OpenShard."""
        with self._lock:
            words = self._headers.get(id(copied))
            if words is None:
                return
            segment = self.attach_slot_header(tensor, served=True)
            if not segment.header_offset:  # a header of its own, made before (not in a header file)
                return
            generation = int(self._headers[id(tensor)][2])
            slot = (segment.header_offset, segment.inode, generation)
            write_successor(words, name, version, index, slot=slot)

    def _track(self, tensor: torch.Tensor, segment: Segment, header: np.ndarray) -> None:
        """Remember the segment and header words of `tensor` while that tensor lives."""
        key = id(tensor)
        with self._lock:
            self._segments[key] = segment
            self._headers[key] = header
        weakref.finalize(tensor, self._forget, key)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._segments.pop(key, None)
            self._headers.pop(key, None)
            slot = self._slots.pop(key, None)
            if slot is not None:
                self.header_slots.give_back(slot)

    def mark(self, tensors: Iterable[torch.Tensor], served: bool, replaced: bool = False) -> None:
        """Set the header state of the segments of `tensors` (others are ignored): SERVED, REPLACED (served, but a
        newer version is: clients read what they began, and start new reads at the newer one) or DROPPED."""
        state = _state_word(served, replaced)
        with self._lock:
            for tensor in tensors:
                header = self._headers.get(id(tensor))
                if header is not None:
                    if served:
                        _seal_segment(self._segments[id(tensor)].fd)
                    header[1] = state

    def label(self, name: str, version: int, shards: Mapping[int, torch.Tensor]) -> None:
        """Label the segment of each shard (by index) with the shard it holds (same_host.write_label), before the
        version is marked served: a reader that maps a segment for an earlier version finds this one there by
        its label and reads it without OpenShard. Only segments whose bytes follow their header (not CUDA
        header-only segments)."""
        if not self._headers:  # no segment has a header (shared memory off, or only private shards)
            return
        with self._lock:
            for index, tensor in shards.items():
                segment, header = self._segments.get(id(tensor)), self._headers.get(id(tensor))
                if (
                    header is not None
                    and segment is not None
                    and segment.data_offset == HEADER_BYTES
                ):
                    write_label(header, name, version, index)

    def writable_segment(self, tensor: torch.Tensor) -> tuple[Segment, bool] | None:
        """The Segment of a pending shard made by `empty`, for a same-host writer to fill in place, and whether its
        writes are sealed already (reused memory of a served version: only a writer that mapped it before may
        write it); None for a tensor outside shared memory."""
        with self._lock:
            segment = self._segments.get(id(tensor))
        if segment is None or segment.data_offset != HEADER_BYTES:
            return None
        return segment, segment.fd in _SEALED_SEGMENTS or is_write_sealed(segment.fd)

    def clear_left_checksum(self, tensor: torch.Tensor) -> None:
        """Forget any checksum a writer left in the header of `tensor`'s segment: it is handed to a writer now."""
        with self._lock:
            header = self._headers.get(id(tensor))
            if header is not None:
                header[WORD_CHECKSUM_TAG] = 0

    def left_checksum(self, tensor: torch.Tensor) -> int | None:
        """The checksum the in-place writer of `tensor` left in its segment's header for its bytes as they are
        now, or None (no segment, or the writer did not hash what it wrote)."""
        with self._lock:
            header = self._headers.get(id(tensor))
        return left_checksum(header) if header is not None else None

    def segment_of(self, tensor: torch.Tensor) -> Segment | None:
        """The Segment of a tensor made by `empty` (None for any other tensor)."""
        with self._lock:
            return self._segments.get(id(tensor))

    def export(self, tensor: torch.Tensor) -> torch.Tensor:
        """A shared-memory copy of `tensor` (for shards built elsewhere, e.g. by a reshard)."""
        copy = self.empty(tuple(tensor.shape), tensor.dtype)
        copy.copy_(tensor)
        return copy


def _segment_budget(open_files: int) -> int:
    """How many segments (two fds each) leave enough open files for everything else: FDS_KEPT_FOR_SOCKETS, or
    half of a small limit."""
    return max(0, (open_files - min(FDS_KEPT_FOR_SOCKETS, open_files // 2)) // 2)


def _raise_fd_limit() -> int:
    """Lift this process's soft limit of open files to its hard limit; returns the limit now in force."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return limit if limit != resource.RLIM_INFINITY else 1 << 20
    except (ImportError, ValueError, OSError):
        return 1024


def _new_header(flat: torch.Tensor, state: int) -> np.ndarray:
    """Write the header (magic, state, generation 0, no checksum) at the start of a segment's bytes; returns its
    int64 words (a numpy view of them)."""
    header = flat[: HEADER_WORDS * 8].view(torch.int64).numpy()
    header[:] = 0
    header[0] = HEADER_MAGIC
    header[1] = state
    return header


def _state_word(served: bool, replaced: bool) -> int:
    """The header's state word of a version served (REPLACED when a newer one is too) or not (DROPPED)."""
    return (STATE_REPLACED if replaced else STATE_SERVED) if served else STATE_DROPPED


def _nbytes(sizes: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(sizes).numel() * itemsize(dtype)


def _owns_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is the whole of its storage (a buffer of its own, not a view into something bigger)."""
    return (
        tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def _seal_size(fd: int) -> None:
    """Seal a new segment against resizing: readers open it by /proc/PID/fd/N, where a same-user process could
    otherwise truncate it (every later touch of the lost pages is SIGBUS in this rank). Its writes are sealed when
    its version is first served (`seal_writes`): until then a same-host writer may map it to fill it in place."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)


_SEALED_SEGMENTS: set[int] = set()
"""fds of this process's shard segments (_memfd_bytes) sealed by `_seal_segment`, each until it is closed:
seals are final, and a reused segment is asked on every allocation and promotion (an fcntl each)."""


def _seal_segment(fd: int) -> None:
    """seal_writes of one of this process's shard segments, remembered until the segment is closed."""
    if fd not in _SEALED_SEGMENTS:
        seal_writes(fd)
        _SEALED_SEGMENTS.add(fd)


def _close_segment(fd: int) -> None:
    # forgotten before the close: after it, the fd number is free for another file
    _SEALED_SEGMENTS.discard(fd)
    os.close(fd)


def is_write_sealed(fd: int) -> bool:
    """Whether memfd `fd`'s seals are final (`seal_writes` ran): no new writable mapping of it can be made."""
    return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL)


def seal_writes(fd: int) -> None:
    """No write, and no new writable mapping, of memfd `fd` through any handle from now on (mappings made before
    stay writable: the rank's own, and an in-place writer's), and no seal changed any more; once only.
    F_SEAL_FUTURE_WRITE is Linux 5.1; older kernels get the final seal alone. The write seal forbids punching
    holes too, so a segment whose blocks later versions share is freed whole, once none of its blocks is used
    (server/rank/blocks.py)."""
    if is_write_sealed(fd):
        return
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)


def _header_file(nbytes: int) -> tuple[torch.Tensor, Segment]:
    """A header file of `nbytes` for HeaderSlots: writable here, sealed against every other writer."""
    flat, segment = _memfd_bytes(nbytes)
    _seal_segment(segment.fd)
    return flat, segment


def _memfd_bytes(nbytes: int) -> tuple[torch.Tensor, Segment]:
    """A flat uint8 tensor over a new memfd of `nbytes` (pages reserved up front: ENOSPC, not SIGBUS),
    and its Segment; the fd is closed when the mapping goes."""
    fd = os.memfd_create("shardserve-shard", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        _seal_size(fd)
        stat = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    segment = Segment(os.getpid(), fd, stat.st_ino, stat.st_dev, nbytes)
    weakref.finalize(
        mapped, _close_segment, fd
    )  # the fd lives exactly as long as the memory (any view of it)
    return torch.frombuffer(mapped, dtype=torch.uint8), segment
