"""Snapshots reserved after their commit answered (CommitSnapshotRequest.reserve_later), until the writer takes them.

A steady writer's commit reserves the prefix's next snapshot: a catalog transaction and a rank call per rank that
drops the versions the commit removed and allocates the next ones in their memory. Made before the commit
answers, that is a third of a small state dict's put; made after, it runs while the writer goes on (its next
training step), and the writer's TakeReservedSnapshot waits for it only when it is not done yet. A reservation
no one takes is a pending snapshot like any other, aborted after the pending timeout; its entry here goes then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

TAKE_WAIT_S = 120.0
"""How long TakeReservedSnapshot waits for a reservation still being made (its rank calls have deadlines of
their own, well within this)."""

# reservations made at once: one held by a stopped rank (until its deadline) holds up no other prefix's
RESERVE_THREADS = 4

Made = TypeVar("Made")


class LaterReservations(Generic[Made]):
    """Reservations being made or made, by (prefix, the number of the snapshot whose commit asked for them)."""

    def __init__(
        self, *, threads: int = RESERVE_THREADS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._pool = futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="coord-reserve"
        )
        self._clock = clock
        self._made: dict[tuple[str, int], tuple[float, futures.Future[Made | None]]] = {}
        self._lock = threading.Lock()

    def start(self, prefix: str, committed: int, reserve: Callable[[], Made | None]) -> None:
        """Run `reserve` (None: nothing reserved) on a reservation thread, for the writer of `prefix` to take."""
        future = self._pool.submit(reserve)
        with self._lock:
            self._made[(prefix, committed)] = (self._clock(), future)

    def take(self, prefix: str, committed: int, *, timeout: float = TAKE_WAIT_S) -> Made | None:
        """The reservation the commit of snapshot `committed` asked for, once made, no longer kept here: None when
        none was asked for (or it was taken already), when it could not be made, or after `timeout`."""
        with self._lock:
            entry = self._made.pop((prefix, committed), None)
        if entry is None:
            return None
        try:
            return entry[1].result(timeout=timeout)
        except futures.TimeoutError:
            log.warning(
                "the reservation after snapshot %r %d not made within %.0f s; left to the pending timeout",
                prefix,
                committed,
                timeout,
            )
        # any other failure: the writer creates its next snapshot instead, the cause is the coordinator's to log
        except Exception:
            log.exception("the reservation after snapshot %r %d failed", prefix, committed)
        return None

    def forget_older(self, age: float) -> int:
        """Forget the reservations made more than `age` seconds ago and never taken (their pending snapshots are
        aborted by the pending timeout); how many."""
        cutoff = self._clock() - age
        with self._lock:
            old = [key for key, (started, _) in self._made.items() if started < cutoff]
            for key in old:
                del self._made[key]
        return len(old)

    def __len__(self) -> int:
        with self._lock:
            return len(self._made)

    def close(self) -> None:
        """Finish the reservations being made, then stop the threads."""
        self._pool.shutdown(wait=True)
