"""Refresh-and-retry for reads made at a cached version.

A read names the version its metadata is at; when a rank no longer serves it
(stale, not found, rank gone), the caller refreshes and reads again, whole, so
a result never mixes versions. Writers may publish several versions while one
read is in flight (ranks keep a replaced version readable for their
--version-grace, so this is rare), so the read is retried until its deadline
(the client's timeout) while the error is StaleVersionError, MIN_ATTEMPTS times for the other retryable
errors (a rank gone, the tensor not found): at once when a refresh
brings a newer version, and after a pause (SAME_VERSION_PAUSE_S, doubling up
to MAX_PAUSE_S) when it brings the same one, as a new version is READY in the
catalog a moment before its ranks serve it. An error that outlasts the
deadline is raised. A read that finds a box lost (ShardsLostError) is not retried,
and a refresh that finds the tensor deleted raises TensorNotFoundError.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

from shardserve.client import counters
from shardserve.client.errors import (
    RankUnavailableError,
    ShardsLostError,
    StaleVersionError,
    TensorNotFoundError,
)

T = TypeVar("T")

RETRYABLE = (StaleVersionError, TensorNotFoundError, RankUnavailableError)
MIN_ATTEMPTS = 5
DEFAULT_DEADLINE_S = 30.0
SAME_VERSION_PAUSE_S = 0.05  # then 0.1, 0.2, 0.2, ...
MAX_PAUSE_S = 0.2


def read_with_refresh(
    attempt: Callable[[], T],
    refresh: Callable[[], Hashable],
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> T:
    """attempt(); on a retryable error refresh() (returning the versions now cached) and attempt again, until
    `deadline_s` seconds have passed (and at least MIN_ATTEMPTS attempts were made)."""
    seen: Hashable = None
    pause = SAME_VERSION_PAUSE_S
    give_up = time.monotonic() + deadline_s
    tries = 0
    while True:
        tries += 1
        try:
            return attempt()
        except ShardsLostError:
            raise  # no live copy: asking again does not bring one back
        except RETRYABLE as err:
            if tries >= MIN_ATTEMPTS and (
                not isinstance(err, StaleVersionError) or time.monotonic() >= give_up
            ):
                raise
            counters.count("retries")
            versions = refresh()
            if (
                tries > 1 and versions == seen
            ):  # nothing newer: a version being promoted, or a real error
                time.sleep(min(pause, max(0.0, give_up - time.monotonic())))
                pause = min(2 * pause, MAX_PAUSE_S)
            seen = versions
