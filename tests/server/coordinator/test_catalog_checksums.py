"""The catalog keeps each version's shard checksums: committed with the version (one put, a snapshot, a
reshard's record update), read back equal after the catalog is reopened (a coordinator restart), in SQLite
and in PostgreSQL; and an SQLite catalog of schema 1 (records without checksums) is migrated on open with none
known."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorRecord,
)
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.catalog.sqlite_schema import SCHEMA_VERSION

TWO_SHARDS = ShardedTensorMetadata(
    (ShardMetadata((0,), (4,), "rank:0/cpu"), ShardMetadata((4,), (4,), "rank:1/cpu")), (8,)
)
SUMS = {0: 0x0123_4567_89AB_CDEF, 1: 0xFFFF_FFFF_FFFF_FFFE}  # the high bit set: stored unsigned


def _row(name: str, version: int) -> TensorRecord:
    return TensorRecord(name=name, version=version, metadata=TWO_SHARDS)


def test_checksums_commit_with_the_version_and_survive_a_reopen(store):
    catalog = store.open()
    catalog.add(_row("t", 1))
    ready, _ = catalog.commit("t", 1, checksums=SUMS)
    assert ready.checksums == (SUMS[0], SUMS[1])
    entries = (SnapshotEntry("w", _row("p@2/w", 2)),)
    catalog.add_all([entry.tensor for entry in entries])
    committed, _ = catalog.commit_snapshot(
        SnapshotRecord("p", 2, 1, entries), checksums={("p@2/w", 2): {1: SUMS[1]}}
    )
    assert committed.entries[0].tensor.checksums == (0, SUMS[1])  # 0: shard 0's not known
    resharded = _row("r", 3)
    catalog.add(resharded)
    catalog.commit("r", 3)
    catalog.update(replace(catalog.get("r", 3), promoting=False).with_checksums(SUMS))
    catalog.close()

    again = store.open()
    assert again.ready("t").checksums == (SUMS[0], SUMS[1])
    assert again.get("p@2/w", 2).checksums == (0, SUMS[1])
    assert again.snapshot("p").entries[0].tensor.checksums == (0, SUMS[1])
    assert again.ready("r").checksums == (SUMS[0], SUMS[1])
    again.close()


def test_a_schema_1_catalog_is_migrated_with_no_checksums_known(tmp_path):
    path = tmp_path / "catalog.sqlite"
    catalog = SQLiteCatalog(path)
    catalog.add(_row("old", 1))
    catalog.commit("old", 1)
    entries = (SnapshotEntry("w", _row("p@2/w", 2)),)
    catalog.add_all([entry.tensor for entry in entries])
    catalog.commit_snapshot(SnapshotRecord("p", 2, 1, entries))
    catalog.close()
    db = sqlite3.connect(path)  # as schema 1 wrote it: no "checksums" in any record
    for name, version, text in db.execute("SELECT name, version, record FROM tensors").fetchall():
        document = json.loads(text)
        del document["checksums"]
        db.execute(
            "UPDATE tensors SET record = ? WHERE name = ? AND version = ?",
            (json.dumps(document), name, version),
        )
    (text,) = db.execute("SELECT record FROM snapshots").fetchone()
    document = json.loads(text)
    del document["entries"][0]["tensor"]["checksums"]
    db.execute("UPDATE snapshots SET record = ?", (json.dumps(document),))
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()

    migrated = SQLiteCatalog(path)
    assert migrated.ready("old").checksums == ()
    assert migrated.snapshot("p").entries[0].tensor.checksums == ()
    migrated.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
