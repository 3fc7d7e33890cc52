"""Hedged and fail-fast reads on a real 3-rank cluster with rank 1 stopped (SIGSTOP): reads of boxes with another
copy answer from it well within the call deadline, over gRPC and the bulk port, bit for bit; a box whose only
copy is on the stopped rank fails with RankUnavailableError naming it, once the read's deadline has passed
(it retries: the rank may come back), never with DATA_LOSS.

One cluster for the module; rank 1 is stopped once, for one test, and continued in its finally.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from reference import mirrored
from waiting import wait_until

from shardserve import Cluster, RankUnavailableError, ShardsLostError, connect
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.launcher import LocalCluster

ROWS, DIM, STOPPED = 12, 6, 1
DEADLINE_S = 30.0  # the clients' call deadline
WELL_WITHIN_S = 10.0  # what a read of a stopped rank may take at most
SHORT_S = 3.0  # the deadline of the reads that wait for the stopped rank's only copy
SINGLE = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"])  # rows 4-7 only on rank 1
# every row band on two ranks, rank 1's copy listed first where it has one (reads pick it while it answers)
MIRRORED = mirrored([(1, 0), (1, 2), (2, 0)], ROWS, DIM)
TRANSPORTS = ["grpc", "bulk"]
WAIT_S = 30.0


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(ranks=3)


@pytest.fixture(scope="module")
def data(cluster: LocalCluster) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tensors = {
        "mirrored": torch.randn(ROWS, DIM, generator=generator),
        "single": torch.randn(ROWS, DIM, generator=generator),
    }
    with connect(cluster.address) as writer:
        writer.put("mirrored", tensors["mirrored"], spec=MIRRORED)
        writer.put("single", tensors["single"], spec=SINGLE)
    return tensors


@pytest.fixture
def clients(cluster: LocalCluster, data: dict[str, torch.Tensor]) -> Iterator[dict[str, Cluster]]:
    """Two clients per transport (one fetches, one looks up: each meets the stopped rank first), plus one with
    hedging off, each warmed up through rank 1."""
    made = {
        f"{transport} {kind}": connect(cluster.address, timeout=DEADLINE_S, transport=transport)
        for transport in TRANSPORTS
        for kind in ("fetch", "lookup")
    }
    made["unhedged"] = connect(
        cluster.address, timeout=DEADLINE_S, transport="bulk", hedge_after=None
    )
    try:
        for client in made.values():
            for name, tensor in data.items():
                assert torch.equal(client.tensor(name).full_tensor(), tensor)
                assert torch.equal(client.tensor(name).lookup(torch.arange(ROWS)), tensor)
        yield made
    finally:
        for client in made.values():
            client.close()


def _timed(read: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    start = time.monotonic()
    result = read()
    return result, time.monotonic() - start


def test_reads_of_a_stopped_rank_end_well_within_the_deadline(
    cluster: LocalCluster, data: dict[str, torch.Tensor], clients: dict[str, Cluster]
) -> None:
    """Rank 1 stopped: mirrored reads and lookups hedge to the other copy on both network paths; the box only
    rank 1 holds ends with RankUnavailableError naming rank 1 once it is reported dead; a client with hedging
    off fails over then too."""
    table = data["mirrored"]
    ids = torch.tensor([5, 0, 11, 5, 2, 7])
    offsets = torch.tensor([0, 2, 4])
    coordinator = cluster.coordinator
    assert coordinator is not None
    cluster.kill_rank(STOPPED, signal.SIGSTOP)
    try:
        for transport in TRANSPORTS:
            fetched = clients[f"{transport} fetch"].tensor("mirrored")
            looked_up = clients[f"{transport} lookup"].tensor("mirrored")
            checks = [
                (lambda: fetched.full_tensor(), table),
                (lambda: fetched.fetch((3, 1), (6, 4)), table[3:9, 1:5]),
                (lambda: looked_up.lookup(ids), F.embedding(ids, table)),
                (
                    lambda: looked_up.lookup_bag(ids, offsets, mode="sum", pooling="client"),
                    F.embedding_bag(ids, table, offsets, mode="sum"),
                ),
            ]
            for read, expected in checks:
                result, took = _timed(read)
                assert torch.equal(result, expected), transport
                assert took < WELL_WITHIN_S, f"{transport}: a read took {took:.1f} s"
            assert fetched.last_transport == transport
        wait_until(
            lambda: not coordinator.registry.rank_alive(STOPPED), WAIT_S, "rank 1 reported dead"
        )
        for transport in TRANSPORTS:
            start = time.monotonic()
            with connect(cluster.address, timeout=SHORT_S, transport=transport) as short:
                with pytest.raises(RankUnavailableError) as raised:
                    short.tensor("single").fetch((4, 0), (2, DIM))
            took = time.monotonic() - start
            assert not isinstance(raised.value, ShardsLostError), transport
            assert took < SHORT_S + WELL_WITHIN_S, f"{transport}: the failure took {took:.1f} s"
            assert (
                "rank 1" in str(raised.value)
                or "rank(s) 1" in str(raised.value)
                or getattr(raised.value, "ranks", ()) == (STOPPED,)
            ), str(raised.value)
        assert not coordinator.registry.rank_alive(STOPPED)
        result, took = _timed(lambda: clients["unhedged"].tensor("mirrored").full_tensor())
        assert torch.equal(result, table) and took < WELL_WITHIN_S
        assert torch.equal(
            clients["bulk fetch"].tensor("single").fetch((0, 0), (4, DIM)), data["single"][:4]
        )
    finally:
        cluster.kill_rank(STOPPED, signal.SIGCONT)
    wait_until(
        lambda: coordinator.registry.rank_alive(STOPPED),
        WAIT_S,
        "rank 1 to answer heartbeats again",
    )
