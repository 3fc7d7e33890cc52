"""Durability is the caller's choice per put: on a persisting 2-rank cluster whose ranks are both SIGKILLed and
restarted, a durable put reads back bit for bit, while a put and a state-dict snapshot made with
durable=False are reported lost (their ranks restarted without them); the cluster keeps serving."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loaded_host import coordinator_options
from waiting import wait_until

from shardserve import InvalidArgumentError, ShardsLostError, connect, spmd
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.common.names import file_name
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster
from shardserve.server.supervisor import RestartPolicy

SPEC = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
WAIT_S = 120.0


@pytest.fixture(scope="module")
def persisting(make_cluster: Callable[..., LocalCluster], tmp_path_factory) -> LocalCluster:
    root = tmp_path_factory.mktemp("durability")
    return make_cluster(
        ranks=2,
        state_dir=root / "state",
        rank_options=RankOptions(persist_dir=root / "state" / "data"),
        coordinator_options=coordinator_options(heartbeat_interval=0.5, repair_after=3600.0),
        restart_policy=RestartPolicy(max_restarts=1, initial_backoff=0.2),
    )


def test_durable_puts_survive_a_restart_and_not_durable_ones_are_lost(persisting):
    kept = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    state = {"w": torch.randn(6, 4), "b": torch.randn(6)}
    data = Path(persisting.state_dir) / "data"
    with connect(persisting.address) as client:
        client.put("kept", kept, SPEC, durable=True)
        client.put("weights", weights, SPEC, durable=False)
        number = spmd.put_state_dict(client, state, "model", durable=False)
        snapshot_names = [f"model@{number}/{key}" for key in state]
        assert torch.equal(client.tensor("weights").full_tensor(), weights)  # served meanwhile
        persisted = sorted(p.parent.relative_to(data) for p in data.rglob("tensor.json"))
        assert persisted == [Path(f"rank-{r}", file_name("kept")) for r in (0, 1)], persisted
        pids = list(persisting.rank_pids)
        for rank in (0, 1):
            persisting.kill_rank(rank, signal.SIGKILL)

        def restored() -> bool:
            fresh = persisting.rank_pids
            return (
                all(fresh[r] != pids[r] for r in (0, 1))
                and client.tensor("kept").health == "healthy"
                and all(client.tensor(n).health == "lost" for n in ["weights", *snapshot_names])
            )

        wait_until(restored, WAIT_S, "both ranks to restart, restore kept and lose the rest")
        assert torch.equal(client.tensor("kept").full_tensor(), kept)
        for name in ["weights", *snapshot_names]:
            with pytest.raises(ShardsLostError):
                client.tensor(name).full_tensor()
        with pytest.raises(ShardsLostError):
            client.snapshot("model").read()
        client.put("weights", weights * 2, SPEC, durable=False, overwrite=True)  # still serving
        assert torch.equal(client.tensor("weights").full_tensor(), weights * 2)


@pytest.mark.parametrize("durable", ["no", 0, None])
def test_durable_must_be_a_bool(persisting, durable):
    with connect(persisting.address) as client:
        with pytest.raises(InvalidArgumentError, match="durable"):
            client.put("x", torch.zeros(2), durable=durable)
        with pytest.raises(InvalidArgumentError, match="durable"):
            client.create("x", (2,), durable=durable)
        with pytest.raises(InvalidArgumentError, match="durable"):
            spmd.put_state_dict(client, {"w": torch.zeros(2)}, "bad", durable=durable)
