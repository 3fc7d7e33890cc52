"""RankRegistry re-admission in-process: a restarted rank (new pid, new address) is refused while its old
incarnation still looks alive, admitted once that one is known dead (exited or out of heartbeats), and counted
as a restart; the same process registering again is not."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from shardserve.core.metadata import ShardedTensorMetadata, ShardMetadata
from shardserve.server.common.errors import (
    InvalidArgument,
    InvalidState,
    RankUnavailable,
    WorldMismatch,
)
from shardserve.server.coordinator.ranks.info import RankInfo, RestoreProgress
from shardserve.server.coordinator.ranks.registry import RankRegistry

DEAD_AFTER = 3.0
JUST = 0.01  # a moment past a bound


def incarnation(pid: int, port: int, rank: int = 0) -> RankInfo:
    return RankInfo(
        rank=rank,
        address=f"127.0.0.1:{port}",
        device="cpu",
        hostname="node-a",
        world_size=2,
        pid=pid,
    )


def restarts_of(registry: RankRegistry, rank: int = 0) -> int:
    return next(r.restarts for r in registry.ranks() if r.rank == rank)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock):
    registry = RankRegistry(dead_after=DEAD_AFTER, clock=clock)
    yield registry
    registry.close()


def test_a_restarted_rank_waits_for_its_old_incarnation_to_miss_its_heartbeats(registry, clock):
    registry.register(incarnation(pid=100, port=7001), [])
    clock.advance(DEAD_AFTER)  # no heartbeats: the old entry expires after DEAD_AFTER, not before
    with pytest.raises(RankUnavailable, match="registered at 127.0.0.1:7001 and alive"):
        registry.register(incarnation(pid=200, port=7002), [])
    clock.advance(JUST)
    assert not registry.rank_alive(0)
    registry.register(incarnation(pid=200, port=7002), [])
    [info] = registry.ranks()
    assert (info.pid, info.address, info.alive, info.restarts) == (200, "127.0.0.1:7002", True, 1)


def test_an_exited_rank_is_replaced_at_once_and_each_new_process_counts(registry):
    registry.register(incarnation(pid=100, port=7001), [])
    registry.mark_exited(0, "process 100 was killed by SIGKILL")
    registry.register(incarnation(pid=200, port=7002), [])
    assert restarts_of(registry) == 1
    registry.register(
        incarnation(pid=200, port=7002), []
    )  # the same process again (e.g. after NOT_FOUND)
    assert restarts_of(registry) == 1
    registry.mark_exited(0, "process 200 exited with code 1")
    registry.register(incarnation(pid=300, port=7003), [])
    assert restarts_of(registry) == 2 and registry.rank_alive(0)


def test_a_restoring_rank_is_listed_with_its_progress_until_it_is_restored(registry):
    registry.report_restore(
        RestoreProgress(
            rank=1,
            pid=300,
            hostname="node-b",
            done_bytes=10,
            total_bytes=40,
            done_tensors=1,
            total_tensors=4,
        )
    )
    listed = {r.rank: r for r in registry.ranks()}
    assert registry.restoring(1) and not registry.rank_alive(1) and not listed[1].alive
    assert (listed[1].pid, listed[1].restore.done_bytes, listed[1].restore.total_tensors) == (
        300,
        10,
        4,
    )
    registry.report_restore(
        RestoreProgress(
            rank=1,
            pid=300,
            done_bytes=40,
            total_bytes=40,
            done_tensors=4,
            total_tensors=4,
            loaded=True,
        )
    )
    registry.register(incarnation(pid=300, port=7003, rank=1), [])
    assert next(
        r for r in registry.ranks() if r.rank == 1
    ).restore.loaded  # until its versions are re-promoted
    registry.restore_done(1)
    assert (
        not registry.restoring(1)
        and next(r for r in registry.ranks() if r.rank == 1).restore is None
    )
    registry.report_restore(RestoreProgress(rank=2, pid=400, total_bytes=8, total_tensors=1))
    registry.mark_exited(2, "killed while restoring")  # its restore ended with its process
    assert not registry.restoring(2) and 2 not in {r.rank for r in registry.ranks()}
    with pytest.raises(InvalidArgument, match="done_tensors must be between 0 and total_tensors"):
        registry.report_restore(RestoreProgress(rank=1, done_tensors=2, total_tensors=1))


def test_changed_at_marks_registrations_exits_deaths_and_returns_not_heartbeats(registry, clock):
    registry.register(incarnation(pid=100, port=7001), [])
    registered = registry.changed_at()
    clock.advance(1.0)
    registry.heartbeat(0, 0)  # a live rank's heartbeat changes nothing
    assert registry.changed_at() == registered
    registry.register(incarnation(pid=101, port=7003, rank=1), [])
    assert registry.changed_at() == clock()
    clock.advance(0.25)
    registry.mark_exited(1, "process 101 was killed by SIGKILL")
    assert registry.changed_at() == clock()
    clock.advance(DEAD_AFTER + JUST)  # rank 0 stops heartbeating: dead, which the monitor reports
    assert registry.changed_at() < clock()
    registry.report_dead()
    assert registry.changed_at() == clock()
    clock.advance(0.5)
    registry.heartbeat(0, 0)  # back from the dead
    assert registry.changed_at() == clock() and registry.rank_alive(0)


def test_a_placement_on_a_rank_not_registered_yet_is_unavailable_then_invalid(registry, clock):
    """A coordinator that just began (a new leader, a restart) has not heard from every rank yet: a placement on
    one inside the registered world is RankUnavailable (retryable) for the unregistered grace, then invalid; one
    outside the world is invalid at once."""
    from shardserve.core.specs import ChunkShardingSpec

    registry.register(incarnation(pid=100, port=7001), [])  # rank 0 of a world of 2
    on_rank_1 = ChunkShardingSpec(0, ["rank:1/cpu"]).build_metadata((4,))
    on_rank_5 = ChunkShardingSpec(0, ["rank:5/cpu"]).build_metadata((4,))
    with pytest.raises(
        RankUnavailable, match="rank 1 has not registered with this coordinator yet"
    ):
        registry.check_placements(on_rank_1)
    with pytest.raises(InvalidArgument, match="rank 5 is not a registered rank"):
        registry.check_placements(on_rank_5)
    clock.advance(registry.heartbeats.unregistered_grace(2) + JUST)
    registry.heartbeat(0, 0)
    with pytest.raises(InvalidArgument, match="rank 1 is not a registered rank"):
        registry.check_placements(on_rank_1)


def test_a_registration_must_agree_with_the_live_ranks_world_and_addresses(registry, clock):
    """Checked without walking every rank: a world size no live rank has is refused (a dead rank's is not held
    against it), an address a live rank holds is refused, and an address a rank left for another is free."""
    registry.register(incarnation(pid=100, port=7001), [])
    with pytest.raises(WorldMismatch, match="differs from the world size 2 of registered rank 0"):
        registry.register(
            RankInfo(rank=1, address="127.0.0.1:7002", device="cpu", world_size=3), []
        )
    with pytest.raises(InvalidState, match="127.0.0.1:7001 is registered by rank 0"):
        registry.register(incarnation(pid=200, port=7001, rank=1), [])
    registry.mark_exited(0, "process 100 was killed by SIGKILL")
    registry.register(incarnation(pid=101, port=7005), [])  # rank 0 again, at another address
    registry.register(incarnation(pid=200, port=7001, rank=1), [])  # 7001 is free now
    registry.mark_exited(0, "process 101 was killed by SIGKILL")
    registry.mark_exited(1, "process 200 was killed by SIGKILL")
    registry.register(RankInfo(rank=0, address="127.0.0.1:7009", device="cpu", world_size=3), [])
    assert [(r.rank, r.world_size, r.alive) for r in registry.ranks()] == [
        (0, 3, True),
        (1, 2, False),
    ]


def test_placements_are_checked_once_each_and_a_bad_one_named_by_its_first_shard(registry):
    """A layout repeats a few placements over many shards: each is checked once, and the error names the first
    shard with a placement that fails (a dead rank, another device), whichever placements came before."""
    registry.register(incarnation(pid=100, port=7001), [])
    registry.register(incarnation(pid=200, port=7002, rank=1), [])

    def layout(*placements: str) -> ShardedTensorMetadata:
        return ShardedTensorMetadata(
            tuple(ShardMetadata((i,), (1,), p) for i, p in enumerate(placements)),
            (len(placements),),
        )

    fine = layout(*["rank:0/cpu", "rank:1/cpu"] * 50)
    registry.check_placements(fine)
    with pytest.raises(InvalidArgument, match=r"shards_metadata\[7\]\.placement rank:0/cuda:0"):
        registry.check_placements(layout(*["rank:0/cpu"] * 7, "rank:0/cuda:0", "rank:1/cpu"))
    registry.mark_exited(1, "process 200 was killed by SIGKILL")
    with pytest.raises(RankUnavailable, match=r"shards_metadata\[1\]\.placement rank:1/cpu"):
        registry.check_placements(fine)
    registry.check_placements(
        fine, skip=frozenset(range(1, 100, 2))
    )  # every shard on rank 1 skipped
