"""What one rank of an SPMD job holds of each tensor of a state dict: its boxes of the global tensor and the
local tensors holding exactly them (DTensors, ShardedTensors, LocalShardsWrappers, plain tensors)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client.casts import stored_as
from shardserve.client.errors import InvalidArgumentError
from shardserve.core.dtypes import dtype_name, dtype_to_wire
from shardserve.core.metadata import Box
from shardserve.core.state_tree import SplitStateDict, StateTreeError, split_state_dict

# a box of the global tensor and the local tensor holding exactly it
Piece = tuple[Box, torch.Tensor]


def local_pieces(
    value: Any, key: str, rank: int, plain_writer: int
) -> tuple[tuple[int, ...] | None, list[Piece]]:
    """(global size, or None when only the boxes tell it; the boxes this rank holds with their local tensors)."""
    DTensor, ShardedTensor, LocalShardsWrapper = _distributed_types()  # noqa: N806

    if DTensor is not None and isinstance(value, DTensor):
        return tuple(value.shape), _dtensor_pieces(value, LocalShardsWrapper)
    if ShardedTensor is not None and isinstance(value, ShardedTensor):
        return tuple(value.size()), [
            (Box(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)), s.tensor)
            for s in value.local_shards()
        ]
    if LocalShardsWrapper is not None and isinstance(value, LocalShardsWrapper):
        return None, _wrapper_pieces(value)
    if isinstance(value, torch.Tensor):
        arguments.dense_tensor(value, key)
        whole = Box((0,) * value.dim(), tuple(value.shape))
        return tuple(value.shape), [(whole, value)] if rank == plain_writer else []
    raise InvalidArgumentError(
        f"state dict entry {key!r} is a {type(value).__name__}, not a tensor, DTensor, "
        f"ShardedTensor or LocalShardsWrapper"
    )


def _distributed_types() -> tuple[Any, Any, Any]:
    """DTensor, ShardedTensor and LocalShardsWrapper, each None while its module is not imported."""
    return (
        _loaded_type("torch.distributed.tensor", "DTensor"),
        _loaded_type("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
        _loaded_type("torch.distributed.tensor._shards_wrapper", "LocalShardsWrapper"),
    )


def _loaded_type(module: str, name: str) -> Any:
    """`module.name` if that module is imported already, else None: a value cannot be of a type whose module no
    one imported, and importing torch.distributed.tensor costs ~0.8 s, which a state dict of plain tensors (a
    world of one) should not pay on its first put."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def _dtensor_pieces(value: Any, wrapper_type: type | None) -> list[Piece]:
    if value.device_mesh.get_coordinate() is None:
        return []  # this rank is not in the tensor's mesh
    local = value.to_local()
    if wrapper_type is not None and isinstance(local, wrapper_type):
        return _wrapper_pieces(local)
    return [(_local_box(tuple(value.shape), value.device_mesh, tuple(value.placements)), local)]


@functools.lru_cache(maxsize=4096)
def _local_box(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> Box:
    """This process's box of a DTensor of `shape` on `mesh` with `placements`: the same for every put of a
    model (DTensor's own computation, ~40 us a tensor, is done once per distinct layout)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return Box(tuple(offset), tuple(local_shape))


def _wrapper_pieces(wrapper: Any) -> list[Piece]:
    return [
        (Box(tuple(offset), tuple(shard.shape)), shard)
        for shard, offset in zip(wrapper.local_shards(), wrapper.local_offsets())
    ]


def report_pieces(
    flat: Mapping[str, Any], rank: int, plain_writer: int, *, cast: torch.dtype | None = None
) -> tuple[dict[str, Any], dict[str, list[Piece]]]:
    """This rank's report {key: (size, stored dtype name, boxes)} and its pieces {key: [(box, tensor)]}; the
    stored dtype is `cast` for floating tensors when given (client.casts), else the tensor's own."""
    report, pieces = {}, {}
    for key, value in flat.items():
        size, held = local_pieces(value, key, rank, plain_writer)
        source = dtype_of(value)
        dtype_to_wire(source)
        dtype = stored_as(source, cast, key)
        for box, tensor in held:
            if tuple(tensor.shape) != box.sizes:
                raise InvalidArgumentError(
                    f"{key!r}: a local shard of shape {tuple(tensor.shape)} stands for a box "
                    f"of sizes {box.sizes}"
                )
        report[key] = (size, dtype_name(dtype).replace("torch.", ""), [box for box, _ in held])
        pieces[key] = held
    return report, pieces


def resolved_sizes(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reports whose unknown sizes (a bare LocalShardsWrapper) are the bounding extent of every rank's boxes."""
    for key, (size, _, _) in reports[0].items():
        if size is None:
            boxes = [box for report in reports for box in report[key][2]]
            if not boxes:
                raise InvalidArgumentError(
                    f"{key!r}: no rank holds a shard of it, so its size is unknown"
                )
            extent = tuple(
                max(b.offsets[d] + b.sizes[d] for b in boxes) for d in range(boxes[0].ndim)
            )
            for report in reports:
                report[key] = (extent, report[key][1], report[key][2])
    return reports


def dtype_of(value: Any) -> torch.dtype:
    """The element type of a tensor, DTensor, LocalShardsWrapper or ShardedTensor."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    return value.metadata().tensor_properties.dtype


def is_distributed(value: torch.Tensor) -> bool:
    """Whether `value` is a DTensor, ShardedTensor or LocalShardsWrapper (types from modules someone imported:
    a reader's first get of plain tensors imports none of them, ~0.8 s, ~2.8 s where torch has no bytecode)."""
    return isinstance(value, distributed_types())


def distributed_types() -> tuple[type, ...]:
    """DTensor, ShardedTensor and LocalShardsWrapper, those whose modules are imported (is_distributed): for
    `isinstance` over many values."""
    return tuple(loaded for loaded in _distributed_types() if loaded is not None)


def split_tensors(state_dict: Mapping[str, Any]) -> SplitStateDict:
    """`state_dict`'s tensors by dotted key and its typed non-tensor tree; INVALID_ARGUMENT naming the key
    and type of a value that cannot be stored (shardserve.core.state_tree)."""
    try:
        return split_state_dict(state_dict, is_tensor=lambda value: isinstance(value, torch.Tensor))
    except StateTreeError as err:
        raise InvalidArgumentError(str(err)) from None
