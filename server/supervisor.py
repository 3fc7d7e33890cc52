"""Rank processes kept running: spawn them, restart one that exits (with backoff), stop them all.

`shardserve up` (LocalCluster) and `shardserve node` both supervise their
ranks with RankSupervisor, like torchrun's elastic agent but one rank at a
time: a rank that exits is restarted under the same rank number after a
backoff (1 s doubling to 30 s, back to 1 s once an incarnation stayed up for a
minute), at most `max_restarts` times; one out of restarts stays dead. A
restarted rank registers with the coordinator again and comes back empty: the
coordinator records the copies it lost (server/coordinator/drivers/reconcile.py).
A rank's command line and environment come from server/rank_launch.py, how its process is started (forked
from a preloaded process, or a new interpreter) from server/rank_start.py.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardserve.server.rank_start import START_METHODS, StartedProcess, start_process

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 10
POLL_INTERVAL = 0.2  # seconds between checks of the rank processes


@dataclass(frozen=True)
class RestartPolicy:
    """How often and how soon a rank that exited is started again."""

    max_restarts: int = (
        DEFAULT_MAX_RESTARTS  # per rank, over the supervisor's life; 0 = never restart
    )
    initial_backoff: float = 1.0  # seconds before the first restart
    max_backoff: float = 30.0  # the doubling stops here
    stable_after: float = 60.0  # an incarnation up this long resets the backoff to initial_backoff

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError(
                f"restart backoff must satisfy 0 <= initial ({self.initial_backoff}) <= max "
                f"({self.max_backoff})"
            )

    def next_backoff(self, previous: float | None, uptime: float) -> float:
        """The wait before the next restart: doubled from `previous`, or the initial one after a stable run."""
        if previous is None or uptime >= self.stable_after:
            return self.initial_backoff
        return min(self.max_backoff, max(previous * 2, self.initial_backoff))


@dataclass(frozen=True)
class RankLaunch:
    """Everything a rank process is started with (the same for every incarnation)."""

    rank: int
    command: Sequence[str]
    env: dict[str, str]


def add_restart_args(parser: argparse.ArgumentParser) -> None:
    """--max-restarts and --restart-backoff (of `up` and `node`)."""
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        help="times each rank is "
        "restarted after its process ends, under the same rank number (0 = never; a rank out of "
        "restarts stays dead; default %(default)s)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=RestartPolicy.initial_backoff,
        help="seconds "
        "before restarting a rank that exited, doubled for each further restart up to "
        f"{RestartPolicy.max_backoff:.0f} s and reset once a rank stayed up "
        f"{RestartPolicy.stable_after:.0f} s (default %(default)s)",
    )


def check_restart_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) naming --max-restarts or --restart-backoff when out of range."""
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if not 0 <= args.restart_backoff < math.inf:
        parser.error(
            f"--restart-backoff must be a number of seconds >= 0, got {args.restart_backoff}"
        )


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    """The RestartPolicy of --max-restarts and --restart-backoff (checked by check_restart_args)."""
    return RestartPolicy(
        args.max_restarts,
        args.restart_backoff,
        max(RestartPolicy.max_backoff, args.restart_backoff),
    )


def exit_reason(code: int | None) -> str:
    """'exited with code 1' or 'was killed by SIGKILL' for a Popen returncode ('is running' for None)."""
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Slot:
    """One rank number: its current process and its restart state."""

    def __init__(self, launch: RankLaunch) -> None:
        self.launch = launch
        self.proc: StartedProcess | None = None
        self.started = 0.0  # time.monotonic() of the current incarnation's start
        self.restarts = 0
        self.backoff: float | None = None  # the last backoff waited; None before the first restart
        self.restart_at: float | None = None  # when a restart is due; None when none is
        self.final = False  # out of restarts: stays dead


class RankSupervisor:
    """Spawns rank processes, restarts each one that exits per `policy`, and stops them all.

    `on_exit(rank, reason)` is called (from the watch thread) as soon as a rank's process is seen ended, before
    any restart, so a coordinator told there learns of the death at once. No rank is spawned once stop() began.
    `start_method`: how a rank's process starts (server/rank_start.py).
    """

    def __init__(
        self,
        launches: Sequence[RankLaunch],
        policy: RestartPolicy = RestartPolicy(),
        on_exit: Callable[[int, str], None] | None = None,
        *,
        start_method: str = "spawn",
    ) -> None:
        ranks = [launch.rank for launch in launches]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks must be distinct, got {ranks}")
        if start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}"
            )
        self.policy = policy
        self.start_method = start_method
        self._on_exit = on_exit
        self._slots = {launch.rank: _Slot(launch) for launch in launches}
        self._lock = threading.Lock()  # spawning and stopping: never a spawn after stop() began
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ what tests and launchers read

    @property
    def ranks(self) -> list[int]:
        """The rank numbers supervised here, sorted."""
        return sorted(self._slots)

    def process(self, rank: int) -> StartedProcess:
        """The current (latest) process of `rank`."""
        proc = self._slot(rank).proc
        if proc is None:
            raise RuntimeError(f"rank {rank} was never started")
        return proc

    def pids(self) -> list[int]:
        """The current process id of every rank, by rank (a rank that stays dead keeps its last pid)."""
        return [self.process(rank).pid for rank in self.ranks]

    def restarts(self, rank: int) -> int:
        """How many times `rank` was restarted."""
        return self._slot(rank).restarts

    def stays_dead(self, rank: int) -> bool:
        """Whether `rank` exited with no restarts left."""
        return self._slot(rank).final

    def restart_pending(self, rank: int) -> bool:
        """Whether `rank` exited and waits out its backoff before its restart."""
        return self._slot(rank).restart_at is not None

    @property
    def watching(self) -> bool:
        """Whether the watch thread runs (only it restarts ranks)."""
        return self._thread is not None and self._thread.is_alive()

    def _slot(self, rank: int) -> _Slot:
        try:
            return self._slots[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not supervised here (ranks {self.ranks})") from None

    def signal_all(self, sig: int) -> None:
        """Send `sig` to every rank process still running (SIGHUP: re-read the tokens file)."""
        with self._lock:
            procs = [slot.proc for slot in self._slots.values() if slot.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    # ------------------------------------------------------------ lifecycle

    def spawn_all(self) -> None:
        """Start every rank once (without watching them yet)."""
        with self._lock:
            for slot in self._slots.values():
                if not self._stopping.is_set():
                    self._spawn(slot)
        log.info(
            "started ranks %s as pids %s",
            self.ranks,
            [s.proc.pid for s in self._slots.values() if s.proc],
        )

    def watch(self) -> None:
        """Start the thread that reports and restarts ranks whose process ends."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch_loop, name="rank-supervisor", daemon=True
            )
            self._thread.start()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every rank, SIGKILL those still alive after `grace`; no restart happens after this began.
        Idempotent."""
        with self._lock:
            self._stopping.set()
            procs = [slot.proc for slot in self._slots.values() if slot.proc is not None]
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank pid %d did not stop in %.1fs; killing it", proc.pid, grace)
                proc.kill()
                proc.wait(timeout=5.0)

    # ------------------------------------------------------------ the watch thread

    def _spawn(self, slot: _Slot) -> None:
        """(lock held) Start `slot`'s rank."""
        slot.proc = start_process(slot.launch.command, slot.launch.env, self.start_method)
        slot.started = time.monotonic()
        slot.restart_at = None

    def _watch_loop(self) -> None:
        while not self._stopping.wait(POLL_INTERVAL):
            for slot in self._slots.values():
                try:
                    self._check(slot)
                except Exception:  # noqa: BLE001 - the watch thread must outlive one rank's trouble
                    log.exception("supervising rank %d failed", slot.launch.rank)

    def _check(self, slot: _Slot) -> None:
        if slot.final or slot.proc is None:
            return
        if slot.restart_at is None and slot.proc.poll() is not None:
            self._exited(slot)
        if slot.restart_at is not None and time.monotonic() >= slot.restart_at:
            self._restart(slot)

    def _exited(self, slot: _Slot) -> None:
        """Report the death, then schedule a restart or declare the rank dead for good."""
        rank, proc = slot.launch.rank, slot.proc
        assert proc is not None
        reason = f"process {proc.pid} {exit_reason(proc.returncode)}"
        if self._on_exit is not None and not self._stopping.is_set():
            self._on_exit(rank, reason)
        if slot.restarts >= self.policy.max_restarts:
            slot.final = True
            log.error(
                "rank %d: %s; no restarts left (%d of --max-restarts %d used): it stays dead",
                rank,
                reason,
                slot.restarts,
                self.policy.max_restarts,
            )
            return
        slot.backoff = self.policy.next_backoff(slot.backoff, time.monotonic() - slot.started)
        slot.restart_at = time.monotonic() + slot.backoff
        log.warning(
            "rank %d: %s; restarting it in %.1fs (restart %d of %d)",
            rank,
            reason,
            slot.backoff,
            slot.restarts + 1,
            self.policy.max_restarts,
        )

    def _restart(self, slot: _Slot) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._spawn(slot)
            slot.restarts += 1
        assert slot.proc is not None
        log.warning(
            "rank %d restarted as pid %d (restart %d of %d)",
            slot.launch.rank,
            slot.proc.pid,
            slot.restarts,
            self.policy.max_restarts,
        )
