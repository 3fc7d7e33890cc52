"""Every RPC answers malformed and hostile requests with the right status code naming the field, and keeps serving."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from server_helpers import TIMEOUT, Stubs, put, read_full, rpc_error, write_requests

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT
META = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]).build_metadata(
    (9, 5), TensorProperties(dtype=torch.float32)
)
TENSOR = torch.arange(45, dtype=torch.float32).view(9, 5)


@pytest.fixture(scope="module")
def stubs(cluster3):
    s = Stubs(
        cluster3.address, default_metadata=cluster3.cluster_metadata
    )  # control RPCs need the credential
    yield s
    s.close()


@pytest.fixture(scope="module")
def served(stubs):
    return put(stubs, "good", TENSOR, META)


@pytest.fixture(autouse=True)
def still_serving(stubs, served):
    """After every bad request, both the coordinator and every rank still answer a good one."""
    yield
    info = stubs.coord.GetTensor(pb.GetTensorRequest(name="good"), timeout=TIMEOUT)
    assert torch.equal(read_full(stubs, info), TENSOR)


def read(stubs, served, **fields):
    request = dict(name="good", version=served.version, shard_index=0, offsets=[0, 0], sizes=[1, 1])
    request.update(fields)
    return rpc_error(stubs.ranks[0].ReadRegion, pb.ReadRegionRequest(**request), timeout=TIMEOUT)


@pytest.mark.parametrize(
    "fields,code,needle",
    [
        (dict(name="nope"), grpc.StatusCode.NOT_FOUND, "'nope' not found on rank 0"),
        (dict(name=""), INVALID, "name is empty"),
        (dict(name="x" * 1025), INVALID, "name is 1025 bytes of UTF-8; the limit is 1024"),
        (dict(name="é" * 513), INVALID, "name is 1026 bytes of UTF-8"),
        (dict(shard_index=7), INVALID, "shard_index 7 is out of range"),
        (dict(shard_index=-1), INVALID, "shard_index -1"),
        (dict(shard_index=1), INVALID, "shard_index 1 of tensor 'good' is not held by rank 0"),
        (dict(offsets=[-1, 0]), INVALID, "offsets[0]=-1 is negative"),
        (dict(sizes=[1, -2]), INVALID, "sizes[1]=-2 is negative"),
        (dict(offsets=[0]), INVALID, "offsets has 1 dims"),
        (dict(sizes=[1, 1, 1]), INVALID, "sizes has 3 dims"),
        (dict(offsets=[2, 0], sizes=[2, 5]), INVALID, "offsets/sizes"),  # shard 0 holds rows 0..2
        (dict(offsets=[0, 0], sizes=[1, 6]), INVALID, "offsets/sizes"),
        (dict(offsets=[2**62, 0], sizes=[2**62, 1]), INVALID, "offsets/sizes"),
        (dict(chunk_bytes=-5), INVALID, "chunk_bytes -5 is negative"),
        (
            dict(version=10**9),
            grpc.StatusCode.FAILED_PRECONDITION,
            "version 1000000000 is not held",
        ),
    ],
)
def test_read_region_bad_input(stubs, served, fields, code, needle):
    err = read(stubs, served, **fields)
    assert err.code() == code
    assert needle in err.details()


def write(stubs, messages, rank=0):
    return rpc_error(stubs.ranks[rank].WriteShard, iter(messages), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def pending(stubs):
    return stubs.coord.CreateTensor(
        pb.CreateTensorRequest(name="pend", metadata=metadata_to_proto(META)), timeout=TIMEOUT
    )


def header(version, **fields):
    values = dict(name="pend", version=version, shard_index=0, dtype=pb.FLOAT32, nbytes=3 * 5 * 4)
    values.update(fields)
    return pb.WriteShardRequest(header=pb.WriteShardHeader(**values))


def chunk(offset, data):
    return pb.WriteShardRequest(chunk=pb.TensorChunk(offset=offset, data=data))


@pytest.mark.parametrize(
    "case,code,needle",
    [
        ("no messages", INVALID, "header"),
        ("chunk first", INVALID, "first WriteShard message must carry the header"),
        ("wrong dtype", INVALID, "header.dtype float16 does not match"),
        ("unknown dtype", INVALID, "header.dtype"),
        ("wrong nbytes", INVALID, "header.nbytes 59"),
        ("past the end", INVALID, "past the end of the shard (60 bytes)"),
        ("out of order", INVALID, "chunk.offset 8 is not where the stream is"),
        ("second header", INVALID, "only the first WriteShard message may carry a header"),
        ("empty message", INVALID, "neither header nor chunk"),
        ("short stream", INVALID, "ended after 4 of 60 bytes"),
        ("unknown name", grpc.StatusCode.NOT_FOUND, "'ghost' not found on rank 0"),
        ("served version", grpc.StatusCode.FAILED_PRECONDITION, "already committed"),
        ("not local", INVALID, "shard_index 2 of tensor 'pend' is not held by rank 0"),
    ],
)
def test_write_shard_bad_input(stubs, pending, served, case, code, needle):
    v = pending.version
    messages = {
        "no messages": [],
        "chunk first": [chunk(0, b"1234")],
        "wrong dtype": [header(v, dtype=pb.FLOAT16)],
        "unknown dtype": [header(v, dtype=99)],
        "wrong nbytes": [header(v, nbytes=59)],
        "past the end": [header(v), chunk(0, b"x" * 56), chunk(56, b"x" * 8)],
        "out of order": [header(v), chunk(8, b"x" * 4)],
        "second header": [header(v), chunk(0, b"x" * 4), header(v)],
        "empty message": [header(v), pb.WriteShardRequest()],
        "short stream": [header(v), chunk(0, b"x" * 4)],
        "unknown name": [header(v, name="ghost")],
        "served version": [header(served.version, name="good")],
        "not local": [header(v, shard_index=2)],
    }[case]
    err = write(stubs, messages)
    assert err.code() == code
    assert needle in err.details()


def create_error(stubs, meta=None, **fields):
    request = pb.CreateTensorRequest(
        name=fields.pop("name", "bad"),
        metadata=meta if meta is not None else metadata_to_proto(META),
        **fields,
    )
    return rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT)


def meta_with(shards, size=(9, 5), dtype=torch.float32):
    return metadata_to_proto(
        ShardedTensorMetadata(tuple(shards), size, TensorProperties(dtype=dtype))
    )


@pytest.mark.parametrize(
    "build,code,needle",
    [
        (lambda: dict(name=""), INVALID, "name is empty"),
        (lambda: dict(name="bad\x00name"), INVALID, "non-printable"),
        (lambda: dict(name="good"), grpc.StatusCode.ALREADY_EXISTS, "already exists"),
        (lambda: dict(meta=meta_with([])), INVALID, "shards_metadata is empty"),
        (
            lambda: dict(meta=meta_with([ShardMetadata((0, 0), (9, 5), "rank:7/cpu")])),
            INVALID,
            "rank 7 is not a registered rank",
        ),
        (
            lambda: dict(meta=meta_with([ShardMetadata((0, 0), (9, 5), "rank:1/cuda:0")])),
            INVALID,
            "rank 1's device is cpu",
        ),
        (
            lambda: dict(
                meta=meta_with(
                    [
                        ShardMetadata((0, 0), (5, 5), "rank:0/cpu"),
                        ShardMetadata((4, 0), (5, 5), "rank:1/cpu"),
                    ]
                )
            ),
            INVALID,
            "metadata:",
        ),
        (
            lambda: dict(meta=meta_with([ShardMetadata((0, 0), (5, 5), "rank:0/cpu")])),
            INVALID,
            "metadata:",
        ),
        (
            lambda: dict(meta=meta_with([ShardMetadata((0, 0), (9, 6), "rank:0/cpu")])),
            INVALID,
            "metadata:",
        ),
        (
            lambda: dict(
                meta=meta_with([ShardMetadata((0, 0), (9, 5), "rank:0/cpu")], dtype=torch.int64),
                init=pb.INIT_NORMAL,
            ),
            INVALID,
            "INIT_NORMAL needs a floating",
        ),
        (lambda: dict(init=42), INVALID, "init 42"),
        (
            lambda: dict(
                meta=pb.ShardedTensorMetadata(
                    shards_metadata=[
                        pb.ShardMetadata(
                            shard_offsets=[0, 0], shard_sizes=[9, 5], placement="rank:0/cpu"
                        )
                    ],
                    size=[9, 5],
                )
            ),
            INVALID,
            "tensor_properties.dtype",
        ),
        (
            lambda: dict(
                meta=pb.ShardedTensorMetadata(
                    shards_metadata=[
                        pb.ShardMetadata(
                            shard_offsets=[0, 0], shard_sizes=[9, 5], placement="node7"
                        )
                    ],
                    size=[9, 5],
                    tensor_properties=pb.TensorProperties(dtype=pb.FLOAT32),
                )
            ),
            INVALID,
            "placement",
        ),
        (
            lambda: dict(options=pb.TensorOptions(oov=pb.OOV_DEFAULT, default_row=b"123")),
            INVALID,
            "options.default_row has 3 bytes",
        ),
    ],
)
def test_create_tensor_bad_input(stubs, build, code, needle):
    err = create_error(stubs, **build())
    assert err.code() == code
    assert needle in err.details()


@pytest.mark.parametrize(
    "call,request_,code,needle",
    [
        (
            "GetTensor",
            pb.GetTensorRequest(name="nope"),
            grpc.StatusCode.NOT_FOUND,
            "'nope' not found",
        ),
        (
            "DeleteTensor",
            pb.DeleteTensorRequest(name="nope"),
            grpc.StatusCode.NOT_FOUND,
            "'nope' not found",
        ),
        (
            "CommitTensor",
            pb.CommitTensorRequest(name="good", version=0),
            INVALID,
            "version must be > 0",
        ),
        (
            "CommitTensor",
            pb.CommitTensorRequest(name="nope", version=3),
            grpc.StatusCode.NOT_FOUND,
            "version 3",
        ),
        (
            "AbortTensor",
            pb.AbortTensorRequest(name="nope", version=3),
            grpc.StatusCode.NOT_FOUND,
            "version 3",
        ),
        (
            "AbortTensor",
            pb.AbortTensorRequest(name="nope", version=3, put_token="t"),
            INVALID,
            "either version or put_token",
        ),
        (
            "AbortTensor",
            pb.AbortTensorRequest(name="nope", put_token="x" * 200),
            INVALID,
            "put_token is 200",
        ),
        ("AbortTensor", pb.AbortTensorRequest(name="nope"), INVALID, "version must be > 0"),
        (
            "CommitTensor",
            pb.CommitTensorRequest(name="good", version=2**63),
            INVALID,
            "version 9223372036854775808 is out",
        ),
        (
            "InspectCheckpoint",
            pb.InspectCheckpointRequest(path="/" + "a" * 20000),
            INVALID,
            "path is 20001 bytes long; the limit is 4096",
        ),
        (
            "SaveCheckpoint",
            pb.SaveCheckpointRequest(path="/tmp/a\x00b", names=["good"]),
            INVALID,
            "holds a NUL",
        ),
        (
            "CreateTensor",
            pb.CreateTensorRequest(
                name="x",
                metadata=pb.ShardedTensorMetadata(
                    size=[4],
                    tensor_properties=pb.TensorProperties(dtype=pb.FLOAT32),
                    shards_metadata=[
                        pb.ShardMetadata(
                            shard_offsets=[0], shard_sizes=[4], placement="rank:0/" + "x" * 100000
                        )
                    ],
                ),
            ),
            INVALID,
            "more characters)",
        ),  # quoted in full, the placement would make a status header over gRPC's 16 KiB
        (
            "AbortTensor",
            pb.AbortTensorRequest(name="good", version=2**64 - 1),
            INVALID,
            "(versions are below 2**63)",
        ),
        (
            "Heartbeat",
            pb.HeartbeatRequest(rank=99),
            grpc.StatusCode.NOT_FOUND,
            "rank 99 is not registered",
        ),
        ("ReportRestore", pb.RestoreProgress(rank=-1), INVALID, "rank must be >= 0"),
        (
            "ReportRestore",
            pb.RestoreProgress(rank=1, done_bytes=5, total_bytes=4),
            INVALID,
            "done_bytes must be between 0 and total_bytes (4), got 5",
        ),
        (
            "ReportRestore",
            pb.RestoreProgress(rank=1, done_tensors=-1),
            INVALID,
            "done_tensors must be between 0",
        ),
        (
            "RegisterRank",
            pb.RegisterRankRequest(
                rank=pb.RankInfo(rank=-1, world_size=3, address="h:1", device="cpu")
            ),
            INVALID,
            "rank.rank -1",
        ),
        (
            "RegisterRank",
            pb.RegisterRankRequest(
                rank=pb.RankInfo(rank=5, world_size=3, address="h:1", device="cpu")
            ),
            INVALID,
            "rank.world_size",
        ),
        (
            "RegisterRank",
            pb.RegisterRankRequest(
                rank=pb.RankInfo(rank=1, world_size=3, address="", device="cpu")
            ),
            INVALID,
            "rank.address",
        ),
        (
            "RegisterRank",
            pb.RegisterRankRequest(
                rank=pb.RankInfo(rank=1, world_size=3, address="h:1", device="tpu")
            ),
            INVALID,
            "rank.device",
        ),
        (
            "RegisterRank",
            pb.RegisterRankRequest(  # version 0 would have the reconcile drop every version of "good"
                rank=pb.RankInfo(rank=1, world_size=3, address="h:1", device="cpu"),
                held=[pb.HeldVersion(name="good", version=0)],
            ),
            INVALID,
            "held[0].version must be > 0",
        ),
    ],
)
def test_coordinator_bad_input(stubs, call, request_, code, needle):
    err = rpc_error(getattr(stubs.coord, call), request_, timeout=TIMEOUT)
    assert err.code() == code
    assert needle in err.details()


def test_a_tensor_larger_than_the_host_is_refused(stubs):
    huge = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]).build_metadata(
        (2**40, 2**20), TensorProperties(dtype=torch.float32)
    )
    err = create_error(stubs, metadata_to_proto(huge), name="huge", init=pb.INIT_ZEROS)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "bytes requested" in err.details()
    listed = stubs.coord.ListTensors(
        pb.ListTensorsRequest(include_pending=True), timeout=TIMEOUT
    ).tensors
    assert "huge" not in [t.name for t in listed]


@pytest.mark.parametrize(
    "metadata,needle",
    [
        (
            pb.ShardedTensorMetadata(
                size=[2] * 20000,
                tensor_properties=pb.TensorProperties(dtype=pb.FLOAT32),
                shards_metadata=[
                    pb.ShardMetadata(
                        shard_offsets=[0] * 20000, shard_sizes=[1] * 20000, placement="rank:0/cpu"
                    )
                ],
            ),
            "metadata.size has 20000 dims; the limit is 64",
        ),
        (
            pb.ShardedTensorMetadata(
                size=[2**62, 2**62],
                tensor_properties=pb.TensorProperties(dtype=pb.FLOAT32),
                shards_metadata=[
                    pb.ShardMetadata(
                        shard_offsets=[0, 0], shard_sizes=[2**62, 2**62], placement="rank:0/cpu"
                    )
                ],
            ),
            "is 2**63 bytes or more",
        ),
        (
            pb.ShardedTensorMetadata(
                size=[70000],
                tensor_properties=pb.TensorProperties(dtype=pb.FLOAT32),
                shards_metadata=[
                    pb.ShardMetadata(shard_offsets=[i], shard_sizes=[1], placement="rank:0/cpu")
                    for i in range(70000)
                ],
            ),
            "metadata.shards_metadata has 70000 shards; the limit is 65536",
        ),
    ],
)
def test_layouts_too_big_to_check_are_refused_at_once(stubs, metadata, needle):
    """Refused before validation, whose cost grows with dims x shards (20000 dims took minutes)."""
    start = time.monotonic()
    err = create_error(stubs, metadata, name="big")
    assert err.code() == INVALID and needle in err.details() and time.monotonic() - start < 10


def test_request_bytes_that_do_not_decode_are_invalid_argument(stubs, pending):
    """grpcio would answer INTERNAL "Exception deserializing request!" (and log a traceback): the server answers
    INVALID_ARGUMENT naming the message type, for unary and streamed requests."""
    coordinator = stubs.coordinator_channel.unary_unary("/shardserve.v1.Coordinator/GetTensor")
    rank = stubs.rank_channels[0].unary_unary("/shardserve.v1.ShardServer/LookupSmall")
    for call, data, expected in (
        (coordinator, b"\x0a\x02\xff\xfe", "shardserve.v1.GetTensorRequest"),
        (rank, b"\x0f", "shardserve.v1.LookupRequest"),
    ):
        err = rpc_error(call, data, timeout=TIMEOUT)
        assert err.code() == INVALID and f"request: not a serialized {expected}" in err.details()
    good = next(write_requests("pend", pending.version, 0, TENSOR[:3]))
    write = stubs.rank_channels[0].stream_unary("/shardserve.v1.ShardServer/WriteShard")
    err = rpc_error(write, iter([good.SerializeToString(), b"\xff\xff"]), timeout=TIMEOUT)
    assert (
        err.code() == INVALID
        and "request: not a serialized request of /shardserve.v1.ShardServer/WriteShard"
        in err.details()
    )


def test_a_refused_write_rows_leaves_the_copy_committable(stubs):
    """WriteRows refused for its values (before any byte changed) must not mark the shard half written, or the
    update's version could never be committed."""
    table = put(stubs, "rows", TENSOR, META)
    copy = stubs.coord.CreateTensor(
        pb.CreateTensorRequest(
            name="rows",
            metadata=table.metadata,
            init=pb.INIT_COPY,
            overwrite=True,
            source_version=table.version,
        ),
        timeout=TIMEOUT,
    )
    ids = torch.tensor([1], dtype=torch.int64).numpy().tobytes()
    err = rpc_error(
        stubs.ranks[0].WriteRows,
        pb.WriteRowsRequest(
            name="rows", version=copy.version, shard_index=0, ids=ids, values=b"\0" * 15
        ),
        timeout=TIMEOUT,
    )
    assert err.code() == INVALID and "values" in err.details()
    stubs.ranks[0].WriteRows(
        pb.WriteRowsRequest(
            name="rows",
            version=copy.version,
            shard_index=0,
            ids=ids,
            values=torch.full((5,), 7.0).numpy().tobytes(),
        ),
        timeout=TIMEOUT,
    )
    committed = stubs.coord.CommitTensor(
        pb.CommitTensorRequest(name="rows", version=copy.version), timeout=TIMEOUT
    )
    expected = TENSOR.clone()
    expected[1] = 7.0
    assert torch.equal(read_full(stubs, committed), expected)
    stubs.coord.DeleteTensor(pb.DeleteTensorRequest(name="rows"), timeout=TIMEOUT)


def test_a_registration_must_fit_the_world(stubs, served):
    """A stray RegisterRank (another live rank's address, another world size) is refused before it replaces a
    rank's entry, whose reconcile would then drop versions on the rank at that address."""
    ranks = {r.rank: r for r in stubs.coord.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks}
    err = rpc_error(
        stubs.coord.RegisterRank,
        pb.RegisterRankRequest(
            rank=pb.RankInfo(rank=2, world_size=3, address=ranks[0].address, device="cpu"),
            held=[pb.HeldVersion(name="good", version=served.version)],
        ),
        timeout=TIMEOUT,
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"rank.address {ranks[0].address} is registered by rank 0" in err.details()
    err = rpc_error(
        stubs.coord.RegisterRank,
        pb.RegisterRankRequest(
            rank=pb.RankInfo(rank=1, world_size=3, address="127.0.0.1:1", device="cpu")
        ),
        timeout=TIMEOUT,
    )
    assert (
        err.code() == grpc.StatusCode.UNAVAILABLE
    )  # a live rank 1 is not taken over from another address
    assert f"rank 1 is registered at {ranks[1].address} and alive" in err.details()
    err = rpc_error(
        stubs.coord.RegisterRank,
        pb.RegisterRankRequest(
            rank=pb.RankInfo(rank=5, world_size=10, address="127.0.0.1:1", device="cpu")
        ),
        timeout=TIMEOUT,
    )
    assert (
        err.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "rank.world_size 10 differs" in err.details()
    )
    err = rpc_error(
        stubs.coord.Heartbeat, pb.HeartbeatRequest(rank=0, memory_used_bytes=-5), timeout=TIMEOUT
    )
    assert err.code() == INVALID and "memory_used_bytes must be >= 0" in err.details()
    after = {
        r.rank: r.address
        for r in stubs.coord.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks
    }
    assert after == {r: info.address for r, info in ranks.items()}
    assert torch.equal(read_full(stubs, served), TENSOR)  # nothing was dropped on rank 0


def test_abort_of_a_committed_version_is_refused(stubs, served):
    err = rpc_error(
        stubs.coord.AbortTensor,
        pb.AbortTensorRequest(name="good", version=served.version),
        timeout=TIMEOUT,
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "use DeleteTensor" in err.details()


@pytest.mark.parametrize(
    "rpc,request_,needle",
    [
        ("AllocateShards", pb.AllocateShardsRequest(name="a", version=0), "version must be > 0"),
        ("AllocateShards", pb.AllocateShardsRequest(name="a", version=1), "metadata:"),
        (
            "AllocateShards",
            pb.AllocateShardsRequest(
                name="a",
                version=1,
                metadata=metadata_to_proto(META),
                options=pb.TensorOptions(oov=9),
            ),
            "options.oov 9 is not a known",
        ),
        ("PromoteVersion", pb.PromoteVersionRequest(name="", version=1), "name is empty"),
        (
            "AllocateMany",
            pb.AllocateManyRequest(
                tensors=[
                    pb.AllocateShardsRequest(name="m", version=1, metadata=metadata_to_proto(META)),
                    pb.AllocateShardsRequest(name="a", version=0),
                ]
            ),
            "tensors[1].version must be > 0",
        ),
        (
            "AllocateMany",
            pb.AllocateManyRequest(tensors=[pb.AllocateShardsRequest(name="a", version=1)]),
            "tensors[0].metadata",
        ),
        (
            "AllocateMany",
            pb.AllocateManyRequest(
                tensors=[
                    pb.AllocateShardsRequest(
                        name="a",
                        version=1,
                        metadata=metadata_to_proto(META),
                        options=pb.TensorOptions(oov=9),
                    )
                ]
            ),
            "tensors[0].options.oov 9",
        ),
        (
            "PromoteMany",
            pb.PromoteManyRequest(versions=[pb.PromoteVersionRequest(name="", version=1)]),
            "versions[0].name is empty",
        ),
        (
            "DropMany",
            pb.DropManyRequest(
                versions=[
                    pb.DropVersionRequest(name="ok", version=1),
                    pb.DropVersionRequest(name=""),
                ]
            ),
            "versions[1].name is empty",
        ),
        ("DropVersion", pb.DropVersionRequest(name=""), "name is empty"),
        (
            "OpenShard",
            pb.OpenShardRequest(name="good", version=1, lease_s=float("nan")),
            "lease_s nan",
        ),
        ("OpenShard", pb.OpenShardRequest(name="good", version=1, lease_s=-1), "lease_s -1"),
        (
            "OpenShards",
            pb.OpenShardsRequest(shards=[pb.OpenShardRequest(name="good", version=1, lease_s=-1)]),
            "shards[0]: lease_s -1",
        ),
        (
            "OpenShards",
            pb.OpenShardsRequest(shards=[pb.OpenShardRequest(name="", version=1)]),
            "shards[0]: name is empty",
        ),
        (
            "RunCollective",
            pb.CollectiveJob(seq=5, ranks=[1], timeout_s=float("inf"), reshard=pb.ReshardJob()),
            "timeout_s must be a finite number > 0",
        ),
        (
            "RunCollective",
            pb.CollectiveJob(seq=5, ranks=[1], timeout_s=float("nan"), reshard=pb.ReshardJob()),
            "timeout_s must be a finite number > 0",
        ),
    ],
)
def test_rank_control_bad_input(stubs, rpc, request_, needle):
    err = rpc_error(getattr(stubs.ranks[1], rpc), request_, timeout=TIMEOUT)
    assert err.code() == INVALID and needle in err.details()


def test_allocating_a_held_version_twice_is_refused(stubs, served):
    request = pb.AllocateShardsRequest(
        name="good", version=served.version, metadata=metadata_to_proto(META)
    )
    err = rpc_error(stubs.ranks[0].AllocateShards, request, timeout=TIMEOUT)
    assert (
        err.code() == grpc.StatusCode.FAILED_PRECONDITION and "already allocated" in err.details()
    )


def test_allocate_many_is_all_or_none_on_the_rank(stubs, served):
    """The second allocation of the batch is refused (already held): the first, made before it, is dropped."""
    fresh = pb.AllocateShardsRequest(
        name="batch-new", version=served.version + 1000, metadata=metadata_to_proto(META)
    )
    held = pb.AllocateShardsRequest(
        name="good", version=served.version, metadata=metadata_to_proto(META)
    )
    err = rpc_error(
        stubs.ranks[0].AllocateMany, pb.AllocateManyRequest(tensors=[fresh, held]), timeout=TIMEOUT
    )
    assert (
        err.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "tensors[1] ('good' version " in err.details()
    )
    stats = stubs.ranks[0].GetStats(pb.GetStatsRequest(), timeout=TIMEOUT, metadata=stubs.metadata)
    assert ("batch-new", fresh.version) not in {(h.name, h.version) for h in stats.held}
    err = rpc_error(
        stubs.ranks[0].PromoteMany,
        pb.PromoteManyRequest(
            versions=[pb.PromoteVersionRequest(name="batch-new", version=fresh.version)]
        ),
        timeout=TIMEOUT,
    )
    assert (
        err.code() == grpc.StatusCode.NOT_FOUND
        and "versions[0]: tensor 'batch-new' not found" in err.details()
    )
    assert torch.equal(read_full(stubs, served), TENSOR)


def test_write_requests_helper_round_trips(stubs, pending):
    """Control for the write cases above: the same stream shape, done right, is accepted."""
    part = TENSOR[0:3]
    reply = stubs.ranks[0].WriteShard(
        write_requests("pend", pending.version, 0, part, chunk=7), timeout=TIMEOUT
    )
    assert reply.bytes_written == part.numel() * 4
