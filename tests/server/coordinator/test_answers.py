"""The coordinator's snapshot answers: the FULL view carries every entry with its health, the BASIC view (a
writer's commit) none, with the same number, state and sizes."""

from __future__ import annotations

import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.answers import Answers
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorRecord,
    TensorState,
)


def _snapshot(count: int) -> SnapshotRecord:
    meta = ShardedTensorMetadata(
        (ShardMetadata((0,), (4,), "rank:0/cpu"), ShardMetadata((4,), (4,), "rank:1/cpu")),
        (8,),
        TensorProperties(dtype=torch.float32),
    )
    entries = tuple(
        SnapshotEntry(f"w{i}", TensorRecord(name=f"m@7/w{i}", version=8 + i, metadata=meta))
        for i in range(count)
    )
    return SnapshotRecord("m", 7, 1, entries, state=TensorState.READY, skeleton='{"t":"d"}')


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
