"""A rank's persistence in-process: snapshots and the update log restore bit for bit; torn logs, corrupt or
truncated shard files and a full disk are detected and named."""

import json
import logging
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from waiting import wait_until

from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.common.names import file_name
from shardserve.server.rank.errors import DiskFull
from shardserve.server.rank.persistence import LOG_NAME, FsyncPolicy, Persistence
from shardserve.server.rank.store import ShardStore, VersionState

ROWS, COLUMNS = 64, 8


def _meta(rows: int = ROWS, ranks: int = 1) -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(ranks)]).build_metadata(
        (rows, COLUMNS), TensorProperties()
    )


def _store(root: Path, policy: FsyncPolicy = FsyncPolicy.ALWAYS) -> ShardStore:
    return ShardStore(
        0, shared_memory=True, version_grace=0, persistence=Persistence(0, root, policy)
    )


def _update(
    store: ShardStore, version: int, rows: list[int], values: torch.Tensor, promote: bool = True
) -> None:
    """What CreateTensor(INIT_COPY) + WriteRows (log, then write) + commit do on one rank."""
    store.allocate_copy("t", version, _meta(), version - 1)
    local = np.array(rows, dtype=np.int64)
    store.persistence.log_rows("t", version, 0, local, values)
    with store.leases.rewrite("t", version, 0, torch.from_numpy(local)) as shard:
        shard.index_copy_(0, torch.from_numpy(local), values)
    if promote:
        store.promote("t", version)
        store.drop("t", version - 1)


def _restored(root: Path) -> ShardStore:
    store = _store(root)
    for name, version in store.restore():
        store.promote(name, version)
    return store


def _put(store: ShardStore, table: torch.Tensor, version: int = 1) -> None:
    store.install(
        "t",
        version,
        _meta(table.shape[0]),
        {0: store.memory.empty(tuple(table.shape), table.dtype, True).copy_(table)},
    )
    store.promote("t", version)


def test_snapshots_and_logged_updates_restore_bit_for_bit(tmp_path):
    table = torch.randn(ROWS, COLUMNS)
    store = _store(tmp_path)
    _put(store, table)
    expected = table.clone()
    for version in (2, 3, 4):
        values = torch.randn(2, COLUMNS)
        _update(store, version, [version, ROWS - version], values)
        expected[[version, ROWS - version]] = values
    store.persistence.close()

    again = _restored(tmp_path)
    assert [(n, v) for n, v, _ in again.held()] == [("t", 4)]
    assert torch.equal(again.local_tensor("t", 4, 0), expected)


def test_the_shard_file_is_safetensors_with_its_checksum(tmp_path):
    table = torch.arange(ROWS * COLUMNS, dtype=torch.float32).view(ROWS, COLUMNS)
    store = _store(tmp_path)
    _put(store, table)
    raw = (tmp_path / file_name("t") / "v1.s0.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    assert header["shard"] == {
        "dtype": "F32",
        "shape": [ROWS, COLUMNS],
        "data_offsets": [0, table.nbytes],
    }
    assert header["__metadata__"]["name"] == "t" and header["__metadata__"]["version"] == "1"
    assert torch.equal(
        torch.frombuffer(bytearray(raw[8 + length :]), dtype=torch.float32).view(ROWS, COLUMNS),
        table,
    )
    safetensors = pytest.importorskip("safetensors.torch")
    assert torch.equal(
        safetensors.load_file(tmp_path / file_name("t") / "v1.s0.safetensors")["shard"], table
    )


def test_an_update_never_promoted_is_not_restored(tmp_path):
    table = torch.randn(ROWS, COLUMNS)
    store = _store(tmp_path)
    _put(store, table)
    _update(store, 2, [1], torch.ones(1, COLUMNS), promote=False)  # crashed before the commit
    again = _restored(tmp_path)
    assert [(n, v) for n, v, _ in again.held()] == [("t", 1)]
    assert torch.equal(again.local_tensor("t", 1, 0), table)


def test_a_torn_log_tail_is_ignored(tmp_path):
    table = torch.randn(ROWS, COLUMNS)
    store = _store(tmp_path)
    _put(store, table)
    _update(store, 2, [5], torch.ones(1, COLUMNS))
    store.persistence.close()
    with open(
        tmp_path / file_name("t") / LOG_NAME, "ab"
    ) as f:  # half of a record, as a crash mid-append leaves it
        f.write(b"GLSS" + struct.pack("<I", 1000) + b"\x00" * 10)
    expected = table.clone()
    expected[5] = 1
    assert torch.equal(_restored(tmp_path).local_tensor("t", 2, 0), expected)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_file_is_named_and_not_served(tmp_path, caplog, damage):
    store = _store(tmp_path)
    _put(store, torch.randn(ROWS, COLUMNS))
    path = tmp_path / file_name("t") / "v1.s0.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if damage == "flip":
            f.seek(size - 7)
            byte = f.read(1)
            f.seek(size - 7)
            f.write(bytes([byte[0] ^ 0x40]))
        else:
            f.truncate(size - 100)
    with caplog.at_level(logging.ERROR):
        again = _restored(tmp_path)
    assert again.held() == []
    assert str(path) in caplog.text and "refuses to serve 't'" in caplog.text
    assert ("checksum mismatch" if damage == "flip" else "truncated") in caplog.text


def test_a_log_larger_than_the_table_is_compacted_into_a_snapshot(tmp_path):
    rows = (
        40_000  # 1.28 MB: each update below logs every row, so the log outgrows the table at once
    )
    big = torch.randn(rows, COLUMNS)
    store = _store(tmp_path)
    _put(store, big, version=1)
    store.drop("t", 0)
    _put(store, big, version=20)
    for version in range(21, 24):
        store.allocate_copy("t", version, _meta(rows), version - 1)
        local = np.arange(rows, dtype=np.int64)
        big.add_(1)
        store.persistence.log_rows("t", version, 0, local, big)
        with store.leases.rewrite("t", version, 0, torch.from_numpy(local)) as shard:
            shard.copy_(big)
        store.promote("t", version)
        store.drop("t", version - 1)
    wait_until(
        lambda: (
            (tmp_path / file_name("t") / "v23.json").exists()
            and not store.persistence.compacting("t")
        ),
        30,
        "the compaction to write version 23's snapshot",
    )
    store.persistence.close()
    assert not (
        tmp_path / file_name("t") / "v20.json"
    ).exists()  # the compaction's snapshot replaced it
    assert (tmp_path / file_name("t") / LOG_NAME).stat().st_size < big.nbytes
    again = _restored(tmp_path)
    assert [(n, v) for n, v, _ in again.held()] == [("t", 23)]
    assert torch.equal(again.local_tensor("t", 23, 0), big)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (needs root and mount); unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_fails_the_promote_and_nothing_is_served(small_disk):
    store = _store(small_disk)
    _put(store, torch.randn(ROWS, COLUMNS))  # fits
    big = torch.randn(4096, COLUMNS)  # 128 KiB twice over: does not fit beside the first
    store.install("big", 1, _meta(4096), {0: big.clone()})
    store.install("big2", 1, _meta(4096), {0: big.clone()})
    store.promote("big", 1)
    with pytest.raises(
        DiskFull,
        match=rf"rank 0 could not persist {small_disk}/{file_name('big2')}/v1.s0.safetensors"
        r".*disk full",
    ):
        store.promote("big2", 1)
    assert ("big2", 1, VersionState.PENDING) in store.held()  # never served, so never acknowledged
    with pytest.raises(DiskFull, match="updates.log"):
        _fill_log(store)


def _fill_log(store: ShardStore) -> None:
    for version in range(2, 100):
        _update(store, version, list(range(ROWS)), torch.randn(ROWS, COLUMNS))


def test_options_survive(tmp_path):
    store = _store(tmp_path)
    store.install(
        "t", 1, _meta(), {0: torch.zeros(ROWS, COLUMNS)}, TensorOptions(default_row=b"\x01\x02")
    )
    store.promote("t", 1)
    again = _store(tmp_path)
    again.restore()
    with again.leases.lease("t", 1, served=False) as entry:
        assert entry.options.default_row == b"\x01\x02"
