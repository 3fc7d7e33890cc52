"""The same-host path's mapping cache finds the memory opened for an earlier version when the rank reuses it for
a later one: a memfd segment by its identity, a CUDA shard by its state header's identity and the very IPC
handle, offset and length the rank answers now. CPU tensors stand in for opened CUDA memory (the cache only
compares them)."""

from __future__ import annotations

import os

import pytest
import torch

from shardserve.client.paths import segments
from shardserve.client.paths.mapping_cache import MappingCache
from shardserve.core.dtypes import dtype_to_wire
from shardserve.protos import shardserve_pb2 as pb

ADDRESS, INODE, DEVICE, HANDLE = "127.0.0.1:1", 41, 7, b"ipc-handle"


def _cuda_mapping(flat: torch.Tensor, handle: bytes = HANDLE) -> segments.SegmentMapping:
    return segments.SegmentMapping(
        segments.RANK_PROCESSES.watch(os.getpid()),
        INODE,
        DEVICE,
        flat,
        torch.tensor([1, 2, 0], dtype=torch.int64),
        fd=3,
        cuda_handle=(handle, 0),
    )


def _reply(**changes) -> pb.OpenShardResponse:
    fields = dict(pid=os.getpid(), fd=3, inode=INODE, device_id=DEVICE, nbytes=64)
    cuda = dict(handle=HANDLE, storage_size_bytes=64, storage_offset_bytes=0, tensor_offset=0)
    for key, value in changes.items():
        (cuda if key in cuda else fields)[key] = value
    return pb.OpenShardResponse(
        dtype=dtype_to_wire(torch.float32), cuda=pb.CudaIpcHandle(**cuda), **fields
    )


def test_the_memory_opened_for_an_earlier_version_is_taken_once():
    cache = MappingCache()
    earlier = _cuda_mapping(torch.zeros(64, dtype=torch.uint8))
    cache.remember((ADDRESS, "w", 1, 0), earlier)
    assert cache.take_cuda(ADDRESS, _reply()) is earlier
    assert cache.get((ADDRESS, "w", 1, 0)) is None  # its generation went stale: out of the cache
    assert cache.take_cuda(ADDRESS, _reply()) is None


@pytest.mark.parametrize(
    "changes",
    [
        {"handle": b"another-allocation"},
        {"storage_offset_bytes": 512},
        {"tensor_offset": 4},
        {"nbytes": 32},
        {"inode": INODE + 1},
        {"pid": 1},
    ],
    ids=["handle", "storage-offset", "tensor-offset", "length", "header", "process"],
)
def test_other_memory_is_not_taken_for_it(changes):
    cache = MappingCache()
    cache.remember((ADDRESS, "w", 1, 0), _cuda_mapping(torch.zeros(64, dtype=torch.uint8)))
    assert cache.take_cuda(ADDRESS, _reply(**changes)) is None
    assert cache.take_cuda("127.0.0.1:2", _reply()) is None
    assert cache.get((ADDRESS, "w", 1, 0)) is not None
