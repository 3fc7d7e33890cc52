"""client.health.RankHealth and client.paths.chain.FallbackChain without processes: leases on a fake clock,
fake ranks and fake data paths."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from fake_clock import FakeClock

from shardserve.client.errors import (
    InvalidArgumentError,
    RankUnavailableError,
    ShardServeError,
    ShardsLostError,
)
from shardserve.client.health import LEASE_S, RETRY_AFTER_S, UNREACHABLE_S, RankHealth
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.bulk import BulkReadError
from shardserve.client.paths.chain import FallbackChain
from shardserve.client.paths.kinds import PathKind, parse_transport
from shardserve.client.ranks import RankDirectory
from shardserve.core.metadata import ShardMetadata, TensorProperties
from shardserve.core.specs import EnumerableShardingSpec


class Coordinator:
    """ListRanks answers: `alive` per rank, counting the calls."""

    def __init__(self, alive: dict[int, bool]) -> None:
        self.alive = alive
        self.calls = 0

    def list_ranks(self) -> list[RankStatus]:
        self.calls += 1
        return [_rank(rank, alive) for rank, alive in self.alive.items()]


def _rank(number: int, alive: bool = True) -> RankStatus:
    return RankStatus(number, f"10.0.0.{number}:1", "cpu", "elsewhere", alive, 0, 0, 1, 0.0)


def _health(alive: dict[int, bool]) -> tuple[RankHealth, Coordinator, FakeClock]:
    clock, coordinator = FakeClock(), Coordinator(alive)
    directory = RankDirectory(coordinator.list_ranks, "coordinator:1", clock=clock)
    directory.refresh()
    return RankHealth(directory, clock=clock), coordinator, clock


def _mirrored(clock: FakeClock, unavailable: frozenset[int] = frozenset()) -> TensorSummary:
    """Rows 0-3 on ranks 0 and 1 (shards 0, 1), rows 4-7 on rank 2 alone (shard 2)."""
    shards = [
        ShardMetadata((0, 0), (4, 2), "rank:0/cpu"),
        ShardMetadata((0, 0), (4, 2), "rank:1/cpu"),
        ShardMetadata((4, 0), (4, 2), "rank:2/cpu"),
    ]
    meta = EnumerableShardingSpec(tuple(shards)).build_metadata(
        (8, 2), TensorProperties(dtype=torch.float32)
    )
    return TensorSummary("t", 1, meta, "READY", 64, 0.0, unavailable, answered_at=clock())


def test_a_dead_rank_is_a_lease_asked_again_once_it_is_old():
    health, coordinator, clock = _health({0: True, 1: True, 2: False})
    summary = _mirrored(clock)
    clock.now += 0.1
    health.ranks.refresh()  # a newer answer than the summary's
    assert health.unavailable_shards(summary) == {2}
    calls = coordinator.calls
    clock.now += LEASE_S / 2
    assert (
        health.unavailable_shards(summary) == {2} and coordinator.calls == calls
    )  # within the lease
    coordinator.alive[2] = True  # restarted and restored: the coordinator sees it alive
    clock.now += LEASE_S
    assert health.unavailable_shards(summary) == frozenset() and coordinator.calls == calls + 1
    clock.now += 10 * LEASE_S
    health.unavailable_shards(summary)
    assert coordinator.calls == calls + 1  # nothing concluded: no question asked


def test_the_watchdog_asks_the_coordinator_at_most_once_per_lease():
    health, coordinator, clock = _health({0: True, 1: True})
    calls = coordinator.calls
    assert health.rank_reported_dead(1) is None and coordinator.calls == calls
    coordinator.alive[1] = False
    clock.now += LEASE_S
    err = health.rank_reported_dead(1)
    assert isinstance(err, RankUnavailableError) and "reports it dead" in str(err)
    assert health.rank_reported_dead(1) is not None and coordinator.calls == calls + 1


def test_an_unreachable_rank_is_read_last_until_its_lease_runs_out_then_the_coordinator_is_asked():
    health, coordinator, clock = _health({0: True, 1: True, 2: True})
    summary = _mirrored(clock)
    health.note_failure(0, RankUnavailableError("rank 0: connection refused"))
    health.note_failure(1, ShardsLostError("lost"))  # not a verdict about reaching rank 1
    health.note_failure(2, InvalidArgumentError("bad box"))
    assert health.suspect_shards(summary) == {0}
    assert health.other_copies(summary, 1) == [0]  # suspect, yet the only other copy: still asked
    assert health.other_copies(summary, 0) == [1]
    calls = coordinator.calls
    clock.now += UNREACHABLE_S
    assert health.suspect_shards(summary) == frozenset()
    health.unavailable_shards(
        summary
    )  # the expired lease makes the next question ask the coordinator
    assert coordinator.calls == calls + 1


def test_a_summary_naming_unreadable_copies_expires():
    health, _, clock = _health({0: True, 1: True, 2: True})
    healthy, lost = _mirrored(clock), _mirrored(clock, frozenset({2}))
    clock.now += LEASE_S
    assert health.summary_expired(lost) and not health.summary_expired(healthy)


def test_a_path_back_off_is_a_lease():
    health, _, clock = _health({0: True})
    health.back_off(PathKind.BULK, "10.0.0.0:1")
    assert health.backing_off(PathKind.BULK, "10.0.0.0:1")
    assert not health.backing_off(PathKind.SHARED_MEMORY, "10.0.0.0:1")
    clock.now += RETRY_AFTER_S
    assert not health.backing_off(PathKind.BULK, "10.0.0.0:1")


class FakePath:
    """A data path whose reads fail with `errors` in turn (then answer), recording each attempt."""

    def __init__(self, kind: PathKind, errors: Sequence[ShardServeError] = (), serves: bool = True):
        self.kind = kind
        self.errors = list(errors)
        self.serves = serves
        self.attempts = 0

    def supports(self, rank: RankStatus, summary: TensorSummary | None = None) -> bool:
        return self.serves

    def refusal(self, rank: RankStatus) -> ShardServeError:
        return BulkReadError(f"{self.kind} cannot serve rank {rank.rank}")

    def attempt(self) -> str:
        self.attempts += 1
        if self.errors:
            raise self.errors.pop(0)
        return f"bytes by {self.kind}"


def _chain(*paths: FakePath, forced: bool = False) -> tuple[FallbackChain, FakeClock]:
    health, _, clock = _health({0: True})
    return FallbackChain(paths, health, forced=forced), clock  # type: ignore[arg-type]


def test_a_path_failure_falls_back_to_the_next_path_and_logs_once(caplog):
    fast = FakePath(PathKind.BULK, [BulkReadError("connection reset")])
    slow = FakePath(PathKind.GRPC)
    chain, _ = _chain(fast, slow)
    rank = _rank(0)
    assert chain.run(rank, lambda path: path.attempt()) == ("bytes by grpc", PathKind.GRPC)  # type: ignore[attr-defined]
    assert "bulk TCP read from rank 0 failed; reading it over gRPC for 30 s" in caplog.text
    caplog.clear()
    assert chain.run(rank, lambda path: path.attempt())[1] is PathKind.GRPC  # type: ignore[attr-defined]
    assert fast.attempts == 1 and caplog.text == ""  # backing off: neither tried nor logged again


def test_a_request_error_is_raised_not_fallen_back_on():
    fast = FakePath(PathKind.BULK, [InvalidArgumentError("offsets: out of range")])
    slow = FakePath(PathKind.GRPC)
    chain, _ = _chain(fast, slow)
    with pytest.raises(InvalidArgumentError):
        chain.run(_rank(0), lambda path: path.attempt())  # type: ignore[attr-defined]
    assert slow.attempts == 0
    assert chain.first(_rank(0)) is fast  # no back-off either


def test_the_fast_path_is_tried_again_once_its_back_off_ran_out():
    fast = FakePath(PathKind.SHARED_MEMORY, [BulkReadError("mapping refused")])
    slow = FakePath(PathKind.GRPC)
    chain, clock = _chain(fast, slow)
    rank = _rank(0)
    assert chain.run(rank, lambda path: path.attempt())[1] is PathKind.GRPC  # type: ignore[attr-defined]
    assert chain.first(rank) is slow
    clock.now += RETRY_AFTER_S
    assert chain.first(rank) is fast
    assert chain.run(rank, lambda path: path.attempt())[1] is PathKind.SHARED_MEMORY  # type: ignore[attr-defined]


def test_a_forced_path_raises_its_failure_and_its_refusal():
    refused = FakePath(PathKind.BULK, [BulkReadError("no bulk port")])
    chain, _ = _chain(refused, forced=True)
    with pytest.raises(BulkReadError, match="no bulk port"):
        chain.run(_rank(0), lambda path: path.attempt())  # type: ignore[attr-defined]
    elsewhere = FakePath(PathKind.SHARED_MEMORY, serves=False)
    chain, _ = _chain(elsewhere, forced=True)
    with pytest.raises(BulkReadError, match="cannot serve rank 0"):
        chain.run(_rank(0), lambda path: path.attempt())  # type: ignore[attr-defined]


def test_transport_strings_parse_into_path_kinds():
    assert parse_transport("auto") is None
    assert parse_transport("bulk") is PathKind.BULK and PathKind.BULK == "bulk"
    with pytest.warns(
        DeprecationWarning, match="transport='tcp' is deprecated; use transport='bulk'"
    ):
        assert parse_transport("tcp") is PathKind.BULK  # the bulk path's old name
    assert str(PathKind.SHARED_MEMORY) == "shm" and f"{PathKind.GRPC}" == "grpc"
    with pytest.raises(ValueError, match="transport must be one of"):
        parse_transport("rdma")


def test_a_recent_rank_list_is_reused_and_an_old_one_asked_again():
    clock, coordinator = FakeClock(), Coordinator({0: True, 1: True})
    directory = RankDirectory(coordinator.list_ranks, "coordinator:1", clock=clock)
    assert [r.rank for r in directory.recent(1.0)] == [0, 1]  # never asked: asks
    assert coordinator.calls == 1
    coordinator.alive[1] = False
    clock.now += 0.5
    assert all(r.alive for r in directory.recent(1.0))  # half a second old: kept
    assert coordinator.calls == 1
    clock.now += 0.6
    assert [r.alive for r in directory.recent(1.0)] == [True, False]
    assert coordinator.calls == 2
