"""Kept threads for the coordinator's calls to a few ranks.

A gRPC future (`stub.Method.future`) on a channel with no other call in flight first starts that channel's
polling thread and waits for it to run: one new thread per rank per fan-out, which on a loaded host costs
milliseconds each (a third of a small put's commit, measured). A blocking call polls on the thread that makes
it, so a fan-out to a few ranks runs its calls as blocking calls on threads kept for it: quicker for one or two
ranks than the call loop's grpc.aio (0.85 against 1.0 ms for two, measured). There are at most `size` of
them, taken without waiting: a call that finds none free goes to the call loop instead (call_loop.py), so ranks
that hold their calls until the deadline (a stopped process) never hold up calls to other ranks.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = None  # what tells a thread to end


class CallThreads:
    """Up to `size` daemon threads that run blocking calls, started as they are first needed; each call runs in
    the context (contextvars: the trace) of the thread that started it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = threading.Semaphore(size)
        self._jobs: queue.SimpleQueue[tuple[futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def start(self, call: Callable[[], T]) -> futures.Future[T] | None:
        """Run `call` on a kept thread; its future, or None (nothing run) when every thread is busy or the pool
        is closed."""
        if not self._free.acquire(blocking=False):
            return None
        with self._lock:
            if self._closed:
                self._free.release()
                return None
            if self._idle == 0:
                self._spawn()
            else:
                self._idle -= 1
        future: futures.Future[T] = futures.Future()
        # the caller's trace goes with the call, as a future's would
        context = contextvars.copy_context()
        self._jobs.put((future, lambda: context.run(call)))
        return future

    def close(self) -> None:
        """End the threads once the calls given to them have returned; later calls are refused (None)."""
        with self._lock:
            self._closed = True
            count = len(self._threads)
        for _ in range(count):
            self._jobs.put(_STOP)

    @property
    def threads(self) -> int:
        """How many threads were started (idle or busy)."""
        with self._lock:
            return len(self._threads)

    def _spawn(self) -> None:
        thread = threading.Thread(
            target=self._run, name=f"rank-calls-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, call = job
            running = future.set_running_or_notify_cancel()
            result, error = None, None
            if running:
                try:
                    result = call()
                except BaseException as err:  # noqa: BLE001 - handed to the future's reader
                    error = err
            with self._lock:  # free again before the caller hears: its next call finds this thread
                self._idle += 1
            self._free.release()
            if error is not None:
                future.set_exception(error)
            elif running:
                future.set_result(result)
