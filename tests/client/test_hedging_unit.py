"""The hedging pieces without processes: which copies a hedge asks, and how a race between a primary call and its
hedge ends (client.paths.hedging)."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from shardserve.client.errors import RankUnavailableError, ShardServeError
from shardserve.client.health import other_copies
from shardserve.client.paths.hedging import Cancellation, Race, Watchdog, hedge_delay
from shardserve.core.metadata import ShardMetadata, TensorProperties
from shardserve.core.specs import EnumerableShardingSpec

MIRRORED = EnumerableShardingSpec(
    [
        ShardMetadata((0, 0), (4, 2), "rank:1/cpu"),
        ShardMetadata((0, 0), (4, 2), "rank:0/cpu"),
        ShardMetadata((0, 0), (4, 2), "rank:2/cpu"),
        ShardMetadata((4, 0), (4, 2), "rank:1/cpu"),
    ]
).build_metadata((8, 2), TensorProperties(dtype=torch.float32))
WAIT_S = 10.0


def test_other_copies_skip_the_same_rank_unavailable_ones_and_put_suspects_last() -> None:
    assert other_copies(MIRRORED, 0) == [1, 2]
    assert other_copies(MIRRORED, 0, suspect={1}) == [2, 1]
    assert other_copies(MIRRORED, 0, unavailable={2}) == [1]
    assert other_copies(MIRRORED, 3) == []  # rows 4-7 have one copy


def test_hedge_delay_grows_with_the_bytes() -> None:
    assert hedge_delay(0.1, 0) == pytest.approx(0.1)
    assert hedge_delay(0.1, 500_000_000) == pytest.approx(1.1)


def test_cancellation_runs_hooks_once_and_late_hooks_at_once() -> None:
    cancel, seen = Cancellation(), []
    cancel.on_cancel(lambda: seen.append("early"))
    cancel.cancel()
    cancel.cancel()
    cancel.on_cancel(lambda: seen.append("late"))
    assert seen == ["early", "late"] and cancel.cancelled


def _race(hedge: object) -> Race:
    return Race(1, hedge, time.monotonic(), 0.0, float("inf"))  # type: ignore[arg-type]


def test_a_hedge_that_answers_first_wins_and_cancels_the_primary() -> None:
    landed = []
    race = _race(lambda cancel: ("bulk", lambda: landed.append("hedge")))
    race.hedged = True
    race.run_hedge()
    assert race.hedge_won and race.primary.cancelled
    path, land = race.primary_failed(
        ShardServeError("cancelled")
    )  # the primary's call ends once cancelled
    land()
    assert path == "bulk" and landed == ["hedge"]


def test_a_primary_that_answers_first_wins_and_cancels_the_hedge() -> None:
    hedge_cancel: list[Cancellation] = []
    started = threading.Event()

    def hedge(cancel: Cancellation) -> tuple[str, object]:
        hedge_cancel.append(cancel)
        started.set()
        stopped = threading.Event()
        cancel.on_cancel(stopped.set)
        assert stopped.wait(WAIT_S)
        raise ShardServeError("cancelled")

    race = _race(hedge)
    race.hedged = True
    thread = threading.Thread(target=race.run_hedge)
    thread.start()
    assert started.wait(WAIT_S)
    race.primary_done()
    thread.join(WAIT_S)
    assert race.outcome == "primary" and hedge_cancel[0].cancelled and not race.primary.cancelled


def test_a_rank_reported_dead_ends_the_race_with_its_error() -> None:
    race = _race(None)
    dead = RankUnavailableError("rank 1 at h:1 did not answer and the coordinator reports it dead")
    race.rank_dead(dead)
    assert race.primary.cancelled
    with pytest.raises(RankUnavailableError, match="rank 1"):
        race.primary_failed(ShardServeError("cancelled"))


def test_other_errors_of_the_primary_are_raised_as_they_are() -> None:
    with pytest.raises(ValueError):
        _race(None).primary_failed(ValueError("bad box"))


def test_the_watchdog_hedges_a_silent_primary_and_checks_its_rank() -> None:
    """A primary blocked until cancelled: the watchdog starts the hedge after the delay, which wins."""
    checked = threading.Event()

    def rank_dead(rank: int) -> RankUnavailableError | None:
        checked.set()
        return None

    watchdog = Watchdog(0.01, rank_dead)
    try:
        race = watchdog.start(1, 0, lambda cancel: ("grpc", lambda: None))
        blocked = threading.Event()
        race.primary.on_cancel(blocked.set)
        assert blocked.wait(WAIT_S)  # the primary's call, cancelled by the winning hedge
        assert race.primary_failed(ShardServeError("cancelled"))[0] == "grpc"
        watchdog.finish(race)
        silent = watchdog.start(2, 0, None)
        assert checked.wait(
            WAIT_S
        )  # no other copy: its rank's liveness is asked (after CHECK_EVERY_S)
        watchdog.finish(silent)
    finally:
        watchdog.close()


class _Buffer:
    """Stands for what a race's hedge holds (a read's target tensor, a mapping)."""


def test_an_idle_watchdog_keeps_no_finished_race_alive() -> None:
    watchdog = Watchdog(60.0, lambda rank: None)
    try:
        held = _Buffer()
        alive = weakref.ref(held)
        race = watchdog.start(1, 0, lambda cancel, held=held: ("grpc", lambda: None))
        time.sleep(0.1)  # the watchdog looks at the race at least once
        watchdog.finish(race)
        del race, held
        deadline = time.monotonic() + WAIT_S
        while alive() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive() is None
    finally:
        watchdog.close()


def test_close_ends_the_watchdog_thread() -> None:
    """A watchdog thread still letting go of buffers while the interpreter exits aborts the process."""
    before = set(threading.enumerate())
    watchdog = Watchdog(60.0, lambda rank: None)
    watchdog.finish(watchdog.start(1, 0, None))
    watchdog.close()
    assert not [
        t for t in threading.enumerate() if t not in before and t.name == "shardserve-watchdog"
    ]
