"""The writer's half of same-host writes: a batch's bytes in a memfd of this process that the rank reads.

The rank opens it as /proc/<our pid>/fd/<fd> (server/rank/writes/shared.py)
and checks it is this very file: its inode and device, its size, and its name,
which carries a secret only this process knows. A file is used by one batch at
a time, and kept for the next one (StagingFiles, up to KEPT_BYTES in all, none
idle past IDLE_S): a fresh memfd costs a page fault per 4 KiB on its first
fill, which made writes of large state dicts slower than the bulk port.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import torch

from shardserve.client.paths.copies import copy_tensor
from shardserve.client.paths.writes import ShardWrite
from shardserve.core.wire import tensor_bytes
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import STAGING_NAME

KEPT_BYTES = (
    512 << 20
)  # staging memory a client keeps between writes (a 64 MiB file per rank written to)
IDLE_S = 60.0  # a kept file unused this long is closed when the next write comes


class StagingFile:
    """A memfd of `nbytes` mapped into this process: pack() copies a batch in, source() describes it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.secret = secrets.token_urlsafe(24)
        self._fd = os.memfd_create(STAGING_NAME + self.secret, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, nbytes)
            if nbytes:
                os.posix_fallocate(
                    self._fd, 0, nbytes
                )  # the pages now, in one call: ENOSPC here, never SIGBUS
            self._map = mmap.mmap(self._fd, nbytes) if nbytes else None
        except BaseException:
            os.close(self._fd)
            raise

    def pack(self, writes: Sequence[ShardWrite]) -> None:
        """Copy each write's bytes into the file, back to back in order: one copy of a contiguous CPU tensor
        (another first of a strided or device one). Bytes, not elements: a shard's place in the file need not
        be aligned to its element type. A shard stored as another dtype converts while copying where its place
        is aligned to the stored dtype, else through one converted copy of it."""
        offset = 0
        for write in writes:
            if write.nbytes:
                target = torch.frombuffer(
                    self._map, dtype=torch.uint8, count=write.nbytes, offset=offset
                )
                if write.data.dtype != write.dtype and offset % write.dtype.itemsize == 0:
                    target.view(write.dtype).view(write.data.shape).copy_(write.data)
                else:
                    target.copy_(torch.frombuffer(tensor_bytes(write.stored()), dtype=torch.uint8))
                del target
            offset += write.nbytes

    def pack_bytes(self, pieces: Sequence[torch.Tensor]) -> None:
        """Copy flat uint8 CPU tensors into the file, back to back in order (a byte-range write's ranges)."""
        offset = 0
        for piece in pieces:
            if piece.numel():
                target = torch.frombuffer(
                    self._map, dtype=torch.uint8, count=piece.numel(), offset=offset
                )
                copy_tensor(target, piece)
                del target  # no view of the mapping outlives the copy: close() can unmap it
            offset += piece.numel()

    def source(self, host_id: str) -> pb.SharedMemorySource:
        """The file as WriteShards' shared source, from this process on host `host_id`."""
        info = os.fstat(self._fd)
        return pb.SharedMemorySource(
            pid=os.getpid(),
            fd=self._fd,
            inode=info.st_ino,
            device_id=info.st_dev,
            nbytes=self.nbytes,
            host_id=host_id,
            name_secret=self.secret,
        )

    @property
    def closed(self) -> bool:
        """Whether close() released the file (its descriptor and mapping)."""
        return self._fd < 0

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> StagingFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


class StagingFiles:
    """The staging files of one client: take() one of at least `nbytes` (a kept one when it fits), give_back()
    it after the rank answered."""

    def __init__(
        self,
        kept_bytes: int = KEPT_BYTES,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: what idleness is timed by (seconds, monotonic; tests pass a fake one)."""
        self.kept_bytes = kept_bytes
        self.idle_s = idle_s
        self._clock = clock
        self._idle: list[tuple[float, StagingFile]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> StagingFile:
        now = self._clock()
        with self._lock:
            stale = [f for since, f in self._idle if now - since > self.idle_s]
            self._idle = [(since, f) for since, f in self._idle if now - since <= self.idle_s]
            fits = [(f.nbytes, i) for i, (_, f) in enumerate(self._idle) if f.nbytes >= nbytes]
            chosen = self._idle.pop(min(fits)[1])[1] if fits else None
        for staging in stale:
            staging.close()
        return chosen if chosen is not None else StagingFile(nbytes)

    def give_back(self, staging: StagingFile) -> None:
        with self._lock:
            if staging.nbytes + sum(f.nbytes for _, f in self._idle) <= self.kept_bytes:
                self._idle.append((self._clock(), staging))
                return
        staging.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, staging in idle:
            staging.close()
