"""The catalog's records as JSON documents: what a row of the tensors and snapshots tables holds.

Plain JSON of the domain records (server/coordinator/records.py), versioned by the catalog's schema version
(PRAGMA user_version, server/coordinator/catalog_schema.py); never protobuf, never pickle.
"""

from __future__ import annotations

import base64
import functools
import json
from typing import Any

from shardserve.core.dtypes import dtype_from_name, dtype_name
from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.server.coordinator.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorOptions,
    TensorRecord,
    TensorState,
)


def tensor_json(record: TensorRecord) -> str:
    return json.dumps(tensor_document(record), sort_keys=True, separators=(",", ":"))


def tensor_of(text: str) -> TensorRecord:
    return tensor_from_document(json.loads(text))


def snapshot_json(snapshot: SnapshotRecord) -> str:
    document = {
        "prefix": snapshot.prefix,
        "number": snapshot.number,
        "keep": snapshot.keep,
        "state": snapshot.state.value,
        "created_unix": snapshot.created_unix,
        "entries": [{"key": e.key, "tensor": tensor_document(e.tensor)} for e in snapshot.entries],
        "skeleton": snapshot.skeleton,
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


DECODED_SNAPSHOTS = 16
"""Snapshot documents whose records are kept decoded (records are immutable, and a document that changes is
another key): every reader of a weight sync's snapshot asks for the same one, and decoding hundreds of
tensors costs milliseconds."""


@functools.lru_cache(maxsize=DECODED_SNAPSHOTS)
def snapshot_of(text: str) -> SnapshotRecord:
    document = json.loads(text)
    return SnapshotRecord(
        prefix=document["prefix"],
        number=document["number"],
        keep=document["keep"],
        entries=tuple(
            SnapshotEntry(e["key"], tensor_from_document(e["tensor"])) for e in document["entries"]
        ),
        state=TensorState(document["state"]),
        created_unix=document["created_unix"],
        skeleton=document.get("skeleton", ""),
    )


def tensor_document(record: TensorRecord) -> dict[str, Any]:
    meta = record.metadata
    return {
        "name": record.name,
        "version": record.version,
        "state": record.state.value,
        "metadata": {
            "size": list(meta.size),
            "dtype": dtype_name(meta.dtype),
            "requires_grad": meta.tensor_properties.requires_grad,
            "pin_memory": meta.tensor_properties.pin_memory,
            "shards": [
                {
                    "offsets": list(s.shard_offsets),
                    "sizes": list(s.shard_sizes),
                    "placement": None if s.placement is None else str(s.placement),
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
        "checksums": [f"{value:016x}" for value in record.checksums],
    }


def tensor_from_document(document: dict[str, Any]) -> TensorRecord:
    layout = document["metadata"]
    metadata = ShardedTensorMetadata(
        tuple(
            ShardMetadata(tuple(s["offsets"]), tuple(s["sizes"]), s["placement"])
            for s in layout["shards"]
        ),
        tuple(layout["size"]),
        TensorProperties(
            dtype=dtype_from_name(layout["dtype"]),
            requires_grad=layout["requires_grad"],
            pin_memory=layout["pin_memory"],
        ),
    )
    options = document["options"]
    return TensorRecord(
        name=document["name"],
        version=document["version"],
        metadata=metadata,
        state=TensorState(document["state"]),
        options=TensorOptions(
            options["oov"],
            base64.b64decode(options["default_row"]),
            durable=options.get("durable", True),  # catalogs written before the field: durable
        ),
        created_unix=document["created_unix"],
        put_token=document["put_token"],
        owner=document["owner"],
        promoting=document["promoting"],
        lost_shards=tuple(document["lost_shards"]),
        checksums=tuple(int(value, 16) for value in document["checksums"]),
    )
