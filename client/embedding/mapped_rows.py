"""Row lookups and pooled bags answered straight from mapped shards: the same-host fast path of
client.embedding.lookup.

When every shard of a table is a CPU shard of a rank whose first path reads rows from its mappings (a
same-host rank mapped through shared memory: client.paths.shm), the shards are read in place:

- rows (layouts holding every row whole: row-wise, table-wise, uneven): a batch of ids is gathered with a
  few numpy calls over the mapped bytes: no dedup (a duplicate costs one row copy either way), no route
  objects, no torch dispatch per step (each torch call hands the GIL around, which is what made 8
  concurrent callers slow);
- bags: no looked-up row is copied out of the shards. Whole-row shards are mapped once more side by side
  in one tensor (client.paths.stitched), so a request is one `F.embedding_bag` over it with the ids
  shifted to their shard's place: bit for bit torch's on the whole table. Other layouts whose shards
  tile the table in row bands (column-split ones included, or shards that cannot be stitched) pool each
  shard's rows with one `F.embedding_bag` on its mapping and add the partial sums
  (shardcore.band_pooling).

Before and after each read every shard's header must say served at the generation it was mapped at (else
StaleVersionError, so the caller refreshes its view: the rank dropped the version, or recycled its memory
for another one), and its rank must be alive before it.
Anything else (out-of-range ids, CUDA shards, a dead rank, an answer over a rank's max_request_bytes, a
float16/bfloat16 request spread over several row bands that are not stitched) gets None and the general
path answers with its own errors and precision.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import dataclass

import grpc
import numpy as np
import torch
import torch.nn.functional as F

from shardserve.client.embedding.views import TableView
from shardserve.client.errors import RankUnavailableError, StaleVersionError
from shardserve.client.paths.segments import HostMapping, SegmentError
from shardserve.client.paths.shm import SharedMemoryError
from shardserve.client.paths.stitched import StitchedRows, stitch
from shardserve.client.session import Session
from shardserve.core.band_pooling import RowBand, pool_from_bands
from shardserve.core.embedding import accumulation_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Piece:
    """The block of rows [start, end) and columns [col, col + width) one shard holds, over its mapping."""

    start: int
    end: int
    col: int
    width: int
    mapping: HostMapping
    table: torch.Tensor | None  # [end - start, width] in the table's dtype (None: misaligned bytes)


class MappedRows:
    """A table at one version whose every shard is read from its same-host mapping."""

    def __init__(self, view: TableView, pieces: list[_Piece], limit: int) -> None:
        self.view = view
        self._pieces = pieces
        self._row_bytes = view.dim * view.summary.metadata.tensor_properties.itemsize
        self._limit = limit
        self._exact_only = accumulation_dtype(view.dtype) != view.dtype
        self._bands = _row_bands(pieces, view.summary.metadata.size[0], view.dim)
        self._band_starts = [band.start for band in self._bands or ()]
        whole = all(piece.width == view.dim for piece in pieces)
        self._rows = sorted(pieces, key=lambda piece: piece.start) if whole else None
        self._starts = [piece.start for piece in self._rows or ()]
        self._starts_np = np.asarray(self._starts, dtype=np.int64)
        self._row_arrays = [
            piece.mapping.data.reshape(piece.end - piece.start, -1) for piece in self._rows or ()
        ]
        self._stitched: StitchedRows | None = None
        self._shifts = np.zeros(len(self._starts), dtype=np.int64)

    def stitch(self) -> None:
        """Map the shards' rows side by side once more (client.paths.stitched), so that bags over several
        shards are one kernel call; left unstitched where the segments do not allow it."""
        sources = [piece.mapping.source for piece in self._rows or ()]
        if len(sources) < 2 or any(source is None for source in sources):
            return
        try:
            stitched = stitch(
                [s for s in sources if s is not None],
                row_bytes=self._row_bytes,
                dtype=self.view.dtype,
            )
        except SegmentError as err:
            log.debug("shards of %r not stitched: %s", self.view.name, err)
            return
        if stitched is not None:
            self._stitched = stitched
            self._shifts = np.asarray(stitched.first_rows, dtype=np.int64) - self._starts_np

    @classmethod
    def build(cls, view: TableView, session: Session) -> MappedRows | None:
        """The fast path for `view`, or None where its shards do not allow one (or serve neither rows nor
        bags from their mappings)."""
        if not view.complete or view.dim == 0:
            return None
        pieces, limits = [], []
        for box in view.index.boxes:
            status = session.rank_status(box.rank)
            address = status.address
            reader = session.paths.row_reader(status)
            if reader is None:
                return None
            try:
                mapping = reader.host_mapping(address, view.summary, box.shard)
            except SharedMemoryError:
                return None
            except RankUnavailableError as err:  # the rank died: later views route to another copy
                session.health.note_failure(status.rank, err)
                raise
            if mapping is None:
                return None
            rows = view.summary.metadata.shards_metadata[box.shard].shard_sizes[0]
            col, width = box.inner_offsets[0], box.inner_sizes[0]
            table = _as_table(mapping, view.dtype, rows, width)
            pieces.append(_Piece(box.row_start, box.row_start + rows, col, width, mapping, table))
            limits.append(reader.limit(address))
        built = cls(view, pieces, min((limit for limit in limits if limit), default=0))
        if not built.serves_rows and built._bands is None:
            return None
        built.stitch()
        return built

    @property
    def serves_rows(self) -> bool:
        """Whether rows are gathered here (every shard holds whole rows), not only bags pooled."""
        return self._rows is not None

    def rows(self, ids: torch.Tensor, *, pinned: bool = False) -> torch.Tensor | None:
        """Rows `ids` (1-D int64 CPU) [len(ids), dim] in the table's dtype, or None to use the general path;
        gathered into pinned memory when asked (the rows then go to a GPU without another copy)."""
        if self._rows is None:
            return None
        values = ids.numpy()
        count = values.size
        span = self._span(values, count)
        if span is None:
            return None
        low, high = span
        out = torch.empty((count, self._row_bytes), dtype=torch.uint8, pin_memory=pinned)
        first = bisect_right(self._starts, low) - 1
        if high < self._rows[first].end:
            self._row_arrays[first].take(
                values - self._starts[first], axis=0, out=out.numpy(), mode="clip"
            )
        else:
            self._gather_rows(values, out.numpy())
        self._confirm()
        log.debug("looked up %d rows of %r from mapped shards", count, self.view.name)
        return out.view(self.view.dtype)

    def bags(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        *,
        mode: str,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Bags [len(offsets), dim] of `ids` (1-D int64 CPU, nn.EmbeddingBag offsets and weights) pooled on the
        mappings, or None to use the general path."""
        if self._bands is None:
            return None
        values = ids.numpy()
        span = self._span(values, values.size)
        if span is None:
            return None
        first = bisect_right(self._band_starts, span[0]) - 1
        last = bisect_right(self._band_starts, span[1])
        if last - first > 1 and self._stitched is not None:
            table, rows = self._stitched.table, self._stitched_ids(values, first, last)
            pooled = F.embedding_bag(rows, table, offsets, mode=mode, per_sample_weights=weights)
        elif last - first > 1 and self._exact_only:
            return None  # float16/bfloat16 partial sums would lose precision: the rows are pooled whole
        else:
            pooled = pool_from_bands(
                self._bands[first:last], ids, offsets, mode=mode, weights=weights
            )
        self._confirm()
        return pooled

    def _stitched_ids(self, values: np.ndarray, first: int, last: int) -> torch.Tensor:
        """Ids of bands [first, last) as rows of the stitched tensor: each id plus its band's shift."""
        shifts, starts = self._shifts, self._starts
        rows = values + shifts[first] if shifts[first] else values.copy()
        for band in range(first + 1, last):
            rows += (values >= starts[band]) * (shifts[band] - shifts[band - 1])
        return torch.from_numpy(rows)

    def _span(self, values: np.ndarray, count: int) -> tuple[int, int] | None:
        """The lowest and highest id, once checked readable here (in range, under the rank's limit, every
        shard served and its rank alive); None for the general path."""
        if count == 0 or (self._limit and count * self._row_bytes > self._limit):
            return None
        low, high = (int(values[0]),) * 2 if count == 1 else (int(values.min()), int(values.max()))
        if low < 0 or high >= self.view.summary.metadata.size[0] or not self._usable():
            return None
        return low, high

    def _gather_rows(self, values: np.ndarray, out: np.ndarray) -> None:
        """Rows `values` (every one inside some shard) into `out` [len(values), row bytes], shard by shard."""
        owner = np.searchsorted(self._starts_np, values, side="right") - 1
        for index in np.unique(owner).tolist():
            where = np.flatnonzero(owner == index)
            out[where] = self._row_arrays[index].take(values[where] - self._starts[index], axis=0)

    def _usable(self) -> bool:
        """Every shard still served (StaleVersionError once one is dropped or recycled) and its rank alive."""
        for piece in self._pieces:
            if not piece.mapping.serves():
                raise self._stale()
            if not piece.mapping.held():
                return False
        return True

    def _confirm(self) -> None:
        """After a read: StaleVersionError if a segment was recycled meanwhile (its bytes may be another
        version's)."""
        if not all(piece.mapping.readable() for piece in self._pieces):
            raise self._stale()

    def _stale(self) -> StaleVersionError:
        return StaleVersionError(
            f"tensor {self.view.name!r} version {self.view.version} is no longer served",
            grpc.StatusCode.FAILED_PRECONDITION,
        )


def _as_table(
    mapping: HostMapping, dtype: torch.dtype, rows: int, width: int
) -> torch.Tensor | None:
    """The shard's mapped bytes as a [rows, width] tensor of `dtype` (no copy), or None where they are not
    aligned for it."""
    try:
        return mapping.tensor.view(dtype).view(rows, width)
    except RuntimeError:
        return None


def _row_bands(pieces: list[_Piece], num_rows: int, dim: int) -> list[RowBand] | None:
    """The pieces as row bands tiling the table (each band's pieces tiling its columns), or None where they do
    not (overlapping row ranges, a misaligned mapping)."""
    groups: dict[tuple[int, int], list[_Piece]] = {}
    for piece in pieces:
        if piece.table is None:
            return None
        groups.setdefault((piece.start, piece.end), []).append(piece)
    bands, next_row = [], 0
    for (start, end), group in sorted(groups.items()):
        group.sort(key=lambda piece: piece.col)
        cols = [piece.col for piece in group]
        widths = [piece.width for piece in group]
        if start != next_row or cols != [sum(widths[:k]) for k in range(len(group))]:
            return None
        if sum(widths) != dim:
            return None
        bands.append(
            RowBand(start, end, tuple((p.col, p.table) for p in group if p.table is not None))
        )
        next_row = end
    return bands if next_row == num_rows else None
