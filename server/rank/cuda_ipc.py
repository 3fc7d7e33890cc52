"""A CUDA shard described for another process on this host: torch's CUDA IPC reduction as proto fields.

Both same-host paths hand CUDA shards over this way: reads (server/rank/reads/shm.py) and in-place writes
(server/rank/writes/in_place.py). The description is torch.multiprocessing's reduction of the shard's storage
without pickle. Each one made counts one more user of the storage in torch's IPC reference counter: the
memory stays out of the caching allocator's reuse, even once the rank drops the shard, until the process that
opened the handle lets it go (or gives the count back unopened).
"""

from __future__ import annotations

import torch

from shardserve.protos import shardserve_pb2 as pb


def cuda_ipc_handle(shard: torch.Tensor) -> pb.CudaIpcHandle:
    """The CUDA IPC description of a shard's storage (torch.multiprocessing's reduction, without pickle), once
    every write into it on any stream of its device is complete (a failed device raises: no handle to half-written
    memory)."""
    torch.cuda.synchronize(shard.device)
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        shard.untyped_storage()._share_cuda_()
    )
    return pb.CudaIpcHandle(
        device=device,
        handle=handle,
        storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=bool(event_sync),
        tensor_offset=int(shard.storage_offset()),
    )
