"""The repair loop's catalog scans: every round while a copy may be unavailable (a rank down or changed lately,
an unavailable copy seen), else once per SETTLED_S; a scan reads the rows of dead ranks and lost copies only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fake_clock import FakeClock

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.coordinator.catalog.records import TensorRecord, TensorState
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.drivers import repair
from shardserve.server.coordinator.ranks.info import RankInfo
from shardserve.server.coordinator.ranks.registry import RankRegistry

JUST = 0.01  # a moment past a bound


class Catalog(SQLiteCatalog):
    """A real catalog that counts the loop's scans (the candidate queries it starts each scan with)."""

    scans = 0

    def placed_ranks(self) -> set[int]:
        self.scans += 1
        return super().placed_ranks()


class Reshards:
    default_timeout_s = 60.0

    def is_running(self, name: str) -> bool:
        return False


def record(
    lost: tuple[int, ...] = (), *, name: str = "t", version: int = 1, ranks: tuple[int, ...] = (0,)
) -> TensorRecord:
    meta = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        (4, 2), TensorProperties(dtype=torch.float32)
    )
    return TensorRecord(
        name=name, version=version, metadata=meta, state=TensorState.READY, lost_shards=lost
    )


@pytest.fixture
def catalog(tmp_path):
    catalog = Catalog(tmp_path / "catalog.sqlite")
    yield catalog
    catalog.close()


def holding(catalog: Catalog, records: list[TensorRecord]) -> Catalog:
    """`catalog` holding exactly `records`."""
    for old in catalog.list(include_pending=True):
        catalog.remove(old.name)
    catalog.add_all(records)
    return catalog


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
    catalog, registry, clock
):
    loop = driver(holding(catalog, [record()]), registry, clock)
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


def test_a_copy_that_cannot_be_repaired_is_scanned_again_on_a_change_not_every_round(
    catalog, registry, clock
):
    """Its only copy lost, a tensor cannot be repaired: scanning it every round would read its row every half
    second for nothing. It is scanned again when the ranks change (a rank back may hold a copy) or after
    SETTLED_S."""
    holding(catalog, [record(lost=(0,))])
    loop = driver(catalog, registry, clock)
    clock.advance(repair.SETTLED_S + JUST)
    loop.run_once()
    assert not loop.scan_due() and catalog.scans == 1
    clock.advance(repair.SETTLED_S)
    assert loop.scan_due()  # the periodic scan
    loop.run_once()
    registry.report_dead()  # nothing died: no change
    assert not loop.scan_due()
    registry.mark_exited(0, "process 100 was killed by SIGKILL")
    assert loop.scan_due()


def test_a_copy_waiting_for_repair_after_is_scanned_again_when_it_is_due(catalog, clock):
    """A rank dead for less than repair_after: its copies are repaired once it has been dead that long, so the
    next scan is due then (and not every round before)."""
    registry = RankRegistry(dead_after=600.0, clock=clock)
    for rank in (0, 1):
        info = RankInfo(rank=rank, address=f"127.0.0.1:{7001 + rank}", device="cpu", world_size=2)
        registry.register(info, [])
    holding(catalog, [record(ranks=(0, 1))])
    loop = repair.RepairDriver(
        catalog,  # type: ignore[arg-type]
        registry=registry,
        reshards=Reshards(),  # type: ignore[arg-type]
        repair_after=repair.SETTLED_S + 5.0,
        clock=clock,
    )
    registry.mark_exited(1, "process 1 was killed by SIGKILL")
    clock.advance(repair.SETTLED_S + JUST)
    loop.run_once()  # rank 1 dead for SETTLED_S: 5 s more to wait, sooner than the periodic scan
    assert not loop.scan_due()
    clock.advance(5.0 - 2 * JUST)
    assert not loop.scan_due()
    clock.advance(2 * JUST)
    assert loop.scan_due()
    registry.close()


def test_a_scan_reads_only_the_versions_on_dead_ranks_and_those_with_lost_copies(catalog, clock):
    """Of many tensors, the candidates are the READY ones with a shard on a rank that is dead now or a copy a
    rank lost; a rank the coordinator never heard of counts dead once the unregistered grace is over."""
    records = [record(name=f"on{r}", version=10 + r, ranks=(r, (r + 1) % 4)) for r in range(4)] + [
        record(lost=(0,), name="lost", version=20, ranks=(0,))
    ]
    holding(catalog, records)
    catalog.add(replace(record(name="pending", version=30, ranks=(2,)), state=TensorState.PENDING))
    registry = RankRegistry(dead_after=60.0, clock=clock)
    for rank in (0, 1, 2):  # rank 3 never registers
        info = RankInfo(rank=rank, address=f"127.0.0.1:{7001 + rank}", device="cpu", world_size=4)
        registry.register(info, [])
    loop = driver(catalog, registry, clock)
    assert loop.candidates() == [records[4]]  # rank 3 is not dead before the grace is over
    clock.advance(registry.heartbeats.unregistered_grace(4) + JUST)
    for rank in (0, 1, 2):
        registry.heartbeat(rank, 0)
    assert [r.name for r in loop.candidates()] == ["lost", "on2", "on3"]  # rank 3 never registered
    registry.mark_exited(1, "process 101 was killed by SIGKILL")
    assert [r.name for r in loop.candidates()] == ["lost", "on0", "on1", "on2", "on3"]
    registry.close()


class CountingRegistry(RankRegistry):
    """A real registry that counts the listings of every rank asked of it."""

    listings = 0

    def ranks(self) -> list[RankInfo]:
        self.listings += 1
        return super().ranks()


def test_a_scan_that_finds_nothing_to_repair_lists_no_rank(catalog, clock):
    """The ranks' listing (where a repaired copy may go) is read only when a copy needs repairing: a thousand
    ranks registering make the loop scan every round, and each listing costs the coordinator all of them."""
    registry = CountingRegistry(dead_after=60.0, clock=clock)
    for rank in range(2):
        registry.register(
            RankInfo(
                rank=rank,
                address=f"127.0.0.1:{7001 + rank}",
                device="cpu",
                world_size=2,
                pid=100 + rank,
            ),
            [],
        )
    try:
        loop = driver(holding(catalog, [record(ranks=(0, 1))]), registry, clock)
        loop.run_once()
        assert registry.listings == 0  # every copy available
        registry.mark_exited(1, "process 101 was killed by SIGKILL")
        loop.run_once()
        assert registry.listings == 1  # rank 1's copy is due: where may it go
    finally:
        registry.close()


def test_tensors_that_cannot_be_repaired_are_logged_in_one_line_per_scan_and_once(
    catalog, registry, clock, caplog
):
    """A rank lost without replicas leaves each of its tensors beyond repair: one ERROR line names the first few
    with their reason and counts the rest, and a later scan that finds nothing new logs nothing."""
    count = repair.REFUSALS_NAMED + 2
    holding(catalog, [record(lost=(0,), name=f"t{i}", version=i + 1) for i in range(count)])
    loop = driver(catalog, registry, clock)
    clock.advance(repair.SETTLED_S + JUST)
    with caplog.at_level("ERROR", logger=repair.__name__):
        loop.run_once()
        [line] = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"{count} tensors cannot be repaired now: 't0' version 1: ")
        assert "'t4' version 5" in line and "'t5'" not in line
        assert line.endswith("; and 2 more (`shardserve status` shows the health of each)")
        caplog.clear()
        clock.advance(repair.SETTLED_S)
        loop.run_once()  # the periodic scan: the same tensors, for the same reasons
        assert not caplog.records
