"""Two coordinators' lease keepers over one SQLite catalog, stepped by hand on one fake clock (the lease's and
the keepers' time): one leads and the other stands by naming it; a leader that stops renewing (hung) stops
serving before its lease lapses and the standby takes over in a new term, with a new rendezvous store and a
new epoch; a leader cut from the database stops serving before its lease can pass; a leader that stops resigns,
so the standby leads at once. The servers are the real parts of each term."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import grpc
import pytest
from fake_clock import FakeClock

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata
from shardserve.protos.errors import Reason
from shardserve.server.common.auth import Security
from shardserve.server.common.errors import NotLeader
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.catalog.sqlite_leadership import SQLiteLeadership
from shardserve.server.coordinator.lease_keeper import LeaseKeeper
from shardserve.server.coordinator.options import CoordinatorOptions
from shardserve.server.coordinator.process import CoordinatorProcess
from shardserve.server.coordinator.role import CoordinatorRole
from shardserve.server.coordinator.role_view import Role

LEASE_S = 0.5  # fake seconds (binary fractions: exact sums); a renewal blocked by a busy file gives up after a
# quarter of it (real seconds)
TICK_S = LEASE_S / 4
ONE_SHARD = ShardedTensorMetadata((ShardMetadata((0,), (4,), "rank:0/cpu"),), (4,))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(now=1024.0)


@pytest.fixture
def keepers(tmp_path, clock) -> Iterator[tuple[LeaseKeeper, LeaseKeeper]]:
    """Keepers "a" and "b" over one catalog file, neither started (the test steps them)."""
    path = tmp_path / "catalog.sqlite"
    made = []
    for name in ("a", "b"):
        process = CoordinatorProcess(path, Security(), CoordinatorOptions(lease_duration=LEASE_S))
        role = CoordinatorRole(f"{name}:1", lease_duration=LEASE_S, clock=clock)
        leadership = SQLiteLeadership(path, lease_duration=LEASE_S, clock=clock)
        made.append(LeaseKeeper(leadership, role, process.build, clock=clock))
    yield made[0], made[1]
    for keeper in made:
        keeper.stop()


def _leads(keeper: LeaseKeeper) -> bool:
    try:
        keeper.role.leading()
    except NotLeader:
        return False
    return True


def test_one_leads_and_the_other_stands_by_naming_it(keepers):
    a, b = keepers
    a.step()
    b.step()
    assert _leads(a) and not _leads(b)
    with pytest.raises(NotLeader) as refused:
        b.role.leading()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert refused.value.reason == Reason.NOT_LEADER
    assert refused.value.metadata == {"leader": "a:1", "term": 1}
    view = b.role.view()
    assert (view.role, view.term, view.leader, view.leader_term) == (Role.STANDBY, 0, "a:1", 1)
    assert a.role.view().role == Role.LEADER and a.role.view().term == 1


def test_a_hung_leader_stops_serving_before_the_standby_takes_over_in_a_new_term(keepers, clock):
    a, b = keepers
    a.step()
    old = a.role.leading()
    old_epoch, old_store = old.collectives.epochs.current, old.collectives.store_port
    for _ in range(3):  # "a" hangs: it renews no more; "b" keeps trying
        clock.advance(TICK_S)
        b.step()
    assert not _leads(a)  # three quarters of a lease: "a" refuses by its own clock ...
    assert not _leads(b)  # ... before its lease lapsed
    clock.advance(TICK_S + 0.125)
    b.step()
    new = b.role.leading()
    assert b.role.view().term == 2
    assert new.collectives.epochs.current > old_epoch  # jobs of the new term run in a new epoch
    assert new.collectives.store_port != old_store  # over the new leader's rendezvous store
    a.step()  # "a" wakes: its renewal is refused and it stands by, its term's parts closed
    assert a.role.current() is None
    with pytest.raises(NotLeader) as refused:
        a.role.leading()
    assert refused.value.metadata["leader"] == "b:1"


def test_a_leader_cut_from_the_database_stops_before_its_lease_can_pass(keepers, clock, tmp_path):
    a, b = keepers
    a.step()
    acquired = clock()
    blocker = sqlite3.connect(tmp_path / "catalog.sqlite", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the file: "a"'s renewals fail
    try:
        clock.advance(TICK_S)
        a.step()
        assert _leads(a)  # one failed renewal: it still has time
        clock.advance(2 * TICK_S)
        assert not _leads(a)  # its serving time ran out: refused before the lease lapsed
        assert clock() < acquired + LEASE_S
        a.step()
        assert a.role.current() is None  # and its term's parts are closed
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    b.step()
    assert not _leads(b)  # the lease has not lapsed yet
    clock.advance(TICK_S + 0.125)
    b.step()
    assert _leads(b) and b.role.view().term == 2


def test_a_deposed_leaders_catalog_writes_are_refused(keepers, clock):
    a, b = keepers
    a.step()
    deposed = a.role.leading().catalog  # "a"'s term's catalog, as its drivers write it
    clock.advance(LEASE_S + 0.125)
    b.step()
    assert b.role.view().term == 2
    with pytest.raises(NotLeader) as refused:
        deposed.add(TensorRecord(name="late", version=10_000, metadata=ONE_SHARD))
    assert refused.value.metadata == {"leader": "b:1", "term": 2}
    with pytest.raises(NotLeader):
        deposed.next_versions(5_000)  # past its reserved block: a write too
    assert [r.name for r in b.role.leading().catalog.list(include_pending=True)] == []


def test_a_leader_that_stops_resigns_and_the_standby_leads_at_once(keepers):
    a, b = keepers
    a.step()
    b.step()
    assert not _leads(b)
    a.stop()
    b.step()  # no time passed
    assert _leads(b) and b.role.view().term == 2
