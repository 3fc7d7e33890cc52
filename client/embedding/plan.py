"""How one lookup is asked of the ranks: distinct ids, routed items per shard, and the rows put back in order.

A RowPlan takes one table's ids: their distinct values (once each, cache hits
and out-of-range ids left out), one ItemPlan per shard holding some (every
column shard of a row band), and afterwards the answers scattered into rows
in the caller's order. Server-pooled bags are planned by `bag_items`. Ids are
handled with numpy on the calling thread (see RowPlan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardserve.client.embedding.ids import BagRequest
from shardserve.client.embedding.views import TableView
from shardserve.core.embedding import PartialBags, accumulation_dtype, bag_subset
from shardserve.core.routing import distinct_ids
from shardserve.core.wire import tensor_bytes
from shardserve.protos import shardserve_pb2 as pb

CHUNK_FRAMING_BYTES = (
    128  # a LookupChunk's fields but data and counts, with its tag and length in LookupReply
)


@dataclass
class ItemPlan:
    """One LookupItem and where its answer goes; the ids go into the message only when it is sent."""

    view: TableView
    rank: int
    columns: slice  # the table columns the shard holds (slice(None): all)
    message: pb.LookupItem
    ids: torch.Tensor
    positions: np.ndarray | None = (
        None  # row items: the answer's rows' places among the plan's distinct ids
    )
    answer: Any = None  # rows tensor, or PartialBags for pooled items

    @property
    def width(self) -> int:
        """The number of table columns the answer holds."""
        return (
            self.view.dim if self.columns == slice(None) else self.columns.stop - self.columns.start
        )

    def wire_message(self) -> pb.LookupItem:
        """The message with its ids as raw int64 bytes (filled on first use)."""
        if not self.message.ids and self.ids.numel():
            self.message.ids = bytes(tensor_bytes(self.ids))
        return self.message


@dataclass
class RowPlan:
    """One table's rows in a lookup: its distinct ids, those no shard holds, which are fetched, and the rows.

    Ids are handled with numpy on the calling thread: a lookup takes a dozen small array steps, ~1 us each
    this way against ~5-10 us per torch call (with torch, a one-id lookup spent ~225 us of client CPU around
    its gRPC call, about as much as the call itself), and torch's index kernels run OpenMP regions whose
    idle threads spin (see byte_rows)."""

    view: TableView
    unique: np.ndarray  # sorted distinct ids
    inverse: (
        np.ndarray | None
    )  # per id asked, its place in unique; None when the ids were sorted and distinct
    bad: np.ndarray | None  # over unique: ids no shard holds (None: none)
    wanted: np.ndarray | None = None  # the places in unique to fetch (None: all)
    out: torch.Tensor | None = None

    @classmethod
    def of(cls, view: TableView, ids: torch.Tensor) -> RowPlan:
        values = ids.numpy()
        if values.size <= 1 or bool((values[1:] > values[:-1]).all()):
            return cls(view, values, None, view.invalid(values))
        unique, inverse = distinct_ids(values)
        return cls(view, unique, inverse, view.invalid(unique))

    def bad_per_id(self) -> torch.Tensor:
        """The invalid-id mask over the ids as asked (for the error naming the first one)."""
        assert self.bad is not None
        return torch.from_numpy(self.bad if self.inverse is None else self.bad[self.inverse])

    def rows(self) -> torch.Tensor:
        """The rows of the distinct ids, allocated on first use."""
        if self.out is None:
            self.out = torch.empty((self.unique.size, self.view.dim), dtype=self.view.dtype)
        return self.out

    def items(self) -> list[ItemPlan]:
        """One item per shard holding wanted ids (every column shard of their row band)."""
        fetch = self.unique if self.wanted is None else self.unique[self.wanted]
        items = []
        for route in self.view.index.route(fetch, invalid="skip"):
            positions = route.positions.numpy()
            message = pb.LookupItem(
                name=self.view.name, version=self.view.version, shard_index=route.shard
            )
            items.append(
                ItemPlan(
                    self.view,
                    route.rank,
                    route.columns,
                    message,
                    torch.from_numpy(fetch[positions]),
                    positions if self.wanted is None else self.wanted[positions],
                )
            )
        return items

    def distinct_rows(self, items: list[ItemPlan]) -> torch.Tensor:
        """The rows of the distinct ids from the answered items, the cache and the out-of-range policy.

        One answer holding every row whole (all distinct ids on one shard of full width) is used as is."""
        if (
            self.out is None
            and self.bad is None
            and len(items) == 1
            and items[0].width == self.view.dim
            and items[0].positions is not None
            and items[0].positions.size == self.unique.size
            and items[0].answer.dtype == self.view.dtype
        ):
            return items[0].answer  # positions are 0..n-1: a route of sorted ids keeps their order
        out = self.rows()
        out_bytes, itemsize = byte_rows(out), out.element_size()
        for item in items:
            answer = item.answer if item.answer.dtype == out.dtype else item.answer.to(out.dtype)
            first = (item.columns.start or 0) * itemsize
            out_bytes[item.positions, first : first + item.width * itemsize] = byte_rows(answer)
        if self.bad is not None:
            out[torch.from_numpy(self.bad)] = self.view.fill_row()
        return out

    def in_callers_order(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the distinct ids put in the order (and with the repeats) of the ids asked."""
        return rows if self.inverse is None else gather_rows(rows, self.inverse)


def bag_items(view: TableView, request: BagRequest) -> list[ItemPlan]:
    """One pooled item per shard holding some of the bag ids: each shard sums the bags' rows it owns."""
    items = []
    for route in view.index.route(request.ids, invalid="skip"):
        order, sub_offsets = bag_subset(request.offsets, route.positions, request.ids.numel())
        positions = route.positions[order]
        message = pb.LookupItem(
            name=view.name,
            version=view.version,
            shard_index=route.shard,
            pooled=True,
            offsets=bytes(tensor_bytes(sub_offsets)),
        )
        if request.weights is not None:
            message.per_sample_weights = bytes(
                tensor_bytes(request.weights[positions].contiguous())
            )
        items.append(ItemPlan(view, route.rank, route.columns, message, request.ids[positions]))
    return items


def split_columns(partials: list[PartialBags]) -> list[PartialBags]:
    """Partials cut at every column boundary of any of them, so row bands split by other columns combine."""
    cuts = sorted({p.col_offset for p in partials} | {p.col_offset + p.width for p in partials})
    if all(
        p.col_offset in cuts and cuts[cuts.index(p.col_offset) + 1] == p.col_offset + p.width
        for p in partials
    ):
        return partials
    pieces = []
    for part in partials:
        inner = [c for c in cuts if part.col_offset <= c <= part.col_offset + part.width]
        for lo, hi in zip(inner, inner[1:]):
            start = lo - part.col_offset
            pieces.append(PartialBags(part.sums[:, start : start + hi - lo], part.counts, lo))
    return pieces


def byte_rows(rows: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view [rows, row bytes] of a 2-D CPU tensor whose rows are contiguous.

    The routed path scatters and gathers rows with numpy, on this thread: torch's index kernels over a few
    hundred rows run as OpenMP regions whose idle threads then spin for a while, taking the other core from
    the gRPC threads and the ranks (512 ids over gRPC: 2.3-2.6 -> 1.9-2.3 ms, client CPU 3.1 -> 1.4 ms).
    """
    return rows.view(torch.uint8).numpy()


def gather_rows(rows: torch.Tensor, order: np.ndarray) -> torch.Tensor:
    """rows[order] for a 2-D CPU tensor, with numpy (see byte_rows); `order` is in range by construction."""
    if not order.size or not rows.shape[1]:
        return rows.new_empty((order.size, rows.shape[1]))
    return torch.from_numpy(byte_rows(rows).take(order, axis=0)).view(rows.dtype)


def answer_bytes(item: ItemPlan) -> int:
    """The data bytes of an item's answer, as a rank counts them against its LookupSmall limit: its rows, or a
    pooled item's per-bag sums in the accumulation dtype."""
    if item.message.pooled:
        return bag_count(item) * item.width * accumulation_dtype(item.view.dtype).itemsize
    return item.ids.numel() * item.width * item.view.dtype.itemsize


def reply_bytes(items: list[ItemPlan]) -> int:
    """An upper bound of a serialized LookupReply answering `items`: their data, a pooled item's int64 counts,
    and each LookupChunk's fields and framing."""
    return sum(
        answer_bytes(item)
        + (bag_count(item) * 8 if item.message.pooled else 0)
        + CHUNK_FRAMING_BYTES
        for item in items
    )


def bag_count(item: ItemPlan) -> int:
    """The number of bags of a pooled item."""
    return len(item.message.offsets) // 8
