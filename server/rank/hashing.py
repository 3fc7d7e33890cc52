"""The rank's shard checksums: computed once per version when it is promoted, on a pool shared by the rank.

A version's local shards are hashed (shardserve.core.checksums: xxh3-64 of the raw bytes) after every byte is
written and before it is persisted or served, one shard per pool thread (xxhash releases the GIL), the shards
of every version a promote names together, so a promote of many shards costs about their bytes over the cores
(a small shard sent as bytes was hashed as it landed: server/rank/leases.py HASHED_AS_WRITTEN_BYTES). A shard
keeps its checksum for its life on the rank: a promote retried, a re-promote after a coordinator restart and a
restore answer the same value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from shardserve.core.checksums import hashing_pool, shard_checksums, views_checksum

Shards = Mapping[int, torch.Tensor]
Checksums = Mapping[int, int]
StableViews = Callable[[torch.Tensor], Sequence[torch.Tensor] | None]


def missing_checksums(
    versions: Sequence[tuple[Shards, Checksums]], *, stable_views: StableViews | None = None
) -> list[dict[int, int]]:
    """For each version's (shards, known checksums), the checksums of its shards not known yet. The shards of
    every version are hashed together, in parallel: a weight sync's promote has one shard per version, and
    hashing version after version ran those shards one by one (a CUDA rank's 1 GiB state dict of 64 tensors:
    64 single-shard trips through host memory, ~80 ms of a 106 ms put on an H200). A shard for which
    `stable_views` answers views (a row update's composed version) is read through them instead of its own
    new mapping, whose every page would fault in first."""
    todo = {
        (position, index): tensor
        for position, (shards, known) in enumerate(versions)
        for index, tensor in shards.items()
        if index not in known
    }
    found: list[dict[int, int]] = [{} for _ in versions]
    if not todo:
        return found
    pool = hashing_pool()
    views = {key: stable_views(t) for key, t in todo.items()} if stable_views else {}
    composed = {key: pool.submit(views_checksum, v) for key, v in views.items() if v is not None}
    plain = {key: t for key, t in todo.items() if key not in composed}
    sums = {**shard_checksums(plain, pool), **{k: f.result() for k, f in composed.items()}}
    for (position, index), checksum in sums.items():
        found[position][index] = checksum
    return found
