"""`shardserve catalog copy SRC DST`: every tensor version, snapshot and the version counter move from an SQLite
catalog to a PostgreSQL one and back, read back equal; a destination that holds rows is refused unless
--replace; passwords never show."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.server.catalog_command import main_catalog
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.locations import open_catalog
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorOptions,
    TensorRecord,
    TensorState,
)

LAYOUT = ShardedTensorMetadata(
    (ShardMetadata((0, 0), (2, 3), "rank:0/cpu"), ShardMetadata((2, 0), (2, 3), "rank:1/cpu")),
    (4, 3),
    TensorProperties(dtype=torch.bfloat16),
)


def record(name: str, version: int, **fields: object) -> TensorRecord:
    return replace(TensorRecord(name=name, version=version, metadata=LAYOUT), **fields)


def fill(catalog: Catalog) -> None:
    """Rows of every kind: READY with checksums, PENDING, a reshard's promoting row with a lost copy, options,
    and two prefixes' snapshots (one beyond its keep, gone); the counter well past the versions."""
    versions = catalog.next_versions(3000)
    catalog.add(
        record("w", versions[0], options=TensorOptions("default", b"\x01" * 6, durable=False))
    )
    catalog.commit("w", versions[0], checksums={0: 0xFFFF_0000_FFFF_0000, 1: 7})
    catalog.add(record("pending", versions[1], put_token="tok", owner="alice"))
    catalog.add(
        record("moving", versions[2], state=TensorState.READY, promoting=True, lost_shards=(1,))
    )
    for prefix, number, first in (("model", 1, 10), ("model", 2, 20), ("opt", 3, 30)):
        entries = tuple(
            SnapshotEntry(key, record(f"{prefix}@{number}/{key}", versions[first + i]))
            for i, key in enumerate(("a", "b.c"))
        )
        catalog.add_all([entry.tensor for entry in entries])
        catalog.commit_snapshot(
            SnapshotRecord(
                prefix, number, 1, entries, created_unix=float(number), skeleton='{"t":1}'
            )
        )


@pytest.fixture
def sqlite_file(tmp_path: Path) -> str:
    return str(tmp_path / "catalog.sqlite")


@pytest.mark.parametrize("direction", ["sqlite to postgresql", "postgresql to sqlite"])
def test_a_copy_reads_back_equal_with_the_counter_carried_over(
    direction, sqlite_file, postgres_url, capsys
):
    source, destination = (
        (sqlite_file, postgres_url)
        if direction.startswith("sqlite")
        else (postgres_url, sqlite_file)
    )
    src = open_catalog(source)
    fill(src)
    expected = src.contents()
    src.close()
    assert len(expected.tensors) == 7 and [s.number for s in expected.snapshots] == [2, 3]
    assert expected.version_counter >= 3000

    assert main_catalog(["copy", source, destination]) == 0
    printed = capsys.readouterr().out
    assert (
        "copied 7 tensor versions, 2 snapshots" in printed
        and f"({expected.version_counter})" in printed
    )
    dst = open_catalog(destination)
    assert dst.contents() == expected
    assert dst.snapshot("model") == expected.snapshots[0] and dst.ready("w") == expected.tensors[-1]
    assert [r.name for r in dst.pending()] == ["pending"]
    assert [r.name for r in dst.promoting()] == ["moving"]
    assert dst.next_versions(1)[0] > expected.version_counter  # numbers never repeat
    dst.close()


def test_a_destination_that_holds_rows_is_refused_unless_replace(sqlite_file, postgres_url, caplog):
    src = open_catalog(sqlite_file)
    fill(src)
    src.close()
    dst = open_catalog(postgres_url)
    dst.add(record("mine", dst.next_versions(1)[0]))
    counter = dst.next_versions(5000)[-1]
    held = dst.contents()
    dst.close()

    assert main_catalog(["copy", sqlite_file, postgres_url]) == 1
    assert "is not empty: it holds 1 tensor versions and 0 snapshots" in caplog.text
    assert "--replace" in caplog.text
    dst = open_catalog(postgres_url)
    assert dst.contents() == held
    dst.close()

    assert main_catalog(["copy", sqlite_file, postgres_url, "--replace"]) == 0
    dst = open_catalog(postgres_url)
    copied = dst.contents()
    assert "mine" not in {r.name for r in copied.tensors} and len(copied.tensors) == 7
    assert copied.version_counter >= counter  # the destination's counter never goes back
    dst.close()


def test_the_command_names_what_it_cannot_copy(tmp_path, caplog):
    missing = str(tmp_path / "none.sqlite")
    assert main_catalog(["copy", missing, str(tmp_path / "b.sqlite")]) == 1
    assert "is not a file" in caplog.text and not (tmp_path / "none.sqlite").exists()
    same = str(tmp_path / "a.sqlite")
    open_catalog(same).close()
    assert main_catalog(["copy", same, same]) == 1
    with pytest.raises(SystemExit) as usage:
        main_catalog(["copy", same, "mysql://h/db"])
    assert usage.value.code == 2


def test_shardserve_catalog_copy_runs_from_the_command_line_and_hides_the_password(
    sqlite_file, postgres_server, postgres_url
):
    src = open_catalog(sqlite_file)
    fill(src)
    src.close()
    shardserve = Path(sys.executable).parent / "shardserve"
    done = subprocess.run(
        [str(shardserve), "catalog", "copy", sqlite_file, postgres_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "copied 7 tensor versions" in done.stdout
    assert postgres_server.password in postgres_url
    assert postgres_server.password not in done.stdout + done.stderr
    assert postgres_url.replace(f":{postgres_server.password}@", "@") in done.stdout
