"""Leases on a rank's versions: the reads and changes in flight, each holding its version until it ends.

A served version is leased for reads (a box of it, an OpenShard, a lookup, a copy, a checkpoint save); a
pending one for changes of one local shard (a write stream, a row rewrite), which count in its ShardProgress
so that no promote serves a shard half changed. A dropped version keeps its memory until its last lease
ends; then it is freed (server/rank/version_table.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from shardserve.core.dtypes import dtype_name
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.regions import local_view
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.rank.errors import InvalidArgument, InvalidState, RequestTooLarge, TensorBusy
from shardserve.server.rank.shard_memory import ShardMemory
from shardserve.server.rank.shard_writer import ShardWriter, checked_box
from shardserve.server.rank.shared_memory import Segment
from shardserve.server.rank.version_table import StoredVersion, VersionState, VersionTable

HASHED_AS_WRITTEN_BYTES = 1 << 20
"""A shard written by bytes (WriteShard, WriteShards, the bulk port) up to this size is hashed as soon as it is
whole, while its bytes are in cache: its promote then finds every checksum known and serves at once, without
leasing the version and handing each shard to the hashing pool (for a batch of small shards, most of the
promote's cost). Larger shards are hashed by the promote, in parallel on the pool."""


@dataclass(frozen=True)
class InPlace:
    """A pending shard handed to a same-host writer: the Segment to find it by (for a CUDA shard its header-only
    one), whether its writes are sealed, and the CUDA shard whose IPC handle the writer opens (None for a shard
    in shared memory)."""

    segment: Segment
    sealed: bool
    cuda: torch.Tensor | None = None


class VersionLeases:
    """Reads and changes of one rank's versions under leases; shares the store's lock and version table."""

    def __init__(
        self,
        lock: threading.Lock,
        versions: VersionTable,
        memory: ShardMemory,
        *,
        max_request_bytes: int = 0,
    ) -> None:
        if max_request_bytes < 0:
            raise ValueError(
                f"max_request_bytes must be >= 0 (0 = unlimited), got {max_request_bytes}"
            )
        self.rank = versions.rank
        self.max_request_bytes = max_request_bytes
        self._lock = lock
        self._versions = versions
        self._memory = memory

    @contextmanager
    def lease(self, name: str, version: int, served: bool = True) -> Iterator[StoredVersion]:
        """Lease (name, version), served (or, with served=False, pending): reads that go on outside a stream
        (OpenShard, lookups, copies, checkpoint jobs)."""
        record = self._take(name, version, served=served)
        with self._held(record):
            yield record

    @contextmanager
    def read(
        self,
        name: str,
        version: int,
        shard_index: int,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> Iterator[torch.Tensor]:
        """Lease a served version and yield the global box as a view of its local shard."""
        with self.lease(name, version) as record:
            yield self.box_of(record, shard_index, offsets, sizes)

    @contextmanager
    def reads(self) -> Iterator[LeasedReads]:
        """Leases for a batch of reads (ReadRegions): each served version leased at its first box and held
        until the batch ends, so that many small boxes pay one lease per version, not one per box."""
        batch = LeasedReads(self._take, self.box_of)
        try:
            yield batch
        finally:
            self._release(batch.records())

    def box_of(
        self,
        record: StoredVersion,
        shard_index: int,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> torch.Tensor:
        """The global box of a leased version as a view of its local shard (InvalidArgument naming
        offsets/sizes when it is not inside the shard, RequestTooLarge over max_request_bytes)."""
        shard_tensor = record.local_shard(shard_index, self.rank)
        shard_box = record.metadata.shards_metadata[shard_index].box
        whole = offsets == shard_box.offsets and sizes == shard_box.sizes  # checked as it is
        wanted = shard_box if whole else checked_box(shard_box, offsets, sizes)
        nbytes = wanted.numel() * record.metadata.tensor_properties.itemsize
        if self.max_request_bytes and nbytes > self.max_request_bytes:
            raise RequestTooLarge(
                f"offsets/sizes: the box is {nbytes} bytes, over this rank's "
                f"max_request_bytes {self.max_request_bytes}",
                metadata={"tensor": record.name, "rank": self.rank, "field": "sizes"},
            )
        return local_view(shard_tensor, shard_box, wanted)

    def _take(self, name: str, version: int, *, served: bool = True) -> StoredVersion:
        """(name, version) leased: served (0: the newest), or with served=False pending; the caller releases it
        (_release)."""
        with self._lock:
            if served:
                record = self._versions.served(name, version)
            else:
                record = self._versions.pending(name, version)
            self._versions.lease(record)
        return record

    def _release(self, records: list[StoredVersion]) -> None:
        """End one lease of each of `records`, freeing a dropped version whose last lease it was."""
        if not records:
            return
        with self._lock:
            for record in records:
                if self._versions.unlease(record):
                    self._memory.reclaim(record)

    @contextmanager
    def write(
        self, name: str, version: int, shard_index: int, dtype: torch.dtype, nbytes: int
    ) -> Iterator[ShardWriter]:
        """Lease a pending version and yield a writer that fills shard `shard_index` in order."""

        def check(record: StoredVersion) -> None:
            self._check_whole_write(record, shard_index, dtype, nbytes)

        record, shard_tensor, _ = self._open_change(name, version, shard_index, check)
        with self._changing(record, shard_index) as done:
            writer = ShardWriter(shard_tensor, nbytes)
            yield writer
            if writer.written != nbytes:
                raise InvalidArgument(
                    f"the stream ended after {writer.written} of {nbytes} bytes of "
                    f"shard {shard_index}",
                    metadata={"tensor": name},
                )
            # kept before the shard counts as written, so a promote never finds the shard whole without it
            checksum = writer.checksum() if nbytes <= HASHED_AS_WRITTEN_BYTES else None
            if checksum is not None:
                with self._lock:
                    record.checksums[shard_index] = checksum
            done(True)

    def open_in_place(
        self,
        name: str,
        version: int,
        shard_index: int,
        dtype: torch.dtype,
        nbytes: int,
        *,
        fresh: bool = False,
    ) -> InPlace | None:
        """Hand pending shard `shard_index` to a same-host writer that fills its memory itself: its shared-memory
        Segment and whether its writes are sealed (SharedMemory.writable_segment), or, for a CUDA shard, the
        shard itself and its header-only segment (the writer opens its CUDA IPC handle); None when it is in
        neither. `fresh`: a sealed segment is first replaced by fresh memory (ShardMemory.renewed; a shard being
        written is refused before that). The shard stays torn until `finish_in_place`."""
        with self._lock:
            record = self._versions.pending(name, version)
            shard = record.local_shard(shard_index, self.rank)
            self._check_whole_write(record, shard_index, dtype, nbytes)
            if fresh:
                shard = self._renew(record, shard_index, shard)
            found = self._in_place(record, shard)
            if found is not None:
                self._hand_out(record, shard_index, shard)
        return found

    def _renew(self, record: StoredVersion, shard_index: int, shard: torch.Tensor) -> torch.Tensor:
        """The shard of `record` at `shard_index`, moved into fresh memory when its segment is sealed (under
        the lock, checked idle)."""
        renewed = self._memory.renewed(shard)
        if renewed is None:
            return shard
        record.shards[shard_index] = renewed
        return renewed

    def _hand_out(self, record: StoredVersion, shard_index: int, shard: torch.Tensor) -> None:
        """(under the lock) Count pending shard `shard_index` as handed to an in-place writer, whose bytes replace
        any hashed before: the checksum taken of bytes sent to it and the one a former writer left beside it are
        forgotten."""
        record.progress.open_in_place(shard_index)
        record.checksums.pop(shard_index, None)
        self._memory.shared.clear_left_checksum(shard)

    def _in_place(self, record: StoredVersion, shard: torch.Tensor) -> InPlace | None:
        """Where a writer fills pending `shard` in place (under the lock); None when it cannot."""
        shared = self._memory.shared
        if shard.device.type == "cuda":
            return InPlace(shared.attach_header(shard, **_header_state(record)), False, shard)
        found = shared.writable_segment(shard)
        return InPlace(*found) if found is not None else None

    def open_allocated_in_place(self, name: str, version: int) -> list[tuple[int, Segment, bool]]:
        """Hand every local shard of the newly allocated pending (name, version) that lies in shared memory to
        a same-host writer, as open_in_place does one: (shard index, Segment, sealed) each."""
        opened = []
        with self._lock:
            record = self._versions.pending(name, version)
            for shard_index, shard in sorted(record.shards.items()):
                found = self._memory.shared.writable_segment(
                    shard
                )  # CUDA shards: OpenShardsForWrite
                if found is not None:
                    self._hand_out(record, shard_index, shard)
                    opened.append((shard_index, *found))
        return opened

    def finish_all_in_place(self, name: str, version: int) -> int:
        """Count every shard of pending (name, version) still handed to an in-place writer as written (its
        writers said they filled them all); how many there were."""
        with self._lock:
            record = self._versions.get(name, version)
            if not record.state.is_pending:
                return 0  # promoted already: a commit retried
            handed = sorted(record.progress.in_place)
            for shard_index in handed:
                record.progress.finish_in_place(shard_index)
                self._take_left_checksum(record, shard_index)
        return len(handed)

    def finish_in_place(
        self, name: str, version: int, shard_index: int, dtype: torch.dtype, nbytes: int
    ) -> None:
        """Count pending shard `shard_index`, filled in place by the writer it was handed to, as written."""
        with self._lock:
            record = self._versions.pending(name, version)
            record.local_shard(shard_index, self.rank)
            self._check_whole_write(record, shard_index, dtype, nbytes)
            if not record.progress.finish_in_place(shard_index):
                raise InvalidArgument(
                    f"shard_index {shard_index} of {name!r} version {version} was not opened for an "
                    f"in-place write on rank {self.rank} (OpenShardsForWrite), or bytes were sent for "
                    f"it since",
                    metadata={"tensor": name, "field": "shard_index"},
                )
            self._take_left_checksum(record, shard_index)

    def _take_left_checksum(self, record: StoredVersion, shard_index: int) -> None:
        """Keep the checksum the in-place writer of a shard it filled left beside it (under the lock), so the
        promote need not hash it; none left: the promote hashes it."""
        checksum = self._memory.shared.left_checksum(record.shards[shard_index])
        if checksum is not None:
            record.checksums[shard_index] = checksum

    def _check_whole_write(
        self, record: StoredVersion, shard_index: int, dtype: torch.dtype, nbytes: int
    ) -> None:
        """A write of all of shard `shard_index` in `dtype`, `nbytes` long, must match the version's layout, not
        be a row update's copy, and not race another write of it."""
        meta, name, version = record.metadata, record.name, record.version
        if dtype != meta.dtype:
            raise InvalidArgument(
                f"header.dtype {dtype_name(dtype)} does not match tensor {name!r}'s "
                f"dtype {dtype_name(meta.dtype)}",
                metadata={"tensor": name, "field": "header.dtype"},
            )
        if nbytes != meta.shard_nbytes(shard_index):
            raise InvalidArgument(
                f"header.nbytes {nbytes} does not match shard {shard_index}'s size "
                f"of {meta.shard_nbytes(shard_index)} bytes",
                metadata={"tensor": name, "field": "header.nbytes"},
            )
        shard = record.shards.get(shard_index)
        if shard is not None and self._memory.blocks.is_composed(shard):
            raise InvalidState(
                f"shard_index {shard_index} of {name!r} version {version} is a row "
                f"update's copy; change its rows with WriteRows",
                metadata={"tensor": name, "field": "shard_index"},
            )
        if record.progress.is_changing(shard_index):  # two streams would interleave their bytes
            raise TensorBusy(
                f"shard_index {shard_index} of {name!r} version {version} is being written by "
                f"another stream on rank {self.rank}; write each shard once",
                metadata={"tensor": name, "rank": self.rank},
            )

    @contextmanager
    def rewrite(
        self,
        name: str,
        version: int,
        shard_index: int,
        rows: torch.Tensor | None = None,
        *,
        byte_ranges: list[tuple[int, int]] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Lease a pending version and yield local shard `shard_index` to change in place; the shard counts as
        not fully written meanwhile, so a promote cannot serve it half changed. A version made by a row
        update or a delta put shares its blocks with its source: only the blocks holding local `rows` (dim 0)
        of it, or its `byte_ranges` [start, stop), may be changed, and they get copies of their own first."""
        record, shard, was_complete = self._open_change(name, version, shard_index)
        with self._changing(record, shard_index) as done:
            if self._memory.blocks.is_composed(shard):
                if byte_ranges is not None:
                    self._memory.own_bytes(shard, byte_ranges)
                else:
                    self._memory.own_rows(shard, rows)
            yield shard
            done(was_complete)

    def shard_of(self, record: StoredVersion, shard_index: int) -> torch.Tensor:
        """The local tensor of shard `shard_index` of a leased version (InvalidArgument if not held here)."""
        return record.local_shard(shard_index, self.rank)

    def shared_segment(self, record: StoredVersion, shard_index: int) -> Segment | None:
        """The shared-memory Segment of a leased served shard, moving the shard into shared memory first
        when it was built elsewhere (a reshard, a checkpoint load); None when shared memory is off."""
        shared = self._memory.shared
        shard = record.local_shard(shard_index, self.rank)
        segment = shared.segment_of(shard)
        if segment is not None or not shared.enabled or shard.device.type != "cpu":
            return segment
        if self._memory.blocks.is_composed(shard):
            return None
        copy = shared.export(shard)  # same bytes; the served version is immutable
        with self._lock:
            if record.shards.get(shard_index) is shard:
                record.shards[shard_index] = copy
                shared.mark([copy], **_header_state(record))
            current = record.shards.get(shard_index)
        return shared.segment_of(current) if current is not None else None

    def state_header(
        self, record: StoredVersion, shard_index: int, *, slot: bool = False
    ) -> Segment:
        """The header-only segment whose state word tells same-host clients whether a leased served shard whose
        bytes live elsewhere (CUDA memory, shared blocks) is still served (server/rank/shared_memory.py
        SharedMemory.attach_header); with `slot`, a slot of a header file (attach_slot_header) unless the shard
        has a header already."""
        shard = record.local_shard(shard_index, self.rank)
        shared = self._memory.shared
        attach = shared.attach_slot_header if slot else shared.attach_header
        with self._lock:
            return attach(shard, **_header_state(record))

    @contextmanager
    def served_shards(
        self, name: str, version: int
    ) -> Iterator[tuple[ShardedTensorMetadata, TensorOptions, dict[int, torch.Tensor]]]:
        """A served version's layout, options and shards, leased meanwhile (what persistence snapshots)."""
        with self.lease(name, version) as record:
            yield record.metadata, record.options, dict(record.shards)

    def _open_change(
        self,
        name: str,
        version: int,
        shard_index: int,
        check: Callable[[StoredVersion], None] = lambda record: None,
    ) -> tuple[StoredVersion, torch.Tensor, bool]:
        """Lease pending (name, version) for a change of local shard `shard_index`, after `check(record)`, and
        count the change, all in one step under the lock so no promote comes in between. Returns (the record,
        whose lease and change the caller ends with _changing; the shard; whether it was complete)."""
        with self._lock:
            record = self._versions.pending(name, version)
            shard = record.local_shard(shard_index, self.rank)
            check(record)
            was_complete = record.progress.open_change(shard_index)
            record.checksums.pop(shard_index, None)  # its bytes change: the promote hashes them
            self._versions.lease(record)
        return record, shard, was_complete

    @contextmanager
    def _changing(
        self, record: StoredVersion, shard_index: int
    ) -> Iterator[Callable[[bool], None]]:
        """End the lease and change opened by _open_change on exit; yields `done(complete)`, which the caller
        calls once its change is whole (`complete`: the shard then counts as fully written); a change that
        ends without it leaves the shard torn."""
        outcome: list[bool] = []
        with self._held(record):
            try:
                yield outcome.append
            finally:
                with self._lock:
                    record.progress.close_change(shard_index, outcome[0] if outcome else None)

    @contextmanager
    def _held(self, record: StoredVersion) -> Iterator[StoredVersion]:
        """End a lease taken under the lock on exit, freeing a dropped version whose last lease it was."""
        try:
            yield record
        finally:
            self._release([record])


class LeasedReads:
    """The leases of one batch of reads: `box` leases a (name, version) the first time the batch names it (by
    `take`) and keeps it until VersionLeases.reads ends the batch."""

    def __init__(
        self,
        take: Callable[[str, int], StoredVersion],
        box_of: Callable[[StoredVersion, int, tuple[int, ...], tuple[int, ...]], torch.Tensor],
    ) -> None:
        self._take, self._box_of = take, box_of
        self._held: dict[tuple[str, int], StoredVersion] = {}

    def box(
        self,
        name: str,
        version: int,
        shard_index: int,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> torch.Tensor:
        """The global box of served (name, version) (0: the newest) as a view of its local shard, valid until
        the batch ends."""
        record = self._held.get((name, version))
        if record is None:
            record = self._held[(name, version)] = self._take(name, version)
        return self._box_of(record, shard_index, offsets, sizes)

    def records(self) -> list[StoredVersion]:
        """The versions this batch leased, once each."""
        return list(self._held.values())


def _header_state(record: StoredVersion) -> dict[str, bool]:
    """The state word same-host readers see for a leased version: served, and replaced when graced."""
    return {
        "served": record.state.is_served,
        "replaced": record.state is VersionState.GRACED,
    }
