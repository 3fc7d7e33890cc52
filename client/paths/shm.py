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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch

from shardserve.client.channel import Channel
from shardserve.client.errors import (
    ResourceExhaustedError,
    ShardServeError,
    error_from_rpc,
)
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths import segments
from shardserve.client.paths.copies import (
    copy_checked,
    copy_tensor,
    cuda_devices,
    synchronize,
)
from shardserve.client.paths.device_mapping import DeviceMapping
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.in_place import InPlaceUnavailable, InPlaceWriter
from shardserve.client.paths.kinds import (
    CPU_AND_CUDA,
    CPU_ONLY,
    Capabilities,
    PartRead,
    PathKind,
)
from shardserve.client.paths.registered import PAGES
from shardserve.client.paths.shard_opener import ShardOpener, SharedMemoryError, stale
from shardserve.client.paths.staging import StagingFile, StagingFiles
from shardserve.client.paths.writes import (
    DIRECT_BATCH_BYTES,
    ShardWrite,
    batched,
    write_request,
)
from shardserve.core.regions import local_view
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.protos.same_host import host_id

log = logging.getLogger(__name__)


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
        self.opener = ShardOpener(channel)
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
        landing = self.start_read(address, read, cancel)
        if landing is not None:
            synchronize(landing.devices)
            landing.confirm()

    def read_many(self, address: str, reads: Sequence[PartRead]) -> set[int]:
        """Read many parts of host shards of the same-host rank at `address` one after another on this thread: no
        hand-off to a pool thread per part (each hand-off waits for the GIL) and no path choice per part. Copies
        that touch a CUDA device are all queued before any is waited for, so the device copies one part while
        this thread opens the next; each part is confirmed once every copy landed. The caller opens the shards
        first in one call (open_all); one not open yet is opened by its read. Returns the positions in `reads` of
        the parts not read; the caller reads those by themselves, whose fallbacks or errors then say why."""
        failed = set()
        landings: list[tuple[int, Landing]] = []
        for position, read in enumerate(reads):
            try:
                landing = self.start_read(address, read)
            except ShardServeError:
                failed.add(position)
                continue
            if landing is not None:
                landings.append((position, landing))
        synchronize({device for _, landing in landings for device in landing.devices})
        for position, landing in landings:
            try:
                landing.confirm()
            except ShardServeError:
                failed.add(position)
        return failed

    def start_read(
        self, address: str, read: PartRead, cancel: Cancellation | None = None
    ) -> Landing | None:
        """Open the part's shard and queue its copy into the region (done at once unless a CUDA device takes
        part); the Landing to wait for and confirm, or None when the shard holds no bytes. read() and read_many()
        read every part through this."""
        summary, index = read.summary, read.index
        mapping, shard = self.opener.open(address, summary, index, cancel)
        self.check_limit(address, read.nbytes, "offsets/sizes: the box")
        if shard is None:
            return None
        box = summary.metadata.shards_metadata[index].box
        if read.region.device.type == "cuda" and mapping and mapping.data_offset >= 0:
            # a host segment into a CUDA region: registered once, copied at pinned speed
            PAGES.pin(mapping, mapping.flat, read_only=True)
        source = local_view(shard, box, read.part)
        sums = read.checksums if read.part == box else None
        hashed = copy_checked(read.region, source) if sums is not None else None
        devices = cuda_devices(read.region, source) if hashed is None else set()
        if hashed is None:
            copy_tensor(read.region, source, non_blocking=bool(devices))
        return Landing(address, read, mapping, source, devices, hashed)

    def read_rows(
        self, address: str, summary: TensorSummary, index: int, local_rows: torch.Tensor
    ) -> torch.Tensor:
        """Rows `local_rows` of shard `index` of a 2-D table, as a CPU tensor [len(local_rows), shard columns]."""
        mapping, shard = self.opener.open(address, summary, index)
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
        return self.opener.limit(address)

    def open_all(self, address: str, shards: Sequence[tuple[TensorSummary, int]]) -> int:
        """Open many shards of the same-host rank at `address` at once (ShardOpener.open_all): a reader about to
        read them saves a call per shard; returns how many were opened."""
        return self.opener.open_all(address, shards)

    def check_limit(self, address: str, nbytes: int, what: str) -> None:
        """The rank's max_request_bytes holds for mapped reads too, as it does over gRPC."""
        limit = self.opener.limit(address)
        if limit and nbytes > limit:
            raise ResourceExhaustedError(
                f"{what} is {nbytes} bytes, over the max_request_bytes "
                f"{limit} of the rank at {address}",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )

    def cached(self, name: str) -> dict[tuple[str, str, int, int], segments.SegmentMapping]:
        """The mappings this path keeps of tensor `name`'s shards, by (rank address, name, version, shard)."""
        return self.opener.mappings.of_tensor(name)

    def host_mapping(
        self, address: str, summary: TensorSummary, index: int
    ) -> segments.HostMapping | None:
        """Shard `index` mapped from host shared memory with its header state, for callers that check the state
        themselves on every read (client.embedding.mapped_rows); None for CUDA shards, empty shards and header-less
        segments."""
        mapping, shard = self.opener.open(address, summary, index)
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
        mapping, shard = self.opener.open(address, summary, index)
        if shard is None or mapping is None or mapping.cuda_handle is None:
            return None
        return DeviceMapping(mapping, shard)

    def write_shards(self, address: str, writes: Sequence[ShardWrite]) -> int:
        """Write whole shards to the same-host rank at `address`: copied straight into its shard memory
        (client/paths/in_place.py), else (the batch, or its shards in memory this writer cannot map) packed into
        a staging memfd that the rank reads (WriteShards with a shared source); returns the bytes written.
        SharedMemoryError when the rank can do neither (not the same host for it, shared memory off)."""
        written, left = 0, writes
        if address not in self._in_place_refused:
            try:
                written, left = self.in_place.write(address, writes)
            except InPlaceUnavailable as err:
                log.debug("writing in place to %s: %s; staging the bytes", address, err)
                if err.refused:
                    self._in_place_refused.add(address)
        if left:
            written += self._write_staged(address, left)
        return written

    def _write_staged(self, address: str, writes: Sequence[ShardWrite]) -> int:
        return sum(
            self._write_staged_batch(address, batch)
            for batch in batched(writes, DIRECT_BATCH_BYTES)
        )

    def _write_staged_batch(self, address: str, writes: Sequence[ShardWrite]) -> int:
        def call(source: pb.SharedMemorySource, timeout: float) -> int:
            request = write_request(writes)
            request.shared.CopyFrom(source)
            reply = self.channel.shard_methods(address).write_shards(
                request, timeout=timeout, metadata=self.channel.metadata
            )
            return reply.bytes_written

        total = sum(write.nbytes for write in writes)
        return self._staged(address, total, lambda staging: staging.pack(writes), call)

    def write_bytes(
        self, address: str, request: pb.WriteBytesRequest, pieces: Sequence[torch.Tensor]
    ) -> int:
        """WriteBytes to the same-host rank at `address` with the ranges' bytes (`pieces`: flat uint8 CPU tensors,
        one per range) packed into a staging memfd the rank reads; returns the bytes written. SharedMemoryError
        when the rank cannot read it (not the same host for it, shared memory off)."""

        def call(source: pb.SharedMemorySource, timeout: float) -> int:
            staged = pb.WriteBytesRequest()
            staged.CopyFrom(request)
            staged.shared.CopyFrom(source)
            reply = self.channel.shard_server(address).WriteBytes(
                staged, timeout=timeout, metadata=self.channel.metadata
            )
            return reply.bytes_written

        total = sum(piece.numel() for piece in pieces)
        return self._staged(address, total, lambda staging: staging.pack_bytes(pieces), call)

    def _staged(
        self,
        address: str,
        total: int,
        pack: Callable[[StagingFile], None],
        call: Callable[[pb.SharedMemorySource, float], int],
    ) -> int:
        """call(source, timeout) with `total` bytes packed into a staging file by pack(file); the file is kept for
        the next write once the rank answered, else closed (the rank may still read it)."""
        staging = self._staging.take(total)
        try:
            pack(staging)
            written = call(staging.source(self.host[1]), self.channel.data_timeout(total))
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
        return written

    def close(self) -> None:
        """Forget every cached mapping (unmapped once no tensor uses it) and close the kept staging files."""
        self.opener.mappings.clear()
        self._staging.close()
        self.in_place.close()


@dataclass(frozen=True)
class Landing:
    """A part's copy out of a mapped shard, queued: the devices to wait for, then the confirmation that the
    segment still held that version while it was read (`source` keeps the mapped bytes alive until then)."""

    address: str
    read: PartRead
    mapping: segments.SegmentMapping | None
    source: torch.Tensor
    devices: set[torch.device]
    hashed: int | None  # the checksum of a verified whole-shard read's bytes, hashed as they landed

    def confirm(self) -> None:
        """StaleVersionError if the segment was recycled meanwhile; else the verified read's checksum kept.
        Every copy of the part has landed (the caller waited for `devices`)."""
        _confirm(self.mapping, self.read.summary, self.address)
        sums = self.read.checksums
        if sums is not None and self.hashed is not None:  # bytes of a version still served
            sums[self.read.index] = self.hashed


def _confirm(mapping: segments.SegmentMapping | None, summary: TensorSummary, address: str) -> None:
    """After a read: StaleVersionError if the segment was recycled for another version meanwhile (the read may
    have seen its new bytes; the caller refreshes and reads again)."""
    if mapping is not None and not mapping.readable():
        raise stale(summary, address)
