"""Where the source boxes of a reshard are: the index the planner (shardcore/planner.py) asks which source boxes
a destination box overlaps.

Source boxes are indexed per dim by their distinct intervals (sorted, with bisect). A destination box that is a
source box is found by a dict lookup; any other tests either the source boxes of its most selective dim or, for
grid-like sources, only the product of the overlapping intervals, whichever is fewer. Limit: one very long
interval in a dim widens the bisect window of that dim.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from shardserve.core.metadata import ShardedTensorMetadata

_BoxKey = tuple[tuple[int, ...], tuple[int, ...]]


class _IntervalIndex:
    """The distinct intervals of one dim, sorted by start, each with the boxes spanning it."""

    def __init__(self, intervals: dict[tuple[int, int], list[int]]) -> None:
        items = sorted(intervals.items())
        self.starts = [lo for (lo, _), _ in items]
        self.ends = [hi for (_, hi), _ in items]
        self.members = [ids for _, ids in items]
        self.max_len = max((hi - lo for hi, lo in zip(self.ends, self.starts)), default=0)

    def overlapping(self, lo: int, hi: int) -> list[int]:
        """Positions of the intervals that overlap [lo, hi)."""
        first = bisect_left(self.starts, lo - self.max_len + 1)
        last = bisect_left(self.starts, hi)
        ends = self.ends
        return [i for i in range(first, last) if ends[i] > lo]


class SourceIndex:
    """Distinct non-empty source boxes, their holders (shard index, rank) and a per-dim index.

    Each box is also keyed by the positions of its intervals in the per-dim
    indexes, so a grid-like source answers a query by enumerating the product
    of the overlapping intervals, and any other source by the members of the
    most selective dim, whichever is fewer.
    """

    def __init__(
        self,
        src: ShardedTensorMetadata,
        ranks: Sequence[int],
        unavailable: frozenset[int] = frozenset(),
    ) -> None:
        groups: dict[_BoxKey, list[tuple[int, int]]] = {}
        for index, shard in enumerate(src.shards_metadata):
            if 0 in shard.shard_sizes or index in unavailable:
                continue
            groups.setdefault((shard.shard_offsets, shard.shard_sizes), []).append(
                (index, ranks[index])
            )
        self.boxes = list(groups)
        self.holders = list(groups.values())
        self.ndim = len(src.size)
        self.by_box = {box: g for g, box in enumerate(self.boxes)}
        # made on the first query of a box that is not a source box (_per_dim)
        self._dims: list[_IntervalIndex] | None = None
        self._by_key: dict[tuple[int, ...], int] = {}

    def _per_dim(self) -> list[_IntervalIndex]:
        """The per-dim interval indexes (and each box's key of interval positions), made once when first asked:
        a reshard that only moves whole shards, and every repair, never needs them."""
        if self._dims is not None:
            return self._dims
        dims: list[_IntervalIndex] = []
        keys: list[list[int]] = [[] for _ in self.boxes]
        for d in range(self.ndim):
            intervals: dict[tuple[int, int], list[int]] = {}
            for g, (offsets, sizes) in enumerate(self.boxes):
                intervals.setdefault((offsets[d], offsets[d] + sizes[d]), []).append(g)
            interval_index = _IntervalIndex(intervals)
            for position, members in enumerate(interval_index.members):
                for g in members:
                    keys[g].append(position)
            dims.append(interval_index)
        self._by_key = {tuple(key): g for g, key in enumerate(keys)}
        self._dims = dims
        return dims

    def same(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int | None:
        """The source group whose box is this one, if any (it overlaps that one only: source boxes are disjoint
        but for exact replicas)."""
        return self.by_box.get((offsets, sizes))

    def candidates(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterable[int]:
        """Source groups that may overlap the box (a superset; exact for grid-like sources). A box that is a
        source box itself overlaps that one only (source boxes are disjoint but for exact replicas): a reshard
        that moves shards without cutting them again, and every repair, finds each at once."""
        same = self.same(offsets, sizes)
        if same is not None:
            return (same,)
        if self.ndim == 0:
            return range(len(self.boxes))
        dims = self._per_dim()
        hits_per_dim = []
        product = 1
        best_count, best_dim = -1, 0
        for d, index in enumerate(dims):
            hits = index.overlapping(offsets[d], offsets[d] + sizes[d])
            if not hits:
                return ()
            hits_per_dim.append(hits)
            product *= len(hits)
            count = sum(len(index.members[i]) for i in hits)
            if best_count < 0 or count < best_count:
                best_count, best_dim = count, d
        if product <= best_count:
            lookup = self._by_key
            return [
                g for key in itertools.product(*hits_per_dim) if (g := lookup.get(key)) is not None
            ]
        members = dims[best_dim].members
        return itertools.chain.from_iterable(members[i] for i in hits_per_dim[best_dim])
