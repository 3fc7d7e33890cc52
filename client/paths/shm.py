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
CUDA: reaching CUDA shards is a capability of this path (its Capabilities.devices), cached per version like
the segments. A read this path cannot serve raises SharedMemoryError; client.paths.policy
then falls back (transport="auto") or passes it on (transport="shm").
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

import grpc
import torch

from shardserve.client import counters
from shardserve.client.channel import Channel
from shardserve.client.errors import (
    ResourceExhaustedError,
    ShardServeError,
    StaleVersionError,
    error_from_rpc,
)
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths import segments
from shardserve.client.paths.copies import copy_all, copy_checked
from shardserve.client.paths.device_mapping import DeviceMapping
from shardserve.client.paths.grpc import unary
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.in_place import InPlaceUnavailable, InPlaceWriter
from shardserve.client.paths.kinds import (
    CPU_AND_CUDA,
    CPU_ONLY,
    Capabilities,
    PartRead,
    PathKind,
)
from shardserve.client.paths.mapping_cache import MappingCache
from shardserve.client.paths.registered import PAGES
from shardserve.client.paths.staging import StagingFiles
from shardserve.client.paths.writes import (
    DIRECT_BATCH_BYTES,
    ShardWrite,
    batched,
    write_request,
)
from shardserve.core.dtypes import dtype_from_wire
from shardserve.core.lent_memory import release_cuda_count
from shardserve.core.regions import local_view
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.protos.same_host import host_id

log = logging.getLogger(__name__)


class SharedMemoryError(ShardServeError):
    """The same-host path cannot serve this read (not the same host, shared memory off, mapping refused):
    PATH_UNAVAILABLE, so the fallback chain tries the next path."""

    reason = Reason.PATH_UNAVAILABLE


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


class SharedMemoryPath:
    """Reads parts and rows of shards from same-host ranks through mapped shared memory (CUDA shards through
    their IPC handles), and writes whole shards straight into shard memory or through staging memfds they read
    (a DataPath: client.paths.kinds)."""

    kind = PathKind.SHARED_MEMORY

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.host = local_host()  # (hostname, host id) of this process
        self._mappings = MappingCache()
        self._limits: dict[
            str, int
        ] = {}  # address -> the rank's max_request_bytes (from OpenShard)
        self._staging = (
            StagingFiles()
        )  # the memfds writes stage their bytes in (client/paths/staging.py)
        self.in_place = InPlaceWriter(channel, self.host[1])
        self._in_place_refused: set[str] = (
            set()
        )  # ranks that write no shard in place for this client

    @property
    def capabilities(self) -> Capabilities:
        """Mapped reads, row reads and writes in place; CUDA shards too where this process has CUDA (IPC)."""
        return Capabilities(
            devices=CPU_AND_CUDA if torch.cuda.is_available() else CPU_ONLY,
            maps_memory=True,
            row_reads=True,
            in_place_writes=True,
        )

    @property
    def in_place_host_id(self) -> str:
        """The host id under which ranks open shards for this path's writes in place."""
        return self.in_place.host_id

    def supports(self, rank: RankStatus, summary: TensorSummary | None = None) -> bool:
        """Whether `rank` may be read through shared memory: on this host, offering it."""
        return not same_host_reason(rank, self.host)

    def refusal(self, rank: RankStatus) -> ShardServeError:
        return SharedMemoryError(
            f"transport='shm' is impossible: {same_host_reason(rank, self.host)}"
        )

    def read(self, address: str, read: PartRead, cancel: Cancellation | None = None) -> None:
        """Copy the part into its region; `cancel` can stop an OpenShard call from another thread. A verified
        read of a whole host shard hashes the bytes as they land (read.checksums)."""
        summary, index = read.summary, read.index
        mapping, shard = self._open(address, summary, index, cancel)
        self.check_limit(address, read.nbytes, "offsets/sizes: the box")
        if shard is not None:
            box = summary.metadata.shards_metadata[index].box
            if read.region.device.type == "cuda" and mapping and mapping.data_offset >= 0:
                # a host segment into a CUDA region: registered once, copied at pinned speed
                PAGES.pin(mapping, mapping.flat, read_only=True)
            source = local_view(shard, box, read.part)
            sums = read.checksums if read.part == box else None
            hashed = copy_checked(read.region, source) if sums is not None else None
            if hashed is None:  # finished before _confirm looks at the header again
                copy_all([(read.region, source)])
            _confirm(mapping, summary, address)
            if sums is not None and hashed is not None:  # bytes of a version still served
                sums[index] = hashed

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
    ) -> tuple[segments.SegmentMapping | None, torch.Tensor | None]:
        """(the mapping, shard `index` at the summary's version as a read-only tensor over it; both None when the
        shard is empty): a cached mapping checked by its header, else one opened by OpenShard. The caller checks
        after reading that the mapping still serves (_confirm)."""
        key = (address, summary.name, summary.version, index)
        cached = self._mappings.get(key)
        if (
            cached is not None and cached.state is not None
        ):  # the rank keeps the header's words current
            if not cached.serves():
                self._mappings.forget(key)
                raise _stale(summary, address)
            if segments.still_held(cached):
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
        process = segments.RANK_PROCESSES.watch(
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
                    self._mappings.forget(key)
                    raise _stale(summary, address)
                mapping = cached
            elif (
                not reply.lease_id
            ):  # the rank saw our inode and kept no lease, yet this is another segment
                self._mappings.forget(key)
                # asked again without it: a mapping made under a lease
                return self._open(address, summary, index, cancel)
            else:
                earlier = self._mappings.take_segment(address, reply)
                flat, header = (
                    (earlier.flat, earlier.state) if earlier else segments.map_segment(reply)
                )
                mapping = segments.SegmentMapping(
                    process,
                    reply.inode,
                    reply.device_id,
                    flat,
                    header,
                    reply.fd,
                    generation=int(header[2]) if header is not None else 0,
                    data_offset=-1 if reply.extents else reply.data_offset,
                )
                self._mappings.remember(key, mapping)
        except segments.SegmentError as err:
            raise SharedMemoryError(str(err)) from None
        finally:
            if reply.lease_id:
                self._release(address, reply.lease_id)
        return mapping, _as_shard(mapping.flat, summary, index)

    def cached(self, name: str) -> dict[tuple[str, str, int, int], segments.SegmentMapping]:
        """The mappings this path keeps of tensor `name`'s shards, by (rank address, name, version, shard)."""
        return self._mappings.of_tensor(name)

    def host_mapping(
        self, address: str, summary: TensorSummary, index: int
    ) -> segments.HostMapping | None:
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
        return segments.HostMapping(mapping)

    def device_mapping(
        self, address: str, summary: TensorSummary, index: int
    ) -> DeviceMapping | None:
        """Shard `index` mapped on its CUDA device through its IPC handle (cached per version), for gathers on
        the GPU (client.embedding.cuda_rows); None for host shards and empty shards."""
        mapping, shard = self._open(address, summary, index)
        if shard is None or mapping is None or mapping.cuda_handle is None:
            return None
        return DeviceMapping(mapping, shard)

    def _cuda_mapping(
        self,
        key: tuple,
        cached: segments.SegmentMapping | None,
        reply: pb.OpenShardResponse,
        process: segments.RankProcess,
    ) -> segments.SegmentMapping:
        """The shard's CUDA memory: the cached mapping when the handle is the same one (opening a handle maps the
        whole allocation, milliseconds per call), else a newly opened one."""
        h = reply.cuda
        if cached is not None and cached.cuda_handle == (h.handle, h.storage_offset_bytes):
            # the rank counted one more user of its memory for this reply; we already hold one
            release_cuda_count(h)
            return cached
        flat = segments.map_cuda(reply)
        state = (
            segments.map_state_header(reply) if reply.fd else None
        )  # later reads check it instead of calling OpenShard
        mapping = segments.SegmentMapping(
            process,
            reply.inode,
            reply.device_id,
            flat,
            state,
            reply.fd,
            cuda_handle=(h.handle, h.storage_offset_bytes),
            generation=int(state[2]) if state is not None else 0,
        )
        self._mappings.remember(key, mapping)
        return mapping

    def write_shards(self, address: str, writes: Sequence[ShardWrite]) -> int:
        """Write whole shards to the same-host rank at `address`: copied straight into its shard memory
        (client/paths/in_place.py), else packed into a staging memfd that the rank reads (WriteShards with a
        shared source); returns the bytes written. SharedMemoryError when the rank can do neither (not the same
        host for it, shared memory off)."""
        if address not in self._in_place_refused:
            try:
                return self.in_place.write(address, writes)
            except InPlaceUnavailable as err:
                log.debug("writing in place to %s: %s; staging the bytes", address, err)
                if err.refused:
                    self._in_place_refused.add(address)
        return self._write_staged(address, writes)

    def _write_staged(self, address: str, writes: Sequence[ShardWrite]) -> int:
        return sum(
            self._write_staged_batch(address, batch)
            for batch in batched(writes, DIRECT_BATCH_BYTES)
        )

    def _write_staged_batch(self, address: str, writes: Sequence[ShardWrite]) -> int:
        total = sum(write.nbytes for write in writes)
        staging = self._staging.take(total)
        try:
            staging.pack(writes)
            request = write_request(writes)
            request.shared.CopyFrom(staging.source(self.host[1]))
            reply = self.channel.shard_methods(address).write_shards(
                request, timeout=self.channel.data_timeout(total), metadata=self.channel.metadata
            )
        except grpc.RpcError as err:
            staging.close()  # the rank may still be reading it: never reused
            error = error_from_rpc(err, f"rank at {address}")
            if error.reason == Reason.PATH_UNAVAILABLE:
                raise SharedMemoryError(f"rank at {address}: {err.details()}") from None
            raise error from None
        except BaseException:
            staging.close()
            raise
        self._staging.give_back(staging)
        return reply.bytes_written

    def close(self) -> None:
        """Forget every cached mapping (unmapped once no tensor uses it) and close the kept staging files."""
        self._mappings.clear()
        self._staging.close()
        self.in_place.close()

    def _open_shard(
        self, address: str, request: pb.OpenShardRequest, cancel: Cancellation | None = None
    ) -> pb.OpenShardResponse:
        counters.count("shm_opens")
        try:
            return unary(
                self.channel.shard_server(address).OpenShard,
                request,
                self.channel.timeout,
                self.channel.metadata,
                cancel,
            )
        except grpc.RpcError as err:
            error = error_from_rpc(err, f"rank at {address}")
            if error.reason in (Reason.PATH_UNAVAILABLE, Reason.INTERNAL):
                raise SharedMemoryError(f"rank at {address}: {err.details()}") from None
            raise error from None

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


def _confirm(mapping: segments.SegmentMapping | None, summary: TensorSummary, address: str) -> None:
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
