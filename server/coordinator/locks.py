"""Per-tensor-name locks on the coordinator: changes of one tensor take turns, different names run in parallel;
and the update slots that order row updates of one table."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from server.common.errors import Aborted

UPDATE_SLOT_WAIT_S = 1.0  # a CreateTensor(INIT_COPY) waits this long for the table's pending update, then ABORTED
UPDATE_PENDING_S = 30.0  # an update pending this long (its client is gone) is aborted by the next one that waits
NAME_LOCK_WAIT_S = 10.0  # how long a change of a tensor waits for another one of it (under the clients' 30 s deadline)


class NameLocks:
    """One lock per tensor name in use, forgotten once no caller uses it (names asked about must not pile up)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[threading.Lock, int]] = {}  # name -> (its lock, callers using it)
        self._guard = threading.Lock()

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
                raise Aborted(f"tensor {name!r} is busy: a reshard, checkpoint or other change of it is running; "
                              f"retry once it has ended")
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


class UpdateSlots:
    """At most one row update (an INIT_COPY version) pending per table: the next one waits for it to be
    committed or aborted instead of aborting it, so updates of one table from any number of clients are applied
    one after another, in the order they get the slot. A wait is bounded (UPDATE_SLOT_WAIT_S: a gRPC worker must
    not block for long; the client asks again); a holder whose update stays pending past UPDATE_PENDING_S is
    taken to be gone and its version aborted (`abort_stale`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, tuple[int, float]] = {}  # name -> (pending version, 0 while being created; since)
        self._changed = threading.Condition()

    def claim(self, name: str, abort_stale: Callable[[str, int], None], wait_s: float = UPDATE_SLOT_WAIT_S) -> None:
        """Take `name`'s slot, waiting up to `wait_s` for the update holding it; ABORTED when it stays held."""
        give_up = self._clock() + wait_s
        with self._changed:
            while name in self._held:
                version, since = self._held[name]
                if version and self._clock() - since > UPDATE_PENDING_S:
                    del self._held[name]
                    self._changed.release()
                    try:
                        abort_stale(name, version)
                    finally:
                        self._changed.acquire()
                    continue
                left = give_up - self._clock()
                if left <= 0:
                    raise Aborted(f"tensor {name!r} has an update pending (version {version}); updates of a table "
                                  f"take turns, ask again")
                self._changed.wait(left)
            self._held[name] = (0, self._clock())

    def bind(self, name: str, version: int) -> None:
        """The claimed slot of `name` is held by pending `version` now."""
        with self._changed:
            self._held[name] = (version, self._clock())

    def end(self, name: str, version: int | None = None) -> None:
        """Free `name`'s slot if `version` holds it (0: a claim not bound to a version yet; None: whatever holds
        it, for a delete), waking the next update."""
        with self._changed:
            held = self._held.get(name)
            if held is not None and (version is None or held[0] == version):
                del self._held[name]
                self._changed.notify_all()
