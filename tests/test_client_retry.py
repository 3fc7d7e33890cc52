"""read_with_refresh: retried while refreshes bring newer versions, raised when they stop."""
import pytest

from client.errors import RankUnavailableError, StaleVersionError
from client.retry import MAX_ATTEMPTS, read_with_refresh


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


def test_a_refresh_that_changes_nothing_raises_the_error() -> None:
    attempt, calls = _reader(5, RankUnavailableError("rank 1 down"))
    with pytest.raises(RankUnavailableError, match="rank 1 down"):
        read_with_refresh(attempt, lambda: 7)
    assert calls["attempts"] == 2  # the first refresh is always tried; the second found nothing new


def test_attempts_are_bounded_even_when_versions_keep_moving() -> None:
    attempt, calls = _reader(100, StaleVersionError("version gone"))
    versions = iter(range(100))
    with pytest.raises(StaleVersionError):
        read_with_refresh(attempt, lambda: next(versions))
    assert calls["attempts"] == MAX_ATTEMPTS


def test_other_errors_are_not_retried() -> None:
    attempt, calls = _reader(1, ValueError("bad box"))
    with pytest.raises(ValueError):
        read_with_refresh(attempt, lambda: 1)
    assert calls["attempts"] == 1
