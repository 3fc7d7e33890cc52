"""Names are data, never paths: hostile and long tensor names put on a persisting cluster write nothing outside
each rank's folder, and every accepted name is restored under its own name after its rank is killed and
restarted. A name over the rule is INVALID_ARGUMENT naming the rule."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loaded_host import coordinator_options
from waiting import wait_until

from shardserve import InvalidArgumentError, Reason, connect
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.launcher import LocalCluster
from shardserve.server.supervisor import RestartPolicy

NAMES = [
    ".",
    "..",
    "a/../../b",
    "../../etc/passwd",
    "é" * 127 + "x",
    "€" * 341 + "x",
]  # last two: 255, 1024 B
SPEC = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
WAIT_S = 120.0


def files_under(root: Path) -> set[Path]:
    return {Path(dirpath) / name for dirpath, _, names in os.walk(root) for name in names}


@pytest.fixture(scope="module")
def persisting(make_cluster: Callable[..., LocalCluster], tmp_path_factory) -> LocalCluster:
    root = tmp_path_factory.mktemp("names")
    return make_cluster(
        ranks=2,
        state_dir=root / "state",
        rank_options=RankOptions(persist_dir=root / "state" / "data"),
        coordinator_options=coordinator_options(heartbeat_interval=0.5, repair_after=3600.0),
        restart_policy=RestartPolicy(max_restarts=1, initial_backoff=0.2),
    )


def test_hostile_names_stay_inside_the_rank_folders_and_come_back_after_a_restart(persisting):
    assert [len(name.encode()) for name in NAMES[-2:]] == [255, 1024]
    root = Path(persisting.state_dir).parent
    data = Path(persisting.state_dir) / "data"
    before = files_under(root)
    tables = {
        name: torch.randn(6, 4, generator=torch.Generator().manual_seed(i))
        for i, name in enumerate(NAMES)
    }
    with connect(persisting.address) as client:
        for name, table in tables.items():
            client.put(name, table, SPEC)
        new = files_under(root) - before
        assert new, "persistence wrote nothing"
        outside = [p for p in new if data not in p.parents]
        assert not outside, f"written outside the persist dir: {outside}"
        for path in new:
            rank_folder = path.relative_to(data).parts[0]
            assert rank_folder in ("rank-0", "rank-1"), path
            assert all(part not in (".", "..") and len(part) <= 255 for part in path.parts), path
        pids = list(persisting.rank_pids)
        for rank in (0, 1):
            persisting.kill_rank(rank, signal.SIGKILL)

        def restored() -> bool:
            fresh = persisting.rank_pids
            return all(fresh[r] != pids[r] for r in (0, 1)) and all(
                client.tensor(name).health == "healthy" for name in NAMES
            )

        wait_until(restored, WAIT_S, "both ranks to restart and restore every tensor")
        for name, table in tables.items():
            assert torch.equal(client.tensor(name).full_tensor(), table), name


def test_a_name_over_the_rule_is_refused_naming_the_rule(persisting):
    with connect(persisting.address) as client:
        for name in ("x" * 1025, "tab\there"):
            with pytest.raises(
                InvalidArgumentError, match="names hold 1 to 1024 bytes of UTF-8"
            ) as refused:
                client.put(name, torch.zeros(2), ChunkShardingSpec(0, ["rank:0/cpu"]))
            assert refused.value.reason == Reason.INVALID_ARGUMENT
            assert refused.value.metadata["field"] == "name"
        client.put("after", torch.ones(2), ChunkShardingSpec(0, ["rank:0/cpu"]))  # still serving
