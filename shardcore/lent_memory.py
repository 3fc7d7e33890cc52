"""Opening shard memory that another process on this host lends: a memfd named /proc/<pid>/fd/<fd> and checked by
(inode, device), or a CUDA storage by its IPC handle (torch.multiprocessing's reduction as proto fields).

Both halves open such memory: a client reading or writing a rank's shards (client/paths/segments.py,
in_place.py) and a rank copying a same-host peer's boxes in a reshard (server/rank/jobs/peer_memory.py). The
checks and torch's calls live here once; each caller turns LentMemoryError into its own error.
"""

from __future__ import annotations

import os
import warnings

import torch

from shardserve.protos import shardserve_pb2 as pb


class LentMemoryError(Exception):
    """The lent memory cannot be opened, is not what its lender described, or lies outside it."""


class NotTheFileDescribed(LentMemoryError):
    """/proc/<pid>/fd/<fd> opened, but it is another file than the lender described (or a shorter one)."""


def open_lent_file(  # noqa: PLR0913 - a file's four coordinates and how much of it is needed
    pid: int, fd: int, inode: int, device_id: int, *, min_size: int, flags: int = os.O_RDONLY
) -> int:
    """Open /proc/<pid>/fd/<fd> (`flags`) and check it is the file described (inode, device) and at least
    `min_size` bytes; the caller closes the fd. LentMemoryError when it cannot be opened, NotTheFileDescribed
    when it is not that file."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        opened = os.open(path, flags | os.O_CLOEXEC)
    except OSError as err:
        raise LentMemoryError(f"cannot open {path}: {err.strerror}") from None
    stat = os.fstat(opened)
    if (stat.st_ino, stat.st_dev) != (inode, device_id) or stat.st_size < min_size:
        os.close(opened)
        raise NotTheFileDescribed(path)
    return opened


def open_cuda_storage(h: pb.CudaIpcHandle, byte_offset: int, nbytes: int) -> torch.Tensor:
    """The `nbytes` from `byte_offset` of the storage lent as `h`, as a uint8 CUDA tensor over its memory (no
    copy). The lender's memory stays allocated while this tensor's storage lives (its IPC reference count);
    LentMemoryError, the handle left unopened, when it cannot be opened."""
    if byte_offset < 0 or byte_offset + nbytes > h.storage_size_bytes:
        raise LentMemoryError(
            f"the shard's {nbytes} bytes at {byte_offset} lie outside its CUDA storage of "
            f"{h.storage_size_bytes} bytes"
        )
    try:
        torch.cuda.init()  # opening a handle needs this process's CUDA context
        storage = torch.UntypedStorage._new_shared_cuda(
            h.device,
            h.handle,
            h.storage_size_bytes,
            h.storage_offset_bytes,
            h.ref_counter_handle,
            h.ref_counter_offset,
            h.event_handle or None,
            h.event_sync_required,
        )
    except (RuntimeError, AttributeError) as err:
        raise LentMemoryError(f"cannot open the CUDA IPC handle of the shard: {err}") from None
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}")
    flat.set_(storage, byte_offset, (nbytes,), (1,))
    return flat


def release_cuda_count(h: pb.CudaIpcHandle) -> None:
    """Give back the one user the lender counted for handing out `h` when this process will not open it (it
    holds that storage open already, or cannot open it), so the memory is freed once the lender lets it go."""
    try:
        torch.UntypedStorage._release_ipc_counter(
            h.ref_counter_handle, h.ref_counter_offset, device=h.device
        )
    except (RuntimeError, AttributeError) as err:
        warnings.warn(f"could not release a CUDA IPC reference of a rank: {err}", stacklevel=2)
