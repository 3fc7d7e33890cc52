"""Conversions between shardcore's layout types and torch's: ShardedTensor, DCP and DTensor.

- torch `ShardedTensorMetadata` / `ShardMetadata` / `TensorProperties`
  (torch.distributed._shard): `metadata_to_torch`, `metadata_from_torch`, ...
- torch sharding specs: `spec_to_torch`, `spec_from_torch`, and `as_spec`,
  which takes either kind so client code can accept both.
- DCP `TensorStorageMetadata` / `ChunkStorageMetadata`: DCP stores boxes
  without placements, so `from_dcp_storage_metadata` takes a placement rule
  and `boxes_from_dcp_storage_metadata` returns bare boxes.
- DTensor: `metadata_from_dtensor` (a DTensor or DTensorSpec: mesh +
  placements) and `dtensor_layout` (ours -> mesh list + placements, when
  DTensor's chunk rule reproduces the layout).

torch.distributed is imported lazily, inside the functions that need it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from shardserve.core.metadata import (
    Box,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from shardserve.core.placements import (
    Placement,
    Replicate,
    Shard,
    as_mesh_placement,
    local_box,
    metadata_from_placements,
    parse_mesh,
)
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec

Spec = ChunkShardingSpec | EnumerableShardingSpec
PlacementRule = Callable[[int, Box], Any] | Sequence[Any]


def properties_from_torch(props: Any) -> TensorProperties:
    """Ours from torch's TensorProperties (ShardedTensor's or DCP's; same fields)."""
    try:
        return TensorProperties(
            dtype=props.dtype,
            layout=props.layout,
            requires_grad=bool(props.requires_grad),
            memory_format=props.memory_format,
            pin_memory=bool(props.pin_memory),
        )
    except AttributeError:
        raise TypeError(
            f"tensor_properties must be a TensorProperties, got {type(props).__name__}"
        ) from None


def properties_to_torch(props: TensorProperties) -> Any:
    """torch.distributed._shard.sharded_tensor.metadata.TensorProperties from ours."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchProperties

    return TorchProperties(
        dtype=props.dtype,
        layout=props.layout,
        requires_grad=props.requires_grad,
        memory_format=props.memory_format,
        pin_memory=props.pin_memory,
    )


def shard_metadata_to_torch(shard: ShardMetadata) -> Any:
    """torch ShardMetadata (lists, `_remote_device` placement) from ours."""
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata

    placement = (
        None if shard.placement is None else torch.distributed._remote_device(str(shard.placement))
    )
    return TorchShardMetadata(list(shard.shard_offsets), list(shard.shard_sizes), placement)


def shard_metadata_from_torch(shard: Any) -> ShardMetadata:
    """Ours from a torch ShardMetadata."""
    try:
        return ShardMetadata(tuple(shard.shard_offsets), tuple(shard.shard_sizes), shard.placement)
    except AttributeError:
        raise TypeError(f"expected a torch ShardMetadata, got {type(shard).__name__}") from None


def metadata_to_torch(meta: ShardedTensorMetadata) -> Any:
    """torch ShardedTensorMetadata from ours."""
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata as TorchMeta

    if not isinstance(meta, ShardedTensorMetadata):
        raise TypeError(
            f"meta must be a shardcore ShardedTensorMetadata, got {type(meta).__name__}"
        )
    return TorchMeta(
        [shard_metadata_to_torch(s) for s in meta.shards_metadata],
        torch.Size(meta.size),
        properties_to_torch(meta.tensor_properties),
    )


def metadata_from_torch(meta: Any) -> ShardedTensorMetadata:
    """Ours from a torch ShardedTensorMetadata (or a ShardedTensor, via its .metadata())."""
    if callable(getattr(meta, "metadata", None)):
        meta = meta.metadata()
    try:
        shards, size, props = meta.shards_metadata, meta.size, meta.tensor_properties
    except AttributeError:
        raise TypeError(
            f"expected a torch ShardedTensorMetadata, got {type(meta).__name__}"
        ) from None
    return ShardedTensorMetadata(
        tuple(shard_metadata_from_torch(s) for s in shards),
        tuple(size),
        properties_from_torch(props),
    )


def spec_to_torch(spec: Spec) -> Any:
    """torch's ChunkShardingSpec / EnumerableShardingSpec from ours.

    torch's EnumerableShardingSpec rejects identical boxes, so a spec with
    replicas raises ValueError here.
    """
    from torch.distributed._shard import sharding_spec as torch_specs

    if isinstance(spec, ChunkShardingSpec):
        return torch_specs.ChunkShardingSpec(spec.dim, [str(p) for p in spec.placements])
    if isinstance(spec, EnumerableShardingSpec):
        try:
            return torch_specs.EnumerableShardingSpec(
                [shard_metadata_to_torch(s) for s in spec.shards]
            )
        except ValueError as exc:
            raise ValueError(
                f"torch's EnumerableShardingSpec refuses these shards (replicas?): {exc}"
            ) from None
    raise TypeError(
        f"spec must be a shardcore ChunkShardingSpec or EnumerableShardingSpec, got {type(spec).__name__}"
    )


def spec_from_torch(spec: Any) -> Spec:
    """Ours from torch's ChunkShardingSpec / EnumerableShardingSpec."""
    from torch.distributed._shard import sharding_spec as torch_specs

    if isinstance(spec, torch_specs.ChunkShardingSpec):
        return ChunkShardingSpec(
            cast(int, spec.dim),  # a named (str) dim is refused by ChunkShardingSpec
            tuple(RemoteDevice(str(p)) for p in spec.placements),
        )
    if isinstance(spec, torch_specs.EnumerableShardingSpec):
        return EnumerableShardingSpec(tuple(shard_metadata_from_torch(s) for s in spec.shards))
    raise TypeError(
        f"spec must be torch's ChunkShardingSpec or EnumerableShardingSpec, got {type(spec).__name__}"
    )


def as_spec(spec: Any) -> Spec:
    """Our spec from ours or torch's, so an API can take either."""
    if isinstance(spec, (ChunkShardingSpec, EnumerableShardingSpec)):
        return spec
    return spec_from_torch(spec)


def _distinct_boxes(meta: ShardedTensorMetadata) -> list[Box]:
    """Non-empty boxes, each once, in first-seen order."""
    return list(dict.fromkeys(s.box for s in meta.shards_metadata if not s.box.is_empty()))


def to_dcp_storage_metadata(meta: ShardedTensorMetadata) -> Any:
    """DCP TensorStorageMetadata: one chunk per distinct non-empty box (replicas stored once)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.metadata import TensorProperties as DcpProperties

    if not isinstance(meta, ShardedTensorMetadata):
        raise TypeError(
            f"meta must be a shardcore ShardedTensorMetadata, got {type(meta).__name__}"
        )
    p = meta.tensor_properties
    props = DcpProperties(
        dtype=p.dtype,
        layout=p.layout,
        requires_grad=p.requires_grad,
        memory_format=p.memory_format,
        pin_memory=p.pin_memory,
    )
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes))
        for b in _distinct_boxes(meta)
    ]
    return TensorStorageMetadata(properties=props, size=torch.Size(meta.size), chunks=chunks)


def boxes_from_dcp_storage_metadata(storage: Any) -> list[Box]:
    """The chunk boxes of a DCP TensorStorageMetadata, in its order."""
    try:
        return [Box(tuple(c.offsets), tuple(c.sizes)) for c in storage.chunks]
    except AttributeError:
        raise TypeError(
            f"expected a DCP TensorStorageMetadata, got {type(storage).__name__}"
        ) from None


def from_dcp_storage_metadata(storage: Any, placement: PlacementRule) -> ShardedTensorMetadata:
    """Our metadata from DCP storage metadata; `placement` is one placement per chunk or f(index, box)."""
    boxes = boxes_from_dcp_storage_metadata(storage)
    if callable(placement):
        placements = [placement(i, b) for i, b in enumerate(boxes)]
    elif isinstance(placement, (str, bytes)) or not isinstance(placement, Sequence):
        raise TypeError(
            "placement must be a sequence (one per chunk) or a callable (index, box) -> placement"
        )
    else:
        placements = list(placement)
        if len(placements) != len(boxes):
            raise ValueError(
                f"placement has {len(placements)} entries but the storage has {len(boxes)} chunks"
            )
    shards = tuple(ShardMetadata(b.offsets, b.sizes, p) for b, p in zip(boxes, placements))
    return ShardedTensorMetadata(
        shards, tuple(storage.size), properties_from_torch(storage.properties)
    )


def placements_to_torch(placements: Sequence[Placement]) -> tuple[Any, ...]:
    """torch.distributed.tensor Shard/Replicate from ours."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    out = []
    for i, p in enumerate(placements):
        p = as_mesh_placement(p, i)
        out.append(TorchShard(p.dim) if isinstance(p, Shard) else TorchReplicate())
    return tuple(out)


def placements_from_torch(placements: Sequence[Any]) -> tuple[Placement, ...]:
    """Our Shard/Replicate from torch's; Partial and _StridedShard raise TypeError."""
    return tuple(as_mesh_placement(p, i) for i, p in enumerate(placements))


def metadata_from_dtensor(
    dtensor: Any, size: Sequence[int] | None = None, *, devices_per_host: int = 1
) -> ShardedTensorMetadata:
    """Our metadata of a DTensor, or of a DTensorSpec (give `size` when it carries no tensor_meta)."""
    mesh = getattr(dtensor, "device_mesh", None)
    if mesh is None:
        mesh = getattr(dtensor, "mesh", None)
    if mesh is None or not hasattr(dtensor, "placements"):
        raise TypeError(f"expected a DTensor or DTensorSpec, got {type(dtensor).__name__}")
    dtype = getattr(dtensor, "dtype", None)
    if size is None:
        meta = getattr(dtensor, "tensor_meta", None)
        size = (
            tuple(dtensor.shape)
            if isinstance(dtensor, torch.Tensor)
            else getattr(meta, "shape", None)
        )
        dtype = dtype or getattr(meta, "dtype", None)
        if size is None:
            raise ValueError("size is required: the DTensorSpec has no tensor_meta")
    device = "cuda" if mesh.device_type == "cuda" else "cpu"
    return metadata_from_placements(
        tuple(size),
        mesh.mesh.tolist(),
        placements_from_torch(dtensor.placements),
        dtype=dtype or torch.float32,
        device=device,
        devices_per_host=devices_per_host,
    )


def dtensor_layout(
    meta: ShardedTensorMetadata, mesh_ndims: Sequence[int] = (1, 2)
) -> tuple[list[Any], tuple[Placement, ...]]:
    """(mesh as nested list of ranks, placements) reproducing `meta` by DTensor's rule.

    The shards must be listed in mesh row-major order, one per distinct rank,
    on one device type (cuda indices are not compared). Raises ValueError when
    no 1-D or 2-D mesh with Shard/Replicate placements reproduces the layout.
    """
    if not isinstance(meta, ShardedTensorMetadata):
        raise TypeError(
            f"meta must be a shardcore ShardedTensorMetadata, got {type(meta).__name__}"
        )
    shards = meta.shards_metadata
    ranks = [s.rank for s in shards]
    if not shards or len(set(ranks)) != len(ranks):
        raise ValueError(
            "not expressible as DTensor placements: a mesh needs one shard per distinct rank"
        )
    if len({s.device.type for s in shards}) != 1:
        raise ValueError(
            "not expressible as DTensor placements: shards are on several device types"
        )
    choices = [None] + list(range(meta.ndim))
    for shape in _mesh_shapes(len(shards), mesh_ndims):
        for rules in itertools.product(choices, repeat=len(shape)):
            if _reproduces(meta, shape, rules):
                mesh = torch.tensor(ranks).reshape(shape).tolist()
                parse_mesh(mesh)
                return mesh, tuple(Replicate() if d is None else Shard(d) for d in rules)
    raise ValueError(
        f"not expressible as DTensor placements on a {' or '.join(f'{n}-D' for n in mesh_ndims)} "
        f"mesh: no Shard/Replicate combination reproduces these {len(shards)} shards"
    )


def _mesh_shapes(count: int, mesh_ndims: Sequence[int]) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    if 1 in mesh_ndims:
        shapes.append((count,))
    if 2 in mesh_ndims:
        shapes += [(a, count // a) for a in range(1, count + 1) if count % a == 0]
    return shapes


def _reproduces(
    meta: ShardedTensorMetadata, shape: tuple[int, ...], rules: tuple[int | None, ...]
) -> bool:
    for shard, coordinate in zip(
        meta.shards_metadata, itertools.product(*(range(n) for n in shape))
    ):
        offsets, sizes = local_box(meta.size, shape, coordinate, rules, {})
        if (offsets, sizes) != (shard.shard_offsets, shard.shard_sizes):
            return False
    return True


def remote_device_to_torch(placement: RemoteDevice) -> Any:
    """torch.distributed._remote_device from ours."""
    return torch.distributed._remote_device(str(placement))
