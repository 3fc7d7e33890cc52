"""The catalog's documents: a tensor's document is the JSON text of its fields with sorted keys (its layout and
options embedded as text encoded once per layout and per options, the same bytes as encoding them in place),
and it reads back to the same record; a snapshot's document embeds its tensors' documents."""

from __future__ import annotations

import base64
import json

import torch

from shardserve.core.metadata import (
    Box,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    interned,
)
from shardserve.core.tensor_options import TensorOptions
from shardserve.server.coordinator.catalog.documents import (
    layout_json,
    layout_of,
    snapshot_json,
    tensor_json,
    tensor_of,
)
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorRecord,
    TensorState,
)


def _layout(*ranks: int) -> ShardedTensorMetadata:
    shards = tuple(ShardMetadata((i, 0), (1, 3), f"rank:{r}/cpu") for i, r in enumerate(ranks))
    return ShardedTensorMetadata(
        shards, (len(ranks), 3), TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    )


def _expected(record: TensorRecord) -> str:
    """The document written field by field with the standard library (sorted keys, no spaces)."""
    meta = record.metadata
    document = {
        "name": record.name,
        "version": record.version,
        "state": record.state.value,
        "metadata": {
            "size": list(meta.size),
            "dtype": "bfloat16",
            "requires_grad": True,
            "pin_memory": False,
            "shards": [
                {
                    "offsets": list(s.shard_offsets),
                    "sizes": list(s.shard_sizes),
                    "placement": str(s.placement),
                }
                for s in meta.shards_metadata
            ],
        },
        "options": {
            "oov": record.options.oov,
            "default_row": base64.b64encode(record.options.default_row).decode("ascii"),
            "durable": record.options.durable,
        },
        "created_unix": record.created_unix,
        "put_token": record.put_token,
        "owner": record.owner,
        "promoting": record.promoting,
        "lost_shards": list(record.lost_shards),
        "checksums": [f"{c:016x}" for c in record.checksums],
    }
    if record.reserved:
        document["reserved"] = True
    if record.creator:
        document["creator"] = record.creator
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


RECORDS = [
    TensorRecord("w", 3, _layout(0, 1), created_unix=1.5, checksums=(1, 2**64 - 1)),
    TensorRecord(
        "p@2/é",
        9,
        _layout(0, 1),
        state=TensorState.READY,
        options=TensorOptions("zero", b"\x00\x01", durable=False),
        owner="alice",
        lost_shards=(1,),
    ),
    TensorRecord("w", 4, _layout(2, 0, 1), promoting=True, put_token="t-1"),
    TensorRecord("w", 5, _layout(0, 1), reserved=True),
    TensorRecord("p@3/w", 6, _layout(0, 1), creator="5f0c2e"),
]


def test_a_tensor_document_is_its_fields_json_and_reads_back_to_the_record():
    for record in RECORDS:
        text = tensor_json(record)
        assert text == _expected(record)
        assert tensor_of(text) == record


def test_a_snapshot_document_embeds_its_tensors_documents():
    snapshot = SnapshotRecord(
        "p", 2, 1, tuple(SnapshotEntry(f"k{i}", r) for i, r in enumerate(RECORDS))
    )
    entries = json.loads(snapshot_json(snapshot))["entries"]
    assert [
        json.dumps(e["tensor"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        for e in entries
    ] == [_expected(r) for r in RECORDS]


def test_a_layout_read_from_its_text_is_the_layout_written_with_shards_as_the_constructor_makes_them():
    """A layout read from the layouts table's text (made without the constructor's coercions) equals the one
    written field by field, its offsets and sizes tuples of ints, its placements parsed, None kept; and it
    is the one live object of that layout (interned), so caches keyed on layouts find it."""
    original = ShardedTensorMetadata(
        (
            ShardMetadata((0, 0, 0), (2, 3, 4), "rank:0/cpu"),
            ShardMetadata((2, 0, 0), (0, 3, 4), "rank:1/cuda:1"),
            ShardMetadata((2, 0, 0), (2, 3, 4), None),
        ),
        (4, 3, 4),
        TensorProperties(dtype=torch.float16, pin_memory=True),
    )
    text = layout_json(original)
    layout_of.cache_clear()
    read = layout_of(text)
    assert read == original and hash(read) == hash(original)
    assert read is interned(original)
    for got, want in zip(read.shards_metadata, original.shards_metadata, strict=True):
        assert (got.shard_offsets, got.shard_sizes, got.placement) == (
            want.shard_offsets,
            want.shard_sizes,
            want.placement,
        )
        assert all(type(v) is int for v in got.shard_offsets + got.shard_sizes)
        assert got.box == Box(want.shard_offsets, want.shard_sizes)
        assert hash(got.box) == hash(Box(want.shard_offsets, want.shard_sizes))
    assert [s.rank for s in read.shards_metadata[:2]] == [0, 1]
    assert str(read.shards_metadata[1].device) == "cuda:1"
