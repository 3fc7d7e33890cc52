"""Layouts of state dicts put by SPMD jobs: who writes which box, and where the boxes go on the server ranks.

Every job rank reports the boxes it holds of each tensor; a box held by
several job ranks (Replicate) is written once, by the lowest of them. By
default each distinct box becomes one server shard, placed on the server rank
with the fewest bytes so far (largest boxes first, over the whole state dict).
A layout given by the caller is refined instead: each of its shards is cut by
the job's boxes, so every server shard lies inside one job box and one job
rank writes it whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardserve.core.metadata import (
    Box,
    RemoteDevice,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)
from shardserve.core.regions import intersect


@dataclass(frozen=True)
class JobTensor:
    """One tensor of a state dict as the job holds it: its size, dtype and each distinct box with its writer."""

    size: tuple[int, ...]
    dtype: torch.dtype
    writers: tuple[tuple[Box, int], ...]  # (box, the lowest job rank holding it), boxes sorted

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


def job_tensors(
    reports: Sequence[Mapping[str, tuple[tuple[int, ...], str, list[Box]]]],
) -> dict[str, JobTensor]:
    """Merge every job rank's report {key: (size, dtype name, its boxes)} into one JobTensor per key.

    Raises ValueError naming the key when ranks disagree on the keys, a size or a dtype."""
    keys = list(reports[0])
    for rank, report in enumerate(reports):
        if sorted(report) != sorted(keys):
            extra, missing = sorted(set(report) - set(keys)), sorted(set(keys) - set(report))
            raise ValueError(
                f"job rank {rank}'s state dict differs from job rank 0's: extra keys {extra}, "
                f"missing keys {missing}"
            )
    tensors = {}
    for key in keys:
        size, dtype_name = reports[0][key][0], reports[0][key][1]
        writers: dict[Box, int] = {}
        for rank, report in enumerate(reports):
            if tuple(report[key][0]) != tuple(size) or report[key][1] != dtype_name:
                raise ValueError(
                    f"{key!r}: job rank {rank} holds a {report[key][1]} tensor of size "
                    f"{tuple(report[key][0])}, job rank 0 a {dtype_name} of size {tuple(size)}"
                )
            for box in report[key][2]:
                writers.setdefault(box, rank)
        ordered = tuple(sorted(writers.items(), key=lambda item: (item[0].offsets, item[0].sizes)))
        tensors[key] = JobTensor(tuple(size), getattr(torch, dtype_name), ordered)
    return tensors


def balanced_layouts(
    tensors: Mapping[str, JobTensor], placements: Sequence[str]
) -> dict[str, ShardedTensorMetadata]:
    """Each distinct non-empty box of every tensor as one shard, on the placement with the fewest bytes so far
    (largest boxes first; ties to the earlier placement). A tensor with no non-empty box gets one empty shard."""
    if not placements:
        raise ValueError("placements is empty: no server rank to place boxes on")
    load = [0] * len(placements)
    chosen: dict[tuple[str, Box], str] = {}
    boxes = [
        (tensor.itemsize * box.numel(), key, box)
        for key, tensor in tensors.items()
        for box, _ in tensor.writers
        if not box.is_empty()
    ]
    for nbytes, key, box in sorted(boxes, key=lambda item: (-item[0], item[1], item[2].offsets)):
        target = min(range(len(placements)), key=lambda i: (load[i], i))
        load[target] += nbytes
        chosen[(key, box)] = placements[target]
    layouts = {}
    for key, tensor in tensors.items():
        shards = [
            ShardMetadata(box.offsets, box.sizes, RemoteDevice(chosen[(key, box)]))
            for box, _ in tensor.writers
            if (key, box) in chosen
        ]
        if not shards:
            shards = [
                ShardMetadata((0,) * len(tensor.size), tensor.size, RemoteDevice(placements[0]))
            ]
        layouts[key] = ShardedTensorMetadata(
            tuple(shards), tensor.size, TensorProperties(dtype=tensor.dtype)
        )
    return layouts


def refine_layout(meta: ShardedTensorMetadata, tensor: JobTensor) -> ShardedTensorMetadata:
    """`meta` with every shard cut by the job's boxes: each new shard lies inside one job box, on the rank of the
    shard it came from (replicas stay replicas)."""
    shards = []
    for shard in meta.shards_metadata:
        pieces = [
            piece
            for box, _ in tensor.writers
            if (piece := intersect(shard.box, box)) is not None and not piece.is_empty()
        ]
        shards += [ShardMetadata(p.offsets, p.sizes, shard.placement) for p in pieces] or (
            [shard] if shard.box.is_empty() else []
        )
    return ShardedTensorMetadata(tuple(shards), meta.size, meta.tensor_properties)


def writer_of(box: Box, tensor: JobTensor) -> tuple[int, Box]:
    """(the job rank that writes server shard `box`, the job box holding it); ValueError when none holds it."""
    for job_box, rank in tensor.writers:
        if job_box.contains(box):
            return rank, job_box
    if box.is_empty():
        return 0, box
    raise ValueError(
        f"box offsets={box.offsets} sizes={box.sizes} lies inside no box the job holds"
    )
