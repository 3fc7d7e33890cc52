"""Row lookups and pooled bags on the GPU, straight from a table's CUDA shards mapped on this host: the
CUDA_MAPPED route of client.embedding.routes.

When every shard of a table holds whole rows on a CUDA device of a rank whose first path maps CUDA shards (the
same-host path opens their CUDA IPC handles, cached per version: client.paths.shm), CUDA ids are answered on
the device with no trip through host memory:

- rows: one `index_select` on the shard that holds every id; ids spread over shards are gathered shard by
  shard and merged with `torch.where` (no boolean indexing, so no wait on the device);
- bags: one `F.embedding_bag` on the shard that holds every id; ids spread over shards have their rows
  gathered first and pooled by `pool_bags` (embedding_bag over the gathered rows): either way the kernel sums
  each bag's rows in the bag's order, so the result is bit for bit `nn.EmbeddingBag` on the same device.

The ids' range is read once (one wait on the device); ids out of range, or a table this cannot serve, get None
and the caller takes another route, with its own errors and out-of-range policy. Every shard's rank must
serve the version before the gather, and once the gather has run (its stream synchronized) the memory must
still hold that version, else StaleVersionError: the caller refreshes its view and looks up again.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch
import torch.nn.functional as F

from shardserve.client.embedding.views import TableView
from shardserve.client.errors import RankUnavailableError, StaleVersionError
from shardserve.client.paths.device_mapping import DeviceMapping
from shardserve.client.paths.shm import SharedMemoryError
from shardserve.client.session import Session
from shardserve.core.embedding import pool_bags


@dataclass(frozen=True)
class RowBlock:
    """Rows [start, start + len(table)) of a table, whole, as `table` on its device."""

    start: int
    table: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.table.shape[0]


class DeviceTable:
    """A table's row blocks tiling its rows, gathered and pooled where they are (any device; the result on the
    ids' device)."""

    def __init__(self, blocks: Sequence[RowBlock], dim: int) -> None:
        self.blocks = sorted(blocks, key=lambda block: block.start)
        self.starts = [block.start for block in self.blocks]
        self.dim = dim
        self.dtype = self.blocks[0].table.dtype

    @property
    def num_rows(self) -> int:
        return self.blocks[-1].end

    def span(self, ids: torch.Tensor) -> tuple[int, int] | None:
        """The lowest and highest id (one wait on the ids' device), None when one is out of range."""
        low, high = torch.stack(torch.aminmax(ids)).tolist()
        return (low, high) if low >= 0 and high < self.num_rows else None

    def rows(self, ids: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
        """Rows `ids` (1-D int64, every one inside `span`) [len(ids), dim] on the ids' device."""
        blocks = self._blocks_of(span)
        if len(blocks) == 1:
            return self._gather(blocks[0], ids)
        gathered = self._gather(blocks[0], ids)
        for block in blocks[1:]:
            inside = ((ids >= block.start) & (ids < block.end)).unsqueeze(1)
            gathered = torch.where(inside, self._gather(block, ids), gathered)
        return gathered

    def bags(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        span: tuple[int, int],
        *,
        mode: str,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Bags [len(offsets), dim] of `ids` (nn.EmbeddingBag offsets and per-sample weights, on the ids'
        device) pooled where the rows are, on the ids' device."""
        blocks = self._blocks_of(span)
        if len(blocks) > 1 or offsets.numel() == 0:
            return pool_bags(self.rows(ids, span), offsets, mode, weights)
        block = blocks[0]
        device = block.table.device
        pooled = F.embedding_bag(
            (ids - block.start).to(device),
            block.table,
            offsets.to(device),
            mode=mode,
            per_sample_weights=None if weights is None else weights.to(device),
        )
        return pooled.to(ids.device)

    def _blocks_of(self, span: tuple[int, int]) -> list[RowBlock]:
        first = bisect_right(self.starts, span[0]) - 1
        last = bisect_right(self.starts, span[1])
        return self.blocks[first:last]

    @staticmethod
    def _gather(block: RowBlock, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `block` at `ids` (ids outside it are clamped in: the caller keeps only those inside)."""
        local = (ids - block.start).clamp_(0, block.table.shape[0] - 1)
        return block.table.index_select(0, local.to(block.table.device)).to(ids.device)


class CudaRows:
    """A table at one version whose every shard is a CUDA shard mapped on this host, holding whole rows."""

    def __init__(
        self, view: TableView, mappings: Sequence[DeviceMapping], table: DeviceTable
    ) -> None:
        self.view = view
        self._mappings = list(mappings)
        self._table = table
        self._devices = {mapping.tensor.device for mapping in mappings}

    @classmethod
    def build(cls, view: TableView, session: Session) -> CudaRows | None:
        """The GPU route for `view`, or None where its shards do not allow one."""
        if not view.complete or view.dim == 0:
            return None
        mappings, blocks = [], []
        for box in view.index.boxes:
            if box.inner_sizes[0] != view.dim:
                return None  # a column-split shard: the rows are not whole on one device
            status = session.rank_status(box.rank)
            reader = session.paths.row_reader(status)
            if reader is None:
                return None
            try:
                mapping = reader.device_mapping(status.address, view.summary, box.shard)
            except SharedMemoryError:
                return None
            except RankUnavailableError as err:  # the rank died: later views route to another copy
                session.health.note_failure(status.rank, err)
                raise
            if mapping is None:
                return None
            mappings.append(mapping)
            blocks.append(RowBlock(box.row_start, mapping.tensor))
        table = DeviceTable(blocks, view.dim)
        if not _tiles(table.blocks, view.summary.metadata.size[0]):
            return None
        return cls(view, mappings, table)

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows `ids` (1-D int64 on a CUDA device) [len(ids), dim] on that device, or None for another route."""
        if ids.numel() == 0:
            return torch.empty((0, self.view.dim), dtype=self.view.dtype, device=ids.device)
        span = self._usable_span(ids)
        if span is None:
            return None
        rows = self._table.rows(ids, span)
        self._confirm(rows.device)
        return rows

    def bags(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        *,
        mode: str,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Bags [len(offsets), dim] of `ids` (nn.EmbeddingBag offsets and weights, on a CUDA device) pooled on
        the GPU, or None for another route."""
        if ids.numel() == 0:
            return torch.zeros(
                (offsets.numel(), self.view.dim), dtype=self.view.dtype, device=ids.device
            )
        span = self._usable_span(ids)
        if span is None:
            return None
        pooled = self._table.bags(ids, offsets, span, mode=mode, weights=weights)
        self._confirm(pooled.device)
        return pooled

    def _usable_span(self, ids: torch.Tensor) -> tuple[int, int] | None:
        """The ids' span when every id is in range, every shard served (else StaleVersionError) and its rank
        alive; None for another route."""
        for mapping in self._mappings:
            if not mapping.serves():
                raise self._stale()
            if not mapping.held():
                return None
        return self._table.span(ids)

    def _confirm(self, result_device: torch.device) -> None:
        """Once the gather has run (its streams synchronized): StaleVersionError if a shard's memory was given
        to another version meanwhile."""
        for device in self._devices | {result_device}:
            torch.cuda.current_stream(device).synchronize()
        if not all(mapping.readable() for mapping in self._mappings):
            raise self._stale()

    def _stale(self) -> StaleVersionError:
        return StaleVersionError(
            f"tensor {self.view.name!r} version {self.view.version} is no longer served",
            grpc.StatusCode.FAILED_PRECONDITION,
        )


def _tiles(blocks: Sequence[RowBlock], num_rows: int) -> bool:
    """Whether the sorted blocks cover rows 0..num_rows-1 exactly once."""
    next_row = 0
    for block in blocks:
        if block.start != next_row:
            return False
        next_row = block.end
    return next_row == num_rows
