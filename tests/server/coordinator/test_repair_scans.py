"""The repair loop's catalog scans: every round while a copy may be unavailable (a rank down or changed lately,
an unavailable copy seen), else once per SETTLED_S, since a scan decodes every row of the catalog."""

from __future__ import annotations

import pytest
import torch
from fake_clock import FakeClock

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.coordinator.catalog.records import TensorRecord, TensorState
from shardserve.server.coordinator.drivers import repair
from shardserve.server.coordinator.ranks.info import RankInfo
from shardserve.server.coordinator.ranks.registry import RankRegistry

JUST = 0.01  # a moment past a bound


class Catalog:
    """The rows the loop scans, and how many scans there were."""

    def __init__(self, records: list[TensorRecord]) -> None:
        self.records, self.scans = records, 0

    def list(self) -> list[TensorRecord]:
        self.scans += 1
        return self.records


class Reshards:
    default_timeout_s = 60.0

    def is_running(self, name: str) -> bool:
        return False


def record(lost: tuple[int, ...] = ()) -> TensorRecord:
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (4, 2), TensorProperties(dtype=torch.float32)
    )
    return TensorRecord(
        name="t", version=1, metadata=meta, state=TensorState.READY, lost_shards=lost
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock):
    registry = RankRegistry(dead_after=60.0, clock=clock)
    info = RankInfo(
        rank=0, address="127.0.0.1:7001", device="cpu", hostname="node-a", world_size=1, pid=100
    )
    registry.register(info, [])
    yield registry
    registry.close()


def driver(catalog: Catalog, registry: RankRegistry, clock: FakeClock) -> repair.RepairDriver:
    return repair.RepairDriver(
        catalog,  # type: ignore[arg-type]
        registry=registry,
        reshards=Reshards(),  # type: ignore[arg-type]
        clock=clock,
    )


def test_a_settled_cluster_with_every_copy_available_is_scanned_once_per_settled_period(
    registry, clock
):
    loop = driver(Catalog([record()]), registry, clock)
    assert loop.scan_due()  # nothing scanned yet, and rank 0 registered just now
    clock.advance(repair.SETTLED_S + JUST)
    assert loop.scan_due()  # settled, but never scanned
    loop.run_once()
    assert not loop.scan_due()
    clock.advance(repair.SETTLED_S - JUST)
    assert not loop.scan_due()  # within the settled period
    clock.advance(JUST)
    assert loop.scan_due()  # the periodic scan
    loop.run_once()
    registry.mark_exited(0, "process 100 was killed by SIGKILL")
    assert loop.scan_due()  # a rank is down: every round


def test_an_unavailable_copy_keeps_every_round_scanning(registry, clock):
    catalog = Catalog(
        [record(lost=(0,))]
    )  # its only copy lost: cannot be repaired, stays unavailable
    loop = driver(catalog, registry, clock)
    clock.advance(repair.SETTLED_S + JUST)
    loop.run_once()
    assert loop.scan_due() and catalog.scans == 1
    catalog.records = [record()]
    loop.run_once()
    assert not loop.scan_due()
