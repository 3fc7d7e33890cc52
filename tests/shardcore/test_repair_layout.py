"""shardcore.repair: where lost copies go, and a plan that reads only available copies rebuilds them exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.core.executor import copy_box
from shardserve.core.health import HEALTHY, layout_health
from shardserve.core.metadata import make_metadata
from shardserve.core.planner import plan_reshard
from shardserve.core.regions import cut_tensor
from shardserve.core.repair import LiveRank, RepairImpossible, ranks_receiving, repaired_layout
from shardserve.core.validation import validate_metadata

MIRRORED = make_metadata(
    (8, 4),
    [
        ((0, 0), (4, 4), "rank:0/cpu"),
        ((0, 0), (4, 4), "rank:1/cpu"),
        ((4, 0), (4, 4), "rank:1/cpu"),
        ((4, 0), (4, 4), "rank:2/cpu"),
    ],
)


def live(*ranks: int, hosts: dict[int, str] | None = None) -> list[LiveRank]:
    return [LiveRank(r, (hosts or {}).get(r, "h0")) for r in ranks]


def test_a_dead_ranks_copies_go_to_live_ranks_that_do_not_hold_the_box():
    repaired = repaired_layout(MIRRORED, {1, 2}, live(0, 2, 3))
    placements = [str(s.placement) for s in repaired.shards_metadata]
    assert (
        placements[0] == "rank:0/cpu" and placements[3] == "rank:2/cpu"
    )  # available copies stay put
    assert (
        placements[1] != "rank:0/cpu" and placements[2] != "rank:2/cpu"
    )  # never beside the other copy
    assert [s.box for s in repaired.shards_metadata] == [s.box for s in MIRRORED.shards_metadata]
    assert (
        layout_health(repaired, ()).state == HEALTHY and layout_health(repaired, ()).replicas == 2
    )
    validate_metadata(repaired)


def test_a_rank_that_came_back_empty_gets_its_own_copies_back():
    repaired = repaired_layout(MIRRORED, {1, 2}, live(0, 1, 2, 3))
    assert repaired == MIRRORED
    assert ranks_receiving(repaired, {1, 2}) == [1]


def test_copies_go_to_another_host_first_then_to_the_least_loaded_rank():
    hosts = {0: "a", 2: "b", 3: "a", 4: "c", 5: "c"}
    repaired = repaired_layout(
        MIRRORED, {1, 2}, live(0, 2, 3, 4, 5, hosts=hosts), load={2: 500, 4: 100}
    )
    # box 0's other copy is on host a (rank 0): rank 3 (host a, empty) loses to the least loaded rank elsewhere
    assert str(repaired.shards_metadata[1].placement) == "rank:5/cpu"
    # box 1's other copy is on host b (rank 2): ranks 0 and 3 (host a) hold nothing, rank 5 now 64 bytes
    assert str(repaired.shards_metadata[2].placement) == "rank:0/cpu"


def test_the_target_ranks_device_is_used():
    repaired = repaired_layout(
        MIRRORED,
        {1},
        [LiveRank(0, "h"), LiveRank(2, "h"), LiveRank(3, "h", "cuda:1")],
        load={2: 10},
    )
    assert str(repaired.shards_metadata[1].placement) == "rank:3/cuda:1"


def test_a_box_without_an_available_copy_or_a_free_rank_cannot_be_repaired():
    with pytest.raises(RepairImpossible, match="no available copy"):
        repaired_layout(MIRRORED, {0, 1}, live(2, 3))
    with pytest.raises(RepairImpossible, match="no rank to repair onto"):
        repaired_layout(MIRRORED, {1}, live(0))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 24), copies=st.integers(2, 3), world=st.integers(4, 6), data=st.data())
def test_a_plan_that_skips_unavailable_copies_rebuilds_the_repaired_layout_bit_for_bit(
    rows, copies, world, data
):
    bands = data.draw(st.integers(1, min(rows, 4)))
    cuts = (
        sorted(data.draw(st.sets(st.integers(1, rows - 1), min_size=bands - 1, max_size=bands - 1)))
        if rows > 1
        else []
    )
    edges = [0, *cuts, rows]
    shards = []
    for b, (start, end) in enumerate(zip(edges, edges[1:])):
        for c in range(copies):
            shards.append(((start, 0), (end - start, 3), f"rank:{(b + c) % world}/cpu"))
    meta = make_metadata((rows, 3), shards)
    dead = data.draw(st.integers(0, world - 1))
    unavailable = {i for i, s in enumerate(meta.shards_metadata) if s.rank == dead}
    repaired = repaired_layout(meta, unavailable, live(*[r for r in range(world) if r != dead]))
    validate_metadata(repaired)
    assert dead not in repaired.ranks()
    assert layout_health(repaired, ()).replicas == copies
    for box_copies in {
        s.box: [t.rank for t in repaired.shards_metadata if t.box == s.box]
        for s in repaired.shards_metadata
    }.values():
        assert len(set(box_copies)) == copies

    tensor = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    plan = plan_reshard(meta, repaired, 64, unavailable)
    assert all(t.src_shard not in unavailable for t in plan.transfers)
    assert dead not in plan.participants(repaired)
    src = {i: shard for i, shard in enumerate(cut_tensor(tensor, meta)) if i not in unavailable}
    out = [torch.full(tuple(s.shard_sizes), float("nan")) for s in repaired.shards_metadata]
    for t in plan.transfers:
        copy_box(
            src[t.src_shard],
            meta.shards_metadata[t.src_shard].box,
            out[t.dst_shard],
            repaired.shards_metadata[t.dst_shard].box,
            t.box,
        )
    for got, want in zip(out, cut_tensor(tensor, repaired)):
        assert torch.equal(got, want)
