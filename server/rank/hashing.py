"""The rank's shard checksums: computed once per version when it is promoted, on a pool shared by the rank.

A version's local shards are hashed (shardserve.core.checksums: xxh3-64 of the raw bytes) after every byte is
written and before it is persisted or served, one shard per pool thread (xxhash releases the GIL), so a promote
of many shards costs about their bytes over the cores (a small shard sent as bytes was hashed as it landed:
server/rank/leases.py HASHED_AS_WRITTEN_BYTES). A shard keeps its checksum for its life on the rank: a
promote retried, a re-promote after a coordinator restart and a restore answer the same value.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardserve.core.checksums import hashing_pool, shard_checksums


def missing_checksums(
    shards: Mapping[int, torch.Tensor], known: Mapping[int, int]
) -> dict[int, int]:
    """The checksums of the shards not in `known`, hashed in parallel."""
    todo = {index: tensor for index, tensor in shards.items() if index not in known}
    return shard_checksums(todo, hashing_pool()) if todo else {}
