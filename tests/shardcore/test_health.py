"""shardcore.health: health, lost boxes and replicas of a layout with unavailable copies, and the copy a read picks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.core.health import (
    DEGRADED,
    HEALTHY,
    LOST,
    UNAVAILABLE,
    copies_by_box,
    layout_health,
    lost_boxes_in,
    pick_copy,
    ranks_of_copies,
)
from shardserve.core.metadata import Box, ShardMetadata, TensorProperties
from shardserve.core.regions import shards_for_box
from shardserve.core.routing import RowIndex
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec


def _layout(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]], size: tuple[int, ...] = (8, 4)
):
    spec = EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{r}/cpu") for o, s, r in boxes])
    return spec.build_metadata(size, TensorProperties(dtype=torch.float32))


PLAIN = _layout([((0, 0), (4, 4), 0), ((4, 0), (2, 4), 1), ((6, 0), (2, 4), 2)])
# every box on two ranks: shards 0,1 hold rows 0-3, shards 2,3 rows 4-7
MIRRORED = _layout(
    [((0, 0), (4, 4), 0), ((0, 0), (4, 4), 1), ((4, 0), (4, 4), 1), ((4, 0), (4, 4), 2)]
)


def test_a_plain_layout_is_healthy_with_one_replica():
    health = layout_health(PLAIN, [])
    assert (health.state, health.lost_boxes, health.replicas) == (HEALTHY, (), 1)


def test_a_plain_layout_cannot_read_the_boxes_of_its_dead_rank_until_it_is_back():
    health = layout_health(PLAIN, [1])
    assert health.state == UNAVAILABLE and health.lost_boxes == (Box((4, 0), (2, 4)),)
    assert health.gone_boxes == ()  # the rank may come back with them
    assert ranks_of_copies(PLAIN, health.lost_boxes) == [1]


def test_a_box_is_lost_only_when_every_copy_is_known_gone():
    health = layout_health(PLAIN, [1], lost=[1])  # rank 1 restarted without its copy
    assert health.state == LOST and health.gone_boxes == health.lost_boxes == (Box((4, 0), (2, 4)),)
    mirrored = layout_health(MIRRORED, [2, 3], lost=[2])  # one copy gone, the other on a dead rank
    assert mirrored.state == UNAVAILABLE and mirrored.gone_boxes == ()
    assert layout_health(MIRRORED, [2, 3], lost=[2, 3]).state == LOST


def test_a_mirrored_layout_is_degraded_until_both_copies_of_a_box_are_gone():
    assert layout_health(MIRRORED, []).replicas == 2
    assert layout_health(MIRRORED, [1, 2]).state == DEGRADED  # rank 1 dead: each box keeps one copy
    health = layout_health(MIRRORED, [2, 3])
    assert health.state == UNAVAILABLE and health.lost_boxes == (Box((4, 0), (4, 4)),)
    assert ranks_of_copies(MIRRORED, health.lost_boxes) == [1, 2]


def test_replicas_is_the_minimum_over_boxes():
    partly = _layout([((0, 0), (4, 4), 0), ((0, 0), (4, 4), 1), ((4, 0), (4, 4), 2)])
    assert layout_health(partly, []).replicas == 1
    assert layout_health(partly, [0]).state == DEGRADED


def test_empty_shards_count_for_nothing():
    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]).build_metadata(
        (2, 3), TensorProperties(dtype=torch.float32)
    )  # rank 2's shard is empty
    assert len(copies_by_box(meta)) == 2
    assert layout_health(meta, [2]).state == HEALTHY


def test_lost_boxes_in_a_read_are_only_those_it_touches():
    assert lost_boxes_in(PLAIN, Box((0, 0), (4, 4)), {1}) == []
    assert lost_boxes_in(PLAIN, Box((3, 1), (2, 2)), {1}) == [Box((4, 0), (2, 4))]
    assert lost_boxes_in(MIRRORED, Box((0, 0), (8, 4)), {1, 2}) == []


def test_a_read_picks_a_live_copy_then_a_suspect_one():
    assert pick_copy(MIRRORED, [0, 1]) == 0
    assert pick_copy(MIRRORED, [0, 1], unavailable={0}) == 1
    assert pick_copy(MIRRORED, [0, 1], suspect={0}) == 1
    assert pick_copy(MIRRORED, [0, 1], unavailable={0}, suspect={1}) == 1  # suspect beats dead
    assert pick_copy(MIRRORED, [0, 1], prefer_rank=1) == 1
    assert (
        pick_copy(MIRRORED, [0, 1], suspect={1}, prefer_rank=1) == 0
    )  # a live copy beats the preferred rank


def test_shards_for_box_and_row_routing_avoid_dead_copies():
    whole = Box((0, 0), (8, 4))
    assert [i for i, _ in shards_for_box(MIRRORED, whole)] == [0, 2]
    assert [i for i, _ in shards_for_box(MIRRORED, whole, unavailable={0, 2})] == [1, 3]
    assert [i for i, _ in shards_for_box(MIRRORED, whole, suspect={1, 2})] == [0, 3]
    routes = RowIndex(MIRRORED, unavailable={0}).route(torch.tensor([1, 5]))
    assert [(r.shard, r.rank) for r in routes] == [(1, 1), (2, 1)]


@st.composite
def _mirrored_layouts(draw):
    """Row bands, each on 1-3 distinct ranks of 4, and a set of unavailable shard indices."""
    bands = draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
    boxes, start = [], 0
    for rows in bands:
        for rank in draw(st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)):
            boxes.append(((start, 0), (rows, 2), rank))
        start += rows
    meta = _layout(boxes, (start, 2))
    dead = draw(st.sets(st.integers(0, 3)))
    unavailable = {i for i, shard in enumerate(meta.shards_metadata) if shard.rank in dead}
    return meta, unavailable


@settings(max_examples=200, deadline=None)
@given(_mirrored_layouts())
def test_health_agrees_with_the_copies_a_read_can_use(case):
    meta, unavailable = case
    health = layout_health(meta, unavailable)
    whole = Box((0, 0), meta.size)
    parts = shards_for_box(meta, whole, unavailable=unavailable)
    used_dead = {meta.shards_metadata[i].box for i, _ in parts if i in unavailable}
    assert used_dead == set(health.lost_boxes) == set(lost_boxes_in(meta, whole, unavailable))
    assert (health.state == UNAVAILABLE) == bool(health.lost_boxes)  # none known gone here
    copies = copies_by_box(meta)
    assert health.replicas == min(len(c) for c in copies.values())
    some_copy_gone = any(i in unavailable for c in copies.values() for i in c)
    assert (health.state == HEALTHY) == (not some_copy_gone)

    def order(box: Box) -> tuple:
        return box.offsets, box.sizes

    assert sorted((part for _, part in parts), key=order) == sorted(
        copies, key=order
    )  # every box read once
