"""Per-tensor-name locks on the coordinator: changes of one tensor take turns, different names run in parallel
(row updates of one table are ordered by server/coordinator/drivers/update_groups.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from shardserve.server.common.errors import TensorBusy

NAME_LOCK_WAIT_S = 10.0  # how long a change of a tensor waits for another one of it (under the clients' 30 s deadline)


class NameLocks:
    """One lock per tensor name in use, forgotten once no caller uses it (names asked about must not pile up)."""

    def __init__(self) -> None:
        self._locks: dict[
            str, tuple[threading.Lock, int]
        ] = {}  # name -> (its lock, callers using it)
        self._guard = threading.Lock()

    def names(self) -> set[str]:
        """The names whose lock is in use now: held, or waited for."""
        with self._guard:
            return set(self._locks)

    @contextlib.contextmanager
    def hold(self, name: str, wait_s: float | None = None) -> Iterator[None]:
        """Hold `name`'s lock; ABORTED when another change keeps it longer than `wait_s` (default
        NAME_LOCK_WAIT_S): a reshard or checkpoint holds it for its whole run, and a gRPC worker must not wait on
        it without bound."""
        with self._guard:
            lock, users = self._locks.get(name, (threading.Lock(), 0))
            self._locks[name] = (lock, users + 1)
        try:
            if not lock.acquire(timeout=NAME_LOCK_WAIT_S if wait_s is None else wait_s):
                raise TensorBusy(
                    f"tensor {name!r} is busy: a reshard, checkpoint or other change of it is running; "
                    f"retry once it has ended"
                )
            try:
                yield
            finally:
                lock.release()
        finally:
            with self._guard:
                lock, users = self._locks[name]
                if users == 1:
                    del self._locks[name]
                else:
                    self._locks[name] = (lock, users - 1)
