"""The coordinator's snapshot answers: the FULL view carries every entry with its health, the BASIC view (a
writer's commit) none, with the same number, state and sizes; a committed snapshot's FULL answer is prepared
for its readers, built once. A listing with its layouts apart sends each layout once and reads as the full
one."""

from __future__ import annotations

import threading

import pytest
import torch
from waiting import wait_until

from shardserve.client.catalog_requests import tensors_listed
from shardserve.client.errors import ShardServeError
from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.answers import Answers
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorRecord,
    TensorState,
)
from shardserve.server.coordinator.drivers.repair import RepairInFlight


def _layout(*ranks: int) -> ShardedTensorMetadata:
    """Shards of 4 elements, shard i on ranks[i]."""
    return ShardedTensorMetadata(
        tuple(ShardMetadata((4 * i,), (4,), f"rank:{r}/cpu") for i, r in enumerate(ranks)),
        (4 * len(ranks),),
        TensorProperties(dtype=torch.float32),
    )


def _snapshot(count: int, number: int = 7) -> SnapshotRecord:
    meta = _layout(0, 1)
    entries = tuple(
        SnapshotEntry(f"w{i}", TensorRecord(name=f"m@7/w{i}", version=8 + i, metadata=meta))
        for i in range(count)
    )
    return SnapshotRecord("m", number, 1, entries, state=TensorState.READY, skeleton='{"t":"d"}')


def test_the_basic_view_leaves_out_the_entries_and_keeps_the_rest() -> None:
    answers = Answers(rank_unreadable=lambda rank: rank == 1, repair=lambda name: None)
    record = _snapshot(3)
    full = answers.snapshot(record)
    basic = answers.snapshot(record, pb.SNAPSHOT_VIEW_BASIC)
    assert [e.key for e in full.entries] == ["w0", "w1", "w2"]
    assert list(full.entries[0].tensor.unavailable_shards) == [1]  # health from the live registry
    assert len(basic.entries) == 0
    assert (basic.prefix, basic.number, basic.state, basic.keep, basic.skeleton) == (
        "m",
        7,
        pb.READY,
        1,
        '{"t":"d"}',
    )
    assert basic.nbytes == full.nbytes == 3 * 8 * 4


def test_a_full_answer_is_kept_for_its_record_and_the_ranks_that_cannot_be_read() -> None:
    down: set[int] = set()
    repairing: dict[str, RepairInFlight] = {}
    answers = Answers(rank_unreadable=lambda rank: rank in down, repair=repairing.get)
    record = _snapshot(3)
    first = answers.snapshot(record)
    first.entries[
        0
    ].tensor.health = "changed by the caller"  # a copy: the kept answer is not touched
    again = answers.snapshot(record)
    assert again is not first and again.entries[0].tensor.health == "healthy"
    assert [list(e.tensor.unavailable_shards) for e in again.entries] == [[], [], []]
    down.add(1)  # rank 1 goes down: its shards are answered unavailable at once
    assert [list(e.tensor.unavailable_shards) for e in answers.snapshot(record).entries] == [
        [1]
    ] * 3
    down.clear()
    assert answers.snapshot(record) == again
    repairing["m@7/w1"] = RepairInFlight(9, 4, 16, 0.0, (0,))
    assert answers.snapshot(record).entries[1].tensor.repair.bytes_done == 4
    repairing["m@7/w1"] = RepairInFlight(9, 12, 16, 0.0, (0,))
    assert (
        answers.snapshot(record).entries[1].tensor.repair.bytes_done == 12
    )  # never kept meanwhile


class _CountedRepairs:
    """The repair driver's answer (none in flight), counting the calls: each tensor is asked once to see whether
    an answer may be kept, and once more in each build of the answer."""

    def __init__(self, block_at: int = 0) -> None:
        self.calls = 0
        self.block_at = block_at
        self.release = threading.Event()

    def __call__(self, name: str) -> RepairInFlight | None:
        self.calls += 1
        if self.calls == self.block_at:
            assert self.release.wait(30.0)
        return None


def test_a_committed_snapshots_answer_is_prepared_for_its_readers() -> None:
    """prepare_snapshot builds and keeps the FULL answer on its own thread once its prefix has readers: the
    reader's call after it only copies it (its tensors asked once each, to see whether it may be kept, not
    twice); a prefix nobody has read gets nothing prepared."""
    repairs = _CountedRepairs()
    answers = Answers(rank_unreadable=lambda rank: False, repair=repairs)
    unread = _snapshot(4, number=6)
    answers.prepare_snapshot(unread)
    answers.snapshot(_snapshot(4, number=5))  # a reader of the prefix, after that commit
    record = _snapshot(4)
    answers.prepare_snapshot(record)
    answers.close()  # the preparation finished
    repairs.calls = 0
    assert [e.key for e in answers.snapshot(record).entries] == ["w0", "w1", "w2", "w3"]
    assert repairs.calls == 4
    answers.snapshot(unread)
    assert repairs.calls == 4 + 4 + 4  # built by its reader: not prepared
    answers.prepare_snapshot(
        _snapshot(4, number=8)
    )  # once closed, nothing is prepared (nothing fails)


def test_a_reader_waits_for_the_answer_being_built_rather_than_build_another() -> None:
    repairs = _CountedRepairs()  # blocks at the prepared build's first tensor, below
    answers = Answers(rank_unreadable=lambda rank: False, repair=repairs)
    answers.snapshot(_snapshot(4, number=6))  # a reader of the prefix
    repairs.calls, repairs.block_at = 0, 4 + 1
    record = _snapshot(4)
    answers.prepare_snapshot(record)
    read: list[pb.SnapshotInfo] = []
    reader = threading.Thread(target=lambda: read.append(answers.snapshot(record)))
    reader.start()
    wait_until(lambda: repairs.calls >= 4 + 1 + 4, 30.0, "the reader to ask about its tensors")
    repairs.release.set()
    reader.join(30.0)
    answers.close()
    assert [e.key for e in read[0].entries] == ["w0", "w1", "w2", "w3"]
    assert repairs.calls == 4 + 4 + 4  # two checks, one build


def test_a_listing_with_its_layouts_apart_sends_each_once_and_reads_as_the_full_one() -> None:
    """Each distinct layout is in the answer once, each tensor names it by index and carries no copy; the
    shards that cannot be read (on a dead rank, or lost) are each tensor's own; the client reads both answers
    into the same summaries."""
    records = [
        TensorRecord(name=f"t{i}", version=i + 1, metadata=_layout(*ranks), lost_shards=lost)
        for i, (ranks, lost) in enumerate(
            [((0, 1), ()), ((1, 2, 3), ()), ((0, 1), (0,)), ((1, 2, 3), (2,)), ((2, 0), ())]
        )
    ]
    answers = Answers(rank_unreadable=lambda rank: rank == 1, repair=lambda name: None)
    full = answers.tensors(records)
    apart = answers.tensors(records, layouts_apart=True)
    assert len(full.layouts) == 0 and all(t.HasField("metadata") for t in full.tensors)
    assert len(apart.layouts) == 3 and not any(t.HasField("metadata") for t in apart.tensors)
    assert [t.layout for t in apart.tensors] == [0, 1, 0, 1, 2]
    assert [list(t.unavailable_shards) for t in apart.tensors] == [[1], [0], [0, 1], [0, 2], []]
    assert [t.health for t in apart.tensors] == [t.health for t in full.tensors]
    listed = tensors_listed(apart, include_pending=True)
    assert listed == tensors_listed(full, include_pending=True)
    assert [s.metadata for s in listed] == [r.metadata for r in records]


def test_a_listing_that_names_a_layout_it_does_not_hold_is_refused() -> None:
    answers = Answers(rank_unreadable=lambda rank: False, repair=lambda name: None)
    apart = answers.tensors(
        [TensorRecord(name="t", version=1, metadata=_layout(0))], layouts_apart=True
    )
    apart.tensors[0].layout = 1
    with pytest.raises(ShardServeError, match="layout 1 for tensor 't', of 1 layouts"):
        tensors_listed(apart, include_pending=True)
