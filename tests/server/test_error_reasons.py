"""Each error reason a healthy cluster answers, caused for real on one shared 3-rank cluster: the status code
and the ErrorInfo a generic gRPC client reads (grpc_status.rpc_status.from_call), the client exception's
class and reason for the same cause, and after each a good call still succeeds.

The reasons that need a broken or specially configured cluster are in test_error_reasons_limits.py (auth,
quotas, limits, paths) and test_error_reasons_failures.py (a dead rank, a full disk, ended epochs, cancelled
calls, internal errors); test_every_reason_is_tested checks that the three modules cover every Reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed.checkpoint as dcp
from error_reasons import assert_status
from server_helpers import TIMEOUT, Stubs, create, put, read_full, rpc_error

from shardserve import connect
from shardserve.client.errors import (
    AbortedError,
    InvalidArgumentError,
    TensorExistsError,
    TensorNotFoundError,
)
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason

pytestmark = pytest.mark.timeout(300)

META = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu", "rank:2/cpu"]).build_metadata(
    (9, 5), TensorProperties(dtype=torch.float32)
)
TENSOR = torch.arange(45, dtype=torch.float32).view(9, 5)
MODULES = (
    "test_error_reasons.py",
    "test_error_reasons_limits.py",
    "test_error_reasons_failures.py",
    "../cluster/test_checksums_cluster.py",  # CHECKSUM_MISMATCH needs a shard corrupted in a rank's memory
)


@pytest.fixture(scope="module")
def stubs(cluster3):
    s = Stubs(cluster3.address, default_metadata=cluster3.cluster_metadata)
    yield s
    s.close()


@pytest.fixture(scope="module")
def served(stubs):
    return put(stubs, "good", TENSOR, META)


@pytest.fixture(scope="module")
def client(cluster3):
    with connect(cluster3.address, timeout=30) as c:
        yield c


@pytest.fixture(autouse=True)
def still_serving(stubs, served):
    """After every refused call the coordinator and every rank answer a good one."""
    yield
    info = stubs.coord.GetTensor(pb.GetTensorRequest(name="good"), timeout=TIMEOUT)
    assert torch.equal(read_full(stubs, info), TENSOR)


def test_every_reason_is_tested():
    """Each Reason is asserted (assert_status or .reason ==) in one of the three error-reason modules."""
    here = Path(__file__).parent
    text = "".join((here / name).read_text() for name in MODULES)
    tested = set(re.findall(r"Reason\.([A-Z_]+)", text))
    assert {r.name for r in Reason} - tested == set()


def test_invalid_argument(stubs, served, client):
    err = rpc_error(stubs.coord.GetTensor, pb.GetTensorRequest(name="bad\x00name"), timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_ARGUMENT, field="name")
    err = rpc_error(
        stubs.ranks[0].ReadRegion,
        pb.ReadRegionRequest(
            name="good", version=served.version, shard_index=0, offsets=[-1, 0], sizes=[1, 1]
        ),
        timeout=TIMEOUT,
    )
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_ARGUMENT, tensor="good")
    with pytest.raises(InvalidArgumentError) as raised:
        client.tensor("good").fetch((0, 0), (1, 6))
    assert raised.value.reason == Reason.INVALID_ARGUMENT


def test_tensor_not_found(stubs, client):
    err = rpc_error(stubs.coord.GetTensor, pb.GetTensorRequest(name="nope"), timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.NOT_FOUND, Reason.TENSOR_NOT_FOUND, tensor="nope")
    with pytest.raises(TensorNotFoundError) as raised:
        client.tensor("nope")
    assert raised.value.reason == Reason.TENSOR_NOT_FOUND
    assert raised.value.metadata["tensor"] == "nope"


def test_rank_not_registered(stubs):
    """A heartbeat from a rank the coordinator does not know: NOT_FOUND (the rank registers again on it), with
    the rank's own reason, not a tensor's."""
    err = rpc_error(stubs.coord.Heartbeat, pb.HeartbeatRequest(rank=99), timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.NOT_FOUND, Reason.RANK_NOT_REGISTERED, rank="99")


def test_tensor_exists(stubs, served, client):
    err = rpc_error(
        stubs.coord.CreateTensor,
        pb.CreateTensorRequest(name="good", metadata=served.metadata),
        timeout=TIMEOUT,
    )
    assert_status(err, grpc.StatusCode.ALREADY_EXISTS, Reason.TENSOR_EXISTS, tensor="good")
    with pytest.raises(TensorExistsError) as raised:
        client.put("good", TENSOR)
    assert raised.value.reason == Reason.TENSOR_EXISTS
    assert raised.value.metadata["tensor"] == "good"


def test_stale_version(stubs, served):
    """A read at a version the rank does not hold: the client refreshes its metadata and reads again (its
    retry until the deadline is tested in tests/client/test_client_retry.py)."""
    err = rpc_error(
        stubs.ranks[1].ReadRegion,
        pb.ReadRegionRequest(
            name="good", version=served.version + 1000, shard_index=1, offsets=[3, 0], sizes=[1, 1]
        ),
        timeout=TIMEOUT,
    )
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, Reason.STALE_VERSION, tensor="good")


def test_invalid_state(stubs, served):
    """Aborting a committed version, and writing into one."""
    err = rpc_error(
        stubs.coord.AbortTensor,
        pb.AbortTensorRequest(name="good", version=served.version),
        timeout=TIMEOUT,
    )
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, Reason.INVALID_STATE, tensor="good")
    header = pb.WriteShardHeader(
        name="good",
        version=served.version,
        shard_index=0,
        dtype=pb.FLOAT32,
        nbytes=3 * 5 * 4,
    )
    err = rpc_error(
        stubs.ranks[0].WriteShard, iter([pb.WriteShardRequest(header=header)]), timeout=TIMEOUT
    )
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, Reason.INVALID_STATE)
    assert "already committed" in err.details()


def test_write_incomplete(stubs):
    """A commit before every shard was written is refused; the version stays PENDING and is aborted."""
    info = create(stubs, "half-written", META)
    try:
        err = rpc_error(
            stubs.coord.CommitTensor,
            pb.CommitTensorRequest(name="half-written", version=info.version),
            timeout=TIMEOUT,
        )
        assert_status(
            err, grpc.StatusCode.FAILED_PRECONDITION, Reason.WRITE_INCOMPLETE, tensor="half-written"
        )
    finally:
        stubs.coord.AbortTensor(
            pb.AbortTensorRequest(name="half-written", version=info.version), timeout=TIMEOUT
        )


def test_request_too_large(stubs, served):
    region = pb.ReadRegionRequest(
        name="good", version=served.version, shard_index=0, offsets=[0, 0], sizes=[1, 1]
    )
    request = pb.ReadRegionsRequest(regions=[region] * 16385)
    err = rpc_error(stubs.ranks[0].ReadRegions, request, timeout=TIMEOUT)
    assert_status(
        err, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.REQUEST_TOO_LARGE, field="regions"
    )


def test_world_mismatch(stubs):
    """A rank registering with another world size than the cluster's."""
    request = pb.RegisterRankRequest(
        rank=pb.RankInfo(rank=5, world_size=10, address="127.0.0.1:1", device="cpu")
    )
    err = rpc_error(stubs.coord.RegisterRank, request, timeout=TIMEOUT)
    assert_status(
        err, grpc.StatusCode.FAILED_PRECONDITION, Reason.WORLD_MISMATCH, field="rank.world_size"
    )


def test_rank_unavailable_for_a_live_rank_taken_over(stubs):
    """A registration of live rank 1 from another address: retryable once rank 1 is gone. (A dead rank's
    RANK_UNAVAILABLE is in test_error_reasons_failures.py.)"""
    request = pb.RegisterRankRequest(
        rank=pb.RankInfo(rank=1, world_size=3, address="127.0.0.1:1", device="cpu")
    )
    err = rpc_error(stubs.coord.RegisterRank, request, timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.UNAVAILABLE, Reason.RANK_UNAVAILABLE, rank=1)


def test_job_failed(stubs, client, tmp_path):
    """A checkpoint load whose data files are truncated: reading fails on the ranks, nothing is loaded."""
    path = tmp_path / "truncated"
    dcp.save({"from-checkpoint": TENSOR.clone()}, checkpoint_id=str(path), no_dist=True)
    for data_file in path.glob("*.distcp"):
        data_file.write_bytes(data_file.read_bytes()[:100])
    wanted = pb.CheckpointTensor(name="from-checkpoint", metadata=metadata_to_proto(META))
    err = rpc_error(
        stubs.coord.LoadCheckpoint,
        pb.LoadCheckpointRequest(path=str(path), tensors=[wanted], timeout_s=60),
        timeout=120,
    )
    assert_status(err, grpc.StatusCode.ABORTED, Reason.JOB_FAILED)
    with pytest.raises(AbortedError) as raised:
        client.load_checkpoint(str(path))
    assert raised.value.reason == Reason.JOB_FAILED
    assert "from-checkpoint" not in {t.name for t in client.list(include_pending=True)}


def test_tensor_busy(stubs, served):
    """A CreateTensor whose put token was aborted first (a client gave up on a put whose answer was lost)."""
    stubs.coord.AbortTensor(
        pb.AbortTensorRequest(name="contested", put_token="given-up"), timeout=TIMEOUT
    )
    request = pb.CreateTensorRequest(
        name="contested", metadata=served.metadata, put_token="given-up"
    )
    err = rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.ABORTED, Reason.TENSOR_BUSY, tensor="contested")
