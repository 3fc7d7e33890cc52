"""Embedding serving and DCP checkpoints with CUDA shards (on a GPU; skipped without one).

One 1-rank CUDA cluster: lookups and bags over gRPC (the rank stages rows
through pinned memory) and over CUDA IPC (same host), row updates, and DCP
round trips between the GPU cluster and plain CPU tensors, all bit for bit
against plain torch on the CPU (but bags pooled by the GPU, which sums in its
own order: equal up to float rounding).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from shardserve import connect
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.common.rank_options import RankOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU_ROWS = ChunkShardingSpec(0, ["rank:0/cuda:0"] * 3)


@pytest.fixture(scope="module")
def gpu(make_cluster):
    return make_cluster(ranks=1, rank_options=RankOptions(device="cuda"))


def table(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookups_and_bags_from_cuda_shards(gpu, transport: str, dtype: torch.dtype) -> None:
    weights = table(101, 12, dtype, seed=5)
    ids = torch.tensor([0, 100, 33, 33, 67, 68, 34, 0, 99])
    offsets = torch.tensor([0, 2, 2, 5])
    with connect(gpu.address, transport=transport) as client:
        name = f"emb-{transport}-{str(dtype).split('.')[-1]}"
        remote = client.put(name, weights, GPU_ROWS)
        assert torch.equal(remote.lookup(ids), F.embedding(ids, weights))
        assert client.lookups.last_paths == {0: transport}
        for mode in ("sum", "mean"):
            expected = F.embedding_bag(ids, weights.float(), offsets, mode=mode)
            exact = remote.lookup_bag(
                ids, offsets, mode=mode, pooling="client", dtype=torch.float32
            )
            assert torch.equal(exact, F.embedding_bag(ids, weights, offsets, mode=mode).float())
            served = remote.lookup_bag(
                ids, offsets, mode=mode, pooling="server", dtype=torch.float32
            )
            # CUDA's embedding_bag sums in another order than the CPU: float rounding apart, no more
            tolerance = (
                dict(rtol=2e-2, atol=1e-2)
                if dtype == torch.bfloat16
                else dict(rtol=1e-5, atol=1e-5)
            )
            torch.testing.assert_close(served, expected, **tolerance)
        new_rows = table(2, 12, dtype, seed=6)
        remote.update_rows(torch.tensor([33, 100]), new_rows)
        weights = weights.clone()
        weights[torch.tensor([33, 100])] = new_rows
        assert torch.equal(remote.lookup(ids), F.embedding(ids, weights))
        assert torch.equal(remote.full_tensor(), weights)


def test_checkpoint_round_trips_between_cuda_shards_and_plain_tensors(gpu, tmp_path: Path) -> None:
    source = table(257, 9, torch.float32, seed=8)
    dcp.save({"trained": source}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with connect(gpu.address) as client:
        loaded = client.load_checkpoint(tmp_path / "plain", names="trained", spec=GPU_ROWS)[
            "trained"
        ]
        assert loaded.metadata().shards_metadata[0].device == torch.device("cuda:0")
        assert torch.equal(loaded.full_tensor(), source)
        assert client.save_checkpoint(tmp_path / "saved", names=["trained"]) == ["trained"]
    back = {"trained": torch.zeros_like(source)}
    dcp.load(back, checkpoint_id=str(tmp_path / "saved"), no_dist=True)
    assert torch.equal(back["trained"], source)
