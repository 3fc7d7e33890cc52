"""DTensor-style placements (`Shard(dim)`, `Replicate()`) over a mesh of ranks, as shard metadata.

`metadata_from_placements` gives one shard per mesh coordinate (row-major
over the mesh) with DTensor's chunk rule: the sizes and offsets equal
`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`, whose
empty chunks already carry an offset clamped to the dim size.
`sharding_shapes` overrides the rule with explicit uneven sizes, as
physicsnemo's ShardTensor does.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex, cast

import torch

from shardserve.core.metadata import (
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from shardserve.core.specs import chunk_bound


@dataclass(frozen=True)
class Shard:
    """Split tensor dim `dim` (negative counts from the end) across one mesh dim."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard.dim must be an int, got {self.dim!r}")


@dataclass(frozen=True)
class Replicate:
    """Hold the whole tensor (as sharded by the other mesh dims) on every rank of one mesh dim."""


Placement = Shard | Replicate
SizeEntry = int | Sequence[int]


def as_mesh_placement(value: Any, index: int = 0) -> Placement:
    """Our Shard/Replicate from ours or torch.distributed.tensor's; other kinds are refused."""
    if isinstance(value, (Shard, Replicate)):
        return value
    kind = type(value).__name__
    if kind == "Shard" and hasattr(value, "dim"):
        return Shard(int(value.dim))
    if kind == "Replicate":
        return Replicate()
    raise TypeError(
        f"placements[{index}] is a {kind}; only Shard(dim) and Replicate() are supported"
    )


def parse_mesh(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(mesh shape, ranks in row-major order) of a list, nested list or tensor of ranks."""
    if isinstance(mesh, torch.Tensor):
        mesh = mesh.tolist()
    shape = _nested_shape(mesh)
    ranks = tuple(_flatten(mesh, len(shape)))
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"mesh holds {r!r}; ranks must be non-negative integers")
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"mesh lists ranks {dup} more than once")
    return shape, ranks


def _nested_shape(mesh: Any) -> tuple[int, ...]:
    if not isinstance(mesh, (list, tuple)) or not mesh:
        raise ValueError(
            f"mesh must be a non-empty list (1-D) or list of lists (2-D) of ranks, got {mesh!r}"
        )
    if not isinstance(mesh[0], (list, tuple)):
        return (len(mesh),)
    inner = _nested_shape(mesh[0])
    for row in mesh:
        if not isinstance(row, (list, tuple)) or _nested_shape(row) != inner:
            raise ValueError(f"mesh is not rectangular: rows {mesh!r}")
    return (len(mesh),) + inner


def _flatten(mesh: Any, depth: int) -> list[Any]:
    if depth == 1:
        return list(mesh)
    return [r for row in mesh for r in _flatten(row, depth - 1)]


def placement_string(rank: int, device: str = "cpu", devices_per_host: int = 1) -> str:
    """ "rank:N/cpu", or "rank:N/cuda:K" with K = rank % devices_per_host."""
    if device == "cpu":
        return f"rank:{rank}/cpu"
    if device == "cuda":
        return f"rank:{rank}/cuda:{rank % devices_per_host}"
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def metadata_from_placements(
    size: Sequence[int],
    mesh: Any,
    placements: Sequence[Any],
    dtype: torch.dtype = torch.float32,
    sharding_shapes: Mapping[int, Sequence[SizeEntry]] | None = None,
    *,
    device: str = "cpu",
    devices_per_host: int = 1,
) -> ShardedTensorMetadata:
    """Shard metadata of a tensor laid out on `mesh` by DTensor `placements`, one shard per rank.

    `sharding_shapes` maps a mesh dim that carries `Shard(d)` to the sizes of
    its chunks along tensor dim d, one entry per mesh coordinate on that mesh
    dim, in order: `{0: [5, 3]}` splits dim d into 5 + 3 rows. An entry may
    also be a full local shape (physicsnemo's form), of which entry d is used
    and the dims that no mesh dim shards must equal the tensor's. The sizes
    must add up to the extent being split. Empty chunks get offset size[d],
    as DTensor gives them.
    """
    size = _checked_size(size)
    shape, ranks = parse_mesh(mesh)
    rules = _checked_placements(placements, shape, len(size))
    if (
        isinstance(devices_per_host, bool)
        or not isinstance(devices_per_host, int)
        or devices_per_host < 1
    ):
        raise ValueError(f"devices_per_host must be a positive int, got {devices_per_host!r}")
    placement_string(0, device, devices_per_host)
    explicit = _checked_sharding_shapes(sharding_shapes, shape, rules, size)
    shards = []
    for rank, coordinate in zip(ranks, itertools.product(*(range(n) for n in shape))):
        offsets, sizes = local_box(size, shape, coordinate, rules, explicit)
        shards.append(
            ShardMetadata(
                offsets, sizes, RemoteDevice(placement_string(rank, device, devices_per_host))
            )
        )
    return ShardedTensorMetadata(tuple(shards), size, TensorProperties(dtype=dtype))


def _checked_size(size: Sequence[int]) -> tuple[int, ...]:
    values = tuple(size)
    for d, n in enumerate(values):
        if isinstance(n, bool) or not isinstance(n, int):
            try:
                n = operator.index(n)
            except TypeError:
                raise TypeError(f"size[{d}] must be an int, got {n!r}") from None
        if n < 0:
            raise ValueError(f"size[{d}]={n} is negative")
    return tuple(operator.index(n) for n in values)


def _checked_placements(
    placements: Sequence[Any], shape: tuple[int, ...], ndim: int
) -> tuple[int | None, ...]:
    """Per mesh dim, the normalized tensor dim it shards, or None for Replicate."""
    placements = tuple(placements)
    if len(placements) != len(shape):
        raise ValueError(
            f"placements has {len(placements)} entries but the mesh has {len(shape)} dims"
        )
    rules: list[int | None] = []
    for i, p in enumerate(placements):
        p = as_mesh_placement(p, i)
        if isinstance(p, Replicate):
            rules.append(None)
            continue
        if not -ndim <= p.dim < ndim:
            raise ValueError(
                f"placements[{i}] = Shard({p.dim}) is out of range for a {ndim}-D tensor"
            )
        rules.append(p.dim % ndim)
    return tuple(rules)


def _checked_sharding_shapes(
    sharding_shapes: Mapping[int, Sequence[SizeEntry]] | None,
    shape: tuple[int, ...],
    rules: tuple[int | None, ...],
    size: tuple[int, ...],
) -> dict[int, tuple[int, ...]]:
    """sharding_shapes as {mesh dim: chunk lengths along its tensor dim}, checked."""
    if sharding_shapes is None:
        return {}
    if not isinstance(sharding_shapes, Mapping):
        raise TypeError(
            f"sharding_shapes must be a dict {{mesh_dim: [sizes]}}, got {type(sharding_shapes).__name__}"
        )
    sharded = {d for d in rules if d is not None}
    out = {}
    for mesh_dim, entries in sharding_shapes.items():
        where = f"sharding_shapes[{mesh_dim!r}]"
        if (
            isinstance(mesh_dim, bool)
            or not isinstance(mesh_dim, int)
            or not 0 <= mesh_dim < len(shape)
        ):
            raise ValueError(f"{where}: key must be a mesh dim in [0, {len(shape)})")
        tensor_dim = rules[mesh_dim]
        if tensor_dim is None:
            raise ValueError(
                f"{where}: mesh dim {mesh_dim} is Replicate(), it has no chunks to size"
            )
        entries = tuple(entries)
        if len(entries) != shape[mesh_dim]:
            raise ValueError(
                f"{where} has {len(entries)} entries but mesh dim {mesh_dim} has {shape[mesh_dim]}"
            )
        out[mesh_dim] = tuple(
            _chunk_length(f"{where}[{k}]", e, tensor_dim, sharded, size)
            for k, e in enumerate(entries)
        )
    return out


def _chunk_length(
    where: str, entry: SizeEntry, tensor_dim: int, sharded: set[int], size: tuple[int, ...]
) -> int:
    if isinstance(entry, (list, tuple, torch.Size)):
        if len(entry) != len(size):
            raise ValueError(
                f"{where} is a shape of {len(entry)} dims but the tensor has {len(size)}"
            )
        for d, n in enumerate(entry):
            if d not in sharded and n != size[d]:
                raise ValueError(
                    f"{where}[{d}]={n} but dim {d} is not sharded and has size {size[d]}"
                )
        entry = entry[tensor_dim]
    try:
        if isinstance(entry, bool):
            raise TypeError
        entry = operator.index(cast(SupportsIndex, entry))  # raises TypeError for a non-integer
    except TypeError:
        raise ValueError(f"{where} must be a non-negative int or a shape, got {entry!r}") from None
    if entry < 0:
        raise ValueError(f"{where} must be a non-negative int or a shape, got {entry!r}")
    return entry


def local_box(
    size: tuple[int, ...],
    shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    rules: tuple[int | None, ...],
    explicit: dict[int, tuple[int, ...]],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) at one mesh coordinate by DTensor's left-to-right rule.

    `rules[m]` is the tensor dim mesh dim m shards (None: Replicate);
    `explicit[m]` optional chunk lengths replacing the chunk rule on mesh dim m.
    """
    offsets, sizes = [0] * len(size), list(size)
    for mesh_dim, tensor_dim in enumerate(rules):
        if tensor_dim is None:
            continue
        c = coordinate[mesh_dim]
        if mesh_dim in explicit:
            lengths = explicit[mesh_dim]
            if sum(lengths) != sizes[tensor_dim]:
                raise ValueError(
                    f"sharding_shapes[{mesh_dim}] adds up to {sum(lengths)} but tensor dim {tensor_dim} "
                    f"has {sizes[tensor_dim]} to split there (at mesh coordinate {coordinate})"
                )
            start, length = sum(lengths[:c]), lengths[c]
        else:
            start, length = chunk_bound(sizes[tensor_dim], shape[mesh_dim], c)
        offsets[tensor_dim] = size[tensor_dim] if length == 0 else offsets[tensor_dim] + start
        sizes[tensor_dim] = length
    return tuple(offsets), tuple(sizes)
