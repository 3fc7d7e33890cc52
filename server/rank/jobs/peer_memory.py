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
import mmap
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import host_id
from shardserve.server.rank.cuda_ipc import cuda_ipc_handle
from shardserve.server.rank.shared_memory import Segment

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
class CudaHandle:
    """A CUDA shard as a CUDA IPC handle (pb.CudaIpcHandle's fields, encoded by protobuf, never pickled)."""

    handle: bytes  # a serialized pb.CudaIpcHandle
    nbytes: int


ShardHandle = SegmentHandle | CudaHandle


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
                shards[str(index)] = {
                    "cuda": base64.b64encode(handle.handle).decode(),
                    "nbytes": handle.nbytes,
                }
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
    return CudaHandle(base64.b64decode(raw["cuda"], validate=True), _int(raw["nbytes"]))


def local_export(
    shards: Mapping[int, torch.Tensor], segment_of: Callable[[torch.Tensor], Segment | None]
) -> PeerExport:
    """This rank's export of `shards` (source shard index -> tensor): CPU shards that live in a whole memfd
    (`segment_of`), every CUDA shard by IPC; the others (private memory, composed blocks) are left out and go over
    the network. Nothing when the exchange is switched off."""
    mine = PeerExport(host_id(), os.getuid(), os.getpid())
    if not enabled_by_env():
        return mine
    handles: dict[int, ShardHandle] = {}
    for index, shard in shards.items():
        nbytes = shard.numel() * shard.element_size()
        if nbytes == 0:
            continue
        if shard.device.type == "cuda":
            handles[index] = CudaHandle(cuda_ipc_handle(shard).SerializeToString(), nbytes)
            continue
        segment = segment_of(shard)
        if segment is not None and segment.nbytes == nbytes and shard.is_contiguous():
            handles[index] = SegmentHandle(
                segment.fd, segment.inode, segment.device_id, segment.data_offset, nbytes
            )
    return PeerExport(mine.host, mine.uid, mine.pid, handles)


def open_shard(
    export: PeerExport, index: int, *, sizes: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Source shard `index` of the rank that made `export`, mapped here (no copy) as a tensor of `sizes` and
    `dtype`: read-only memfd pages for a CPU shard, the IPC-opened allocation for a CUDA one."""
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
    else:
        flat = _open_cuda(handle, dtype.itemsize)
    return flat.view(dtype).view(sizes)


def _map_segment(pid: int, handle: SegmentHandle) -> torch.Tensor:
    """The shard's bytes in a read-only mapping of /proc/<pid>/fd/<fd>, once it is checked to be that memfd."""
    path = f"/proc/{pid}/fd/{handle.fd}"
    size = handle.data_offset + handle.nbytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise PeerMemoryError(f"cannot open {path}: {err.strerror}") from None
    try:
        stat = os.fstat(fd)
        if (stat.st_ino, stat.st_dev) != (handle.inode, handle.device_id) or stat.st_size < size:
            raise PeerMemoryError(f"{path} is not the shard segment its rank exported")
        mapped = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ
        )
    except OSError as err:
        raise PeerMemoryError(f"cannot map {path}: {err.strerror}") from None
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: it is only read
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
    return whole[handle.data_offset : size]


def _open_cuda(handle: CudaHandle, itemsize: int) -> torch.Tensor:
    """The shard's bytes as a uint8 CUDA tensor over the opened IPC allocation (torch caches opened handles, so a
    storage opened twice in one process maps once)."""
    ipc = pb.CudaIpcHandle.FromString(handle.handle)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            ipc.device,
            ipc.handle,
            ipc.storage_size_bytes,
            ipc.storage_offset_bytes,
            ipc.ref_counter_handle,
            ipc.ref_counter_offset,
            ipc.event_handle or None,
            ipc.event_sync_required,
        )
    except (RuntimeError, AttributeError) as err:
        raise PeerMemoryError(f"cannot open a peer's CUDA IPC handle: {err}") from None
    start = (
        ipc.tensor_offset * itemsize
    )  # the shard's offset in its storage, in elements of its dtype
    if start + handle.nbytes > storage.nbytes():
        raise PeerMemoryError("a peer's CUDA IPC handle names a storage shorter than its shard")
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ipc.device}")
    flat.set_(storage, start, (handle.nbytes,), (1,))
    return flat
