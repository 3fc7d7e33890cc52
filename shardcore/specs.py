"""Sharding specs with torch's names: `ChunkShardingSpec` and `EnumerableShardingSpec`.

Both are frozen value types whose `build_metadata(size, tensor_properties)`
returns a `ShardedTensorMetadata`, like
`torch.distributed._shard.sharding_spec`'s classes of the same names.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from shardserve.core.metadata import (
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    as_placement,
)
from shardserve.core.validation import LayoutError, validate_metadata


def tensor_size(size: Iterable[int]) -> tuple[int, ...]:
    """`size` as a tuple of non-negative ints: TypeError for what is not a sequence of integers (bools
    included), ValueError naming the negative dim."""
    try:
        values = tuple(size)
    except TypeError:
        raise TypeError(f"size must be a sequence of integers, got {size!r}") from None
    if any(isinstance(n, bool) for n in values):
        raise TypeError(f"size must hold integers, got {values!r}")
    try:
        values = tuple(operator.index(n) for n in values)
    except TypeError:
        raise TypeError(f"size must hold integers, got {values!r}") from None
    for d, n in enumerate(values):
        if n < 0:
            raise ValueError(f"size[{d}]={n} is negative")
    return values


def _properties(tensor_properties: TensorProperties | None) -> TensorProperties:
    if tensor_properties is None:
        return TensorProperties()
    if not isinstance(tensor_properties, TensorProperties):
        raise TypeError(
            f"tensor_properties must be a shardcore TensorProperties, got {type(tensor_properties).__name__}"
            " (convert torch's with shardcore.interop.properties_from_torch)"
        )
    return tensor_properties


def chunk_bound(dim_size: int, chunks: int, index: int) -> tuple[int, int]:
    """(offset, size) of piece `index` of `chunks` torch.chunk-style pieces of `dim_size`, offset clamped."""
    split = -(-dim_size // chunks)
    return min(split * index, dim_size), max(min(dim_size, split * (index + 1)) - split * index, 0)


def chunk_bounds(dim_size: int, chunks: int) -> list[tuple[int, int]]:
    """(offset, size) of each of `chunks` torch.chunk-style pieces of `dim_size`, offsets clamped."""
    return [chunk_bound(dim_size, chunks, i) for i in range(chunks)]


@dataclass(frozen=True)
class ChunkShardingSpec:
    """Shard one dim into `len(placements)` torch.chunk pieces, piece i on placements[i].

    Equal to torch's `ChunkShardingSpec.build_metadata` shard for shard (same
    count, order, offsets, sizes, placements; negative `dim` allowed, a rank may
    repeat). One difference: when there are more placements than fit the dim
    (ceil(n / k) * i > n for some i), torch emits offsets past the end of the
    dim, which `dcp.save` rejects; here those empty shards get their offset
    clamped to the dim size, so the metadata always validates.
    """

    dim: int
    placements: tuple[RemoteDevice, ...]

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim must be an int, got {self.dim!r}")
        if isinstance(self.placements, (str, bytes)) or not isinstance(self.placements, Iterable):
            raise TypeError(f"placements must be a sequence of placements, got {self.placements!r}")
        placements = tuple(self.placements)
        if not placements:
            raise ValueError("placements must not be empty")
        coerced = []
        for i, p in enumerate(placements):
            if p is None:
                raise ValueError(f"placements[{i}] is None")
            try:
                coerced.append(as_placement(p))
            except ValueError as exc:
                raise ValueError(f"placements[{i}]: {exc}") from None
        object.__setattr__(self, "placements", tuple(coerced))

    def build_metadata(
        self, size: Sequence[int], tensor_properties: TensorProperties | None = None
    ) -> ShardedTensorMetadata:
        """Metadata of a tensor of `size` chunked along `dim` over the placements."""
        size = tensor_size(size)
        if not -len(size) <= self.dim < len(size):
            raise ValueError(
                f"dim {self.dim} is out of range for a {len(size)}-D tensor of size {size}"
            )
        dim = self.dim % len(size)
        shards = []
        for placement, (offset, length) in zip(
            self.placements, chunk_bounds(size[dim], len(self.placements))
        ):
            offsets = [0] * len(size)
            sizes = list(size)
            offsets[dim], sizes[dim] = offset, length
            shards.append(ShardMetadata(tuple(offsets), tuple(sizes), placement))
        return ShardedTensorMetadata(tuple(shards), size, _properties(tensor_properties))


def _as_shard_metadata(index: int, shard: Any) -> ShardMetadata:
    if isinstance(shard, ShardMetadata):
        return shard
    try:
        return ShardMetadata(tuple(shard.shard_offsets), tuple(shard.shard_sizes), shard.placement)
    except AttributeError:
        raise TypeError(
            f"shards[{index}] is a {type(shard).__name__}, not a ShardMetadata"
        ) from None


@dataclass(frozen=True)
class EnumerableShardingSpec:
    """Arbitrary shards listed one by one; they may not overlap (identical boxes are replicas).

    Like torch's EnumerableShardingSpec, construction checks the shards agree
    on the dim count and do not overlap, and `build_metadata` checks they lie
    inside and cover the tensor. Unlike torch, identical boxes on several
    placements are accepted as replicas, and torch ShardMetadata is accepted
    (converted) too.
    """

    shards: tuple[ShardMetadata, ...]

    def __post_init__(self) -> None:
        if isinstance(self.shards, (str, bytes)) or not isinstance(self.shards, Iterable):
            raise TypeError(f"shards must be a sequence of ShardMetadata, got {self.shards!r}")
        shards = tuple(_as_shard_metadata(i, s) for i, s in enumerate(self.shards))
        if not shards:
            raise ValueError("shards must not be empty")
        object.__setattr__(self, "shards", shards)
        ndims = {len(s.shard_sizes) for s in shards}
        if len(ndims) > 1:
            first = len(shards[0].shard_sizes)
            odd = [i for i, s in enumerate(shards) if len(s.shard_sizes) != first]
            raise LayoutError(
                f"dim count mismatch in shards {odd}: shards[0] has {first} dims but "
                f"shards[{odd[0]}] has {len(shards[odd[0]].shard_sizes)}"
            )
        bounding = tuple(
            max(o + s for o, s in zip(col_o, col_s))
            for col_o, col_s in zip(
                zip(*(s.shard_offsets for s in shards)), zip(*(s.shard_sizes for s in shards))
            )
        )
        validate_metadata(
            ShardedTensorMetadata(shards, tuple(max(n, 0) for n in bounding)),
            require_coverage=False,
        )

    def build_metadata(
        self, size: Sequence[int], tensor_properties: TensorProperties | None = None
    ) -> ShardedTensorMetadata:
        """Metadata of a tensor of `size` made of these shards; raises LayoutError if they don't fit it."""
        meta = ShardedTensorMetadata(self.shards, tensor_size(size), _properties(tensor_properties))
        validate_metadata(meta)
        return meta
