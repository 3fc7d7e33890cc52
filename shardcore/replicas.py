"""Replicas on request: a layout expanded so that every non-empty box is held by R distinct ranks.

`replicate_layout(meta, replicas, candidates)` keeps each shard where it is
(listed first, so reads that pick the first live copy do not move) and places
R-1 extra copies of its box on other candidate ranks: first on hosts that hold
no copy of the box yet, then on the rank with the fewest bytes placed so far,
ties by rank number. Boxes are taken in turn from the least loaded rank that
still has boxes to copy, since its boxes are the ones that cannot use it. The
result is a plain ShardedTensorMetadata; the same input always gives the same
layout.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsIndex, cast

from shardserve.core.health import copies_by_box
from shardserve.core.metadata import RemoteDevice, ShardedTensorMetadata, ShardMetadata


@dataclass(frozen=True)
class CandidateRank:
    """A rank that may hold copies: its number, the host it runs on (ranks with equal hosts share a machine)
    and its device ("cpu", "cuda:K")."""

    rank: int
    host: str
    device: str = "cpu"


def replicate_layout(
    meta: ShardedTensorMetadata, replicas: int, candidates: Sequence[CandidateRank]
) -> ShardedTensorMetadata:
    """`meta` with every non-empty box held by `replicas` distinct ranks, the extra copies on `candidates`.

    Raises ValueError naming `replicas` when it is below 1, above the number of candidate ranks, or above 1
    for a layout that already holds a box on several ranks.
    """
    replicas = _checked_replicas(replicas, candidates)
    if replicas == 1:
        return meta
    _check_not_replicated(meta, replicas)
    copies = _place_copies(meta, replicas, candidates)
    shards: list[ShardMetadata] = []
    for index, shard in enumerate(meta.shards_metadata):
        shards.append(shard)
        shards.extend(
            dataclasses.replace(shard, placement=RemoteDevice((c.rank, c.device)))
            for c in copies.get(index, ())
        )
    return dataclasses.replace(meta, shards_metadata=tuple(shards))


def _checked_replicas(replicas: object, candidates: Sequence[CandidateRank]) -> int:
    """`replicas` as an int in [1, len(candidates)]; the candidates' ranks distinct and devices valid."""
    if isinstance(replicas, bool):
        raise ValueError(f"replicas must be an int, got {replicas!r}")
    try:
        replicas = operator.index(
            cast(SupportsIndex, replicas)
        )  # raises TypeError for a non-integer
    except TypeError:
        raise ValueError(f"replicas must be an int, got {replicas!r}") from None
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    ranks = [c.rank for c in candidates]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"candidate ranks {sorted(ranks)} list a rank more than once")
    for candidate in candidates:
        RemoteDevice((candidate.rank, candidate.device))
    if replicas > len(candidates):
        raise ValueError(
            f"replicas={replicas} is more than the {len(candidates)} live ranks "
            f"({sorted(ranks)}) that could hold the copies"
        )
    return replicas


def _check_not_replicated(meta: ShardedTensorMetadata, replicas: int) -> None:
    """ValueError when a box of `meta` is already held by several shards (its copies are set by the layout)."""
    for box, held_by in copies_by_box(meta).items():
        if len(held_by) > 1:
            raise ValueError(
                f"replicas={replicas} asks for copies of a layout that already has replicas (shards {held_by} "
                f"hold offsets {box.offsets}, sizes {box.sizes}); give replicas=1 or a layout with one copy per box"
            )


def _place_copies(
    meta: ShardedTensorMetadata, replicas: int, candidates: Sequence[CandidateRank]
) -> dict[int, list[CandidateRank]]:
    """{shard index: its R-1 extra copies' ranks} for every non-empty shard, balanced by bytes placed."""
    hosts = {c.rank: c.host for c in candidates}
    placed: dict[int, int] = {}
    waiting: dict[int, deque[int]] = {}  # rank -> its shards still to copy, in order
    for index, shard in enumerate(meta.shards_metadata):
        placed[shard.rank] = placed.get(shard.rank, 0) + meta.shard_nbytes(index)
        if not shard.box.is_empty():
            waiting.setdefault(shard.rank, deque()).append(index)
    copies: dict[int, list[CandidateRank]] = {}
    while waiting:
        rank = min(waiting, key=lambda r: (placed.get(r, 0), r))
        index = waiting[rank].popleft()
        if not waiting[rank]:
            del waiting[rank]
        copies[index] = _copies_of(index, meta, replicas, candidates, hosts, placed)
    return copies


def _copies_of(
    index: int,
    meta: ShardedTensorMetadata,
    replicas: int,
    candidates: Sequence[CandidateRank],
    hosts: dict[int, str],
    placed: dict[int, int],
) -> list[CandidateRank]:
    """The R-1 ranks that get copies of shard `index`: on a host holding no copy yet if any, then the fewest
    bytes placed, then the lowest rank; `placed` counts them."""
    primary = meta.shards_metadata[index].rank
    holders, used_hosts = {primary}, {hosts[primary]} if primary in hosts else set()
    chosen = []
    for _ in range(replicas - 1):
        target = min(
            (c for c in candidates if c.rank not in holders),
            key=lambda c: (c.host in used_hosts, placed.get(c.rank, 0), c.rank),
        )
        chosen.append(target)
        holders.add(target.rank)
        used_hosts.add(target.host)
        placed[target.rank] = placed.get(target.rank, 0) + meta.shard_nbytes(index)
    return chosen
