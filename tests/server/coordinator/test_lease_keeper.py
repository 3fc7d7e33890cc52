"""Two coordinators' lease keepers over one catalog, SQLite and PostgreSQL alike (the `store` fixture), stepped
by hand: one leads and the other stands by naming it; a leader that stops renewing (hung) stops serving before
the standby takes over in a new term, with a new rendezvous store and a new epoch, and its catalog writes are
refused; a leader that stops resigns, so the standby leads without waiting for the lease to lapse. The lease
runs on the database's clock, so these wait for it with bounded polls; the servers are the real parts of each
term."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from waiting import wait_until

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.protos.errors import Reason
from shardserve.server.common.auth import Security
from shardserve.server.common.errors import NotLeader
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.lease_keeper import LeaseKeeper
from shardserve.server.coordinator.options import CoordinatorOptions
from shardserve.server.coordinator.process import CoordinatorProcess
from shardserve.server.coordinator.role import CoordinatorRole
from shardserve.server.coordinator.role_view import Role

LEASE_S = 1.0


@pytest.fixture
def keepers(store, tmp_path) -> Iterator[tuple[LeaseKeeper, LeaseKeeper]]:
    """Keepers "a" and "b" over one catalog, their threads not started (the test steps them)."""
    made: list[LeaseKeeper] = []
    leases: list[Catalog] = []
    options = CoordinatorOptions(lease_duration=LEASE_S)
    for name in ("a", "b"):
        process = CoordinatorProcess(store.location, tmp_path, Security(), options)
        leases.append(store.open())
        role = CoordinatorRole(f"{name}:1", lease_duration=LEASE_S)
        made.append(LeaseKeeper(leases[-1].leadership(LEASE_S), role, process.build))
    yield made[0], made[1]
    for keeper in made:
        keeper.stop()
    for catalog in leases:
        catalog.close()


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
    assert (a.role.view().role, a.role.view().term) == (Role.LEADER, 1)


def test_a_hung_leader_stops_before_the_standby_takes_over_and_writes_nothing_after(keepers):
    a, b = keepers
    a.step()
    old = a.role.leading()
    old_epoch, old_store = old.collectives.epochs.current, old.collectives.store_port

    def standby_took_over() -> bool:  # "a" hangs: it renews no more
        b.step()
        b_leads = _leads(
            b
        )  # read "b" first: "a" leading after "b" began would be two leaders at once
        assert not (b_leads and _leads(a)), "two coordinators led at once"
        return b_leads

    wait_until(standby_took_over, 10 * LEASE_S, "the standby to take over")
    new = b.role.leading()
    assert b.role.view().term == 2
    assert new.collectives.epochs.current > old_epoch  # jobs of the new term run in a new epoch
    assert new.collectives.store_port != old_store  # over the new leader's rendezvous store
    with pytest.raises(NotLeader) as refused:  # "a"'s term's catalog, as its drivers would write it
        old.catalog.add(
            TensorRecord(name="late", version=10**6, metadata=ShardedTensorMetadata(size=(2,)))
        )
    assert refused.value.metadata == {"leader": "b:1", "term": 2}
    assert new.catalog.list(include_pending=True) == []
    a.step()  # "a" wakes: its renewal is refused; it stands by naming "b", its term's parts closed
    assert a.role.current() is None
    with pytest.raises(NotLeader) as named:
        a.role.leading()
    assert named.value.metadata["leader"] == "b:1"


def test_a_leader_that_stops_resigns_and_the_standby_leads_at_once(keepers):
    a, b = keepers
    a.step()
    b.step()
    assert not _leads(b)
    a.stop()
    b.step()  # the lease has not lapsed: it was handed back
    assert _leads(b) and b.role.view().term == 2
