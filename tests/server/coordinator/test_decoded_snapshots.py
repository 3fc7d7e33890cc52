"""The decoded snapshot records the catalog keeps by document text: what a commit wrote is read back without
decoding, equal to what decoding its document gives, and only the latest few are kept, holding a bounded number
of tensors."""

from __future__ import annotations

from dataclasses import replace

import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.server.coordinator.catalog.documents import DecodedSnapshots, snapshot_json
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorOptions,
    TensorRecord,
    TensorState,
)
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog

LAYOUT = ShardedTensorMetadata(  # a row of three shards, one of them replicated
    tuple(ShardMetadata((6 * i,), (6,), f"rank:{i}/cpu") for i in range(3))
    + (ShardMetadata((0,), (6,), "rank:2/cpu"),),
    (18,),
    TensorProperties(torch.float16),
)


def _snapshot(number: int, *, keys: tuple[str, ...] = ("w", "b")) -> SnapshotRecord:
    entries = tuple(
        SnapshotEntry(
            key,
            TensorRecord(
                f"p@{number}/{key}",
                number * 10 + i,
                LAYOUT,
                options=TensorOptions(durable=False),
                created_unix=1.5 + number,
            ),
        )
        for i, key in enumerate(keys)
    )
    return SnapshotRecord("p", number, 2, entries, created_unix=2.25 + number, skeleton='{"k": 1}')


def test_a_remembered_record_is_read_back_without_decoding_and_equals_a_decoding() -> None:
    committed = _snapshot(1).committed({("p@1/w", 10): {0: 7, 1: 8}, ("p@1/b", 11): {1: 9}})
    assert committed.state is TensorState.READY
    text = snapshot_json(committed)
    decoded = DecodedSnapshots()
    decoded.remember(text, committed)
    assert decoded.get(text) is committed
    fresh = DecodedSnapshots().get(text)
    assert fresh == committed and fresh is not committed


def test_only_the_latest_documents_are_kept() -> None:
    decoded = DecodedSnapshots(size=2)
    records = [_snapshot(n) for n in (1, 2, 3)]
    texts = [snapshot_json(r) for r in records]
    for text, record in zip(texts, records):
        decoded.remember(text, record)
    assert decoded.get(texts[2]) is records[2] and decoded.get(texts[1]) is records[1]
    assert decoded.get(texts[0]) == records[0] and decoded.get(texts[0]) is not records[0]


def test_the_records_kept_hold_a_bounded_number_of_tensors_the_newest_whatever_its_size() -> None:
    decoded = DecodedSnapshots(size=16, tensors=5)
    small = [_snapshot(n) for n in (1, 2)]  # 2 tensors each
    large = _snapshot(3, keys=tuple(f"k{i}" for i in range(7)))
    texts = [snapshot_json(r) for r in (*small, large)]
    for text, record in zip(texts[:2], small):
        decoded.remember(text, record)
    assert all(decoded.peek(text) is not None for text in texts[:2])
    decoded.remember(texts[1], small[1])  # remembered again: counted once
    decoded.remember(texts[2], large)  # 7 tensors alone: the others go, it stays
    assert [decoded.peek(text) for text in texts] == [None, None, large]
    decoded.remember(texts[0], small[0])
    assert [decoded.peek(text) for text in texts] == [small[0], None, None]


def test_a_sqlite_commit_is_read_back_as_the_record_it_returned(tmp_path) -> None:
    catalog = SQLiteCatalog(str(tmp_path / "catalog.sqlite"))
    try:
        snapshot = _snapshot(1)
        catalog.add_all(snapshot.tensors())
        committed, _ = catalog.commit_snapshot(snapshot)
        assert catalog.snapshot("p") is committed and catalog.snapshot("p", 1) is committed
        assert DecodedSnapshots().get(snapshot_json(committed)) == committed
    finally:
        catalog.close()


def test_a_delta_snapshot_counts_each_box_once_and_its_document_keeps_what_it_shares() -> None:
    """The ranks answer shared bytes per local shard; a replicated box (shards 0 and 3 here) counts once, and
    the count and the snapshot copied travel through the document and back."""
    delta = replace(_snapshot(2), delta_of=1)
    shared = {("p@2/w", 20): {0: 4, 3: 4, 1: 2}, ("p@2/b", 21): {2: 6}}
    counted = delta.sharing(shared)
    assert counted.shared_nbytes == 4 + 2 + 6
    text = snapshot_json(counted.committed({}))
    back = DecodedSnapshots().get(text)
    assert (back.delta_of, back.shared_nbytes) == (1, 12)
    plain = DecodedSnapshots().get(snapshot_json(_snapshot(3)))
    assert (plain.delta_of, plain.shared_nbytes) == (0, 0)
