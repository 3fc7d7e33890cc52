"""The error reasons of failures, caused for real: a rank killed for good (RANK_UNAVAILABLE, SHARDS_LOST), a
rank persisting to a full tmpfs (DISK_FULL), the catalog's PostgreSQL stopped (CATALOG_UNAVAILABLE), a lease
taken over by another coordinator and a standby coordinator (NOT_LEADER), and, through a real in-process gRPC
server, a collective epoch ended by a failed job (EPOCH_ENDED), a client that cancels its request stream
(CANCELLED) and a servicer bug (INTERNAL). Each is read as a generic gRPC client reads it, and as the client
library raises it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from error_reasons import assert_status
from loaded_host import coordinator_options
from server_helpers import TIMEOUT, Stubs, create, rpc_error, write_shards
from waiting import eventually, wait_until

from shardserve import connect
from shardserve.client.errors import (
    NotLeaderError,
    PreconditionError,
    RankUnavailableError,
    ResourceExhaustedError,
    ShardServeError,
    ShardsLostError,
    error_from_rpc,
)
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import Reason
from shardserve.server.common.auth import Security
from shardserve.server.common.errors import rpc_errors
from shardserve.server.common.rank_options import RankOptions
from shardserve.server.coordinator_process import CoordinatorOptions, start_coordinator
from shardserve.server.rank.error_status import rank_rpc
from shardserve.server.rank.errors import EpochEnded
from shardserve.server.rank.jobs.service import CollectiveJobService, JobKinds
from shardserve.server.rank.store import ShardStore
from shardserve.server.supervisor import RestartPolicy

pytestmark = pytest.mark.timeout(300)

ROWS = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
ON_RANK_0 = ChunkShardingSpec(0, ["rank:0/cpu"])
ON_RANK_1 = ChunkShardingSpec(0, ["rank:1/cpu"])
TABLE = torch.arange(40, dtype=torch.float32).view(8, 5)
DEAD = 1
WAIT_S = 60.0


def layout(spec: ChunkShardingSpec, tensor: torch.Tensor) -> pb.ShardedTensorMetadata:
    return metadata_to_proto(
        spec.build_metadata(tuple(tensor.shape), TensorProperties(dtype=tensor.dtype))
    )


@pytest.fixture(scope="module")
def broken(make_cluster):
    """A 2-rank cluster whose rank 1 was killed for good after "rows" was put on both ranks."""
    cluster = make_cluster(ranks=2, coordinator_options=coordinator_options(heartbeat_interval=0.5))
    with connect(cluster.address, timeout=30) as client:
        client.put("rows", TABLE, spec=ROWS)
        cluster.kill_rank(DEAD, signal.SIGKILL)
        wait_until(
            lambda: cluster.stays_dead(DEAD) and not client.ranks()[DEAD].alive,
            WAIT_S,
            "rank 1 to be declared dead",
        )
    return cluster


@pytest.fixture(scope="module")
def stubs(broken):
    s = Stubs(broken.address, default_metadata=broken.cluster_metadata)
    yield s
    s.close()


@pytest.fixture
def client(broken):
    with connect(broken.address, timeout=30) as c:
        yield c
        # the live rank still serves: a put onto it and its half of "rows" read back
        c.put("after", TABLE, spec=ON_RANK_0, overwrite=True)
        assert torch.equal(c.tensor("after").full_tensor(), TABLE)
        assert torch.equal(c.tensor("rows")[0:4], TABLE[0:4])


def test_rank_unavailable_for_a_dead_rank(stubs, client):
    request = pb.CreateTensorRequest(name="onto-dead", metadata=layout(ON_RANK_1, TABLE))
    err = rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT)
    assert_status(
        err,
        grpc.StatusCode.UNAVAILABLE,
        Reason.RANK_UNAVAILABLE,
        tensor="onto-dead",
        rank=DEAD,
        field="metadata.shards_metadata[0].placement",
    )
    with pytest.raises(RankUnavailableError) as raised:
        client.put("onto-dead", TABLE, spec=ON_RANK_1)
    assert raised.value.reason == Reason.RANK_UNAVAILABLE
    assert raised.value.metadata["rank"] == str(DEAD)


def test_rank_unavailable_for_a_box_whose_only_copy_is_on_a_dead_rank(stubs, broken):
    """A reshard of a tensor whose only copy of rows 4-7 is on the dead rank, and a read of those rows: the
    rank may come back, so UNAVAILABLE (the read after retrying until its deadline), never DATA_LOSS."""
    request = pb.ReshardRequest(
        name="rows", metadata=layout(ChunkShardingSpec(1, ["rank:0/cpu"]), TABLE)
    )
    err = rpc_error(stubs.coord.Reshard, request, timeout=TIMEOUT)
    assert_status(err, grpc.StatusCode.UNAVAILABLE, Reason.RANK_UNAVAILABLE, tensor="rows")
    with connect(broken.address, timeout=2.0) as client:
        with pytest.raises(RankUnavailableError) as down:
            client.tensor("rows")[4:]
        assert down.value.reason == Reason.RANK_UNAVAILABLE and not isinstance(
            down.value, ShardsLostError
        )
        assert torch.equal(client.tensor("rows")[0:4], TABLE[0:4])


@pytest.fixture(scope="module")
def on_postgres(make_cluster, postgres_server):
    """A 1-rank cluster whose catalog is a database of the test PostgreSQL server, with "kept" put; a call waits
    2 s for the database (libpq's connect_timeout in the URL), not the default 5 s."""
    url = postgres_server.url(postgres_server.create_database())
    cluster = make_cluster(ranks=1, catalog=f"{url}?connect_timeout=2")
    with connect(cluster.address, timeout=30) as client:
        client.put("kept", TABLE, spec=ON_RANK_0)
    return cluster


def test_catalog_unavailable(on_postgres, postgres_server):
    """The database stopped under a running cluster: calls that need the catalog fail UNAVAILABLE with
    CATALOG_UNAVAILABLE; once it is back they succeed, and what was put before reads back."""
    stubs = Stubs(on_postgres.address, default_metadata=on_postgres.cluster_metadata)
    request = pb.CreateTensorRequest(name="new", metadata=layout(ON_RANK_0, TABLE))
    postgres_server.stop("immediate")
    try:
        err = rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT)
        assert_status(err, grpc.StatusCode.UNAVAILABLE, Reason.CATALOG_UNAVAILABLE, tensor="new")
        assert "unavailable" in err.details() and postgres_server.password not in err.details()
        with connect(on_postgres.address, timeout=TIMEOUT) as client:
            with pytest.raises(RankUnavailableError) as raised:
                client.put("new", TABLE, spec=ON_RANK_0)
            assert raised.value.reason == Reason.CATALOG_UNAVAILABLE
    finally:
        postgres_server.start()
        stubs.close()
    with connect(on_postgres.address, timeout=TIMEOUT) as client:
        eventually(lambda: client.put("new", TABLE * 2, spec=ON_RANK_0), WAIT_S, "a put once back")
        assert torch.equal(client.tensor("kept").full_tensor(), TABLE)
        assert torch.equal(client.tensor("new").full_tensor(), TABLE * 2)


def test_not_leader(on_postgres):
    """The coordinator's catalog fenced with its lease's term, then the lease taken over by another holder:
    its writes fail UNAVAILABLE with NOT_LEADER naming the new leader and term, and write nothing; reads go
    on."""
    catalog = on_postgres.coordinator.catalog
    lease = catalog.leadership(
        lease_duration=60.0
    )  # the leader's writes never race its lease's end
    term = lease.try_acquire("this", on_postgres.address)
    catalog.fence(term)
    stubs = Stubs(on_postgres.address, default_metadata=on_postgres.cluster_metadata)
    try:
        with connect(on_postgres.address, timeout=TIMEOUT) as client:
            client.put("led", TABLE, spec=ON_RANK_0)  # the leader writes
            lease.resign(term)
            other = lease.try_acquire("other", "10.0.0.2:50051")
            request = pb.CreateTensorRequest(name="refused", metadata=layout(ON_RANK_0, TABLE))
            err = rpc_error(stubs.coord.CreateTensor, request, timeout=TIMEOUT)
            assert_status(
                err,
                grpc.StatusCode.UNAVAILABLE,
                Reason.NOT_LEADER,
                leader="10.0.0.2:50051",
                term=other,
            )
            with pytest.raises(RankUnavailableError) as raised:
                client.put("refused", TABLE, spec=ON_RANK_0)
            assert raised.value.reason == Reason.NOT_LEADER
            assert "refused" not in {s.name for s in client.list(include_pending=True)}
            assert torch.equal(client.tensor("led").full_tensor(), TABLE)  # reads go on
            lease.resign(other)
    finally:
        catalog.fence(None)
        stubs.close()


@pytest.fixture(scope="module")
def restarted_empty(make_cluster):
    """A 2-rank cluster without persistence whose rank 1 was killed and restarted: it came back without its
    copy of "rows", which is now known gone."""
    cluster = make_cluster(
        ranks=2,
        coordinator_options=coordinator_options(heartbeat_interval=0.5, repair_after=3600.0),
        restart_policy=RestartPolicy(max_restarts=1, initial_backoff=0.2),
    )
    with connect(cluster.address, timeout=30) as client:
        client.put("rows", TABLE, spec=ROWS)
        old = cluster.rank_pids[DEAD]
        cluster.kill_rank(DEAD, signal.SIGKILL)
        wait_until(
            lambda: cluster.rank_pids[DEAD] != old and client.tensor("rows").health == "lost",
            WAIT_S * 2,
            "rank 1 to come back without its copy",
        )
    return cluster


def test_shards_lost(restarted_empty):
    """Rows 4-7 had one copy, on a rank that restarted without it: DATA_LOSS for a reshard and for a read, at
    once (asking again cannot bring it back); the other rows stay readable."""
    stubs = Stubs(restarted_empty.address, default_metadata=restarted_empty.cluster_metadata)
    try:
        request = pb.ReshardRequest(
            name="rows", metadata=layout(ChunkShardingSpec(1, ["rank:0/cpu"]), TABLE)
        )
        err = rpc_error(stubs.coord.Reshard, request, timeout=TIMEOUT)
        assert_status(err, grpc.StatusCode.DATA_LOSS, Reason.SHARDS_LOST, tensor="rows")
    finally:
        stubs.close()
    with connect(restarted_empty.address, timeout=30) as client:
        with pytest.raises(ShardServeError) as raised:
            client.tensor("rows").reshard(ChunkShardingSpec(1, ["rank:0/cpu"]))
        assert raised.value.reason == Reason.SHARDS_LOST
        start = time.monotonic()
        with pytest.raises(ShardsLostError) as lost:
            client.tensor("rows")[4:]
        assert time.monotonic() - start < 5.0  # not retried
        assert lost.value.reason == Reason.SHARDS_LOST and lost.value.ranks == (DEAD,)
        assert torch.equal(client.tensor("rows")[0:4], TABLE[0:4])


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (needs root and mount); unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
            capture_output=True,
            timeout=30,
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def test_disk_full(make_cluster, small_disk):
    """A rank that persists to a 256 KiB tmpfs: a 512 KiB commit is refused and nothing is served; a small put
    still succeeds."""
    cluster = make_cluster(ranks=1, rank_options=RankOptions(persist_dir=small_disk))
    big = torch.randn(512, 256)
    meta = ON_RANK_0.build_metadata(tuple(big.shape), TensorProperties(dtype=big.dtype))
    stubs = Stubs(cluster.address, default_metadata=cluster.cluster_metadata)
    try:
        info = create(stubs, "too-big", meta)
        write_shards(stubs, info, big)
        request = pb.CommitTensorRequest(name="too-big", version=info.version)
        err = rpc_error(stubs.coord.CommitTensor, request, timeout=TIMEOUT)
        assert_status(
            err, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.DISK_FULL, tensor="too-big", rank=0
        )
    finally:
        stubs.close()
    with connect(cluster.address, timeout=30) as client:
        with pytest.raises(ResourceExhaustedError) as raised:
            client.put("too-big-too", big, spec=ON_RANK_0)
        assert raised.value.reason == Reason.DISK_FULL
        assert {t.name for t in client.list()} == set()
        client.put("fits", TABLE, spec=ON_RANK_0)
        assert torch.equal(client.tensor("fits").full_tensor(), TABLE)


class Probe:
    """A servicer of one unary and one request-streaming method, each wrapped as the real servicers are: `Raise`
    (as a rank's, so it answers rank errors too) raises `error`, `Drain` reads its request stream to the end."""

    def __init__(self) -> None:
        self.error: BaseException = RuntimeError("unset")
        self.draining = threading.Event()
        self.drained = threading.Event()  # Drain ended, ...
        self.stream_failed = threading.Event()  # ... its request stream raising (not merely ending)

    @rank_rpc
    def Raise(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise self.error

    @rpc_errors
    def Drain(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self.draining.set()
        try:
            return b"".join(requests)
        except grpc.RpcError:
            self.stream_failed.set()
            raise
        finally:
            self.drained.set()


@pytest.fixture(scope="module")
def probe() -> Iterator[tuple[Probe, grpc.Channel]]:
    """The Probe on a real gRPC server on 127.0.0.1, and a channel to it."""
    servicer = Probe()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handlers = {
        "Raise": grpc.unary_unary_rpc_method_handler(servicer.Raise),
        "Drain": grpc.stream_unary_rpc_method_handler(servicer.Drain),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("probe.Probe", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, channel
    channel.close()
    server.stop(grace=None)


def raised_through(probe: tuple[Probe, grpc.Channel], error: BaseException) -> grpc.RpcError:
    servicer, channel = probe
    servicer.error = error
    return rpc_error(channel.unary_unary("/probe.Probe/Raise"), b"", timeout=TIMEOUT)


def test_epoch_ended(probe):
    """A collective job fails on a rank, which ends its epoch there; a later job of that epoch is refused
    with EPOCH_ENDED (the coordinator then runs the job again in a new epoch)."""

    def failing(job: pb.CollectiveJob, ctx: object) -> None:
        raise RuntimeError("a peer went away")

    kinds = JobKinds()
    kinds.register("reshard", failing)
    service = CollectiveJobService(ShardStore(0, shared_memory=False), kinds)
    job = pb.CollectiveJob(
        seq=1, after_seq=0, ranks=[0], timeout_s=30, epoch=3, reshard=pb.ReshardJob(name="t")
    )
    final = list(service.RunCollective(job, None))[-1]
    assert final.done and "a peer went away" in final.error
    with pytest.raises(EpochEnded) as ended:
        service.groups.for_job(3, [0], 1.0)
    err = raised_through(probe, ended.value)
    assert_status(err, grpc.StatusCode.FAILED_PRECONDITION, Reason.EPOCH_ENDED)
    assert "epoch 3 has ended on rank 0" in err.details()
    client_error = error_from_rpc(err)
    assert isinstance(client_error, PreconditionError)
    assert client_error.reason == Reason.EPOCH_ENDED


def test_internal(probe, caplog):
    """A servicer bug answers INTERNAL naming the exception, logs its traceback, and the server goes on."""
    caplog.set_level(logging.ERROR, logger="shardserve.server.common.errors")
    err = raised_through(probe, ZeroDivisionError("division by zero"))
    assert_status(err, grpc.StatusCode.INTERNAL, Reason.INTERNAL)
    assert "internal error: ZeroDivisionError: division by zero" in err.details()
    assert any(r.exc_info and "Raise failed" in r.getMessage() for r in caplog.records)
    client_error = error_from_rpc(err)
    assert type(client_error) is ShardServeError and client_error.reason == Reason.INTERNAL
    _, channel = probe
    assert channel.stream_unary("/probe.Probe/Drain")(iter([b"a", b"b"]), timeout=TIMEOUT) == b"ab"


def test_cancelled(probe, caplog):
    """A client cancels its request stream mid-way: the server ends the call CANCELLED (logged with the
    reason; the caller, gone, gets gRPC's own CANCELLED without details) and goes on serving."""
    caplog.set_level(logging.INFO, logger="shardserve.server.common.errors")
    servicer, channel = probe
    for event in (servicer.draining, servicer.drained, servicer.stream_failed):
        event.clear()
    release = threading.Event()

    def requests() -> Iterator[bytes]:
        yield b"first"
        release.wait(TIMEOUT)

    call = channel.stream_unary("/probe.Probe/Drain").future(requests(), timeout=TIMEOUT)
    try:
        assert servicer.draining.wait(TIMEOUT)
        call.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            call.result(timeout=TIMEOUT)
    finally:
        release.set()

    assert servicer.drained.wait(WAIT_S), "the server never ended the cancelled call"
    answered = f"Drain -> CANCELLED ({Reason.CANCELLED.value}): the client ended the request stream"

    def logged() -> bool:
        return any(answered in r.getMessage() for r in caplog.records)

    # gRPC hands the handler either the cancellation (its stream raises) or, in a narrow race, a plain end of
    # the stream; the first must be answered CANCELLED with the reason
    if servicer.stream_failed.is_set():
        wait_until(logged, WAIT_S, "the server to log the cancelled call")
    assert channel.stream_unary("/probe.Probe/Drain")(iter([b"c"]), timeout=TIMEOUT) == b"c"


def test_not_leader_from_a_standby(tmp_path):
    """Two coordinators over one catalog under a lease: the standby refuses a call with UNAVAILABLE, reason
    NOT_LEADER, metadata naming the leader's address; the client raises NotLeaderError (a
    RankUnavailableError) carrying it."""
    options = CoordinatorOptions(lease_duration=5.0)
    leader, leader_server = start_coordinator("127.0.0.1:0", tmp_path, Security(), options)
    standby, standby_server = start_coordinator("127.0.0.1:0", tmp_path, Security(), options)
    try:
        with grpc.insecure_channel(standby.role.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            err = rpc_error(stub.GetTensor, pb.GetTensorRequest(name="t"), timeout=TIMEOUT)
        assert_status(
            err, grpc.StatusCode.UNAVAILABLE, Reason.NOT_LEADER, leader=leader.role.address
        )
        assert f"the leader is at {leader.role.address}" in err.details()
        client_error = error_from_rpc(err)
        assert isinstance(client_error, NotLeaderError) and isinstance(
            client_error, RankUnavailableError
        )
        assert client_error.reason == Reason.NOT_LEADER
        assert client_error.leader == leader.role.address
    finally:
        for process, server in ((standby, standby_server), (leader, leader_server)):
            server.stop(grace=0.5)
            process.close()
