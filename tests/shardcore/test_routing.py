"""route_rows / RowIndex: every valid id reaches exactly the shards holding its row, bit for bit."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardserve.core import (
    ChunkShardingSpec,
    Replicate,
    RowIndex,
    Shard,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    cut_tensor,
    make_metadata,
    metadata_from_placements,
    route_rows,
    unique_ids,
)


@st.composite
def tables(draw):
    """A 1-4-D table cut into a random grid (rows and inner dims), replicas, and maybe a missing box."""
    ndim = draw(st.integers(1, 4))
    size = tuple([draw(st.integers(0, 12))] + [draw(st.integers(1, 4)) for _ in range(ndim - 1)])
    per_dim = []
    for n in size:
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        bounds = [0, *cuts, n]
        per_dim.append(list(zip(bounds, bounds[1:])))
    boxes = list(itertools.product(*per_dim))
    if boxes and draw(st.booleans()):
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))  # leaves rows that no shard holds whole
    shards = []
    for box in boxes:
        for rank in draw(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True)):
            shards.append(
                ShardMetadata(
                    tuple(lo for lo, _ in box), tuple(hi - lo for lo, hi in box), f"rank:{rank}/cpu"
                )
            )
    shards = draw(st.permutations(shards))
    return ShardedTensorMetadata(tuple(shards), size, TensorProperties(dtype=torch.int64))


def held_rows(meta: ShardedTensorMetadata) -> torch.Tensor:
    """Reference: per row, does the layout hold all of it (every inner element)?"""
    painted = torch.zeros(meta.size, dtype=torch.bool)
    for s in meta.shards_metadata:
        painted[tuple(slice(o, o + n) for o, n in zip(s.shard_offsets, s.shard_sizes))] = True
    return painted.reshape(meta.size[0], math.prod(meta.size[1:])).all(dim=1)


def gather(
    meta: ShardedTensorMetadata, routes, ids: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """What a client does: fetch each route's rows from its shard and place the column pieces."""
    shards = cut_tensor(table, meta)
    out = torch.full((len(ids), *meta.size[1:]), -1, dtype=table.dtype)
    for route in routes:
        piece = shards[route.shard][route.local_rows]
        inner = tuple(slice(o, o + n) for o, n in zip(route.inner_offsets, route.inner_sizes))
        assert bool((out[(route.positions, *inner)] == -1).all()), "an element was delivered twice"
        out[(route.positions, *inner)] = piece
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables(), st.data())
def test_routes_deliver_every_valid_id_exactly_once(meta, data):
    n = meta.size[0]
    ids = torch.tensor(data.draw(st.lists(st.integers(-3, n + 3), max_size=40)), dtype=torch.int64)
    table = torch.arange(meta.numel(), dtype=torch.int64).reshape(meta.size)
    held = held_rows(meta)
    in_range = (ids >= 0) & (ids < n)
    expected_bad = ~in_range.clone()
    expected_bad[in_range] = ~held[ids[in_range]]
    index = RowIndex(meta)
    assert torch.equal(index.invalid_mask(ids), expected_bad)
    routes = index.route(ids, invalid="skip")
    shards = {i for i, s in enumerate(meta.shards_metadata)}
    boxes = [meta.shards_metadata[r.shard].box for r in routes]
    assert all(r.shard in shards and len(r) > 0 for r in routes)
    assert len(set(boxes)) == len(boxes), "a replica box was routed twice"
    assert [r.shard for r in routes] == sorted(r.shard for r in routes)
    for r in routes:
        s = meta.shards_metadata[r.shard]
        assert r.rank == s.rank and r.inner_offsets == s.shard_offsets[1:]
        assert bool(((r.local_rows >= 0) & (r.local_rows < s.shard_sizes[0])).all())
        assert not bool(expected_bad[r.positions].any())
        assert torch.equal(ids[r.positions] - s.shard_offsets[0], r.local_rows)
    got = gather(meta, routes, ids, table)
    valid = ~expected_bad
    assert torch.equal(got[valid], table[ids[valid]])
    if bool(expected_bad.any()):
        with pytest.raises(IndexError):
            index.route(ids)
    else:
        assert [
            (r.shard, r.positions.tolist(), r.local_rows.tolist()) for r in index.route(ids)
        ] == [(r.shard, r.positions.tolist(), r.local_rows.tolist()) for r in routes]


def test_row_sharded_table_routes_each_id_to_one_shard():
    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]).build_metadata(
        (10, 3), TensorProperties()
    )
    ids = torch.tensor([9, 0, 4, 3, 4, 8])
    routes = route_rows(meta, ids)
    assert [(r.shard, r.rank, r.positions.tolist(), r.local_rows.tolist()) for r in routes] == [
        (0, 0, [1, 3], [0, 3]),
        (1, 1, [2, 4], [0, 0]),
        (2, 2, [5, 0], [0, 1]),
    ]  # ascending rows
    assert all(r.columns == slice(0, 3) for r in routes)


def test_column_sharded_table_sends_ids_to_every_column_piece():
    meta = ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"]).build_metadata(
        (5, 6), TensorProperties()
    )
    ids = torch.tensor([4, 1])
    routes = route_rows(meta, ids)
    assert [(r.shard, r.positions.tolist(), r.local_rows.tolist(), r.columns) for r in routes] == [
        (0, [1, 0], [1, 4], slice(0, 3)),
        (1, [1, 0], [1, 4], slice(3, 6)),
    ]


def test_replicas_are_routed_once_preferring_a_rank():
    meta = metadata_from_placements((8, 4), [[0, 1], [2, 3]], [Replicate(), Shard(0)])
    ids = torch.tensor([1, 6])
    assert [(r.shard, r.rank) for r in route_rows(meta, ids)] == [(0, 0), (1, 1)]
    assert [(r.shard, r.rank) for r in route_rows(meta, ids, prefer_rank=3)] == [(0, 0), (3, 3)]


def test_out_of_range_raises_naming_the_first_bad_id():
    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]).build_metadata(
        (6, 2), TensorProperties()
    )
    with pytest.raises(
        IndexError, match=r"ids\[2\]=6: out of range for 6 rows \(2 invalid id\(s\) in all\)"
    ):
        route_rows(meta, torch.tensor([0, 5, 6, -1]))


def test_rows_held_by_no_shard_are_invalid():
    meta = make_metadata((6, 2), [((0, 0), (2, 2), 0), ((4, 0), (2, 2), 1)])
    with pytest.raises(IndexError, match=r"ids\[1\]=3: row 3 is held by no shard"):
        route_rows(meta, torch.tensor([1, 3]))


def test_skip_policy_supports_zero_and_default_rows():
    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]).build_metadata(
        (4, 2), TensorProperties()
    )
    table = torch.arange(8.0).reshape(4, 2)
    ids = torch.tensor([3, 99, 0, -2])
    index = RowIndex(meta)
    bad = index.invalid_mask(ids)
    assert bad.tolist() == [False, True, False, True]
    zero_rows = gather(meta, index.route(ids, invalid="skip"), ids, table).masked_fill(
        bad[:, None], 0.0
    )
    assert torch.equal(zero_rows, torch.stack([table[3], torch.zeros(2), table[0], torch.zeros(2)]))
    default_ids = ids.masked_fill(bad, 1)
    assert torch.equal(
        gather(meta, index.route(default_ids), default_ids, table), table[default_ids]
    )


def test_many_ids_across_many_shards_match_plain_indexing():
    n, shards = 100_000, 64
    meta = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(shards)]).build_metadata(
        (n, 2), TensorProperties(dtype=torch.int64)
    )
    ids = torch.randint(0, n, (200_000,), generator=torch.Generator().manual_seed(0))
    table = torch.arange(2 * n).reshape(n, 2)
    routes = route_rows(meta, ids)
    assert len(routes) == shards and sum(len(r) for r in routes) == len(ids)
    assert torch.equal(gather(meta, routes, ids, table), table[ids])


def test_large_batches_sort_with_torch_and_route_exactly_as_numpy_does(monkeypatch):
    from shardserve.core import routing

    meta = ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(5)]).build_metadata(
        (1000, 3), TensorProperties(dtype=torch.int64)
    )
    ids = torch.randint(
        0, 1000, (routing.LARGE_SORT + 17,), generator=torch.Generator().manual_seed(3)
    )
    index = RowIndex(meta)
    by_torch = [(r.shard, r.positions.tolist(), r.local_rows.tolist()) for r in index.route(ids)]
    monkeypatch.setattr(routing, "LARGE_SORT", 1 << 62)
    assert [
        (r.shard, r.positions.tolist(), r.local_rows.tolist()) for r in index.route(ids)
    ] == by_torch


def test_distinct_ids_agree_below_and_past_large_sort(monkeypatch):
    from shardserve.core import routing

    values = torch.randint(
        0, 500, (routing.LARGE_SORT + 9,), generator=torch.Generator().manual_seed(4)
    ).numpy()
    unique, inverse = routing.distinct_ids(values)  # torch.unique
    assert (unique[inverse] == values).all() and (unique[1:] > unique[:-1]).all()
    monkeypatch.setattr(routing, "LARGE_SORT", 1 << 62)
    small_unique, small_inverse = routing.distinct_ids(values)  # numpy
    assert (small_unique == unique).all() and (small_inverse == inverse).all()


def test_int32_ids_are_accepted():
    meta = make_metadata((4, 1), [((0, 0), (4, 1), 0)])
    (route,) = route_rows(meta, torch.tensor([2, 1], dtype=torch.int32))
    assert route.local_rows.dtype == torch.int64 and route.local_rows.tolist() == [1, 2]
    assert route.positions.tolist() == [1, 0]


def test_sorted_ids_skip_the_sort_and_keep_their_positions():
    meta = make_metadata((10, 1), [((0, 0), (5, 1), 0), ((5, 0), (5, 1), 1)])
    ids = torch.tensor([0, 2, 2, 6, 9])
    routes = route_rows(meta, ids)
    assert [(r.positions.tolist(), r.local_rows.tolist()) for r in routes] == [
        ([0, 1, 2], [0, 2, 2]),
        ([3, 4], [1, 4]),
    ]


def test_one_dim_table_routes_whole_rows():
    meta = make_metadata((6,), [((0,), (3,), 0), ((3,), (3,), 1)])
    routes = route_rows(meta, torch.tensor([5, 1]))
    assert [(r.shard, r.local_rows.tolist(), r.columns) for r in routes] == [
        (0, [1], slice(None)),
        (1, [2], slice(None)),
    ]


def test_empty_ids_give_no_routes():
    meta = make_metadata((4, 1), [((0, 0), (4, 1), 0)])
    assert route_rows(meta, torch.tensor([], dtype=torch.int64)) == []


@pytest.mark.parametrize(
    "ids,error,message",
    [
        (torch.tensor([1.0]), TypeError, "ids must hold integers"),
        (torch.tensor([True]), TypeError, "ids must hold integers"),
        ([1, 2], TypeError, "ids must be a torch.Tensor"),
        (torch.tensor([[1]]), ValueError, r"ids must be 1-D, got shape \(1, 1\)"),
    ],
)
def test_bad_ids_are_rejected(ids, error, message):
    meta = make_metadata((4, 1), [((0, 0), (4, 1), 0)])
    with pytest.raises(error, match=message):
        route_rows(meta, ids)


def test_bad_policy_and_metadata_are_rejected():
    meta = make_metadata((4, 1), [((0, 0), (4, 1), 0)])
    with pytest.raises(ValueError, match="invalid must be one of"):
        route_rows(meta, torch.tensor([0]), invalid="zero")
    with pytest.raises(ValueError, match="meta.size must have at least one dim"):
        route_rows(make_metadata((), [((), (), 0)]), torch.tensor([0]))
    with pytest.raises(TypeError, match="meta must be a ShardedTensorMetadata"):
        route_rows({"size": (4, 1)}, torch.tensor([0]))


def test_unique_ids_round_trip():
    ids = torch.tensor([5, 3, 5, 9, 3])
    unique, inverse = unique_ids(ids)
    assert unique.tolist() == [3, 5, 9] and torch.equal(unique[inverse], ids)
