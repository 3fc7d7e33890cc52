"""A cluster whose SQLite catalog was copied to PostgreSQL (`shardserve catalog copy`) and started again on the
copy, over the same ranks' persisted shards, serves the same tensors bit for bit, at the same versions, and the
same snapshots; writes go on from the copy's version counter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from waiting import wait_until

from shardserve import connect, spmd
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.catalog_command import main_catalog
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.coordinator.catalog.locations import CATALOG_FILE
from shardserve.server.launcher import LocalCluster

pytestmark = pytest.mark.slow

SPEC = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
WAIT_S = 120.0


def test_a_cluster_on_a_copied_catalog_serves_the_same_tensors_and_snapshots(
    make_cluster: Callable[..., LocalCluster], tmp_path, postgres_url
):
    state = tmp_path / "state"
    options = RankOptions(persist_dir=state / "data")
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "table": torch.randn(64, 8, generator=generator),
        "ids": torch.randint(-(2**62), 2**62, (10, 3), generator=generator),
        "half": torch.randn(16, 4, generator=generator).to(torch.bfloat16),
    }
    state_dict = {
        "w": torch.randn(6, 4, generator=generator),
        "b": torch.randn(6, generator=generator),
    }
    first = make_cluster(ranks=2, state_dir=state, rank_options=options)
    with connect(first.address) as client:
        for name, value in tensors.items():
            client.put(name, value, SPEC)
        number = spmd.put_state_dict(client, state_dict, "model")
        versions = {s.name: s.version for s in client.list()}
        snapshots = [(s.number, s.tensors) for s in client.snapshots("model")]
    first.stop()

    assert main_catalog(["copy", str(state / CATALOG_FILE), postgres_url]) == 0
    second = make_cluster(ranks=2, state_dir=state, rank_options=options, catalog=postgres_url)
    with connect(second.address) as client:
        wait_until(
            lambda: all(s.health == "healthy" for s in client.list()),
            WAIT_S,
            "the ranks to restore their persisted shards",
        )
        assert {s.name: s.version for s in client.list()} == versions
        for name, value in tensors.items():
            read = client.tensor(name).full_tensor()
            assert read.dtype == value.dtype and torch.equal(
                read.view(torch.uint8), value.view(torch.uint8)
            )
        assert [(s.number, s.tensors) for s in client.snapshots("model")] == snapshots
        read = client.snapshot("model", number).read()
        assert read.keys() == state_dict.keys()
        assert all(torch.equal(read[k], v) for k, v in state_dict.items())
        client.put(
            "table", tensors["table"] * 2, SPEC, overwrite=True
        )  # the copy serves writes too
        assert client.tensor("table").version > max(versions.values())
        assert torch.equal(client.tensor("table").full_tensor(), tensors["table"] * 2)
