"""The embedded catalog: `Catalog` (server/coordinator/catalog/interface.py) kept in one SQLite file.

The catalog keeps `TensorRecord`s and `SnapshotRecord`s (server/coordinator/catalog/records.py) in its own schema,
whatever the API's messages look like. In SQLite each row is one JSON document of a record beside the columns
it is looked up by, its layout apart in the layouts table (the row's `layout` column names it: a state dict's
ten thousand tensors have a few layouts); the schema's version is the database's `PRAGMA user_version`. A
catalog written by an earlier shardserve (TensorInfo protobuf blobs, user_version 0; records without shard
checksums, user_version 1; ...) is migrated when it is opened, in one transaction (the tables and their
migrations: server/coordinator/catalog/sqlite_schema.py). Versions come from one counter over the whole catalog
that only grows.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardserve.server.coordinator.catalog.documents import (
    DECODED,
    RemovedRows,
    dumps,
    snapshot_json,
    snapshot_of,
    tensor_of,
    tensor_row_json,
)
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.leadership import LEASE_DURATION_S, Leadership
from shardserve.server.coordinator.catalog.records import (
    CatalogContents,
    PlacedVersion,
    ShardChecksums,
    SnapshotRecord,
    TensorRecord,
    TensorState,
    state_of,
)
from shardserve.server.coordinator.catalog.sqlite_leadership import TABLE as LEASE_TABLE
from shardserve.server.coordinator.catalog.sqlite_leadership import SQLiteLeadership, check_term
from shardserve.server.coordinator.catalog.sqlite_schema import (
    forget_unused_layouts,
    layout_ids,
    upgrade,
)

log = logging.getLogger(__name__)

VERSION_BLOCK = (
    1024  # version numbers reserved per durable counter update (one fsync per block, not per put)
)


class SQLiteCatalog(Catalog):
    """The embedded default: one SQLite file under the state dir, WAL mode, one transaction per change."""

    def __init__(self, path: str | Path, *, trace: Callable[[str], object] | None = None) -> None:
        """`trace`: called with every SQL statement the catalog sends (for diagnosis)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._block_lock = threading.Lock()  # the reserved block of version numbers: [next, end)
        self._block_next = self._block_end = 0
        self._term: int | None = None  # the lease term every write checks (fence), None: none
        self._db = sqlite3.connect(
            str(self.path), isolation_level=None, check_same_thread=False, timeout=10.0
        )
        self._db.set_trace_callback(trace)
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: NORMAL may lose the last commits to a power cut, and a commit the ranks acted on (an old
        # version dropped) must survive; catalog writes are few
        self._db.execute("PRAGMA synchronous=FULL")
        with self._transaction() as db:
            upgrade(db, self.path)
            forget_unused_layouts(db)
        # counted, not read: a catalog of many rows opens in the time of its schema
        with self._lock:
            count = self._db.execute("SELECT count(*) FROM tensors").fetchone()[0]
        log.info("catalog %s: %d tensor versions", self.path, count)

    @contextmanager
    def _transaction(
        self, durable: bool = True, *, fenced: bool = True
    ) -> Iterator[sqlite3.Connection]:
        """One transaction; `durable` False commits it without waiting for the disk (WAL order is kept: the
        next durable commit syncs it too), for records of data that is not durable either. `fenced`: first
        check the lease term the catalog was fenced with (NotLeader, nothing written)."""
        with self._lock:
            if not durable:
                self._db.execute("PRAGMA synchronous=NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    if fenced and self._term is not None:
                        check_term(self._db, self._term)
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                if not durable:
                    self._db.execute("PRAGMA synchronous=FULL")

    def next_versions(self, count: int) -> list[int]:
        """`count` new version numbers, from a block reserved in one durable transaction per VERSION_BLOCK
        numbers (a restart skips the rest of a block: numbers only grow, never repeat)."""
        with self._block_lock:
            if self._block_next + count > self._block_end:
                reserve = max(count, VERSION_BLOCK)
                with self._transaction() as db:
                    db.execute(
                        "UPDATE counters SET value = value + ? WHERE name = 'version'", (reserve,)
                    )
                    end = int(
                        db.execute("SELECT value FROM counters WHERE name = 'version'").fetchone()[
                            0
                        ]
                    )
                self._block_next, self._block_end = end - reserve + 1, end + 1
            first = self._block_next
            self._block_next += count
        return list(range(first, first + count))

    def add_all(self, records: list[TensorRecord], *, durable: bool = True) -> None:
        with self._transaction(durable) as db:
            layouts = layout_ids(db, (r.metadata for r in records))
            db.executemany(
                "INSERT INTO tensors (name, version, state, record, layout) VALUES (?, ?, ?, ?, ?)",
                [
                    (r.name, r.version, r.state.value, tensor_row_json(r), layouts[r.metadata])
                    for r in records
                ],
            )

    def commit_all(
        self,
        versions: list[tuple[str, int]],
        *,
        durable: bool = True,
        checksums: ShardChecksums | None = None,
    ) -> list[tuple[TensorRecord, list[TensorRecord]]]:
        sums = checksums or {}
        with self._transaction(durable) as db:
            return [
                _commit_in(db, name, version, sums.get((name, version), {}))
                for name, version in versions
            ]

    def commit_snapshot(
        self,
        snapshot: SnapshotRecord,
        *,
        durable: bool = True,
        checksums: ShardChecksums | None = None,
    ) -> tuple[SnapshotRecord, Sequence[TensorRecord]]:
        committed = snapshot.committed(checksums or {})
        document = snapshot_json(committed)
        with self._transaction(durable) as db:
            _mark_ready(db, committed.tensors())
            db.execute(
                "INSERT INTO snapshots (prefix, number, record) VALUES (?, ?, ?)",
                (committed.prefix, committed.number, document),
            )
            removed = _drop_old_snapshots(db, committed.prefix, max(1, committed.keep))
        # its readers find it decoded: the text they read back is this one
        DECODED.remember(document, committed)
        return committed, removed

    def snapshots(self, prefix: str) -> list[SnapshotRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM snapshots WHERE prefix = ? ORDER BY number", (prefix,)
            ).fetchall()
        return [snapshot_of(r[0]) for r in rows]

    def snapshot(self, prefix: str, number: int = 0) -> SnapshotRecord | None:
        query = "SELECT record FROM snapshots WHERE prefix = ? "
        query += "ORDER BY number DESC LIMIT 1" if number == 0 else "AND number = ?"
        with self._lock:
            row = self._db.execute(query, (prefix,) if number == 0 else (prefix, number)).fetchone()
        return snapshot_of(row[0]) if row is not None else None

    def update(self, record: TensorRecord) -> None:
        with self._transaction() as db:
            layout = layout_ids(db, [record.metadata])[record.metadata]
            cursor = db.execute(
                "UPDATE tensors SET state = ?, record = ?, layout = ? WHERE name = ? AND version = ?",
                (record.state.value, tensor_row_json(record), layout, record.name, record.version),
            )
            if cursor.rowcount != 1:
                raise KeyError(
                    f"tensor {record.name!r} version {record.version} is not in the catalog"
                )

    def remove(self, name: str, version: int = 0) -> list[TensorRecord]:
        where, args = (
            ("name = ?", (name,)) if version == 0 else ("name = ? AND version = ?", (name, version))
        )
        with self._transaction() as db:
            removed = _tensors_where(db, where, args)
            db.execute(f"DELETE FROM tensors WHERE {where}", args)
        return removed

    def get(self, name: str, version: int) -> TensorRecord | None:
        with self._lock:
            found = _tensors_where(self._db, "name = ? AND version = ?", (name, version))
        return found[0] if found else None

    def versions(self, name: str) -> list[TensorRecord]:
        with self._lock:
            return _tensors_where(self._db, "name = ?", (name,))

    def pending(self, created_before: float | None = None) -> list[TensorRecord]:
        where = "state = 'pending'"  # the literal the partial index tensors_pending names
        args: tuple[float, ...] = ()
        if created_before is not None:
            where += " AND json_extract(record, '$.created_unix') < ?"
            args = (created_before,)
        with self._lock:
            return _tensors_where(self._db, where, args)

    def promoting(self) -> list[TensorRecord]:
        with (
            self._lock
        ):  # a JSON field, read by SQLite through a partial index: only matching rows decoded
            return _tensors_where(self._db, "json_extract(record, '$.promoting')", ())

    def holding(self, ranks: Iterable[int]) -> list[TensorRecord]:
        where, wanted = _on_ranks(ranks)
        if not wanted:
            return []
        with self._lock:
            return _tensors_where(self._db, where, wanted)

    def placed_versions(self, ranks: Iterable[int]) -> list[PlacedVersion]:
        where, wanted = _on_ranks(ranks)
        if not wanted:
            return []
        with self._lock:  # the rows holding() reads, their documents left undecoded
            rows = self._db.execute(
                f"SELECT name, version, state FROM tensors WHERE {where} ORDER BY version", wanted
            ).fetchall()
        return [PlacedVersion(name, version, state_of(state)) for name, version, state in rows]

    def placed_ranks(self) -> set[int]:
        # of the layouts rows have now (one replaced stays in the layouts table until a reopen)
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT rank FROM layout_ranks WHERE layout IN (SELECT layout FROM tensors)"
            )
            return {r[0] for r in rows}

    def with_lost_copies(self) -> list[TensorRecord]:
        with self._lock:  # the partial index tensors_lost: only rows with lost copies are read
            return _tensors_where(
                self._db, "json_array_length(record, '$.lost_shards') > 0 AND state = 'ready'", ()
            )

    def sync_level(self) -> int:
        """SQLite's `synchronous` setting between transactions: 2 (FULL), what a commit's durability rests on."""
        with self._lock:
            level: int = self._db.execute("PRAGMA synchronous").fetchone()[0]
            return level

    def contents(self) -> CatalogContents:
        with self._transaction(fenced=False) as db:
            tensors = db.execute(f"{_ROWS} ORDER BY name, version").fetchall()
            snapshots = db.execute(
                "SELECT record FROM snapshots ORDER BY prefix, number"
            ).fetchall()
            (counter,) = db.execute("SELECT value FROM counters WHERE name = 'version'").fetchone()
        return CatalogContents(
            tuple(tensor_of(*row) for row in tensors),
            tuple(snapshot_of(r[0]) for r in snapshots),
            int(counter),
        )

    def restore(self, contents: CatalogContents, *, replace: bool = False) -> None:
        with self._transaction() as db:
            tensors = db.execute("SELECT count(*) FROM tensors").fetchone()[0]
            snapshots = db.execute("SELECT count(*) FROM snapshots").fetchone()[0]
            if (tensors or snapshots) and not replace:
                raise ValueError(not_empty(str(self.path), tensors, snapshots))
            db.execute("DELETE FROM tensors")
            db.execute("DELETE FROM snapshots")
            layouts = layout_ids(db, (r.metadata for r in contents.tensors))
            db.executemany(
                "INSERT INTO tensors (name, version, state, record, layout) VALUES (?, ?, ?, ?, ?)",
                [
                    (r.name, r.version, r.state.value, tensor_row_json(r), layouts[r.metadata])
                    for r in contents.tensors
                ],
            )
            db.executemany(
                "INSERT INTO snapshots (prefix, number, record) VALUES (?, ?, ?)",
                [(s.prefix, s.number, snapshot_json(s)) for s in contents.snapshots],
            )
            db.execute(
                "UPDATE counters SET value = max(value, ?) WHERE name = 'version'",
                (contents.version_counter,),
            )

    def leadership(self, lease_duration: float = LEASE_DURATION_S) -> Leadership:
        with self._transaction(fenced=False) as db:  # the lease's table, made when first needed
            db.execute(LEASE_TABLE)
        return SQLiteLeadership(lambda: self._transaction(fenced=False), lease_duration)

    def fence(self, term: int | None) -> None:
        if term is not None:
            with self._transaction(fenced=False) as db:
                db.execute(LEASE_TABLE)
        with self._lock:
            self._term = term

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # defined last: below it, `list` in this class body would name the method, not the builtin
    def list(self, include_pending: bool = False) -> list[TensorRecord]:
        where, args = ("1", ()) if include_pending else ("state = ?", (TensorState.READY.value,))
        with self._lock:
            rows = self._db.execute(
                f"{_ROWS} WHERE {where} ORDER BY name, version", args
            ).fetchall()
        return [tensor_of(*row) for row in rows]


def not_empty(where: str, tensors: int, snapshots: int) -> str:
    """The refusal of a restore into a catalog that holds rows."""
    return f"catalog {where} is not empty: it holds {tensors} tensor versions and {snapshots} snapshots"


# ---------------------------------------------------------------- rows within a transaction


# A row's document and its layout's (decoded once per distinct layout: tensor_of).
_ROWS = "SELECT record, document FROM tensors LEFT JOIN layouts ON layouts.id = tensors.layout"


def _on_ranks(ranks: Iterable[int]) -> tuple[str, tuple[int, ...]]:
    """The condition that selects the rows with a shard on one of `ranks`, and its arguments: the layouts on
    those ranks, then their rows (index tensors_layout), never every row."""
    wanted = tuple(sorted(set(ranks)))
    marks = ",".join("?" * len(wanted))
    return f"layout IN (SELECT layout FROM layout_ranks WHERE rank IN ({marks}))", wanted


def _tensors_where(db: sqlite3.Connection, where: str, args: tuple[Any, ...]) -> list[TensorRecord]:
    rows = db.execute(f"{_ROWS} WHERE {where} ORDER BY version", args)
    return [tensor_of(*row) for row in rows]


def _commit_in(
    db: sqlite3.Connection, name: str, version: int, checksums: dict[int, int]
) -> tuple[TensorRecord, list[TensorRecord]]:
    """Within an open transaction: (name, version) READY with `checksums`, older READY rows of `name` removed."""
    found = _tensors_where(db, "name = ? AND version = ?", (name, version))
    if not found:
        raise KeyError(f"tensor {name!r} version {version} is not in the catalog")
    ready = replace(found[0], state=TensorState.READY).with_checksums(checksums)
    older_ready = ("name = ? AND version < ? AND state = ?", (name, version, ready.state.value))
    older = _tensors_where(db, *older_ready)
    db.execute(f"DELETE FROM tensors WHERE {older_ready[0]}", older_ready[1])
    db.execute(
        "UPDATE tensors SET state = ?, record = ? WHERE name = ? AND version = ?",
        (ready.state.value, tensor_row_json(ready), name, version),
    )
    return ready, older


def _mark_ready(db: sqlite3.Connection, records: Sequence[TensorRecord]) -> None:
    """Within an open transaction: the PENDING rows of `records` READY with their checksums, their documents
    changed in place (no decoding: a snapshot's names are its own, so no older READY row of them exists);
    KeyError if one is gone."""
    ready, pending = TensorState.READY.value, TensorState.PENDING.value
    versions = [(r.name, r.version) for r in records]
    cursor = db.executemany(
        "UPDATE tensors SET state = ?, record = json_set(record, '$.state', ?, '$.checksums', json(?)) "
        "WHERE name = ? AND version = ? AND state = ?",
        [
            (
                ready,
                ready,
                dumps([f"{c:016x}" for c in r.checksums]),
                r.name,
                r.version,
                pending,
            )
            for r in records
        ],
    )
    if cursor.rowcount != len(versions):
        missing = [
            (name, version)
            for name, version in versions
            if not _tensors_where(db, "name = ? AND version = ?", (name, version))
        ]
        raise KeyError(f"tensor versions {missing or versions} are not pending in the catalog")


def _drop_old_snapshots(db: sqlite3.Connection, prefix: str, keep: int) -> RemovedRows:
    """Within an open transaction: remove the snapshots of `prefix` beyond the newest `keep` and their tensor
    rows; return the rows removed (not decoded yet)."""
    old = db.execute(
        "SELECT number, record FROM snapshots WHERE prefix = ? ORDER BY number DESC LIMIT -1 OFFSET ?",
        (prefix, keep),
    ).fetchall()
    rows: list[tuple[str, int | None]] = []
    for number, text in old:
        names, parameter = _names_of(text)
        rows += db.execute(
            f"DELETE FROM tensors WHERE name IN ({names}) RETURNING record, layout", (parameter,)
        ).fetchall()
        db.execute("DELETE FROM snapshots WHERE prefix = ? AND number = ?", (prefix, number))
    layouts = _layout_documents(db, {layout for _, layout in rows if layout is not None})
    return RemovedRows([row[0] for row in rows], [layouts.get(row[1]) for row in rows])


def _layout_documents(db: sqlite3.Connection, ids: set[int]) -> dict[int | None, str]:
    """The documents of the layouts `ids` by id (the rows naming them may be gone: layouts stay until a reopen)."""
    if not ids:
        return {}
    marks = ",".join("?" * len(ids))
    found = db.execute(f"SELECT id, document FROM layouts WHERE id IN ({marks})", tuple(ids))
    return dict(found.fetchall())


def _names_of(text: str) -> tuple[str, str]:
    """A query of the tensor names of the snapshot whose document is `text`, and its one parameter: a JSON array
    of the names from the snapshot's record when this process keeps it decoded (a weight sync's commit removes
    a snapshot it committed a few steps before), else the document, read by SQLite (parsing a 10,000-tensor
    document there takes 90 ms, a list of its names 6 ms)."""
    kept = DECODED.peek(text)
    if kept is None:
        return "SELECT json_extract(value, '$.tensor.name') FROM json_each(?, '$.entries')", text
    return "SELECT value FROM json_each(?)", dumps([entry.tensor.name for entry in kept.entries])
