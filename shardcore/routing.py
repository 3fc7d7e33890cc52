"""Vectorized routing of row ids (dim 0) to the shards that hold them, for embedding tables.

Row boundaries of all shards cut dim 0 into segments. One stable sort of the
ids (skipped when they are already sorted, as after `unique_ids`) and one
`searchsorted` of the few boundaries into the sorted ids give every segment's
ids as a slice, so routing is a handful of array ops whatever the number of
ids; each route's ids come in ascending row order. Routing runs on the host
with numpy (ids of any device are read there; routes hold CPU tensors): a
lookup routes a few to a few thousand ids, where numpy's ~1 us per op beats
torch's ~5-10 us dispatch, and a serving client pays that on every call.
A shard receives the ids of the segments its rows span; column-split shards
of the same rows each receive them, with their column range, and the caller
concatenates the pieces. Replicas (identical boxes) are routed once.

Ids out of range, or whose rows no shard holds, are invalid: `invalid="raise"`
raises IndexError naming the first one; `invalid="skip"` leaves them out of
every route, and `RowIndex.invalid_mask` finds them, so callers can implement
their own policy (error, zero row, default row).
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left
from collections.abc import Set
from dataclasses import dataclass

import numpy as np
import torch

from shardserve.core.health import pick_copy
from shardserve.core.metadata import ShardedTensorMetadata

_INVALID_POLICIES = ("raise", "skip")
LARGE_SORT = (
    1 << 16
)  # from this many ids on, torch sorts (multi-threaded) and dedups; below, numpy does


@dataclass(frozen=True, eq=False)
class RowRoute:
    """The ids one shard serves: their positions in `ids` and their rows inside the shard."""

    shard: int
    rank: int
    positions: torch.Tensor
    local_rows: torch.Tensor
    inner_offsets: tuple[int, ...]
    inner_sizes: tuple[int, ...]

    @property
    def columns(self) -> slice:
        """The global column range (dim 1) the shard holds; slice(None) (the whole row) for a 1-D tensor."""
        if not self.inner_offsets:
            return slice(None)
        return slice(self.inner_offsets[0], self.inner_offsets[0] + self.inner_sizes[0])

    def __len__(self) -> int:
        return int(self.positions.numel())


@dataclass(frozen=True)
class _RoutedBox:
    shard: int
    rank: int
    row_start: int
    first_segment: int
    end_segment: int
    inner_offsets: tuple[int, ...]
    inner_sizes: tuple[int, ...]
    valid_runs: tuple[tuple[int, int], ...] = ()


class RowIndex:
    """Row boundaries of a layout, built once and reused to route many id batches."""

    def __init__(
        self,
        meta: ShardedTensorMetadata,
        prefer_rank: int | None = None,
        unavailable: Set[int] = frozenset(),
        suspect: Set[int] = frozenset(),
    ) -> None:
        if not isinstance(meta, ShardedTensorMetadata):
            raise TypeError(f"meta must be a ShardedTensorMetadata, got {type(meta).__name__}")
        if meta.ndim < 1:
            raise ValueError("meta.size must have at least one dim (rows are dim 0)")
        self.meta = meta
        self.num_rows = meta.size[0]
        chosen = _one_replica_per_box(meta, prefer_rank, unavailable, suspect)
        bounds = sorted(
            {0, self.num_rows}
            | {meta.shards_metadata[i].shard_offsets[0] for i in chosen}
            | {
                meta.shards_metadata[i].shard_offsets[0] + meta.shards_metadata[i].shard_sizes[0]
                for i in chosen
            }
        )
        self.boxes = tuple(self._routed_box(i, bounds) for i in chosen)
        self._bounds = np.array(bounds, dtype=np.int64)
        self._segment_ok = self._covered_segments(len(bounds) - 1)
        ok = self._segment_ok[1:-1].tolist()
        self.boxes = tuple(_with_valid_runs(box, ok) for box in self.boxes)
        self._bad_segments = [k for k, good in enumerate(ok) if not good]

    def _routed_box(self, index: int, bounds: list[int]) -> _RoutedBox:
        shard = self.meta.shards_metadata[index]
        start, size = shard.shard_offsets[0], shard.shard_sizes[0]
        return _RoutedBox(
            index,
            shard.rank,
            start,
            bisect_left(bounds, start),
            bisect_left(bounds, start + size),
            shard.shard_offsets[1:],
            shard.shard_sizes[1:],
        )

    def _covered_segments(self, segments: int) -> np.ndarray:
        """Per segment: do the chosen boxes hold the whole of its rows (every column)?"""
        delta = [0] * (segments + 1)
        for box in self.boxes:
            volume = math.prod(box.inner_sizes)
            delta[box.first_segment] += volume
            delta[box.end_segment] -= volume
        covered = np.cumsum(np.array(delta[:-1], dtype=np.int64))
        # one extra segment for ids past the end, and one (index -1 after shift) before 0
        ok = np.zeros(segments + 2, dtype=bool)
        ok[1:-1] = covered == math.prod(self.meta.size[1:])
        return ok

    @property
    def covers_every_row(self) -> bool:
        """Whether the chosen boxes hold every row 0..num_rows-1 whole (then only the range needs checking)."""
        return bool(self._segment_ok[1:-1].all())

    def invalid_mask(self, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """True where an id is out of range or its row is held by no shard (a CPU bool tensor)."""
        return torch.from_numpy(self.invalid_array(host_ids(ids)))

    def invalid_array(self, ids: np.ndarray) -> np.ndarray:
        """invalid_mask of int64 host ids, as a numpy bool array."""
        # the segment of each id shifted by one: 0 for ids < 0, S+1 for ids past the last row
        return ~self._segment_ok[np.searchsorted(self._bounds, ids, side="right")]

    def route(self, ids: torch.Tensor | np.ndarray, invalid: str = "raise") -> list[RowRoute]:
        """Group `ids` by the shards that hold their rows; see the module docstring for `invalid`."""
        values = host_ids(ids)
        if invalid not in _INVALID_POLICIES:
            raise ValueError(f"invalid must be one of {_INVALID_POLICIES}, got {invalid!r}")
        total = values.size
        if total == 0:
            return []
        if total == 1 or bool((values[1:] >= values[:-1]).all()):
            sorted_ids, order = values, None
        else:
            sorted_ids, order = stable_sort(values)
        # cuts[k]: first sorted position with id >= bounds[k]; segment k is cuts[k]:cuts[k+1]
        cuts = np.searchsorted(sorted_ids, self._bounds).tolist()
        if invalid == "raise" and (
            cuts[0] > 0
            or cuts[-1] < total
            or any(cuts[k + 1] > cuts[k] for k in self._bad_segments)
        ):
            raise IndexError(self._describe_bad(values, self.invalid_array(values)))
        routes = []
        pieces: dict[
            tuple, tuple[np.ndarray, np.ndarray]
        ] = {}  # column shards of a row band share them
        for box in self.boxes:
            key = (box.valid_runs, box.row_start)
            if key not in pieces:
                slices = [(cuts[a], cuts[b]) for a, b in box.valid_runs if cuts[b] > cuts[a]]
                pieces[key] = _gather_slices(slices, sorted_ids, order, box.row_start)
            positions, rows = pieces[key]
            if positions.size:
                routes.append(
                    RowRoute(
                        box.shard,
                        box.rank,
                        torch.from_numpy(positions),
                        torch.from_numpy(rows),
                        box.inner_offsets,
                        box.inner_sizes,
                    )
                )
        return routes

    def _describe_bad(self, ids: np.ndarray, bad: np.ndarray) -> str:
        position = int(np.flatnonzero(bad)[0])
        value = int(ids[position])
        count = int(bad.sum())
        if 0 <= value < self.num_rows:
            reason = f"row {value} is held by no shard"
        else:
            reason = f"out of range for {self.num_rows} rows"
        return f"ids[{position}]={value}: {reason} ({count} invalid id(s) in all)"


def _with_valid_runs(box: _RoutedBox, segment_ok: list[bool]) -> _RoutedBox:
    """The box with the runs of its segments whose rows the layout holds whole."""
    runs, start = [], None
    for k in range(box.first_segment, box.end_segment):
        if segment_ok[k] and start is None:
            start = k
        elif not segment_ok[k] and start is not None:
            runs.append((start, k))
            start = None
    if start is not None:
        runs.append((start, box.end_segment))
    return dataclasses.replace(box, valid_runs=tuple(runs))


def _gather_slices(
    slices: list[tuple[int, int]], sorted_ids: np.ndarray, order: np.ndarray | None, row_start: int
) -> tuple[np.ndarray, np.ndarray]:
    """Positions in `ids` and shard-local rows of the sorted ids in `slices`.

    `order` is None when the ids were already sorted (positions are then ranges).
    """
    if not slices:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    if order is None:
        positions = [np.arange(lo, hi, dtype=np.int64) for lo, hi in slices]
    else:
        positions = [order[lo:hi] for lo, hi in slices]
    rows = [sorted_ids[lo:hi] for lo, hi in slices]
    if len(slices) == 1:
        return positions[0].astype(np.int64, copy=False), rows[0] - row_start
    return np.concatenate(positions).astype(np.int64, copy=False), np.concatenate(rows) - row_start


def _one_replica_per_box(
    meta: ShardedTensorMetadata,
    prefer_rank: int | None,
    unavailable: Set[int] = frozenset(),
    suspect: Set[int] = frozenset(),
) -> list[int]:
    """Indices of the non-empty shards to route to: one copy per distinct box, chosen by
    shardcore.health.pick_copy (an available one, prefer_rank's if any)."""
    copies: dict[tuple, list[int]] = {}
    for index, shard in enumerate(meta.shards_metadata):
        if len(shard.shard_offsets) != meta.ndim:
            raise ValueError(
                f"meta.shards_metadata[{index}] has {len(shard.shard_offsets)} dims "
                f"but the tensor has {meta.ndim}"
            )
        if 0 in shard.shard_sizes:
            continue
        if shard.placement is None:
            raise ValueError(f"meta.shards_metadata[{index}].placement is missing")
        copies.setdefault((shard.shard_offsets, shard.shard_sizes), []).append(index)
    return sorted(
        pick_copy(meta, indices, unavailable, suspect, prefer_rank) for indices in copies.values()
    )


def _check_ids(ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor of integers, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"ids must hold integers, got dtype {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    return ids.to(torch.int64)


def host_ids(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    """Checked 1-D integer ids as an int64 numpy array on the host (a view when they already are one)."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must hold integers, got dtype {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        return ids.astype(np.int64, copy=False)
    return _check_ids(ids).detach().cpu().numpy()


def route_rows(
    meta: ShardedTensorMetadata,
    ids: torch.Tensor,
    *,
    invalid: str = "raise",
    prefer_rank: int | None = None,
) -> list[RowRoute]:
    """Group row ids by the shards holding their rows (one route per shard, in shard order)."""
    return RowIndex(meta, prefer_rank).route(ids, invalid)


def stable_sort(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, their positions), ties in input order: numpy for small arrays, torch's multi-threaded
    sort from LARGE_SORT ids on (1M ids: ~16 ms against numpy's ~120 ms)."""
    if values.size < LARGE_SORT:
        order = np.argsort(values, kind="stable")
        return values[order], order
    sorted_ids, positions = torch.sort(torch.from_numpy(values), stable=True)
    return sorted_ids.numpy(), positions.numpy()


def distinct_ids(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, per value its index in them): numpy for small arrays, torch.unique from
    LARGE_SORT ids on, as stable_sort."""
    if values.size < LARGE_SORT:
        unique, inverse = np.unique(values, return_inverse=True)
        return unique, inverse.reshape(-1)
    unique, inverse = torch.unique(torch.from_numpy(values), sorted=True, return_inverse=True)
    return unique.numpy(), inverse.numpy()


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct ids and, per id, its index in them (ids == unique[inverse])."""
    ids = _check_ids(ids)
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return unique, inverse
