"""Copies between tensors in this process's memory, shared by the same-host paths: reads out of mapped
segments into the caller's tensors (client.paths.shm) and writes of the caller's tensors into them
(client.paths.in_place)."""

from __future__ import annotations

import numpy as np
import torch

from shardserve.core.wire import byte_view, word_views

PARALLEL_COPY_BYTES = 8 << 20  # from this size torch's multi-threaded copy_ beats one memcpy


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src: one single-threaded memcpy when both are contiguous CPU tensors below
    PARALLEL_COPY_BYTES (torch's copy_ wakes its thread pool, which on a loaded 2-core host cost milliseconds
    per small read), torch's multi-threaded copy_ of whole words above, else torch's copy_ (any strides and
    devices)."""
    if not (
        dst.device.type == src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        dst.copy_(src)
        return
    if not dst.numel():
        return
    dst_bytes, src_bytes = byte_view(dst), byte_view(src)
    if dst_bytes.numel() < PARALLEL_COPY_BYTES:
        np.copyto(dst_bytes.numpy(), src_bytes.numpy())
        return
    wide_dst, wide_src = word_views(dst_bytes, src_bytes)
    wide_dst.copy_(wide_src)
