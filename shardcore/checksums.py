"""Checksums of shard bytes: what proves that a read, a copy or a restore is bit-exact.

Every shard of a version carries the xxh3-64 hash (xxhash, a maintained library) of its raw little-endian
C-contiguous bytes, exactly the bytes the wire protocol moves. The hash reads the tensor's memory in place (a
numpy view of a CPU tensor, no copy); a CUDA tensor is hashed where its bytes pass the host (one copy down).
xxhash releases the GIL while it hashes a large buffer, so the shards of a version are hashed on a thread pool,
one shard per task. 0 stands for "no checksum known" (versions made before checksums, a lost copy): the
chance that a real shard hashes to 0 is 2^-64.

`copy_checksummed` copies a run of bytes and hashes it in the same pass: chunk by chunk, each chunk hashed
right after it is copied, while it is still in cache, instead of reading the whole run again from memory
afterwards. xxh3-64 is sequential (a streaming hasher takes the chunks in order), so the calling thread hashes
every chunk while a helper on the hashing pool copies the chunks ahead of it (a copy and a hash of cached bytes
overlap on two cores: the pair costs about the copy alone); the digest is exactly that of the whole run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np
import torch
import xxhash

ALGORITHM = "xxh3_64"
UNKNOWN = 0  # a shard whose checksum is not known
CHUNK_BYTES = 2 << 20  # a fused copy's chunk: hashed while still in the core's cache (L2 1 MiB, L3 shared)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def hashing_pool() -> ThreadPoolExecutor:
    """The process's pool of hashing threads (one per core, at most 8), made on first use. Only hashing runs
    on it: a task never waits on another pool, so callers on any thread may wait on it."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="shard-hash"
            )
        return _pool


def tensor_checksum(tensor: torch.Tensor) -> int:
    """The xxh3-64 of `tensor`'s bytes in C order (its dtype's raw little-endian bytes, as the wire sends them).

    A C-contiguous CPU tensor is read in place; any other is made contiguous on the host first."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    host = tensor.detach()
    if host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu").contiguous()
    if host.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(host.reshape(-1).view(torch.uint8).numpy().data)


def shard_checksums(
    shards: Mapping[int, torch.Tensor], pool: Executor | None = None
) -> dict[int, int]:
    """The checksum of every shard by its index; with `pool`, the shards are hashed in parallel (one per task)."""
    if pool is None or len(shards) <= 1:
        return {index: tensor_checksum(tensor) for index, tensor in shards.items()}
    futures = {index: pool.submit(tensor_checksum, tensor) for index, tensor in shards.items()}
    return {index: future.result() for index, future in futures.items()}


def checksum_text(value: int) -> str:
    """A checksum as operators see it: 16 hex digits ("unknown" for UNKNOWN)."""
    return "unknown" if value == UNKNOWN else f"{value:016x}"


def copy_checksummed(dst: torch.Tensor, src: torch.Tensor, *, pool: Executor | None = None) -> int:
    """dst[...] = src for two flat uint8 CPU tensors of one length, returning the xxh3-64 of the bytes that
    landed in `dst` (each chunk hashed right after its copy, in order, on this thread). With `pool`, helpers
    there copy the chunks ahead of this thread (one per core but this one) while it hashes: a helper never
    waits for anything, so the pool may be busy or shared; until one starts, this thread copies too."""
    if dst.dtype != torch.uint8 or src.dtype != torch.uint8 or dst.dim() != 1 or src.shape != dst.shape:
        raise ValueError("copy_checksummed takes two flat uint8 tensors of one length")
    chunks = _Chunks(dst.numpy(), src.numpy())
    helpers = max(0, min(3, (os.cpu_count() or 1) - 1)) if pool is not None and chunks.count > 1 else 0
    for _ in range(helpers):
        pool.submit(chunks.help)  # type: ignore[union-attr]
    hasher = xxhash.xxh3_64()
    for k in range(chunks.count):
        hasher.update(chunks.copied(k))
    return hasher.intdigest()


class _Chunks:
    """The chunks of one fused copy: each copied exactly once, by whichever thread claims it first."""

    def __init__(self, dst: np.ndarray, src: np.ndarray) -> None:
        self._dst, self._src = dst, src
        self.count = max(1, -(-dst.size // CHUNK_BYTES))
        self._lock = threading.Lock()
        self._claimed = [False] * self.count
        self._done = [threading.Event() for _ in range(self.count)]
        self._helped = False  # a helper started: from then on it copies every chunk not claimed yet
        self._error: BaseException | None = None

    def _span(self, k: int) -> slice:
        return slice(k * CHUNK_BYTES, min((k + 1) * CHUNK_BYTES, self._dst.size))

    def _claim(self, k: int, *, helper: bool) -> bool:
        with self._lock:
            self._helped = self._helped or helper
            if self._claimed[k] or (self._helped and not helper):
                return False
            self._claimed[k] = True
            return True

    def _copy(self, k: int) -> None:
        try:
            np.copyto(self._dst[self._span(k)], self._src[self._span(k)])
        except BaseException as err:  # noqa: BLE001 - raised on the hashing thread instead
            self._error = err
        finally:
            self._done[k].set()

    def help(self) -> None:
        """Copy every chunk not claimed yet, in order (a helper's task: it never waits)."""
        for k in range(self.count):
            if self._claim(k, helper=True):
                self._copy(k)

    def copied(self, k: int) -> memoryview:
        """Chunk `k` of the destination once copied (by this thread while no helper has started)."""
        if self._claim(k, helper=False):
            self._copy(k)
        else:
            self._done[k].wait()
        if self._error is not None:
            raise self._error
        return memoryview(self._dst[self._span(k)])
