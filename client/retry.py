"""Refresh-and-retry for reads made at a cached version.

A read names the version its metadata is at; when a rank no longer serves it
(stale, not found, rank gone), the caller refreshes and reads again, whole, so
a result never mixes versions. Writers may publish several versions while one
read is in flight, so the read is retried as long as each refresh brings a
newer version, up to `MAX_ATTEMPTS`; when a refresh changes nothing the error
is real and is raised.
"""
from __future__ import annotations

from typing import Callable, Hashable, TypeVar

from client.errors import RankUnavailableError, StaleVersionError, TensorNotFoundError

T = TypeVar("T")

RETRYABLE = (StaleVersionError, TensorNotFoundError, RankUnavailableError)
MAX_ATTEMPTS = 5


def read_with_refresh(attempt: Callable[[], T], refresh: Callable[[], Hashable],
                      max_attempts: int = MAX_ATTEMPTS) -> T:
    """attempt(); on a retryable error refresh() (returning the versions now cached) and attempt again."""
    seen: Hashable = None
    for tries in range(1, max_attempts + 1):
        try:
            return attempt()
        except RETRYABLE:
            if tries == max_attempts:
                raise
            versions = refresh()
            if tries > 1 and versions == seen:
                raise
            seen = versions
    raise AssertionError("unreachable")
