"""Row lookups answered straight from mapped shards: the same-host fast path of client.embedding.lookup.

When every shard of a table is a CPU shard of a same-host rank mapped through
shared memory (client.paths.shm) and the layout holds every row whole
(row-wise, table-wise, uneven), a batch of ids is gathered with a few numpy
calls over the mapped bytes: no dedup (a duplicate costs one row copy either
way), no route objects, no torch dispatch per step (each torch call hands the
GIL around, which is what made 8 concurrent callers slow). Before and after
each read every shard's header must say served at the generation it was
mapped at (else StaleVersionError, so the caller refreshes its view: the rank
dropped the version, or recycled its memory for another one), and its rank
must be alive before it.
Anything else (out-of-range ids, column-split layouts, CUDA shards, a dead
rank, an answer over a rank's max_request_bytes) gets None and the general
path answers with its own errors.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from shardserve.client.embedding.views import TableView
from shardserve.client.errors import RankUnavailableError, StaleVersionError
from shardserve.client.paths.segments import HostMapping
from shardserve.client.paths.shm import SharedMemoryError
from shardserve.client.session import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Band:
    """The rows [start, end) one shard holds, as uint8 rows over its mapping."""

    start: int
    end: int
    rows: np.ndarray  # [end - start, row bytes]
    mapping: HostMapping


class MappedRows:
    """A table at one version whose every row is read from mapped same-host shards."""

    def __init__(self, view: TableView, bands: list[_Band], limit: int) -> None:
        self.view = view
        self._bands = sorted(bands, key=lambda band: band.start)
        self._starts = [band.start for band in self._bands]
        self._starts_np = np.asarray(self._starts, dtype=np.int64)
        self._row_bytes = view.dim * view.summary.metadata.tensor_properties.itemsize
        self._limit = limit

    @classmethod
    def build(cls, view: TableView, session: Session) -> MappedRows | None:
        """The fast path for `view`, or None where its layout or its shards do not allow one."""
        if not view.complete or view.dim == 0:
            return None
        reader, bands, limits = session.paths.shm, [], []
        for box in view.index.boxes:
            if box.inner_offsets != (0,) or box.inner_sizes != (view.dim,):
                return None  # column-split: the general path concatenates the pieces
            status = session.rank_status(box.rank)
            address = status.address
            try:
                mapping = reader.host_mapping(address, view.summary, box.shard)
            except SharedMemoryError:
                return None
            except RankUnavailableError as err:  # the rank died: later views route to another copy
                session.health.note_failure(status.rank, err)
                raise
            if mapping is None:
                return None
            shard = view.summary.metadata.shards_metadata[box.shard]
            rows = mapping.data.reshape(shard.shard_sizes[0], -1)
            bands.append(_Band(box.row_start, box.row_start + shard.shard_sizes[0], rows, mapping))
            limits.append(reader.limit(address))
        return cls(view, bands, min((limit for limit in limits if limit), default=0))

    def rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows `ids` (1-D int64 CPU) [len(ids), dim] in the table's dtype, or None to use the general path."""
        values = ids.numpy()
        count = values.size
        if count == 0 or (self._limit and count * self._row_bytes > self._limit):
            return None
        low, high = (int(values[0]),) * 2 if count == 1 else (int(values.min()), int(values.max()))
        if low < 0 or high >= self.view.summary.metadata.size[0] or not self._usable():
            return None
        first = bisect_right(self._starts, low) - 1
        if high < self._bands[first].end:
            band = self._bands[first]
            out = band.rows.take(values - band.start, axis=0)
        else:
            out = self._gather_bands(values)
        if not all(band.mapping.readable() for band in self._bands):
            raise self._stale()  # a segment was recycled during the read: its rows may be another version's
        log.debug("looked up %d rows of %r from mapped shards", count, self.view.name)
        return torch.from_numpy(out).view(self.view.dtype)

    def _gather_bands(self, values: np.ndarray) -> np.ndarray:
        out = np.empty((values.size, self._row_bytes), dtype=np.uint8)
        owner = np.searchsorted(self._starts_np, values, side="right") - 1
        for index in np.unique(owner).tolist():
            band = self._bands[index]
            where = np.flatnonzero(owner == index)
            out[where] = band.rows.take(values[where] - band.start, axis=0)
        return out

    def _usable(self) -> bool:
        """Every shard still served (StaleVersionError once one is dropped or recycled) and its rank alive."""
        for band in self._bands:
            if not band.mapping.serves():
                raise self._stale()
            if not band.mapping.held():
                return False
        return True

    def _stale(self) -> StaleVersionError:
        return StaleVersionError(
            f"tensor {self.view.name!r} version {self.view.version} is no longer served",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
