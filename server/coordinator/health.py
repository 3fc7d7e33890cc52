"""The coordinator's view of tensor health: copies ranks lost, copies on dead ranks, and the health they give.

A rank that registers again without a version it held has lost its copies of
that version: they are recorded in the catalog record (TensorRecord.lost_shards)
and the tensor stays. A dead rank's copies are unavailable while it is dead.
Answers carry both, with the health shardcore.health derives from them, so a
client reads surviving boxes from live copies and reports lost ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shardserve.core.health import LayoutHealth, layout_health, name_ranks, ranks_of_copies
from shardserve.server.coordinator.records import TensorRecord


def unavailable_shards(record: TensorRecord, rank_dead: Callable[[int], bool]) -> list[int]:
    """The shards of `record` whose copy cannot be read now: lost, or on a rank known to be dead."""
    dead = {rank for rank in record.ranks() if rank_dead(rank)}
    shards = record.metadata.shards_metadata
    on_dead = [index for index, shard in enumerate(shards) if shard.rank in dead]
    return sorted(set(record.lost_shards) | set(on_dead))


def boxes_without_copy(record: TensorRecord, unavailable: Iterable[int]) -> str:
    """ "" when every box of `record` keeps a copy outside `unavailable`; else the boxes with none and the ranks
    their copies were on, for an error message."""
    unavailable = list(unavailable)
    if not unavailable:
        return ""
    lost = layout_health(record.metadata, unavailable).lost_boxes
    if not lost:
        return ""
    boxes = ", ".join(f"offsets {b.offsets} sizes {b.sizes}" for b in lost)
    ranks = name_ranks(ranks_of_copies(record.metadata, lost))
    return f"{boxes}; their copies were on {ranks}: down, or restarted without them"


def health_of(record: TensorRecord, unavailable: Iterable[int]) -> LayoutHealth | None:
    """The health of `record` with the copies `unavailable` unreadable; None for a layout it cannot be told of
    (a record the catalog holds was validated when made: an answer must never fail on it)."""
    try:
        return layout_health(record.metadata, list(unavailable))
    except (ValueError, TypeError):
        return None
