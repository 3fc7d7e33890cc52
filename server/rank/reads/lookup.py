"""Embedding lookups on one rank: the work behind ShardServer.Lookup and LookupSmall.

A Lookup request holds several items, each (tensor, version, shard, ids). For
every item the rank leases the served version, checks the ids (raw int64, every
one a row of that shard) and answers either the rows (the shard's columns) or,
for pooled items, per-bag partial sums and counts (shardcore.embedding), so only
pooled rows travel. Answers stream item by item in chunks of about 1 MiB; the
first chunk of an item says the version it was served at. The id and row parsing
here serves WriteRows too (server/rank/writes/path.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from shardserve.core.dtypes import dtype_to_wire
from shardserve.core.embedding import partial_pool
from shardserve.core.wire import tensor_bytes
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.chunk_codec import LookupPart
from shardserve.server.common.requests import check_name, check_version
from shardserve.server.rank.errors import InvalidArgument, RequestTooLarge
from shardserve.server.rank.metrics import GRPC
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.table_rows import ID_BYTES, local_rows, parse_ids, parse_rows

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 16 << 20
MIN_CHUNK_BYTES = (
    4096  # a floor, so a hostile chunk_bytes=1 cannot turn one answer into millions of messages
)
SMALL_REPLY_BYTES = 4 << 20  # LookupSmall answers at most this many data bytes in its one message


@dataclass(frozen=True)
class ItemAnswer:
    """One item's answer before chunking: its raw C-order bytes, their dtype and, for pooled items, the raw
    int64 per-bag counts."""

    version: int
    dtype: torch.dtype
    data: memoryview
    counts: bytes = b""


class LookupService:
    """Answers Lookup and LookupSmall against one rank's ShardStore."""

    def __init__(self, store: ShardStore, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes

    def lookup(self, request: pb.LookupRequest) -> Iterator[LookupPart]:
        """Check the whole request first (nothing streams for a bad one), then answer item by item."""
        if request.chunk_bytes < 0:
            raise InvalidArgument(f"chunk_bytes {request.chunk_bytes} is negative")
        chunk_bytes = max(
            MIN_CHUNK_BYTES, min(request.chunk_bytes or self.chunk_bytes, MAX_CHUNK_BYTES)
        )
        self._check_request_size(request)
        answers = [self._answer(i, item) for i, item in enumerate(request.items)]
        self._count(request, answers, GRPC)
        for index, answer in enumerate(answers):
            yield from _chunks(index, answer, chunk_bytes)

    def lookup_small(self, request: pb.LookupRequest, path: str = GRPC) -> list[LookupPart]:
        """The whole answer in one message; RESOURCE_EXHAUSTED past SMALL_REPLY_BYTES (use the stream).
        `path`: the data path it is answered over, for the metrics."""
        self._check_request_size(request)
        answers = [self._answer(i, item) for i, item in enumerate(request.items)]
        total = sum(len(a.data) for a in answers)
        if total > SMALL_REPLY_BYTES:
            raise RequestTooLarge(
                f"items: the answer is {total} bytes, over LookupSmall's {SMALL_REPLY_BYTES}; "
                f"use the streaming Lookup"
            )
        self._count(request, answers, path)
        return [
            next(_chunks(index, answer, max(SMALL_REPLY_BYTES, 1)))
            for index, answer in enumerate(answers)
        ]

    def _count(self, request: pb.LookupRequest, answers: list[ItemAnswer], path: str) -> None:
        """Record the items, ids and answer bytes of one lookup call (once per call, not per row)."""
        metrics = self.store.metrics
        if not metrics.enabled:
            return
        for item, answer in zip(request.items, answers):
            metrics.looked_up(item.name, len(item.ids) // ID_BYTES)
            metrics.served(path, item.name, len(answer.data))

    def _check_request_size(self, request: pb.LookupRequest) -> None:
        limit = self.store.leases.max_request_bytes
        if not limit:
            return
        ids = sum(len(item.ids) for item in request.items)
        if ids > limit:
            raise RequestTooLarge(
                f"items[].ids: {ids} bytes of ids, over this rank's max_request_bytes {limit}"
            )

    def _answer(self, index: int, item: pb.LookupItem) -> ItemAnswer:
        field = f"items[{index}]"
        name = check_name(item.name, f"{field}.name")
        version = check_version(item.version, f"{field}.version")
        ids = parse_ids(item.ids, f"{field}.ids")
        with self.store.leases.lease(name, version) as entry:
            shard = self.store.leases.shard_of(entry, item.shard_index)
            local = local_rows(entry, item.shard_index, ids, f"{field}.ids")
            out_bytes = (
                (len(item.offsets) // ID_BYTES if item.pooled else ids.size)
                * shard.shape[1]
                * shard.element_size()
            )
            limit = self.store.leases.max_request_bytes
            if limit and out_bytes > limit:
                raise RequestTooLarge(
                    f"{field}.ids: the answer is {out_bytes} bytes, over this rank's "
                    f"max_request_bytes {limit}"
                )
            if not item.pooled:
                if item.offsets or item.per_sample_weights:
                    raise InvalidArgument(
                        f"{field}.offsets/per_sample_weights are only for pooled items"
                    )
                return ItemAnswer(entry.version, shard.dtype, row_bytes(shard, local))
            rows = shard.index_select(0, torch.from_numpy(local).to(shard.device))
            sums, counts = self._pool(rows, item, field)
            return ItemAnswer(
                entry.version, sums.dtype, tensor_bytes(sums), bytes(tensor_bytes(counts))
            )

    def _pool(
        self, rows: torch.Tensor, item: pb.LookupItem, field: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.from_numpy(parse_ids(item.offsets, f"{field}.offsets").copy())
        weights = None
        if item.per_sample_weights:
            weights = (
                parse_rows(
                    item.per_sample_weights,
                    rows.dtype,
                    (rows.shape[0], 1),
                    f"{field}.per_sample_weights",
                )
                .view(-1)
                .to(rows.device)
            )
        try:
            partial = partial_pool(rows, offsets.to(rows.device), weights)
        except (ValueError, TypeError) as err:
            raise InvalidArgument(f"{field}: {err}") from None
        return partial.sums.cpu(), partial.counts.cpu()


def row_bytes(shard: torch.Tensor, rows: np.ndarray) -> memoryview:
    """The bytes of shard[rows] on the host: numpy's take of the byte rows for a CPU shard (one thread, no
    OpenMP region left spinning on a 2-core host, no torch dispatch), index_select on the device for CUDA."""
    if shard.device.type != "cpu":
        return tensor_bytes(shard.index_select(0, torch.from_numpy(rows).to(shard.device)))
    if not rows.size or not shard.shape[1]:
        return memoryview(b"")
    return shard.view(torch.uint8).numpy().take(rows, axis=0).data.cast("B")


def _chunks(index: int, answer: ItemAnswer, chunk_bytes: int) -> Iterator[LookupPart]:
    """The item's answer as LookupChunks of up to `chunk_bytes` of data, serialized by protos.chunk_codec (the
    data is copied once, into the message)."""
    data = answer.data
    header = pb.LookupChunk(
        item=index,
        version=answer.version,
        dtype=cast(pb.DType, dtype_to_wire(answer.dtype)),  # the wire enum's number
        nbytes=len(data),
        counts=answer.counts,
        offset=0,
    )
    yield LookupPart(header, data[:chunk_bytes])
    for offset in range(chunk_bytes, len(data), chunk_bytes):
        yield LookupPart(
            pb.LookupChunk(item=index, offset=offset), data[offset : offset + chunk_bytes]
        )
