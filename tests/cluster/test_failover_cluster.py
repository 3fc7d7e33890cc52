"""A dead rank on a real 3-rank cluster: surviving boxes read on every path, its boxes raise RankUnavailableError
(UNAVAILABLE: it may come back) once the read's deadline passes, replicated boxes fail over to a live copy, and a
rank that registers again empty makes its boxes lost (ShardsLostError, DATA_LOSS) but never makes a tensor vanish.

One cluster for the module; its rank 1 is killed (SIGKILL) once, after every client has read through it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
import torch
import torch.nn.functional as F
from reference import mirrored
from waiting import wait_until

from shardserve import Cluster, RankUnavailableError, ShardsLostError, connect
from shardserve.client.cli.main import main as cli_main
from shardserve.core.metadata import Box
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import Reason
from shardserve.server.coordinator_process import CoordinatorOptions
from shardserve.server.launcher import LocalCluster

TRANSPORTS = ["auto", "grpc", "bulk", "shm"]
ROWS, DIM, DEAD = 12, 6, 1
PLAIN = ChunkShardingSpec(
    0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]
)  # rows 0-3, 4-7, 8-11: one copy each
# every row band on two ranks, rank 1's copy listed first where it has one (reads pick it while it lives)
MIRRORED = mirrored([(1, 0), (1, 2), (2, 0)], ROWS, DIM)
WAIT_S = 20.0
READ_TIMEOUT_S = 1.0  # the clients' deadline: a read of the dead rank's box waits this long for it


@pytest.fixture(scope="module")
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(
        ranks=3, coordinator_options=CoordinatorOptions(repair_after=3600.0)
    )  # the dead rank's copies stay unavailable: no repair


@pytest.fixture(scope="module")
def world(cluster: LocalCluster) -> Iterator[dict]:
    """The tensors put, two clients per transport (one per test that reads) warmed up through rank 1, then
    rank 1 killed."""
    generator = torch.Generator().manual_seed(3)
    data = {
        "plain": torch.randn(ROWS, DIM, generator=generator),
        "mirrored": torch.randn(ROWS, DIM, generator=generator),
        "reshardable": torch.randn(ROWS, DIM, generator=generator),
    }
    clients: dict[tuple[str, str], Cluster] = {}
    try:
        with connect(cluster.address) as writer:
            writer.put("plain", data["plain"], spec=PLAIN)
            writer.put("mirrored", data["mirrored"], spec=MIRRORED)
            writer.put("reshardable", data["reshardable"], spec=MIRRORED)
        with connect(cluster.address) as writer:
            plain_version = writer.tensor("plain").version
        for transport in TRANSPORTS:
            for name in data:
                client = clients[(transport, name)] = connect(
                    cluster.address, transport=transport, timeout=READ_TIMEOUT_S
                )
                remote = client.tensor(name)
                assert torch.equal(remote.full_tensor(), data[name])
                assert torch.equal(remote.lookup(torch.arange(ROWS)), data[name])
        cluster.kill_rank(DEAD, signal.SIGKILL)
        coordinator = cluster.coordinator
        assert (
            coordinator is not None
        )  # the clients still take rank 1 for alive: they have not asked since
        wait_until(
            lambda: not coordinator.registry.rank_alive(DEAD),
            WAIT_S,
            "the coordinator to mark rank 1 dead",
        )
        yield {"data": data, "clients": clients, "plain_version": plain_version}
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_replicated_tensor_reads_every_box_from_live_copies(world, transport):
    """The first read after the kill picks rank 1's copies (the client has not heard of its death), fails on them
    and is served by the other copies within the same call."""
    table, client = world["data"]["mirrored"], world["clients"][(transport, "mirrored")]
    remote = client.tensor("mirrored")
    assert torch.equal(remote.full_tensor(), table)
    assert torch.equal(remote.fetch((3, 1), (6, 4)), table[3:9, 1:5])
    assert torch.equal(remote[4:8], table[4:8])
    ids = torch.tensor([5, 0, 11, 5, 7, 2])
    assert torch.equal(remote.lookup(ids), F.embedding(ids, table))
    offsets = torch.tensor([0, 2, 4])
    assert torch.allclose(
        remote.lookup_bag(ids, offsets, mode="sum"),
        F.embedding_bag(ids, table, offsets, mode="sum"),
    )
    assert remote.health == "degraded" and remote.replicas == 2 and remote.lost_boxes == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_surviving_boxes_read_bit_for_bit_and_the_dead_ranks_ones_are_unavailable(world, transport):
    table, client = world["data"]["plain"], world["clients"][(transport, "plain")]
    remote = client.tensor("plain")
    start = time.monotonic()
    with pytest.raises(
        RankUnavailableError, match=r"offsets=\(4, 0\), sizes=\(4, 6\).*rank 1 "
    ) as down:
        remote[4:8]
    assert (
        time.monotonic() - start >= READ_TIMEOUT_S * 0.9
    )  # retried until the deadline: it may come back
    assert not isinstance(down.value, ShardsLostError)  # alive or not, its data is not known gone
    assert (
        down.value.code == grpc.StatusCode.UNAVAILABLE
        and down.value.reason == Reason.RANK_UNAVAILABLE
    )
    assert down.value.metadata == {"tensor": "plain", "ranks": str(DEAD)}
    failing = {  # what: (call, what its error names); each waits out the deadline, so they run at once
        "the full tensor": (remote.full_tensor, ""),
        "a fetch of a live and a dead box": (lambda: remote.fetch((3, 0), (2, DIM)), "rank 1"),
        "a lookup": (lambda: remote.lookup(torch.tensor([0, 6])), r"offsets=\(4, 0\)"),
        "a pooled lookup": (
            lambda: remote.lookup_bag(torch.tensor([1, 5]), torch.tensor([0]), mode="sum"),
            "",
        ),
    }
    with futures.ThreadPoolExecutor(len(failing)) as pool:
        reads = {what: pool.submit(call) for what, (call, _) in failing.items()}
        assert torch.equal(remote[0:4], table[0:4])
        assert torch.equal(remote.fetch((8, 2), (4, 3)), table[8:12, 2:5])
        ids = torch.tensor([9, 0, 3, 11, 0])
        assert torch.equal(remote.lookup(ids), F.embedding(ids, table))
    for what, read in reads.items():
        with pytest.raises(RankUnavailableError, match=failing[what][1]):
            read.result()
    assert torch.equal(
        remote.lookup(torch.tensor([10, 1])), table[[10, 1]]
    )  # still served after the errors


def test_health_lost_boxes_and_replicas_say_what_the_cluster_can_serve(world, cluster):
    with connect(cluster.address) as client:
        wait_until(lambda: not client.ranks()[DEAD].alive, WAIT_S, "rank 1 to be marked dead")
        listed = {t.name: t for t in client.list()}
        assert listed["plain"].health == "unavailable" and listed["mirrored"].health == "degraded"
        plain = client.tensor("plain")
        assert plain.health == "unavailable" and plain.replicas == 1
        assert plain.lost_boxes == [Box((4, 0), (4, DIM))]
        info = client.session.call("GetTensor", pb.GetTensorRequest(name="mirrored"))
        assert (info.health, info.replicas, list(info.unavailable_shards)) == (
            "degraded",
            2,
            [0, 2],
        )


def test_cli_status_and_list_show_health(world, cluster, capsys):
    assert cli_main(["--coordinator", cluster.address, "list"]) == 0
    lines = {line.split("\t")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["plain"].endswith("unavailable (1 box, rank 1)")
    assert lines["mirrored"].endswith("degraded")
    assert cli_main(["--coordinator", cluster.address, "status"]) == 0
    out = capsys.readouterr().out
    assert "unavailable (1 box, rank 1)" in out and "degraded" in out


def test_a_degraded_tensor_reshards_from_its_live_copies(world, cluster):
    """A reshard reads each box from a live copy: the dead rank's copies are skipped, not a reason to refuse."""
    with connect(cluster.address) as client:
        wait_until(
            lambda: client.tensor("reshardable").health == "degraded",
            WAIT_S,
            "rank 1's copies to be unavailable",
        )
        remote = client.tensor("reshardable").reshard(
            ChunkShardingSpec(1, ["rank:0/cpu", "rank:2/cpu"])
        )
        assert remote.health == "healthy" and remote.metadata().ranks() == (0, 2)
        assert torch.equal(remote.full_tensor(), world["data"]["reshardable"])
        with pytest.raises(RankUnavailableError, match="no copy on a live rank") as refused:
            client.tensor("plain").reshard(ChunkShardingSpec(1, ["rank:0/cpu", "rank:2/cpu"]))
        assert refused.value.reason == Reason.RANK_UNAVAILABLE


def test_rows_of_a_degraded_table_are_written_to_its_live_copies(world, cluster):
    """update_rows while a replica's rank is dead: the new version starts without that copy (lost, repaired later),
    every live copy gets the rows; a table with a box on no live rank refuses the update (UNAVAILABLE)."""
    with connect(cluster.address) as client:
        wait_until(
            lambda: client.tensor("mirrored").health == "degraded",
            WAIT_S,
            "rank 1's copies to be unavailable",
        )
        before = client.tensor("mirrored").version
        ids, rows = torch.tensor([1, 5, 10]), torch.full((3, DIM), 7.5)
        version = client.update_rows("mirrored", ids, rows)
        expected = world["data"]["mirrored"].clone()
        expected[ids] = rows
        remote = client.tensor("mirrored")
        assert version > before and remote.version == version and remote.health == "degraded"
        info = client.session.call("GetTensor", pb.GetTensorRequest(name="mirrored"))
        assert list(info.lost_shards) == [0, 2]  # rank 1's copies: not in the new version
        assert torch.equal(remote.full_tensor(), expected)
        assert torch.equal(remote.lookup(torch.arange(ROWS)), expected)
        world["data"]["mirrored"] = expected
        with pytest.raises(RankUnavailableError, match="on rank 1:") as refused:
            client.update_rows("plain", torch.tensor([0]), torch.zeros(1, DIM))
        assert not isinstance(refused.value, ShardsLostError)
        assert client.tensor("plain").version == world["plain_version"]


class _EmptyRank(pb_grpc.ShardServerServicer):
    """A restarted rank as the coordinator sees it: it holds nothing and accepts drops and promotions."""

    def GetStats(self, request, context):  # noqa: N802 - gRPC's names
        return pb.GetStatsResponse(rank=DEAD)

    def DropVersion(self, request, context):  # noqa: N802
        return pb.DropVersionResponse()

    def PromoteVersion(self, request, context):  # noqa: N802
        return pb.PromoteVersionResponse()


def test_a_rank_that_registers_again_empty_never_makes_the_coordinator_forget_a_tensor(
    world, cluster
):
    """Rank 1 comes back (here: a stand-in server under its rank number) holding nothing: its copies are marked
    lost, both tensors stay listed, and reads avoid the lost copies though the rank is alive again."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ShardServerServicer_to_server(_EmptyRank(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(cluster.address)
    try:
        coordinator = pb_grpc.CoordinatorStub(channel)
        coordinator.RegisterRank(
            pb.RegisterRankRequest(
                rank=pb.RankInfo(
                    rank=DEAD,
                    address=f"127.0.0.1:{port}",
                    device="cpu",
                    hostname="restarted",
                    world_size=3,
                    pid=1,
                )
            ),
            timeout=10,
            metadata=cluster.cluster_metadata,
        )

        def marked_lost() -> bool:
            info = coordinator.GetTensor(pb.GetTensorRequest(name="plain"), timeout=10)
            return list(info.lost_shards) == [1]

        wait_until(marked_lost, WAIT_S, "the coordinator to mark rank 1's copies lost")
        mirrored = coordinator.GetTensor(pb.GetTensorRequest(name="mirrored"), timeout=10)
        assert list(mirrored.lost_shards) == [0, 2]
        with connect(cluster.address, transport="grpc") as client:
            assert {t.name for t in client.list()} >= {"plain", "mirrored"}
            assert client.tensor("plain").health == "lost"
            table = world["data"]["mirrored"]
            remote = client.tensor("mirrored")
            assert remote.health == "degraded"
            assert torch.equal(remote.full_tensor(), table)
            assert torch.equal(remote.lookup(torch.arange(ROWS)), table)
            with pytest.raises(ShardsLostError, match="rank 1") as lost:  # known gone: at once
                client.tensor("plain")[5]
            assert lost.value.code == grpc.StatusCode.DATA_LOSS
            assert lost.value.reason == Reason.SHARDS_LOST and lost.value.ranks == (DEAD,)
            assert torch.equal(client.tensor("plain")[8:], world["data"]["plain"][8:])
    finally:
        channel.close()
        server.stop(grace=None)
