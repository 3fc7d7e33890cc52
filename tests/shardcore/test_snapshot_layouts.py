"""shardcore.snapshots: merging the job's reports, balancing boxes over server ranks, refining a given layout."""

from __future__ import annotations

import pytest

from shardserve.core.metadata import Box
from shardserve.core.snapshots import (
    balanced_layouts,
    job_tensors,
    refine_layout,
    writer_of,
)
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.validation import validate_metadata


def _reports() -> list[dict]:
    rows = [Box((0, 0), (3, 4)), Box((3, 0), (2, 4))]
    return [
        {"w": ((5, 4), "float32", [rows[0]]), "b": ((4,), "int64", [Box((0,), (4,))])},
        {"w": ((5, 4), "float32", [rows[1]]), "b": ((4,), "int64", [Box((0,), (4,))])},
    ]


def test_replicated_boxes_are_written_once_by_the_lowest_rank() -> None:
    tensors = job_tensors(_reports())
    assert tensors["b"].writers == ((Box((0,), (4,)), 0),)
    assert [rank for _, rank in tensors["w"].writers] == [0, 1]


def test_ranks_that_disagree_are_named() -> None:
    reports = _reports()
    reports[1]["w"] = ((6, 4), "float32", [])
    with pytest.raises(ValueError, match="'w': job rank 1 holds a float32 tensor of size"):
        job_tensors(reports)
    del reports[1]["w"]
    with pytest.raises(ValueError, match="missing keys \\['w'\\]"):
        job_tensors(reports)


def test_boxes_are_balanced_by_bytes_and_cover_each_tensor() -> None:
    layouts = balanced_layouts(job_tensors(_reports()), ["rank:0/cpu", "rank:1/cpu"])
    for meta in layouts.values():
        validate_metadata(meta)
    load = {0: 0, 1: 0}
    for meta in layouts.values():
        for i, shard in enumerate(meta.shards_metadata):
            load[shard.rank] += meta.shard_nbytes(i)
    assert sorted(load.values()) == [48, 64]  # largest first onto the lightest rank: 48 | 32 + 32


def test_a_given_layout_is_cut_by_the_job_boxes() -> None:
    tensors = job_tensors(_reports())
    meta = ChunkShardingSpec(1, ["rank:1/cpu", "rank:0/cpu"]).build_metadata((5, 4))
    refined = refine_layout(meta, tensors["w"])
    validate_metadata(refined)
    assert [(s.shard_offsets, s.shard_sizes, s.rank) for s in refined.shards_metadata] == [
        ((0, 0), (3, 2), 1),
        ((3, 0), (2, 2), 1),
        ((0, 2), (3, 2), 0),
        ((3, 2), (2, 2), 0),
    ]
    assert writer_of(Box((3, 2), (2, 2)), tensors["w"]) == (1, Box((3, 0), (2, 4)))
