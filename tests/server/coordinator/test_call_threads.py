"""The coordinator's kept call threads: calls run on threads started once and reused, never more than `size` at
once (past that the caller is told to make the call elsewhere: the call loop), failures reach the caller, and closed
threads end."""

from __future__ import annotations

import threading

import pytest

from shardserve.server.coordinator.ranks.call_threads import CallThreads

WAIT_S = 10.0


def test_sequential_calls_reuse_one_thread():
    threads = CallThreads(4)
    try:
        for value in range(20):
            future = threads.start(lambda value=value: value * 2)
            assert future is not None and future.result(WAIT_S) == value * 2
        assert threads.threads == 1
    finally:
        threads.close()


def test_past_size_busy_threads_a_call_is_refused_not_queued():
    """A call that would wait for a busy thread (a rank holding its calls until their deadline) is refused, so
    the caller makes it on the call loop at once; a thread freed takes calls again."""
    threads = CallThreads(2)
    release = threading.Event()
    try:
        held = [threads.start(lambda: release.wait(WAIT_S)) for _ in range(2)]
        assert all(future is not None for future in held)
        assert threads.start(lambda: "refused") is None
        release.set()
        assert all(future.result(WAIT_S) is True for future in held if future is not None)
        again = threads.start(lambda: "taken")
        assert again is not None and again.result(WAIT_S) == "taken"
        assert threads.threads == 2
    finally:
        threads.close()


def test_a_failed_call_raises_from_its_future():
    threads = CallThreads(1)
    try:

        def fails() -> None:
            raise ValueError("rank refused")

        future = threads.start(fails)
        assert future is not None
        with pytest.raises(ValueError, match="rank refused"):
            future.result(WAIT_S)
        after = threads.start(lambda: "still serving")
        assert after is not None and after.result(WAIT_S) == "still serving"
    finally:
        threads.close()


def test_closed_threads_end_and_refuse_calls():
    threads = CallThreads(3)
    futures = [threads.start(lambda: threading.current_thread()) for _ in range(3)]
    started = {future.result(WAIT_S) for future in futures if future is not None}
    threads.close()
    assert threads.start(lambda: None) is None
    for thread in started:
        thread.join(WAIT_S)
        assert not thread.is_alive()


def test_a_call_runs_in_the_context_of_the_thread_that_started_it():
    """The caller's contextvars (the OpenTelemetry trace the call's metadata carries) go with the call."""
    import contextvars

    trace: contextvars.ContextVar[str] = contextvars.ContextVar("trace", default="none")
    threads = CallThreads(1)
    try:
        trace.set("commit-span")
        future = threads.start(trace.get)
        assert future is not None and future.result(WAIT_S) == "commit-span"
        trace.set("another-span")
        future = threads.start(trace.get)
        assert future is not None and future.result(WAIT_S) == "another-span"
    finally:
        threads.close()
