"""The leader's lease in the SQLite catalog file, on a fake wall clock: one holder at a time, terms that only
grow, renewal, lapse and resignation; and the fencing of the catalog's writes: a deposed leader's write
transaction is refused (UNAVAILABLE, NOT_LEADER naming the new leader) and writes nothing."""

from __future__ import annotations

import grpc
import pytest
from fake_clock import FakeClock

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata
from shardserve.protos.errors import Reason
from shardserve.server.common.errors import NotLeader
from shardserve.server.coordinator.catalog.leadership import Leader
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.catalog.sqlite_leadership import SQLiteLeadership

LEASE_S = 2.0
ONE_SHARD = ShardedTensorMetadata((ShardMetadata((0,), (4,), "rank:0/cpu"),), (4,))


@pytest.fixture
def path(tmp_path):
    return tmp_path / "catalog.sqlite"


@pytest.fixture
def clock():
    return FakeClock(now=1_700_000_000.0)


@pytest.fixture
def leases(path, clock):
    """Two coordinators' views of one file (two connections, as two processes have)."""
    a = SQLiteLeadership(path, lease_duration=LEASE_S, clock=clock)
    b = SQLiteLeadership(path, lease_duration=LEASE_S, clock=clock)
    yield a, b
    a.close()
    b.close()


def test_one_holder_at_a_time_until_its_lease_lapses(leases, clock):
    a, b = leases
    assert a.leader() is None
    assert a.try_acquire("a", "host-a:1") == 1
    assert b.try_acquire("b", "host-b:1") is None
    assert b.leader() == Leader("host-a:1", 1)
    clock.advance(LEASE_S - 0.1)
    assert b.try_acquire("b", "host-b:1") is None  # not lapsed yet
    clock.advance(0.2)
    assert b.leader() is None
    assert b.try_acquire("b", "host-b:1") == 2
    assert a.leader() == Leader("host-b:1", 2)
    assert not a.renew(1)  # term 1 was taken over: its renewal fails
    assert a.try_acquire("a", "host-a:1") is None


def test_renewing_keeps_the_lease_and_resigning_frees_it_at_once(leases, clock):
    a, b = leases
    assert a.try_acquire("a", "host-a:1") == 1
    for _ in range(5):  # renewed each half lease: never lapses
        clock.advance(LEASE_S / 2)
        assert a.renew(1)
        assert b.try_acquire("b", "host-b:1") is None
    a.resign(1)
    assert b.leader() is None
    assert b.try_acquire("b", "host-b:1") == 2
    a.resign(1)  # an old term resigning changes nothing
    assert a.leader() == Leader("host-b:1", 2)


def test_terms_only_grow_across_reopening(path, clock):
    first = SQLiteLeadership(path, lease_duration=LEASE_S, clock=clock)
    assert first.try_acquire("a", "host-a:1") == 1
    first.resign(1)
    first.close()
    again = SQLiteLeadership(path, lease_duration=LEASE_S, clock=clock)
    assert again.try_acquire("a", "host-a:1") == 2
    again.close()


def test_a_deposed_leader_writes_nothing(leases, clock, path):
    a, b = leases
    assert a.try_acquire("a", "host-a:1") == 1
    old = SQLiteCatalog(path, term=1)
    old.add(TensorRecord(name="before", version=old.next_version(), metadata=ONE_SHARD))
    clock.advance(LEASE_S + 0.1)
    assert b.try_acquire("b", "host-b:1") == 2
    with pytest.raises(NotLeader) as refused:
        old.add(TensorRecord(name="after", version=10_000, metadata=ONE_SHARD))
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert refused.value.reason == Reason.NOT_LEADER
    assert refused.value.metadata == {"leader": "host-b:1", "term": 2}
    with pytest.raises(NotLeader):
        old.remove("before")
    new = SQLiteCatalog(path, term=2)
    assert [r.name for r in new.list(include_pending=True)] == ["before"]
    new.add(TensorRecord(name="new", version=new.next_version(), metadata=ONE_SHARD))
    assert [r.name for r in old.list(include_pending=True)] == ["before", "new"]  # reads still work
    old.close()
    new.close()
