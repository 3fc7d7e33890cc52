"""read_with_refresh: retried while refreshes bring newer versions, raised when they stop."""

import pytest

from shardserve.client.errors import RankUnavailableError, StaleVersionError, TensorNotFoundError
from shardserve.client.retry import MIN_ATTEMPTS, read_with_refresh


def _reader(failures: int, error: Exception):
    calls = {"attempts": 0}

    def attempt() -> str:
        calls["attempts"] += 1
        if calls["attempts"] <= failures:
            raise error
        return "data"

    return attempt, calls


def test_retries_while_each_refresh_brings_a_newer_version() -> None:
    attempt, calls = _reader(3, StaleVersionError("version gone"))
    versions = iter(range(10, 20))
    assert read_with_refresh(attempt, lambda: next(versions)) == "data"
    assert calls["attempts"] == 4


def test_a_refresh_that_changes_nothing_is_retried_after_a_pause_then_raised(monkeypatch) -> None:
    import shardserve.client.retry as retry

    pauses: list[float] = []
    monkeypatch.setattr(retry.time, "sleep", pauses.append)
    attempt, calls = _reader(5, TensorNotFoundError("no tensor 't'"))  # deleted, maybe put again
    with pytest.raises(TensorNotFoundError, match="no tensor"):
        read_with_refresh(attempt, lambda: 7)
    assert calls["attempts"] == MIN_ATTEMPTS and pauses == [
        0.05,
        0.1,
        0.2,
    ]  # 0.35 s before giving up
    attempt, calls = _reader(
        2, StaleVersionError("version 7 not served yet")
    )  # a reshard being promoted
    assert read_with_refresh(attempt, lambda: 7) == "data" and calls["attempts"] == 3


def test_a_stale_version_is_retried_until_the_deadline_then_raised(monkeypatch) -> None:
    import shardserve.client.retry as retry

    now = [0.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])

    def attempt() -> str:
        now[0] += 1.0  # each attempt takes a second of the deadline
        raise StaleVersionError("version gone")

    versions = iter(range(100))
    with pytest.raises(StaleVersionError):
        read_with_refresh(attempt, lambda: next(versions), deadline_s=12.0)
    assert (
        now[0] == 12.0
    )  # retried past MIN_ATTEMPTS until the deadline, versions moving all the while
    attempt, calls = _reader(30, StaleVersionError("version gone"))
    versions = iter(range(100))
    assert read_with_refresh(attempt, lambda: next(versions), deadline_s=60.0) == "data"
    assert calls["attempts"] == 31


def test_a_rank_unavailable_is_retried_until_the_deadline_then_raised(monkeypatch) -> None:
    """A rank down, hung or restoring may come back: the read waits for it, within its deadline."""
    import shardserve.client.retry as retry

    now = [0.0]
    monkeypatch.setattr(retry.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(retry.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))

    def attempt() -> str:
        now[0] += 0.5
        raise RankUnavailableError("rank 1 down")

    with pytest.raises(RankUnavailableError, match="rank 1 down"):
        read_with_refresh(attempt, lambda: 7, deadline_s=10.0)
    assert 10.0 <= now[0] <= 11.0  # past MIN_ATTEMPTS, until the deadline
    attempt, calls = _reader(12, RankUnavailableError("rank 1 restoring"))
    assert read_with_refresh(attempt, lambda: 7, deadline_s=60.0) == "data"


def test_other_errors_are_not_retried() -> None:
    attempt, calls = _reader(1, ValueError("bad box"))
    with pytest.raises(ValueError):
        read_with_refresh(attempt, lambda: 1)
    assert calls["attempts"] == 1


def test_a_lost_box_is_raised_at_once_not_retried() -> None:
    from shardserve.client.errors import ShardsLostError

    attempt, calls = _reader(5, ShardsLostError("box lost", boxes=(((0,), (4,)),), ranks=(1,)))
    with pytest.raises(ShardsLostError, match="box lost"):
        read_with_refresh(attempt, lambda: 7)
    assert calls["attempts"] == 1
