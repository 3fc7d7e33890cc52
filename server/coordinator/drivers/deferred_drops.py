"""Versions a commit removed from the catalog, freed on their ranks after the commit has answered.

The commit's transaction already made them unreachable (a snapshot commit's older snapshots, a tensor commit's
replaced versions); freeing their memory on the ranks is not part of what the writer waits for. The next
snapshot of the same prefix (the next version of the same tensor) waits for it before allocating, so a steady
writer still reuses that memory. A coordinator that dies first leaves them to the reconciler, as any version
its catalog does not hold.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

from shardserve.server.coordinator.catalog.records import TensorRecord

log = logging.getLogger(__name__)

WAIT_S = 30.0
"""How long a new snapshot waits for the previous one's drops before allocating anyway."""


class DeferredDrops:
    """Runs `drop_on_ranks` on one background thread, in order, and lets a prefix's next snapshot wait for it."""

    def __init__(self, drop_on_ranks: Callable[[Sequence[TensorRecord]], None]) -> None:
        self._drop_on_ranks = drop_on_ranks
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="coord-drops")
        self._latest: dict[str, futures.Future[None]] = {}
        self._lock = threading.Lock()

    def submit(self, prefix: str, records: Sequence[TensorRecord]) -> None:
        """Free `records` (removed from the catalog with a commit of `prefix`, a snapshot prefix or a tensor
        name) on their ranks soon (read on the drop thread: they may be decoded only then)."""
        if not records:
            return
        with self._lock:
            self._latest[prefix] = self._pool.submit(self._drop, prefix, records)

    def wait(self, prefix: str, timeout: float = WAIT_S) -> None:
        """Return once the drops submitted for `prefix` so far are done (or `timeout` passed)."""
        with self._lock:
            latest = self._latest.get(prefix)
        if latest is None:
            return
        done, _ = futures.wait([latest], timeout=timeout)
        if not done:
            log.warning("drops of older versions of %r still running after %.0f s", prefix, timeout)
            return
        with self._lock:
            if self._latest.get(prefix) is latest:
                del self._latest[prefix]

    def close(self) -> None:
        """Finish the drops submitted, then stop the thread."""
        self._pool.shutdown(wait=True)

    def _drop(self, prefix: str, records: Sequence[TensorRecord]) -> None:
        try:
            self._drop_on_ranks(records)
        except Exception:  # noqa: BLE001 - a failed drop is logged; the reconciler frees what is left
            log.exception("dropping %d older versions of %r", len(records), prefix)
