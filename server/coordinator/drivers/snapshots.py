"""Snapshots: many tensors of one prefix committed in one catalog transaction (state dicts of SPMD jobs).

CreateSnapshot records every tensor PENDING under "PREFIX@NUMBER/KEY" and
allocates it on its ranks; the job's ranks write their own shards; CommitSnapshot
promotes every tensor on its ranks, then marks all of them READY and records the
snapshot in one transaction, which also removes the snapshots of the prefix
beyond the newest `keep` (freed on their ranks once the commit has answered:
server/coordinator/drivers/deferred_drops.py). A snapshot never committed stays invisible: it is
aborted by its writer, or its tensors are reaped as any pending put.

A delta put's snapshot (SnapshotOrder.delta_of) repeats the keys and layouts of
the prefix's newest snapshot, and each of its tensors is allocated as a copy of
that snapshot's tensor of the same key, sharing its blocks on the ranks; its
writer then sends only the bytes that changed.

A commit may also reserve the prefix's next snapshot: created as CreateSnapshot
would with the same layouts, in the memory the commit just freed (after a delta
snapshot, as a delta snapshot of the one committed). A writer that
puts the same layouts every step commits it next and skips the create. The
reservation is made before the commit answers, or after it (reserve_later:
server/coordinator/drivers/later_reservations.py), the writer then taking it with
TakeReservedSnapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import (
    InvalidArgument,
    ServiceError,
    StaleVersion,
    TensorBusy,
    TensorNotFound,
)
from shardserve.server.common.requests import check_name, check_version
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorOptions,
    TensorRecord,
    TensorState,
)
from shardserve.server.coordinator.drivers.context import DriverContext
from shardserve.server.coordinator.drivers.deferred_drops import DeferredDrops
from shardserve.server.coordinator.drivers.later_reservations import LaterReservations
from shardserve.server.coordinator.drivers.orders import (
    CommitOrder,
    SnapshotOrder,
    check_skeleton_keys,
    check_skeleton_packs,
)
from shardserve.server.coordinator.ranks.calls import versions_by_rank

log = logging.getLogger(__name__)


class Versions(Protocol):
    """What the driver needs of the tensor lifecycle: forgetting versions, and freeing them on the ranks."""

    def drop_versions(self, records: list[TensorRecord]) -> None: ...

    def drop_on_ranks(self, records: Iterable[TensorRecord]) -> None: ...


def snapshot_tensor_name(prefix: str, number: int, key: str) -> str:
    """The catalog name of tensor `key` of snapshot `number` of `prefix`."""
    return f"{prefix}@{number}/{key}"


@dataclass(frozen=True)
class CreatedSnapshot:
    """A pending snapshot and the shards its ranks opened for the writer's in-place writes (their answers,
    relayed to the writer as they are)."""

    record: SnapshotRecord
    writable: Sequence[pb.WritableShard] = ()


@dataclass(frozen=True)
class CommittedSnapshot:
    """A committed snapshot, and the prefix's next one if the commit reserved it."""

    record: SnapshotRecord
    next: CreatedSnapshot | None = None


@dataclass(frozen=True)
class _Pending:
    """A pending snapshot and the same-host writer its shards were opened for ("" for none)."""

    record: SnapshotRecord
    writer_host_id: str


class SnapshotDriver:
    """Create, commit, abort and read snapshots; pending ones are kept in memory until committed or aborted."""

    def __init__(
        self,
        context: DriverContext,
        *,
        versions: Versions,
        pending_timeout: float,
        coordinator_id: str,
    ) -> None:
        """`coordinator_id`: the id of this coordinator, marking the tensors of the snapshots it creates
        (TensorRecord.creator): no other one can commit them."""
        self.coordinator_id = coordinator_id
        self.catalog, self.registry, self.calls, self.locks = (
            context.catalog,
            context.registry,
            context.calls,
            context.locks,
        )
        self.versions = versions
        self.pending_timeout = pending_timeout
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._guard = threading.Lock()
        self.drops = DeferredDrops(versions.drop_on_ranks)
        self.later: LaterReservations[CreatedSnapshot] = LaterReservations()

    def create(
        self, order: SnapshotOrder, *, dropping: Sequence[TensorRecord] = ()
    ) -> CreatedSnapshot:
        """Record every tensor PENDING and allocate it on its ranks (opening its shards for the order's same-host
        writer, if any); all or none. `dropping`: versions removed from the catalog that the ranks drop in the
        same calls, first (their memory is the new snapshot's)."""
        prefix, keep, layouts, skeleton = order.prefix, order.keep, order.layouts, order.skeleton
        checked: set[ShardedTensorMetadata] = set()  # a state dict's tensors share a few layouts
        for key, meta in layouts.items():
            if meta in checked:
                continue
            try:
                self.registry.check_placements(meta)
            except InvalidArgument as err:
                raise InvalidArgument(f"tensors[{key!r}]: {err.message}") from None
            checked.add(meta)
        self._forget_stale()
        self.drops.wait(
            prefix
        )  # the memory of the snapshots the last commit removed, free to reuse
        bases = self._delta_bases(order) if order.delta_of else {}
        number, *versions = self.catalog.next_versions(1 + len(layouts))
        created = time.time()
        options = TensorOptions(durable=order.durable)
        entries = tuple(
            SnapshotEntry(
                key,
                TensorRecord(
                    name=snapshot_tensor_name(prefix, number, key),
                    version=version,
                    metadata=meta,
                    options=options,
                    created_unix=created,
                    creator=self.coordinator_id,
                ),
            )
            for (key, meta), version in zip(layouts.items(), versions)
        )
        snapshot = SnapshotRecord(
            prefix,
            number,
            keep,
            entries,
            created_unix=created,
            skeleton=skeleton,
            delta_of=order.delta_of,
        )
        self.catalog.add_all(snapshot.tensors(), durable=options.durable)
        try:
            writable = self.calls.allocate_many(
                _tensors_by_rank(snapshot),
                f"allocate snapshot {prefix!r} {number}",
                writer_host_id=order.writer_host_id,
                dropping=versions_by_rank(dropping, TensorRecord.ranks),
                copies={
                    entry.tensor.name: (bases[entry.key].name, bases[entry.key].version)
                    for entry in entries
                    if entry.key in bases
                },
            )
        except BaseException:
            self._drop(snapshot)
            raise
        with self._guard:
            self._pending[(prefix, number)] = _Pending(snapshot, order.writer_host_id)
        log.info(
            "snapshot %r %d: %d tensors, %d bytes pending",
            prefix,
            number,
            len(layouts),
            snapshot.nbytes,
        )
        return CreatedSnapshot(snapshot, writable)

    def _delta_bases(self, order: SnapshotOrder) -> dict[str, TensorRecord]:
        """{key: the tensor of snapshot `order.delta_of` each new tensor copies}; FAILED_PRECONDITION (the
        writer puts in full) unless that snapshot is the prefix's newest and has exactly the order's keys and
        layouts."""
        newest = self.catalog.snapshot(order.prefix, 0)
        if newest is None or newest.number != order.delta_of:
            raise StaleVersion(
                f"delta_of {order.delta_of} is not the newest snapshot of {order.prefix!r} "
                f"(newest: {newest.number if newest else 'none'}); put in full",
                metadata={"field": "delta_of"},
            )
        bases = {entry.key: entry.tensor for entry in newest.entries}
        if {key: t.metadata for key, t in bases.items()} != dict(order.layouts):
            raise StaleVersion(
                f"snapshot {order.delta_of} of {order.prefix!r} has other keys or layouts than the delta "
                f"put's; put in full",
                metadata={"field": "delta_of"},
            )
        return bases

    def commit(self, order: CommitOrder) -> CommittedSnapshot:
        """Promote every tensor on its ranks (`written_in_place`: the shards create opened for in-place writes
        count as written first), then commit all of them and the snapshot in one transaction; then reserve the
        next snapshot if the order asks (a failure to reserve leaves the commit done, with no next)."""
        prefix, number = order.prefix, order.number
        pending = self._take(prefix, number)
        snapshot = pending.record
        try:
            if order.skeleton is not None:
                if order.skeleton:
                    check_skeleton_keys(order.skeleton_keys, (e.key for e in snapshot.entries))
                    check_skeleton_packs(
                        order.skeleton, {e.key: e.tensor.metadata for e in snapshot.entries}
                    )
                snapshot = replace(snapshot, skeleton=order.skeleton)
            committed, removed = self._commit(snapshot, written_in_place=order.written_in_place)
        except BaseException:
            self._drop(snapshot)
            raise
        if not order.reserve_next:
            self.drops.submit(prefix, removed)
            return CommittedSnapshot(committed)
        reserve = lambda: self._reserve_next(committed, list(removed), pending.writer_host_id)  # noqa: E731
        if order.reserve_later:
            self.later.start(prefix, committed.number, reserve)
            return CommittedSnapshot(committed)
        return CommittedSnapshot(committed, reserve())

    def take_reserved(self, prefix: str, committed: int) -> CreatedSnapshot:
        """The snapshot the commit of `committed` reserved after it answered (reserve_later), once made;
        NOT_FOUND when none was asked for, it was taken already, or its ranks could not allocate it."""
        prefix = check_name(prefix, "prefix")
        committed = check_version(committed, "committed")
        reserved = self.later.take(prefix, committed)
        if reserved is None:
            raise TensorNotFound(
                f"no snapshot of {prefix!r} is reserved after snapshot {committed} (not asked for with "
                f"reserve_later, taken already, or not made: the coordinator's log says why)",
                metadata={"field": "committed"},
            )
        return reserved

    def _commit(
        self, snapshot: SnapshotRecord, *, written_in_place: bool
    ) -> tuple[SnapshotRecord, Sequence[TensorRecord]]:
        """Promote on the ranks, then commit in the catalog; the committed record and the versions it removed."""
        prefix, number = snapshot.prefix, snapshot.number
        with self.locks.hold(f"{prefix}@"):
            promoted = self.calls.promote_many(
                versions_by_rank(snapshot.tensors(), TensorRecord.holding_ranks),
                f"promote snapshot {prefix!r} {number}",
                finish_in_place=written_in_place,
            )
            if snapshot.delta_of:
                snapshot = snapshot.sharing(promoted.shared)
            try:
                committed, removed = self.catalog.commit_snapshot(
                    snapshot, durable=_durable(snapshot), checksums=promoted.checksums
                )
            except KeyError as err:
                raise TensorBusy(
                    f"snapshot {prefix!r} {number} lost a tensor while pending (reaped after "
                    f"{self.pending_timeout:.0f} s?): {err}"
                ) from None
        log.info(
            "committed snapshot %r %d (%d tensors)%s",
            prefix,
            number,
            len(committed.entries),
            f", dropping {len(removed)} tensors of older snapshots" if removed else "",
        )
        return committed, removed

    def _reserve_next(
        self, committed: SnapshotRecord, removed: list[TensorRecord], writer_host_id: str
    ) -> CreatedSnapshot | None:
        """The prefix's next snapshot, created with `committed`'s layouts, keep, tree and durability for the
        same writer (after a delta snapshot, a delta snapshot of it: each tensor a copy of `committed`'s, for the
        writer's next delta put), in the memory of the versions the commit `removed` (dropped by the same rank calls; a
        reshard's unfinished promotion is left to the deferred drops, which also free its replaced version).
        None (logged) when its ranks cannot allocate it: the removed versions are dropped as after any commit."""
        order = SnapshotOrder(
            committed.prefix,
            committed.keep,
            {entry.key: entry.tensor.metadata for entry in committed.entries},
            committed.skeleton,
            durable=_durable(committed),
            writer_host_id=writer_host_id,
            delta_of=committed.number if committed.delta_of else 0,
        )
        promoting = [record for record in removed if record.promoting]
        self.drops.submit(committed.prefix, promoting)
        try:
            return self.create(order, dropping=[r for r in removed if not r.promoting])
        except ServiceError as err:
            self.drops.submit(committed.prefix, removed)
            log.warning(
                "snapshot %r %d committed; its next not reserved: %s",
                committed.prefix,
                committed.number,
                err.message,
            )
            return None

    def abort(self, prefix: str, number: int) -> None:
        """Forget a pending snapshot and free its tensors."""
        self._drop(self._take(prefix, number).record)
        log.info("aborted snapshot %r %d", prefix, number)

    def get(self, prefix: str, number: int) -> SnapshotRecord:
        """Committed snapshot `number` of `prefix` (0: the newest)."""
        prefix = check_name(prefix, "prefix")
        snapshot = self.catalog.snapshot(prefix, number)
        if snapshot is None:
            kept = [s.number for s in self.catalog.snapshots(prefix)]
            which = "no snapshot" if number == 0 else f"no snapshot {number}"
            raise TensorNotFound(f"prefix {prefix!r} has {which} (kept: {kept or 'none'})")
        return snapshot

    def list(self, prefix: str) -> list[SnapshotRecord]:
        """The committed snapshots of `prefix`, oldest first."""
        return self.catalog.snapshots(check_name(prefix, "prefix"))

    # ------------------------------------------------------------ helpers

    def _take(self, prefix: str, number: int) -> _Pending:
        prefix = check_name(prefix, "prefix")
        number = check_version(number, "number")
        with self._guard:
            snapshot = self._pending.pop((prefix, number), None)
        if snapshot is None:
            raise TensorNotFound(
                f"snapshot {prefix!r} {number} is not pending (never created, committed, aborted, "
                f"or the coordinator restarted)"
            )
        return snapshot

    def _forget_stale(self) -> None:
        """Drop pending snapshots older than the pending timeout (their writers are gone)."""
        self.later.forget_older(self.pending_timeout)
        cutoff = time.time() - self.pending_timeout
        with self._guard:
            stale = [key for key, p in self._pending.items() if p.record.created_unix < cutoff]
            snapshots = [self._pending.pop(key).record for key in stale]
        for snapshot in snapshots:
            log.warning(
                "aborting snapshot %r %d: pending for more than %.0f s",
                snapshot.prefix,
                snapshot.number,
                self.pending_timeout,
            )
            self._drop(snapshot)

    def _drop(self, snapshot: SnapshotRecord) -> None:
        """Remove every pending tensor of the snapshot from the catalog and free it on its ranks."""
        pending = [
            record
            for record in (self.catalog.get(t.name, t.version) for t in snapshot.tensors())
            if record is not None and record.state is TensorState.PENDING
        ]
        try:
            self.versions.drop_versions(pending)
        except ServiceError as err:
            log.warning(
                "discarding snapshot %r %d: %s", snapshot.prefix, snapshot.number, err.message
            )


def _tensors_by_rank(snapshot: SnapshotRecord) -> dict[int, list[TensorRecord]]:
    """{rank: every snapshot tensor it holds shards of}."""
    out: dict[int, list[TensorRecord]] = {}
    for record in snapshot.tensors():
        for rank in record.holding_ranks():
            out.setdefault(rank, []).append(record)
    return out


def _durable(snapshot: SnapshotRecord) -> bool:
    """Whether the snapshot's data outlives a restart, so its catalog records must outlive a power cut."""
    return all(entry.tensor.options.durable for entry in snapshot.entries)
