"""Bytes of a shard box for the wire; a CUDA box is staged through pinned host memory first.

A copy from device memory to pageable memory goes through a driver bounce
buffer; into pinned (page-locked) memory it is one DMA. torch's caching host
allocator reuses pinned blocks, so repeated reads do not pay cudaHostAlloc.
"""

from __future__ import annotations

import torch

from shardserve.core.wire import tensor_bytes


def host_bytes(box: torch.Tensor) -> memoryview:
    """The C-contiguous bytes of `box` on the host: zero-copy for a contiguous CPU box, pinned staging for CUDA."""
    if box.device.type == "cpu" and box.dim() and box.is_contiguous():
        # a shard or a run of one: its bytes as they lie (tensor_bytes' checks cost more than 8 KiB's copy)
        return box.view(-1).view(torch.uint8).numpy().data
    if box.device.type != "cuda" or box.numel() == 0:
        return tensor_bytes(box)
    staged = torch.empty(box.shape, dtype=box.dtype, pin_memory=True)
    staged.copy_(box)  # synchronous: the bytes are on the host when this returns
    return tensor_bytes(staged)  # the memoryview's numpy base keeps `staged` alive
