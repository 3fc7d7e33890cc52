"""A real 3-rank cluster driven through raw gRPC stubs: put, commit, read bit for bit, versions, leases."""

from __future__ import annotations

import random

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_helpers import (
    TIMEOUT,
    Stubs,
    create,
    put,
    read_full,
    read_region,
    rpc_error,
    write_shards,
)

from shardserve.core.metadata import Box, ShardMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.rank.shard_fill import arange_box


@pytest.fixture(scope="module")
def cluster3(make_cluster):
    """Ranks without a grace period: these tests check at the RPC level that a replaced version is dropped."""
    return make_cluster(ranks=3, rank_options=RankOptions(version_grace=0))


@pytest.fixture(scope="module")
def stubs(cluster3):
    s = Stubs(cluster3.address)
    yield s
    s.close()


def chunk_meta(size, dim, dtype, ranks=(0, 1, 2, 0)):
    return ChunkShardingSpec(dim, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        size, TensorProperties(dtype=dtype)
    )


def source(size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(size, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(size, generator=g).to(dtype)
    return torch.randint(0, 250, size, generator=g).to(dtype)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
)
@pytest.mark.parametrize("dim", [0, 1])
def test_put_then_read_random_boxes_bit_for_bit(stubs, dtype, dim):
    tensor = source((37, 23), dtype)
    meta = chunk_meta((37, 23), dim, dtype)
    info = put(stubs, f"t-{dim}-{dtype}".replace("torch.", ""), tensor, meta, chunk=97)
    assert info.state == pb.READY
    assert torch.equal(read_full(stubs, info), tensor)
    rng = random.Random(1)
    for _ in range(20):
        index = rng.randrange(len(meta.shards_metadata))
        shard = meta.shards_metadata[index]
        if shard.numel() == 0:
            continue
        offsets = [o + rng.randrange(s) for o, s in zip(shard.shard_offsets, shard.shard_sizes)]
        sizes = [
            rng.randint(0, o0 + s0 - o)
            for o, o0, s0 in zip(offsets, shard.shard_offsets, shard.shard_sizes)
        ]
        got = read_region(
            stubs,
            shard.rank,
            info.name,
            info.version,
            index,
            offsets=offsets,
            sizes=sizes,
            dtype=dtype,
            chunk_bytes=rng.choice([0, 1, 7, 64]),
        )
        expected = tensor[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
        assert torch.equal(got, expected)


def test_enumerable_grid_with_several_shards_per_rank_and_replicas(stubs):
    shards = [
        ShardMetadata((r, c), (2 if r == 0 else 3, 4), f"rank:{(r + c) % 3}/cpu")
        for r in (0, 2)
        for c in (0, 4)
    ]
    shards.append(ShardMetadata((0, 0), (2, 4), "rank:2/cpu"))  # a replica of shard 0
    meta = EnumerableShardingSpec(shards).build_metadata(
        (5, 8), TensorProperties(dtype=torch.float64)
    )
    tensor = source((5, 8), torch.float64, seed=3)
    info = put(stubs, "grid", tensor, meta)
    assert torch.equal(read_full(stubs, info), tensor)
    replica = read_region(
        stubs, 2, "grid", info.version, 4, offsets=[0, 1], sizes=[2, 2], dtype=torch.float64
    )
    assert torch.equal(replica, tensor[0:2, 1:3])


@pytest.mark.parametrize(
    "init,expected",
    [
        (pb.INIT_ZEROS, lambda: torch.zeros(10, 6)),
        (pb.INIT_ONES, lambda: torch.ones(10, 6)),
        (pb.INIT_ARANGE, lambda: torch.arange(60, dtype=torch.float32).view(10, 6)),
    ],
)
def test_create_with_init(stubs, init, expected):
    meta = chunk_meta((10, 6), 0, torch.float32)
    info = create(stubs, f"init-{init}", meta, init=init)
    assert info.state == pb.READY and info.version > 0
    assert torch.equal(read_full(stubs, info), expected())


def test_init_normal_uses_seed_plus_shard_index(stubs):
    meta = chunk_meta((9, 4), 0, torch.float32, ranks=(0, 1, 2))
    info = create(stubs, "normal", meta, init=pb.INIT_NORMAL, seed=5)
    got = read_full(stubs, info)
    for i, shard in enumerate(meta.shards_metadata):
        ref = torch.randn(shard.shard_sizes, generator=torch.Generator().manual_seed(5 + i))
        assert torch.equal(
            got[shard.shard_offsets[0] : shard.shard_offsets[0] + shard.shard_sizes[0]], ref
        )


def test_arange_box_matches_torch_arange():
    full = torch.arange(3 * 4 * 5).view(3, 4, 5)
    assert torch.equal(
        arange_box((3, 4, 5), Box((1, 2, 0), (2, 2, 3)), torch.int64), full[1:3, 2:4, 0:3]
    )


def test_pending_tensor_is_invisible_until_commit(stubs):
    meta = chunk_meta((6, 3), 0, torch.int32, ranks=(0, 1))
    tensor = torch.arange(18, dtype=torch.int32).view(6, 3)
    info = create(stubs, "pending", meta)
    assert info.state == pb.PENDING
    err = rpc_error(stubs.coord.GetTensor, pb.GetTensorRequest(name="pending"), timeout=TIMEOUT)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'pending'" in err.details()
    listed = stubs.coord.ListTensors(pb.ListTensorsRequest(), timeout=TIMEOUT).tensors
    assert "pending" not in [t.name for t in listed]
    with_pending = stubs.coord.ListTensors(
        pb.ListTensorsRequest(include_pending=True), timeout=TIMEOUT
    ).tensors
    assert [t.state for t in with_pending if t.name == "pending"] == [pb.PENDING]
    err = rpc_error(
        read_region,
        stubs,
        0,
        "pending",
        info.version,
        0,
        offsets=[0, 0],
        sizes=[1, 1],
        dtype=torch.int32,
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not served" in err.details()
    write_shards(stubs, info, tensor, only=[0])
    err = rpc_error(
        stubs.coord.CommitTensor,
        pb.CommitTensorRequest(name="pending", version=info.version),
        timeout=TIMEOUT,
    )
    assert (
        err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not fully written" in err.details()
    )
    write_shards(stubs, info, tensor, only=[1])
    ready = stubs.coord.CommitTensor(
        pb.CommitTensorRequest(name="pending", version=info.version), timeout=TIMEOUT
    )
    assert ready.state == pb.READY
    assert torch.equal(
        read_full(
            stubs, stubs.coord.GetTensor(pb.GetTensorRequest(name="pending"), timeout=TIMEOUT)
        ),
        tensor,
    )


def held_everywhere(stubs):
    return {
        (h.name, h.version)
        for stub in stubs.ranks.values()
        for h in stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).held
    }


def memory_used(stubs):
    return sum(
        stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).memory_used_bytes
        for stub in stubs.ranks.values()
    )


def test_half_failed_put_then_abort_leaves_nothing(stubs):
    before = memory_used(stubs)
    meta = chunk_meta((8, 8), 1, torch.float32, ranks=(0, 1, 2))
    tensor = source((8, 8), torch.float32)
    info = create(stubs, "half", meta)
    assert memory_used(stubs) == before + 8 * 8 * 4
    write_shards(stubs, info, tensor, only=[0])
    bad = pb.WriteShardRequest(
        header=pb.WriteShardHeader(
            name="half", version=info.version, shard_index=1, dtype=pb.FLOAT32, nbytes=5
        )
    )
    err = rpc_error(stubs.ranks[1].WriteShard, iter([bad]), timeout=TIMEOUT)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "header.nbytes" in err.details()
    stubs.coord.AbortTensor(
        pb.AbortTensorRequest(name="half", version=info.version), timeout=TIMEOUT
    )
    err = rpc_error(stubs.coord.GetTensor, pb.GetTensorRequest(name="half"), timeout=TIMEOUT)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert not any(name == "half" for name, _ in held_everywhere(stubs))
    assert memory_used(stubs) == before
    err = rpc_error(
        stubs.coord.CommitTensor,
        pb.CommitTensorRequest(name="half", version=info.version),
        timeout=TIMEOUT,
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_overwrite_makes_a_new_version_and_old_reads_fail_precondition(stubs):
    meta = chunk_meta((4, 4), 0, torch.float32, ranks=(0, 1))
    first = put(stubs, "versioned", torch.zeros(4, 4), meta)
    err = rpc_error(create, stubs, "versioned", meta)
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "overwrite" in err.details()
    second = put(stubs, "versioned", torch.ones(4, 4), meta, overwrite=True)
    assert second.version > first.version
    err = rpc_error(
        read_region,
        stubs,
        0,
        "versioned",
        first.version,
        0,
        offsets=[0, 0],
        sizes=[2, 4],
        dtype=torch.float32,
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"served version is {second.version}" in err.details()
    assert torch.equal(read_full(stubs, second), torch.ones(4, 4))
    assert ("versioned", first.version) not in held_everywhere(stubs)


def test_dropped_version_stays_whole_for_a_read_in_flight(stubs):
    meta = chunk_meta((2048, 1024), 0, torch.float32, ranks=(2,))
    nbytes = 2048 * 1024 * 4
    tensor = source((2048, 1024), torch.float32, seed=7)
    first = put(stubs, "leased", tensor, meta)
    base = stubs.ranks[2].GetStats(pb.GetStatsRequest(), timeout=TIMEOUT).memory_used_bytes
    # The stream's flow-control window stays at its first 64 KiB (no BDP probing to widen it, as a channel
    # that moved megabytes before may have): the rank cannot hand gRPC the whole 8 MiB before this test reads
    # it, so its read, and its lease on the version, stay open.
    reader = stubs.rank_stub(2, options=[("grpc.http2.bdp_probe", 0)])
    stream = reader.ReadRegion(
        pb.ReadRegionRequest(
            name="leased",
            version=first.version,
            shard_index=0,
            offsets=[0, 0],
            sizes=[2048, 1024],
            chunk_bytes=16384,
        ),
        timeout=TIMEOUT,
    )
    chunks = [next(stream)]
    put(
        stubs, "leased", torch.zeros(2048, 1024), meta, overwrite=True
    )  # drops the first version on rank 2
    stats = stubs.ranks[2].GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)
    assert ("leased", first.version) not in {(h.name, h.version) for h in stats.held}
    assert stats.memory_used_bytes == base + nbytes  # old version still leased by the open stream
    chunks.extend(stream)
    data = b"".join(c.data for c in sorted(chunks, key=lambda c: c.offset))
    assert torch.equal(
        torch.frombuffer(bytearray(data), dtype=torch.float32).view(2048, 1024), tensor
    )
    stats = stubs.ranks[2].GetStats(pb.GetStatsRequest(), timeout=TIMEOUT)
    assert stats.memory_used_bytes == base


def test_delete_frees_memory_and_then_not_found(stubs):
    before = memory_used(stubs)
    meta = chunk_meta((16, 2), 0, torch.int64)
    info = create(stubs, "doomed", meta, init=pb.INIT_ARANGE)
    assert memory_used(stubs) == before + 16 * 2 * 8
    stubs.coord.DeleteTensor(pb.DeleteTensorRequest(name="doomed"), timeout=TIMEOUT)
    assert memory_used(stubs) == before
    for call, request in [
        (stubs.coord.GetTensor, pb.GetTensorRequest(name="doomed")),
        (stubs.coord.DeleteTensor, pb.DeleteTensorRequest(name="doomed")),
    ]:
        assert rpc_error(call, request, timeout=TIMEOUT).code() == grpc.StatusCode.NOT_FOUND
    err = rpc_error(
        read_region,
        stubs,
        0,
        "doomed",
        info.version,
        0,
        offsets=[0, 0],
        sizes=[1, 1],
        dtype=torch.int64,
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND and "not found on rank 0" in err.details()


def test_list_ranks_reports_live_ranks(stubs, cluster3):
    ranks = stubs.coord.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks
    assert [r.rank for r in ranks] == [0, 1, 2]
    assert all(r.alive and r.world_size == 3 and r.device == "cpu" for r in ranks)
    assert sorted(r.pid for r in ranks) == sorted(cluster3.rank_pids)


def test_health_and_reflection_on_both_servers(stubs, cluster3):
    addresses = {"shardserve.v1.Coordinator": cluster3.address}
    addresses.update(
        {
            "shardserve.v1.ShardServer": r.address
            for r in stubs.coord.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks
        }
    )
    for service, address in addresses.items():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                status = health.Check(
                    health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT
                ).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
            )
            names = {s.name for a in answers for s in a.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_chunk_size_is_clamped_to_at_least_4_kib(stubs):
    meta = chunk_meta((10, 1000), 0, torch.uint8, ranks=(1,))
    info = create(stubs, "chunky", meta, init=pb.INIT_ARANGE)
    for requested, sizes in [(1, [4096, 4096, 1808]), (0, [10000]), (5000, [5000, 5000])]:
        chunks = list(
            stubs.ranks[1].ReadRegion(
                pb.ReadRegionRequest(
                    name="chunky",
                    version=info.version,
                    shard_index=0,
                    offsets=[0, 0],
                    sizes=[10, 1000],
                    chunk_bytes=requested,
                ),
                timeout=TIMEOUT,
            )
        )
        assert [len(c.data) for c in chunks] == sizes
        assert [c.offset for c in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]
