"""The coordinator's tensor catalog: a small interface and its SQLite implementation.

Rows are (name, version) with a state (PENDING or READY) and the TensorInfo
as serialized protobuf bytes (never pickle). Versions come from one counter
over the whole catalog that only grows. Keeping the catalog behind `Catalog`
lets a networked store replace SQLite for a highly available coordinator.
"""

from __future__ import annotations

import abc
import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardserve.core.metadata import RemoteDevice
from shardserve.protos import shardserve_pb2 as pb

log = logging.getLogger(__name__)


class Catalog(abc.ABC):
    """Where the coordinator keeps tensors, versions and their metadata."""

    @abc.abstractmethod
    def next_version(self) -> int:
        """A version number never handed out before (the counter survives restarts)."""

    def next_versions(self, count: int) -> list[int]:
        """`count` version numbers never handed out before, increasing (one transaction where it can)."""
        return [self.next_version() for _ in range(count)]

    @abc.abstractmethod
    def add(self, info: pb.TensorInfo) -> None:
        """Record a new (name, version) row in the state `info.state`."""

    def add_all(self, infos: list[pb.TensorInfo]) -> None:
        """add() of several rows in one transaction: all of them or, on an error, none."""
        for info in infos:
            self.add(info)

    def commit(self, name: str, version: int) -> tuple[pb.TensorInfo, list[pb.TensorInfo]]:
        """In one transaction: mark (name, version) READY, remove older READY rows; return (new, removed)."""
        return self.commit_all([(name, version)])[0]

    @abc.abstractmethod
    def commit_all(
        self, versions: list[tuple[str, int]]
    ) -> list[tuple[pb.TensorInfo, list[pb.TensorInfo]]]:
        """commit() of several (name, version) pairs in one transaction: all of them or, on an error, none."""

    @abc.abstractmethod
    def remove(self, name: str, version: int = 0) -> list[pb.TensorInfo]:
        """Remove one version (0 = every version) of `name`; return the removed rows."""

    @abc.abstractmethod
    def get(self, name: str, version: int) -> pb.TensorInfo | None:
        """The row (name, version) in any state, or None."""

    @abc.abstractmethod
    def versions(self, name: str) -> list[pb.TensorInfo]:
        """Every row of `name`, oldest version first."""

    @abc.abstractmethod
    def list(self, include_pending: bool = False) -> list[pb.TensorInfo]:
        """READY rows (and PENDING ones when asked), by name then version."""

    @abc.abstractmethod
    def update(self, info: pb.TensorInfo) -> None:
        """Replace the stored TensorInfo of the existing row (info.name, info.version), state included."""

    def ready(self, name: str) -> pb.TensorInfo | None:
        """The READY version of `name`, or None."""
        ready = [info for info in self.versions(name) if info.state == pb.READY]
        return ready[-1] if ready else None

    @abc.abstractmethod
    def commit_snapshot(
        self, snapshot: pb.SnapshotInfo
    ) -> tuple[pb.SnapshotInfo, list[pb.TensorInfo]]:
        """In one transaction: every tensor of `snapshot` READY, the snapshot recorded, and the snapshots of its
        prefix beyond the newest `snapshot.keep` removed with their tensors; return (committed, removed rows)."""

    @abc.abstractmethod
    def snapshots(self, prefix: str) -> list[pb.SnapshotInfo]:
        """The committed snapshots of `prefix`, oldest first."""

    def snapshot(self, prefix: str, number: int = 0) -> pb.SnapshotInfo | None:
        """Committed snapshot `number` of `prefix` (0: the newest), or None."""
        kept = self.snapshots(prefix)
        if number == 0:
            return kept[-1] if kept else None
        return next((s for s in kept if s.number == number), None)

    def close(self) -> None:
        """Release resources."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS tensors (
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    state INTEGER NOT NULL,
    info BLOB NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    prefix TEXT NOT NULL,
    number INTEGER NOT NULL,
    info BLOB NOT NULL,
    PRIMARY KEY (prefix, number)
);
INSERT OR IGNORE INTO counters (name, value) VALUES ('version', 0);
"""


class SQLiteCatalog(Catalog):
    """The embedded default: one SQLite file under the state dir, WAL mode, one transaction per change."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(self.path), isolation_level=None, check_same_thread=False, timeout=10.0
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "PRAGMA synchronous=FULL"
        )  # NORMAL may lose the last commits to a power cut: a commit
        # the ranks acted on (an old version dropped) must survive, and catalog writes are few
        self._db.executescript(_SCHEMA)
        log.info("catalog %s: %d tensor versions", self.path, len(self.list(include_pending=True)))

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def next_version(self) -> int:
        with self._transaction() as db:
            db.execute("UPDATE counters SET value = value + 1 WHERE name = 'version'")
            return int(
                db.execute("SELECT value FROM counters WHERE name = 'version'").fetchone()[0]
            )

    def next_versions(self, count: int) -> list[int]:
        with self._transaction() as db:
            db.execute("UPDATE counters SET value = value + ? WHERE name = 'version'", (count,))
            last = int(
                db.execute("SELECT value FROM counters WHERE name = 'version'").fetchone()[0]
            )
        return list(range(last - count + 1, last + 1))

    def add(self, info: pb.TensorInfo) -> None:
        self.add_all([info])

    def add_all(self, infos: list[pb.TensorInfo]) -> None:
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO tensors (name, version, state, info) VALUES (?, ?, ?, ?)",
                [(info.name, info.version, info.state, info.SerializeToString()) for info in infos],
            )

    def commit_all(
        self, versions: list[tuple[str, int]]
    ) -> list[tuple[pb.TensorInfo, list[pb.TensorInfo]]]:
        with self._transaction() as db:
            return [_commit_in(db, name, version) for name, version in versions]

    def commit_snapshot(
        self, snapshot: pb.SnapshotInfo
    ) -> tuple[pb.SnapshotInfo, list[pb.TensorInfo]]:
        committed = pb.SnapshotInfo()
        committed.CopyFrom(snapshot)
        committed.state = pb.READY
        with self._transaction() as db:
            for entry in committed.entries:
                ready, _ = _commit_in(db, entry.tensor.name, entry.tensor.version)
                entry.tensor.CopyFrom(ready)
            db.execute(
                "INSERT INTO snapshots (prefix, number, info) VALUES (?, ?, ?)",
                (committed.prefix, committed.number, committed.SerializeToString()),
            )
            removed = _drop_old_snapshots(db, committed.prefix, max(1, committed.keep))
        return committed, removed

    def snapshots(self, prefix: str) -> list[pb.SnapshotInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT info FROM snapshots WHERE prefix = ? ORDER BY number", (prefix,)
            ).fetchall()
        return [pb.SnapshotInfo.FromString(r[0]) for r in rows]

    def update(self, info: pb.TensorInfo) -> None:
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE tensors SET state = ?, info = ? WHERE name = ? AND version = ?",
                (info.state, info.SerializeToString(), info.name, info.version),
            )
            if cursor.rowcount != 1:
                raise KeyError(f"tensor {info.name!r} version {info.version} is not in the catalog")

    def remove(self, name: str, version: int = 0) -> list[pb.TensorInfo]:
        where, args = (
            ("name = ?", (name,)) if version == 0 else ("name = ? AND version = ?", (name, version))
        )
        with self._transaction() as db:
            removed = [
                _parse(r[0]) for r in db.execute(f"SELECT info FROM tensors WHERE {where}", args)
            ]
            db.execute(f"DELETE FROM tensors WHERE {where}", args)
        return removed

    def get(self, name: str, version: int) -> pb.TensorInfo | None:
        with self._lock:
            row = self._db.execute(
                "SELECT info FROM tensors WHERE name = ? AND version = ?", (name, version)
            ).fetchone()
        return _parse(row[0]) if row else None

    def versions(self, name: str) -> list[pb.TensorInfo]:
        with self._lock:
            rows = self._db.execute(
                "SELECT info FROM tensors WHERE name = ? ORDER BY version", (name,)
            ).fetchall()
        return [_parse(r[0]) for r in rows]

    def list(self, include_pending: bool = False) -> list[pb.TensorInfo]:
        query = "SELECT info FROM tensors"
        args: tuple[int, ...] = ()
        if not include_pending:
            query, args = query + " WHERE state = ?", (pb.READY,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY name, version", args).fetchall()
        return [_parse(r[0]) for r in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _parse(blob: bytes) -> pb.TensorInfo:
    info = pb.TensorInfo()
    info.ParseFromString(blob)
    return info


def ranks_of(info: pb.TensorInfo) -> list[int]:
    """Distinct ranks holding shards of a catalog row."""
    return sorted({RemoteDevice(s.placement).rank() for s in info.metadata.shards_metadata})


def holding_ranks(info: pb.TensorInfo) -> list[int]:
    """Distinct ranks holding a copy of a catalog row that is not lost (those that allocate and promote it)."""
    lost = set(info.lost_shards)
    return sorted(
        {
            RemoteDevice(s.placement).rank()
            for i, s in enumerate(info.metadata.shards_metadata)
            if i not in lost
        }
    )


def _drop_old_snapshots(db: sqlite3.Connection, prefix: str, keep: int) -> list[pb.TensorInfo]:
    """Within an open transaction: remove the snapshots of `prefix` beyond the newest `keep` and their tensor
    rows; return the rows removed."""
    old = [
        pb.SnapshotInfo.FromString(r[0])
        for r in db.execute(
            "SELECT info FROM snapshots WHERE prefix = ? ORDER BY number DESC LIMIT -1 OFFSET ?",
            (prefix, keep),
        )
    ]
    removed = []
    for snapshot in old:
        for entry in snapshot.entries:
            removed += [
                _parse(r[0])
                for r in db.execute("SELECT info FROM tensors WHERE name = ?", (entry.tensor.name,))
            ]
            db.execute("DELETE FROM tensors WHERE name = ?", (entry.tensor.name,))
        db.execute(
            "DELETE FROM snapshots WHERE prefix = ? AND number = ?", (prefix, snapshot.number)
        )
    return removed


def _commit_in(
    db: sqlite3.Connection, name: str, version: int
) -> tuple[pb.TensorInfo, list[pb.TensorInfo]]:
    """Within an open transaction: (name, version) READY, older READY rows of `name` removed."""
    row = db.execute(
        "SELECT info FROM tensors WHERE name = ? AND version = ?", (name, version)
    ).fetchone()
    if row is None:
        raise KeyError(f"tensor {name!r} version {version} is not in the catalog")
    info = _parse(row[0])
    info.state = pb.READY
    older = [
        _parse(r[0])
        for r in db.execute(
            "SELECT info FROM tensors WHERE name = ? AND version < ? AND state = ?",
            (name, version, pb.READY),
        )
    ]
    db.execute(
        "DELETE FROM tensors WHERE name = ? AND version < ? AND state = ?",
        (name, version, pb.READY),
    )
    db.execute(
        "UPDATE tensors SET state = ?, info = ? WHERE name = ? AND version = ?",
        (pb.READY, info.SerializeToString(), name, version),
    )
    return info, older
