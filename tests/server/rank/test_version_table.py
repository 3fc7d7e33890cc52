"""The version state machine and table alone (no store, no processes): every legal and illegal transition."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardserve.core.metadata import make_metadata
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.rank.errors import (
    InvalidState,
    StaleVersion,
    TensorBusy,
    TensorNotFound,
    WriteIncomplete,
)
from shardserve.server.rank.version_table import (
    TRANSITIONS,
    ShardProgress,
    StoredVersion,
    VersionEvent,
    VersionState,
    VersionTable,
    next_state,
)

S, E = VersionState, VersionEvent
LEGAL = {
    (S.RESERVED, E.FILL): S.PENDING,
    (S.RESERVED, E.DROP): S.DROPPED,
    (S.PENDING, E.PROMOTE): S.SERVED,
    (S.PENDING, E.DROP): S.DROPPED,
    (S.SERVED, E.PROMOTE): S.SERVED,
    (S.SERVED, E.REPLACE): S.GRACED,
    (S.SERVED, E.DROP): S.DROPPED,
    (S.GRACED, E.PROMOTE): S.GRACED,
    (S.GRACED, E.REPLACE): S.GRACED,
    (S.GRACED, E.DROP): S.DROPPED,
    (S.DROPPED, E.DROP): S.DROPPED,
    (S.DROPPED, E.FREE): S.FREED,
}
META = make_metadata((4, 2), [((0, 0), (2, 2), 0), ((2, 0), (2, 2), 1)])


def test_the_table_is_the_one_written_down_here():
    assert TRANSITIONS == LEGAL


@pytest.mark.parametrize(("state", "event"), list(itertools.product(VersionState, VersionEvent)))
def test_every_state_and_event(state: VersionState, event: VersionEvent):
    """A legal step leads where the table says; any other raises InvalidState and changes nothing."""
    record = _record("t", 1, state)
    if (state, event) in LEGAL:
        record.apply(event)
        assert record.state is LEGAL[(state, event)] is next_state(state, event)
    else:
        with pytest.raises(InvalidState, match=f"a {state.value} version cannot {event.value}"):
            record.apply(event)
        assert record.state is state


def test_freed_is_final_and_only_dropped_versions_are_freed():
    assert not [event for (state, event) in LEGAL if state is S.FREED]
    assert [state for (state, event) in LEGAL if event is E.FREE] == [S.DROPPED]


def test_a_dropped_version_is_freed_when_its_last_lease_ends():
    table = VersionTable(0)
    record = _record("t", 1, S.SERVED)
    table.add(record)
    table.lease(record)
    record.apply(E.DROP)
    assert not table.free_if_unleased(record)  # still leased
    assert table.unlease(record) and record.state is S.FREED
    assert table.records() == []


def test_lookups_name_what_is_wrong():
    table = VersionTable(0)
    with pytest.raises(TensorNotFound, match="'t' not found on rank 0"):
        table.get("t", 1)
    table.add(_record("t", 1, S.PENDING))
    table.add(_record("t", 2, S.SERVED))
    table.add(_record("t", 3, S.GRACED))
    assert table.served("t", 0).version == 3  # the newest readable one
    with pytest.raises(StaleVersion, match="version 1 is not served here; served version is 3"):
        table.served("t", 1)
    with pytest.raises(InvalidState, match="already committed"):
        table.pending("t", 2)
    assert table.replaced(table.get("t", 2)) and not table.replaced(table.get("t", 3))
    with pytest.raises(InvalidState, match="already allocated"):
        table.add(_record("t", 1, S.PENDING))
    table.remember_dropped("t", 9)
    with pytest.raises(TensorBusy, match="was dropped on rank 0 before this allocation"):
        table.add(_record("t", 9, S.PENDING))


def test_lookups_by_name_see_only_that_name_and_forget_freed_versions():
    table = VersionTable(0)
    for name in ("t", "u"):
        for version, state in ((1, S.SERVED), (2, S.PENDING)):
            table.add(_record(name, version, state))
    assert [r.version for r in table.matching("t", 0)] == [1, 2]
    assert [r.key for r in table.matching("u", 2)] == [("u", 2)]
    assert table.matching("t", 3) == [] and table.matching("v", 0) == []
    for record in table.matching("t", 0):
        record.apply(E.DROP)
        assert table.free_if_unleased(record)
    assert table.matching("t", 0) == []
    with pytest.raises(TensorNotFound, match="'t' not found"):
        table.get("t", 1)
    assert table.served("u", 0).key == ("u", 1)
    table.add(_record("t", 5, S.SERVED))  # the name comes back with a new version
    assert table.served("t", 0).version == 5


def test_a_version_is_promotable_once_every_local_shard_is_whole():
    table = VersionTable(1)
    record = _record("t", 1, S.PENDING)
    table.add(record)
    with pytest.raises(WriteIncomplete, match=r"shards \[1\] on rank 1"):
        table.promotable("t", 1)
    record.progress.mark_filled([1])
    assert table.promotable("t", 1) is record


def test_shard_progress_counts_overlapping_changes_and_torn_ones():
    progress = ShardProgress()
    progress.mark_filled([0])
    assert progress.open_change(0) and progress.open_change(0) is False
    progress.close_change(0, None)  # one change failed: torn
    progress.close_change(0, True)  # another finished: still torn
    assert progress.unfinished([0]) == [0]
    progress.open_change(
        0
    )  # a fresh round starts with the shard idle: its old failure is forgotten
    assert progress.torn == set()
    progress.close_change(0, True)
    assert progress.unfinished([0]) == []


def test_a_shard_handed_to_an_in_place_writer_is_torn_until_it_says_done():
    progress = ShardProgress()
    progress.mark_filled([0, 1])
    assert progress.finish_in_place(0) is False  # never handed over: refused
    progress.open_in_place(0)
    assert progress.unfinished([0, 1]) == [0]  # a writer dying now publishes nothing
    assert progress.finish_in_place(0) is True
    assert progress.unfinished([0, 1]) == []
    assert progress.finish_in_place(0) is False  # once


def test_bytes_sent_for_a_shard_take_it_back_from_its_in_place_writer():
    progress = ShardProgress()
    progress.open_in_place(0)
    progress.open_change(0)
    progress.close_change(0, None)  # the sent bytes failed half way
    assert progress.finish_in_place(0) is False  # the in-place writer cannot complete it now
    assert progress.unfinished([0]) == [0]


def _record(name: str, version: int, state: VersionState) -> StoredVersion:
    shards = {1: torch.zeros(2, 2)}
    return StoredVersion(name, version, META, TensorOptions(), 16, shards, state=state)
