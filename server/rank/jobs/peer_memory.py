"""Shard memory that ranks on one host lend each other for a collective job: what a rank exports, how a peer maps it.

A rank's CPU shards live in memfds (server/rank/shared_memory.py) and its CUDA shards can be handed out as CUDA
IPC handles (server/rank/reads/shm.py), exactly as same-host clients read them. In a reshard, repair or replica
job a destination rank on the source's host maps the source's shards this way and copies the boxes it needs,
instead of receiving them over gloo or NCCL (server/rank/jobs/same_host.py agrees which buckets go so).

`PeerExport` is what a rank tells its peers: its host (boot id and namespaces, as the data plane's `host_id`), its
user and pid, and a handle per exported source shard. It travels as JSON over the job's own group: plain numbers
and strings, never pickle. A peer may map it only when it runs on the same host as the same user: /proc/PID/fd/N of
another user's process cannot be opened (and root may open any).
"""

from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from google.protobuf.message import DecodeError

from shardserve.core.lent_memory import (
    LentMemoryError,
    NotTheFileDescribed,
    open_cuda_storage,
    open_lent_file,
    release_cuda_count,
)
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import host_id
from shardserve.server.rank.cuda_ipc import cuda_ipc_handle
from shardserve.server.rank.shared_memory import Segment

log = logging.getLogger(__name__)

ENV_SWITCH = (
    "SHARDSERVE_SAME_HOST_EXCHANGE"  # "0": a rank sends every box over gloo / NCCL, as across hosts
)


def enabled_by_env() -> bool:
    """Whether this rank lends and maps shard memory in collective jobs (SHARDSERVE_SAME_HOST_EXCHANGE != 0)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


class PeerMemoryError(RuntimeError):
    """A peer's export is malformed, or its shard memory cannot be mapped here."""


@dataclass(frozen=True)
class SegmentHandle:
    """A CPU shard in a memfd of the exporting rank: /proc/<pid>/fd/<fd>, checked by (inode, device)."""

    fd: int
    inode: int
    device_id: int
    data_offset: int
    nbytes: int


@dataclass(frozen=True)
class CudaShard:
    """A CUDA shard the exporting rank lends by CUDA IPC. Its handle is made only for a peer that will open it
    (`cuda_handles`): each handle counts one user of the allocation in torch's IPC reference counter, which only
    the opener (or `release_handle`) gives back, and until then the memory is never reused."""

    nbytes: int


ShardHandle = SegmentHandle | CudaShard


@dataclass(frozen=True)
class PeerExport:
    """What one rank lends its same-host peers in one job: where each exported source shard's memory is."""

    host: str
    uid: int
    pid: int
    shards: Mapping[int, ShardHandle] = field(default_factory=dict)

    def maps(self, other: PeerExport) -> bool:
        """Whether this rank can map `other`'s memory: one host (a known one), and the same user or root."""
        return bool(self.host) and self.host == other.host and self.uid in (0, other.uid)

    def encode(self) -> bytes:
        """The export as JSON bytes."""
        shards: dict[str, Any] = {}
        for index, handle in self.shards.items():
            if isinstance(handle, SegmentHandle):
                shards[str(index)] = {"segment": vars(handle)}
            else:
                shards[str(index)] = {"cuda": handle.nbytes}
        return json.dumps(
            {"host": self.host, "uid": self.uid, "pid": self.pid, "shards": shards}
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> PeerExport:
        """An export from its JSON bytes; PeerMemoryError naming what is wrong."""
        try:
            raw = json.loads(data.decode())
            shards = {int(i): _handle(h) for i, h in raw["shards"].items()}
            return cls(str(raw["host"]), _int(raw["uid"]), _int(raw["pid"]), shards)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise PeerMemoryError(f"a peer's shard export is malformed: {err!r}") from None


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value


def _handle(raw: dict) -> ShardHandle:
    if "segment" in raw:
        fields = raw["segment"]
        return SegmentHandle(
            **{name: _int(fields[name]) for name in SegmentHandle.__dataclass_fields__}
        )
    return CudaShard(_int(raw["cuda"]))


def encode_handles(handles: Mapping[int, bytes]) -> bytes:
    """CUDA IPC handles by source shard index (`cuda_handles`), as JSON bytes."""
    return json.dumps({str(i): base64.b64encode(h).decode() for i, h in handles.items()}).encode()


def decode_handles(data: bytes) -> dict[int, bytes]:
    """The handles of `encode_handles`; PeerMemoryError when malformed."""
    try:
        raw = json.loads(data.decode())
        return {int(i): base64.b64decode(h, validate=True) for i, h in raw.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise PeerMemoryError(f"a peer's CUDA IPC handles are malformed: {err!r}") from None


def cuda_handles(shards: Mapping[int, torch.Tensor], indices: Iterable[int]) -> dict[int, bytes]:
    """A CUDA IPC handle (a serialized pb.CudaIpcHandle) of each of `indices`, for one peer that opens each once."""
    return {i: cuda_ipc_handle(shards[i]).SerializeToString() for i in indices}


def release_handle(handle: bytes) -> None:
    """Give back the user that a handle this process will not open counted (a failed job's), so the lending
    rank's memory can be reused once it drops it."""
    try:
        release_cuda_count(pb.CudaIpcHandle.FromString(handle))
    except DecodeError as err:
        log.warning("could not give back a CUDA IPC reference of a peer: %s", err)


def local_export(
    shards: Mapping[int, torch.Tensor], segment_of: Callable[[torch.Tensor], Segment | None]
) -> PeerExport:
    """This rank's export of `shards` (source shard index -> tensor): CPU shards that live in a whole memfd
    (`segment_of`), and every CUDA shard (announced: its handle is made for a peer that maps it); the others
    (private memory, composed blocks) are left out and go over the network. Nothing when switched off."""
    mine = PeerExport(host_id(), os.getuid(), os.getpid())
    if not enabled_by_env():
        return mine
    handles: dict[int, ShardHandle] = {}
    for index, shard in shards.items():
        nbytes = shard.numel() * shard.element_size()
        if nbytes == 0 or not shard.is_contiguous():
            continue
        if shard.device.type == "cuda":
            handles[index] = CudaShard(nbytes)
            continue
        segment = segment_of(shard)
        if segment is not None and segment.nbytes == nbytes:
            handles[index] = SegmentHandle(
                segment.fd, segment.inode, segment.device_id, segment.data_offset, nbytes
            )
    return PeerExport(mine.host, mine.uid, mine.pid, handles)


def open_shard(
    export: PeerExport,
    index: int,
    *,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    cuda_handle: bytes | None = None,
) -> torch.Tensor:
    """Source shard `index` of the rank that made `export`, mapped here (no copy) as a tensor of `sizes` and
    `dtype`: read-only memfd pages for a CPU shard; for a CUDA one, the allocation of `cuda_handle` (the handle
    its rank made for this process) opened."""
    handle = export.shards.get(index)
    if handle is None:
        raise PeerMemoryError(f"shard {index} is not exported by process {export.pid}")
    nbytes = torch.Size(sizes).numel() * dtype.itemsize
    if handle.nbytes != nbytes:
        raise PeerMemoryError(
            f"shard {index} of process {export.pid} has {handle.nbytes} bytes, the plan {nbytes}"
        )
    if isinstance(handle, SegmentHandle):
        flat = _map_segment(export.pid, handle)
    elif cuda_handle is None:
        raise PeerMemoryError(f"no CUDA IPC handle came for shard {index} of process {export.pid}")
    else:
        flat = _open_cuda(cuda_handle, handle.nbytes, dtype.itemsize)
    return flat.view(dtype).view(sizes)


def _map_segment(pid: int, handle: SegmentHandle) -> torch.Tensor:
    """The shard's bytes in a read-only mapping of /proc/<pid>/fd/<fd>, once it is checked to be that memfd."""
    size = handle.data_offset + handle.nbytes
    try:
        fd = open_lent_file(pid, handle.fd, handle.inode, handle.device_id, min_size=size)
    except NotTheFileDescribed as err:
        raise PeerMemoryError(f"{err} is not the shard segment its rank exported") from None
    except LentMemoryError as err:
        raise PeerMemoryError(str(err)) from None
    try:
        mapped = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ
        )
    except OSError as err:
        raise PeerMemoryError(f"cannot map /proc/{pid}/fd/{handle.fd}: {err.strerror}") from None
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: it is only read
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
    return whole[handle.data_offset : size]


def _open_cuda(handle: bytes, nbytes: int, itemsize: int) -> torch.Tensor:
    """The shard's bytes as a uint8 CUDA tensor over the opened IPC allocation (torch caches opened handles, so a
    storage opened twice in one process maps once); the shard starts `tensor_offset` elements into it."""
    try:
        ipc = pb.CudaIpcHandle.FromString(handle)
        return open_cuda_storage(ipc, ipc.tensor_offset * itemsize, nbytes)
    except (LentMemoryError, DecodeError) as err:
        raise PeerMemoryError(f"a peer's CUDA memory: {err}") from None
