"""shardcore.embedding against F.embedding / F.embedding_bag / nn.EmbeddingBag on random tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.core.embedding import (
    PartialBags,
    bag_of_ids,
    bag_subset,
    combine_partials,
    dedup_ids,
    lookup_rows,
    partial_pool,
    pool_bags,
    restore_order,
    validate_ids,
)
from shardserve.core.metadata import make_metadata
from shardserve.core.routing import route_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SETTINGS = settings(max_examples=60, deadline=None)


def random_table(
    rows: int, dim: int, dtype: torch.dtype, seed: int, dyadic: bool = False
) -> torch.Tensor:
    """A random table; `dyadic` tables hold multiples of 1/8 in [-1, 1], so small sums are exact in any dtype."""
    gen = torch.Generator().manual_seed(seed)
    if dyadic:
        return (torch.randint(-8, 9, (rows, dim), generator=gen).float() / 8).to(dtype)
    return torch.randn(rows, dim, generator=gen).to(dtype)


def random_bags(
    num_rows: int, bag_sizes: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids with duplicates (drawn from few rows) and nn.EmbeddingBag offsets; bag sizes may be 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, (sum(bag_sizes),), generator=gen)
    offsets = (
        torch.tensor([0] + bag_sizes[:-1], dtype=torch.int64).cumsum(0)
        if bag_sizes
        else torch.empty(0, dtype=torch.int64)
    )
    return ids, offsets


# --- ids -----------------------------------------------------------------------------------------


def test_validate_ids_returns_int64_and_mask():
    ids, mask = validate_ids(torch.tensor([3, 0, 9, -1], dtype=torch.int32), 5, oov="zero")
    assert ids.dtype == torch.int64 and torch.equal(ids, torch.tensor([3, 0, 9, -1]))
    assert torch.equal(mask, torch.tensor([False, False, True, True]))
    ids, mask = validate_ids([1, 2], 5)
    assert torch.equal(ids, torch.tensor([1, 2])) and not mask.any()
    ids, mask = validate_ids([], 5)
    assert ids.shape == (0,) and ids.dtype == torch.int64 and mask.shape == (0,)


@pytest.mark.parametrize(
    "ids, position, value", [([0, 4, 5, 7], 2, 5), ([-3, 9], 0, -3), ([1, 2, 3, 4, -1], 4, -1)]
)
def test_validate_ids_error_names_first_bad_id(ids, position, value):
    with pytest.raises(
        ValueError, match=rf"ids\[{position}\]={value} is out of range for a table of 5 rows"
    ):
        validate_ids(torch.tensor(ids), 5)


def test_validate_ids_rejects_bad_arguments():
    with pytest.raises(ValueError, match="oov must be one of"):
        validate_ids([1], 5, oov="ignore")
    with pytest.raises(TypeError, match="ids must hold integers"):
        validate_ids(torch.tensor([1.0]), 5)
    with pytest.raises(TypeError, match="ids must hold integers"):
        validate_ids(torch.tensor([True]), 5)
    with pytest.raises(ValueError, match=r"ids must be 1-D, got shape \(1, 2\)"):
        validate_ids(torch.tensor([[1, 2]]), 5)
    with pytest.raises(ValueError, match="num_rows must be >= 0"):
        validate_ids([1], -1)
    with pytest.raises(TypeError, match="ids must be a tensor or a sequence of ints"):
        validate_ids(["a"], 5)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(
    num_rows=st.integers(1, 40),
    dim=st.integers(1, 9),
    count=st.integers(0, 60),
    seed=st.integers(0, 2**16),
)
def test_lookup_rows_equals_f_embedding(dtype, num_rows, dim, count, seed):
    table = random_table(num_rows, dim, dtype, seed)
    ids = torch.randint(0, num_rows, (count,), generator=torch.Generator().manual_seed(seed + 1))
    assert torch.equal(lookup_rows(table, ids), F.embedding(ids, table))


@pytest.mark.parametrize("oov", ["zero", "default"])
def test_lookup_rows_out_of_range_policies(oov):
    table = random_table(6, 4, torch.float32, 0)
    default = torch.tensor([1.5, -2.0, 3.0, 0.25])
    ids = torch.tensor([2, 6, -1, 5, 100, 2])
    rows = lookup_rows(table, ids, oov=oov, default_row=default if oov == "default" else None)
    fill = default if oov == "default" else torch.zeros(4)
    expected = torch.stack([table[2], fill, fill, table[5], fill, table[2]])
    assert torch.equal(rows, expected)


def test_lookup_rows_errors():
    table = random_table(6, 4, torch.float32, 0)
    with pytest.raises(ValueError, match=r"ids\[1\]=6 is out of range"):
        lookup_rows(table, [0, 6])
    with pytest.raises(ValueError, match="default_row is required"):
        lookup_rows(table, [0, 6], oov="default")
    with pytest.raises(ValueError, match=r"default_row must be a tensor of shape \(4,\)"):
        lookup_rows(table, [0, 6], oov="default", default_row=torch.zeros(3))
    with pytest.raises(ValueError, match="default_row is only used with oov='default'"):
        lookup_rows(table, [0], oov="zero", default_row=torch.zeros(4))
    with pytest.raises(ValueError, match="table must be 2-D"):
        lookup_rows(torch.zeros(3), [0])


@SETTINGS
@given(num_rows=st.integers(1, 30), count=st.integers(0, 80), seed=st.integers(0, 2**16))
def test_dedup_then_restore_order_equals_direct_lookup(num_rows, count, seed):
    table = random_table(num_rows, 5, torch.float32, seed)
    ids = torch.randint(0, num_rows, (count,), generator=torch.Generator().manual_seed(seed))
    unique, inverse = dedup_ids(ids)
    assert torch.equal(unique, torch.unique(ids)) and torch.equal(unique[inverse], ids)
    assert torch.equal(restore_order(F.embedding(unique, table), inverse), F.embedding(ids, table))


def test_restore_order_rejects_bad_inverse():
    with pytest.raises(ValueError, match="inverse holds indices outside 0..1"):
        restore_order(torch.zeros(2, 3), torch.tensor([0, 2]))


# --- pooling -------------------------------------------------------------------------------------

bag_size_lists = st.lists(st.integers(0, 7), min_size=0, max_size=12)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(
    num_rows=st.integers(1, 25),
    dim=st.integers(1, 9),
    bag_sizes=bag_size_lists,
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pool_bags_equals_f_embedding_bag_bit_for_bit(
    *, dtype, num_rows, dim, bag_sizes, mode, weighted, seed
):
    table = random_table(num_rows, dim, dtype, seed)
    ids, offsets = random_bags(num_rows, bag_sizes, seed)
    weights = (
        torch.rand(ids.numel(), generator=torch.Generator().manual_seed(seed)).to(dtype)
        if weighted and mode == "sum"
        else None
    )
    got = pool_bags(F.embedding(ids, table), offsets, mode, weights)
    expected = F.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=weights)
    assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pool_bags_equals_nn_embedding_bag_with_long_bags_and_empty_bags(dtype, mode):
    module = torch.nn.EmbeddingBag(500, 33, mode=mode).to(dtype)
    ids, offsets = random_bags(500, [0, 1, 1000, 0, 37, 2500, 3, 0], seed=7)
    with torch.no_grad():
        expected = module(ids, offsets)
        got = pool_bags(module.weight[ids], offsets, mode)
    assert torch.equal(got, expected)
    assert not got[0].any() and not got[3].any() and not got[7].any()


def test_pool_bags_without_offsets_cuts_equal_bags_like_2d_input():
    module = torch.nn.EmbeddingBag(20, 4, mode="mean")
    ids = torch.randint(0, 20, (6, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = module(ids)
        got = pool_bags(module.weight[ids.reshape(-1)], None, "mean", num_bags=6)
    assert torch.equal(got, expected)


def test_pool_bags_with_no_rows_gives_zero_bags():
    got = pool_bags(torch.empty(0, 3), torch.tensor([0, 0]), "mean")
    assert torch.equal(
        got,
        F.embedding_bag(
            torch.empty(0, dtype=torch.int64), torch.randn(4, 3), torch.tensor([0, 0]), mode="mean"
        ),
    )


def _torch_rejects(**kwargs) -> None:
    """Assert torch itself rejects the call we are about to check (so ours mirrors a real rule)."""
    ids = kwargs.pop("ids", torch.tensor([0, 1, 2]))
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        F.embedding_bag(ids, torch.randn(5, 2), **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(offsets=torch.tensor([0, 1]), mode="mean", per_sample_weights=torch.ones(3)),
            r"per_sample_weights is only supported for mode='sum' \(got mode='mean'\)",
        ),
        (
            dict(offsets=torch.tensor([0, 1]), mode="max", per_sample_weights=torch.ones(3)),
            "mode must be one of",
        ),
        (dict(offsets=torch.tensor([1, 2]), mode="sum"), r"offsets\[0\] has to be 0"),
        (
            dict(offsets=torch.tensor([0, 4]), mode="sum"),
            r"offsets\[-1\]=4 is past the end of the 3 ids",
        ),
        (
            dict(offsets=torch.tensor([0, 2, 1]), mode="sum"),
            r"offsets must be non-decreasing, but offsets\[2\]=1",
        ),
        (
            dict(offsets=torch.tensor([0, 1]), mode="sum", per_sample_weights=torch.ones(2)),
            r"per_sample_weights has shape \(2,\); it must have one weight per id",
        ),
        (
            dict(
                offsets=torch.tensor([0, 1]),
                mode="sum",
                per_sample_weights=torch.ones(3, dtype=torch.float64),
            ),
            "per_sample_weights has dtype torch.float64 but the rows are torch.float32",
        ),
    ],
)
def test_pool_bags_mirrors_torch_argument_errors(kwargs, message):
    _torch_rejects(**dict(kwargs))
    with pytest.raises(ValueError, match=message):
        pool_bags(
            torch.randn(3, 2), kwargs["offsets"], kwargs["mode"], kwargs.get("per_sample_weights")
        )


def test_pool_bags_rejects_bad_offsets_types():
    with pytest.raises(ValueError, match="offsets must be 1-D"):
        pool_bags(torch.randn(3, 2), torch.tensor([[0]]), "sum")
    with pytest.raises(TypeError, match="offsets must hold integers"):
        pool_bags(torch.randn(3, 2), torch.tensor([0.0]), "sum")
    with pytest.raises(ValueError, match="num_bags=2 but offsets describe 1 bags"):
        pool_bags(torch.randn(3, 2), torch.tensor([0]), "sum", num_bags=2)
    with pytest.raises(ValueError, match="num_bags=2 does not divide the 3 ids"):
        pool_bags(torch.randn(3, 2), None, "sum", num_bags=2)
    with pytest.raises(TypeError, match="rows must hold floating point rows"):
        pool_bags(torch.ones(3, 2, dtype=torch.int64), torch.tensor([0]), "sum")


def test_bag_of_ids_and_bag_subset():
    offsets = torch.tensor([0, 2, 2, 5])
    assert torch.equal(bag_of_ids(offsets, 7), torch.tensor([0, 0, 2, 2, 2, 3, 3]))
    order, sub_offsets = bag_subset(offsets, torch.tensor([6, 1, 3]), 7)
    assert torch.equal(torch.tensor([6, 1, 3])[order], torch.tensor([1, 3, 6]))
    assert torch.equal(sub_offsets, torch.tensor([0, 1, 1, 2]))
    order, sub_offsets = bag_subset(offsets, torch.empty(0, dtype=torch.int64), 7)
    assert order.numel() == 0 and torch.equal(sub_offsets, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions hold values outside 0..6"):
        bag_subset(offsets, torch.tensor([7]), 7)


# --- partial pooling over shards ---------------------------------------------------------------


def cut_points(total: int, pieces: int, seed: int) -> list[int]:
    """Sorted cut points 0 = c0 <= ... <= ck = total (pieces may be empty)."""
    gen = torch.Generator().manual_seed(seed)
    inner = sorted(torch.randint(0, total + 1, (pieces - 1,), generator=gen).tolist())
    return [0, *inner, total]


def grid_metadata(
    num_rows: int, dim: int, row_cuts: list[int], col_cuts: list[int], dtype: torch.dtype
):
    shards = []
    for r0, r1 in zip(row_cuts, row_cuts[1:]):
        for c0, c1 in zip(col_cuts, col_cuts[1:]):
            shards.append(((r0, c0), (r1 - r0, c1 - c0), len(shards)))
    return make_metadata((num_rows, dim), shards, dtype)


def pool_on_shards(
    table: torch.Tensor,
    meta,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    mode: str,
) -> torch.Tensor:
    """What the cluster does: route ids, pool each shard's rows on the shard, combine on the client."""
    partials = []
    for route in route_rows(meta, ids):
        shard = meta.shards_metadata[route.shard]
        local = table[
            shard.shard_offsets[0] : shard.shard_offsets[0] + shard.shard_sizes[0], route.columns
        ].clone()  # the shard's own tensor
        order, sub_offsets = bag_subset(offsets, route.positions, ids.numel())
        positions = route.positions[order]
        rows = lookup_rows(local, route.local_rows[order])
        partials.append(
            partial_pool(
                rows,
                sub_offsets,
                None if weights is None else weights[positions],
                col_offset=route.columns.start,
            )
        )
    if not partials:  # no ids at all: every column range answers with empty bags
        for c0, width in sorted(
            {
                (s.shard_offsets[1], s.shard_sizes[1])
                for s in meta.shards_metadata
                if s.shard_sizes[1]
            }
        ):
            partials.append(
                partial_pool(table.new_empty(0, width), torch.zeros_like(offsets), col_offset=c0)
            )
    bag_sizes = torch.diff(offsets, append=torch.tensor([ids.numel()]))
    return combine_partials(partials, mode, table.dtype, expected_counts=bag_sizes)


def error_bound(table, ids, offsets, weights, mode) -> torch.Tensor:
    """A few ulps of the dtype times the bag's sum of |w * row| (how far reassociation can move a sum)."""
    eps = torch.finfo(table.dtype).eps
    absolute = F.embedding_bag(
        ids,
        table.double().abs(),
        offsets,
        mode=mode,
        per_sample_weights=None if weights is None else weights.double().abs(),
    )
    counts = torch.diff(offsets, append=torch.tensor([ids.numel()])).double()
    return eps * (counts.unsqueeze(1) + 2) * absolute + eps


layouts = st.tuples(st.integers(1, 4), st.integers(1, 3))  # row pieces, column pieces


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(
    num_rows=st.integers(1, 30),
    dim=st.integers(1, 8),
    pieces=layouts,
    bag_sizes=bag_size_lists,
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_partial_pooling_over_random_grids_matches_embedding_bag(
    *, dtype, num_rows, dim, pieces, bag_sizes, mode, weighted, seed
):
    row_pieces, col_pieces = pieces
    col_pieces = min(col_pieces, dim)
    row_cuts = cut_points(num_rows, row_pieces, seed)
    col_cuts = [
        0,
        *sorted(
            torch.randperm(dim - 1, generator=torch.Generator().manual_seed(seed))[: col_pieces - 1]
            .add(1)
            .tolist()
        ),
        dim,
    ]
    meta = grid_metadata(num_rows, dim, row_cuts, col_cuts, dtype)
    table = random_table(num_rows, dim, dtype, seed)
    ids, offsets = random_bags(num_rows, bag_sizes, seed)
    weights = (
        torch.rand(ids.numel(), generator=torch.Generator().manual_seed(seed)).to(dtype)
        if weighted and mode == "sum"
        else None
    )
    got = pool_on_shards(table, meta, ids, offsets, weights, mode)
    expected = F.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=weights)
    assert got.dtype == dtype and got.shape == expected.shape
    bound = error_bound(table, ids, offsets, weights, mode)
    assert ((got.double() - expected.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(
    num_rows=st.integers(1, 30),
    dim=st.integers(1, 8),
    pieces=layouts,
    bag_sizes=bag_size_lists,
    seed=st.integers(0, 2**16),
)
def test_partial_sums_of_exact_tables_are_bit_for_bit(
    dtype, num_rows, dim, pieces, bag_sizes, seed
):
    """Tables of multiples of 1/8 sum exactly in any order, so sharded sums must equal torch's bits."""
    row_cuts = cut_points(num_rows, pieces[0], seed)
    col_cuts = cut_points(dim, min(pieces[1], dim), seed + 1)
    meta = grid_metadata(num_rows, dim, row_cuts, col_cuts, dtype)
    table = random_table(num_rows, dim, dtype, seed, dyadic=True)
    ids, offsets = random_bags(num_rows, bag_sizes, seed)
    got = pool_on_shards(table, meta, ids, offsets, None, "sum")
    assert torch.equal(got, F.embedding_bag(ids, table, offsets, mode="sum"))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bags_held_by_one_shard_are_bit_for_bit(dtype, mode):
    """Random-valued rows: a bag whose ids all live on one row shard is pooled in torch's own order."""
    num_rows, dim = 90, 12
    meta = grid_metadata(num_rows, dim, [0, 25, 60, 90], [0, 5, 12], dtype)
    table = random_table(num_rows, dim, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    bags, ranges = [], [(0, 25), (25, 60), (60, 90)]
    for b in range(40):
        lo, hi = ranges[b % 3]
        bags.append(
            torch.randint(lo, hi, (int(torch.randint(0, 300, (1,), generator=gen)),), generator=gen)
        )
    ids = torch.cat(bags)
    offsets = torch.tensor([0] + [len(b) for b in bags[:-1]]).cumsum(0)
    for weights in (
        [None, torch.rand(ids.numel(), generator=gen).to(dtype)] if mode == "sum" else [None]
    ):
        got = pool_on_shards(table, meta, ids, offsets, weights, mode)
        assert torch.equal(
            got, F.embedding_bag(ids, table, offsets, mode=mode, per_sample_weights=weights)
        )


def test_column_split_table_concatenates_columns():
    table = random_table(10, 6, torch.float32, 1)
    meta = grid_metadata(10, 6, [0, 10], [0, 2, 6], torch.float32)
    ids, offsets = random_bags(10, [3, 0, 4], 2)
    for mode in ("sum", "mean"):
        got = pool_on_shards(table, meta, ids, offsets, None, mode)
        assert torch.equal(got, F.embedding_bag(ids, table, offsets, mode=mode))


def test_partial_pool_counts_and_accumulation_dtype():
    rows = torch.randn(5, 3).half()
    part = partial_pool(rows, torch.tensor([0, 0, 2]), col_offset=4)
    assert part.sums.dtype == torch.float32 and part.col_offset == 4 and part.width == 3
    assert torch.equal(part.counts, torch.tensor([0, 2, 3]))
    assert torch.equal(part.sums[1], rows[:2].float().sum(0))


def test_combine_partials_errors():
    a = PartialBags(torch.zeros(2, 3), torch.tensor([1, 1]), 0)
    with pytest.raises(ValueError, match="partials is empty"):
        combine_partials([], "sum")
    with pytest.raises(ValueError, match="leave columns 3..4 uncovered"):
        combine_partials([a, PartialBags(torch.zeros(2, 2), torch.tensor([1, 1]), 5)], "sum")
    with pytest.raises(ValueError, match="other per-bag counts"):
        combine_partials([a, PartialBags(torch.zeros(2, 2), torch.tensor([2, 1]), 3)], "mean")
    with pytest.raises(ValueError, match="have widths 2 and 3"):
        combine_partials([a, PartialBags(torch.zeros(2, 2), torch.tensor([1, 1]), 0)], "sum")
    with pytest.raises(ValueError, match=r"expected \(2, width\)"):
        combine_partials([a, PartialBags(torch.zeros(3, 3), torch.tensor([1, 1, 1]), 0)], "sum")
    with pytest.raises(TypeError, match=r"partials\[0\] is a tuple"):
        combine_partials([(torch.zeros(2, 3), torch.tensor([1, 1]))], "sum")
    with pytest.raises(ValueError, match="mode must be one of"):
        combine_partials([a], "max")
    with pytest.raises(
        ValueError, match="pooled 1 ids into bag 1 but expected_counts says 3: a shard's partial"
    ):
        combine_partials([a], "sum", expected_counts=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="expected_counts has 3 bags but the partials have 2"):
        combine_partials([a], "sum", expected_counts=torch.tensor([1, 1, 1]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_no_bags_pool_to_an_empty_result_in_every_dtype(dtype):
    """Ids with empty offsets are zero bags; torch's float64 embedding_bag segfaults on that, ours answers."""
    rows = torch.randn(3, 4).to(dtype)
    assert pool_bags(rows, [], "mean").shape == (0, 4)
    assert pool_bags(rows, [], "sum", torch.ones(3, dtype=dtype)).shape == (0, 4)
    partial = partial_pool(rows, [])
    assert partial.sums.shape == (0, 4) and partial.counts.numel() == 0


def test_bags_of_a_table_without_columns_are_empty_rows():
    """torch's embedding_bag raises on a (n, 0) table; pooling answers (bags, 0) as the shape says."""
    rows = torch.empty(3, 0)
    assert pool_bags(rows, torch.tensor([0, 2]), "sum").shape == (2, 0)
    assert partial_pool(rows, torch.tensor([0, 2])).sums.shape == (2, 0)
