"""RankCalls' fan-out: every rank's call in flight at once (no pool bounding them), each rank's batch built from
entries encoded once, and a failure named by its rank. The ranks are real gRPC servers on loopback that answer
the ShardServer methods the fan-outs call, and record what they were asked."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import RankUnavailable
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.ranks import calls as calls_module
from shardserve.server.coordinator.ranks.calls import RankCalls, versions_by_rank
from shardserve.server.coordinator.ranks.heartbeats import HeartbeatPolicy
from shardserve.server.coordinator.ranks.info import RankInfo
from shardserve.server.coordinator.ranks.registry import RankRegistry

RANKS = 48  # more than the 32 calls the fan-out pool it replaced allowed in flight
SERVICE = "shardserve.v1.ShardServer"
WAIT_S = 20.0


@dataclass
class Rank:
    """One rank's server: what it was asked, and a barrier every rank's call must reach before any answers."""

    barrier: threading.Barrier
    refuse: bool = False
    hold: threading.Event | None = (
        None  # set: the call waits for it (a rank that stopped), then answers
    )
    asked: dict[str, list] = field(default_factory=dict)

    def handler(self, method: str, request_type, answer):  # type: ignore[no-untyped-def]
        def handle(request, context):  # type: ignore[no-untyped-def]
            self.asked.setdefault(method, []).append(request)
            self.barrier.wait(
                WAIT_S
            )  # BrokenBarrierError (an UNKNOWN answer) unless all are in flight
            if self.hold is not None:
                self.hold.wait(WAIT_S)
            if self.refuse:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "memory limit")
            return answer(request)

        return grpc.unary_unary_rpc_method_handler(
            handle,
            request_deserializer=request_type.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )


def _promoted(request: pb.PromoteManyRequest) -> pb.PromoteManyResponse:
    return pb.PromoteManyResponse(
        checksums=[
            pb.ShardChecksum(name=v.name, version=v.version, shard_index=0, checksum=7)
            for v in request.versions
        ]
    )


@pytest.fixture
def cluster():
    """RANKS real servers and a registry of them: (registry, {rank: Rank})."""
    barrier = threading.Barrier(RANKS)
    ranks, servers = {}, []
    registry = RankRegistry(heartbeats=HeartbeatPolicy(dead_after=600.0))
    for rank in range(RANKS):
        state = ranks[rank] = Rank(barrier)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handlers = {
            "PromoteMany": state.handler("PromoteMany", pb.PromoteManyRequest, _promoted),
            "AllocateMany": state.handler(
                "AllocateMany", pb.AllocateManyRequest, lambda r: pb.AllocateManyResponse()
            ),
            "DropMany": state.handler(
                "DropMany", pb.DropManyRequest, lambda r: pb.DropManyResponse()
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        info = RankInfo(
            rank=rank, address=f"127.0.0.1:{port}", device="cpu", world_size=RANKS, pid=rank
        )
        registry.register(info, [])
    yield registry, ranks
    registry.close()
    for server in servers:
        server.stop(0)


@pytest.fixture
def calls(cluster):
    """The fan-out of the cluster's registry, closed after the test."""
    made = RankCalls(cluster[0], rpc_timeout=WAIT_S * 2)
    yield made
    made.close()


def _records(count: int) -> list[TensorRecord]:
    """`count` tensors, tensor i on ranks i, i+1 and i+2 (mod RANKS)."""
    return [
        TensorRecord(
            name=f"t{i}",
            version=100 + i,
            metadata=ChunkShardingSpec(
                0, [f"rank:{(i + k) % RANKS}/cpu" for k in range(3)]
            ).build_metadata((6, 2), TensorProperties(dtype=torch.float32)),
        )
        for i in range(count)
    ]


def test_every_ranks_call_is_in_flight_at_once(cluster, calls):
    """Each rank's server holds its call until all RANKS calls arrived: a fan-out bounded by a pool of fewer
    calls would break the barrier instead of answering. Each rank is asked for its own versions only."""
    registry, ranks = cluster
    records = _records(RANKS)
    versions = versions_by_rank(records, TensorRecord.ranks)
    promoted = calls.promote_many(versions, "promote")
    assert promoted.checksums == {r.key: {0: 7} for r in records} and promoted.shared == {}
    for rank, state in ranks.items():
        [request] = state.asked["PromoteMany"]
        assert [(v.name, v.version) for v in request.versions] == versions[rank]


def test_a_batch_is_the_entries_each_made_once(cluster, calls, monkeypatch):
    """AllocateMany: each rank's request holds exactly the allocation of each of its records (as built field by
    field), and a layout is encoded at most once however many records and ranks hold it (the process keeps
    what earlier calls encoded, so other tests may have encoded some already)."""
    registry, ranks = cluster
    records = _records(RANKS)
    built = []
    real = calls_module.metadata_to_proto
    monkeypatch.setattr(
        calls_module, "metadata_to_proto", lambda meta: built.append(meta) or real(meta)
    )
    by_rank = {rank: [r for r in records if rank in r.ranks()] for rank in range(RANKS)}
    dropping = {rank: [("old", rank + 1)] for rank in range(RANKS)}
    calls.allocate_many(by_rank, "allocate", writer_host_id="host-a", dropping=dropping)
    assert len(built) <= len({r.metadata for r in records})  # not one per (rank, record)
    for rank, state in ranks.items():
        [request] = state.asked["AllocateMany"]
        expected = pb.AllocateManyRequest(
            tensors=[
                pb.AllocateShardsRequest(
                    name=r.name,
                    version=r.version,
                    metadata=metadata_to_proto(r.metadata),
                    options=pb.TensorOptions(),
                )
                for r in by_rank[rank]
            ],
            writer_host_id="host-a",
            drop_first=[pb.DropVersionRequest(name="old", version=rank + 1)],
        )
        assert request == expected


def test_a_refusal_is_raised_naming_its_rank_after_every_call_ended(cluster, calls):
    registry, ranks = cluster
    ranks[5].refuse = True
    versions = {rank: [("t", 1)] for rank in range(RANKS)}
    with pytest.raises(Exception, match="rank 5: memory limit") as raised:
        calls.promote_many(versions, "promote")
    assert raised.value.metadata["rank"] == 5  # type: ignore[attr-defined]
    assert all(len(state.asked["PromoteMany"]) == 1 for state in ranks.values())


def test_a_rank_that_is_not_alive_fails_at_once_and_the_others_are_called(cluster, calls):
    registry, ranks = cluster
    registry.mark_exited(7, "process 7 was killed by SIGKILL")
    barrier = threading.Barrier(RANKS - 1)  # the others' calls, all in flight at once
    for state in ranks.values():
        state.barrier = barrier
    versions = {rank: [("t", 1)] for rank in range(RANKS)}
    with pytest.raises(RankUnavailable, match="rank 7 .* is not alive"):
        calls.promote_many(versions, "promote")
    assert not barrier.broken and "PromoteMany" not in ranks[7].asked
    assert all(len(ranks[r].asked["PromoteMany"]) == 1 for r in range(RANKS) if r != 7)


def test_a_rank_past_its_deadline_is_named_and_the_others_answered(cluster):
    """A large fan-out (on the call loop): the rank that holds its call past the deadline fails unavailable,
    named; every other rank's answer came."""
    registry, ranks = cluster
    ranks[9].hold = release = threading.Event()
    calls = RankCalls(registry, rpc_timeout=1.0)
    try:
        with pytest.raises(RankUnavailable, match="rank 9 .* unavailable: Deadline Exceeded"):
            calls.promote_many({rank: [("t", 1)] for rank in range(RANKS)}, "promote")
    finally:
        release.set()
        calls.close()
    assert all(len(state.asked["PromoteMany"]) == 1 for state in ranks.values())


def test_a_call_that_finds_no_kept_thread_free_goes_on_the_loop(cluster):
    """With its one kept thread held by a stopped rank's call, a fan-out to another rank still answers (on the
    call loop) while the first waits."""
    registry, ranks = cluster
    lone = threading.Barrier(1)
    for state in ranks.values():
        state.barrier = lone
    ranks[0].hold = release = threading.Event()
    calls = RankCalls(registry, rpc_timeout=WAIT_S * 2, threads=1)
    held = futures.ThreadPoolExecutor(1).submit(calls.promote_many, {0: [("t", 1)]}, "held")
    try:
        deadline = time.monotonic() + WAIT_S  # rank 0's call under way: the kept thread is taken
        while "PromoteMany" not in ranks[0].asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "PromoteMany" in ranks[0].asked
        promoted = calls.promote_many({1: [("u", 2)]}, "promote")
        assert promoted.checksums == {("u", 2): {0: 7}} and not held.done()
    finally:
        release.set()
        held.result(WAIT_S)
        calls.close()


def test_promote_answers_give_each_versions_checksums_by_shard_in_any_order():
    """The checksums of several ranks' answers, a version's items interleaved with another's and split over
    answers, come out by (name, version) then shard index."""
    first = pb.PromoteManyResponse(
        checksums=[
            pb.ShardChecksum(name="a", version=1, shard_index=0, checksum=10),
            pb.ShardChecksum(name="a", version=1, shard_index=1, checksum=11),
            pb.ShardChecksum(name="b", version=1, shard_index=0, checksum=20),
            pb.ShardChecksum(name="a", version=1, shard_index=2, checksum=12),
            pb.ShardChecksum(name="a", version=2, shard_index=0, checksum=30),
        ]
    )
    second = pb.PromoteManyResponse(
        checksums=[pb.ShardChecksum(name="b", version=1, shard_index=1, checksum=21)]
    )
    assert calls_module.checksums_of([first, second]) == {
        ("a", 1): {0: 10, 1: 11, 2: 12},
        ("b", 1): {0: 20, 1: 21},
        ("a", 2): {0: 30},
    }
