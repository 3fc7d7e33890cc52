"""plan_reshard: which boxes move from which source shard to which destination shard.

Planning apart from execution, as in torch.distributed.tensor._redistribute:
the plan is a pure value; server/ executes it with collectives and
shardcore.executor.apply_plan executes it in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardcore.metadata import Box, ShardedTensorMetadata


@dataclass(frozen=True)
class Transfer:
    """Move the global box (offsets, sizes) from a source shard to a destination shard."""

    src_shard: int
    dst_shard: int
    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class Bucket:
    """Transfers between one (src_rank, dst_rank) pair sent together, at most bucket_bytes."""

    src_rank: int
    dst_rank: int
    transfers: tuple[Transfer, ...]
    nbytes: int


@dataclass(frozen=True)
class ReshardPlan:
    src: ShardedTensorMetadata
    dst: ShardedTensorMetadata
    transfers: tuple[Transfer, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
