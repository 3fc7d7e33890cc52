"""The scale harness's cluster as a smoke test: the real coordinator process and 50 simulated ranks (real rank
service code, many instances per process; benchmarks/scale_ranks.py). Registration, a snapshot's commit (its
data read back bit for bit), a reshard's new layout and a repair after a rank is lost (read back bit for bit)."""

from __future__ import annotations

import pytest
import torch
from waiting import wait_until

from benchmarks.scale_cluster import SimulatedCluster
from benchmarks.scale_workload import (
    PREFIX,
    StateDict,
    create_tables,
    reshard_table,
    state_value,
    table_layout,
    table_value,
    write_snapshot,
)
from shardserve import connect
from shardserve.core.wire import metadata_from_proto
from shardserve.protos import shardserve_pb2 as pb

RANKS = 50
TENSORS = 200  # x 10 shards, each tensor on a group of 10 ranks
TABLES, ROWS = 5, 40  # x 2 replicas
TIMEOUT_S = 120.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with SimulatedCluster(
        RANKS, heartbeat_interval=1.0, repair_after=0.0, processes=2
    ) as simulated:
        simulated.start_coordinator()
        simulated.start_ranks()
        simulated.register()
        yield simulated


def test_every_rank_registers_at_its_own_address(cluster):
    ranks = cluster.stub.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT_S).ranks
    assert sorted(r.rank for r in ranks) == list(range(RANKS))
    assert all(r.alive and r.world_size == RANKS for r in ranks)
    assert len({r.address for r in ranks}) == RANKS and len({r.hostname for r in ranks}) > 1


@pytest.fixture(scope="module")
def snapshot(cluster) -> tuple[StateDict, pb.CommitSnapshotResponse]:
    """The state dict of TENSORS tensors put as a snapshot (created, written, committed reserving the next):
    its description and the commit's answer."""
    state = StateDict(TENSORS, RANKS)
    created = cluster.stub.CreateSnapshot(state.create_request(), timeout=TIMEOUT_S)
    assert write_snapshot(created, cluster.rank_stub, state=state) == state.shards * 16
    commit = pb.CommitSnapshotRequest(prefix=PREFIX, number=created.number, reserve_next=True)
    return state, cluster.stub.CommitSnapshot(commit, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def tables(cluster) -> None:
    """TABLES tables of ROWS rows, each row on 2 ranks of a group."""
    create_tables(cluster.stub, count=TABLES, rows=ROWS, world=RANKS)


def test_a_snapshot_commits_and_reads_back_bit_for_bit(cluster, snapshot):
    state, answer = snapshot
    assert answer.committed.state == pb.READY and len(answer.committed.entries) == TENSORS
    assert answer.next.state == pb.PENDING and len(answer.next.entries) == TENSORS
    for entry in answer.committed.entries:
        index = int(entry.key.removeprefix("layer").removesuffix(".weight"))
        assert metadata_from_proto(entry.tensor.metadata).ranks() == tuple(
            range((index % 5) * 10, (index % 5) * 10 + 10)
        )
    with connect(cluster.address, timeout=TIMEOUT_S, transport="grpc") as client:
        read = client.snapshot(PREFIX).read()
    assert sorted(read) == sorted(state.key(i) for i in range(TENSORS))
    for i in range(TENSORS):
        assert torch.equal(read[state.key(i)], state_value(i)), state.key(i)


def test_a_reshard_commits_the_layout_asked_for(cluster, tables):
    for index in range(TABLES):
        before = cluster.stub.GetTensor(
            pb.GetTensorRequest(name=f"table{index}"), timeout=TIMEOUT_S
        )
        done = reshard_table(cluster.stub, index, rows=ROWS, world=RANKS, shift=2).tensor
        assert done.version > before.version and done.health == "healthy" and done.replicas == 2
        assert metadata_from_proto(done.metadata) == table_layout(index, RANKS, ROWS, shift=2)
    with connect(cluster.address, timeout=TIMEOUT_S, transport="grpc") as client:
        for index in range(TABLES):
            assert torch.equal(client.tensor(f"table{index}").full_tensor(), table_value(ROWS))


def test_a_lost_rank_is_noticed_and_its_copies_repaired(cluster, snapshot, tables):
    """Rank 3 is killed: the coordinator lists it dead, the tables it held copies of are repaired onto other
    ranks (read back bit for bit), and the snapshot tensors whose only copy was there are reported unavailable,
    not lost. (Last in the module: it leaves the cluster a rank short.)"""
    victim = 3
    held = [i for i in range(TABLES) if victim in _ranks_of(cluster, f"table{i}")]
    assert held  # table 0 is on ranks 0-9
    cluster.kill_rank(victim)
    wait_until(lambda: not _alive(cluster, victim), TIMEOUT_S, f"rank {victim} listed dead")
    wait_until(
        lambda: all(victim not in _ranks_of(cluster, f"table{i}") for i in held),
        TIMEOUT_S,
        "the tables repaired",
    )
    listed = cluster.stub.ListTensors(pb.ListTensorsRequest(), timeout=TIMEOUT_S).tensors
    tables = {t.name: t for t in listed if t.name.startswith("table")}
    assert all(tables[f"table{i}"].health == "healthy" for i in held)
    on_victim = [t for t in listed if t.name.startswith(PREFIX) and t.unavailable_shards]
    assert on_victim and all(t.health == "unavailable" for t in on_victim)
    with connect(cluster.address, timeout=TIMEOUT_S, transport="grpc") as client:
        for index in held:
            assert torch.equal(client.tensor(f"table{index}").full_tensor(), table_value(ROWS))


def _ranks_of(cluster: SimulatedCluster, name: str) -> set[int]:
    info = cluster.stub.GetTensor(pb.GetTensorRequest(name=name), timeout=TIMEOUT_S)
    return set(metadata_from_proto(info.metadata).ranks())


def _alive(cluster: SimulatedCluster, rank: int) -> bool:
    ranks = cluster.stub.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT_S).ranks
    return any(r.rank == rank and r.alive for r in ranks)
