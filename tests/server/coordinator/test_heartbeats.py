"""Heartbeat intervals that grow with the cluster: the coordinator tells each rank an interval that keeps all its
ranks within the heartbeat rate, at registration and in every heartbeat answer; a rank is dead once silent for
twice the interval it was told. In-process with a fake clock, and end to end with real CoordinatorLinks
against a served coordinator."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock
from waiting import wait_until

from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.protos.same_host import host_id
from shardserve.server.common.auth import Security
from shardserve.server.common.grpc_server import start_server
from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.options import CoordinatorOptions
from shardserve.server.coordinator.ranks.heartbeats import HeartbeatPolicy
from shardserve.server.coordinator.ranks.info import RankInfo
from shardserve.server.coordinator.ranks.registry import RankRegistry
from shardserve.server.coordinator.role import CoordinatorRole
from shardserve.server.coordinator.server import CoordinatorServer
from shardserve.server.coordinator.service import CoordinatorServicer
from shardserve.server.rank.coordinator_link import CoordinatorLink, wait_before_next
from shardserve.server.rank.coordinators import Coordinators
from shardserve.server.rank.store import ShardStore

JUST = 0.01


def info(rank: int, world: int = 1000) -> RankInfo:
    return RankInfo(
        rank=rank, address=f"127.0.0.1:{7000 + rank}", device="cpu", world_size=world, pid=rank
    )


def test_the_interval_keeps_the_registered_ranks_within_the_rate():
    policy = HeartbeatPolicy(interval=1.0, rate=200.0)
    assert [policy.interval_for(n) for n in (1, 200, 400, 1000)] == [1.0, 1.0, 2.0, 5.0]
    assert HeartbeatPolicy(interval=1.0, rate=0).interval_for(10_000) == 1.0  # no limit
    assert policy.dead_after_for(5.0) == 10.0
    assert HeartbeatPolicy(dead_after=3.0).dead_after_for(5.0) == 3.0  # fixed
    for bad in ({"interval": 0}, {"rate": -1.0}, {"dead_after": 0.0}):
        with pytest.raises(ValueError):
            HeartbeatPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--heartbeat-rate"):
        CoordinatorOptions(heartbeat_rate=-1.0)


def test_each_rank_is_told_the_interval_of_its_whole_world_from_its_registration_and_judged_by_it():
    """The first ranks of a world registering at once are told the interval of all of them (so that the
    heartbeats of a thousand ranks starting together stay within the rate from the start), not that of the
    few registered so far."""
    clock = FakeClock()
    registry = RankRegistry(clock=clock, heartbeats=HeartbeatPolicy(interval=1.0, rate=2.0))
    registry.register(info(0, world=6), [])
    assert registry.interval_of(0) == 3.0  # six ranks at 2 heartbeats a second: every 3 s
    for rank in range(1, 6):
        registry.register(info(rank, world=6), [])
    assert registry.interval_of(5) == registry.interval_of(0) == 3.0
    assert registry.heartbeat(0, memory_used=123) == (False, 3.0)
    clock.advance(2 * 3.0)
    assert registry.rank_alive(0)  # silent for twice its interval: not yet dead
    clock.advance(JUST)
    assert not registry.rank_alive(0) and registry.dead_for(0) == pytest.approx(JUST)
    assert registry.heartbeat(0, memory_used=456) == (True, 3.0)  # back from the dead
    [rank0] = [r for r in registry.ranks() if r.rank == 0]
    assert rank0.alive and rank0.memory_used_bytes == 456 and rank0.last_heartbeat_unix > 0
    registry.close()


def test_more_registered_ranks_than_the_world_declares_lengthen_the_interval():
    """Ranks of an older, larger world still registered (dead ones that have not expired) count until they go:
    the coordinator takes their heartbeats too should they come back."""
    clock = FakeClock()
    registry = RankRegistry(clock=clock, heartbeats=HeartbeatPolicy(interval=1.0, rate=2.0))
    for rank in range(8):
        registry.register(info(rank, world=8), [])
    assert registry.interval_of(7) == 4.0
    clock.advance(2 * 4.0 + JUST)  # all silent: dead, and a world of 2 may register
    registry.register(info(0, world=2), [])
    assert registry.interval_of(0) == 4.0  # eight registered ranks, not the 2 declared
    registry.close()


def test_a_rank_a_restarted_coordinator_never_heard_from_is_dead_after_the_worlds_silence_and_a_reregistration():
    """A rank that outlived a coordinator restart registers again at its next heartbeat: one that does not is
    dead once the silence that marks a registered rank dead has passed, at the interval the registered world
    is told (longer for a large world under the rate), and REREGISTER_S more."""
    from shardserve.server.coordinator.ranks.heartbeats import REREGISTER_S

    policy = HeartbeatPolicy(interval=0.5, rate=100.0)
    assert policy.unregistered_grace(0) == policy.unregistered_grace(3) == 2 * 0.5 + REREGISTER_S
    assert (
        policy.unregistered_grace(1000) == 2 * 10.0 + REREGISTER_S
    )  # told 10 s at 100 heartbeats/s
    clock = FakeClock()
    registry = RankRegistry(clock=clock, heartbeats=policy)
    registry.register(info(0), [])  # rank 0 of 1,000
    clock.advance(2 * 10.0 + REREGISTER_S - JUST)
    registry.heartbeat(0, memory_used=0)
    assert registry.dead_for(999) is None and not registry.rank_dead(999)
    clock.advance(2 * JUST)
    assert registry.dead_for(999) == pytest.approx(JUST) and registry.rank_dead(999)
    assert registry.rank_alive(0)
    registry.close()


def test_links_adopt_the_interval_their_heartbeat_answers_tell(tmp_path):
    """Real CoordinatorLinks against a served coordinator: a link is told the interval of its world when it
    registers, and heartbeats at the longer one a heartbeat answer tells once the coordinator's rate is lower."""
    options = CoordinatorOptions(heartbeat_interval=0.05, heartbeat_rate=20.0)
    coordinator = CoordinatorServer(SQLiteCatalog(tmp_path / "catalog.sqlite"), options=options)
    coordinator.start()

    def add(server) -> list[str]:  # type: ignore[no-untyped-def]
        servicer = CoordinatorServicer(CoordinatorRole.sole(coordinator))
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        return [pb.DESCRIPTOR.services_by_name["Coordinator"].full_name]

    running = start_server("127.0.0.1:0", Security(), add)
    store = ShardStore(0)
    rank = pb.RankInfo(
        rank=0, address="127.0.0.1:7000", device="cpu", world_size=4, pid=1, host_id=host_id()
    )
    link = CoordinatorLink(Coordinators([running.address], Security()), rank, store)
    try:
        link.register(timeout=30.0)
        assert link.interval == pytest.approx(
            0.2
        )  # a world of four at 20 heartbeats a second: every 0.2 s
        link.start()
        for other in (1, 2, 3):
            coordinator.registry.register(info(other, world=4), [])
        coordinator.registry.heartbeats = HeartbeatPolicy(interval=0.05, rate=10.0)  # every 0.4 s
        wait_until(lambda: link.interval == pytest.approx(0.4), 30.0, "the link told 0.4 s")
        assert coordinator.registry.interval_of(0) == pytest.approx(0.4)
    finally:
        link.stop()
        running.stop(grace=0.1)
        coordinator.close()


def test_heartbeats_start_an_interval_apart_however_long_the_answer_took():
    """A rank waits what is left of its interval after an answer, not a whole interval more: a coordinator
    slow to answer (a loaded host) still hears from it every interval."""
    assert wait_before_next(sent_at=10.0, now=10.1, interval=0.5) == pytest.approx(0.4)
    assert wait_before_next(sent_at=10.0, now=10.7, interval=0.5) == 0.0  # late: at once
    assert (
        wait_before_next(sent_at=10.0, now=9.0, interval=0.5) == 0.5
    )  # never more than an interval


def test_dead_after_is_a_coordinator_flag(capsys: pytest.CaptureFixture[str]):
    """`--dead-after` fixes the silence that marks a rank dead; a bad value is a usage error naming the flag."""
    import argparse

    from shardserve.server.coordinator_process import (
        add_coordinator_args,
        coordinator_options_from_args,
    )

    parser = argparse.ArgumentParser()
    add_coordinator_args(parser)
    options = coordinator_options_from_args(parser, parser.parse_args(["--dead-after", "6"]))
    assert options.heartbeats.dead_after_for(0.5) == 6.0
    default = coordinator_options_from_args(parser, parser.parse_args([]))
    assert default.heartbeats.dead_after_for(0.5) == 1.0
    with pytest.raises(SystemExit):
        coordinator_options_from_args(parser, parser.parse_args(["--dead-after", "0"]))
    assert "--dead-after must be > 0 seconds" in capsys.readouterr().err
