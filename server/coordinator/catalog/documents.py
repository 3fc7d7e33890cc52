"""The catalog's records as JSON documents: what a row of the tensors and snapshots tables holds.

Plain JSON of the domain records (server/coordinator/catalog/records.py), versioned by the catalog's schema version
(PRAGMA user_version, server/coordinator/catalog/sqlite_schema.py); never protobuf, never pickle. Encoded and decoded by
orjson (a maintained C library, several times faster than the standard json module, same JSON): a snapshot
commit writes and reads hundreds of these documents on a weight sync's critical path. A layout's part of the
document is made once per layout and decoded once per distinct layout (both cached): the tensors of a state
dict put every step have the same few layouts every step.
"""

from __future__ import annotations

import base64
import functools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, overload

import orjson

from shardserve.core.dtypes import dtype_from_name, dtype_name
from shardserve.core.metadata import (
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    as_placement,
    interned,
)
from shardserve.server.coordinator.catalog.records import (
    SnapshotEntry,
    SnapshotRecord,
    TensorOptions,
    TensorRecord,
    state_of,
)

LAYOUTS_CACHED = 4096
"""Distinct layouts kept encoded and decoded (each a few hundred bytes): a state dict's tensors share a few."""


def dumps(document: Any) -> str:
    """`document` as compact JSON text with sorted keys (the catalog's documents and the SQL parameters)."""
    return orjson.dumps(document, option=orjson.OPT_SORT_KEYS).decode()


def loads(text: str | bytes) -> Any:
    """A catalog document's JSON text decoded."""
    return orjson.loads(text)


def tensor_json(record: TensorRecord) -> str:
    return dumps(tensor_document(record))


def tensor_row_json(record: TensorRecord) -> str:
    """The document of a row whose layout the catalog keeps apart (SQLite's layouts table, the row naming it
    by id): the record without its layout, which was two thirds of a 10-shard tensor's document and most of
    what decoding a row cost (tensor_of then takes the layout's document)."""
    document = tensor_document(record)
    del document["metadata"]
    return dumps(document)


def tensor_of(text: str, layout: str | None = None) -> TensorRecord:
    """The record of a row's document; `layout`, the document of its layout when the row names one (the
    catalog's layouts table: the row's own document then holds none, tensor_row_json), decoded once per
    distinct layout instead of once per row."""
    return tensor_from_document(loads(text), None if layout is None else layout_of(layout))


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def layout_of(text: str) -> ShardedTensorMetadata:
    """The layout of a layout document's text (layout_document, as JSON): made from the document at once, the
    text being the cache's key (a restarted coordinator's first listing decodes every distinct layout)."""
    document = loads(text)
    return _made_layout(
        ((tuple(s["offsets"]), tuple(s["sizes"]), s["placement"]) for s in document["shards"]),
        tuple(document["size"]),
        document["dtype"],
        document["requires_grad"],
        document["pin_memory"],
    )


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
    if snapshot.delta_of:
        document["delta_of"] = snapshot.delta_of
        document["shared_nbytes"] = snapshot.shared_nbytes
    return dumps(document)


DECODED_SNAPSHOTS = 16
"""Snapshot documents whose records are kept decoded (records are immutable, and a document that changes is
another key): every reader of a weight sync's snapshot asks for the same one, and decoding hundreds of
tensors costs milliseconds (5,000 tensors: 0.2 s)."""

DECODED_TENSORS = 32768
"""The most tensors those records hold together (the newest snapshot is kept whatever its size): every record
kept is an object the cyclic collector walks in each full collection, and sixteen snapshots of 10,000 tensors
(480,000 objects) made each of a commit's one or two full collections cost ~80 ms."""


class DecodedSnapshots:
    """The records of the latest DECODED_SNAPSHOTS snapshot documents, holding DECODED_TENSORS tensors at most,
    by document text: those read back, and those a commit wrote (so that the first reader of a new snapshot,
    every step of a weight sync, does not decode what the commit had in hand)."""

    def __init__(self, size: int = DECODED_SNAPSHOTS, *, tensors: int = DECODED_TENSORS) -> None:
        self.size = size
        self.tensors = tensors
        self._records: OrderedDict[str, SnapshotRecord] = OrderedDict()
        self._held = 0  # tensors of the records kept
        self._lock = threading.Lock()

    def get(self, text: str) -> SnapshotRecord:
        """The record of document `text`, decoded on a miss."""
        with self._lock:
            record = self._records.get(text)
            if record is not None:
                self._records.move_to_end(text)
                return record
        record = _decode_snapshot(text)
        self.remember(text, record)
        return record

    def peek(self, text: str) -> SnapshotRecord | None:
        """The record of document `text` if kept decoded, else None (nothing decoded)."""
        with self._lock:
            return self._records.get(text)

    def forget(self) -> None:
        """Keep nothing decoded (what a new process starts with)."""
        with self._lock:
            self._records.clear()
            self._held = 0

    def remember(self, text: str, record: SnapshotRecord) -> None:
        """Keep `record` as the decoding of `text` (what snapshot_json(record) wrote), letting go of the oldest
        records past the bounds."""
        with self._lock:
            if text not in self._records:
                self._held += len(record.entries)
            self._records[text] = record
            self._records.move_to_end(text)
            while len(self._records) > 1 and (
                len(self._records) > self.size or self._held > self.tensors
            ):
                _, oldest = self._records.popitem(last=False)
                self._held -= len(oldest.entries)


DECODED = DecodedSnapshots()


def snapshot_of(text: str) -> SnapshotRecord:
    """The record of a snapshot document's text (decoded once while among the latest)."""
    return DECODED.get(text)


def _decode_snapshot(text: str) -> SnapshotRecord:
    document = loads(text)
    return SnapshotRecord(
        prefix=document["prefix"],
        number=document["number"],
        keep=document["keep"],
        entries=tuple(
            SnapshotEntry(e["key"], tensor_from_document(e["tensor"])) for e in document["entries"]
        ),
        state=state_of(document["state"]),
        created_unix=document["created_unix"],
        skeleton=document.get("skeleton", ""),
        delta_of=document.get("delta_of", 0),
        shared_nbytes=document.get("shared_nbytes", 0),
    )


def tensor_document(record: TensorRecord) -> dict[str, Any]:
    """The record's fields as JSON values; `reserved` and `creator` only where set (catalogs written before
    these fields read as unset)."""
    document = {
        "name": record.name,
        "version": record.version,
        "state": record.state.value,
        "metadata": _layout_fragment(record.metadata),
        "options": _options_fragment(record.options),
        "created_unix": record.created_unix,
        "put_token": record.put_token,
        "owner": record.owner,
        "promoting": record.promoting,
        "lost_shards": list(record.lost_shards),
        "checksums": [f"{value:016x}" for value in record.checksums],
    }
    if record.reserved:
        document["reserved"] = True
    if record.creator:
        document["creator"] = record.creator
    return document


def tensor_from_document(
    document: dict[str, Any], metadata: ShardedTensorMetadata | None = None
) -> TensorRecord:
    """The record of a document; `metadata`, its layout when already known (else read from the document)."""
    if metadata is None:
        metadata = layout_from_document(document["metadata"])
    options = document["options"]
    return TensorRecord(
        name=document["name"],
        version=document["version"],
        metadata=metadata,
        state=state_of(document["state"]),
        options=_options_of(
            options["oov"],
            options["default_row"],
            options.get("durable", True),  # catalogs written before the field: durable
        ),
        created_unix=document["created_unix"],
        put_token=document["put_token"],
        owner=document["owner"],
        promoting=document["promoting"],
        lost_shards=tuple(document["lost_shards"]),
        checksums=tuple([int(value, 16) for value in document["checksums"]]),
        reserved=document.get("reserved", False),
        creator=document.get("creator", ""),
    )


@functools.lru_cache(maxsize=64)
def _options_of(oov: str, default_row: str, durable: bool) -> TensorOptions:
    """The options a document holds (records share a few, and options never change: made once each)."""
    return TensorOptions(oov, base64.b64decode(default_row), durable=durable)


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def layout_json(meta: ShardedTensorMetadata) -> str:
    """A layout's document as JSON text (the layouts table's rows), encoded once per layout."""
    return dumps(layout_document(meta))


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _layout_fragment(meta: ShardedTensorMetadata) -> orjson.Fragment:
    """A layout's document as JSON text to embed in a tensor's document as it is: encoded once per layout, not
    once per row (a 10-shard layout was most of encoding a 10,000-tensor snapshot's documents)."""
    return orjson.Fragment(layout_json(meta))


@functools.lru_cache(maxsize=64)
def _options_fragment(options: TensorOptions) -> orjson.Fragment:
    """A tensor's options as JSON text to embed in its document (records share a few)."""
    return orjson.Fragment(
        dumps(
            {
                "oov": options.oov,
                "default_row": base64.b64encode(options.default_row).decode("ascii"),
                "durable": options.durable,
            }
        )
    )


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def layout_document(meta: ShardedTensorMetadata) -> dict[str, Any]:
    """The document of a layout (shared by every caller: encoded, never changed)."""
    return {
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
    }


def layout_from_document(layout: dict[str, Any]) -> ShardedTensorMetadata:
    """The layout a document holds, made once per distinct layout (the key is the document's values)."""
    shards = tuple(
        (tuple(s["offsets"]), tuple(s["sizes"]), s["placement"]) for s in layout["shards"]
    )
    key = (
        shards,
        tuple(layout["size"]),
        layout["dtype"],
        layout["requires_grad"],
        layout["pin_memory"],
    )
    return _layout(key)


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _layout(key: tuple[Any, ...]) -> ShardedTensorMetadata:
    return _made_layout(*key)


def _made_layout(
    shards: Iterable[tuple[tuple[int, ...], tuple[int, ...], str | None]],
    size: tuple[int, ...],
    dtype: str,
    requires_grad: bool,
    pin_memory: bool,
) -> ShardedTensorMetadata:
    """The layout of a document's values, the one object of it (interned: the requests' and other records'
    of this layout share it). Its shards are made without the constructor's coercions (a third of the cost):
    the catalog wrote their offsets and sizes as ints, from a layout validated when it was made."""
    return interned(
        ShardedTensorMetadata(
            tuple(
                ShardMetadata.of_ints(offsets, sizes, as_placement(placement))
                for offsets, sizes, placement in shards
            ),
            size,
            TensorProperties(
                dtype=dtype_from_name(dtype), requires_grad=requires_grad, pin_memory=pin_memory
            ),
        )
    )


class RemovedRows(Sequence[TensorRecord]):
    """Rows a transaction removed, kept as their stored documents and decoded on first read: a snapshot commit
    that removes hundreds of rows answers without decoding them; the drop that frees them reads them later.
    `layouts`: each row's layout document where the catalog keeps layouts apart (tensor_of: decoded once per
    distinct layout, not once per row)."""

    def __init__(self, documents: list[str], layouts: Sequence[str | None] = ()) -> None:
        self._documents = documents
        self._layouts = layouts or [None] * len(documents)
        self._records: list[TensorRecord] | None = None

    def __len__(self) -> int:
        return len(self._documents)

    @overload
    def __getitem__(self, index: int) -> TensorRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[TensorRecord]: ...

    def __getitem__(self, index: int | slice) -> TensorRecord | list[TensorRecord]:
        if self._records is None:
            self._records = [
                tensor_of(document, layout)
                for document, layout in zip(self._documents, self._layouts)
            ]
        return self._records[index]
