"""The coordinator's chores abort pending versions: past the pending timeout, and at once those of snapshots
another coordinator created (a pending snapshot lives in the memory of the coordinator that created it, so no
commit can reach them after a restart or a failover). A real SQLite catalog and the real Upkeep thread; the
tensors' lifecycle and the reshards are stand-ins that record what they are asked."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from waiting import wait_until

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.upkeep import Upkeep

LAYOUT = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
    (4, 4), TensorProperties(dtype=torch.float32)
)


class Lifecycle:
    """Aborts recorded, and the version removed from the catalog as the real abort does."""

    def __init__(self, catalog: SQLiteCatalog) -> None:
        self.catalog = catalog
        self.aborted: list[tuple[str, int]] = []

    def abort(self, name: str, version: int) -> None:
        self.aborted.append((name, version))
        self.catalog.remove(name, version)


class Reshards:
    """No reshard runs; each chores round ends with finish_promotions (counted)."""

    def __init__(self) -> None:
        self.rounds = 0

    def is_running(self, name: str) -> bool:
        return False

    def finish_promotions(self) -> None:
        self.rounds += 1


class Registry:
    def report_dead(self) -> None:
        return None


def test_the_chores_abort_the_pending_snapshot_versions_of_other_coordinators_only(
    tmp_path: Path,
) -> None:
    catalog = SQLiteCatalog(tmp_path / "catalog.sqlite")
    now = time.time()
    catalog.add_all(
        [
            TensorRecord("p@1/w", 1, LAYOUT, created_unix=now - 60, creator="earlier"),
            # another coordinator's, on a clock running ahead of this one's
            TensorRecord("p@1/b", 2, LAYOUT, created_unix=now + 30, creator="earlier"),
            # a plain put's pending version: its commit can reach it from any coordinator
            TensorRecord("plain", 3, LAYOUT, created_unix=now - 60),
            # this coordinator's own, however its clock moved
            TensorRecord("p@2/w", 4, LAYOUT, created_unix=now - 60, creator="this"),
            TensorRecord("old", 5, LAYOUT, created_unix=now - 7200),  # past the timeout
        ]
    )
    lifecycle, reshards = Lifecycle(catalog), Reshards()
    upkeep = Upkeep(
        catalog,
        registry=Registry(),  # type: ignore[arg-type]
        lifecycle=lifecycle,  # type: ignore[arg-type]
        reconciler=None,  # type: ignore[arg-type]
        reshards=reshards,  # type: ignore[arg-type]
        heartbeat_interval=0.05,
        pending_timeout=3600,
        coordinator_id="this",
    )
    upkeep.start()
    try:
        wait_until(lambda: reshards.rounds >= 1, 30, "one round of chores")
    finally:
        upkeep.close()
    assert sorted(lifecycle.aborted) == [("old", 5), ("p@1/b", 2), ("p@1/w", 1)]
    assert sorted(r.key for r in catalog.pending()) == [("p@2/w", 4), ("plain", 3)]
