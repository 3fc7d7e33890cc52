"""Expected shard values computed with plain torch slicing, never with the layout code under test
(shardcore.regions.cut_tensor, local_view and the executors all share one region routine)."""
from __future__ import annotations

import torch

from shardcore.metadata import ShardedTensorMetadata, ShardMetadata


def shard_of(full: torch.Tensor, shard: ShardMetadata) -> torch.Tensor:
    """The part of `full` that `shard` covers: `full[o0:o0+n0, o1:o1+n1, ...]`."""
    return full[tuple(slice(o, o + n) for o, n in zip(shard.shard_offsets, shard.shard_sizes, strict=True))]


def shards_of(full: torch.Tensor, meta: ShardedTensorMetadata) -> list[torch.Tensor]:
    """Every shard of `meta` cut from `full`, in the metadata's order."""
    return [shard_of(full, shard) for shard in meta.shards_metadata]
