"""The SQLite catalog's indexed queries of the background work: the versions on given ranks (their records, or
only their names, versions and states), through each row's layout and the ranks of each layout; the ranks any
layout uses, the rows with lost copies, the pending rows past a timeout. Each answers what a scan of every row
would, through its index (checked with SQLite's query plan), and a catalog of the previous schema gets its
layouts when opened."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

import pytest
import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorRecord,
    TensorState,
)
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.catalog.sqlite_schema import SCHEMA_VERSION


def layout(*ranks: int) -> ShardedTensorMetadata:
    """One row per shard, shard i on ranks[i]."""
    shards = tuple(ShardMetadata((i, 0), (1, 2), f"rank:{r}/cpu") for i, r in enumerate(ranks))
    return ShardedTensorMetadata(shards, (len(ranks), 2), TensorProperties(dtype=torch.float32))


def row(name: str, version: int, *ranks: int, **fields) -> TensorRecord:
    return TensorRecord(name=name, version=version, metadata=layout(*ranks), **fields)


@pytest.fixture
def catalog(tmp_path):
    c = SQLiteCatalog(tmp_path / "catalog.sqlite")
    yield c
    c.close()


def scanned(catalog: SQLiteCatalog, ranks: list[int]) -> list[tuple[str, int]]:
    """What the interface's default (a scan of every row) finds on `ranks`."""
    return [(r.name, r.version) for r in Catalog.holding(catalog, ranks)]


def keys(records: list[TensorRecord]) -> list[tuple[str, int]]:
    return [(r.name, r.version) for r in records]


def placed(catalog: SQLiteCatalog, ranks: list[int]) -> list[tuple[str, int, TensorState]]:
    """The indexed name, version and state of the versions on `ranks`, checked against a scan's."""
    found = [(p.name, p.version, p.state) for p in catalog.placed_versions(ranks)]
    assert found == [(r.name, r.version, r.state) for r in Catalog.holding(catalog, ranks)]
    return found


def test_the_versions_on_ranks_follow_every_change_of_the_rows(catalog):
    catalog.add_all([row("a", 1, 0, 1), row("b", 2, 1, 2), row("c", 3, 3, 3)])
    assert keys(catalog.holding([1])) == [("a", 1), ("b", 2)] == scanned(catalog, [1])
    assert keys(catalog.holding([0, 3])) == [("a", 1), ("c", 3)] == scanned(catalog, [0, 3])
    assert catalog.holding([]) == [] and catalog.holding([9]) == []
    assert placed(catalog, [1]) == [("a", 1, TensorState.PENDING), ("b", 2, TensorState.PENDING)]
    assert placed(catalog, []) == [] and placed(catalog, [9]) == []
    assert catalog.placed_ranks() == {0, 1, 2, 3}
    catalog.add(row("a", 4, 2, 2))  # a new version of a, on another rank
    catalog.commit("a", 4)  # no older READY row to remove: "a" 1 is pending
    assert keys(catalog.holding([2])) == [("b", 2), ("a", 4)] == scanned(catalog, [2])
    assert placed(catalog, [2]) == [("b", 2, TensorState.PENDING), ("a", 4, TensorState.READY)]
    catalog.update(replace(catalog.get("b", 2), metadata=layout(5, 5)))  # a row's layout replaced
    assert keys(catalog.holding([1])) == [("a", 1)] and keys(catalog.holding([5])) == [("b", 2)]
    catalog.remove("a")
    assert keys(catalog.holding([0, 1, 2])) == [] == scanned(catalog, [0, 1, 2])
    entries = (SnapshotEntry("w", row("p@9/w", 9, 6, 7)),)
    catalog.add_all([entry.tensor for entry in entries])
    catalog.commit_snapshot(SnapshotRecord("p", 9, 1, entries))
    assert [(r.name, r.state) for r in catalog.holding([7])] == [("p@9/w", TensorState.READY)]
    assert placed(catalog, [6, 7]) == [("p@9/w", 9, TensorState.READY)]


def test_rows_with_lost_copies_and_pending_rows_past_a_time(catalog):
    catalog.add_all(
        [
            row("old", 1, 0, created_unix=100.0),
            row("new", 2, 0, created_unix=200.0),
            row("lost", 3, 0, 1, state=TensorState.READY, lost_shards=(1,)),
            row("whole", 4, 0, 1, state=TensorState.READY),
        ]
    )
    assert keys(catalog.pending(created_before=150.0)) == [("old", 1)]
    assert keys(catalog.pending()) == [("old", 1), ("new", 2)]
    assert (
        keys(catalog.with_lost_copies()) == [("lost", 3)] == keys(Catalog.with_lost_copies(catalog))
    )
    catalog.update(replace(catalog.get("lost", 3), lost_shards=()))
    assert catalog.with_lost_copies() == []


def test_the_queries_of_the_background_work_are_answered_through_indexes(tmp_path):
    """Every statement the queries send is planned as index searches (SQLite's EXPLAIN QUERY PLAN): none reads
    every row of a table."""
    statements: list[str] = []
    catalog = SQLiteCatalog(tmp_path / "catalog.sqlite", trace=statements.append)
    catalog.add_all([row(f"t{i}", i + 1, i % 5, (i + 1) % 5) for i in range(50)])
    statements.clear()
    catalog.holding([1, 2])
    catalog.placed_versions([1, 2])
    catalog.pending(created_before=1.0)
    catalog.promoting()
    catalog.with_lost_copies()
    catalog.close()
    db = sqlite3.connect(catalog.path)
    for sql in statements:
        plan = [step[3] for step in db.execute(f"EXPLAIN QUERY PLAN {sql}")]
        full = [step for step in plan if step.startswith("SCAN") and "INDEX" not in step]
        assert not full, (sql, plan)
    db.close()


def test_a_catalog_of_schema_2_gets_the_layout_of_every_row(tmp_path):
    path = tmp_path / "catalog.sqlite"
    catalog = SQLiteCatalog(path)
    catalog.add_all([row("a", 1, 0, 1), row("b", 2, 1, 2), row("c", 3, 0, 1)])
    catalog.close()
    db = sqlite3.connect(
        path
    )  # as schema 2 left it: each row's layout in its document, no layouts table, no indexes of the scans
    with_inline_layouts(db)
    for index in ("tensors_layout", "tensors_pending", "tensors_promoting", "tensors_lost"):
        db.execute(f"DROP INDEX {index}")
    db.execute("DROP TABLE layouts")
    db.execute("DROP TABLE layout_ranks")
    db.execute("ALTER TABLE tensors DROP COLUMN layout")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    migrated = SQLiteCatalog(path)
    assert keys(migrated.holding([0])) == [("a", 1), ("c", 3)]
    assert keys(migrated.holding([2])) == [("b", 2)] and migrated.placed_ranks() == {0, 1, 2}
    migrated.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    assert db.execute("SELECT count(*) FROM layouts").fetchone()[0] == 2  # a and c share theirs
    assert inline_layouts(db) == 0
    db.close()


def test_rows_hold_no_layout_of_their_own_and_read_back_whole(catalog):
    """A row's document leaves its layout to the layouts table; every query gives the record that was put."""
    records = [row("a", 1, 0, 1), row("b", 2, 1, 2, state=TensorState.READY), row("c", 3, 0, 1)]
    catalog.add_all(records)
    catalog.update(replace(records[0], metadata=layout(3, 1)))
    db = sqlite3.connect(catalog.path)
    assert inline_layouts(db) == 0
    db.close()
    expected = [replace(records[0], metadata=layout(3, 1)), *records[1:]]
    assert catalog.list(include_pending=True) == expected
    assert catalog.holding([1]) == expected and catalog.holding([3]) == expected[:1]
    assert catalog.contents().tensors == tuple(expected)
    assert catalog.remove("b") == [records[1]]


def test_a_catalog_of_schema_3_keeps_each_layout_once_and_places_rows_restored_without_one(
    tmp_path,
):
    """Schema 3 kept each row's layout in its document too, and a restore (`shardserve catalog copy` into
    SQLite) left the rows' layout unset, so the scans of a rank's rows missed them: both are mended on open."""
    path = tmp_path / "catalog.sqlite"
    catalog = SQLiteCatalog(path)
    records = [row("a", 1, 0, 1), row("b", 2, 1, 2), row("c", 3, 0, 1)]
    catalog.add_all(records)
    catalog.close()
    db = sqlite3.connect(path)
    with_inline_layouts(db)
    db.execute(
        "UPDATE tensors SET layout = NULL WHERE name = 'b'"
    )  # as a restore of schema 3 left it
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()
    migrated = SQLiteCatalog(path)
    assert keys(migrated.holding([2])) == [("b", 2)] and migrated.placed_ranks() == {0, 1, 2}
    assert migrated.list(include_pending=True) == records
    migrated.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert inline_layouts(db) == 0
    db.close()


def test_a_restored_catalog_finds_the_rows_on_each_rank(tmp_path):
    """A catalog copied into SQLite (restore) names each row's layout: a rank's rows are found through it."""
    source = SQLiteCatalog(tmp_path / "source.sqlite")
    source.add_all([row("a", 1, 0, 1), row("b", 2, 1, 2)])
    copy = SQLiteCatalog(tmp_path / "copy.sqlite")
    copy.restore(source.contents())
    assert keys(copy.holding([2])) == [("b", 2)] and keys(copy.holding([1])) == [("a", 1), ("b", 2)]
    assert copy.placed_ranks() == {0, 1, 2}
    assert copy.list(include_pending=True) == source.list(include_pending=True)
    source.close()
    copy.close()


def with_inline_layouts(db: sqlite3.Connection) -> None:
    """Every row's layout put back into its document, as schemas before 4 kept it."""
    db.execute(
        "UPDATE tensors SET record = json_set(tensors.record, '$.metadata', json(layouts.document)) "
        "FROM layouts WHERE layouts.id = tensors.layout"
    )


def inline_layouts(db: sqlite3.Connection) -> int:
    """How many rows hold a layout in their own document."""
    return db.execute(
        "SELECT count(*) FROM tensors WHERE json_type(record, '$.metadata') IS NOT NULL"
    ).fetchone()[0]


def test_layouts_no_row_has_are_forgotten_when_the_catalog_opens(tmp_path):
    path = tmp_path / "catalog.sqlite"
    catalog = SQLiteCatalog(path)
    catalog.add_all([row("a", 1, 0), row("b", 2, 8)])
    catalog.remove("b")
    assert catalog.placed_ranks() == {0}  # of the rows there are
    assert layout_ranks(path) == [0, 8]  # kept while open: one put after another shares them
    catalog.close()
    reopened = SQLiteCatalog(path)
    assert reopened.placed_ranks() == {0} and keys(reopened.holding([0])) == [("a", 1)]
    reopened.close()
    assert layout_ranks(path) == [0]


def layout_ranks(path) -> list[int]:
    db = sqlite3.connect(path)
    try:
        return [r[0] for r in db.execute("SELECT rank FROM layout_ranks ORDER BY rank")]
    finally:
        db.close()
