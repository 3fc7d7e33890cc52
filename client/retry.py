"""Refresh-and-retry for reads made at a cached version.

A read names the version its metadata is at; when a rank no longer serves it
(stale, not found, rank gone), the caller refreshes and reads again, whole, so
a result never mixes versions. The read is retried until its deadline (the
client's timeout) while the error's reason is STALE_VERSION (writers may publish
several versions while one read is in flight) or RANK_UNAVAILABLE (a rank down,
hung, partitioned or restoring may come back, or the refresh finds another
copy), and MIN_ATTEMPTS times for TENSOR_NOT_FOUND: at once when a refresh
brings a newer version, and after a pause (SAME_VERSION_PAUSE_S, doubling up to
MAX_PAUSE_S) when it brings the same one. An error that outlasts the deadline
is raised. A read that finds a box whose every copy is gone (ShardsLostError,
SHARDS_LOST) is not retried, and a refresh that finds the tensor deleted raises
TensorNotFoundError.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

from shardserve.client import counters
from shardserve.client.errors import ShardServeError
from shardserve.protos.errors import Reason

T = TypeVar("T")

# Retried until the deadline: a newer version is being promoted (the refresh finds it); a rank down, hung,
# partitioned or restoring (it may come back, or the refresh finds another copy).
RETRY_UNTIL_DEADLINE = frozenset({Reason.STALE_VERSION, Reason.RANK_UNAVAILABLE})
# Retried MIN_ATTEMPTS times after a refresh: a name not found (deleted and put again meanwhile).
# SHARDS_LOST (every copy known gone) and every other reason are raised at once.
RETRY_A_FEW = frozenset({Reason.TENSOR_NOT_FOUND})
MIN_ATTEMPTS = 5
DEFAULT_DEADLINE_S = 30.0
SAME_VERSION_PAUSE_S = 0.05  # then 0.1, 0.2, 0.2, ...
MAX_PAUSE_S = 0.2


def retryable(err: ShardServeError, *, tries: int, past_deadline: bool) -> bool:
    """Whether a read that failed with `err` on its `tries`-th attempt is tried again, by its reason."""
    if err.reason in RETRY_UNTIL_DEADLINE:
        return tries < MIN_ATTEMPTS or not past_deadline
    return err.reason in RETRY_A_FEW and tries < MIN_ATTEMPTS


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
        except ShardServeError as err:
            if not retryable(err, tries=tries, past_deadline=time.monotonic() >= give_up):
                raise
            counters.count("retries")
            versions = refresh()
            if (
                tries > 1 and versions == seen
            ):  # nothing newer: a version being promoted, or a real error
                time.sleep(min(pause, max(0.0, give_up - time.monotonic())))
                pause = min(2 * pause, MAX_PAUSE_S)
            seen = versions
