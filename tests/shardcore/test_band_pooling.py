"""shardcore.band_pooling against F.embedding_bag on the whole table: row bands, column pieces, weights,
empty bags and requests, "sum" and "mean"."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.core.band_pooling import RowBand, pool_from_bands, split_by_band

SETTINGS = settings(max_examples=60, deadline=None)


def bands_of(table: torch.Tensor, row_cuts: list[int], col_cuts: list[int]) -> list[RowBand]:
    """`table` cut at rows `row_cuts` and columns `col_cuts` (every band cut at the same columns)."""
    rows = [0, *row_cuts, table.shape[0]]
    cols = [0, *col_cuts, table.shape[1]]
    return [
        RowBand(
            top,
            bottom,
            tuple((left, table[top:bottom, left:right]) for left, right in zip(cols, cols[1:])),
        )
        for top, bottom in zip(rows, rows[1:])
    ]


def bags(num_rows: int, sizes: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_rows, (sum(sizes),), generator=generator)
    offsets = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
    return ids, offsets


def test_split_by_band_cuts_ids_offsets_and_weights() -> None:
    ids = torch.tensor([1, 7, 4, 9, 2, 8])
    offsets = torch.tensor([0, 2, 2, 5])  # bags [1, 7], [], [4, 9, 2], [8]
    weights = torch.arange(6, dtype=torch.float32)
    low, middle, high = split_by_band(ids, offsets, [0, 4, 8], weights)
    assert low.ids.tolist() == [1, 2] and low.offsets.tolist() == [0, 1, 1, 2]
    assert low.weights is not None and low.weights.tolist() == [0.0, 4.0]
    assert middle.ids.tolist() == [3, 0] and middle.offsets.tolist() == [0, 1, 1, 2]
    assert high.ids.tolist() == [1, 0] and high.offsets.tolist() == [0, 0, 0, 1]
    assert high.weights is not None and high.weights.tolist() == [3.0, 5.0]
    (whole,) = split_by_band(ids, offsets, [0])
    assert whole.ids is ids and whole.offsets is offsets


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize(
    ("row_cuts", "col_cuts"), [([], []), ([13], []), ([5, 20, 21], []), ([], [3]), ([10], [2, 5])]
)
def test_pool_from_bands_is_embedding_bag_of_the_whole_table(
    mode: str, row_cuts: list[int], col_cuts: list[int]
) -> None:
    table = torch.randn(30, 7, generator=torch.Generator().manual_seed(1))
    ids, offsets = bags(30, [3, 0, 1, 7, 2, 0], seed=2)
    got = pool_from_bands(bands_of(table, row_cuts, col_cuts), ids, offsets, mode=mode)
    want = F.embedding_bag(ids, table, offsets, mode=mode)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if not row_cuts:  # one band: torch's kernel over the same ids, bit for bit
        assert torch.equal(got, want)


def test_bags_within_one_band_are_bit_for_bit() -> None:
    table = torch.randn(40, 5, generator=torch.Generator().manual_seed(3))
    ids, offsets = torch.tensor([1, 6, 2, 30, 39, 31, 7]), torch.tensor([0, 3, 6])
    for mode in ("sum", "mean"):
        got = pool_from_bands(bands_of(table, [20], []), ids, offsets, mode=mode)
        assert torch.equal(got, F.embedding_bag(ids, table, offsets, mode=mode))


def test_weights_and_float64() -> None:
    table = torch.randn(25, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ids, offsets = bags(25, [2, 5, 0, 1], seed=5)
    weights = torch.linspace(-1, 2, ids.numel(), dtype=torch.float64)
    got = pool_from_bands(bands_of(table, [9, 17], [1]), ids, offsets, mode="sum", weights=weights)
    want = F.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=weights)
    torch.testing.assert_close(got, want)


def test_nothing_to_pool_gives_zeros() -> None:
    table = torch.randn(10, 3)
    none = torch.empty(0, dtype=torch.int64)
    got = pool_from_bands(
        bands_of(table, [5], []), none, torch.zeros(4, dtype=torch.int64), mode="mean"
    )
    assert torch.equal(got, torch.zeros(4, 3))
    assert pool_from_bands(bands_of(table, [5], []), none, none, mode="sum").shape == (0, 3)


@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=12),
    cuts=st.lists(st.integers(1, 49), max_size=4, unique=True),
    mode=st.sampled_from(["sum", "mean"]),
    seed=st.integers(0, 1000),
)
@SETTINGS
def test_any_row_bands(sizes: list[int], cuts: list[int], mode: str, seed: int) -> None:
    table = torch.randn(50, 6, generator=torch.Generator().manual_seed(seed))
    ids, offsets = bags(50, sizes, seed)
    got = pool_from_bands(bands_of(table, sorted(cuts), []), ids, offsets, mode=mode)
    torch.testing.assert_close(
        got, F.embedding_bag(ids, table, offsets, mode=mode), rtol=1e-6, atol=1e-6
    )
