"""A replaced version's grace period on a rank: it ends when its time is over (the main loop's `end_graces`), in
the order the versions were replaced, and early, oldest first, when a reservation needs the room."""

from __future__ import annotations

import torch
from fake_clock import FakeClock

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.version_table import VersionState as S

ROWS, COLUMNS = 16, 8
NBYTES = ROWS * COLUMNS * 4


def _meta():
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((ROWS, COLUMNS), TensorProperties())


def _served(store: ShardStore, name: str, version: int) -> None:
    store.allocate(name, version, _meta(), fill=InitFill.ARANGE)
    store.promote(name, version)


def _replace(store: ShardStore, name: str) -> None:
    """Serve version 2 of `name` and drop version 1: version 1 stays served for its grace period."""
    _served(store, name, 2)
    store.drop(name, 1)


def _states(store: ShardStore) -> dict[tuple[str, int], S]:
    return {(name, version): state for name, version, state in store.held()}


def test_graces_end_when_their_time_is_over_in_the_order_they_began():
    clock = FakeClock()
    store = ShardStore(0, version_grace=2.0, clock=clock)
    for name in ("a", "b", "c"):
        _served(store, name, 1)
    _replace(store, "a")
    clock.advance(1.0)
    _replace(store, "b")
    clock.advance(0.5)
    _replace(store, "c")
    store.drop("a", 1)  # dropped again while graced: its grace keeps its end
    assert _states(store)[("a", 1)] is S.GRACED

    clock.advance(0.5)  # a's grace (2 s) is over; b's and c's are not
    assert store.end_graces() == 1
    assert ("a", 1) not in _states(store)
    assert _states(store)[("b", 1)] is S.GRACED
    assert torch.equal(
        store.local_tensor("b", 1, 0).flatten(), torch.arange(float(ROWS * COLUMNS))
    )  # still readable

    clock.advance(1.0)  # b's is over too
    assert store.end_graces() == 1
    assert set(_states(store)) == {("a", 2), ("b", 2), ("c", 1), ("c", 2)}
    clock.advance(10.0)
    assert store.end_graces() == 1 and store.end_graces() == 0
    assert all(state is S.SERVED for state in _states(store).values())


def test_a_reservation_ends_the_oldest_graces_first_and_only_as_many_as_it_needs():
    clock = FakeClock()
    store = ShardStore(0, version_grace=60.0, clock=clock, memory_limit=6 * NBYTES)
    for name in ("a", "b", "c"):
        _served(store, name, 1)
    for name in ("b", "a", "c"):  # replaced in this order
        _replace(store, name)
        clock.advance(1.0)
    assert store.memory_used == 6 * NBYTES

    store.allocate("d", 1, _meta())  # needs one version's room: the oldest grace (b's) ends
    assert ("b", 1) not in _states(store)
    assert {key for key, state in _states(store).items() if state is S.GRACED} == {
        ("a", 1),
        ("c", 1),
    }
    store.allocate("e", 1, _meta())  # then a's
    assert {key for key, state in _states(store).items() if state is S.GRACED} == {("c", 1)}
    assert store.memory_used == 6 * NBYTES


def test_a_shorter_grace_begun_later_ends_first():
    """The grace in force when a version is replaced is its own: one replaced later under a shorter grace ends
    before one replaced earlier under a longer one."""
    clock = FakeClock()
    store = ShardStore(0, version_grace=60.0, clock=clock)
    for name in ("long", "short"):
        _served(store, name, 1)
    _replace(store, "long")
    store.version_grace = 1.0
    _replace(store, "short")
    clock.advance(2.0)
    assert store.end_graces() == 1
    assert ("short", 1) not in _states(store) and _states(store)[("long", 1)] is S.GRACED
