"""Copies between tensors in this process's memory, shared by the same-host paths: reads out of mapped
segments into the caller's tensors (client.paths.shm) and writes of the caller's tensors into them
(client.paths.in_place). A copy that touches a CUDA device is queued on that device's current stream
(asynchronous from registered or device memory) and `copy_all` waits for each such stream once at the end.
`copy_checked` is the copy of a verified read: it hashes the bytes as they land (shardcore.checksums);
`copy_checked_all` copies and hashes many runs at once, spread over the hashing pool (an in-place writer's);
`copy_down_checked_all` does the same for CUDA tensors copied down into registered host memory, each run
hashed as soon as the device's copy engine has landed it, while the next runs are still on their way."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from shardserve.core.checksums import copy_checksummed, copy_down_checksummed, hashing_pool
from shardserve.core.wire import byte_view, word_views

PARALLEL_COPY_BYTES = 8 << 20  # from this size torch's multi-threaded copy_ beats one memcpy
GROUP_BYTES = (
    4 << 20
)  # the least a task of copy_checked_all copies: a pool task costs tens of microseconds


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst[...] = src for each (dst, src) in order, every byte in place on return: copies that touch a CUDA
    device are queued without waiting, then the current stream of each device they touched is synchronized once
    (a rank is told of, or a caller handed, only finished bytes)."""
    devices: set[torch.device] = set()
    for dst, src in pairs:
        touched = cuda_devices(dst, src)
        copy_tensor(dst, src, non_blocking=bool(touched))
        devices |= touched
    synchronize(devices)


def cuda_devices(*tensors: torch.Tensor) -> set[torch.device]:
    """The CUDA devices `tensors` are on (none for CPU tensors)."""
    return {t.device for t in tensors if t.device.type == "cuda"}


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for every copy queued on the current stream of each of `devices`."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> int | None:
    """dst[...] = src returning the xxh3-64 of the bytes that landed in `dst`, hashed chunk by chunk as they
    are copied, on this thread (shardcore.checksums.copy_checksummed); None, with nothing copied, when the
    copy is not one of two contiguous CPU tensors of one dtype and shape (a cast, a strided region, a CUDA
    device): the caller then copies and hashes apart."""
    if not _plain_bytes(dst, src):
        return None
    return copy_checksummed(byte_view(dst), byte_view(src))


def copy_checked_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """dst[...] = src for each (dst, src) of flat uint8 CPU tensors of one length, returning the xxh3-64 of each
    copy's bytes in order: each run copied and hashed in one pass on one thread (copy_checksummed), the runs in
    groups of at least GROUP_BYTES spread over the hashing pool (one thread per core), so the whole batch fills
    the cores as torch's parallel copy_ would, and hashing costs little more than the copy."""
    groups = _groups(pairs)
    if len(groups) <= 1:
        return [copy_checksummed(dst, src) for dst, src in pairs]
    pool = hashing_pool()
    futures = [pool.submit(_copy_group, group) for group in groups]
    return [checksum for future in futures for checksum in future.result()]


def copy_down_checked_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """dst[...] = src for each (dst, src), `dst` a flat uint8 CPU tensor (registered with CUDA, or the copies
    run at pageable speed) and `src` a flat uint8 CUDA tensor of one length, returning the xxh3-64 of each
    copy's bytes in order, each run hashed on the hashing pool as soon as it lands
    (shardcore.checksums.copy_down_checksummed). Every byte has landed when this returns."""
    return copy_down_checksummed(pairs, hashing_pool())


def _groups(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Consecutive pairs cut into groups of at least GROUP_BYTES (the last may be smaller)."""
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    current: list[tuple[torch.Tensor, torch.Tensor]] = []
    held = 0
    for dst, src in pairs:
        current.append((dst, src))
        held += dst.numel()
        if held >= GROUP_BYTES:
            groups.append(current)
            current, held = [], 0
    if current:
        groups.append(current)
    return groups


def _copy_group(group: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    return [copy_checksummed(dst, src) for dst, src in group]


def plain_source(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`data`'s bytes as a flat uint8 view when a copy of it stored as `dtype` is one run of CPU bytes (no cast,
    contiguous, on the CPU); else None."""
    return _one_run(data, dtype, "cpu")


def device_source(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`data`'s bytes as a flat uint8 view when a copy of it stored as `dtype` is one run of a CUDA device's
    bytes (no cast, contiguous); else None."""
    return _one_run(data, dtype, "cuda")


def _one_run(data: torch.Tensor, dtype: torch.dtype, device_type: str) -> torch.Tensor | None:
    """`data`'s bytes as a flat uint8 view when it is on a `device_type` device, of `dtype`, contiguous."""
    if data.device.type != device_type or data.dtype != dtype or not data.is_contiguous():
        return None
    return byte_view(data)


def _plain_bytes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether dst[...] = src is a copy of one run of CPU bytes into another."""
    return (
        dst.device.type == src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    )


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """dst[...] = src: one single-threaded memcpy when both are contiguous CPU tensors below
    PARALLEL_COPY_BYTES (torch's copy_ wakes its thread pool, which on a loaded 2-core host cost milliseconds
    per small read), torch's multi-threaded copy_ of whole words above, else torch's copy_ (any strides and
    devices; `non_blocking` queues a copy that touches a CUDA device, which the caller then waits for)."""
    if not _plain_bytes(dst, src):
        dst.copy_(src, non_blocking=non_blocking)
        return
    if not dst.numel():
        return
    dst_bytes, src_bytes = byte_view(dst), byte_view(src)
    if dst_bytes.numel() < PARALLEL_COPY_BYTES:
        np.copyto(dst_bytes.numpy(), src_bytes.numpy())
        return
    wide_dst, wide_src = word_views(dst_bytes, src_bytes)
    wide_dst.copy_(wide_src)
