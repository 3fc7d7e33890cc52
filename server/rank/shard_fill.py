"""How a new shard is filled when it is allocated: left for writes, zeros, ones, normal numbers or its indexes."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from shardserve.core.metadata import Box, ShardedTensorMetadata


class InitFill(enum.Enum):
    """The initial contents of a new version's shards (NONE: the client writes every shard)."""

    NONE = "none"
    ZEROS = "zeros"
    ONES = "ones"
    NORMAL = (
        "normal"  # standard normal; shard i of seed s uses generator seed s + (first replica of i)
    )
    ARANGE = "arange"  # each element's row-major linear index in the global tensor

    @property
    def writes_all(self) -> bool:
        """Whether the fill leaves every shard fully written (all but NONE)."""
        return self is not InitFill.NONE


def _row_major_strides(size: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def arange_box(size: tuple[int, ...], box: Box, dtype: torch.dtype) -> torch.Tensor:
    """The global row-major linear index of every element of `box`, cast to `dtype`."""
    index = torch.zeros(box.sizes, dtype=torch.int64)
    for d, (offset, length, stride) in enumerate(
        zip(box.offsets, box.sizes, _row_major_strides(size))
    ):
        shape = [1] * len(box.sizes)
        shape[d] = length
        index += (torch.arange(offset, offset + length, dtype=torch.int64) * stride).view(shape)
    return index.to(dtype)


def _normal_seed_index(meta: ShardedTensorMetadata, index: int) -> int:
    """Index of the first shard with the same box, so replicas draw the same numbers."""
    box = meta.shards_metadata[index].box
    return next(i for i, s in enumerate(meta.shards_metadata) if s.box == box)


def make_shard(
    meta: ShardedTensorMetadata,
    index: int,
    fill: InitFill,
    seed: int,
    device: torch.device,
    empty: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """A new C-contiguous tensor for shard `index`, filled as `fill` says (in `empty(sizes, dtype)` if given,
    which zero-fills)."""
    shard = meta.shards_metadata[index]
    dtype, sizes = meta.dtype, shard.shard_sizes
    if empty is not None:
        tensor = empty(sizes, dtype)
        if fill not in (InitFill.NONE, InitFill.ZEROS):
            tensor.copy_(make_shard(meta, index, fill, seed, device))
        return tensor
    if fill is InitFill.ZEROS:
        return torch.zeros(sizes, dtype=dtype, device=device)
    if fill is InitFill.ONES:
        return torch.ones(sizes, dtype=dtype, device=device)
    if fill is InitFill.NORMAL:
        generator = torch.Generator().manual_seed(seed + _normal_seed_index(meta, index))
        return torch.randn(sizes, dtype=dtype, generator=generator).to(device)
    if fill is InitFill.ARANGE:
        return arange_box(meta.size, shard.box, dtype).to(device)
    return torch.empty(sizes, dtype=dtype, device=device)
