"""The lease of leadership and the fencing of writes, over SQLite and PostgreSQL alike (the `store` fixture),
each coordinator with a catalog of its own over one store: of two holders that contend one wins; a lease that
runs out passes to the next holder with the next term; a write fenced with a term that no longer holds the
lease is refused (NotLeader, naming the leader) and changes nothing."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from waiting import wait_until

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.protos.errors import Reason
from shardserve.server.common.errors import NotLeader
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorRecord,
    TensorState,
)

SHORT_LEASE_S = 0.5
"""A lease that runs out soon, for the tests that wait for one to run out (never a fixed sleep)."""


def row(name: str, version: int, state: TensorState = TensorState.PENDING) -> TensorRecord:
    return TensorRecord(
        name=name, version=version, state=state, metadata=ShardedTensorMetadata(size=(2,))
    )


@pytest.fixture
def two(store):
    """Two coordinators' catalogs over one store."""
    first, second = store.open(), store.open()
    yield first, second
    first.close()
    second.close()


def test_of_two_holders_that_contend_one_wins(two):
    leases = [catalog.leadership() for catalog in two]
    assert leases[0].leader() is None  # never held
    start = threading.Barrier(2)
    terms: dict[str, int | None] = {}

    def contend(holder: str, index: int) -> None:
        start.wait()
        terms[holder] = leases[index].try_acquire(holder, f"{holder}:50051")

    threads = [threading.Thread(target=contend, args=(h, i)) for i, h in enumerate(("a", "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [holder for holder, term in terms.items() if term is not None]
    assert len(winners) == 1 and terms[winners[0]] == 1, terms
    loser = "b" if winners[0] == "a" else "a"
    assert leases[0].leader() == leases[1].leader() == (f"{winners[0]}:50051", 1)
    assert (
        leases[0].try_acquire(loser, "x:1") is None and leases[1].try_acquire(loser, "x:1") is None
    )


def remaining(store) -> float:
    """Seconds the lease row has left by the database's clock (read behind the catalog's back)."""
    if store.kind == "sqlite":
        db = sqlite3.connect(store.location)
        (left,) = db.execute(
            "SELECT expires_at - ((julianday('now') - 2440587.5) * 86400.0) FROM leader"
        ).fetchone()
        db.close()
        return float(left)
    import psycopg

    with psycopg.connect(store.location) as db:
        (left,) = db.execute(
            "SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM leader"
        ).fetchone()
    return float(left)


def test_a_renewal_moves_the_end_of_the_lease_on_by_its_duration(store, two):
    first, second = (catalog.leadership(lease_duration=10.0) for catalog in two)
    term = first.try_acquire("a", "a:1")
    assert term == 1 and 9.0 < remaining(store) <= 10.0
    wait_until(lambda: remaining(store) < 8.0, 10.0, "two seconds of the lease to pass")
    assert first.renew(term)
    assert remaining(store) > 8.0  # by the database's clock: a full duration again
    assert second.try_acquire("b", "b:1") is None and second.leader() == ("a:1", 1)


def test_a_lease_that_runs_out_passes_to_the_next_holder_with_the_next_term(two):
    first = two[0].leadership(lease_duration=SHORT_LEASE_S)
    second = two[1].leadership(lease_duration=60.0)  # b's lease outlasts the checks below
    assert first.try_acquire("a", "a:1") == 1
    taken: list[int] = []
    wait_until(
        lambda: taken.append(second.try_acquire("b", "b:1") or 0) or taken[-1],
        10.0,
        "the lease to run out and pass to b",
    )
    assert taken[-1] == 2 and second.leader() == ("b:1", 2) == first.leader()
    assert not first.renew(1)  # deposed: its term is gone for good
    assert first.try_acquire("a", "a:1") is None  # b's lease is live


def test_a_resigned_lease_passes_at_once_and_its_term_cannot_be_renewed(two):
    first, second = (catalog.leadership() for catalog in two)
    assert first.try_acquire("a", "a:1") == 1
    first.resign(1)
    assert first.leader() is None and not first.renew(1)
    assert second.try_acquire("b", "b:1") == 2  # no wait for the 3 s lease
    first.resign(1)  # a stale term resigns nothing
    assert second.leader() == ("b:1", 2) and second.renew(2)


def test_a_holder_that_acquires_again_gets_a_new_term_that_fences_its_old_one(two):
    catalog, _ = two
    lease = catalog.leadership()
    assert lease.try_acquire("a", "a:1") == 1
    assert lease.try_acquire("a", "a:2") == 2  # the same holder restarted: the old term is fenced
    catalog.fence(1)
    with pytest.raises(NotLeader):
        catalog.add(row("t", 1))
    catalog.fence(2)
    catalog.add(row("t", 1))
    assert catalog.get("t", 1) is not None


def test_a_write_with_a_stale_term_is_refused_and_changes_nothing(two):
    deposed, leader = two
    old = deposed.leadership(lease_duration=60.0)
    term = old.try_acquire("a", "a:1")
    deposed.fence(term)
    deposed.add_all([row("t", 1), row("p@1/w", 2)])
    deposed.commit("t", 1)
    before = deposed.contents()
    old.resign(term)  # or its lease ran out: either way b takes it over
    assert leader.leadership().try_acquire("b", "b:50051") == 2
    leader.fence(2)
    snapshot = SnapshotRecord("p", 1, 1, (SnapshotEntry("w", row("p@1/w", 2)),))
    writes = {
        "add": lambda: deposed.add(row("u", 3)),
        "commit": lambda: deposed.commit_all([("t", 1)]),
        "update": lambda: deposed.update(row("t", 1, TensorState.READY)),
        "remove": lambda: deposed.remove("t"),
        "snapshot": lambda: deposed.commit_snapshot(snapshot),
        "versions": lambda: deposed.next_versions(5000),  # past its reserved block: a counter write
        "restore": lambda: deposed.restore(before, replace=True),
    }
    for what, write in writes.items():
        with pytest.raises(NotLeader, match="passed to term 2") as refused:
            write()
        assert refused.value.reason is Reason.NOT_LEADER, what
        assert refused.value.metadata == {"leader": "b:50051", "term": 2}, what
    assert deposed.contents() == before  # nothing changed
    leader.add(row("u", 3))  # the leader writes
    assert deposed.get("u", 3) is not None  # reads are not fenced


def test_a_fenced_write_after_the_lease_ran_out_is_refused_though_no_one_took_it(two):
    catalog, _ = two
    lease = catalog.leadership(lease_duration=2.0)
    catalog.fence(lease.try_acquire("a", "a:1"))
    catalog.add(row("t", 1))
    wait_until(lambda: lease.leader() is None, 10.0, "the lease to run out")
    with pytest.raises(NotLeader, match="ran out and no coordinator leads"):
        catalog.add(row("u", 2))
    assert lease.renew(1)  # no one took it: the holder renews and writes again
    catalog.add(row("u", 2))
    assert [r.name for r in catalog.list(include_pending=True)] == ["t", "u"]


def test_an_unfenced_catalog_writes_whoever_leads(two):
    catalog, _ = two
    catalog.leadership().try_acquire("a", "a:1")
    catalog.fence(None)
    catalog.add(row("t", 1))
    assert catalog.get("t", 1) is not None
