"""Hedged, fail-fast reads: a part that has not answered in time is sent to another copy, or ends once its rank is
reported dead instead of waiting out its call's deadline (the read is then retried from the refreshed
layout until the read's own deadline; "The Tail at Scale", Dean and Barroso).

Every part of a read (one rank's part of a fetch, one rank's lookup request) runs as a Race: its primary call
runs on the caller's thread, writing straight into the output, while one Watchdog thread per client looks at the
races in flight every TICK_S. A race whose primary has not ended HEDGE_AFTER_S (+ time for its bytes at
HEDGE_BYTES_PER_S) after it started gets a hedge: the same part asked of another copy, on a thread of the
watchdog's pool, landing in a buffer of its own. The first to answer wins. A winning hedge cancels the primary
(its gRPC call cancelled, its bulk socket shut down), and its buffer is copied into the output only once the
primary's call has returned on the caller's thread, so a loser never writes into the output after the read.
A race with no other copy asks whether its rank is dead (Session's shared ListRanks view, at most about once a
second) every CHECK_EVERY_S and ends with RankUnavailableError as soon as the coordinator says so.

The default delay is fixed rather than a multiple of a measured p95: a healthy part answers in well under a
millisecond here (and a few on a LAN), so 100 ms hedges only stalls (a stopped process, a cut link, a long
pause), never normal reads, and it needs no warm-up per path or size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from shardserve.client.errors import RankUnavailableError

log = logging.getLogger(__name__)

HEDGE_AFTER_S = (
    0.1  # connect(hedge_after=...) default: a part silent this long is asked of another copy
)
HEDGE_BYTES_PER_S = 500e6  # plus time for its bytes at this (pessimistic, healthy) rate
CHECK_EVERY_S = 1.0  # a part with no other copy checks its rank's liveness this often
TICK_S = 0.02  # the watchdog looks at the races in flight this often (idle: never)
HEDGE_THREADS = 8
JOIN_S = 5.0  # close() waits this long at most for the watchdog thread (it ends within a tick)

Landing = Callable[[], None]  # copies a hedge's buffer into the caller's output
Hedge = Callable[
    ["Cancellation"], tuple[str, Landing]
]  # runs the part on another copy: (its path, its landing)


class Cancellation:
    """Hooks that stop one call's blocking I/O from another thread (cancel a gRPC call, shut a socket down)."""

    def __init__(self) -> None:
        self._hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.cancelled = False

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Run `hook` when cancel() is called (at once when it already was)."""
        with self._lock:
            if not self.cancelled:
                self._hooks.append(hook)
                return
        _run_hook(hook)

    def cancel(self) -> None:
        """Run every hook once; later hooks run as they are added."""
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            _run_hook(hook)


def _run_hook(hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception as err:  # noqa: BLE001 - a call that already ended may refuse to be cancelled
        log.debug("cancelling a call: %s", err)


def hedge_delay(hedge_after: float, nbytes: int) -> float:
    """How long a part of `nbytes` may stay silent before it is hedged."""
    return hedge_after + nbytes / HEDGE_BYTES_PER_S


@dataclass(eq=False)
class Race:
    """One part's primary call and the hedge or liveness check the watchdog may start beside it."""

    rank: int
    hedge: Hedge | None
    started: float  # monotonic time the primary started
    hedge_at: float  # monotonic time the hedge starts (inf: never)
    check_at: float  # monotonic time of the next liveness check
    primary: Cancellation = field(default_factory=Cancellation)
    outcome: str = ""  # "", "primary", "hedge" (the hedge answered first) or "dead" (its rank was reported dead)
    reason: BaseException | None = None
    hedged: bool = False
    checking: bool = False
    _hedge_cancel: Cancellation = field(default_factory=Cancellation)
    _hedge_done: threading.Event = field(default_factory=threading.Event)
    _hedge_result: tuple[str, Landing] | None = None
    _hedge_error: BaseException | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run_hedge(self) -> None:
        """The hedge (on a watchdog thread): when it answers before the primary, it wins and cancels the primary."""
        assert self.hedge is not None
        try:
            result = self.hedge(self._hedge_cancel)
        except BaseException as err:  # noqa: BLE001 - kept for the primary's thread, which decides
            self._hedge_error = err
            self._hedge_done.set()
            return
        with self._lock:
            self._hedge_result = result
            won = not self.outcome
            if won:
                self.outcome = "hedge"
        self._hedge_done.set()
        if won:
            self.primary.cancel()

    def rank_dead(self, err: RankUnavailableError) -> None:
        """The coordinator reports the primary's rank dead: the primary is cancelled and the part fails with
        `err` (unless a hedge answers)."""
        with self._lock:
            if self.outcome:
                return
            self.outcome, self.reason = "dead", err
        self.primary.cancel()

    def primary_done(self) -> None:
        """The primary answered: it wins (a hedge still running is cancelled; its buffer is dropped)."""
        with self._lock:
            if not self.outcome:
                self.outcome = "primary"
        self._hedge_cancel.cancel()

    def primary_failed(self, err: BaseException) -> tuple[str, Landing]:
        """The primary raised `err` (or was cancelled): the hedge's (path, landing) when a hedge was started and
        answers; else raises the reason the race ended (its rank reported dead) or `err`."""
        rank_failure = self.primary.cancelled or isinstance(
            err, (RankUnavailableError, ConnectionError)
        )
        if self.hedged and rank_failure:
            self._hedge_done.wait()  # bounded: the hedge's calls have deadlines
            if self._hedge_result is not None:
                with self._lock:
                    if self.outcome in ("", "dead"):
                        self.outcome = "hedge"
                return self._hedge_result
        self._hedge_cancel.cancel()
        if self.reason is not None:
            raise self.reason from None
        raise err

    @property
    def hedge_won(self) -> bool:
        return self.outcome == "hedge"


class Watchdog:
    """Starts hedges and liveness checks for the races in flight (one thread, asleep while none is)."""

    def __init__(
        self, hedge_after: float | None, rank_dead: Callable[[int], RankUnavailableError | None]
    ) -> None:
        self.hedge_after = hedge_after or None
        self.rank_dead = rank_dead
        self._races: dict[int, Race] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def start(self, rank: int, nbytes: int, hedge: Hedge | None) -> Race:
        """A race for one part of `nbytes` on `rank`, watched until finish()."""
        now = time.monotonic()
        hedge_at = float("inf")
        if self.hedge_after and hedge is not None:
            hedge_at = now + hedge_delay(self.hedge_after, nbytes)
        else:
            hedge = None
        race = Race(rank, hedge, now, hedge_at, now + CHECK_EVERY_S)
        with self._cond:
            if self._closed:
                return race
            self._races[id(race)] = race
            if len(self._races) == 1:
                self._ensure_thread()
                self._cond.notify()
        return race

    def finish(self, race: Race) -> None:
        """Stop watching `race`."""
        with self._cond:
            self._races.pop(id(race), None)

    def close(self) -> None:
        """Stop watching: the watchdog thread has ended when this returns (it never holds a lock for long), so
        it cannot still be letting go of a race's buffers while the interpreter exits: a thread that frees a
        tensor then re-takes the GIL during finalization, and is killed inside torch's C++ code, which
        aborts the process ("terminate called without an active exception")."""
        with self._cond:
            self._closed = True
            self._races.clear()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_S)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._pool = ThreadPoolExecutor(
                max_workers=HEDGE_THREADS, thread_name_prefix="shardserve-hedge"
            )
            self._thread = threading.Thread(
                target=self._watch, name="shardserve-watchdog", daemon=True
            )
            self._thread.start()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._races and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                races = list(self._races.values())
            self._look_at(races, time.monotonic())
            del races  # asleep or idle, the watchdog keeps no finished race (nor its buffers) alive
            time.sleep(TICK_S)

    def _look_at(self, races: list[Race], now: float) -> None:
        """Start the hedges and checks that are due."""
        assert self._pool is not None
        for race in races:
            if race.outcome:
                continue
            if not race.hedged and race.hedge_at <= now:
                race.hedged = True
                log.info(
                    "a part on rank %d has not answered in %.0f ms; asking another copy",
                    race.rank,
                    1000 * (now - race.started),
                )
                self._submit(race.run_hedge)
            if not race.checking and race.check_at <= now:
                race.checking = True
                self._submit(partial(self._check, race))

    def _submit(self, job: Callable[[], None]) -> None:
        assert self._pool is not None
        try:
            self._pool.submit(job)
        except RuntimeError:  # closed meanwhile
            pass

    def _check(self, race: Race) -> None:
        """Ask whether the race's rank is reported dead; end the race if so, else check again later."""
        try:
            err = self.rank_dead(race.rank)
        except Exception as failure:  # noqa: BLE001 - the coordinator unreachable: the part keeps waiting
            log.debug("liveness check of rank %d failed: %s", race.rank, failure)
            err = None
        if err is not None:
            race.rank_dead(err)
        race.check_at = time.monotonic() + CHECK_EVERY_S
        race.checking = False
