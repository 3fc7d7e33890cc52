"""replicas= on a real cluster: put, create, load_checkpoint and reshard hold every box on R distinct ranks, every
copy bit for bit; bad replicas are refused naming the field; and a replicas=2 tensor whose rank is SIGKILLed stays
readable on every path, row updates included.

One 3-rank cluster for the module (nothing breaks it) and one 2-rank cluster whose rank 1 is killed once.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from waiting import wait_until

from shardserve import Cluster, InvalidArgumentError, RemoteShardedTensor, connect
from shardserve.client.cli.main import main as cli_main
from shardserve.core.health import copies_by_box
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.launcher import LocalCluster

ROWS, DIM = 12, 5
TRANSPORTS = ["auto", "grpc", "bulk", "shm"]
WAIT_S = 20.0


def _table(seed: int, rows: int = ROWS, dim: int = DIM) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


def _assert_every_copy(remote: RemoteShardedTensor, expected: torch.Tensor, replicas: int) -> None:
    """Every non-empty box is held by `replicas` distinct ranks, and each copy, read from its own rank, equals the
    box of `expected` bit for bit."""
    meta = remote.metadata()
    boxes = copies_by_box(meta)
    assert boxes and remote.replicas == replicas and remote.health == "healthy"
    for box, copies in boxes.items():
        assert len({meta.shards_metadata[i].rank for i in copies}) == replicas
    for shards in remote.remote_shards().values():
        for shard in shards:
            box = shard.metadata.box
            want = expected[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
            assert torch.equal(shard.fetch(), want), f"copy {shard} differs"
    assert torch.equal(remote.full_tensor(), expected)


@pytest.fixture(scope="module")
def cl(cluster3: LocalCluster) -> Iterator[Cluster]:
    with connect(cluster3.address) as client:
        yield client


def test_put_writes_every_copy_of_every_box(cl: Cluster) -> None:
    table = _table(1)
    remote = cl.put("put-r2", table, replicas=2)
    _assert_every_copy(remote, table, 2)
    spec = ChunkShardingSpec(1, ["rank:2/cpu", "rank:0/cpu"])
    remote = cl.put("put-r3", table, spec=spec, replicas=3)
    _assert_every_copy(remote, table, 3)
    firsts = [
        remote.metadata().shards_metadata[copies[0]]
        for copies in copies_by_box(remote.metadata()).values()
    ]
    assert [str(s.placement) for s in firsts] == [
        "rank:2/cpu",
        "rank:0/cpu",
    ]  # primaries stay where spec put them


def test_create_fills_every_copy_alike(cl: Cluster) -> None:
    remote = cl.create("create-r2", (ROWS, DIM), dtype=torch.float64, init="arange", replicas=2)
    _assert_every_copy(remote, torch.arange(ROWS * DIM, dtype=torch.float64).reshape(ROWS, DIM), 2)
    normal = cl.create("create-normal-r2", (ROWS, DIM), init="normal", seed=5, replicas=2)
    _assert_every_copy(normal, normal.full_tensor(), 2)


def test_load_checkpoint_loads_every_copy(cl: Cluster, tmp_path: Path) -> None:
    table, vector = _table(2), torch.arange(7, dtype=torch.float64)
    dcp.save(
        {"ckpt-table": table, "ckpt-vector": vector}, checkpoint_id=str(tmp_path), no_dist=True
    )
    loaded = cl.load_checkpoint(tmp_path, replicas=2)
    _assert_every_copy(loaded["ckpt-table"], table, 2)
    _assert_every_copy(loaded["ckpt-vector"], vector, 2)


def test_reshard_into_two_copies_and_back(cl: Cluster) -> None:
    table = _table(3)
    remote = cl.put("reshard-r2", table)
    columns = ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"])
    remote = remote.reshard(columns, replicas=2)
    _assert_every_copy(remote, table, 2)
    remote = remote.reshard(ChunkShardingSpec(0, ["rank:1/cpu", "rank:2/cpu"]), replicas=3)
    _assert_every_copy(remote, table, 3)
    remote = remote.reshard(columns)
    _assert_every_copy(remote, table, 1)


def test_update_rows_writes_every_copy(cl: Cluster) -> None:
    table = _table(4)
    remote = cl.put("updated-r2", table, replicas=2)
    ids, rows = torch.tensor([0, 5, 11]), _table(40, 3)
    remote.update_rows(ids, rows)
    table[ids] = rows
    _assert_every_copy(remote, table, 2)


@pytest.mark.parametrize(
    "replicas, match",
    [
        (4, r"replicas=4 is more than the 3 live ranks"),
        (0, r"replicas must be in \[1"),
        ("2", r"replicas must be an int"),
        (True, r"replicas must be an int"),
    ],
)
def test_bad_replicas_are_refused_naming_the_field(
    cl: Cluster, tmp_path: Path, replicas: object, match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        cl.put("refused", _table(5), replicas=replicas)
    with pytest.raises(InvalidArgumentError, match=match):
        cl.create("refused", (4, 4), replicas=replicas)
    dcp.save({"refused": _table(5)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(InvalidArgumentError, match=match):
        cl.load_checkpoint(tmp_path, replicas=replicas)
    remote = cl.put("refused-reshard", _table(5), overwrite=True)
    with pytest.raises(InvalidArgumentError, match=match):
        remote.reshard(ChunkShardingSpec(0, ["rank:0/cpu"]), replicas=replicas)
    assert "refused" not in cl and cl.tensor("refused-reshard").version == remote.version


def test_a_layout_with_replicas_takes_no_more(cl: Cluster) -> None:
    remote = cl.put("mirrored-base", torch.zeros(6, 4), replicas=2)
    with pytest.raises(
        InvalidArgumentError, match="replicas=2 asks for copies of a layout that already has"
    ):
        remote.reshard(remote.metadata(), replicas=2)
    with pytest.raises(
        InvalidArgumentError, match="replicas=3 asks for copies of a layout that already has"
    ):
        cl.put("mirrored-again", torch.zeros(6, 4), spec=remote.metadata(), replicas=3)
    assert cl.put("mirrored-again", torch.ones(6, 4), spec=remote.metadata()).replicas == 2


def test_cli_create_reshard_load_with_replicas_and_status_shows_them(
    cl: Cluster, cluster3: LocalCluster, tmp_path: Path, capsys
) -> None:
    coordinator = ["--coordinator", cluster3.address]
    assert (
        cli_main(
            [
                *coordinator,
                "create",
                "cli-r2",
                "--shape",
                "9,4",
                "--init",
                "arange",
                "--replicas",
                "2",
            ]
        )
        == 0
    )
    assert "6 shards on ranks 0,1,2" in capsys.readouterr().out
    assert cl.tensor("cli-r2").replicas == 2
    assert cli_main([*coordinator, "reshard", "cli-r2", "--dim", "1", "--replicas", "3"]) == 0
    assert cl.tensor("cli-r2").replicas == 3
    dcp.save({"cli-loaded": _table(6)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert cli_main([*coordinator, "load", str(tmp_path), "--replicas", "2"]) == 0
    assert cl.tensor("cli-loaded").replicas == 2
    capsys.readouterr()
    assert cli_main([*coordinator, "list"]) == 0
    lines = {line.split("\t")[0]: line.split("\t") for line in capsys.readouterr().out.splitlines()}
    assert lines["cli-r2"][4] == "replicas 3" and lines["cli-loaded"][4] == "replicas 2"
    assert lines["put-r2"][4] == "replicas 2" and lines["reshard-r2"][4] == "replicas 1"
    assert cli_main([*coordinator, "status"]) == 0
    assert "replicas" in capsys.readouterr().out
    assert cli_main([*coordinator, "create", "cli-r9", "--shape", "4", "--replicas", "9"]) == 1
    assert "replicas=9 is more than the 3 live ranks" in capsys.readouterr().err


# ---------------------------------------------------------------- a replicated tensor survives a dead rank

DEAD = 1


@pytest.fixture(scope="module")
def survivors(make_cluster: Callable[..., LocalCluster]) -> Iterator[dict]:
    """On a fresh 2-rank cluster: a replicas=2 table, and one whose rows were updated; a client per transport that
    read through rank 1 before it was SIGKILLed."""
    cluster = make_cluster(ranks=2)
    table, updated = _table(7), _table(8)
    clients: dict[str, Cluster] = {}
    try:
        with connect(cluster.address) as writer:
            writer.put("kept", table, replicas=2)
            primaries = [
                (s.shard_offsets[0], s.rank)
                for s in writer.put("updated", updated, replicas=2).metadata().shards_metadata
            ]
            assert primaries == [
                (0, 0),
                (0, 1),
                (6, 1),
                (6, 0),
            ]  # rank 1 is primary of rows 6-11, rank 0 backs it
            ids = torch.tensor(
                [1, 7, 10]
            )  # rows on both primaries (rows 0-5 on rank 0, 6-11 on rank 1)
            rows = _table(80, 3)
            writer.update_rows("updated", ids, rows)
            updated[ids] = rows
        for transport in TRANSPORTS:
            client = clients[transport] = connect(cluster.address, transport=transport)
            for name, data in (("kept", table), ("updated", updated)):
                assert torch.equal(client.tensor(name).full_tensor(), data)
        cluster.kill_rank(DEAD, signal.SIGKILL)
        coordinator = cluster.coordinator
        assert coordinator is not None
        wait_until(
            lambda: not coordinator.registry.rank_alive(DEAD),
            WAIT_S,
            "the coordinator to mark rank 1 dead",
        )
        yield {"data": {"kept": table, "updated": updated}, "clients": clients}
    finally:
        for client in clients.values():
            client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", ["kept", "updated"])
def test_a_replicated_tensor_reads_bit_for_bit_after_a_rank_is_killed(
    survivors, transport: str, name: str
) -> None:
    table, client = survivors["data"][name], survivors["clients"][transport]
    remote = client.tensor(name)
    assert torch.equal(remote.full_tensor(), table)
    assert torch.equal(remote.fetch((4, 1), (5, 3)), table[4:9, 1:4])
    ids = torch.tensor([10, 1, 7, 0, 11, 7])
    assert torch.equal(remote.lookup(ids), F.embedding(ids, table))
    assert (remote.health, remote.replicas, remote.lost_boxes) == ("degraded", 2, [])
