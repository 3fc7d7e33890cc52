"""Versions a commit removed from the catalog, freed on their ranks after the commit has answered.

A snapshot's commit removes the snapshots of its prefix beyond `keep`. The commit's transaction already made
them unreachable; freeing their memory on the ranks is not part of what the writer waits for. The next snapshot
of the same prefix waits for it before allocating, so a steady writer still reuses that memory. A coordinator
that dies first leaves them to the reconciler, as any version its catalog does not hold.
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


# drops at once: one held by a stopped rank (until its deadline) holds up no other prefix's
DROP_THREADS = 4


class DeferredDrops:
    """Runs `drop_on_ranks` on a few background threads and lets a prefix's next snapshot wait for the drops
    submitted for it."""

    def __init__(
        self,
        drop_on_ranks: Callable[[Sequence[TensorRecord]], None],
        *,
        threads: int = DROP_THREADS,
    ) -> None:
        self._drop_on_ranks = drop_on_ranks
        self._pool = futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="coord-drops"
        )
        self._pending: dict[str, list[futures.Future[None]]] = {}
        self._lock = threading.Lock()

    def submit(self, prefix: str, records: Sequence[TensorRecord]) -> None:
        """Free `records` (removed from the catalog with a commit of `prefix`) on their ranks soon (read on the
        drop thread: they may be decoded only then)."""
        if not records:
            return
        future = self._pool.submit(self._drop, prefix, records)
        with self._lock:
            self._forget_done(prefix)
            self._pending.setdefault(prefix, []).append(future)
        future.add_done_callback(lambda _: self._settle(prefix))  # no entry outlives its drops

    def wait(self, prefix: str, timeout: float = WAIT_S) -> None:
        """Return once the drops submitted for `prefix` so far are done (or `timeout` passed)."""
        with self._lock:
            pending = list(self._pending.get(prefix, []))
        if not pending:
            return
        _, not_done = futures.wait(pending, timeout=timeout)
        if not_done:
            log.warning(
                "drops of older snapshots of %r still running after %.0f s", prefix, timeout
            )
            return
        with self._lock:
            self._forget_done(prefix)

    def __len__(self) -> int:
        """How many prefixes have drops running."""
        with self._lock:
            return len(self._pending)

    def _settle(self, prefix: str) -> None:
        with self._lock:
            self._forget_done(prefix)

    def _forget_done(self, prefix: str) -> None:
        """Keep only the drops of `prefix` still running (lock held)."""
        running = [f for f in self._pending.pop(prefix, []) if not f.done()]
        if running:
            self._pending[prefix] = running

    def close(self) -> None:
        """Finish the drops submitted, then stop the threads."""
        self._pool.shutdown(wait=True)

    def _drop(self, prefix: str, records: Sequence[TensorRecord]) -> None:
        try:
            self._drop_on_ranks(records)
        except Exception:  # noqa: BLE001 - a failed drop is logged; the reconciler frees what is left
            log.exception("dropping %d versions a commit of %r removed", len(records), prefix)
