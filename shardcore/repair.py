"""Where a repair puts the copies a layout lost: the repaired layout, planned apart from running it.

A copy is lost when its rank died for good or came back without it. A box
that still has an available copy is repaired by making a new copy: on the
copy's own rank when that rank is live again (it restarted empty), otherwise
on another live rank that does not hold the box yet, on a host none of the
box's available copies is on where possible, the least loaded first. The
repaired layout keeps every shard's index and box, so it is a plain layout of
the same shape that a reshard job (reading only available copies) turns the
current version into.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, replace

from shardserve.core.health import copies_by_box
from shardserve.core.metadata import RemoteDevice, ShardedTensorMetadata


@dataclass(frozen=True)
class LiveRank:
    """A rank a repair may copy onto: its number, host (ranks on one host share failures) and device."""

    rank: int
    host: str
    device: str = "cpu"


class RepairImpossible(ValueError):
    """The layout cannot be repaired now: a box has no available copy, or no live rank can take a copy."""


def repaired_layout(
    meta: ShardedTensorMetadata,
    unavailable: Set[int],
    live: Sequence[LiveRank],
    load: Mapping[int, int] | None = None,
) -> ShardedTensorMetadata:
    """`meta` with every shard in `unavailable` placed where a live rank can hold it (see the module doc).

    `load` is the bytes each rank holds already (the least loaded takes a copy first, ties by rank number).
    Raises RepairImpossible naming the box when it has no available copy or no live rank can take one.
    """
    by_rank = {place.rank: place for place in live}
    load = dict(load or {})
    shards = list(meta.shards_metadata)
    for box, copies in copies_by_box(meta).items():
        missing = [i for i in copies if i in unavailable]
        if not missing:
            continue
        kept = [i for i in copies if i not in unavailable]
        if not kept:
            raise RepairImpossible(
                f"box offsets {box.offsets} sizes {box.sizes} has no available copy"
            )
        holders = {shards[i].rank for i in kept}
        for index in missing:
            target = _target(shards[index].rank, holders, by_rank, load)
            if target is None:
                raise RepairImpossible(
                    f"box offsets {box.offsets} sizes {box.sizes}: every live rank "
                    f"({sorted(by_rank)}) holds a copy already; no rank to repair onto"
                )
            holders.add(target.rank)
            load[target.rank] = load.get(target.rank, 0) + meta.shard_nbytes(index)
            placement = RemoteDevice(f"rank:{target.rank}/{target.device}")
            shards[index] = replace(shards[index], placement=placement)
    return replace(meta, shards_metadata=tuple(shards))


def _target(
    own_rank: int, holders: set[int], by_rank: Mapping[int, LiveRank], load: Mapping[int, int]
) -> LiveRank | None:
    """The copy's own rank when it is live (restarted empty), else the best live rank not holding the box."""
    if own_rank in by_rank and own_rank not in holders:
        return by_rank[own_rank]
    held_hosts = {by_rank[r].host for r in holders if r in by_rank}
    candidates = [place for rank, place in by_rank.items() if rank not in holders]
    if not candidates:
        return None
    return min(candidates, key=lambda p: (p.host in held_hosts, load.get(p.rank, 0), p.rank))


def ranks_receiving(after: ShardedTensorMetadata, shards: Set[int]) -> list[int]:
    """The sorted ranks that receive the new copies of `shards` in the repaired layout."""
    return sorted({after.shards_metadata[i].rank for i in shards})
