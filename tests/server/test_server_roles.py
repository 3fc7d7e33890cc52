"""Roles per token (tokens file), the internal cluster credential, token rotation by SIGHUP, and change logs.

One 2-rank cluster with a tokens file of four principals. Every RPC of both services is called (from the proto's
service descriptors, so a new RPC without an access rule fails here) by each principal, a wrong token, no token
and the cluster credential.
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc
import pytest
import torch
from google.rpc import status_pb2
from server_helpers import TIMEOUT, recv_exactly
from waiting import wait_until

from shardserve import AuthenticationError, PermissionDeniedError, connect
from shardserve.client.paths.bulk import BulkReadError
from shardserve.client.paths.kinds import PathKind
from shardserve.client.paths.writes import shard_write, write_request
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.bulk_wire import FRAME, HEADER, KIND_READ, STATUS_BODY
from shardserve.protos.errors import Reason, detail_of_status, error_detail_of
from shardserve.server.common.access import ACCESS_RULES
from shardserve.server.common.auth import Security
from shardserve.server.common.principals import PrincipalBook, token_sha256

TOKENS = {
    "reader": "reader-token-1",
    "writer": "writer-token-1",
    "emb-writer": "emb-writer-token",
    "admin": "admin-token-1",
    "leaving": "leaving-token-1",
    "joining": "joining-token-1",
}
ROLES = {
    "reader": "read",
    "writer": "write",
    "emb-writer": "write",
    "admin": "admin",
    "leaving": "read",
    "joining": "read",
}
UNAUTHENTICATED, PERMISSION_DENIED = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)
RIGHTS = {
    "reader": {"read"},
    "writer": {"read", "write"},
    "admin": {"read", "write", "admin"},
    "cluster": {"read", "write", "admin", "cluster"},
}
SERVICES = ("Coordinator", "Leadership", "ShardServer")


def tokens_toml(names) -> str:
    tables = []
    for name in names:
        patterns = '\ntensors = ["emb_*"]' if name == "emb-writer" else ""
        tables.append(
            f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{token_sha256(TOKENS[name])}"\n'
            f'role = "{ROLES[name]}"{patterns}\n'
        )
    return "\n".join(tables)


FIRST = ["reader", "writer", "emb-writer", "admin", "leaving"]


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(tokens_toml(FIRST))
    return path


@pytest.fixture(scope="module")
def cluster(make_cluster, tokens_file):
    return make_cluster(ranks=2, security=Security(principals=PrincipalBook(str(tokens_file))))


def bearer(name):
    return (("authorization", f"Bearer {TOKENS[name]}"),)


def all_methods():
    for service in SERVICES:
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            yield service, method


def test_every_rpc_has_an_access_rule():
    missing = [
        f"/{m.full_name.rsplit('.', 1)[0]}/{m.name}"
        for _, m in all_methods()
        if f"/{m.containing_service.full_name}/{m.name}" not in ACCESS_RULES
    ]
    assert missing == []


def call_status(channel: grpc.Channel, service: str, method, metadata) -> grpc.StatusCode:
    """Call `method` with an empty request; its status code (OK when it answered)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request = getattr(pb, method.input_type.name)()
    response = getattr(pb, method.output_type.name).FromString
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    call = kind[(method.client_streaming, method.server_streaming)](
        path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response
    )
    try:
        answer = call(
            iter([request]) if method.client_streaming else request,
            timeout=TIMEOUT,
            metadata=metadata,
        )
        if method.server_streaming:
            list(answer)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def callers(cluster):
    return {
        "reader": bearer("reader"),
        "writer": bearer("writer"),
        "admin": bearer("admin"),
        "cluster": cluster.cluster_metadata,
        "wrong token": (("authorization", "Bearer nope"),),
        "no token": (),
        "wrong cluster secret": (("authorization", "Cluster " + "x" * 43),),
    }


@pytest.mark.parametrize(
    "service,method",
    [(s, m) for s, m in all_methods()],
    ids=[f"{s}.{m.name}" for s, m in all_methods()],
)
def test_each_rpc_answers_each_caller_by_its_rule(cluster, service, method):
    rule = ACCESS_RULES[f"/{method.containing_service.full_name}/{method.name}"]
    rank0 = cluster.coordinator.registry.ranks()[0].address
    with grpc.insecure_channel(
        cluster.address if service in ("Coordinator", "Leadership") else rank0
    ) as channel:
        for who, metadata in callers(cluster).items():
            code = call_status(channel, service, method, metadata)
            if who not in RIGHTS:
                assert code == UNAUTHENTICATED, (who, code)
            elif rule.right not in RIGHTS[who]:
                assert code == PERMISSION_DENIED, (who, code)
            else:
                assert code not in (UNAUTHENTICATED, PERMISSION_DENIED), (who, code)


def test_a_denial_names_the_principal_and_the_missing_right(cluster):
    tensor = torch.arange(12.0).view(4, 3)
    with connect(cluster.address, token=TOKENS["reader"]) as reader:
        with pytest.raises(
            PermissionDeniedError,
            match="principal 'reader' .*lacks the 'write' right .*CreateTensor",
        ) as denied:
            reader.put("by-reader", tensor)
        assert isinstance(denied.value, PermissionError)
        assert denied.value.reason == Reason.PERMISSION_DENIED
        assert denied.value.metadata == {"principal": "reader", "right": "write"}
    with connect(cluster.address, token=TOKENS["writer"]) as writer:
        remote = writer.put("by-writer", tensor)
        with pytest.raises(
            PermissionDeniedError, match="principal 'writer' .*lacks the 'admin' right .*Reshard"
        ):
            remote.reshard(ChunkShardingSpec(1, ["rank:0/cpu", "rank:1/cpu"]))
    with connect(cluster.address, token=TOKENS["reader"]) as reader:
        assert torch.equal(reader.tensor("by-writer")[:], tensor)


def test_tensor_patterns_limit_what_a_writer_may_change(cluster, caplog):
    table = torch.randn(8, 4)
    with caplog.at_level(logging.INFO, logger="shardserve.server.common.access"):
        with connect(cluster.address, token=TOKENS["emb-writer"]) as writer:
            writer.put("emb_users", table)
            writer.update_rows("emb_users", torch.tensor([1, 5]), torch.ones(2, 4))
            with pytest.raises(
                PermissionDeniedError,
                match="principal 'emb-writer' lacks the 'write' right on tensor 'dense'",
            ):
                writer.put("dense", table)
            with connect(cluster.address, token=TOKENS["admin"]) as admin:
                admin.put("dense", table)
            with pytest.raises(PermissionDeniedError, match="on tensor 'dense'"):
                writer.delete("dense")
            writer.delete("emb_users")
    logged = caplog.text
    assert "principal 'emb-writer' (write" in logged and "CreateTensor 'emb_users'" in logged
    assert "CommitTensor 'emb_users'" in logged and "DeleteTensor 'emb_users'" in logged
    assert "principal 'admin' (admin" in logged and "CreateTensor 'dense'" in logged


def test_tensor_patterns_scope_reads_too(cluster):
    """A principal reads only the tensors its patterns cover: get, fetch, lookup and shared-memory opens of
    another tensor are PERMISSION_DENIED naming the principal and the tensor, on the coordinator and on the
    ranks (a raw call that skips the coordinator is refused there too)."""
    table = torch.arange(32.0).view(8, 4)
    with connect(cluster.address, token=TOKENS["admin"]) as admin:
        admin.put("dense-secret", table)
        admin.put("emb_shared", table)
        rank0 = admin.ranks()[0].address
    for transport in ("grpc", "shm"):
        with connect(cluster.address, token=TOKENS["emb-writer"], transport=transport) as reader:
            assert torch.equal(reader.tensor("emb_shared")[:], table)
            assert torch.equal(
                reader.tensor("emb_shared").lookup(torch.tensor([1, 7])), table[[1, 7]]
            )
            with pytest.raises(
                PermissionDeniedError, match="'read' right on tensor 'dense-secret'"
            ) as no:
                reader.tensor("dense-secret")
            assert no.value.reason == Reason.PERMISSION_DENIED
            assert no.value.metadata["principal"] == "emb-writer"
            assert no.value.metadata["tensor"] == "dense-secret"
    requests = {
        "ReadRegion": pb.ReadRegionRequest(
            name="dense-secret", version=1, offsets=[0, 0], sizes=[1, 4]
        ),
        "ReadRegionSmall": pb.ReadRegionRequest(
            name="dense-secret", version=1, offsets=[0, 0], sizes=[1, 4]
        ),
        "ReadRegions": pb.ReadRegionsRequest(regions=[pb.ReadRegionRequest(name="dense-secret")]),
        "LookupSmall": pb.LookupRequest(items=[pb.LookupItem(name="dense-secret")]),
        "OpenShard": pb.OpenShardRequest(name="dense-secret", version=1),
    }
    with connect(cluster.address, token=TOKENS["emb-writer"]) as reader:
        listed = {
            t.name for t in reader.list()
        }  # listings show only the tensors its patterns cover
        assert "emb_shared" in listed and all(name.startswith("emb_") for name in listed)
    with grpc.insecure_channel(rank0) as channel:
        stub = pb_grpc.ShardServerStub(channel)
        session = stub.OpenBulkSession(
            pb.BulkSessionRequest(), timeout=TIMEOUT, metadata=bearer("emb-writer")
        )
        with socket.create_connection(("127.0.0.1", session.port), timeout=TIMEOUT) as sock:
            sock.sendall(session.ticket)  # the bulk port checks the ticket's principal the same way
            frame = requests["ReadRegion"].SerializeToString()
            sock.sendall(FRAME.pack(KIND_READ, len(frame)) + frame)
            status, body_kind, length = HEADER.unpack(recv_exactly(sock, HEADER.size))
            refusal = status_pb2.Status.FromString(recv_exactly(sock, length))
            assert status == PERMISSION_DENIED.value[0] and body_kind == STATUS_BODY
            detail = detail_of_status(refusal)
            assert detail.reason == Reason.PERMISSION_DENIED
            assert detail.metadata["tensor"] == "dense-secret"
        for method, request in requests.items():
            with pytest.raises(grpc.RpcError) as err:
                answer = getattr(stub, method)(
                    request, timeout=TIMEOUT, metadata=bearer("emb-writer")
                )
                list(answer) if method == "ReadRegion" else answer
            assert err.value.code() == PERMISSION_DENIED, method
            detail = error_detail_of(err.value)
            assert detail.reason == Reason.PERMISSION_DENIED, method
            assert detail.metadata["tensor"] == "dense-secret", method


def test_a_writer_cannot_fill_a_pending_version_outside_its_patterns(cluster):
    """The ranks check the patterns too: WriteShard/WriteRows into someone else's PENDING version is refused."""
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (4,), TensorProperties(dtype=torch.float32)
    )
    from shardserve.core.wire import metadata_to_proto

    with grpc.insecure_channel(cluster.address) as channel:
        info = pb_grpc.CoordinatorStub(channel).CreateTensor(
            pb.CreateTensorRequest(name="pending-dense", metadata=metadata_to_proto(meta)),
            timeout=TIMEOUT,
            metadata=bearer("admin"),
        )
    rank0 = cluster.coordinator.registry.ranks()[0].address
    with grpc.insecure_channel(rank0) as channel:
        stub = pb_grpc.ShardServerStub(channel)
        header = pb.WriteShardRequest(
            header=pb.WriteShardHeader(
                name="pending-dense", version=info.version, dtype=pb.FLOAT32, nbytes=16
            )
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteShard(iter([header]), timeout=TIMEOUT, metadata=bearer("emb-writer"))
        assert (
            err.value.code() == PERMISSION_DENIED
            and "tensor 'pending-dense'" in err.value.details()
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteRows(
                pb.WriteRowsRequest(name="pending-dense", version=info.version),
                timeout=TIMEOUT,
                metadata=bearer("emb-writer"),
            )
        assert err.value.code() == PERMISSION_DENIED
        batch = [
            shard_write("emb_mine", 1, 0, torch.zeros(4)),
            shard_write("pending-dense", info.version, 0, torch.zeros(4)),
        ]
        request = write_request(batch)
        request.data = bytes(32)
        with pytest.raises(grpc.RpcError) as err:
            stub.WriteShards(request, timeout=TIMEOUT, metadata=bearer("emb-writer"))
        assert (
            err.value.code() == PERMISSION_DENIED
            and "tensor 'pending-dense'" in err.value.details()
        )
    with connect(cluster.address, token=TOKENS["emb-writer"], transport="bulk") as writer:
        with pytest.raises(
            BulkReadError, match="lacks the 'write' right on tensor 'pending-dense'"
        ):
            writer.session.paths.path(PathKind.BULK).write_shards(rank0, batch)


def test_an_authenticated_snapshot_writer_is_opened_no_shard_and_stages_its_bytes(cluster):
    """In-place writes are for unauthenticated clusters: the coordinator drops an authenticated caller's
    writer_host_id (of CreateSnapshot and CreateTensor), so no rank opens its shards, and put_state_dict stages
    the bytes instead, bit for bit."""
    from shardserve import spmd
    from shardserve.core.wire import metadata_to_proto
    from shardserve.protos.same_host import host_id

    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]).build_metadata(
        (8, 4), TensorProperties(dtype=torch.float32)
    )
    request = pb.CreateSnapshotRequest(prefix="authed", keep=1, writer_host_id=host_id())
    request.tensors.add(key="w", metadata=metadata_to_proto(meta))
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        created = stub.CreateSnapshot(request, timeout=TIMEOUT, metadata=bearer("writer"))
        assert [list(entry.writable) for entry in created.entries] == [[]]
        tensor = stub.CreateTensor(
            pb.CreateTensorRequest(
                name="authed_tensor", metadata=metadata_to_proto(meta), writer_host_id=host_id()
            ),
            timeout=TIMEOUT,
            metadata=bearer("writer"),
        )
        assert list(tensor.writable) == []
        stub.AbortTensor(
            pb.AbortTensorRequest(name="authed_tensor", version=tensor.version),
            timeout=TIMEOUT,
            metadata=bearer("writer"),
        )
        stub.AbortSnapshot(
            pb.AbortSnapshotRequest(prefix="authed", number=created.number),
            timeout=TIMEOUT,
            metadata=bearer("writer"),
        )
    state = {f"w{i}": torch.full((16, 8), float(i)) for i in range(4)}
    with connect(cluster.address, token=TOKENS["writer"]) as writer:
        spmd.put_state_dict(writer, state, "authed", keep=1, durable=False)
        into = {key: torch.zeros(16, 8) for key in state}
        spmd.get_state_dict(writer, "authed", into=into)
        assert all(torch.equal(into[key], state[key]) for key in state)
        assert writer.session.paths.path(PathKind.SHARED_MEMORY).in_place.mapped_segments == 0


def test_collective_disabling_requests_from_an_admin_client_are_refused(cluster):
    """The fuzz findings: a cancel of a future job, a job sent to one rank only, and a junk job squatting the next
    sequence number. An admin token is not the cluster credential: all are refused and reshards keep working."""
    tensor = torch.arange(40.0).view(10, 4)
    with connect(cluster.address, token=TOKENS["admin"]) as admin:
        remote = admin.put(
            "steady", tensor, spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"])
        )
        for rank in cluster.coordinator.registry.ranks():
            with grpc.insecure_channel(rank.address) as channel:
                stub = pb_grpc.ShardServerStub(channel)
                for seq in (1, 2, 10**6):
                    with pytest.raises(grpc.RpcError) as err:
                        stub.CancelCollective(
                            pb.CancelCollectiveRequest(seq=seq),
                            timeout=TIMEOUT,
                            metadata=bearer("admin"),
                        )
                    assert err.value.code() == PERMISSION_DENIED
                    assert (
                        "principal 'admin' (role admin) lacks the 'cluster' right"
                        in err.value.details()
                    )
                for job in (
                    pb.CollectiveJob(seq=10**6, ranks=[rank.rank], timeout_s=5, epoch=1),
                    pb.CollectiveJob(seq=1, after_seq=0, ranks=[0, 1], timeout_s=600, epoch=1),
                ):
                    with pytest.raises(grpc.RpcError) as err:
                        list(stub.RunCollective(job, timeout=TIMEOUT, metadata=bearer("admin")))
                    assert err.value.code() == PERMISSION_DENIED
        for dim in (1, 0, 1):
            remote = remote.reshard(ChunkShardingSpec(dim, ["rank:1/cpu", "rank:0/cpu"]))
            assert torch.equal(remote[:], tensor)


def test_no_client_can_register_heartbeat_or_report_a_restore_for_a_rank(cluster):
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for metadata in (bearer("admin"), ()):
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterRank(
                    pb.RegisterRankRequest(rank=pb.RankInfo(rank=7, address="127.0.0.1:1")),
                    timeout=TIMEOUT,
                    metadata=metadata,
                )
            assert err.value.code() in (PERMISSION_DENIED, UNAUTHENTICATED)
            with pytest.raises(grpc.RpcError) as err:
                stub.Heartbeat(pb.HeartbeatRequest(rank=0), timeout=TIMEOUT, metadata=metadata)
            assert err.value.code() in (PERMISSION_DENIED, UNAUTHENTICATED)
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportRestore(pb.RestoreProgress(rank=0), timeout=TIMEOUT, metadata=metadata)
            assert err.value.code() in (PERMISSION_DENIED, UNAUTHENTICATED)
    assert sorted(r.rank for r in cluster.coordinator.registry.ranks()) == [0, 1]


def test_tokens_rotate_by_sighup_under_load_without_failing_a_valid_call(cluster, tokens_file):
    """Readers with a token kept by the rotation read and look up all along; a token added works once every
    process re-read the file, a token removed is refused from then on."""
    table = torch.randn(64, 8)
    with connect(cluster.address, token=TOKENS["admin"]) as admin:
        admin.put("rotating", table, spec=ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]))
    failures: list[BaseException] = []
    calls = [0]
    stop = threading.Event()

    def load() -> None:
        with connect(cluster.address, token=TOKENS["reader"]) as reader:
            remote = reader.tensor("rotating")
            while not stop.is_set():
                try:
                    assert torch.equal(remote[3:40], table[3:40])
                    assert torch.equal(
                        reader.lookup({"rotating": torch.tensor([0, 63, 5])})["rotating"],
                        table[[0, 63, 5]],
                    )
                    calls[0] += 1
                except BaseException as err:  # noqa: BLE001 - reported below
                    failures.append(err)
                    return

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: calls[0] >= 5, 60, "the readers to get going")
        tokens_file.write_text(tokens_toml(["reader", "writer", "emb-writer", "admin", "joining"]))
        cluster.reload_principals()  # what SIGHUP to `up` does: re-read here, SIGHUP to every rank

        def joined() -> bool:
            with connect(cluster.address, token=TOKENS["joining"]) as joining:
                return torch.equal(joining.tensor("rotating")[:], table)

        wait_until(joined, 30, "the new token to be accepted by every process")
        with pytest.raises(AuthenticationError):
            connect(cluster.address, token=TOKENS["leaving"])
        before = calls[0]
        wait_until(lambda: calls[0] >= before + 5, 60, "more reads after the rotation")
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        tokens_file.write_text(tokens_toml(FIRST))
        cluster.reload_principals()
    assert failures == []


def test_a_tokens_file_that_does_not_parse_keeps_the_old_principals(cluster, tokens_file):
    tokens_file.write_text('[[principal]]\nname = "x"\nrole = "superuser"\n')
    try:
        cluster.reload_principals()
        with connect(cluster.address, token=TOKENS["reader"]) as reader:
            assert "by-writer" in {t.name for t in reader.list()}
    finally:
        tokens_file.write_text(tokens_toml(FIRST))
        cluster.reload_principals()
