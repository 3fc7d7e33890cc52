"""Repair on real clusters: copies on a rank that stays dead are copied from live replicas onto other ranks, the
progress shows while it runs, a box with no copy left is never "repaired", and a coordinator killed during a
repair redoes (or finishes) it once restarted.

The module's 4-rank cluster repairs after 2 s; its rank 3 is killed once (SIGKILL) after the tensors are put.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from reference import mirrored
from server_processes import fork_server, rank_env, server_env, stop_all
from waiting import wait_until

from shardserve import RankUnavailableError, ShardsLostError, connect
from shardserve.client.cli.main import main as cli_main
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.coordinator.drivers.reshard import (
    EXIT_AFTER_COMMIT_CODE,
    EXIT_AFTER_COMMIT_ENV,
)
from shardserve.server.coordinator_process import CoordinatorOptions
from shardserve.server.launcher import LocalCluster, free_port
from shardserve.server.rank.jobs.reshard import STALL_ENV
from shardserve.server.rank_start import ForkedProcess

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
]  # coordinator and rank processes spawned and killed

ROWS, DIM, DEAD = 16, 8, 3
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., LocalCluster]) -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(
            STALL_ENV, "0:4:slow"
        )  # rank 0 sleeps 4 s in every reshard job of "slow": a window to look in
        yield make_cluster(ranks=4, coordinator_options=CoordinatorOptions(repair_after=2.0))


@pytest.fixture(scope="module")
def world(cluster: LocalCluster) -> dict:
    generator = torch.Generator().manual_seed(11)
    data = {
        name: torch.randn(ROWS, DIM, generator=generator) for name in ("mirrored", "slow", "single")
    }
    with connect(cluster.address) as client:
        client.put(
            "mirrored", data["mirrored"], spec=mirrored([(0, 3), (3, 1), (2, 3), (1, 2)], ROWS, DIM)
        )
        client.put("slow", data["slow"], spec=mirrored([(3, 0), (1, 2)], ROWS, DIM))
        client.put(
            "single", data["single"], spec=ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in range(4)])
        )
        versions = {name: client.tensor(name).version for name in data}
    cluster.kill_rank(DEAD, signal.SIGKILL)
    return {"data": data, "versions": versions}


def _repaired(remote) -> bool:
    """Healthy again with no copy on the dead rank."""
    return remote.health == "healthy" and DEAD not in remote.metadata().ranks()


def _copies_per_box(meta) -> dict:
    copies: dict = {}
    for shard in meta.shards_metadata:
        copies.setdefault(shard.box, []).append(shard.rank)
    return copies


def test_copies_on_a_rank_that_stays_dead_are_repaired_onto_live_ranks(world, cluster):
    with connect(cluster.address) as client:
        wait_until(lambda: _repaired(client.tensor("mirrored")), WAIT_S, "the repair of 'mirrored'")
        repaired = client.tensor("mirrored")
        assert repaired.version > world["versions"]["mirrored"]
        assert DEAD not in repaired.metadata().ranks()
        assert repaired.replicas == 2
        assert all(len(set(ranks)) == 2 for ranks in _copies_per_box(repaired.metadata()).values())
        assert torch.equal(repaired.full_tensor(), world["data"]["mirrored"])
        for (
            shard
        ) in repaired.metadata().shards_metadata:  # every copy holds its box: read each rank's own
            box = shard.box
            rows = slice(box.offsets[0], box.offsets[0] + box.sizes[0])
            with connect(cluster.address, transport="grpc") as reader:
                remote = reader.tensor("mirrored")
                others = [
                    s
                    for s in remote.metadata().shards_metadata
                    if s.box == box and s.rank != shard.rank
                ]
                for (
                    other
                ) in others:  # the read must come from `shard`: mark the other copies unreachable
                    reader.session.health.note_failure(other.rank, _unreachable(other.rank))
                assert torch.equal(remote[rows], world["data"]["mirrored"][rows])


def _unreachable(rank: int) -> RankUnavailableError:
    return RankUnavailableError(f"rank {rank} marked unreachable by the test")


def test_repair_progress_shows_while_it_runs(world, cluster, capsys):
    with connect(cluster.address) as client:
        wait_until(
            lambda: client.tensor("slow").repair is not None,
            WAIT_S,
            "the repair of 'slow' to start",
        )
        progress = client.tensor("slow").repair
        assert progress is not None and progress.version > world["versions"]["slow"]
        assert progress.ranks and DEAD not in progress.ranks
        assert cli_main(["--coordinator", cluster.address, "status"]) == 0
        assert "repairing" in capsys.readouterr().out
        assert torch.equal(
            client.tensor("slow").full_tensor(), world["data"]["slow"]
        )  # reads go on meanwhile
        wait_until(
            lambda: _repaired(client.tensor("slow")), WAIT_S, "the repair of 'slow' to finish"
        )
        wait_until(
            lambda: client.tensor("slow").repair is None, WAIT_S, "the repair's progress to be gone"
        )
        assert torch.equal(client.tensor("slow").full_tensor(), world["data"]["slow"])


def test_a_box_with_no_copy_left_is_reported_unavailable_never_repaired(world, cluster):
    with connect(cluster.address, timeout=2.0) as client:
        wait_until(lambda: _repaired(client.tensor("mirrored")), WAIT_S, "the other repairs")
        single = client.tensor("single")
        assert single.health == "unavailable" and single.version == world["versions"]["single"]
        assert torch.equal(single[: ROWS * 3 // 4], world["data"]["single"][: ROWS * 3 // 4])
        with pytest.raises(RankUnavailableError) as down:  # its rank is dead, not known to be empty
            single.full_tensor()
        assert not isinstance(down.value, ShardsLostError)
        with pytest.raises(RankUnavailableError, match=f"on rank {DEAD}:"):
            single.reshard(ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"]))


# ---------------------------------------------------------------- a coordinator killed during a repair


@pytest.mark.parametrize("how", ["killed mid-repair", "exits after the repair's commit"])
def test_a_restarted_coordinator_redoes_or_finishes_a_repair(tmp_path: Path, how: str):
    port, store_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    env = server_env()
    coordinator_args = [
        "coordinator",
        "--listen",
        address,
        "--state-dir",
        str(tmp_path / "state"),
        "--heartbeat-interval",
        "0.5",
        "--store-port",
        str(store_port),
        "--repair-after",
        "1",
    ]
    hook = {EXIT_AFTER_COMMIT_ENV: "1"} if how.startswith("exits") else {}
    tensor = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(5))
    with open(tmp_path / "log.txt", "w") as log:
        procs: list[ForkedProcess] = []
        try:
            procs.append(fork_server(coordinator_args, dict(env, **hook), log))
            for rank in range(
                3
            ):  # rank 0 stalls 3 s in the repair's job: the window to kill the coordinator in
                procs.append(
                    fork_server(
                        ["--coordinator", address],
                        rank_env(dict(env, **{STALL_ENV: "0:3:r"}), rank, 3),
                        log,
                    )
                )
            wait_until(lambda: _live_ranks(address) == 3, 120, "three ranks")
            with connect(address) as client:
                old = client.put("r", tensor, spec=mirrored([(0, 2), (2, 1)], ROWS, DIM))
            procs[3].kill()  # rank 2, for good
            if hook:
                assert procs[0].wait(WAIT_S) == EXIT_AFTER_COMMIT_CODE
            else:
                wait_until(lambda: _pending(address, "r"), WAIT_S, "the repair to start")
                procs[0].kill()
                procs[0].wait(10)
            procs[0] = fork_server(coordinator_args, env, log)

            def repaired() -> bool:
                with connect(address) as client:
                    remote = client.tensor("r")
                    return (
                        remote.health == "healthy"
                        and 2 not in remote.metadata().ranks()
                        and not _pending(address, "r")
                    )

            wait_until(repaired, WAIT_S, "the restarted coordinator to repair 'r'")
            with connect(address) as client:
                remote = client.tensor("r")
                assert remote.version > old.version and remote.replicas == 2
                assert torch.equal(remote.full_tensor(), tensor)
        finally:
            stop_all(procs)


def _live_ranks(address: str) -> int:
    with connect(address) as client:
        return sum(r.alive for r in client.ranks())


def _pending(address: str, name: str) -> bool:
    """Whether `name` has a version the catalog holds but has not finished (a repair's new version)."""
    with connect(address) as client:
        rows = client.session.call(
            "ListTensors", pb.ListTensorsRequest(include_pending=True)
        ).tensors
        return any(t.name == name and (t.state != pb.READY or t.promoting) for t in rows)
