"""The coordinator's background work: ranks arriving and heartbeating, and the chores of every few seconds.

A rank that registers (or comes back from the dead) is reconciled with the catalog off the caller's thread;
a monitor thread logs ranks that stop heartbeating and starts the chores: aborting puts left PENDING past the
pending timeout (and, at once, the pending tensors of snapshots another coordinator created, which no commit can
reach here: a pending snapshot lives in the memory of the coordinator that created it) and finishing reshard
promotions left unfinished. Nothing runs before `start()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent import futures

from shardserve.server.common.errors import ServiceError
from shardserve.server.common.log_phrases import versions_phrase
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.drivers.lifecycle import TensorLifecycle
from shardserve.server.coordinator.drivers.reconcile import Reconciler
from shardserve.server.coordinator.drivers.reshard import ReshardDriver
from shardserve.server.coordinator.ranks.info import RankInfo
from shardserve.server.coordinator.ranks.registry import RankRegistry

log = logging.getLogger(__name__)

CLOCK_MARGIN_S = 60.0
"""The pending rows the chores read are those created before the timeout's cutoff or, while that is earlier,
before this coordinator started plus this margin (by the clock of the coordinator that created them: another
host's, after a failover, may run ahead). This coordinator's own rows are told apart by their creator id, not
by the clock; the margin only bounds which rows each round decodes."""


class Upkeep:
    """Reconciles ranks that (re)register and runs the periodic chores, on threads of its own."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        registry: RankRegistry,
        lifecycle: TensorLifecycle,
        reconciler: Reconciler,
        reshards: ReshardDriver,
        heartbeat_interval: float,
        pending_timeout: float,
        coordinator_id: str,
    ) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self.catalog = catalog
        self.registry = registry
        self.lifecycle = lifecycle
        self.reconciler = reconciler
        self.reshards = reshards
        self.heartbeat_interval = heartbeat_interval
        self.pending_timeout = pending_timeout
        # its snapshots' tensors carry it (TensorRecord.creator)
        self.coordinator_id = coordinator_id
        # background work that takes name locks gets its own pool, so it never starves the fan-out
        self._background = futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="coord-background"
        )
        self._promotions_lock = threading.Lock()
        self._promotions_queued = False  # a finish_promotions round waits in the background pool
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._loop, name="coord-monitor", daemon=True)
        self._started_unix = float("inf")  # when start() ran

    def register(
        self,
        info: RankInfo,
        held: Iterable[tuple[str, int]],
        *,
        served: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        """Add (or replace) a rank; reconcile what it holds (`served`: those of them it serves already) with the
        catalog in the background, and finish the reshard promotions left unfinished (once for the registrations
        that arrive while one waits: a thousand ranks registering at once ask for one, not a thousand)."""
        held_pairs = self.registry.register(info, held)
        self._background.submit(self.reconciler.reconcile, info.rank, held_pairs, served=served)
        with self._promotions_lock:
            if self._promotions_queued:
                return
            self._promotions_queued = True
        self._background.submit(self._finish_promotions)

    def _finish_promotions(self) -> None:
        with self._promotions_lock:
            self._promotions_queued = False  # a registration from now on asks for another round
        self.reshards.finish_promotions()

    def heartbeat(self, rank: int, memory_used: int) -> float:
        """Record that `rank` is alive; one that had been reported dead is reconciled if a call to it was skipped
        or failed meanwhile (a drop it missed). The interval to tell it."""
        was_dead, interval = self.registry.heartbeat(rank, memory_used)
        if was_dead:
            if self.registry.take_missed(rank):
                log.info("rank %d is alive again; reconciling what it holds", rank)
                self._background.submit(self.reconciler.reconcile_from_stats, rank, self._stop.wait)
            else:  # a heartbeat late on a loaded machine: nothing to reconcile, and reading its rows costs
                log.info("rank %d is alive again; no call to it was missed meanwhile", rank)
        return interval

    def start(self) -> None:
        """Start the monitor thread."""
        self._started_unix = time.time()
        self._monitor.start()

    def stop(self) -> None:
        """Stop watching heartbeats and starting chores (the cluster is shutting down on purpose)."""
        self._stop.set()

    def close(self) -> None:
        """Stop, wait for the monitor, and drop the background work not yet begun."""
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(timeout=5)
        self._background.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        """Log ranks that stop heartbeating; every few seconds, start the chores (off this thread, which must
        not wait on a name lock or a rank)."""
        last_chores: float = time.monotonic()
        chores: futures.Future[None] | None = None
        while not self._stop.wait(min(self.heartbeat_interval, 1.0)):
            self.registry.report_dead()
            if time.monotonic() - last_chores >= min(5.0, self.pending_timeout) and (
                chores is None or chores.done()
            ):
                last_chores = time.monotonic()
                chores = self._background.submit(self._chores)

    def _chores(self) -> None:
        """Abort puts left PENDING past the timeout; finish reshard promotions left unfinished."""
        try:
            self._reap_pending()
        except Exception:  # noqa: BLE001 - a background task must log, not vanish
            log.exception("reaping pending versions failed")
        self.reshards.finish_promotions()

    def _reap_pending(self) -> None:
        """Abort the versions pending past the timeout, and those of snapshots another coordinator created (one
        log line for all of them)."""
        now = time.time()
        cutoff = now - self.pending_timeout
        window = self._started_unix + CLOCK_MARGIN_S
        orphans = []
        for record in self.catalog.pending(
            created_before=max(cutoff, window)
        ):  # not the others: an indexed query
            if self.reshards.is_running(record.name):
                continue  # a reshard's own new version: its timeout bounds it
            if record.created_unix < cutoff:
                log.warning(
                    "aborting %r version %d: pending for more than %.0fs",
                    record.name,
                    record.version,
                    self.pending_timeout,
                )
            elif record.creator and record.creator != self.coordinator_id:
                orphans.append(record.key)
            else:
                continue
            self._abort(record.name, record.version)
        if orphans:
            log.warning(
                "aborting %s: pending in snapshots another coordinator created (no commit can reach "
                "them here)",
                versions_phrase(orphans),
            )

    def _abort(self, name: str, version: int) -> None:
        try:
            self.lifecycle.abort(name, version)
        except ServiceError as err:
            log.info("reaping %r version %d: %s", name, version, err.message)
