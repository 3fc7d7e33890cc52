"""The gate of every Coordinator call (CoordinatorRole and `led`): a standby refuses with NOT_LEADER naming the
leader it saw; a leader serves until its serving time, then refuses by its own clock; a call whose term ended
under it fails with NOT_LEADER whatever it failed with (unary and streaming), while a call that fails in a
term still held keeps its own error."""

from __future__ import annotations

import math

import grpc
import pytest
from fake_clock import FakeClock

from shardserve.protos.errors import Reason
from shardserve.server.common.errors import InvalidArgument, NotLeader
from shardserve.server.coordinator.catalog.leadership import Lease
from shardserve.server.coordinator.role import CoordinatorRole, led
from shardserve.server.coordinator.role_view import Role

PARTS = object()  # what a term's server would be: the role hands it out and never looks inside


class Servicer:
    """A servicer of two calls gated by `led`: each runs `inside` (which may end the term) and raises `error`."""

    def __init__(self, role: CoordinatorRole) -> None:
        self.role = role
        self.inside = lambda: None
        self.error: Exception = InvalidArgument("name: bad")

    @led
    def Unary(self, request: object, context: object) -> object:
        self.inside()
        raise self.error

    @led
    def Stream(self, request: object, context: object):
        yield 1
        self.inside()
        raise self.error


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_standby_refuses_naming_the_leader_it_saw(clock):
    role = CoordinatorRole("b:1", lease_duration=2.0, clock=clock)
    with pytest.raises(NotLeader) as refused:
        role.leading()
    assert refused.value.metadata == {"leader": ""}  # none seen yet
    role.saw(Lease("a:1", 4))
    with pytest.raises(NotLeader) as named:
        Servicer(role).Unary(None, None)
    assert named.value.code == grpc.StatusCode.UNAVAILABLE
    assert named.value.reason == Reason.NOT_LEADER
    assert named.value.metadata == {"leader": "a:1", "term": 4}
    assert (role.view().role, role.view().leader, role.view().leader_term) == (
        Role.STANDBY,
        "a:1",
        4,
    )


def test_a_leader_serves_until_its_time_then_refuses_by_its_own_clock(clock):
    role = CoordinatorRole("a:1", lease_duration=2.0, clock=clock)
    role.lead(3, PARTS, serve_until=clock() + 1.5)  # type: ignore[arg-type]
    assert role.leading() is PARTS and role.view().role == Role.LEADER
    clock.advance(1.0)
    role.extend(3, serve_until=clock() + 1.5)
    clock.advance(1.4)
    assert role.term() == 3
    clock.advance(0.1)
    with pytest.raises(NotLeader) as refused:
        role.leading()
    assert refused.value.metadata == {"leader": ""}  # it knows no other leader
    assert role.view().role == Role.STANDBY and role.view().term == 0


def test_a_call_whose_term_ended_under_it_fails_not_leader(clock):
    role = CoordinatorRole("a:1", lease_duration=2.0, clock=clock)
    role.lead(3, PARTS, serve_until=math.inf)  # type: ignore[arg-type]
    servicer = Servicer(role)
    with pytest.raises(InvalidArgument):  # the term still held: the call's own error
        servicer.Unary(None, None)
    with pytest.raises(InvalidArgument):
        list(servicer.Stream(None, None))

    def deposed() -> None:
        role.step_down()
        role.saw(Lease("b:1", 4))

    servicer.inside = deposed
    with pytest.raises(NotLeader) as unary:
        servicer.Unary(None, None)
    assert unary.value.metadata == {"leader": "b:1", "term": 4}
    role.lead(5, PARTS, serve_until=math.inf)  # type: ignore[arg-type]
    stream = servicer.Stream(None, None)
    assert next(stream) == 1  # under way when the term ends
    with pytest.raises(NotLeader):
        next(stream)


def test_a_lone_coordinator_leads_for_good():
    role = CoordinatorRole.sole(PARTS)  # type: ignore[arg-type]
    assert role.leading() is PARTS
    assert (role.view().role, role.view().term, role.view().takeovers) == (Role.LEADER, 0, 0)
