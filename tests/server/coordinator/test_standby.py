"""Two coordinators served in this process over one state dir, under a lease: the first leads; the second
stands by and answers every Coordinator call with UNAVAILABLE, reason NOT_LEADER, naming the leader's address
(read as a generic gRPC client reads it); both answer GetRole; the leader that stops resigns and the standby
leads; clients given both (or only the standby) follow it to the leader, and a new client's first call waits
for the new leader; the asyncio client follows it too; the metrics show who leads, its term and the
takeovers; the health service says SERVING for the Coordinator service on the leader only."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from error_reasons import assert_status
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import wait_until

from shardserve import aio, connect
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.errors import Reason
from shardserve.server.common.auth import Security
from shardserve.server.coordinator.catalog.locations import CATALOG_FILE, open_catalog
from shardserve.server.coordinator_process import CoordinatorOptions, start_coordinator

LEASE_S = 4.0  # long enough that a loaded machine never starves a renewal past it
TIMEOUT = 10.0
COORDINATOR = pb.DESCRIPTOR.services_by_name["Coordinator"]


class Served:
    """A coordinator served here: its process parts, its gRPC server and stubs."""

    def __init__(self, state_dir: str) -> None:
        self.process, self.running = start_coordinator(
            "127.0.0.1:0",
            state_dir,
            Security(),
            CoordinatorOptions(lease_duration=LEASE_S),
            metrics_port=0,
        )
        self.address = self.process.role.address
        self.channel = grpc.insecure_channel(self.address)
        self.coordinator = pb_grpc.CoordinatorStub(self.channel)
        self.leadership = pb_grpc.LeadershipStub(self.channel)
        self.closed = False

    def role(self) -> pb.RoleInfo:
        return self.leadership.GetRole(pb.GetRoleRequest(), timeout=TIMEOUT)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.channel.close()
        self.running.stop(grace=0.5)
        self.process.close()


@pytest.fixture
def pair(tmp_path) -> Iterator[tuple[Served, Served]]:
    first = Served(str(tmp_path))
    second = Served(str(tmp_path))
    yield first, second
    second.close()
    first.close()


def _call(channel: grpc.Channel, method) -> grpc.RpcError:
    """`method` of the Coordinator service called with an empty request; the error it failed with."""
    path = f"/{COORDINATOR.full_name}/{method.name}"
    request = getattr(pb, method.input_type.name)()
    deserialize = getattr(pb, method.output_type.name).FromString
    make = channel.unary_stream if method.server_streaming else channel.unary_unary
    call = make(
        path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=deserialize
    )
    with pytest.raises(grpc.RpcError) as refused:
        answer = call(request, timeout=TIMEOUT)
        if method.server_streaming:
            list(answer)
    return refused.value


def test_the_standby_answers_every_coordinator_call_not_leader_naming_the_leader(pair):
    leader, standby = pair
    assert leader.role().role == pb.ROLE_LEADER and leader.role().term >= 1
    term = leader.role().term
    seen = standby.role()
    assert (seen.role, seen.term, seen.leader_address, seen.leader_term) == (
        pb.ROLE_STANDBY,
        0,
        leader.address,
        term,
    )
    assert len(COORDINATOR.methods) >= 19
    for method in COORDINATOR.methods:
        err = _call(standby.channel, method)
        assert_status(
            err, grpc.StatusCode.UNAVAILABLE, Reason.NOT_LEADER, leader=leader.address, term=term
        )
    assert leader.coordinator.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks == []


def test_a_leader_that_stops_resigns_and_the_standby_leads(pair, tmp_path):
    leader, standby = pair
    old_term = leader.role().term
    leader.close()
    catalog = open_catalog(str(tmp_path / CATALOG_FILE))
    after = catalog.leadership(LEASE_S).leader()
    catalog.close()
    assert after is None or after.address == standby.address  # resigned: not left to lapse

    def leads() -> bool:
        return standby.role().role == pb.ROLE_LEADER

    wait_until(leads, 10 * LEASE_S, "the standby to lead")
    assert standby.role().term == old_term + 1
    assert standby.coordinator.ListRanks(pb.ListRanksRequest(), timeout=TIMEOUT).ranks == []


def test_a_client_given_both_follows_the_standbys_answer_to_the_leader(pair):
    leader, standby = pair
    with connect(f"{standby.address},{leader.address}", timeout=TIMEOUT) as client:
        assert client.ranks() == []
        assert client.session.coordinators.addresses.current == leader.address
        roles = {c.address: c.role for c in client.session.coordinators.roles()}
        assert roles == {standby.address: "standby", leader.address: "leader"}


def test_a_client_given_one_standby_follows_it_to_the_leader(pair):
    leader, standby = pair
    with connect(standby.address, timeout=TIMEOUT) as client:
        assert client.ranks() == []
        assert client.session.coordinators.addresses.current == leader.address


def test_a_new_clients_first_call_waits_for_the_new_leader(pair):
    leader, standby = pair
    gone = leader.address
    leader.close()  # the lease is handed over: the standby leads within a quarter lease
    with connect(f"{gone},{standby.address}", timeout=TIMEOUT) as client:
        assert client.ranks() == []  # the first call found the one that leads now
        assert client.session.coordinators.addresses.current == standby.address
    assert standby.role().role == pb.ROLE_LEADER


def test_the_asyncio_client_follows_the_leader_too(pair):
    leader, standby = pair

    async def ranks() -> list:
        async with await aio.connect(f"{standby.address},{leader.address}", timeout=TIMEOUT) as c:
            return await c.ranks()

    assert asyncio.run(ranks()) == []


def _metric(served: Served, name: str) -> float:
    """The value of the unlabelled metric `name` as the coordinator's /metrics endpoint shows it now."""
    text = urllib.request.urlopen(
        f"http://{served.process.metrics_address}/metrics", timeout=TIMEOUT
    )
    for line in text.read().decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not served")


def test_the_metrics_show_who_leads_its_term_and_the_takeovers(pair):
    leader, standby = pair
    term = leader.role().term
    assert _metric(leader, "shardserve_coordinator_is_leader") == 1
    assert _metric(leader, "shardserve_coordinator_term") == term
    assert _metric(leader, "shardserve_coordinator_takeovers_total") == 1
    assert _metric(standby, "shardserve_coordinator_is_leader") == 0
    assert _metric(standby, "shardserve_coordinator_term") == 0
    assert _metric(standby, "shardserve_coordinator_takeovers_total") == 0
    leader.close()
    wait_until(lambda: standby.role().role == pb.ROLE_LEADER, 10 * LEASE_S, "the standby to lead")
    assert _metric(standby, "shardserve_coordinator_is_leader") == 1
    assert _metric(standby, "shardserve_coordinator_term") == term + 1
    assert _metric(standby, "shardserve_coordinator_takeovers_total") == 1


def _health(served: Served) -> int:
    stub = health_pb2_grpc.HealthStub(served.channel)
    request = health_pb2.HealthCheckRequest(service=COORDINATOR.full_name)
    return stub.Check(request, timeout=TIMEOUT).status


def test_the_coordinator_service_is_serving_on_the_leader_only(pair):
    leader, standby = pair
    assert _health(leader) == health_pb2.HealthCheckResponse.SERVING
    assert _health(standby) == health_pb2.HealthCheckResponse.NOT_SERVING
    leader.close()
    wait_until(
        lambda: _health(standby) == health_pb2.HealthCheckResponse.SERVING,
        10 * LEASE_S,
        "the new leader's Coordinator service to serve",
    )
