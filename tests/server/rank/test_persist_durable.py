"""Durability per version: a not-durable version writes nothing to the persist dir (and is gone after a
restart), a durable one does; a PromoteMany batch syncs a bounded number of times however many tensors."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.rank import persist_files, persistence
from shardserve.server.rank.persistence import FsyncPolicy, Persistence
from shardserve.server.rank.store import ShardStore

ROWS, COLUMNS = 64, 8
NOT_DURABLE = TensorOptions(durable=False)


def _meta() -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((ROWS, COLUMNS), TensorProperties())


def _store(root: Path, policy: FsyncPolicy = FsyncPolicy.ALWAYS) -> ShardStore:
    return ShardStore(
        0, shared_memory=True, version_grace=0, persistence=Persistence(0, root, policy)
    )


def _install(store: ShardStore, name: str, options: TensorOptions | None = None) -> torch.Tensor:
    table = torch.randn(ROWS, COLUMNS)
    shard = store.memory.empty((ROWS, COLUMNS), table.dtype, True).copy_(table)
    store.install(name, 1, _meta(), {0: shard}, options)
    return table


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_a_not_durable_version_writes_no_file(tmp_path):
    store = _store(tmp_path)
    _install(store, "weights", NOT_DURABLE)
    store.promote("weights", 1)
    store.allocate_copy("weights", 2, _meta(), 1, NOT_DURABLE)  # a row update of it
    with store.leases.lease("weights", 2, served=False) as record:
        assert not record.options.durable
    store.promote("weights", 2)
    store.drop("weights", 1)
    assert _files(tmp_path) == []
    store.persistence.close()
    assert _store(tmp_path).restore() == []  # a restart does not have it


def test_a_durable_version_is_written_and_restored(tmp_path):
    store = _store(tmp_path)
    table = _install(store, "kept")
    store.promote("kept", 1)
    names = {p.name for p in _files(tmp_path)}
    assert {"tensor.json", "v1.json", "v1.s0.safetensors"} <= names
    store.persistence.close()
    again = _store(tmp_path)
    assert again.restore() == [("kept", 1)]
    again.promote("kept", 1)
    assert torch.equal(again.local_tensor("kept", 1, 0), table)


def test_a_batch_of_both_persists_only_the_durable_ones(tmp_path):
    store = _store(tmp_path)
    _install(store, "kept")
    _install(store, "weights", NOT_DURABLE)
    _install(store, "kept2")
    store.promote_many([("kept", 1), ("weights", 1), ("kept2", 1)])
    store.persistence.close()
    again = _store(tmp_path)
    assert sorted(again.restore()) == [("kept", 1), ("kept2", 1)]


def _syncs(monkeypatch: pytest.MonkeyPatch, root: Path, count: int) -> int:
    """How many fsyncs and filesystem syncs a PromoteMany of `count` fresh durable tensors makes."""
    store = _store(root / str(count))
    for i in range(count):
        _install(store, f"t{i}")
    calls = []
    real_fsync, real_syncfs = os.fsync, persist_files.sync_filesystem
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(
        persistence, "sync_filesystem", lambda path: calls.append("syncfs") or real_syncfs(path)
    )
    store.promote_many([(f"t{i}", 1) for i in range(count)])
    monkeypatch.undo()
    store.persistence.close()
    assert len(_store(root / str(count)).restore()) == count
    return len(calls)


def test_a_promote_many_syncs_a_bounded_number_of_times(tmp_path, monkeypatch):
    few, many = _syncs(monkeypatch, tmp_path, 2), _syncs(monkeypatch, tmp_path, 20)
    assert 0 < few == many <= 2


def test_a_promote_many_of_updates_logs_every_promote(tmp_path):
    store = _store(tmp_path)
    tables = {name: _install(store, name) for name in ("a", "b", "c")}
    store.promote_many([(name, 1) for name in tables])
    for name, table in tables.items():
        store.allocate_copy(name, 2, _meta(), 1)
        values = torch.randn(1, COLUMNS)
        store.persistence.log_rows(name, 2, 0, np.array([3]), values)
        with store.leases.rewrite(name, 2, 0, torch.tensor([3])) as shard:
            shard.index_copy_(0, torch.tensor([3]), values)
        table[3] = values[0]
    store.promote_many([(name, 2) for name in tables])
    store.persistence.close()
    again = _store(tmp_path)
    restored = again.restore()
    for name, table in tables.items():
        assert (name, 2) in restored
        again.promote(name, 2)
        assert torch.equal(again.local_tensor(name, 2, 0), table)
