"""A tensor put every step fills the version reserved after the put before (CreateTensorRequest.reserve): no
CreateTensor on a steady put's path, a new version when the layout changes or the reservation is gone, nothing
held by a client that put a name once, by `reserve_next=False` or after close, and a reservation never in the
way of another writer's put or a row update; every put read back bit for bit."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest
import torch
from error_reasons import assert_status

from shardserve import InvalidArgumentError, connect
from shardserve.client.cluster import Cluster
from shardserve.client.session import Session
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import Reason
from shardserve.server.launcher import LocalCluster


@pytest.fixture(scope="module")
def cluster(cluster2: LocalCluster) -> LocalCluster:
    """The shared 2-rank cluster (conftest)."""
    return cluster2


@pytest.fixture
def creates(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool, bool]]:
    """(name, reserve, made on the calling put's thread) of every CreateTensor a client makes."""
    made: list[tuple[str, bool, bool]] = []
    real = Session.create_tensor
    caller = threading.current_thread()

    def counted(session: Session, new: Any, **kwargs: Any) -> pb.TensorInfo:
        made.append((new.name, new.reserve, threading.current_thread() is caller))
        return real(session, new, **kwargs)

    monkeypatch.setattr(Session, "create_tensor", counted)
    return made


def value(step: int, rows: int = 64) -> torch.Tensor:
    return torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16) * step


def pending(client: Cluster, name: str) -> list[int]:
    """The PENDING versions of `name` the coordinator holds."""
    listed = client.session.call("ListTensors", pb.ListTensorsRequest(include_pending=True))
    return [t.version for t in listed.tensors if t.name == name and t.state == pb.PENDING]


def test_steady_puts_fill_the_version_reserved_after_the_put_before(
    cluster: LocalCluster, creates: list[tuple[str, bool, bool]]
) -> None:
    with connect(cluster.address) as client:
        versions = []
        for step in range(1, 6):
            versions.append(client.put("steady", value(step), overwrite=True).version)
            assert torch.equal(client.tensor("steady").full_tensor(), value(step))
        on_path = [reserve for name, reserve, mine in creates if mine]
        reserved = [reserve for name, reserve, mine in creates if not mine]
        assert on_path == [
            False,
            False,
        ]  # the first two puts create; the third on fill reservations
        assert all(reserved) and 3 <= len(reserved) <= 4  # after puts 2, 3, 4 and (being made) 5
        assert versions == sorted(versions)
        assert len(pending(client, "steady")) <= 1
    with connect(cluster.address) as other:
        assert pending(other, "steady") == []  # the close gave the reservation back
        assert torch.equal(other.tensor("steady").full_tensor(), value(5))


def test_a_changed_layout_gives_the_reservation_back_and_creates_anew(
    cluster: LocalCluster, creates: list[tuple[str, bool, bool]]
) -> None:
    with connect(cluster.address) as client:
        for step in (1, 2, 3):
            client.put("reshaped", value(step), overwrite=True)
        client.put("reshaped", value(4, rows=32), overwrite=True)  # another shape: another layout
        assert torch.equal(client.tensor("reshaped").full_tensor(), value(4, rows=32))
        assert [reserve for _, reserve, mine in creates if mine] == [False, False, False]
        client.put("reshaped", value(5, rows=32), overwrite=True, dtype=torch.float16)
        assert torch.equal(
            client.tensor("reshaped").full_tensor(), value(5, rows=32).to(torch.float16)
        )
        assert len(pending(client, "reshaped")) <= 1


def test_without_reserve_next_or_overwrite_nothing_is_reserved(
    cluster: LocalCluster, creates: list[tuple[str, bool, bool]]
) -> None:
    with connect(cluster.address) as client:
        for step in (1, 2, 3):
            client.put("unreserved", value(step), overwrite=True, reserve_next=False)
        client.put("once", value(1), overwrite=True)
        client.put("once", value(2), overwrite=True, replicas=2)  # another layout
        assert not any(reserve for _, reserve, _ in creates)
        assert pending(client, "unreserved") == [] and pending(client, "once") == []
        with pytest.raises(InvalidArgumentError, match="reserve_next"):
            client.put("unreserved", value(4), overwrite=True, reserve_next="yes")


def test_another_writers_put_drops_the_reservation_and_the_next_put_creates_one(
    cluster: LocalCluster, creates: list[tuple[str, bool, bool]]
) -> None:
    """The other writer's put drops the first writer's reservation, which that writer had mapped: the put that
    fills it anyway must neither land in the other's version nor fail."""
    with connect(cluster.address) as writer, connect(cluster.address) as other:
        for step in (1, 2, 3):
            writer.put("shared", value(step), overwrite=True)
        other.put("shared", value(7), overwrite=True, reserve_next=False)
        assert torch.equal(writer.tensor("shared").full_tensor(), value(7))
        other.put(
            "bystander", value(8), overwrite=True, reserve_next=False
        )  # may take freed memory
        writer.put("shared", value(4), overwrite=True)
        assert torch.equal(other.tensor("shared").full_tensor(), value(4))
        assert torch.equal(other.tensor("bystander").full_tensor(), value(8))
        on_path = [mine and not reserve for name, reserve, mine in creates if name == "shared"]
        assert (
            on_path.count(True) == 4
        )  # puts 1, 2, the other's, and the put whose reservation was gone


def test_a_row_update_of_a_table_with_a_reservation_is_not_held_back(
    cluster: LocalCluster,
) -> None:
    with connect(cluster.address) as client:
        for step in (1, 2, 3):
            client.put("table", value(step), overwrite=True)
        assert client.tensor("table").version  # the reservation is being made or made
        client.update_rows("table", torch.tensor([0, 5]), torch.full((2, 16), -1.0))
        expected = value(3)
        expected[[0, 5]] = -1.0
        assert torch.equal(client.tensor("table").full_tensor(), expected)
        client.put("table", value(4), overwrite=True)  # its reservation was dropped by the update
        assert torch.equal(client.tensor("table").full_tensor(), value(4))


def test_a_reservation_is_refused_while_another_put_is_pending_and_never_aborts_it(
    cluster: LocalCluster,
) -> None:
    with connect(cluster.address) as client:
        client.put("contended", value(1), overwrite=True, reserve_next=False)
        meta = client.tensor("contended").metadata()
    with grpc.insecure_channel(cluster.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        request = pb.CreateTensorRequest(
            name="contended", metadata=metadata_to_proto(meta), overwrite=True
        )
        put = stub.CreateTensor(request, timeout=10)
        request.reserve = True
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateTensor(request, timeout=10)
        assert_status(refused.value, grpc.StatusCode.ABORTED, Reason.TENSOR_BUSY)
        assert "in progress" in refused.value.details()
        stub.AbortTensor(pb.AbortTensorRequest(name="contended", version=put.version), timeout=10)
        stub.CreateTensor(request, timeout=10)  # nothing pending now: made
        reserved = stub.CreateTensor(request, timeout=10)  # a reservation holds no other one back
        plain = pb.CreateTensorRequest(name="contended", metadata=metadata_to_proto(meta))
        with pytest.raises(
            grpc.RpcError
        ) as exists:  # the READY version refuses it, not the reservation
            stub.CreateTensor(plain, timeout=10)
        assert "already exists" in exists.value.details()
        plain.overwrite = True
        made = stub.CreateTensor(plain, timeout=10)  # drops the reservation, is not refused by it
        listed = stub.ListTensors(pb.ListTensorsRequest(include_pending=True), timeout=10).tensors
        assert {t.version for t in listed if t.name == "contended" and t.state == pb.PENDING} == {
            made.version
        }
        assert reserved.version < made.version  # each create dropped the reservation before it
        stub.AbortTensor(pb.AbortTensorRequest(name="contended", version=made.version), timeout=10)


@pytest.mark.parametrize(
    "change", [{"overwrite": False}, {"init": pb.INIT_ZEROS}], ids=["no-overwrite", "init"]
)
def test_a_reservation_of_anything_but_a_put_replacing_the_tensor_is_refused_naming_the_field(
    cluster: LocalCluster, change: dict[str, Any]
) -> None:
    with connect(cluster.address) as client:
        client.put("refused", value(1), overwrite=True, reserve_next=False)
        meta = client.tensor("refused").metadata()
    with grpc.insecure_channel(cluster.address) as channel:
        request = pb.CreateTensorRequest(
            name="refused", metadata=metadata_to_proto(meta), overwrite=True, reserve=True
        )
        for field, set_to in change.items():
            setattr(request, field, set_to)
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.CoordinatorStub(channel).CreateTensor(request, timeout=10)
        assert_status(
            refused.value,
            grpc.StatusCode.INVALID_ARGUMENT,
            Reason.INVALID_ARGUMENT,
            field="reserve",
        )
