"""The `Catalog` interface: where the coordinator keeps tensors, versions and snapshots, whatever the store.

The drivers see only this interface and the records (server/coordinator/catalog/records.py); the embedded
SQLite store (server/coordinator/catalog/sqlite.py) implements it, and a networked store can replace it for a
coordinator that outlives its host.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

from shardserve.server.coordinator.catalog.leadership import LEASE_DURATION_S, Leadership
from shardserve.server.coordinator.catalog.records import (
    CatalogContents,
    PlacedVersion,
    ShardChecksums,
    SnapshotRecord,
    TensorRecord,
)


class Catalog(abc.ABC):
    """Where the coordinator keeps tensors, versions and snapshots."""

    @abc.abstractmethod
    def next_versions(self, count: int) -> list[int]:
        """`count` version numbers never handed out before, increasing (the counter survives restarts)."""

    @abc.abstractmethod
    def add_all(self, records: list[TensorRecord], *, durable: bool = True) -> None:
        """Record new (name, version) rows in one transaction: all of them or, on an error, none (`durable`
        False: of data that does not outlive a restart, so the commit need not wait for the disk)."""

    def add(self, record: TensorRecord) -> None:
        """Record a new (name, version) row in the state `record.state`."""
        self.add_all([record], durable=record.options.durable)

    @abc.abstractmethod
    def commit_all(
        self,
        versions: list[tuple[str, int]],
        *,
        durable: bool = True,
        checksums: ShardChecksums | None = None,
    ) -> list[tuple[TensorRecord, list[TensorRecord]]]:
        """commit() of several (name, version) pairs in one transaction: all of them or, on an error, none."""

    def commit(
        self,
        name: str,
        version: int,
        *,
        durable: bool = True,
        checksums: dict[int, int] | None = None,
    ) -> tuple[TensorRecord, list[TensorRecord]]:
        """In one transaction: mark (name, version) READY with its shards' `checksums` (as its ranks' promote
        answered them), remove older READY rows; return (new, removed). KeyError when the row is not in the
        catalog."""
        sums = {(name, version): checksums} if checksums else None
        return self.commit_all([(name, version)], durable=durable, checksums=sums)[0]

    @abc.abstractmethod
    def remove(self, name: str, version: int = 0) -> list[TensorRecord]:
        """Remove one version (0 = every version) of `name`; return the removed rows."""

    @abc.abstractmethod
    def get(self, name: str, version: int) -> TensorRecord | None:
        """The row (name, version) in any state, or None."""

    @abc.abstractmethod
    def versions(self, name: str) -> list[TensorRecord]:
        """Every row of `name`, oldest version first."""

    @abc.abstractmethod
    def update(self, record: TensorRecord) -> None:
        """Replace the existing row (record.name, record.version), state included; KeyError when absent."""

    def ready(self, name: str) -> TensorRecord | None:
        """The READY version of `name`, or None."""
        ready = [record for record in self.versions(name) if record.ready]
        return ready[-1] if ready else None

    @abc.abstractmethod
    def commit_snapshot(
        self,
        snapshot: SnapshotRecord,
        *,
        durable: bool = True,
        checksums: ShardChecksums | None = None,
    ) -> tuple[SnapshotRecord, Sequence[TensorRecord]]:
        """In one transaction: every tensor of `snapshot` READY with its shards' `checksums`, the snapshot
        recorded, and the snapshots of its prefix beyond the newest `snapshot.keep` removed with their tensors;
        return (committed, removed rows, which may be decoded only when first read)."""

    @abc.abstractmethod
    def snapshots(self, prefix: str) -> list[SnapshotRecord]:
        """The committed snapshots of `prefix`, oldest first."""

    def snapshot(self, prefix: str, number: int = 0) -> SnapshotRecord | None:
        """Committed snapshot `number` of `prefix` (0: the newest), or None."""
        kept = self.snapshots(prefix)
        if number == 0:
            return kept[-1] if kept else None
        return next((s for s in kept if s.number == number), None)

    @abc.abstractmethod
    def pending(self, created_before: float | None = None) -> list[TensorRecord]:
        """PENDING rows only (puts and snapshots not committed yet), oldest version first; with
        `created_before` (Unix seconds), only those created earlier (the ones a reaper aborts)."""

    @abc.abstractmethod
    def promoting(self) -> list[TensorRecord]:
        """READY rows whose promotion on the ranks is unfinished (a reshard's commit), oldest version first."""

    @abc.abstractmethod
    def contents(self) -> CatalogContents:
        """Every tensor row, every snapshot and the version counter, read in one transaction."""

    @abc.abstractmethod
    def restore(self, contents: CatalogContents, *, replace: bool = False) -> None:
        """In one transaction: `contents`' rows and snapshots written, and the version counter raised to
        theirs (never lowered: numbers only grow). ValueError naming what is there when the catalog holds
        rows or snapshots, unless `replace`: then they are removed first."""

    @abc.abstractmethod
    def leadership(self, lease_duration: float = LEASE_DURATION_S) -> Leadership:
        """The lease of this catalog's database, taken and renewed for `lease_duration` seconds: which
        coordinator leads over it, with which term (server/coordinator/catalog/leadership.py)."""

    @abc.abstractmethod
    def fence(self, term: int | None) -> None:
        """Make every later write (versions handed out from the database included) check, in its own
        transaction, that the lease still holds `term` and has not run out, else raise NotLeader and change
        nothing (None: writes check nothing, for a catalog with one coordinator)."""

    # The queries of the background work. Each defaults to a scan of every row; a store that can index them
    # (the SQLite one does) answers in the time of the rows found, which the coordinator relies on at scale.

    def holding(self, ranks: Iterable[int]) -> list[TensorRecord]:
        """Every row (any state) with a shard placed on one of `ranks`, oldest version first: what the reconcile of
        a rank and the repair of dead ranks read."""
        wanted = set(ranks)
        rows = [r for r in self.list(include_pending=True) if wanted & set(r.metadata.ranks())]
        return sorted(rows, key=lambda r: r.version)

    def placed_versions(self, ranks: Iterable[int]) -> list[PlacedVersion]:
        """The name, version and state of every row `holding(ranks)` returns, in its order."""
        return [PlacedVersion(r.name, r.version, r.state) for r in self.holding(ranks)]

    def placed_ranks(self) -> set[int]:
        """Every rank some row places a shard on."""
        return {rank for r in self.list(include_pending=True) for rank in r.metadata.ranks()}

    def with_lost_copies(self) -> list[TensorRecord]:
        """READY rows with copies a rank lost (non-empty lost_shards), oldest version first."""
        return sorted((r for r in self.list() if r.lost_shards), key=lambda r: r.version)

    def close(self) -> None:
        """Release resources."""

    # defined last: below it, `list` in this class body would name the method, not the builtin
    @abc.abstractmethod
    def list(self, include_pending: bool = False) -> list[TensorRecord]:
        """READY rows (and PENDING ones when asked), by name then version."""
