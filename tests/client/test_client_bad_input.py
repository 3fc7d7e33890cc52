"""Bad input through the client against a real cluster (token, memory and request limits set).

Every case asserts the exception type (and the field its message names), and
the cluster keeps answering afterwards. Server answers are reached both through
the public API and by raw requests that skip the client's own checks.
"""

from __future__ import annotations

import pytest
import torch

from shardserve.client import (
    AuthenticationError,
    InvalidArgumentError,
    PreconditionError,
    RankUnavailableError,
    ResourceExhaustedError,
    ShardServeError,
    StaleVersionError,
    TensorNotFoundError,
    channel,
    connect,
)
from shardserve.client.paths.grpc import GrpcPath
from shardserve.client.paths.kinds import PathKind
from shardserve.client.paths.policy import PathPolicy
from shardserve.core.metadata import ShardMetadata, make_metadata
from shardserve.core.specs import ChunkShardingSpec, EnumerableShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.server.common.auth import Security
from shardserve.server.common.rank_options import RankOptions

pytestmark = pytest.mark.timeout(300)

TOKEN = "s3cret-token"
MEMORY_LIMIT = 32 << 20
MAX_REQUEST = 1 << 20


@pytest.fixture(scope="module")
def guarded(make_cluster):
    """A 2-rank cluster with a token, a per-rank memory limit and a request byte limit."""
    return make_cluster(
        ranks=2,
        security=Security(token=TOKEN),
        rank_options=RankOptions(memory_limit=MEMORY_LIMIT, max_request_bytes=MAX_REQUEST),
    )


@pytest.fixture(scope="module")
def cl(guarded):
    with connect(guarded.address, token=TOKEN, timeout=60) as c:
        c.put(
            "base",
            torch.arange(40.0).reshape(8, 5),
            ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]),
        )
        yield c


@pytest.fixture(autouse=True)
def cluster_still_answers(cl):
    """After every bad request the cluster still serves reads."""
    yield
    assert all(r.alive for r in cl.ranks())
    assert torch.equal(cl.tensor("base")[2:6], torch.arange(40.0).reshape(8, 5)[2:6])


def test_missing_or_wrong_token_is_authentication_error(guarded):
    with pytest.raises(AuthenticationError):
        connect(guarded.address, timeout=10)
    with pytest.raises(PermissionError):
        connect(guarded.address, token="wrong", timeout=10)


def test_rank_rejects_calls_without_token(cl):
    address = cl.ranks()[0].address
    stub = channel.Channel(channel.Credentials(), timeout=10)
    try:
        with pytest.raises(AuthenticationError):
            GrpcPath(stub).read_stream(
                address,
                pb.ReadRegionRequest(
                    name="base",
                    version=cl.tensor("base").version,
                    shard_index=0,
                    offsets=[0, 0],
                    sizes=[1, 1],
                ),
                torch.empty(4, dtype=torch.uint8),
            )
    finally:
        stub.close()


def test_unknown_tensor_is_key_error(cl):
    with pytest.raises(TensorNotFoundError, match="nope"):
        cl.tensor("nope")
    with pytest.raises(KeyError):
        cl.delete("nope")
    with pytest.raises(KeyError):
        cl["nope"]


@pytest.mark.parametrize(
    "offsets, sizes, field",
    [
        ((0, 0), (9, 5), "sizes"),
        ((8, 0), (1, 1), "offsets"),
        ((-1, 0), (1, 1), "offsets"),
        ((0, 0), (1, -1), "sizes"),
        ((0,), (1,), "dims"),
        ((0, 0, 0), (1, 1, 1), "dims"),
        ((0, 0.5), (1, 1), "offsets"),
        ((0, 0), (1,), "offsets"),
    ],
)
def test_bad_boxes_are_value_errors_naming_the_field(cl, offsets, sizes, field):
    with pytest.raises(InvalidArgumentError, match=field):
        cl.tensor("base").fetch(offsets, sizes)


@pytest.mark.parametrize(
    "index, exc, message",
    [
        (slice(0, 8, 2), ValueError, "step 2"),
        (None, ValueError, "got NoneType"),
        ([0, 1], ValueError, "got list"),
        ((0, 0, 0), IndexError, "too many indices: 3"),
        (8, IndexError, "index 8 is out of range for dim 0"),
        (-9, IndexError, "index -9 is out of range for dim 0"),
        ((0, 5), IndexError, "index 5 is out of range for dim 1"),
        (torch.tensor([1]), ValueError, "got Tensor"),
    ],
)
def test_bad_indices(cl, index, exc, message):
    with pytest.raises(exc, match=message):
        cl.tensor("base")[index]


def test_bad_out_buffers(cl):
    remote = cl.tensor("base")
    with pytest.raises(InvalidArgumentError, match="shape"):
        remote.fetch((0, 0), (2, 2), out=torch.empty(2, 3))
    with pytest.raises(
        InvalidArgumentError, match="dtype"
    ):  # floating into an integer out: no cast
        remote.fetch((0, 0), (2, 2), out=torch.empty(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="out"):
        remote.fetch((0, 0), (2, 2), out=[[0, 0], [0, 0]])
    with torch.inference_mode():
        made_in_inference = torch.empty(2, 2)
    for out, message in (
        (torch.empty(2, 2, device="meta"), "meta device"),
        (torch.empty(1, 2).expand(2, 2), "share memory"),
        (torch.empty(2, 2, requires_grad=True), "requires grad"),
        (torch.empty(2, 2).to_sparse(), "layout"),
        (made_in_inference, "inference mode"),
    ):
        with pytest.raises(InvalidArgumentError, match=f"out .*{message}"):
            remote.fetch((0, 0), (2, 2), out=out)


def test_a_strided_out_whose_parts_are_single_elements(cl):
    """A one-element region counts as contiguous whatever its strides: its bytes land through a restrided view."""
    remote = cl.put(
        "one-element-parts", torch.arange(4.0), ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    )
    out = torch.full((4,), -1.0)
    got = remote.fetch([1], [2], out=out[::2])  # element 1 on rank 0, element 2 on rank 1
    assert torch.equal(got, torch.tensor([1.0, 2.0])) and out.tolist() == [1.0, -1.0, 2.0, -1.0]
    cl.delete("one-element-parts")


def test_bad_puts_are_refused_before_sending(cl):
    with pytest.raises(TypeError, match="tensor"):
        cl.put("x", [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="layout"):
        cl.put("x", torch.eye(3).to_sparse())
    with pytest.raises(InvalidArgumentError, match="dtype"):
        cl.put("x", torch.zeros(4, dtype=torch.uint16))
    with pytest.raises(InvalidArgumentError, match="name"):
        cl.put("", torch.zeros(4))
    with pytest.raises(TypeError, match="spec"):
        cl.put("x", torch.zeros(4), spec="row-wise")
    with pytest.raises(InvalidArgumentError, match="dim"):
        cl.put("x", torch.zeros(4, 4), spec=ChunkShardingSpec(2, ["rank:0/cpu"]))
    gap = EnumerableShardingSpec([ShardMetadata((0, 0), (2, 4), "rank:0/cpu")])
    with pytest.raises(InvalidArgumentError, match="spec"):
        cl.put("x", torch.zeros(4, 4), spec=gap)
    with pytest.raises(InvalidArgumentError, match="size"):
        cl.put("x", torch.zeros(4, 4), spec=make_metadata((4, 5), [((0, 0), (4, 5), 0)]))
    assert "x" not in [t.name for t in cl.list(include_pending=True)]


def test_placement_on_unknown_rank_is_refused_by_the_coordinator(cl):
    with pytest.raises(InvalidArgumentError, match="rank"):
        cl.put("x", torch.zeros(4, 4), spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:7/cpu"]))
    assert "x" not in [t.name for t in cl.list(include_pending=True)]


def test_bad_create_arguments(cl):
    with pytest.raises(InvalidArgumentError, match="init"):
        cl.create("x", (4,), init="random")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        cl.create("x", (4,), dtype="float8")
    with pytest.raises(InvalidArgumentError, match=r"shape \(4, -1\) has a negative size"):
        cl.create("x", (4, -1))
    with pytest.raises(InvalidArgumentError, match="shape must be a sequence of ints"):
        cl.create("x", (4.5, 8))
    with pytest.raises(InvalidArgumentError, match="seed"):
        cl.create("x", (4,), seed="0")
    with pytest.raises(InvalidArgumentError, match="seed must be a 64-bit int"):
        cl.create("x", (4,), seed=2**70)


def test_put_over_memory_limit_is_resource_exhausted_and_invisible(cl):
    with pytest.raises(ResourceExhaustedError, match="memory limit: 33554464 bytes requested"):
        cl.put("huge", torch.zeros(2 * MEMORY_LIMIT // 4 + 16, dtype=torch.float32))
    assert "huge" not in [t.name for t in cl.list(include_pending=True)]


def test_read_over_request_limit_is_resource_exhausted(cl):
    source = torch.arange(1 << 20, dtype=torch.float32).reshape(
        1024, 1024
    )  # 4 MiB, 2 MiB per shard
    remote = cl.put("wide", source)
    assert torch.equal(remote[100:200], source[100:200])
    with pytest.raises(ResourceExhaustedError):
        remote.full_tensor()
    cl.delete("wide")


def test_put_failing_half_way_leaves_nothing_visible(cl, monkeypatch):
    first = torch.arange(8.0)
    cl.put("half", first, ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
    real_write = PathPolicy.write

    def write_then_fail(self, rank, writes):
        if any(write.header.shard_index == 1 for write in writes):
            raise RankUnavailableError("rank went away mid-put (injected)")
        return real_write(self, rank, writes)

    monkeypatch.setattr(PathPolicy, "write", write_then_fail)
    with pytest.raises(RankUnavailableError, match="injected"):
        cl.put("half", -first, ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]), overwrite=True)
    with pytest.raises(RankUnavailableError):
        cl.put("half-new", torch.ones(8), ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
    monkeypatch.setattr(PathPolicy, "write", real_write)
    names = [(t.name, t.state) for t in cl.list(include_pending=True)]
    assert ("half", "READY") in names and all(n != "half-new" for n, _ in names)
    assert [n for n, _ in names].count("half") == 1
    assert torch.equal(cl.tensor("half").full_tensor(), first)
    cl.delete("half")


def test_raw_requests_get_the_server_answers(cl):
    """Requests that skip the client's checks: the server's status codes become the client's exceptions."""
    remote = cl.tensor("base")
    shard = remote.remote_shards()[1][0]
    address = cl.session.address_of(1)

    def read(**fields):
        request = dict(
            name="base",
            version=remote.version,
            shard_index=shard.index,
            offsets=[4, 0],
            sizes=[1, 5],
        )
        request.update(fields)
        cl.session.paths.path(PathKind.GRPC).read_stream(
            address, pb.ReadRegionRequest(**request), torch.empty(20, dtype=torch.uint8)
        )

    read()
    with pytest.raises(TensorNotFoundError):
        read(name="nope")
    with pytest.raises(StaleVersionError):
        read(version=remote.version + 1000)
    with pytest.raises(InvalidArgumentError, match="shard_index"):
        read(shard_index=9)
    with pytest.raises(InvalidArgumentError, match="offsets"):
        read(offsets=[0, 0])  # row 0 lives on rank 0, not inside this shard
    with pytest.raises(InvalidArgumentError, match="sizes"):
        read(sizes=[1, -5])
    with pytest.raises(InvalidArgumentError, match="offsets has 1 dims but the tensor has 2"):
        read(offsets=[4], sizes=[1])
    with pytest.raises(ShardServeError, match="of a 20-byte region"):
        read(sizes=[2, 5])  # more bytes than the client's buffer: refused as the first chunk lands


def test_raw_writes_with_wrong_headers_are_refused(cl):
    address = cl.session.address_of(0)
    committed = cl.tensor("base").version
    header = pb.WriteShardHeader(
        name="base", version=committed, shard_index=0, dtype=pb.FLOAT32, nbytes=80
    )
    with pytest.raises(PreconditionError) as refused:  # a committed version never changes
        cl.session.channel.write_shard(address, header, memoryview(bytes(80)))
    assert refused.value.reason == Reason.INVALID_STATE
    meta = make_metadata((4, 5), [((0, 0), (4, 5), 0)])
    pending = cl.session.call(
        "CreateTensor", pb.CreateTensorRequest(name="raw", metadata=metadata_to_proto(meta))
    )
    try:
        for fields, field in [
            ({"dtype": pb.FLOAT64}, "dtype"),
            ({"nbytes": 79}, "nbytes"),
            ({"shard_index": 3}, "shard_index"),
        ]:
            header = pb.WriteShardHeader(
                **{
                    "name": "raw",
                    "version": pending.version,
                    "shard_index": 0,
                    "dtype": pb.FLOAT32,
                    "nbytes": 80,
                    **fields,
                }
            )
            with pytest.raises(InvalidArgumentError, match=field):
                cl.session.channel.write_shard(address, header, memoryview(bytes(header.nbytes)))
        with pytest.raises(PreconditionError) as refused:  # nothing written: the commit is refused
            cl.session.call(
                "CommitTensor", pb.CommitTensorRequest(name="raw", version=pending.version)
            )
        assert refused.value.reason == Reason.WRITE_INCOMPLETE
    finally:
        cl.session.abort("raw", pending.version)
    assert "raw" not in [t.name for t in cl.list(include_pending=True)]


def test_every_call_of_a_closed_client_says_so(guarded, tmp_path):
    """Mapped lookups went on working after close(), and other calls failed with grpc's raw 'closed channel' or
    the pool's 'cannot schedule new futures'."""
    c = connect(guarded.address, token=TOKEN, timeout=60)
    remote = c.put(
        "closed-table", torch.randn(6, 4), ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
    )
    remote.lookup([1, 5])
    remote.full_tensor()
    c.delete("closed-table")
    c.close()
    for call in (
        lambda: remote.lookup([1]),
        lambda: remote.lookup_bag([1, 2], [0]),
        remote.full_tensor,
        lambda: remote.fetch((0, 0), (1, 1)),
        lambda: c.put("x", torch.ones(2)),
        c.list,
        lambda: c.tensor("base"),
        lambda: c.save_checkpoint(tmp_path / "ck"),
        lambda: remote.reshard(ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"])),
    ):
        with pytest.raises(ShardServeError, match="the client is closed"):
            call()
