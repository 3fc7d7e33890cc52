"""Values a client keeps for its next put of a name or prefix, each made already or being made on a thread of
the holder's own (a reservation the coordinator makes after the commit answered, a version the client creates
after its put returned). A put takes its key's value once, waiting for one still being made, so two puts never
share one; whatever a put or close replaces is handed back for its owner to give up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

V = TypeVar("V")


class KeptForNextPut(Generic[V]):
    """One value per key, made now (`keep`) or by `make()` on this holder's one thread (`keep_later`)."""

    def __init__(self, thread_name: str) -> None:
        self._by_key: dict[str, V | Future[V | None]] = {}
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._makers: ThreadPoolExecutor | None = None

    def take(self, key: str) -> V | None:
        """The key's value, no longer kept here (waiting for one still being made); None if none was made."""
        with self._lock:
            kept = self._by_key.pop(key, None)
        return _resolved(kept)

    def keep(self, key: str, value: V) -> V | None:
        """Keep `value` for the key's next put; returns the value it replaces, if any."""
        return _resolved(self._swap(key, value))

    def keep_later(self, key: str, make: Callable[[], V | None]) -> V | None:
        """Keep what `make()` answers (run on this holder's thread now; None: nothing) for the key's next put;
        returns the value it replaces, if any."""
        with self._lock:
            if self._makers is None:
                self._makers = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=self._thread_name
                )
            later = self._makers.submit(make)
        return _resolved(self._swap(key, later))

    def release_all(self, release: Callable[[str, V], None]) -> None:
        """Forget every value, `release(key, value)` each (once made, for those still being made), and stop the
        holder's thread."""
        with self._lock:
            held, self._by_key = list(self._by_key.items()), {}
            makers, self._makers = self._makers, None
        for key, kept in held:
            value = _resolved(kept)
            if value is not None:
                release(key, value)
        if makers is not None:
            makers.shutdown(wait=True)

    def _swap(self, key: str, kept: V | Future[V | None]) -> V | Future[V | None] | None:
        with self._lock:
            replaced = self._by_key.get(key)
            self._by_key[key] = kept
            return replaced


def _resolved(kept: V | Future[V | None] | None) -> V | None:
    return kept.result() if isinstance(kept, Future) else kept
