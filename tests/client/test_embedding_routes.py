"""Which route a lookup with ids on a device takes (decided from capabilities, so testable without a GPU), and
the GPU route's gathers and pools, run here on CPU tensors: bit for bit nn.Embedding / nn.EmbeddingBag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve.client.embedding.cuda_rows import DeviceTable, RowBlock
from shardserve.client.embedding.routes import Route, choose_route

BOTH = frozenset({"cpu", "cuda"})
CPU = frozenset({"cpu"})
NONE: frozenset[str] = frozenset()


@pytest.mark.parametrize(
    ("ids_on", "shards", "route"),
    [
        ("cuda", [("cuda", BOTH), ("cuda", BOTH)], Route.CUDA_MAPPED),
        ("cuda", [("cuda", BOTH), ("cuda", CPU)], Route.GENERAL),  # a path without CUDA IPC
        ("cuda", [("cuda", BOTH), ("cpu", BOTH)], Route.GENERAL),  # shards on both kinds
        ("cuda", [("cpu", CPU), ("cpu", BOTH)], Route.HOST_MAPPED),
        ("cuda", [("cpu", CPU), ("cpu", NONE)], Route.GENERAL),  # a rank read over the network
        ("cpu", [("cuda", BOTH)], Route.GENERAL),  # CPU ids never pool on a GPU
        ("cpu", [("cpu", CPU)], Route.HOST_MAPPED),
        ("cuda", [], Route.GENERAL),
    ],
)
def test_the_route_follows_the_shards_devices_and_what_their_paths_map(ids_on, shards, route):
    assert choose_route(ids_on, shards) is route


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _table(dtype: torch.dtype) -> tuple[torch.Tensor, DeviceTable]:
    weights = torch.randn(30, 6, generator=torch.Generator().manual_seed(3)).to(dtype)
    blocks = [RowBlock(0, weights[:7]), RowBlock(7, weights[7:20]), RowBlock(20, weights[20:])]
    return weights, DeviceTable(blocks, 6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_gathered_bit_for_bit_from_one_block_or_several(dtype: torch.dtype) -> None:
    weights, table = _table(dtype)
    for ids in (torch.tensor([8, 19, 8, 12]), torch.tensor([29, 0, 7, 7, 20, 6, 19])):
        span = table.span(ids)
        assert span is not None
        assert torch.equal(table.rows(ids, span), F.embedding(ids, weights))
    assert table.span(torch.tensor([3, 30])) is None and table.span(torch.tensor([-1])) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bags_are_pooled_bit_for_bit_with_duplicates_and_empty_bags(dtype, mode) -> None:
    weights, table = _table(dtype)
    cases = [
        (torch.tensor([8, 19, 8, 12]), torch.tensor([0, 0, 3])),  # one block, an empty first bag
        (torch.tensor([29, 0, 7, 7, 20, 6, 19]), torch.tensor([0, 2, 2, 5])),  # every block
    ]
    for ids, offsets in cases:
        span = table.span(ids)
        assert span is not None
        pooled = table.bags(ids, offsets, span, mode=mode)
        assert torch.equal(pooled, F.embedding_bag(ids, weights, offsets, mode=mode))
        if mode == "sum":
            weights_per_id = torch.rand(ids.numel()).to(dtype)
            weighted = table.bags(ids, offsets, span, mode=mode, weights=weights_per_id)
            expected = F.embedding_bag(
                ids, weights, offsets, mode=mode, per_sample_weights=weights_per_id
            )
            assert torch.equal(weighted, expected)
