"""The catalog's SQLite schema and its migrations: the tables of SCHEMA_VERSION, and the steps that bring a
catalog written by an earlier shardserve up to it when it is opened.

The schema's version is the database's `PRAGMA user_version`: 0, the TensorInfo/SnapshotInfo protobuf blobs of
the first versions; 1, records without shard checksums; 2, without the layouts (which rows hold shards on which
ranks) and the indexes of the background scans; 3, rows holding their layout in their own document too; 4, the
current one: a row's layout only in the layouts table. Every step runs inside the open
transaction the catalog hands it, so a migration that fails changes nothing. Kept apart from
server/coordinator/catalog/sqlite.py so that the catalog's queries read on their own and each past layout is
described in one place.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.catalog.documents import (
    layout_from_document,
    layout_json,
    loads,
    snapshot_json,
    tensor_json,
)
from shardserve.server.coordinator.catalog.messages import snapshot_from_proto, tensor_from_proto

# the catalog's logger: a migration is reported as the catalog's, whichever module performs it
log = logging.getLogger("shardserve.server.coordinator.catalog.sqlite")

# PRAGMA user_version; 0: the TensorInfo blobs of earlier versions, 1: records without shard checksums, 2: no
# layouts, 3: layouts in the rows' documents too (all migrated on open)
SCHEMA_VERSION = 4

# Which ranks each layout places shards on, and which layout each row has (the `layout` column): the reconcile
# of one rank and the repair scan read the rows on given ranks through them instead of decoding every row.
# A state dict's tensors share a few layouts, so a put adds an integer per row, not a row per (rank, tensor).
# The partial indexes serve the background scans of the few rows they want (pending puts, unfinished
# promotions, lost copies).
_INDEXES = (
    """CREATE TABLE IF NOT EXISTS layouts (
        id INTEGER PRIMARY KEY,
        document TEXT NOT NULL UNIQUE
    )""",
    """CREATE TABLE IF NOT EXISTS layout_ranks (
        rank INTEGER NOT NULL,
        layout INTEGER NOT NULL,
        PRIMARY KEY (rank, layout)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS tensors_layout ON tensors (layout)",
    "CREATE INDEX IF NOT EXISTS tensors_pending ON tensors (version) WHERE state = 'pending'",
    "CREATE INDEX IF NOT EXISTS tensors_promoting ON tensors (version) "
    "WHERE json_extract(record, '$.promoting')",
    "CREATE INDEX IF NOT EXISTS tensors_lost ON tensors (name) "
    "WHERE json_array_length(record, '$.lost_shards') > 0",
)


def layout_ids(
    db: sqlite3.Connection, layouts: Iterable[ShardedTensorMetadata]
) -> dict[ShardedTensorMetadata, int]:
    """Within an open transaction: the id of each distinct layout of `layouts` in the layouts table, recorded
    there (with the ranks it places shards on) when new."""
    ids = {}
    for meta in dict.fromkeys(layouts):
        document = layout_json(meta)
        db.execute("INSERT OR IGNORE INTO layouts (document) VALUES (?)", (document,))
        (layout,) = db.execute("SELECT id FROM layouts WHERE document = ?", (document,)).fetchone()
        db.executemany(
            "INSERT OR IGNORE INTO layout_ranks (rank, layout) VALUES (?, ?)",
            [(rank, layout) for rank in meta.ranks()],
        )
        ids[meta] = int(layout)
    return ids


def forget_unused_layouts(db: sqlite3.Connection) -> None:
    """Within an open transaction: the layouts no row has any more, and their ranks, removed."""
    unused = "SELECT id FROM layouts WHERE id NOT IN (SELECT layout FROM tensors WHERE layout IS NOT NULL)"
    db.execute(f"DELETE FROM layout_ranks WHERE layout IN ({unused})")
    db.execute(f"DELETE FROM layouts WHERE id IN ({unused})")


_TABLES = (
    """CREATE TABLE tensors (
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        state TEXT NOT NULL,
        record TEXT NOT NULL,
        layout INTEGER,
        PRIMARY KEY (name, version)
    )""",
    """CREATE TABLE snapshots (
        prefix TEXT NOT NULL,
        number INTEGER NOT NULL,
        record TEXT NOT NULL,
        PRIMARY KEY (prefix, number)
    )""",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO counters (name, value) VALUES ('version', 0)",
)


def upgrade(db: sqlite3.Connection, path: Path) -> None:
    """Within an open transaction: make the tables of SCHEMA_VERSION, migrating those of an earlier version (the
    TensorInfo/SnapshotInfo protobuf blobs of user_version 0). Nothing to do when the schema is current."""
    found = int(db.execute("PRAGMA user_version").fetchone()[0])
    if found == SCHEMA_VERSION:
        return
    if found > SCHEMA_VERSION:
        raise RuntimeError(
            f"catalog {path} has schema version {found}, newer than this shardserve's "
            f"({SCHEMA_VERSION}): run the shardserve that wrote it"
        )
    if found in (1, 2, 3):
        if found == 1:
            _add_checksums(db, path)
        if found in (1, 2):
            _add_layouts(db, path)
        unplaced = _layouts_apart(db)
        log.warning(
            "catalog %s migrated to schema version %d: rows without their layouts (%d given theirs)",
            path,
            SCHEMA_VERSION,
            unplaced,
        )
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return
    legacy = _columns(db, "tensors") == {"name", "version", "state", "info"}
    if legacy:
        db.execute("ALTER TABLE tensors RENAME TO tensors_v0")
        if _columns(db, "snapshots"):
            db.execute("ALTER TABLE snapshots RENAME TO snapshots_v0")
    for statement in (*_TABLES, *_INDEXES):
        db.execute(statement)
    if legacy:
        _migrate_blobs(db, path)
        _layouts_apart(db)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _add_checksums(db: sqlite3.Connection, path: Path) -> None:
    """Within an open transaction: schema 1 to 2, every tensor record (of the tensors table and inside each
    snapshot's entries) given an empty `checksums` (not known for versions made before them)."""
    db.execute("UPDATE tensors SET record = json_set(record, '$.checksums', json('[]'))")
    rows = db.execute("SELECT prefix, number, record FROM snapshots").fetchall()
    for prefix, number, text in rows:
        document = json.loads(text)
        for entry in document.get("entries", []):
            entry["tensor"].setdefault("checksums", [])
        db.execute(
            "UPDATE snapshots SET record = ? WHERE prefix = ? AND number = ?",
            (json.dumps(document, sort_keys=True, separators=(",", ":")), prefix, number),
        )
    log.warning(
        "catalog %s migrated to schema version %d: shard checksums (none known for existing versions)",
        path,
        SCHEMA_VERSION,
    )


def _add_layouts(db: sqlite3.Connection, path: Path) -> None:
    """Within an open transaction: schema 2 to 3, the rows' `layout` column and the partial indexes (each row is
    given its layout by the step to 4 that follows, `_layouts_apart`)."""
    if "layout" not in _columns(db, "tensors"):
        db.execute("ALTER TABLE tensors ADD COLUMN layout INTEGER")
    for statement in _INDEXES:
        db.execute(statement)
    log.warning(
        "catalog %s migrated to schema version %d: the layouts and their ranks, indexed",
        path,
        SCHEMA_VERSION,
    )


def _layouts_apart(db: sqlite3.Connection) -> int:
    """Within an open transaction: schema 3 to 4, every row's layout only in the layouts table; how many rows had
    no `layout` and were given theirs first (rows migrated from earlier schemas, and rows restored by
    `shardserve catalog copy` before this version, which the scans of a rank's rows then missed)."""
    unplaced: int = db.execute("SELECT count(*) FROM tensors WHERE layout IS NULL").fetchone()[0]
    fill_layouts(db)
    _drop_inline_layouts(db)
    return unplaced


def _drop_inline_layouts(db: sqlite3.Connection) -> None:
    """Within an open transaction: the layout taken out of the document of every row that names its layout."""
    db.execute(
        "UPDATE tensors SET record = json_remove(record, '$.metadata') "
        "WHERE layout IS NOT NULL AND json_type(record, '$.metadata') IS NOT NULL"
    )


def fill_layouts(db: sqlite3.Connection) -> None:
    """Within an open transaction: the `layout` column of every row that has none, from its document."""
    rows = db.execute(
        "SELECT json_extract(record, '$.metadata') AS meta, rowid FROM tensors WHERE layout IS NULL "
        "ORDER BY meta"
    ).fetchall()
    by_document: dict[str, list[int]] = {}
    for document, rowid in rows:
        by_document.setdefault(document, []).append(rowid)
    for document, rowids in by_document.items():
        meta = layout_from_document(loads(document))
        layout = layout_ids(db, [meta])[meta]
        db.executemany(
            "UPDATE tensors SET layout = ? WHERE rowid = ?", [(layout, r) for r in rowids]
        )


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    """The column names of `table` (empty when there is no such table)."""
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _migrate_blobs(db: sqlite3.Connection, path: Path) -> None:
    """Within an open transaction: the rows of tensors_v0 and snapshots_v0 (protobuf blobs) as records in the
    current tables; then the old tables go."""
    tensors = [
        _legacy(lambda blob: tensor_from_proto(pb.TensorInfo.FromString(blob)), key, blob)
        for *key, blob in db.execute("SELECT name, version, info FROM tensors_v0")
    ]
    db.executemany(
        "INSERT INTO tensors (name, version, state, record) VALUES (?, ?, ?, ?)",
        [(r.name, r.version, r.state.value, tensor_json(r)) for r in tensors],
    )
    snapshots = []
    if _columns(db, "snapshots_v0"):
        snapshots = [
            _legacy(lambda blob: snapshot_from_proto(pb.SnapshotInfo.FromString(blob)), key, blob)
            for *key, blob in db.execute("SELECT prefix, number, info FROM snapshots_v0")
        ]
        db.execute("DROP TABLE snapshots_v0")
    db.executemany(
        "INSERT INTO snapshots (prefix, number, record) VALUES (?, ?, ?)",
        [(s.prefix, s.number, snapshot_json(s)) for s in snapshots],
    )
    db.execute("DROP TABLE tensors_v0")
    log.warning(
        "catalog %s migrated to schema version %d: %d tensor versions, %d snapshots",
        path,
        SCHEMA_VERSION,
        len(tensors),
        len(snapshots),
    )


def _legacy(parse: Any, key: list[object], blob: bytes) -> Any:
    """`parse(blob)` of one old row; a row that does not parse fails the migration naming it."""
    try:
        return parse(blob)
    except Exception as err:  # noqa: BLE001 - DecodeError, ValueError: the row is named, nothing migrated
        raise RuntimeError(f"catalog row {tuple(key)} cannot be migrated: {err}") from err
