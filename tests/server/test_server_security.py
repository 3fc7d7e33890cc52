"""Bearer token on every service but health, mTLS from openssl-made files, and the configured byte limits."""

from __future__ import annotations

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
    write_requests,
)

from shardserve import AuthenticationError, ResourceExhaustedError, connect
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.auth import Security
from shardserve.server.common.rank_options import RankOptions

TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MEMORY_LIMIT = 1 << 20
MAX_REQUEST = 4096


def meta_for(size, ranks, dtype=torch.float32):
    return ChunkShardingSpec(0, [f"rank:{r}/cpu" for r in ranks]).build_metadata(
        size, TensorProperties(dtype=dtype)
    )


@pytest.fixture(scope="module")
def guarded(make_cluster):
    return make_cluster(
        ranks=2,
        security=Security(token=TOKEN),
        rank_options=RankOptions(memory_limit=MEMORY_LIMIT, max_request_bytes=MAX_REQUEST),
    )


@pytest.fixture(scope="module")
def stubs(guarded):
    s = Stubs(guarded.address, metadata=AUTH)
    yield s
    s.close()


@pytest.fixture(scope="module")
def served(stubs):
    tensor = torch.arange(64, dtype=torch.float32).view(16, 4)
    return put(stubs, "t", tensor, meta_for((16, 4), (0, 1))), tensor


def rank_calls(stubs, served):
    info, _ = served
    stub = stubs.ranks[0]
    return [
        lambda md: stub.GetStats(pb.GetStatsRequest(), timeout=TIMEOUT, metadata=md),
        lambda md: list(
            stub.ReadRegion(
                pb.ReadRegionRequest(
                    name="t", version=info.version, shard_index=0, offsets=[0, 0], sizes=[1, 4]
                ),
                timeout=TIMEOUT,
                metadata=md,
            )
        ),
        lambda md: stub.WriteShard(
            write_requests("t", info.version, 0, torch.zeros(8, 4)), timeout=TIMEOUT, metadata=md
        ),
        lambda md: stub.OpenBulkSession(pb.BulkSessionRequest(), timeout=TIMEOUT, metadata=md),
        lambda md: stub.DropVersion(pb.DropVersionRequest(name="t"), timeout=TIMEOUT, metadata=md),
        lambda md: stubs.coord.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT, metadata=md),
        lambda md: stubs.coord.DeleteTensor(
            pb.DeleteTensorRequest(name="t"), timeout=TIMEOUT, metadata=md
        ),
    ]


@pytest.mark.parametrize(
    "metadata,reason",
    [
        ((), "missing"),
        ((("authorization", "Bearer nope"),), "wrong"),
        ((("authorization", TOKEN),), "wrong"),
    ],
)
def test_calls_without_the_right_token_are_unauthenticated(stubs, served, metadata, reason):
    for call in rank_calls(stubs, served):
        err = rpc_error(call, metadata)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert f"{reason} bearer token" in err.details()
    assert torch.equal(read_full(stubs, served[0]), served[1])  # nothing was dropped or deleted


def test_health_needs_no_token_but_reflection_does(stubs, guarded):
    with grpc.insecure_channel(guarded.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT
        )
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        err = rpc_error(
            lambda: list(reflection.ServerReflectionInfo(iter([request]), timeout=TIMEOUT))
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = reflection.ServerReflectionInfo(iter([request]), timeout=TIMEOUT, metadata=AUTH)
        assert "shardserve.v1.Coordinator" in {
            s.name for a in answers for s in a.list_services_response.service
        }


def test_memory_limit_refuses_allocation_and_leaves_nothing(stubs):
    meta = meta_for((2 * MEMORY_LIMIT // 4,), (1,))
    err = rpc_error(create, stubs, "big", meta, init=pb.INIT_ZEROS)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rank 1" in err.details() and "memory limit" in err.details()
    listed = stubs.coord.ListTensors(
        pb.ListTensorsRequest(include_pending=True), timeout=TIMEOUT, metadata=AUTH
    ).tensors
    assert "big" not in [t.name for t in listed]
    small = create(stubs, "small", meta_for((MEMORY_LIMIT // 8,), (1,)), init=pb.INIT_ONES)
    assert small.state == pb.READY
    stats = stubs.ranks[1].GetStats(pb.GetStatsRequest(), timeout=TIMEOUT, metadata=AUTH)
    assert stats.memory_limit_bytes == MEMORY_LIMIT
    assert stats.memory_used_bytes == MEMORY_LIMIT // 2 + 8 * 4 * 4


def test_max_request_bytes(stubs):
    info = create(stubs, "wide", meta_for((4, 2048), (0,), torch.uint8), init=pb.INIT_ARANGE)
    ok = read_region(
        stubs, 0, "wide", info.version, 0, offsets=[0, 0], sizes=[2, 2048], dtype=torch.uint8
    )
    assert torch.equal(ok, (torch.arange(2 * 2048) % 256).to(torch.uint8).view(2, 2048))
    err = rpc_error(
        read_region,
        stubs,
        0,
        "wide",
        info.version,
        0,
        offsets=[0, 0],
        sizes=[3, 2048],
        dtype=torch.uint8,
    )
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "offsets/sizes" in err.details() and "max_request_bytes 4096" in err.details()


def test_bulk_port_reads_with_the_token_and_keeps_the_limits(guarded):
    expected = (torch.arange(4 * 2048) % 251).to(torch.uint8).view(4, 2048)
    with connect(guarded.address, token=TOKEN, transport="bulk") as c:
        remote = c.put("wide-bulk", expected, ChunkShardingSpec(0, ["rank:0/cpu"]))
        assert torch.equal(remote[:2], expected[:2]) and remote.last_transport == "bulk"
        with pytest.raises(ResourceExhaustedError, match="max_request_bytes 4096"):
            remote[:3]
        assert torch.equal(remote[2:4], expected[2:4])  # the kept connection still serves
        c.delete("wide-bulk")
    with pytest.raises(AuthenticationError):
        connect(guarded.address, token="nope", transport="bulk")


@pytest.fixture(scope="module")
def tls_cluster(make_cluster, tls_files):
    return make_cluster(ranks=1, security=Security(token=TOKEN, tls=tls_files))


def test_mtls_cluster_serves_only_clients_with_a_certificate(tls_cluster, tls_files):
    cert, key = (open(p, "rb").read() for p in (tls_files.cert, tls_files.key))
    mutual = grpc.ssl_channel_credentials(
        root_certificates=cert, private_key=key, certificate_chain=cert
    )
    stubs = Stubs(tls_cluster.address, metadata=AUTH, credentials=mutual)
    try:
        tensor = torch.randn(6, 3)
        info = put(stubs, "secret", tensor, meta_for((6, 3), (0,)))
        assert torch.equal(read_full(stubs, info), tensor)
    finally:
        stubs.close()
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=cert)
    for channel in (
        grpc.secure_channel(tls_cluster.address, no_client_cert),
        grpc.insecure_channel(tls_cluster.address),
    ):
        with channel:
            err = rpc_error(
                pb_grpc.CoordinatorStub(channel).ListRanks,
                pb.ListRanksRequest(),
                timeout=5,
                metadata=AUTH,
            )
            assert err.code() == grpc.StatusCode.UNAVAILABLE
