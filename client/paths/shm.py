"""The same-host data path: reading a rank's shards through shared memory (client.paths.policy picks it).

Same host = the rank's hostname and host id (RankInfo.host_id: boot id, network
and PID namespaces) equal ours and the rank offers shared memory: a rank in
another network namespace (a container, a test rig) is read over the network,
like one on another machine, so what isolates it on the network isolates it
for reads too. Then a part is read by ShardServer.OpenShard
(a leased reference, no bulk bytes), mapping /proc/<pid>/fd/<fd> read-only
(checked by inode and device, so a stale fd number cannot show other data),
and one copy of the box into the output. Mappings stay cached (bounded): a
served version never changes, and a segment's header page (state and
generation words, checked before and after every copy) says when the rank
dropped the version or reused the segment for another one. A segment is
mapped anew only under an OpenShard lease. A CUDA shard comes as a CUDA IPC handle when this process has
CUDA. A read this path cannot serve raises SharedMemoryError; client.paths.policy
then falls back (transport="auto") or passes it on (transport="shm").
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from shardserve.client.channel import Channel
from shardserve.client.errors import (
    ResourceExhaustedError,
    ShardServeError,
    StaleVersionError,
    error_from_rpc,
)
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.composed import CompositionError, map_extents
from shardserve.client.paths.grpc import unary
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.staging import StagingFiles
from shardserve.client.paths.writes import ShardWrite, write_request
from shardserve.core.dtypes import dtype_from_wire
from shardserve.core.metadata import Box
from shardserve.core.regions import local_view
from shardserve.core.wire import byte_view
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import HEADER_MAGIC, STATE_REPLACED, STATE_SERVED, host_id

log = logging.getLogger(__name__)

# The segment header the rank keeps (server side of this path; OpenShardResponse.data_offset).
HEADER_WORDS_BYTES = 24  # magic, state, generation
CACHE_BYTES = (
    4 << 30
)  # mapped bytes kept for reuse (pages of dropped versions stay alive meanwhile)
CACHE_ENTRIES = 256


class SharedMemoryError(ShardServeError):
    """The same-host path cannot serve this read (not the same host, shared memory off, mapping refused)."""


def local_host() -> tuple[str, str]:
    """(hostname, host id) of this process: the host id as a rank makes its RankInfo.host_id
    (protos.same_host)."""
    return socket.gethostname(), host_id()


def same_host_reason(rank: RankStatus, host: tuple[str, str]) -> str:
    """Why `rank` cannot be read through shared memory from `host`, or "" when it can be tried."""
    if not rank.shared_memory:
        return f"rank {rank.rank} does not offer shared memory"
    if not rank.host_id or not host[1]:
        return f"rank {rank.rank} or this client has no host id"
    if (rank.hostname, rank.host_id) != host:
        return (
            f"rank {rank.rank} runs on host {rank.hostname!r} or in other namespaces, not this one"
        )
    return ""


@dataclass
class _Mapping:
    process: RankProcess  # the rank process that handed the segment over
    inode: int
    device_id: int
    flat: torch.Tensor  # uint8 over the shard's bytes in the segment (CPU), or in its CUDA storage
    state: torch.Tensor | None = (
        None  # int64 header words (magic, state, generation) of the segment/CUDA header
    )
    fd: int = -1
    cuda_handle: tuple[bytes, int] | None = (
        None  # (IPC handle, storage offset) of a CUDA shard's mapping
    )
    generation: int = 0  # the header's generation when mapped (a recycled segment has a higher one)

    def __post_init__(self) -> None:
        # the header words as numpy: reading one is ~10x cheaper than indexing the torch tensor, on every read
        self._words = self.state.numpy() if self.state is not None else None

    def serves(self) -> bool:
        """Whether the segment holds the version it was mapped for, served and not replaced by a newer one: ask
        before a read (a replaced version is read anew at the newest one)."""
        words = self._words
        return words is None or (int(words[1]) == STATE_SERVED and int(words[2]) == self.generation)

    def readable(self) -> bool:
        """Whether the segment still holds the version it was mapped for (served, or replaced but in the rank's
        grace period) and was not recycled: ask after a read, which then was of that version whole."""
        words = self._words
        return words is None or (
            int(words[1]) in (STATE_SERVED, STATE_REPLACED) and int(words[2]) == self.generation
        )


class HostMapping:
    """A mapped host shard and the questions a reader asks before each read of it."""

    def __init__(self, mapping: _Mapping) -> None:
        self._mapping = mapping
        self.data = mapping.flat.numpy()  # the shard's bytes (uint8), read-only in practice

    def serves(self) -> bool:
        """Whether the segment still holds this version, not replaced (served, not recycled): ask before a read."""
        return self._mapping.serves()

    def readable(self) -> bool:
        """Whether the segment still holds this version (maybe replaced, in its grace): ask after a read."""
        return self._mapping.readable()

    def held(self) -> bool:
        """Whether the rank process that serves it is still alive."""
        return _still_held(self._mapping)


class SharedMemoryPath:
    """Reads parts and rows of shards from same-host ranks through mapped shared memory."""

    name = "shm"

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._cache: OrderedDict[tuple, _Mapping] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._limits: dict[
            str, int
        ] = {}  # address -> the rank's max_request_bytes (from OpenShard)
        self._staging = (
            StagingFiles()
        )  # the memfds writes stage their bytes in (client/paths/staging.py)

    def read(
        self,
        address: str,
        summary: TensorSummary,
        index: int,
        part: Box,
        region: torch.Tensor,
        cancel: Cancellation | None = None,
    ) -> None:
        """Copy global box `part` of shard `index` into `region` (its place in the output); `cancel` can stop an
        OpenShard call from another thread."""
        mapping, shard = self._open(address, summary, index, cancel)
        self.check_limit(address, part.numel() * region.element_size(), "offsets/sizes: the box")
        if shard is not None:
            copy_box(region, local_view(shard, summary.metadata.shards_metadata[index].box, part))
            _confirm(mapping, summary, address)

    def read_rows(
        self, address: str, summary: TensorSummary, index: int, local_rows: torch.Tensor
    ) -> torch.Tensor:
        """Rows `local_rows` of shard `index` of a 2-D table, as a CPU tensor [len(local_rows), shard columns]."""
        mapping, shard = self._open(address, summary, index)
        columns = summary.metadata.shards_metadata[index].shard_sizes[1]
        self.check_limit(
            address,
            local_rows.numel() * columns * summary.metadata.tensor_properties.itemsize,
            "the answer of ids",
        )
        if shard is None:
            return torch.empty((local_rows.numel(), columns), dtype=summary.metadata.dtype)
        rows = shard.index_select(0, local_rows.to(shard.device)).cpu()
        _confirm(mapping, summary, address)
        return rows

    def limit(self, address: str) -> int:
        """The rank's max_request_bytes as its latest OpenShard said (0: no limit or not known yet)."""
        return self._limits.get(address, 0)

    def check_limit(self, address: str, nbytes: int, what: str) -> None:
        """The rank's max_request_bytes holds for mapped reads too, as it does over gRPC."""
        limit = self.limit(address)
        if limit and nbytes > limit:
            raise ResourceExhaustedError(
                f"{what} is {nbytes} bytes, over the max_request_bytes "
                f"{limit} of the rank at {address}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )

    def _open(
        self, address: str, summary: TensorSummary, index: int, cancel: Cancellation | None = None
    ) -> tuple[_Mapping | None, torch.Tensor | None]:
        """(the mapping, shard `index` at the summary's version as a read-only tensor over it; both None when the
        shard is empty): a cached mapping checked by its header, else one opened by OpenShard. The caller checks
        after reading that the mapping still serves (_confirm)."""
        key = (address, summary.name, summary.version, index)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if (
            cached is not None and cached.state is not None
        ):  # the rank keeps the header's words current
            if not cached.serves():
                self._forget(key)
                raise _stale(summary, address)
            if _still_held(cached):
                return cached, _as_shard(cached.flat, summary, index)
        want_cuda = torch.cuda.is_available()
        request = pb.OpenShardRequest(
            name=summary.name,
            version=summary.version,
            shard_index=index,
            cached_inode=cached.inode if cached else 0,
            cuda_ipc=want_cuda,
        )
        reply = self._open_shard(address, request, cancel)
        process = _RANK_PROCESSES.watch(
            reply.pid
        )  # now, while the rank that just answered surely owns the pid
        self._limits[address] = reply.max_request_bytes
        try:  # the lease holds the version (and its segment's generation) until released below
            _check_reply(reply, summary, index)
            if reply.nbytes == 0:
                return None, None
            if reply.HasField("cuda"):
                mapping = self._cuda_mapping(key, cached, reply, process)
            elif cached is not None and (cached.process, cached.inode, cached.device_id) == (
                process,
                reply.inode,
                reply.device_id,
            ):
                if (
                    not cached.serves()
                ):  # the same segment: its header says the version went since the reply
                    self._forget(key)
                    raise _stale(summary, address)
                mapping = cached
            elif (
                not reply.lease_id
            ):  # the rank saw our inode and kept no lease, yet this is another segment
                self._forget(key)
                # asked again without it: a mapping made under a lease
                return self._open(address, summary, index, cancel)
            else:
                flat, header = _map_segment(reply)
                mapping = _Mapping(
                    process,
                    reply.inode,
                    reply.device_id,
                    flat,
                    header,
                    reply.fd,
                    generation=int(header[2]) if header is not None else 0,
                )
                self._remember(key, mapping)
        finally:
            if reply.lease_id:
                self._release(address, reply.lease_id)
        return mapping, _as_shard(mapping.flat, summary, index)

    def host_mapping(self, address: str, summary: TensorSummary, index: int) -> HostMapping | None:
        """Shard `index` mapped from host shared memory with its header state, for callers that check the state
        themselves on every read (client.embedding.mapped_rows); None for CUDA shards, empty shards and header-less
        segments."""
        mapping, shard = self._open(address, summary, index)
        if (
            shard is None
            or mapping is None
            or mapping.state is None
            or mapping.cuda_handle is not None
        ):
            return None
        return HostMapping(mapping)

    def _cuda_mapping(
        self, key: tuple, cached: _Mapping | None, reply: pb.OpenShardResponse, process: RankProcess
    ) -> _Mapping:
        """The shard's CUDA memory: the cached mapping when the handle is the same one (opening a handle maps the
        whole allocation, milliseconds per call), else a newly opened one."""
        h = reply.cuda
        if cached is not None and cached.cuda_handle == (h.handle, h.storage_offset_bytes):
            # the rank counted one more user of its memory for this reply; we already hold one
            torch.UntypedStorage._release_ipc_counter(
                h.ref_counter_handle, h.ref_counter_offset, device=h.device
            )
            return cached
        flat = _map_cuda(reply)
        state = (
            _map_state_header(reply) if reply.fd else None
        )  # later reads check it instead of calling OpenShard
        mapping = _Mapping(
            process,
            reply.inode,
            reply.device_id,
            flat,
            state,
            reply.fd,
            cuda_handle=(h.handle, h.storage_offset_bytes),
            generation=int(state[2]) if state is not None else 0,
        )
        self._remember(key, mapping)
        return mapping

    def _forget(self, key: tuple) -> None:
        with self._lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._cached_bytes -= old.flat.numel()

    def write_shards(self, address: str, writes: Sequence[ShardWrite], host_id: str) -> int:
        """Write whole shards to the same-host rank at `address`: their bytes packed into a staging memfd
        that the rank reads (WriteShards with a shared source); returns the bytes written. SharedMemoryError when
        the rank cannot read it (not the same host for it, shared memory off)."""
        total = sum(write.nbytes for write in writes)
        staging = self._staging.take(total)
        try:
            staging.pack(writes)
            request = write_request(writes)
            request.shared.CopyFrom(staging.source(host_id))
            reply = self.channel.shard_methods(address).write_shards(
                request, timeout=self.channel.data_timeout(total), metadata=self.channel.metadata
            )
        except grpc.RpcError as err:
            staging.close()  # the rank may still be reading it: never reused
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise SharedMemoryError(f"rank at {address}: {err.details()}") from None
            raise error_from_rpc(err, f"rank at {address}") from None
        except BaseException:
            staging.close()
            raise
        self._staging.give_back(staging)
        return reply.bytes_written

    def clear(self) -> None:
        """Forget every cached mapping (unmapped once no tensor uses it) and close the kept staging files."""
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0
        self._staging.close()

    def _open_shard(
        self, address: str, request: pb.OpenShardRequest, cancel: Cancellation | None = None
    ) -> pb.OpenShardResponse:
        try:
            return unary(
                self.channel.shard_server(address).OpenShard,
                request,
                self.channel.timeout,
                self.channel.metadata,
                cancel,
            )
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL):
                raise SharedMemoryError(f"rank at {address}: {err.details()}") from None
            raise error_from_rpc(err, f"rank at {address}") from None

    def _release(self, address: str, lease_id: int) -> None:
        stub = self.channel.shard_server(address)
        request = pb.ReleaseShardRequest(lease_ids=[lease_id])

        def release() -> None:
            try:
                stub.ReleaseShard(
                    request, timeout=self.channel.timeout, metadata=self.channel.metadata
                )
            except (
                grpc.RpcError
            ) as err:  # the lease then ends at its expiry, holding the version until then
                log.info(
                    "releasing lease %d at %s failed (%s); it expires on its own",
                    lease_id,
                    address,
                    err.code().name,
                )

        self.channel.submit(release)

    def _remember(self, key: tuple, mapping: _Mapping) -> None:
        size = mapping.flat.numel()
        with self._lock:
            old = self._cache.pop(key, None)
            if old is not None:
                self._cached_bytes -= old.flat.numel()
            self._cache[key] = mapping
            self._cached_bytes += size
            while self._cache and (
                self._cached_bytes > CACHE_BYTES or len(self._cache) > CACHE_ENTRIES
            ):
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.flat.numel()


PARALLEL_COPY_BYTES = 8 << 20  # from this size torch's multi-threaded copy_ beats one memcpy


def copy_box(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src: one single-threaded memcpy when both are contiguous CPU tensors below
    PARALLEL_COPY_BYTES (torch's copy_ wakes its thread pool, which on a loaded 2-core host cost milliseconds
    per small read), else torch's copy_ (multi-threaded, any strides and devices)."""
    small = dst.numel() * dst.element_size() < PARALLEL_COPY_BYTES
    if (
        small
        and dst.device.type == src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        if dst.numel():
            np.copyto(byte_view(dst).numpy(), byte_view(src).numpy())
        return
    dst.copy_(src)


def _check_reply(reply: pb.OpenShardResponse, summary: TensorSummary, index: int) -> None:
    """SharedMemoryError unless the rank describes exactly the shard the client's metadata expects."""
    shard = summary.metadata.shards_metadata[index]
    expected = shard.box.numel() * summary.metadata.tensor_properties.itemsize
    if (
        reply.version != summary.version
        or tuple(reply.shard_sizes) != shard.shard_sizes
        or reply.nbytes != expected
        or dtype_from_wire(reply.dtype) != summary.metadata.dtype
    ):
        raise SharedMemoryError(
            f"rank described shard {index} of {summary.name!r} as version {reply.version}, "
            f"sizes {tuple(reply.shard_sizes)}, {reply.nbytes} bytes; expected version "
            f"{summary.version}, sizes {shard.shard_sizes}, {expected} bytes"
        )


def _as_shard(flat: torch.Tensor, summary: TensorSummary, index: int) -> torch.Tensor:
    """The shard's bytes `flat` as a tensor of its dtype and sizes."""
    return flat.view(summary.metadata.dtype).view(
        summary.metadata.shards_metadata[index].shard_sizes
    )


def _confirm(mapping: _Mapping | None, summary: TensorSummary, address: str) -> None:
    """After a read: StaleVersionError if the segment was recycled for another version meanwhile (the read may
    have seen its new bytes; the caller refreshes and reads again)."""
    if mapping is not None and not mapping.readable():
        raise _stale(summary, address)


def _stale(summary: TensorSummary, address: str) -> StaleVersionError:
    return StaleVersionError(
        f"tensor {summary.name!r} version {summary.version} is no longer served by the rank "
        f"at {address}",
        grpc.StatusCode.FAILED_PRECONDITION,
    )


def _still_held(mapping: _Mapping) -> bool:
    """Whether the rank still holds the segment (a killed rank's last header would still say served).

    A rank marks a segment dropped before closing it, so while the header says served the segment is held
    exactly as long as the rank's process lives; a pidfd answers that in one poll (no /proc path walk)."""
    alive = mapping.process.alive()
    if alive is not None:
        return alive
    try:
        stat = os.stat(f"/proc/{mapping.process.pid}/fd/{mapping.fd}")
    except OSError:
        return False
    return (stat.st_ino, stat.st_dev) == (mapping.inode, mapping.device_id)


class RankProcess:
    """One rank process, watched through a pidfd (Linux 5.3+): readable once that process has exited, whatever
    later process reuses its pid. The pidfd closes when no mapping refers to the process any more."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = _pidfd(pid)
        self._closer = (
            weakref.finalize(self, os.close, self._pidfd) if self._pidfd is not None else None
        )

    def alive(self) -> bool | None:
        """Whether the process is running; None where pidfds are unavailable."""
        if self._pidfd is None:
            return None
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return not poller.poll(0)


class _ProcessWatch:
    """The latest RankProcess per pid: an exited one is replaced when a rank that reused its pid answers, and
    forgotten (its pidfd closed once its mappings are gone) instead of kept for the client's lifetime."""

    def __init__(self) -> None:
        self._processes: dict[int, RankProcess] = {}
        self._lock = threading.Lock()

    def watch(self, pid: int) -> RankProcess:
        """Rank process `pid`: callers ask right after the rank answered, so a pidfd opened now names that
        process and not a later one that reused its pid."""
        with self._lock:
            process = self._processes.get(pid)
            if process is None or process.alive() is False:
                self._forget_exited()
                process = self._processes[pid] = RankProcess(pid)
            return process

    def _forget_exited(self) -> None:
        for pid in [pid for pid, process in self._processes.items() if process.alive() is False]:
            del self._processes[pid]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


_RANK_PROCESSES = _ProcessWatch()


def _map_segment(reply: pb.OpenShardResponse) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Map the rank's memfd read-only (pages populated up front), after checking it is the segment described:
    (the shard's bytes, the header's int64 words or None when the segment has no header)."""
    if reply.extents:  # a row update's version: its blocks, shared with earlier versions
        try:
            return map_extents(reply), _map_state_header(reply)
        except CompositionError as err:
            raise SharedMemoryError(str(err)) from None
    whole = _map_file(reply, reply.data_offset + reply.nbytes)
    if reply.data_offset < HEADER_WORDS_BYTES:
        return whole[reply.data_offset :], None
    return whole[reply.data_offset :], _header_words(whole, reply)


def _map_state_header(reply: pb.OpenShardResponse) -> torch.Tensor:
    """The int64 header words (magic, state, generation) of a CUDA shard's header-only segment."""
    return _header_words(_map_file(reply, HEADER_WORDS_BYTES), reply)


def _header_words(whole: torch.Tensor, reply: pb.OpenShardResponse) -> torch.Tensor:
    header = whole[:HEADER_WORDS_BYTES].view(torch.int64)
    if int(header[0]) != HEADER_MAGIC:
        raise SharedMemoryError(
            f"/proc/{reply.pid}/fd/{reply.fd} does not start with a shardserve segment header"
        )
    return header


def _map_file(reply: pb.OpenShardResponse, size: int) -> torch.Tensor:
    """The first `size` bytes of the memfd the reply names, mapped read-only as uint8."""
    path = f"/proc/{reply.pid}/fd/{reply.fd}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise SharedMemoryError(
            f"cannot open the shard's shared memory {path}: {err.strerror}"
        ) from None
    try:
        stat = os.fstat(fd)
        if (stat.st_ino, stat.st_dev) != (reply.inode, reply.device_id) or stat.st_size < size:
            raise SharedMemoryError(
                f"{path} is not the segment the rank described (another process or "
                f"another pid namespace)"
            )
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    except OSError as err:
        raise SharedMemoryError(f"cannot map {path}: {err}") from None
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only ever read it
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _map_cuda(reply: pb.OpenShardResponse) -> torch.Tensor:
    """Open the CUDA IPC handle of a CUDA shard: the shard's bytes as a uint8 CUDA tensor (no copy)."""
    h = reply.cuda
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
        raise SharedMemoryError(f"cannot open the CUDA IPC handle of the shard: {err}") from None
    dtype = dtype_from_wire(reply.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}")
    flat.set_(storage, h.tensor_offset * itemsize, (reply.nbytes,), (1,))
    return flat
