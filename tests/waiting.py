"""Waiting in tests: poll a condition until it holds, bounded by a timeout, never a fixed sleep.

The one `wait_until` of the suite (and `eventually`, for a call that fails until something comes back).
A poll is short (POLL_S) so that a test goes on as soon as what it waits for happened; the timeout only
bounds a failure, so it may be generous without slowing a passing test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from shardserve.client.errors import ShardServeError

POLL_S = 0.05
TRANSIENT: tuple[type[BaseException], ...] = (grpc.RpcError, ShardServeError)
"""What a condition may raise while a server is still starting, restarting or settling: counted as not yet."""

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    *,
    ignoring: tuple[type[BaseException], ...] = TRANSIENT,
    poll: float = POLL_S,
) -> None:
    """Poll `predicate` until it returns true; AssertionError naming `what` after `timeout` seconds.

    An error of `ignoring` raised by `predicate` counts as false (the last one is named in the failure)."""
    eventually(lambda: _true(predicate), timeout, what, ignoring=(_NotYet, *ignoring), poll=poll)


def eventually(
    call: Callable[[], T],
    timeout: float,
    what: str,
    *,
    ignoring: tuple[type[BaseException], ...] = TRANSIENT,
    poll: float = POLL_S,
) -> T:
    """`call()`'s result, called again every `poll` seconds while it raises one of `ignoring`; after `timeout`
    seconds an AssertionError naming `what` and the last error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except ignoring as err:
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}: {err!r}"
                ) from err
        time.sleep(poll)


class _NotYet(Exception):
    """A predicate was false."""


def _true(predicate: Callable[[], object]) -> None:
    if not predicate():
        raise _NotYet("the condition was false")
