"""The catalog, over SQLite and over PostgreSQL alike (the `store` fixture): versions only grow across reopen,
commit replaces older READY rows in one step, transactions are all or nothing; records read back equal from
the catalog's own schema. SQLite's own: WAL mode and its sync levels."""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.server.coordinator.catalog.documents import DECODED
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorOptions,
    TensorRecord,
    TensorState,
)
from shardserve.server.coordinator.catalog.sqlite import VERSION_BLOCK, SQLiteCatalog
from shardserve.server.coordinator.catalog.sqlite_schema import SCHEMA_VERSION


def row(name: str, version: int, state: TensorState = TensorState.PENDING) -> TensorRecord:
    return TensorRecord(
        name=name,
        version=version,
        state=state,
        metadata=ShardedTensorMetadata(size=(version,)),
    )


@pytest.fixture
def catalog(store):
    c = store.open()
    yield c
    c.close()


def test_version_counter_only_grows_and_survives_reopen(store):
    first = store.open()
    assert [first.next_versions(1)[0] for _ in range(3)] == [1, 2, 3]
    more = first.next_versions(VERSION_BLOCK)  # past the first reserved block
    assert more == list(range(more[0], more[0] + VERSION_BLOCK)) and more[0] > 3
    first.close()
    again = store.open()
    assert (
        again.next_versions(1)[0] > more[-1]
    )  # the rest of a reserved block is skipped, never repeated
    again.close()


def test_sqlite_catalog_is_in_wal_mode_with_full_sync(tmp_path):
    catalog = SQLiteCatalog(tmp_path / "c.sqlite")
    mode = sqlite3.connect(tmp_path / "c.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    assert catalog.sync_level() == 2  # FULL: a commit survives a power cut
    catalog.close()


def test_commit_marks_ready_and_removes_older_ready_versions(catalog):
    catalog.add(row("t", 1))
    ready, older = catalog.commit("t", 1)
    assert ready.state == TensorState.READY and older == []
    catalog.add(row("t", 2))
    assert catalog.ready("t").version == 1
    assert [i.version for i in catalog.list()] == [1]
    assert [(i.version, i.state) for i in catalog.list(include_pending=True)] == [
        (1, TensorState.READY),
        (2, TensorState.PENDING),
    ]
    ready, older = catalog.commit("t", 2)
    assert (ready.version, [o.version for o in older]) == (2, [1])
    assert [i.version for i in catalog.versions("t")] == [2]
    assert catalog.get("t", 2).metadata.size == (2,)  # stored as a JSON document, read back whole


def test_commit_of_a_missing_row_changes_nothing(catalog):
    catalog.add(row("t", 1, TensorState.READY))
    with pytest.raises(KeyError, match="version 9"):
        catalog.commit("t", 9)
    assert catalog.ready("t").version == 1


def test_remove_one_or_every_version(catalog):
    for v in (1, 2, 3):
        catalog.add(row("t", v))
    assert [i.version for i in catalog.remove("t", 2)] == [2]
    assert [i.version for i in catalog.remove("t")] == [1, 3]
    assert catalog.versions("t") == [] and catalog.remove("t") == []


def test_commit_all_is_all_or_nothing(catalog):
    for name, version in (("a", 1), ("b", 2), ("a", 3)):
        catalog.add(row(name, version))
    catalog.commit("a", 1)
    with pytest.raises(KeyError, match="'c' version 9"):
        catalog.commit_all([("a", 3), ("c", 9)])
    assert (
        catalog.ready("a").version == 1 and catalog.get("a", 3).state == TensorState.PENDING
    )  # rolled back
    done = catalog.commit_all([("a", 3), ("b", 2)])
    assert [(info.name, info.version, [o.version for o in older]) for info, older in done] == [
        ("a", 3, [1]),
        ("b", 2, []),
    ]
    assert (
        catalog.ready("a").version == 3
        and catalog.ready("b").version == 2
        and catalog.get("a", 1) is None
    )


def test_next_versions_hands_out_a_block_that_only_grows(catalog):
    assert catalog.next_versions(1)[0] == 1
    assert catalog.next_versions(3) == [2, 3, 4]
    assert catalog.next_versions(1)[0] == 5


def test_many_threads_share_one_catalog(catalog):
    """The coordinator calls its catalog from many threads at once: versions never repeat, every commit lands
    and replaces its name's older READY version."""
    handed: list[list[int]] = [[] for _ in range(12)]

    def writer(index: int) -> None:
        for _ in range(15):
            version = catalog.next_versions(1)[0]
            handed[index].append(version)
            catalog.add(row(f"n{index}", version))
            _, older = catalog.commit(f"n{index}", version)
            assert [r.version for r in older] == handed[index][-2:-1]

    with ThreadPoolExecutor(max_workers=12) as pool:
        for done in [pool.submit(writer, i) for i in range(12)]:
            done.result()
    every = [v for versions in handed for v in versions]
    assert len(set(every)) == len(every) == 12 * 15
    assert [(r.name, r.version) for r in catalog.list(include_pending=True)] == sorted(
        (f"n{i}", handed[i][-1]) for i in range(12)
    )


def test_add_all_is_all_or_nothing(store, catalog):
    catalog.add_all([row("a", 1), row("b", 2)])
    assert {(r.name, r.version) for r in catalog.list(include_pending=True)} == {("a", 1), ("b", 2)}
    with pytest.raises(store.duplicate_error):
        catalog.add_all(
            [row("c", 3), row("a", 1)]
        )  # the second row exists: the first is not kept either
    assert {(r.name, r.version) for r in catalog.list(include_pending=True)} == {("a", 1), ("b", 2)}


def test_records_of_data_that_is_not_durable_commit_without_full_sync_and_read_back(tmp_path):
    synchronous: list[str] = []
    catalog = SQLiteCatalog(  # the statements the catalog sends, to see its sync mode around them
        tmp_path / "catalog.sqlite",
        trace=lambda sql: synchronous.append(sql) if "synchronous" in sql else None,
    )
    assert synchronous == ["PRAGMA synchronous=FULL"]  # at open
    synchronous.clear()
    catalog.add_all([row("a", 1)], durable=False)
    with pytest.raises(sqlite3.IntegrityError):
        catalog.add_all([row("a", 1)], durable=False)  # a failed one puts the sync mode back too
    catalog.add_all([row("b", 2)])
    assert synchronous == ["PRAGMA synchronous=NORMAL", "PRAGMA synchronous=FULL"] * 2
    assert catalog.sync_level() == 2  # FULL
    catalog.close()
    reopened = SQLiteCatalog(tmp_path / "catalog.sqlite")
    assert {(r.name, r.version) for r in reopened.list(include_pending=True)} == {
        ("a", 1),
        ("b", 2),
    }
    reopened.close()


def test_records_of_data_that_is_not_durable_read_back_after_reopen(store):
    catalog = store.open()
    catalog.add_all([row("a", 1)], durable=False)
    catalog.commit_all([("a", 1)], durable=False)
    with pytest.raises(store.duplicate_error):
        catalog.add_all([row("b", 2), row("a", 1)], durable=False)
    catalog.close()
    again = store.open()
    assert [(r.name, r.version, r.state) for r in again.list(include_pending=True)] == [
        ("a", 1, TensorState.READY)
    ]
    again.close()


def test_rows_list_by_the_bytes_of_their_names(catalog):
    """Names list in the order of their UTF-8 bytes in every store (capitals before small letters, '_' between
    them, other scripts after), never by a locale's collation."""
    names = ["b", "B", "a_b", "ab", "a-b", "é", "Z", "日本", "a"]
    catalog.add_all([row(name, i + 1, TensorState.READY) for i, name in enumerate(names)])
    assert [r.name for r in catalog.list()] == sorted(names, key=lambda n: n.encode())


def _full_record(name: str, version: int) -> TensorRecord:
    """A record with every field set: a replicated bfloat16 table with options, lost copies and a reshard's
    marker."""
    metadata = ShardedTensorMetadata(
        (
            ShardMetadata((0, 0), (2, 3), "rank:0/cpu"),
            ShardMetadata((0, 0), (2, 3), "rank:1/cuda:1"),
            ShardMetadata((2, 0), (2, 3), "rank:1/cpu"),
            ShardMetadata((2, 0), (2, 3), "rank:0/cpu"),
        ),
        (4, 3),
        TensorProperties(dtype=torch.bfloat16, requires_grad=True),
    )
    return TensorRecord(
        name=name,
        version=version,
        metadata=metadata,
        state=TensorState.READY,
        options=TensorOptions("default", b"\x00\x01" * 3),
        created_unix=1700000000.25,
        put_token="tok-7",
        owner="alice",
        promoting=True,
        lost_shards=(1, 3),
    )


def test_records_read_back_equal_across_reopen(store):
    """Every field of a record and a snapshot survives the catalog's own schema, also after a reopen."""
    first = store.open()
    record = _full_record("t", 3)
    first.add(record)
    assert first.get("t", 3) == record and first.list() == [record]
    snapshot = SnapshotRecord(
        "p",
        10,
        2,
        (
            SnapshotEntry("w", replace(_full_record("p@10/w", 11), state=TensorState.PENDING)),
            SnapshotEntry("opt.step", row("p@10/opt.step", 12)),
        ),
        created_unix=5.5,
    )
    first.add_all(snapshot.tensors())
    committed, removed = first.commit_snapshot(snapshot)
    assert list(removed) == [] and committed.state == TensorState.READY
    assert [e.tensor.state for e in committed.entries] == [TensorState.READY] * 2
    first.close()
    again = store.open()
    assert again.get("t", 3) == record
    assert again.snapshots("p") == [committed] and again.snapshot("p") == committed
    assert stored_schema_version(store) == SCHEMA_VERSION
    again.close()


def stored_schema_version(store) -> int:
    """The schema version the store's own tables say (SQLite's user_version, PostgreSQL's schema_version)."""
    if store.kind == "sqlite":
        return sqlite3.connect(store.location).execute("PRAGMA user_version").fetchone()[0]
    import psycopg

    with psycopg.connect(store.location) as db:
        return db.execute("SELECT version FROM schema_version").fetchone()[0]


def change_stored(store, statements: dict[str, str], *args: object) -> None:
    """Run the statement of the store's kind (a change behind the catalog's back), with `args`."""
    if store.kind == "sqlite":
        db = sqlite3.connect(store.location)
        db.execute(statements["sqlite"], args)
        db.commit()
        db.close()
        return
    import psycopg

    with psycopg.connect(store.location) as db:
        db.execute(statements["postgresql"], args)


def test_a_catalog_of_a_newer_schema_is_refused(store):
    store.open().close()
    change_stored(
        store,
        {
            "sqlite": f"PRAGMA user_version = {SCHEMA_VERSION + 1}",
            "postgresql": f"UPDATE schema_version SET version = {SCHEMA_VERSION + 1}",
        },
    )
    with pytest.raises(RuntimeError, match="newer than this shardserve"):
        store.open()


def test_a_catalog_of_schema_3_opens_at_the_current_schema_with_its_rows(store):
    """Schema 4 changed only SQLite's rows (their layouts apart): a PostgreSQL catalog of schema 3 is brought
    to it as it is, a SQLite one slimmed; both read back the same records."""
    catalog = store.open()
    records = [_full_record("w", 1), _full_record("t", 2)]
    catalog.add_all(records)
    catalog.close()
    change_stored(
        store,
        {
            "sqlite": "PRAGMA user_version = 3",
            "postgresql": "UPDATE schema_version SET version = 3",
        },
    )
    again = store.open()
    assert again.list(include_pending=True) == sorted(records, key=lambda r: r.name)
    again.close()
    assert stored_schema_version(store) == SCHEMA_VERSION == 4


def test_durability_is_stored_and_a_document_without_it_reads_as_durable(store):
    """options.durable survives the catalog; a document written before the field existed means durable."""
    catalog = store.open()
    weights = replace(_full_record("w", 1), options=TensorOptions(durable=False))
    catalog.add(weights)
    catalog.add(_full_record("t", 2))
    catalog.close()
    change_stored(
        store,
        {
            "sqlite": "UPDATE tensors SET record = json_remove(record, '$.options.durable') "
            "WHERE name = 't'",
            "postgresql": "UPDATE tensors SET record = record #- '{options,durable}' WHERE name = 't'",
        },
    )
    again = store.open()
    assert again.get("w", 1) == weights and not again.get("w", 1).options.durable
    assert again.get("t", 2).options.durable
    again.close()


def test_pending_and_promoting_rows_are_found_without_listing_every_row(catalog):
    catalog.add_all([row("a", 1), row("b", 2), row("c", 3, TensorState.READY)])
    catalog.add(replace(row("d", 4, TensorState.READY), promoting=True))
    assert [(r.name, r.version) for r in catalog.pending()] == [("a", 1), ("b", 2)]
    assert [(r.name, r.version) for r in catalog.promoting()] == [("d", 4)]
    catalog.commit("a", 1)
    catalog.update(replace(catalog.get("d", 4), promoting=False))
    assert [r.name for r in catalog.pending()] == ["b"] and catalog.promoting() == []


@pytest.mark.parametrize("decoded", ["kept", "forgotten"])
def test_a_snapshot_commit_returns_the_rows_of_the_snapshots_beyond_keep(catalog, decoded):
    """The removed snapshot's rows are found by its tensors' names, whether this process still keeps its
    document decoded (the names from the record) or not (a restarted coordinator: from the document)."""

    def snapshot(number: int) -> SnapshotRecord:
        entries = tuple(
            SnapshotEntry(key, row(f"p@{number}/{key}", number * 10 + i))
            for i, key in enumerate(("w", "b"))
        )
        catalog.add_all([entry.tensor for entry in entries])
        return SnapshotRecord("p", number, 1, entries, created_unix=float(number))

    first = snapshot(1)
    _, removed = catalog.commit_snapshot(first)
    assert len(removed) == 0
    catalog.add(
        row("p@1/w", 15, TensorState.READY)
    )  # another version of a snapshot tensor (a reshard's)
    catalog.add(row("p@1/x", 16, TensorState.READY))  # not the snapshot's: kept
    if decoded == "forgotten":
        DECODED.forget()
    committed, removed = catalog.commit_snapshot(snapshot(2))
    assert len(removed) == 3  # counted before they are decoded
    assert sorted((r.name, r.version, r.state) for r in removed) == [
        ("p@1/b", 11, TensorState.READY),
        ("p@1/w", 10, TensorState.READY),
        ("p@1/w", 15, TensorState.READY),
    ]
    assert catalog.get("p@1/x", 16) is not None
    # their layouts read back whole (from the layouts table where the catalog keeps one)
    assert {r.name: r.metadata for r in removed if r.version != 15} == {
        e.tensor.name: e.tensor.metadata for e in first.entries
    }
    assert catalog.get("p@1/w", 10) is None and catalog.snapshots("p") == [committed]


def test_snapshot_reads_the_newest_or_the_numbered_one_and_none_for_others(catalog):
    def commit(number: int) -> SnapshotRecord:
        entry = SnapshotEntry("w", row(f"q@{number}/w", number * 10))
        catalog.add_all([entry.tensor])
        committed, _ = catalog.commit_snapshot(
            SnapshotRecord("q", number, 2, (entry,), created_unix=float(number))
        )
        return committed

    assert catalog.snapshot("q") is None
    first, second = commit(1), commit(2)
    assert catalog.snapshot("q") == second and catalog.snapshot("q", 1) == first
    assert catalog.snapshot("q", 2) == second and catalog.snapshot("q", 3) is None
    assert catalog.snapshot("other") is None
    third = commit(3)  # keep=2: the first is gone
    assert catalog.snapshot("q") == third and catalog.snapshot("q", 1) is None


@pytest.mark.parametrize("decoded", ["kept", "forgotten"])
def test_the_removed_snapshots_names_come_from_its_kept_record_without_parsing_its_document(
    tmp_path, decoded
):
    statements: list[str] = []
    catalog = SQLiteCatalog(tmp_path / "catalog.sqlite", trace=statements.append)
    for number in (1, 2):
        entry = SnapshotEntry("w", row(f"s@{number}/w", number))
        catalog.add_all([entry.tensor])
        if number == 2 and decoded == "forgotten":
            DECODED.forget()
        statements.clear()
        catalog.commit_snapshot(SnapshotRecord("s", number, 1, (entry,)))
    deletes = [s for s in statements if s.startswith("DELETE FROM tensors")]
    assert len(deletes) == 1
    assert ("'$.entries'" in deletes[0]) == (decoded == "forgotten")
    assert catalog.get("s@1/w", 1) is None and catalog.get("s@2/w", 2) is not None
    catalog.close()
