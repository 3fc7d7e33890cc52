"""The error reasons of access and limits, caused for real on one shared 1-rank cluster with a tokens file
(a reader, a writer with a byte quota, a writer allowed one stream), a 2 MiB memory limit, a 4 KiB request
limit and no bulk port: the status and ErrorInfo a generic gRPC client reads, the client exception's class
and reason, and after each a good call still succeeds."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest
import torch
from error_reasons import assert_status
from server_helpers import TIMEOUT, Stubs, put, read_full, rpc_error
from waiting import eventually

from shardserve import connect
from shardserve.client.errors import (
    AuthenticationError,
    PermissionDeniedError,
    ResourceExhaustedError,
    ShardServeError,
)
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.server.common.auth import Security
from shardserve.server.common.principals import PrincipalBook, token_sha256
from shardserve.server.common.rank_options import RankOptions

pytestmark = pytest.mark.timeout(300)

TOKENS = {
    "admin": "admin-token-123",
    "reader": "reader-token-123",
    "capped": "capped-token-123",
    "streamer": "streamer-token-123",
}
EXTRA = {"admin": "", "reader": "", "capped": "max_bytes = 4096\n", "streamer": "max_streams = 1\n"}
ROLES = {"admin": "admin", "reader": "read", "capped": "write", "streamer": "write"}
MEMORY_LIMIT = 2 << 20
REQUEST_LIMIT = 4096
ON_RANK_0 = ChunkShardingSpec(0, ["rank:0/cpu"])
HELD_WITHIN_S = 20.0  # a loaded host may take a while to start the held stream
SMALL = torch.arange(20, dtype=torch.float32).view(4, 5)


def bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name]}"),)


@pytest.fixture(scope="module")
def cluster(make_cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(
        "".join(
            f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{token_sha256(token)}"\n'
            f'role = "{ROLES[name]}"\n{EXTRA[name]}'
            for name, token in TOKENS.items()
        )
    )
    return make_cluster(
        ranks=1,
        security=Security(principals=PrincipalBook(str(path))),
        rank_options=RankOptions(
            memory_limit=MEMORY_LIMIT, max_request_bytes=REQUEST_LIMIT, bulk_reads=False
        ),
    )


@pytest.fixture(scope="module")
def stubs(cluster):
    s = Stubs(cluster.address, metadata=bearer("admin"), default_metadata=bearer("admin"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def served(stubs):
    meta = ON_RANK_0.build_metadata(tuple(SMALL.shape), TensorProperties(dtype=torch.float32))
    return put(stubs, "small", SMALL, meta)


@pytest.fixture(autouse=True)
def still_serving(stubs, served):
    """After every refused call the coordinator and the rank answer a good one."""
    yield
    info = stubs.coord.GetTensor(pb.GetTensorRequest(name="small"), timeout=TIMEOUT)
    assert torch.equal(read_full(stubs, info), SMALL)


def client_of(cluster, name: str, transport: str = "auto"):
    return connect(cluster.address, token=TOKENS[name], timeout=30, transport=transport)


def test_unauthenticated(cluster, stubs):
    for metadata in ((), (("authorization", "Bearer not-a-token"),)):
        err = rpc_error(
            stubs.coord.GetTensor,
            pb.GetTensorRequest(name="small"),
            timeout=TIMEOUT,
            metadata=metadata or (("x-nothing", "1"),),
        )
        assert_status(err, grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED)
    with pytest.raises(AuthenticationError) as raised:
        connect(cluster.address, token="not-a-token", timeout=30).tensor("small")
    assert raised.value.reason == Reason.UNAUTHENTICATED


def test_permission_denied(cluster, stubs, served):
    request = pb.CreateTensorRequest(name="by-reader", metadata=served.metadata)
    err = rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT, metadata=bearer("reader"))
    assert_status(
        err, grpc.StatusCode.PERMISSION_DENIED, Reason.PERMISSION_DENIED, principal="reader"
    )
    with client_of(cluster, "reader") as reader, pytest.raises(PermissionDeniedError) as raised:
        reader.put("by-reader", SMALL)
    assert raised.value.reason == Reason.PERMISSION_DENIED
    assert raised.value.metadata["principal"] == "reader"


def test_quota_exceeded(cluster, stubs):
    big = torch.zeros(64, 32)  # 8 KiB, over the 4 KiB quota
    meta = ON_RANK_0.build_metadata(tuple(big.shape), TensorProperties(dtype=torch.float32))
    request = pb.CreateTensorRequest(name="over-quota", metadata=metadata_to_proto(meta))
    err = rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT, metadata=bearer("capped"))
    assert_status(
        err,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Reason.QUOTA_EXCEEDED,
        tensor="over-quota",
        principal="capped",
    )
    with client_of(cluster, "capped") as capped, pytest.raises(ResourceExhaustedError) as raised:
        capped.put("over-quota", big, spec=ON_RANK_0)
    assert raised.value.reason == Reason.QUOTA_EXCEEDED


def test_memory_limit(cluster, stubs):
    big = torch.zeros(1024, 1024)  # 4 MiB, over the rank's 2 MiB
    meta = ON_RANK_0.build_metadata(tuple(big.shape), TensorProperties(dtype=torch.float32))
    request = pb.CreateTensorRequest(name="over-memory", metadata=metadata_to_proto(meta))
    err = rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT)
    assert_status(
        err, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.MEMORY_LIMIT, tensor="over-memory", rank=0
    )
    with client_of(cluster, "admin") as admin, pytest.raises(ResourceExhaustedError) as raised:
        admin.put("over-memory", big, spec=ON_RANK_0)
    assert raised.value.reason == Reason.MEMORY_LIMIT


def test_request_too_large_over_the_ranks_limit(cluster, stubs):
    """A box over the rank's max_request_bytes, asked for directly and through the client."""
    wide = torch.randn(64, 32)  # 8 KiB, over the 4 KiB request limit
    meta = ON_RANK_0.build_metadata(tuple(wide.shape), TensorProperties(dtype=torch.float32))
    info = put(stubs, "wide", wide, meta)
    request = pb.ReadRegionRequest(
        name="wide", version=info.version, shard_index=0, offsets=[0, 0], sizes=[64, 32]
    )
    err = rpc_error(stubs.ranks[0].ReadRegion, request, timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.REQUEST_TOO_LARGE, tensor="wide")
    with client_of(cluster, "admin", transport="grpc") as admin:
        with pytest.raises(ResourceExhaustedError) as raised:
            admin.tensor("wide").full_tensor()
        assert raised.value.reason == Reason.REQUEST_TOO_LARGE
        assert torch.equal(admin.tensor("wide")[0:8], wide[0:8])  # a box under the limit is served


def refused_once_held(call: Callable[[], grpc.RpcError]) -> grpc.RpcError:
    """call()'s error, asked again while it succeeds (the held stream may not have reached the rank yet)."""
    return eventually(
        call, HELD_WITHIN_S, "the held stream to reach the rank", ignoring=(AssertionError,)
    )


def test_overloaded_by_one_principal(cluster, stubs, served):
    """A principal allowed one stream holds it with a stalled write: its next streaming call waits, then is
    refused; its unary calls and other principals' calls go on."""
    release = threading.Event()

    def stalled():  # a writer that sends nothing until released, then ends its stream empty
        release.wait(60)
        yield from ()

    held = stubs.ranks[0].WriteShard.future(stalled(), timeout=60, metadata=bearer("streamer"))
    try:
        request = pb.ReadRegionRequest(
            name="small", version=served.version, shard_index=0, offsets=[0, 0], sizes=[1, 1]
        )
        err = refused_once_held(
            lambda: rpc_error(
                stubs.ranks[0].ReadRegion, request, timeout=TIMEOUT, metadata=bearer("streamer")
            )
        )
        assert_status(err, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.OVERLOADED, peer="streamer")
        with client_of(cluster, "streamer", transport="grpc") as streamer:
            # the client reads a small tensor with unary calls, which no stream limit holds up
            assert torch.equal(streamer.tensor("small").full_tensor(), SMALL)
    finally:
        release.set()
    with pytest.raises(grpc.RpcError):
        held.result(timeout=TIMEOUT)  # a write stream without a header is refused once it ends


def test_path_unavailable(cluster, stubs):
    """A rank without a bulk port refuses a bulk session; the client reads over gRPC instead, and a client
    that insists on the bulk port gets an error."""
    err = rpc_error(stubs.ranks[0].OpenBulkSession, pb.BulkSessionRequest(), timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.UNIMPLEMENTED, Reason.PATH_UNAVAILABLE, rank=0)
    with client_of(cluster, "admin", transport="auto") as admin:
        assert torch.equal(admin.tensor("small").full_tensor(), SMALL)
    with client_of(cluster, "admin", transport="bulk") as admin:
        with pytest.raises(ShardServeError) as raised:
            admin.tensor("small").full_tensor()
        assert raised.value.reason == Reason.PATH_UNAVAILABLE
