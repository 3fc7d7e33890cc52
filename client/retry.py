"""Refresh-and-retry for reads made at a cached version.

A read names the version its metadata is at; when a rank no longer serves it
(stale, not found, rank gone), the caller refreshes and reads again, whole, so
a result never mixes versions. Writers may publish several versions while one
read is in flight, so the read is retried, up to `MAX_ATTEMPTS`, at once when
a refresh brings a newer version and after a pause (SAME_VERSION_PAUSE_S,
doubling) when it brings the same one: a reshard's new version is READY in
the catalog a moment before its ranks serve it. An error that outlasts the
attempts is raised. A read that finds a box lost (ShardsLostError) is not retried.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable, TypeVar

from client.errors import RankUnavailableError, ShardsLostError, StaleVersionError, TensorNotFoundError

T = TypeVar("T")

RETRYABLE = (StaleVersionError, TensorNotFoundError, RankUnavailableError)
MAX_ATTEMPTS = 5
SAME_VERSION_PAUSE_S = 0.05  # then 0.1, 0.2: at most 0.35 s of pauses before the error is raised


def read_with_refresh(attempt: Callable[[], T], refresh: Callable[[], Hashable],
                      max_attempts: int = MAX_ATTEMPTS) -> T:
    """attempt(); on a retryable error refresh() (returning the versions now cached) and attempt again."""
    seen: Hashable = None
    pause = SAME_VERSION_PAUSE_S
    for tries in range(1, max_attempts + 1):
        try:
            return attempt()
        except ShardsLostError:
            raise  # no live copy: asking again does not bring one back
        except RETRYABLE:
            if tries == max_attempts:
                raise
            versions = refresh()
            if tries > 1 and versions == seen:  # nothing newer: a version being promoted, or a real error
                time.sleep(pause)
                pause *= 2
            seen = versions
    raise AssertionError("unreachable")
