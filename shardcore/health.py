"""Health of a layout whose copies may be unavailable: which boxes are lost, how many replicas, which copy to read.

A layout may hold the same box on several ranks (replicas). A copy is
*unavailable* when it cannot be read now (its rank is down, hung, partitioned
or restoring) and *lost* when it is known gone (its rank restarted without it).
A box with no available copy is unavailable (a read of it is retried, it may
come back); a box whose every copy is lost is lost (a read of it fails for
good). The coordinator and the client both decide with these functions, so they
agree on health and on which copy a read may use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

from shardserve.core.metadata import Box, ShardedTensorMetadata

HEALTHY, DEGRADED, UNAVAILABLE, LOST = "healthy", "degraded", "unavailable", "lost"
HEALTH_STATES = (HEALTHY, DEGRADED, UNAVAILABLE, LOST)


@dataclass(frozen=True)
class LayoutHealth:
    """A layout's health: "healthy"; "degraded" (a box has unavailable copies, not all); "unavailable" (a
    box has no available copy now); "lost" (a box's every copy is known gone). `lost_boxes`: the boxes with
    no available copy, lost or only unavailable; `gone_boxes`: those of them whose every copy is lost."""

    state: str
    lost_boxes: tuple[Box, ...]
    replicas: int  # copies of each box: the minimum over the layout's non-empty boxes
    gone_boxes: tuple[Box, ...] = ()


def copies_by_box(meta: ShardedTensorMetadata) -> dict[Box, list[int]]:
    """Every non-empty box of the layout with the indices of the shards holding it (its copies), in order."""
    return {Box.of_ints(*extent): copies for extent, copies in _copies_by_extent(meta).items()}


def _copies_by_extent(
    meta: ShardedTensorMetadata,
) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]:
    """copies_by_box keyed by each box's extent, (offsets, sizes): a tuple hashes and compares in C, where a Box
    (a dataclass) does both in Python, and a layout's health asks it of every shard (a 1,000-shard table
    took 8 ms)."""
    copies: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for index, shard in enumerate(meta.shards_metadata):
        if 0 not in shard.shard_sizes:
            copies.setdefault((shard.shard_offsets, shard.shard_sizes), []).append(index)
    return copies


def layout_health(
    meta: ShardedTensorMetadata, unavailable: Iterable[int], lost: Iterable[int] = ()
) -> LayoutHealth:
    """The health of `meta` when the shards (copies) at indices `unavailable` cannot be read, `lost` of them
    (a subset) for good."""
    down, known_gone = frozenset(unavailable), frozenset(lost)
    out = down | known_gone
    copies_of = _copies_by_extent(meta)
    without_copy, gone, degraded = [], [], False
    if out:  # else every copy is readable: nothing to look at
        for extent, copies in copies_of.items():
            live = sum(index not in out for index in copies)
            if live == 0:
                without_copy.append(Box.of_ints(*extent))
                if all(index in known_gone for index in copies):
                    gone.append(Box.of_ints(*extent))
            elif live < len(copies):
                degraded = True
    state = LOST if gone else UNAVAILABLE if without_copy else DEGRADED if degraded else HEALTHY
    replicas = min(map(len, copies_of.values()), default=1)
    return LayoutHealth(state, _sorted(without_copy), replicas, _sorted(gone))


def _sorted(boxes: list[Box]) -> tuple[Box, ...]:
    return tuple(sorted(boxes, key=lambda b: (b.offsets, b.sizes)))


def lost_boxes_in(meta: ShardedTensorMetadata, box: Box, unavailable: Set[int]) -> list[Box]:
    """The layout's boxes overlapping `box` that have no available copy (a read of `box` cannot be served)."""
    if not unavailable:
        return []
    return [
        shard_box
        for shard_box, copies in copies_by_box(meta).items()
        if all(index in unavailable for index in copies) and _overlaps(shard_box, box)
    ]


def ranks_of_copies(meta: ShardedTensorMetadata, boxes: Iterable[Box]) -> list[int]:
    """The ranks holding a copy of any of `boxes` (sorted): for a lost box, the ranks that died or lost it."""
    wanted = set(boxes)
    return sorted(
        {shard.rank for shard in meta.shards_metadata if shard.box in wanted and shard.placement}
    )


def name_ranks(ranks: Iterable[int]) -> str:
    """ "rank 1" or "ranks 1, 2": ranks named in a message."""
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def pick_copy(
    meta: ShardedTensorMetadata,
    copies: Sequence[int],
    unavailable: Set[int] = frozenset(),
    suspect: Set[int] = frozenset(),
    prefer_rank: int | None = None,
) -> int:
    """The copy of a box to read: an available, unsuspected one (prefer_rank's first), else a suspected one
    (its rank failed a call lately), else an unavailable one (the caller reports the box lost)."""

    def cost(index: int) -> tuple[int, int]:
        standing = 2 if index in unavailable else 1 if index in suspect else 0
        preferred = (
            0 if prefer_rank is not None and meta.shards_metadata[index].rank == prefer_rank else 1
        )
        return standing, preferred

    return min(copies, key=cost)  # min keeps the first of equals: the first listed copy


def _overlaps(a: Box, b: Box) -> bool:
    """Whether two non-empty boxes share an element."""
    return not b.is_empty() and all(
        max(oa, ob) < min(oa + sa, ob + sb)
        for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )
