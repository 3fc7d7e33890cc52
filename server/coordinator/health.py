"""The coordinator's view of tensor health: copies ranks lost, copies on dead ranks, and what answers say.

A rank that registers again without a version it held has lost its copies of
that version: they are recorded in the catalog row (TensorInfo.lost_shards)
and the tensor stays. A dead rank's copies are unavailable while it is dead.
Answers carry both, with the health shardcore.health derives from them, so a
client reads surviving boxes from live copies and reports lost ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shardserve.core.health import layout_health, name_ranks, ranks_of_copies
from shardserve.core.metadata import RemoteDevice
from shardserve.core.wire import metadata_from_proto
from shardserve.protos import shardserve_pb2 as pb


def shards_on(info: pb.TensorInfo, rank: int) -> list[int]:
    """The indices of the shards of `info` placed on `rank`."""
    return [index for index, shard_rank in enumerate(_shard_ranks(info)) if shard_rank == rank]


def with_lost(info: pb.TensorInfo, shards: Iterable[int]) -> pb.TensorInfo:
    """A copy of the catalog row `info` with `shards` added to its lost copies."""
    out = pb.TensorInfo()
    out.CopyFrom(info)
    lost = sorted(set(info.lost_shards) | set(shards))
    del out.lost_shards[:]
    out.lost_shards.extend(lost)
    return out


def unavailable_shards(info: pb.TensorInfo, rank_dead: Callable[[int], bool]) -> list[int]:
    """The shards of `info` whose copy cannot be read now: lost, or on a rank known to be dead."""
    dead = {rank for rank in _placed_ranks(info) if rank_dead(rank)}
    on_dead = [index for index, rank in enumerate(_shard_ranks(info)) if rank in dead]
    return sorted(set(info.lost_shards) | set(on_dead))


def boxes_without_copy(info: pb.TensorInfo, unavailable: Iterable[int]) -> str:
    """ "" when every box of `info` keeps a copy outside `unavailable`; else the boxes with none and the ranks their
    copies were on, for an error message."""
    unavailable = list(unavailable)
    if not unavailable:
        return ""
    meta = metadata_from_proto(info.metadata)
    lost = layout_health(meta, unavailable).lost_boxes
    if not lost:
        return ""
    boxes = ", ".join(f"offsets {b.offsets} sizes {b.sizes}" for b in lost)
    return f"{boxes}; their copies were on {name_ranks(ranks_of_copies(meta, lost))}: down, or restarted without them"


def describe(info: pb.TensorInfo, rank_dead: Callable[[int], bool]) -> pb.TensorInfo:
    """`info` as answered to clients: its unavailable shards, health and replicas filled in."""
    out = pb.TensorInfo()
    out.CopyFrom(info)
    unavailable = unavailable_shards(info, rank_dead)
    out.unavailable_shards.extend(unavailable)
    try:
        health = layout_health(metadata_from_proto(info.metadata), unavailable)
    except (
        ValueError,
        TypeError,
    ):  # a row the catalog holds was validated when made; never fail an answer
        return out
    out.health, out.replicas = health.state, health.replicas
    return out


def _shard_ranks(info: pb.TensorInfo) -> list[int]:
    """Per shard, the rank of its placement."""
    return [RemoteDevice(shard.placement).rank() for shard in info.metadata.shards_metadata]


def _placed_ranks(info: pb.TensorInfo) -> set[int]:
    return set(_shard_ranks(info))
