"""The queries of the coordinator's background work, on each store: the versions placed on given ranks (their
records, or their names, versions and states), the ranks any row places shards on, and the READY rows with lost
copies answer what a scan of every row answers, through every change of the rows; PostgreSQL answers the ranks'
query through its index (SQLite's indexes: test_catalog_layouts.py)."""

from __future__ import annotations

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


def layout(*placements: str) -> ShardedTensorMetadata:
    """One row per shard, shard i placed at placements[i]."""
    shards = tuple(ShardMetadata((i, 0), (1, 2), p) for i, p in enumerate(placements))
    return ShardedTensorMetadata(
        shards, (len(placements), 2), TensorProperties(dtype=torch.float32)
    )


def row(name: str, version: int, *ranks: int, **fields) -> TensorRecord:
    return TensorRecord(
        name=name, version=version, metadata=layout(*(f"rank:{r}/cpu" for r in ranks)), **fields
    )


def check_queries(catalog: Catalog, ranks: list[int]) -> list[tuple[str, int, TensorState]]:
    """Each query's answer against a scan's; the placed versions on `ranks`."""
    everything = catalog.list(include_pending=True)
    on = sorted(
        (r for r in everything if set(ranks) & set(r.metadata.ranks())), key=lambda r: r.version
    )
    assert [r.key for r in catalog.holding(ranks)] == [r.key for r in on]
    placed = [(p.name, p.version, p.state) for p in catalog.placed_versions(ranks)]
    assert placed == [(r.name, r.version, r.state) for r in on]
    assert catalog.placed_ranks() == {rank for r in everything for rank in r.metadata.ranks()}
    lost = sorted((r for r in everything if r.ready and r.lost_shards), key=lambda r: r.version)
    assert [r.key for r in catalog.with_lost_copies()] == [r.key for r in lost]
    return placed


def test_the_background_queries_follow_every_change_of_the_rows(store) -> None:
    catalog = store.open()
    try:
        assert check_queries(catalog, [0]) == [] and catalog.placed_ranks() == set()
        catalog.add_all([row("a", 1, 0, 1), row("b", 2, 1, 12), row("c", 3, 3, 3)])
        assert check_queries(catalog, [1]) == [
            ("a", 1, TensorState.PENDING),
            ("b", 2, TensorState.PENDING),
        ]
        assert check_queries(catalog, [12]) == [("b", 2, TensorState.PENDING)]  # 12, not 1 and 2
        assert check_queries(catalog, [2, 9]) == [] and check_queries(catalog, []) == []
        catalog.add(row("a", 4, 2, 2))
        catalog.commit("a", 4)
        assert check_queries(catalog, [2]) == [("a", 4, TensorState.READY)]
        catalog.update(
            replace(catalog.get("b", 2), metadata=layout("rank:5/cuda:1", "rank:13/cpu"))
        )
        assert check_queries(catalog, [13]) == [("b", 2, TensorState.PENDING)]
        assert check_queries(catalog, [12]) == []
        catalog.update(replace(catalog.get("a", 4), lost_shards=(1,)))
        assert [r.key for r in catalog.with_lost_copies()] == [("a", 4)]
        catalog.remove("a")
        assert check_queries(catalog, [0, 1, 2]) == []
        entries = (SnapshotEntry("w", row("p@9/w", 9, 6, 7)),)
        catalog.add_all([entry.tensor for entry in entries])
        catalog.commit_snapshot(SnapshotRecord("p", 9, 1, entries))
        assert check_queries(catalog, [7]) == [("p@9/w", 9, TensorState.READY)]
    finally:
        catalog.close()


def test_postgresql_finds_the_rows_on_given_ranks_through_its_index(postgres_url) -> None:
    """With sequential scans ruled out, the ranks' query is planned on the GIN index of the rows' ranks (on a
    table this small PostgreSQL would otherwise read every row, as it should)."""
    psycopg = pytest.importorskip("psycopg")
    from shardserve.server.coordinator.catalog.postgres import PostgresCatalog
    from shardserve.server.coordinator.catalog.postgres_schema import ON_RANKS

    catalog = PostgresCatalog(postgres_url)
    try:
        catalog.add_all([row(f"t{i}", i + 1, i % 5, (i + 1) % 5) for i in range(50)])
    finally:
        catalog.close()
    with psycopg.connect(postgres_url) as db:
        db.execute("SET enable_seqscan = off")
        plan = db.execute(
            f"EXPLAIN SELECT name, version FROM tensors WHERE {ON_RANKS}",
            ([1, 2],),
        ).fetchall()
    assert any("tensors_ranks" in step for (step,) in plan), plan
