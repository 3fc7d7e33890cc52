"""SQLiteCatalog: versions only grow across reopen, commit replaces older READY rows in one step, WAL mode."""

from __future__ import annotations

import sqlite3

import pytest

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.catalog import SQLiteCatalog


def row(name: str, version: int, state: int = pb.PENDING) -> pb.TensorInfo:
    return pb.TensorInfo(
        name=name,
        version=version,
        state=state,
        nbytes=version * 10,
        metadata=pb.ShardedTensorMetadata(size=[version]),
    )


@pytest.fixture
def catalog(tmp_path):
    c = SQLiteCatalog(tmp_path / "catalog.sqlite")
    yield c
    c.close()


def test_version_counter_only_grows_and_survives_reopen(tmp_path):
    first = SQLiteCatalog(tmp_path / "c.sqlite")
    assert [first.next_version() for _ in range(3)] == [1, 2, 3]
    first.close()
    again = SQLiteCatalog(tmp_path / "c.sqlite")
    assert again.next_version() == 4
    mode = sqlite3.connect(tmp_path / "c.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    assert (
        again._db.execute("PRAGMA synchronous").fetchone()[0] == 2
    )  # FULL: a commit survives a power cut
    again.close()


def test_commit_marks_ready_and_removes_older_ready_versions(catalog):
    catalog.add(row("t", 1))
    ready, older = catalog.commit("t", 1)
    assert ready.state == pb.READY and older == []
    catalog.add(row("t", 2))
    assert catalog.ready("t").version == 1
    assert [i.version for i in catalog.list()] == [1]
    assert [(i.version, i.state) for i in catalog.list(include_pending=True)] == [
        (1, pb.READY),
        (2, pb.PENDING),
    ]
    ready, older = catalog.commit("t", 2)
    assert (ready.version, [o.version for o in older]) == (2, [1])
    assert [i.version for i in catalog.versions("t")] == [2]
    assert catalog.get("t", 2).metadata.size == [2]  # stored as protobuf bytes, read back whole


def test_commit_of_a_missing_row_changes_nothing(catalog):
    catalog.add(row("t", 1, pb.READY))
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
        catalog.ready("a").version == 1 and catalog.get("a", 3).state == pb.PENDING
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
    assert catalog.next_version() == 1
    assert catalog.next_versions(3) == [2, 3, 4]
    assert catalog.next_version() == 5


def test_add_all_is_all_or_nothing(catalog):
    catalog.add_all([row("a", 1), row("b", 2)])
    assert {(r.name, r.version) for r in catalog.list(include_pending=True)} == {("a", 1), ("b", 2)}
    with pytest.raises(sqlite3.IntegrityError):
        catalog.add_all(
            [row("c", 3), row("a", 1)]
        )  # the second row exists: the first is not kept either
    assert {(r.name, r.version) for r in catalog.list(include_pending=True)} == {("a", 1), ("b", 2)}
