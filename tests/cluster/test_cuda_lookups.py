"""GPU lookups (on a GPU; skipped without one): RemoteEmbedding / RemoteEmbeddingBag with CUDA ids over CUDA
ranks on this host are answered on the GPU from the shards' CUDA IPC mappings, and over CPU ranks from the
mapped rows with only the result copied up: rows bit for bit nn.Embedding on the GPU; bags bit for bit
nn.EmbeddingBag on the device that pooled them (the GPU for CUDA ranks, the CPU for CPU ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardserve import connect
from shardserve.client import RemoteEmbedding, RemoteEmbeddingBag
from shardserve.client.embedding.routes import Route
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.common.rank_options import RankOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
IDS = [0, 100, 33, 33, 67, 68, 34, 0, 99, 35, 35]  # every shard, duplicates
OFFSETS = [0, 2, 2, 5, 11]  # an empty bag in the middle and at the end
ONE_SHARD = [34, 40, 34, 66]


@pytest.fixture(scope="module")
def gpu(make_cluster):
    return make_cluster(ranks=1, rank_options=RankOptions(device="cuda"))


@pytest.fixture(scope="module")
def cpu(make_cluster):
    return make_cluster(ranks=2)


def _table(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(101, 12, generator=torch.Generator().manual_seed(7)).to(dtype)


def _check_modules(  # type: ignore[no-untyped-def]
    client, name: str, weights: torch.Tensor, *, pooled_on: str
) -> None:
    device = torch.device("cuda:0")
    local, pooling = weights.to(device), weights.to(pooled_on)
    for values in (IDS, ONE_SHARD):
        ids = torch.tensor(values, device=device)
        rows = RemoteEmbedding(client, name)(ids)
        assert rows.device == device and torch.equal(rows, F.embedding(ids, local))
    ids, offsets = torch.tensor(IDS, device=device), torch.tensor(OFFSETS, device=device)
    there = {"input": ids.to(pooled_on), "offsets": offsets.to(pooled_on)}
    for mode in ("sum", "mean"):
        pooled = RemoteEmbeddingBag(client, name, mode=mode)(ids, offsets)
        assert pooled.device == device
        expected = F.embedding_bag(weight=pooling, mode=mode, **there)
        assert torch.equal(pooled, expected.to(device))
    weights_per_id = torch.rand(ids.numel(), device=device).to(weights.dtype)
    weighted = RemoteEmbeddingBag(client, name, mode="sum")(ids, offsets, weights_per_id)
    expected = F.embedding_bag(
        weight=pooling, mode="sum", per_sample_weights=weights_per_id.to(pooled_on), **there
    )
    assert torch.equal(weighted, expected.to(device))
    empty = torch.empty(0, dtype=torch.int64, device=device)
    bags = RemoteEmbeddingBag(client, name, mode="sum")(empty, torch.zeros(3, dtype=torch.int64))
    assert torch.equal(bags, torch.zeros(3, 12, dtype=weights.dtype, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ids_over_cuda_ranks_are_looked_up_on_the_gpu(gpu, dtype: torch.dtype) -> None:
    spec = ChunkShardingSpec(0, ["rank:0/cuda:0"] * 3)
    with connect(gpu.address) as client:
        name = f"gpu-lookup-{str(dtype).removeprefix('torch.')}"
        weights = _table(dtype)
        client.put(name, weights, spec)
        assert client.lookups.route(name, "cuda") is Route.CUDA_MAPPED
        _check_modules(client, name, weights, pooled_on="cuda:0")
        assert client.lookups.last_paths == {0: "shm"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ids_over_cpu_ranks_gather_mapped_rows_and_copy_the_result(cpu, dtype) -> None:
    spec = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    with connect(cpu.address) as client:
        name = f"cpu-lookup-{str(dtype).removeprefix('torch.')}"
        weights = _table(dtype)
        client.put(name, weights, spec)
        assert client.lookups.route(name, "cuda") is Route.HOST_MAPPED
        _check_modules(client, name, weights, pooled_on="cpu")
