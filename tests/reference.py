"""Expected shard values computed with plain torch slicing, never with the layout code under test
(shardcore.regions.cut_tensor, local_view and the executors all share one region routine)."""

from __future__ import annotations

import torch

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata
from shardserve.core.specs import EnumerableShardingSpec


def shard_of(full: torch.Tensor, shard: ShardMetadata) -> torch.Tensor:
    """The part of `full` that `shard` covers: `full[o0:o0+n0, o1:o1+n1, ...]`."""
    return full[
        tuple(slice(o, o + n) for o, n in zip(shard.shard_offsets, shard.shard_sizes, strict=True))
    ]


def shards_of(full: torch.Tensor, meta: ShardedTensorMetadata) -> list[torch.Tensor]:
    """Every shard of `meta` cut from `full`, in the metadata's order."""
    return [shard_of(full, shard) for shard in meta.shards_metadata]


def mirrored(bands: list[tuple[int, ...]], rows: int, dim: int) -> EnumerableShardingSpec:
    """Equal row bands of a `rows` x `dim` tensor, band b held by the ranks bands[b] in that order (its copies:
    reads pick the first live one)."""
    step = rows // len(bands)
    return EnumerableShardingSpec(
        [
            ShardMetadata((b * step, 0), (step, dim), f"rank:{r}/cpu")
            for b, ranks in enumerate(bands)
            for r in ranks
        ]
    )
