"""Region math: box intersection, which shards hold a box, boxes as views of local shards."""

from __future__ import annotations

from collections.abc import Sequence, Set

import torch

from shardserve.core.health import pick_copy
from shardserve.core.metadata import Box, ShardedTensorMetadata


def intersection(
    a_off: tuple[int, ...], a_size: tuple[int, ...], b_off: tuple[int, ...], b_size: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The common box of two boxes (offsets, sizes), or None when they do not overlap (or either is empty). Two
    equal boxes are their own common box (a shard moved whole, a whole shard read), found without the loop."""
    if a_off == b_off and a_size == b_size:
        return (a_off, a_size) if min(a_size, default=1) > 0 else None
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo = ao if ao > bo else bo
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap (or either is empty). When it is one of
    them whole (a read of a whole shard, every shard of a state dict's get), that box itself is returned: no
    new box is made."""
    if a.ndim != b.ndim:
        raise ValueError(f"cannot intersect a {a.ndim}-D box with a {b.ndim}-D box")
    common = intersection(a.offsets, a.sizes, b.offsets, b.sizes)
    if common is None:
        return None
    if common == (a.offsets, a.sizes):
        return a
    if common == (b.offsets, b.sizes):
        return b
    return Box(*common)


def check_box(size: Sequence[int], box: Box) -> None:
    """Raise ValueError naming `offsets`/`sizes` when `box` is not inside a tensor of `size`."""
    if box.ndim != len(size):
        raise ValueError(f"offsets/sizes have {box.ndim} dims but the tensor has {len(size)}")
    for d, (o, s, n) in enumerate(zip(box.offsets, box.sizes, size)):
        if o < 0:
            raise ValueError(f"offsets[{d}]={o} is negative")
        if s < 0:
            raise ValueError(f"sizes[{d}]={s} is negative")
        if o + s > n:
            raise ValueError(
                f"offsets[{d}]+sizes[{d}]={o + s} exceeds the tensor's size {n} in dim {d}"
            )


def shards_for_box(
    meta: ShardedTensorMetadata,
    box: Box,
    prefer_rank: int | None = None,
    unavailable: Set[int] = frozenset(),
    suspect: Set[int] = frozenset(),
) -> list[tuple[int, Box]]:
    """Shards to read to assemble `box`: (shard index, part of box it supplies).

    Replicas (shards with identical boxes) are read once: an available copy (not in `unavailable`, nor in
    `suspect` when another is not), the one on `prefer_rank` if there is one, else the first listed
    (shardcore.health.pick_copy). Parts never overlap.
    """
    copies: dict[
        Box, tuple[list[int], Box]
    ] = {}  # shard box -> (its copies, the part of `box` it supplies)
    for index, shard in enumerate(meta.shards_metadata):
        part = intersect(shard.box, box)
        if part is not None:
            copies.setdefault(shard.box, ([], part))[0].append(index)
    return sorted(
        (
            indices[0]
            if len(indices) == 1
            else pick_copy(meta, indices, unavailable, suspect, prefer_rank),
            part,
        )
        for indices, part in copies.values()
    )


def local_view(local: torch.Tensor, shard_box: Box, box: Box) -> torch.Tensor:
    """The global `box` (inside `shard_box`) as a view of the local shard tensor (`local` itself when the box is
    the whole shard)."""
    if box == shard_box:
        return local
    if not shard_box.contains(box):
        raise ValueError(f"box {box} is not inside shard {shard_box}")
    view = local
    for d, (o, s, so) in enumerate(zip(box.offsets, box.sizes, shard_box.offsets)):
        view = view.narrow(d, o - so, s)
    return view


def cut_tensor(tensor: torch.Tensor, meta: ShardedTensorMetadata) -> list[torch.Tensor]:
    """Each shard of `meta` as a view of the full `tensor`, in shards_metadata order."""
    if tuple(tensor.shape) != meta.size:
        raise ValueError(
            f"tensor shape {tuple(tensor.shape)} does not match metadata size {meta.size}"
        )
    full = Box((0,) * tensor.dim(), tuple(tensor.shape))
    return [local_view(tensor, full, shard.box) for shard in meta.shards_metadata]


def assemble(meta: ShardedTensorMetadata, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from its local shards (replicas are simply written twice)."""
    if len(shards) != len(meta.shards_metadata):
        raise ValueError(f"got {len(shards)} shard tensors for {len(meta.shards_metadata)} shards")
    out = torch.empty(meta.size, dtype=meta.dtype)
    full = Box((0,) * meta.ndim, meta.size)
    for shard, local in zip(meta.shards_metadata, shards):
        local_view(out, full, shard.box).copy_(local)
    return out
