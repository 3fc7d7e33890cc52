"""Checksums of shard bytes: what proves that a read, a copy or a restore is bit-exact.

Every shard of a version carries the xxh3-64 hash (xxhash, a maintained library) of its raw little-endian
C-contiguous bytes, exactly the bytes the wire protocol moves. The hash reads the tensor's memory in place (a
numpy view of a CPU tensor, no copy); a CUDA tensor's bytes pass the host in runs of STAGE_BYTES through two
pinned buffers, each run hashed while the next one is copied down (a copy into fresh pageable memory, as this
did first, moved a CUDA rank's 1 GiB at 4 GB/s: 250 ms of a 290 ms steady put, measured on an H200).
xxhash releases the GIL while it hashes a large buffer, so the shards of a version are hashed on a thread pool,
one shard per task. 0 stands for "no checksum known" (versions made before checksums, a lost copy): the
chance that a real shard hashes to 0 is 2^-64.

`copy_checksummed` copies a run of bytes and hashes it in the same pass: chunk by chunk, each chunk hashed
right after it is copied, while it is still in cache, instead of reading the whole run again from memory
afterwards; the digest is exactly that of the whole run. xxh3-64 is sequential (a streaming hasher takes the
chunks in order), so one copy runs on one thread: a copy of host memory is bound by memory bandwidth, which one
core nearly fills, and concurrent reads (a state dict's) fill the others. Handing chunks to a helper thread that
copies ahead while this one hashes cost more CPU and more time than it saved on a loaded 2-core host.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import xxhash

Key = TypeVar("Key", bound=Hashable)

ALGORITHM = "xxh3_64"
UNKNOWN = 0  # a shard whose checksum is not known
STAGE_BYTES = 8 << 20
"""A CUDA tensor's run through pinned host memory on its way to the hash: large enough that a copy's fixed cost
(~10 us) is noise beside its ~150 us at 55 GB/s, small enough that two per hashing thread stay cheap."""
WINDOW_BYTES = 256 << 20
"""The pinned host memory CUDA shards pass through on their way to the hash at promote (cuda_checksums), held by
torch's caching host allocator once used: 64 shards of 16 MiB hashed one by one through two 8 MiB buffers each
took 45-55 ms per GiB on an H200 host, all queued at once into one window and hashed as they land 22.5 ms."""
CHUNK_BYTES = 512 << 10
"""A fused copy's chunk: hashed while still in the core's L2 (1 MiB per core on this project's EPYC hosts, 512
KiB to 2 MiB on current x86 server cores), which the chunk's source and destination pass through together. With
2 MiB chunks the hash read the destination back from L3: a 1 GiB put's copies took 8% longer."""

HASH_THREADS = 16
"""Hashing is bound by memory bandwidth, which one core does not fill: 1 GiB hashed on 1, 4, 8 and 16 threads of
a 16-core H200 host took 192, 51, 33 and 24 ms."""
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def hashing_pool() -> ThreadPoolExecutor:
    """The process's pool of hashing threads (one per core, at most HASH_THREADS), made on first use. Only
    hashing runs on it: a task never waits on another pool, so callers on any thread may wait on it."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=max(1, min(HASH_THREADS, os.cpu_count() or 1)),
                thread_name_prefix="shard-hash",
            )
        return _pool


def bytes_checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum of raw bytes (any buffer): what tensor_checksum answers for a tensor holding them."""
    return xxhash.xxh3_64_intdigest(data)


def views_checksum(views: Sequence[torch.Tensor]) -> int:
    """The checksum of the bytes of flat uint8 CPU `views` one after another: tensor_checksum of their
    concatenation, read in place (a shard whose bytes lie in several mappings, server/rank/blocks.py)."""
    hasher = xxhash.xxh3_64()
    for view in views:
        if view.dtype != torch.uint8 or view.dim() != 1 or view.device.type != "cpu":
            raise ValueError("views_checksum reads flat uint8 CPU tensors")
        if view.numel():
            hasher.update(view.numpy().data)
    return hasher.intdigest()


def tensor_checksum(tensor: torch.Tensor) -> int:
    """The xxh3-64 of `tensor`'s bytes in C order (its dtype's raw little-endian bytes, as the wire sends them).

    A C-contiguous CPU tensor is read in place; a CUDA tensor is staged through pinned memory (cuda_checksum);
    any other is made contiguous on the host first."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    host = tensor.detach()
    if host.device.type == "cuda" and host.numel():
        return cuda_checksum(host)
    if host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu").contiguous()
    if host.numel() == 0:
        return bytes_checksum(b"")
    return bytes_checksum(host.reshape(-1).view(torch.uint8).numpy().data)


def cuda_checksum(tensor: torch.Tensor, stage_bytes: int = STAGE_BYTES) -> int:
    """The xxh3-64 of a CUDA tensor's bytes in C order, exactly tensor_checksum of its copy on the host.

    The bytes go down in runs of `stage_bytes` on a side stream (after the work queued on the device's current
    stream, so writes queued before are in), alternating between two pinned buffers from torch's caching host
    allocator: the run in one buffer is hashed (xxhash releases the GIL) while the next is copied into the other.
    A strided tensor is made contiguous on its device first."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    total = flat.numel()
    hasher = xxhash.xxh3_64()
    if total == 0:
        return hasher.intdigest()
    run = min(stage_bytes, total)
    with torch.cuda.device(flat.device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        buffers = [torch.empty(run, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        landed = [torch.cuda.Event(), torch.cuda.Event()]

        def copy_down(i: int) -> None:
            start = i * run
            with torch.cuda.stream(stream):
                buffers[i % 2][: min(run, total - start)].copy_(
                    flat[start : start + run], non_blocking=True
                )
                landed[i % 2].record(stream)

        runs = -(-total // run)
        copy_down(0)
        for i in range(runs):
            if i + 1 < runs:
                copy_down(i + 1)  # into the buffer hashed last round, while this round's is hashed
            landed[i % 2].synchronize()
            hasher.update(buffers[i % 2][: min(run, total - i * run)].numpy().data)
    return hasher.intdigest()


def copy_down_checksummed(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], pool: Executor
) -> list[int]:
    """dst[...] = src for each (dst, src), `dst` a flat uint8 CPU tensor (pinned or registered with CUDA, else
    the copies run at pageable speed) and `src` a flat uint8 CUDA tensor of one length, returning the xxh3-64
    of each copy's bytes in order. Every copy is queued at once on a side stream of its device (after the work
    queued on the device's current stream) in runs of STAGE_BYTES with an event behind each run; a task per
    copy on `pool` (never the caller's own pool thread) hashes its runs as their events complete, so the copy
    engine never waits for the hash. 1 GiB in 64 tensors on an H200 host: 22.5 ms, the plain copy alone 19.6.
    Every byte has landed when this returns."""
    streams: dict[torch.device, torch.cuda.Stream] = {}
    queued: list[tuple[torch.Tensor, list[tuple[int, int, torch.cuda.Event]]]] = []
    for dst, src in pairs:
        stream = streams.get(src.device)
        if stream is None:
            stream = streams[src.device] = torch.cuda.Stream(src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))
        runs = []
        with torch.cuda.stream(stream):
            for start in range(0, dst.numel(), STAGE_BYTES):
                end = min(start + STAGE_BYTES, dst.numel())
                dst[start:end].copy_(src[start:end], non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
                runs.append((start, end, landed))
        queued.append((dst, runs))
    futures = [pool.submit(_hash_as_landed, dst, runs) for dst, runs in queued]
    return [future.result() for future in futures]


def _hash_as_landed(dst: torch.Tensor, runs: list[tuple[int, int, torch.cuda.Event]]) -> int:
    """The xxh3-64 of `dst`'s bytes, each run hashed once its copy's event completed."""
    hasher = xxhash.xxh3_64()
    target = dst.numpy()
    for start, end, landed in runs:
        landed.synchronize()
        hasher.update(target[start:end].data)
    return hasher.intdigest()


def shard_checksums(
    shards: Mapping[Key, torch.Tensor], pool: Executor | None = None
) -> dict[Key, int]:
    """The checksum of every shard by its key (a shard index, or anything naming a shard); with `pool`, the
    shards are hashed in parallel (one per task) and CUDA shards go down through pinned windows together
    (cuda_checksums)."""
    if pool is None or len(shards) <= 1:
        return {index: tensor_checksum(tensor) for index, tensor in shards.items()}
    on_cuda = {i: t for i, t in shards.items() if t.device.type == "cuda" and t.numel()}
    futures = {
        index: pool.submit(tensor_checksum, tensor)
        for index, tensor in shards.items()
        if index not in on_cuda
    }
    found = cuda_checksums(on_cuda, pool) if on_cuda else {}
    return {**found, **{index: future.result() for index, future in futures.items()}}


def cuda_checksums(
    shards: Mapping[Key, torch.Tensor], pool: Executor, *, window_bytes: int = WINDOW_BYTES
) -> dict[Key, int]:
    """The checksums of CUDA `shards` by key, as tensor_checksum gives them: consecutive shards go down
    together into one pinned window of at most `window_bytes` (copy_down_checksummed), window after window; a
    shard larger than a window is hashed alone (cuda_checksum). Called from outside `pool`'s threads."""
    found: dict[Key, int] = {}
    window: list[tuple[Key, torch.Tensor]] = []
    held = 0
    for index, shard in shards.items():
        flat = shard.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() > window_bytes:
            found[index] = cuda_checksum(flat)
            continue
        if held + flat.numel() > window_bytes:
            found.update(_window_checksums(window, held, pool))
            window, held = [], 0
        window.append((index, flat))
        held += flat.numel()
    if window:
        found.update(_window_checksums(window, held, pool))
    return found


def _window_checksums(
    window: Sequence[tuple[Key, torch.Tensor]], nbytes: int, pool: Executor
) -> dict[Key, int]:
    """The checksums of `window`'s flat CUDA bytes, copied down into one pinned buffer of `nbytes` (from torch's
    caching host allocator: the next window reuses it) and hashed as they land."""
    staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pairs, offset = [], 0
    for _, flat in window:
        pairs.append((staging[offset : offset + flat.numel()], flat))
        offset += flat.numel()
    sums = copy_down_checksummed(pairs, pool)
    return {index: checksum for (index, _), checksum in zip(window, sums)}


def checksum_text(value: int) -> str:
    """A checksum as operators see it: 16 hex digits ("unknown" for UNKNOWN)."""
    return "unknown" if value == UNKNOWN else f"{value:016x}"


def copy_checksummed(dst: torch.Tensor, src: torch.Tensor) -> int:
    """dst[...] = src for two flat uint8 CPU tensors of one length, returning the xxh3-64 of the bytes that
    landed in `dst`: chunk by chunk, each chunk hashed right after its copy while it is still in cache."""
    if (
        dst.dtype != torch.uint8
        or src.dtype != torch.uint8
        or dst.dim() != 1
        or src.shape != dst.shape
    ):
        raise ValueError("copy_checksummed takes two flat uint8 tensors of one length")
    target, source = dst.numpy(), src.numpy()
    if target.size <= CHUNK_BYTES:  # one chunk (a state dict's small tensors): no hasher, no slices
        np.copyto(target, source)
        return xxhash.xxh3_64_intdigest(target.data)
    hasher = xxhash.xxh3_64()
    for start in range(0, target.size, CHUNK_BYTES):
        chunk = slice(start, start + CHUNK_BYTES)
        np.copyto(target[chunk], source[chunk])
        hasher.update(target[chunk].data)
    return hasher.intdigest()
