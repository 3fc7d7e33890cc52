"""Ranks that come back by themselves on a real LocalCluster: a SIGKILLed rank is restarted under its rank
number (new pid), registers, comes back empty (its boxes of a replica-free tensor are reported lost, the others
stay readable) and takes new puts and a reshard; out of restarts, a rank stays dead.

One 3-rank cluster with max_restarts=1 for the module (its rank 2 is killed twice, the second time for good),
and a 1-rank cluster with max_restarts=0.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

import pytest
import torch
from loaded_host import coordinator_options
from waiting import wait_until

from shardserve import RankUnavailableError, ShardsLostError, connect
from shardserve.client.cli.main import main as cli_main
from shardserve.core.metadata import Box
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.launcher import LocalCluster
from shardserve.server.supervisor import RestartPolicy

ROWS, DIM, RESTARTED = 12, 6, 2
PLAIN = ChunkShardingSpec(
    0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]
)  # rows 0-3, 4-7, 8-11: one copy each
WAIT_S = 120.0  # a restarted rank imports torch again on a busy 2-core machine
MOVED = torch.randn(
    ROWS, DIM, generator=torch.Generator().manual_seed(7)
)  # "moved": resharded onto rank 2


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(
        ranks=3,
        restart_policy=RestartPolicy(max_restarts=1, initial_backoff=0.2),
        coordinator_options=coordinator_options(heartbeat_interval=0.5),
    )


def test_a_killed_rank_is_restarted_empty_and_serves_again(cluster, capsys):
    table = torch.randn(ROWS, DIM)
    with connect(cluster.address) as client:
        client.put("plain", table, spec=PLAIN)
        moved = client.put("moved", MOVED, spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
        warm = client.put(
            "warm", table, spec=PLAIN
        )  # a job with the old process: the new one must not wait on it
        warm.reshard(ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]))
        old_pid = cluster.rank_pids[RESTARTED]
        cluster.kill_rank(RESTARTED, signal.SIGKILL)

        def back() -> bool:
            status = client.ranks()[RESTARTED]
            return status.alive and status.pid == cluster.rank_pids[RESTARTED] != old_pid

        wait_until(back, WAIT_S, "rank 2 to be restarted and registered")
        assert cluster.restarts(RESTARTED) == 1 and client.ranks()[RESTARTED].restarts == 1
        assert [r.restarts for r in client.ranks()] == [0, 0, 1]
        wait_until(
            lambda: client.tensor("plain").lost_boxes == [Box((8, 0), (4, DIM))],
            WAIT_S,
            "rank 2's box of 'plain' to be reported lost",
        )
        plain = client.tensor("plain")
        assert plain.health == "lost"
        assert torch.equal(plain[0:8], table[0:8])
        with pytest.raises(ShardsLostError, match="rank 2"):
            plain[8:]

        again = client.put(
            "plain", -table, spec=PLAIN, overwrite=True
        )  # onto every rank, the new one too
        assert again.health == "healthy" and torch.equal(again.full_tensor(), -table)
        onto_restarted = moved.reshard(ChunkShardingSpec(1, ["rank:2/cpu", "rank:0/cpu"]))
        assert set(onto_restarted.remote_shards()) == {0, 2}
        assert torch.equal(onto_restarted.full_tensor(), MOVED)
        assert torch.equal(
            onto_restarted.fetch((0, 0), (ROWS, 3)), MOVED[:, :3]
        )  # the columns on rank 2

    assert cli_main(["--coordinator", cluster.address, "status"]) == 0
    assert "restarts" in capsys.readouterr().out


def test_a_rank_out_of_restarts_stays_dead(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="shardserve.server.supervisor")
    pid = cluster.rank_pids[RESTARTED]
    cluster.kill_rank(RESTARTED, signal.SIGKILL)
    wait_until(lambda: cluster.stays_dead(RESTARTED), WAIT_S, "rank 2's second death to be final")
    assert cluster.restarts(RESTARTED) == 1 and cluster.rank_pids[RESTARTED] == pid and _gone(pid)
    assert any(
        "no restarts left (1 of --max-restarts 1 used): it stays dead" in r.getMessage()
        for r in caplog.records
    )
    with connect(cluster.address, timeout=2.0) as client:
        assert [r.alive for r in client.ranks()] == [
            True,
            True,
            False,
        ]  # told at once, no heartbeats missed
        moved = client.tensor("moved")  # columns 0-2 on rank 2, 3-5 on rank 0
        with pytest.raises(RankUnavailableError, match="rank 2") as down:  # dead, not known empty
            moved[:, :3]
        assert not isinstance(down.value, ShardsLostError)
        assert torch.equal(moved[:, 3:], MOVED[:, 3:])


def test_max_restarts_zero_leaves_a_killed_rank_dead(make_cluster):
    single = make_cluster(ranks=1, restart_policy=RestartPolicy(max_restarts=0))
    pid = single.rank_pids[0]
    single.kill_rank(0, signal.SIGKILL)
    wait_until(lambda: single.stays_dead(0), WAIT_S, "rank 0 to be declared dead")
    assert single.restarts(0) == 0 and single.rank_pids == [pid]
    with connect(single.address) as client:
        [status] = client.ranks()
        assert not status.alive and status.pid == pid and status.restarts == 0
