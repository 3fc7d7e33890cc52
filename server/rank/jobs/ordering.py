"""The one ordering primitive of a rank's collective jobs: a chain of (seq, after_seq) run on one thread.

Every participant of two jobs must enter their collectives in the same order,
whatever order the RPCs arrive in. The coordinator tells each rank a job's
`seq` and `after_seq` (the rank's previous job); `JobChain` runs a job on its
one thread right after its predecessor, so a rank never waits for a job it is
not part of. A job whose predecessor never arrives waits at most its
timeout, then fails and releases its successors; `cancel(seq)` does the same
for a job that has not started. `CollectiveExecutor` is the same chain for
densely numbered jobs (n runs after n - 1), as in-process tools use it.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from shardserve.server.rank.jobs.arguments import non_negative_int, positive_seconds

T = TypeVar("T")


class JobCancelled(RuntimeError):
    """The job was cancelled, or timed out waiting for its predecessor, before it started."""


class SequenceTimeoutError(JobCancelled, TimeoutError):
    """A job waited too long for the job before it to arrive."""


_Parked = tuple[int, Callable[[], Any], cf.Future, threading.Timer]


class JobChain:
    """Runs jobs one at a time on one thread, each right after its `after_seq` job.

    A job becomes ready once its predecessor is ready (or it has none), and
    ready jobs run in the order they became ready, so the thread never waits
    for a job that will not come.
    """

    NO_PREDECESSOR = 0  # the after_seq of a job that follows none

    def __init__(self, name: str = "shardserve-collective-jobs") -> None:
        self._lock = threading.Lock()
        self._ready_seqs: set[int] = set()
        self._parked: dict[int, list[_Parked]] = {}
        self._cancelled: set[int] = set()
        self._ready: queue.SimpleQueue[tuple[int, Callable[[], Any], cf.Future] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._thread = threading.Thread(target=self._run_ready, name=name, daemon=True)
        self._thread.start()

    def submit(
        self, seq: int, after_seq: int, fn: Callable[[], T], timeout_s: float
    ) -> cf.Future[T]:
        """Run `fn` after job `after_seq`; the future holds its result or exception."""
        future: cf.Future = cf.Future()
        with self._lock:
            if seq in self._ready_seqs:
                future.set_exception(JobCancelled(f"job {seq} was cancelled or already submitted"))
                return future
            if after_seq == self.NO_PREDECESSOR or after_seq in self._ready_seqs:
                self._make_ready(seq, fn, future)
            else:
                timer = threading.Timer(timeout_s, self._expire, (seq, after_seq))
                timer.daemon = True
                self._parked.setdefault(after_seq, []).append((seq, fn, future, timer))
                timer.start()
        return future

    def cancel(self, seq: int) -> None:
        """Make a job that has not started fail with JobCancelled; its successors go on."""
        with self._lock:
            self._cancelled.add(seq)
            for waiting in self._parked.values():
                for item in waiting:
                    if item[0] == seq:
                        waiting.remove(item)
                        item[3].cancel()
                        self._make_ready(seq, item[1], item[2])
                        return
            if seq not in self._ready_seqs:
                self._make_ready(seq, _nothing, cf.Future())

    def is_known(self, seq: int) -> bool:
        """Whether job `seq` was submitted or cancelled here."""
        with self._lock:
            return (
                seq in self._ready_seqs
                or seq in self._cancelled
                or any(item[0] == seq for waiting in self._parked.values() for item in waiting)
            )

    def _expire(self, seq: int, after_seq: int) -> None:
        with self._lock:
            for item in self._parked.get(after_seq, []):
                if item[0] == seq:
                    self._parked[after_seq].remove(item)
                    item[2].set_exception(
                        SequenceTimeoutError(
                            f"job {seq} timed out waiting for job {after_seq} to arrive"
                        )
                    )
                    self._cancelled.add(seq)
                    self._make_ready(seq, _nothing, cf.Future())
                    return

    def _make_ready(self, seq: int, fn: Callable[[], Any], future: cf.Future) -> None:
        """Queue `seq` for the thread and release the jobs parked behind it (lock held)."""
        self._ready_seqs.add(seq)
        self._ready.put((seq, fn, future))
        for next_seq, next_fn, next_future, timer in self._parked.pop(seq, []):
            timer.cancel()
            self._make_ready(next_seq, next_fn, next_future)

    def _run_ready(self) -> None:
        while True:
            item = self._ready.get()
            if item is None:
                return
            seq, fn, future = item
            if self._closed:
                future.set_exception(RuntimeError("the collective job chain closed"))
            elif seq in self._cancelled:
                if not future.done():
                    future.set_exception(JobCancelled(f"job {seq} was cancelled before it started"))
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # the job's failure belongs to its caller
                    future.set_exception(exc)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after the running job; ready jobs not yet started fail with RuntimeError."""
        self._closed = True
        self._ready.put(None)
        self._thread.join(timeout_s)
        while True:  # jobs queued behind the stop
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item[2].done():
                item[2].set_exception(RuntimeError("the collective job chain closed"))


def _nothing() -> None:
    return None


class CollectiveExecutor:
    """A JobChain for jobs numbered first_seq, first_seq + 1, ...: job n runs right after job n - 1.

    A job whose predecessor has not arrived (or been `skip`ped) within
    `wait_timeout_s` fails with SequenceTimeoutError and its number is
    skipped, so the sequence can continue past it.
    """

    def __init__(self, first_seq: int = 0, *, name: str = "shardserve-collectives") -> None:
        self._first_seq = non_negative_int(first_seq, "first_seq")
        self._next_seq = self._first_seq
        self._chain = _DenseChain(name=name)
        self._lock = threading.Lock()

    @property
    def next_seq(self) -> int:
        """The sequence number after the last job that ran."""
        with self._lock:
            return self._next_seq

    def submit(self, seq: int, fn: Callable[[], T], *, wait_timeout_s: float) -> cf.Future[T]:
        """Queue `fn` as job `seq`; its future holds fn's result or exception."""
        seq = self._check_new_seq(seq)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        wait_timeout_s = positive_seconds(wait_timeout_s, "wait_timeout_s")

        def run() -> T:
            try:
                return fn()
            finally:
                with self._lock:
                    self._next_seq = max(self._next_seq, seq + 1)

        return self._chain.submit(seq, self._predecessor(seq), run, wait_timeout_s)

    def skip(self, seq: int) -> None:
        """Declare that job `seq` will never be submitted here (e.g. aborted before it arrived)."""
        self._chain.cancel(self._check_new_seq(seq))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after the running job; queued jobs fail with RuntimeError."""
        self._chain.close(timeout_s)

    def __enter__(self) -> CollectiveExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _predecessor(self, seq: int) -> int:
        return seq - 1 if seq > self._first_seq else _DenseChain.NO_PREDECESSOR

    def _check_new_seq(self, seq: int) -> int:
        seq = non_negative_int(seq, "seq")
        if seq < self._first_seq or self._chain.is_known(seq):
            raise ValueError(f"seq {seq} was already used (next expected seq is {self.next_seq})")
        return seq


class _DenseChain(JobChain):
    """A chain whose job numbers start at 0, so "no predecessor" is -1."""

    NO_PREDECESSOR = -1
