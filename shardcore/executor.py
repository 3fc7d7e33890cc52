"""Execute a ReshardPlan in memory, and the box copy / bucket packing the servers reuse.

`apply_plan` runs every transfer as a local copy: the servers use it for the
local part of a plan and tests use it to prove plans right. `pack_bucket` and
`unpack_bucket` lay a bucket's boxes out as one flat byte buffer (transfer
after transfer, each box C-contiguous) for collective sends and receives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shardserve.core.metadata import Box, ShardedTensorMetadata
from shardserve.core.planner import Bucket, ReshardPlan, Transfer
from shardserve.core.regions import local_view


def copy_box(
    src_tensor: torch.Tensor, src_box: Box, dst_tensor: torch.Tensor, dst_box: Box, box: Box
) -> None:
    """Copy the global `box` from a local shard (covering src_box) into another (covering dst_box)."""
    local_view(dst_tensor, dst_box, box).copy_(local_view(src_tensor, src_box, box))


def _check_shards(meta: ShardedTensorMetadata, tensors: Sequence[torch.Tensor], name: str) -> None:
    if len(tensors) != len(meta.shards_metadata):
        raise ValueError(
            f"{name} has {len(tensors)} tensors but the metadata has "
            f"{len(meta.shards_metadata)} shards"
        )
    for i, (shard, tensor) in enumerate(zip(meta.shards_metadata, tensors)):
        _check_shard(meta, i, tensor, name)


def _check_shard(meta: ShardedTensorMetadata, index: int, tensor: torch.Tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}[{index}] is a {type(tensor).__name__}, not a torch.Tensor")
    expected = meta.shards_metadata[index].shard_sizes
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"{name}[{index}] has shape {tuple(tensor.shape)} but shard {index} "
            f"has sizes {expected}"
        )
    if tensor.dtype != meta.dtype:
        raise ValueError(
            f"{name}[{index}] has dtype {tensor.dtype} but the tensor's dtype is {meta.dtype}"
        )


def apply_plan(
    plan: ReshardPlan,
    src_shards: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor] | None = None,
    device: torch.device | str | None = None,
) -> list[torch.Tensor]:
    """Run every transfer of `plan` in memory: destination shard tensors in shards_metadata order.

    `src_shards` are the source shard tensors in `plan.src.shards_metadata`
    order. Destination tensors are written into `out` when given, else newly
    allocated on `device` (default: the first source tensor's device, or cpu).
    """
    if not isinstance(plan, ReshardPlan):
        raise TypeError(f"plan must be a ReshardPlan, got {type(plan).__name__}")
    src_shards = list(src_shards)
    _check_shards(plan.src, src_shards, "src_shards")
    if out is None:
        if device is None:
            device = src_shards[0].device if src_shards else torch.device("cpu")
        out = [
            torch.empty(shard.shard_sizes, dtype=plan.dst.dtype, device=device)
            for shard in plan.dst.shards_metadata
        ]
    else:
        out = list(out)
        _check_shards(plan.dst, out, "out")
    src_boxes = [s.box for s in plan.src.shards_metadata]
    dst_boxes = [s.box for s in plan.dst.shards_metadata]
    for t in plan.transfers:
        copy_box(
            src_shards[t.src_shard],
            src_boxes[t.src_shard],
            out[t.dst_shard],
            dst_boxes[t.dst_shard],
            t.box,
        )
    return out


def _narrow(
    tensor: torch.Tensor, local_offsets: tuple[int, ...], sizes: tuple[int, ...], name: str
) -> torch.Tensor:
    """The box at local_offsets/sizes as a view of a local shard tensor."""
    if tensor.dim() != len(sizes):
        raise ValueError(f"{name} is {tensor.dim()}-D but the transfer box is {len(sizes)}-D")
    view = tensor
    for d, (o, s) in enumerate(zip(local_offsets, sizes)):
        if o < 0 or o + s > tensor.shape[d]:
            raise ValueError(
                f"{name} of shape {tuple(tensor.shape)} does not hold the transfer box "
                f"(local offset {o}, size {s} in dim {d})"
            )
        view = view.narrow(d, o, s)
    return view


def _flat_piece(flat: torch.Tensor, start: int, t: Transfer, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of transfer `t` inside a flat uint8 buffer, as a C-contiguous box of `dtype`."""
    return flat[start : start + t.nbytes].view(dtype).view(t.sizes)


def _lookup(tensors: Mapping[int, torch.Tensor], index: int, name: str) -> torch.Tensor:
    try:
        tensor = tensors[index]
    except (KeyError, IndexError):
        raise ValueError(f"{name} has no tensor for shard {index}") from None
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}[{index}] is a {type(tensor).__name__}, not a torch.Tensor")
    return tensor


def pack_bucket(
    bucket: Bucket,
    src_tensors_by_index: Mapping[int, torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bucket's source boxes as one flat uint8 tensor, transfer after transfer.

    `src_tensors_by_index` maps source shard indices to their local tensors;
    `out` (1-D uint8, bucket.nbytes long) is filled when given.
    """
    if out is None:
        first = _lookup(src_tensors_by_index, bucket.transfers[0].src_shard, "src_tensors_by_index")
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=first.device)
    _check_flat(out, bucket, "out")
    start = 0
    for t in bucket.transfers:
        src = _lookup(src_tensors_by_index, t.src_shard, "src_tensors_by_index")
        view = _narrow(src, t.src_local_offsets(), t.sizes, f"src_tensors_by_index[{t.src_shard}]")
        _flat_piece(out, start, t, src.dtype).copy_(view)
        start += t.nbytes
    return out


def unpack_bucket(
    bucket: Bucket, flat: torch.Tensor, dst_tensors_by_index: Mapping[int, torch.Tensor]
) -> None:
    """Write a packed bucket's boxes into the destination shard tensors (by dst shard index)."""
    _check_flat(flat, bucket, "flat")
    start = 0
    for t in bucket.transfers:
        dst = _lookup(dst_tensors_by_index, t.dst_shard, "dst_tensors_by_index")
        view = _narrow(dst, t.dst_local_offsets(), t.sizes, f"dst_tensors_by_index[{t.dst_shard}]")
        view.copy_(_flat_piece(flat, start, t, dst.dtype))
        start += t.nbytes


def _check_flat(flat: torch.Tensor, bucket: Bucket, name: str) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise TypeError(f"{name} must be a 1-D torch.uint8 tensor")
    if flat.numel() != bucket.nbytes:
        raise ValueError(f"{name} holds {flat.numel()} bytes but the bucket has {bucket.nbytes}")
    if not flat.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
