"""The coordinator's view of tensor health: copies ranks lost, copies on dead ranks, and the health they give.

A rank that registers again without a version it held has lost its copies of
that version: they are recorded in the catalog record (TensorRecord.lost_shards)
and the tensor stays. A dead rank's copies are unavailable while it is dead.
Answers carry both, with the health shardcore.health derives from them, so a
client reads surviving boxes from live copies and reports lost ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from shardserve.core.health import LayoutHealth, layout_health, name_ranks, ranks_of_copies
from shardserve.core.metadata import Box, ShardedTensorMetadata
from shardserve.server.common.errors import RankUnavailable, ShardsLost
from shardserve.server.coordinator.catalog.records import TensorRecord


def unavailable_shards(record: TensorRecord, rank_dead: Callable[[int], bool]) -> list[int]:
    """The shards of `record` whose copy cannot be read now: lost, or on a rank known to be dead."""
    return UnreadableShards(rank_dead).of(record)


class UnreadableShards:
    """The shards whose copy cannot be read now, for the records of one answer: each rank asked of `rank_dead`
    once, and each layout's shards on those ranks found once (a listing of ten thousand tensors has a few
    layouts)."""

    def __init__(self, rank_dead: Callable[[int], bool]) -> None:
        self._rank_dead = rank_dead
        self._ranks: dict[int, bool] = {}
        self._layouts: dict[ShardedTensorMetadata, tuple[int, ...]] = {}

    def rank(self, rank: int) -> bool:
        """Whether `rank`'s copies cannot be read (asked once per rank)."""
        found = self._ranks.get(rank)
        if found is None:
            found = self._ranks[rank] = self._rank_dead(rank)
        return found

    def of(self, record: TensorRecord) -> list[int]:
        """The shards of `record` whose copy cannot be read now: lost, or on a rank known to be dead; sorted."""
        meta = record.metadata
        on_dead = self._layouts.get(meta)
        if on_dead is None:
            on_dead = self._layouts[meta] = tuple(
                index for index, shard in enumerate(meta.shards_metadata) if self.rank(shard.rank)
            )
        if not record.lost_shards:
            return list(on_dead)
        return sorted(set(record.lost_shards) | set(on_dead))


def check_copies(record: TensorRecord, unavailable: Iterable[int], *, doing: str) -> None:
    """Nothing when every box of `record` keeps a copy outside `unavailable`. Else ShardsLost (SHARDS_LOST) when
    a box's every copy is known gone (its ranks restarted without it), or RankUnavailable (RANK_UNAVAILABLE) when
    its copies are only on ranks that are down, hung or restoring and may come back; `doing` says what
    cannot be done ("resharded")."""
    unavailable = list(unavailable)
    if not unavailable and not record.lost_shards:
        return  # every copy readable: a catalog record's layout covers its tensor (validated when made)
    health = layout_health(record.metadata, unavailable, record.lost_shards)
    if health.gone_boxes:
        raise ShardsLost(
            f"tensor {record.name!r} has boxes whose every copy is gone "
            f"({_named(record, health.gone_boxes)}: restarted without them); it cannot be {doing}: "
            f"delete it or put it again",
            metadata={"tensor": record.name},
        )
    if health.lost_boxes:
        ranks = ranks_of_copies(record.metadata, health.lost_boxes)
        raise RankUnavailable(
            f"tensor {record.name!r} has boxes with no copy on a live rank "
            f"({_named(record, health.lost_boxes)}: down, hung or restoring); it cannot be {doing} "
            f"until one of them is back",
            metadata={"tensor": record.name, "ranks": ",".join(map(str, ranks))},
        )


def _named(record: TensorRecord, boxes: Iterable[Box]) -> str:
    boxes = list(boxes)
    named = ", ".join(f"offsets {b.offsets} sizes {b.sizes}" for b in boxes)
    return f"{named}; their copies were on {name_ranks(ranks_of_copies(record.metadata, boxes))}"


def health_of(record: TensorRecord, unavailable: Iterable[int]) -> LayoutHealth | None:
    """The health of `record` with the copies `unavailable` unreadable; None for a layout it cannot be told of
    (a record the catalog holds was validated when made: an answer must never fail on it)."""
    unavailable = list(unavailable)
    if not unavailable and not record.lost_shards:
        return _whole_health(record.metadata)
    return _health(record.metadata, unavailable, record.lost_shards)


@functools.lru_cache(maxsize=4096)
def _whole_health(meta: ShardedTensorMetadata) -> LayoutHealth | None:
    """The health of a layout with every copy readable: its replicas, told once per layout (a listing of ten
    thousand tensors asks it of a few layouts)."""
    return _health(meta, [], ())


def _health(
    meta: ShardedTensorMetadata, unavailable: list[int], lost: tuple[int, ...]
) -> LayoutHealth | None:
    try:
        return layout_health(meta, unavailable, lost)
    except (ValueError, TypeError):
        return None
