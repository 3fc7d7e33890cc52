"""CUDA shards: a one-rank cluster on cuda:0, put and read bit for bit (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from server_helpers import Stubs, put, read_full

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.common.rank_options import RankOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_shards_round_trip(make_cluster):
    cluster = make_cluster(ranks=1, rank_options=RankOptions(device="cuda"))
    stubs = Stubs(cluster.address)
    try:
        meta = ChunkShardingSpec(0, ["rank:0/cuda:0", "rank:0/cuda:0"]).build_metadata(
            (300, 70), TensorProperties(dtype=torch.bfloat16)
        )
        tensor = torch.randn(300, 70).to(torch.bfloat16)
        info = put(stubs, "gpu", tensor, meta, chunk=4099)
        assert torch.equal(read_full(stubs, info), tensor)
    finally:
        stubs.close()
