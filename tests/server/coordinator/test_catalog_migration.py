"""A catalog written by the previous coordinator (TensorInfo blobs, fixtures/catalog-v0.sqlite) is migrated to
the catalog's own schema when it is opened, in one transaction, once: the coordinator then answers every
tensor, version and snapshot with the metadata the old one had."""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

import pytest

from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.catalog.sqlite_schema import SCHEMA_VERSION
from shardserve.server.coordinator.role import CoordinatorRole
from shardserve.server.coordinator.server import CoordinatorServer
from shardserve.server.coordinator.service import CoordinatorServicer

FIXTURE = Path(__file__).parent / "fixtures" / "catalog-v0.sqlite"
ANSWER_ONLY = ("unavailable_shards", "health", "replicas", "repair", "update_order")


def _stored(info: pb.TensorInfo) -> pb.TensorInfo:
    """`info` without the fields an answer adds (they describe live state, never stored), and without empty
    options (a snapshot's tensors had none set: the same defaults to a reader)."""
    out = pb.TensorInfo()
    out.CopyFrom(info)
    for field in ANSWER_ONLY:
        out.ClearField(field)
    if out.options == pb.TensorOptions():
        out.ClearField("options")
    return out


def _stored_snapshot(info: pb.SnapshotInfo) -> pb.SnapshotInfo:
    out = pb.SnapshotInfo()
    out.CopyFrom(info)
    for entry in out.entries:
        entry.tensor.CopyFrom(_stored(entry.tensor))
    return out


def _old_rows(path: Path) -> tuple[dict[tuple[str, int], pb.TensorInfo], list[pb.SnapshotInfo]]:
    db = sqlite3.connect(path)
    try:
        tensors = {
            (name, version): _stored(pb.TensorInfo.FromString(blob))
            for name, version, blob in db.execute("SELECT name, version, info FROM tensors")
        }
        snapshots = [
            _stored_snapshot(pb.SnapshotInfo.FromString(blob))
            for (blob,) in db.execute("SELECT info FROM snapshots ORDER BY number")
        ]
    finally:
        db.close()
    return tensors, snapshots


@pytest.fixture
def old_catalog(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.sqlite"
    shutil.copy(FIXTURE, path)
    return path


def _answers(path: Path) -> tuple[list[pb.TensorInfo], list[pb.SnapshotInfo], int]:
    """What a coordinator over the catalog at `path` answers (its threads never started): every tensor
    version, the snapshots of "model", and the next version number."""
    coordinator = CoordinatorServer(SQLiteCatalog(path))
    try:
        servicer = CoordinatorServicer(CoordinatorRole.sole(coordinator))
        listed = servicer.ListTensors(pb.ListTensorsRequest(include_pending=True), None)
        snapshots = servicer.ListSnapshots(pb.ListSnapshotsRequest(prefix="model"), None)
        return (
            list(listed.tensors),
            list(snapshots.snapshots),
            coordinator.catalog.next_versions(1)[0],
        )
    finally:
        coordinator.close()


def test_the_fixture_is_a_catalog_of_the_previous_schema():
    db = sqlite3.connect(FIXTURE)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    columns = {row[1] for row in db.execute("PRAGMA table_info(tensors)")}
    assert columns == {"name", "version", "state", "info"}
    db.close()


def test_an_old_catalog_is_migrated_and_served_with_the_same_metadata(old_catalog, caplog):
    old_tensors, old_snapshots = _old_rows(old_catalog)
    with caplog.at_level(logging.WARNING, logger="shardserve.server.coordinator.catalog.sqlite"):
        tensors, snapshots, next_version = _answers(old_catalog)
    assert "migrated to schema version" in caplog.text
    assert {(t.name, t.version): _stored(t) for t in tensors} == old_tensors
    states = {t.name: t.state for t in tensors}
    assert states["pending"] == pb.PENDING and states["rowwise"] == pb.READY
    table = next(t for t in tensors if t.name == "table")
    assert table.options.oov == pb.OOV_DEFAULT and len(table.options.default_row) == 12
    assert [s.number for s in snapshots] == [s.number for s in old_snapshots] == [12, 15]
    assert [_stored_snapshot(s) for s in snapshots] == old_snapshots
    assert next_version > max(v for _, v in old_tensors) == 18  # the counter carried over
    db = sqlite3.connect(old_catalog)
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert tables == {"tensors", "snapshots", "counters", "layouts", "layout_ranks"}
    db.close()


def test_a_second_start_finds_nothing_to_migrate(old_catalog, caplog):
    first = _answers(old_catalog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardserve.server.coordinator.catalog.sqlite"):
        again = _answers(old_catalog)
    assert "migrated" not in caplog.text
    assert again[:2] == first[:2] and again[2] > first[2]


def test_a_migration_that_fails_changes_nothing(old_catalog):
    """One row that does not parse fails the whole migration, naming the row; the old tables stay as they
    were, for the previous coordinator or a fixed one."""
    db = sqlite3.connect(old_catalog)
    db.execute("UPDATE tensors SET info = ? WHERE name = 'table'", (b"\xff\xff not protobuf",))
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match=r"catalog row \('table', 8\) cannot be migrated"):
        SQLiteCatalog(old_catalog)
    db = sqlite3.connect(old_catalog)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM tensors").fetchone()[0] == 9
    assert {row[1] for row in db.execute("PRAGMA table_info(tensors)")} == {
        "name",
        "version",
        "state",
        "info",
    }
    db.close()
