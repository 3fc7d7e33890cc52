"""Memory of freed versions kept for the next allocation of the same size.

A reshard or an update writes every byte of its new shards, and on Linux
first-touching fresh pages costs several times the copy itself (128 MiB:
~20-30 ms into fresh THP memory, ~100 ms into a fresh memfd, 16 ms into memory
touched before). So when the store frees a dropped version, its shard buffers
come here instead of back to the OS, and the next allocation of the same byte
size on the same device takes one. A CUDA shard's buffer is kept too, with the
header-only segment that tells same-host readers its state: a writer and a
reader that opened its CUDA IPC handle for an earlier version use the same
opened memory again (opening and closing a handle costs far more than the
copy). Bounded in bytes and in age (the rank's main loop expires old buffers
even when nothing else happens); the store trims it whenever it needs the
memory for a reservation.

Safety is the caller's: a buffer is kept only once no lease holds its version
(no read, write or reshard in this process uses it). Same-host clients that
mapped a shared-memory buffer are handled by server/rank/shared_memory.py: taking
such a buffer bumps the generation word of its header before any byte changes,
and clients check that word before and after each read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardserve.core.wire import byte_view

CPU = torch.device("cpu")
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MAX_AGE_S = 60.0


@dataclass(eq=False)
class Buffer:
    """One kept buffer: the C-contiguous tensor it was kept as (a freed shard, or a file's bytes), and (for a
    shared-memory segment) the segment and its header words."""

    tensor: torch.Tensor
    header: np.ndarray | None = None  # int64 words (server/rank/shared_memory.py)
    segment: Any = None
    since: float = 0.0
    nbytes: int = field(init=False)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = self.tensor.numel() * self.tensor.element_size()
        self.device = self.tensor.device

    def shaped(self, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Its bytes as a tensor of `sizes` and `dtype`: the tensor it was kept as when that one fits (a tensor
        put every step takes back its own shape: no new views, ~5 us each), else a view of its bytes."""
        tensor = self.tensor
        if tensor.dtype == dtype and tuple(tensor.shape) == sizes:
            return tensor
        return byte_view(tensor).view(dtype).view(sizes)


class RecycledBuffers:
    """Buffers of freed versions, oldest first, at most `max_bytes` in all and `max_age_s` old."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (0 keeps nothing), got {max_bytes}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        # oldest first, by id(): a rank takes one buffer per new shard, so taking one must not scan them all
        self._buffers: dict[int, Buffer] = {}
        self._by_size: dict[int, list[Buffer]] = {}  # the same buffers by their size, for take()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again, for logs and tests

    @property
    def nbytes(self) -> int:
        """Bytes kept now."""
        return self._bytes

    def keep(self, buffer: Buffer) -> None:
        """Keep `buffer` (dropping the oldest ones past the bounds)."""
        if buffer.nbytes == 0 or buffer.nbytes > self.max_bytes:
            return
        buffer.since = self._clock()
        with self._lock:
            self._buffers[id(buffer)] = buffer
            self._by_size.setdefault(buffer.nbytes, []).append(buffer)
            self._bytes += buffer.nbytes
            self._trim_locked(self.max_bytes)

    def take(
        self, nbytes: int, shared: bool | None = None, *, device: torch.device = CPU
    ) -> Buffer | None:
        """A kept buffer of exactly `nbytes` on `device` (shared-memory ones first when `shared` is None; only
        those, or only private ones, when True or False), or None."""
        with self._lock:
            self._trim_locked(self.max_bytes)
            chosen = _newest(self._by_size.get(nbytes, []), shared, device)
            if chosen is None:
                return None
            del self._buffers[id(chosen)]
            _remove(self._by_size[nbytes], chosen)
            self._bytes -= chosen.nbytes
            self.reused += 1
            return chosen

    def expire(self) -> int:
        """Let go of the buffers kept longer than max_age_s (the rank calls this while idle too); bytes freed."""
        return self.trim(self.max_bytes)

    def trim(self, keep_bytes: int = 0) -> int:
        """Let go of the oldest buffers until at most `keep_bytes` are kept (and none is too old); bytes freed."""
        with self._lock:
            return self._trim_locked(max(0, keep_bytes))

    def _trim_locked(self, keep_bytes: int) -> int:
        too_old = self._clock() - self.max_age_s
        oldest = next(iter(self._buffers.values()), None)
        if self._bytes <= keep_bytes and (oldest is None or oldest.since >= too_old):
            return 0  # nothing to let go of: no scan (take runs this once per shard)
        kept, freed = {}, 0
        total = self._bytes
        for key, buffer in self._buffers.items():  # oldest first
            if buffer.since < too_old or total > keep_bytes:
                total -= buffer.nbytes
                freed += buffer.nbytes
            else:
                kept[key] = buffer
        self._buffers, self._bytes = kept, total
        self._by_size = {}
        for buffer in kept.values():
            self._by_size.setdefault(buffer.nbytes, []).append(buffer)
        return freed


def _remove(buffers: list[Buffer], chosen: Buffer) -> None:
    """Remove `chosen` from `buffers`: from the end in one step when it is the newest (as it mostly is)."""
    if buffers[-1] is chosen:
        buffers.pop()
    else:
        buffers.remove(chosen)


def _newest(buffers: list[Buffer], shared: bool | None, device: torch.device) -> Buffer | None:
    """The newest of `buffers` (kept oldest first) on `device`, in shared memory or not as `shared` asks; for
    None, the newest shared one, else the newest private one. Scans from the newest end: one step when they
    agree (a rank takes one buffer per new shard, thousands per commit)."""
    wanted = True if shared is None else shared
    other = None
    for buffer in reversed(buffers):
        if buffer.device != device:
            continue
        if (buffer.segment is not None) == wanted:
            return buffer
        if other is None:
            other = buffer
    return other if shared is None else None
