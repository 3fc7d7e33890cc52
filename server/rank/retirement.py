"""How a rank's versions leave it: drops, the grace period of a replaced version, and the room they give back.

A drop of a served version that a newer served one replaced starts a grace period instead (GRACED,
server/rank/version_table.py): it stays served `grace` seconds more, so reads that began on it finish there
instead of failing. The grace ends when its time is over (the rank's main loop calls `end_graces`), when a newer
version of the tensor is being made (`end_graces_of`), or early when a reservation needs its memory
(`make_room`). A dropped version is freed once no lease holds it, its memory given back through ShardMemory
(server/rank/shard_memory.py); one whose shards could not be made is forgotten at once (`forget`). Kept apart
from ShardStore (server/rank/store.py), which composes one and shares its lock, version table and memory with
it, so that the store is about making and serving versions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from shardserve.server.rank.persistence import Persistence
from shardserve.server.rank.shard_memory import ShardMemory
from shardserve.server.rank.version_table import (
    StoredVersion,
    VersionEvent,
    VersionState,
    VersionTable,
)

log = logging.getLogger(__name__)

DEFAULT_VERSION_GRACE_S = (
    2.0  # a replaced served version stays readable this long (rank flag --version-grace)
)


class VersionRetirement:
    """Drops of one rank's versions, a replaced served one kept for its grace period first; thread-safe."""

    def __init__(
        self,
        lock: threading.Lock,
        versions: VersionTable,
        memory: ShardMemory,
        *,
        grace: float = DEFAULT_VERSION_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        persistence: Persistence | None = None,
    ) -> None:
        if not grace >= 0:
            raise ValueError(f"version_grace must be >= 0 seconds, got {grace}")
        self.rank = versions.rank
        self.grace = grace
        self.persistence = persistence
        self._clock = clock
        self._lock = lock
        self._versions = versions
        self._memory = memory
        # the GRACED records (the versions replaced within the last `grace` seconds): the rank's main loop
        # checks them five times a second, which must not walk every version the rank holds
        self._graced: dict[tuple[str, int], StoredVersion] = {}

    def drop(self, name: str, version: int = 0, *, log_level: int = logging.INFO) -> int:
        """Drop one version (0 = all) of `name`; memory is freed once its leases end. Idempotent. A served
        version that a newer served one replaced stays served for the grace period first (end_graces drops
        it); dropping all versions (a delete) drops at once. Returns how many versions it dropped."""
        with self._lock:
            records = self._versions.matching(name, version)
            if version:
                self._versions.remember_dropped(name, version)
            graced = []
            for record in records:
                if version and self._gets_grace(record):
                    if record.state is VersionState.SERVED:
                        record.grace_until = self._clock() + self.grace
                        self._memory.shared.mark(record.shards.values(), served=True, replaced=True)
                    record.apply(VersionEvent.REPLACE)
                    self._graced[record.key] = record
                    graced.append(record.version)
                else:
                    self._drop_locked(record)
        if self.persistence is not None and (records or version == 0):
            self.persistence.drop(name, version)
        if records and log.isEnabledFor(log_level):
            log.log(
                log_level,
                "rank %d dropped %r versions %s%s",
                self.rank,
                name,
                [r.version for r in records],
                f" (served {self.grace:g}s more: {graced})" if graced else "",
            )
        return len(records)

    def end_graces_of(self, name: str) -> None:
        """End the grace of every replaced version of `name` now that a newer version is being made: the grace
        is for readers of the version just replaced, and the version before it (replaced since) hands its memory
        to the new one. A tensor put every step then cycles through two sets of buffers that the same-host writer
        and readers keep mapped, instead of fresh memory each step. A reader still on an ended version sees it
        dropped (or its segment's generation moved) and reads the served one."""
        with self._lock:
            for record in self._versions.matching(name, 0):
                if record.state is VersionState.GRACED:
                    self._drop_locked(record)

    def end_graces(self) -> int:
        """Drop the replaced versions whose grace period is over; how many."""
        now = self._clock()
        with self._lock:
            over = [r for r in self._graced.values() if (r.grace_until or 0.0) <= now]
            for record in over:
                self._drop_locked(record)
        for record in over:
            log.info(
                "rank %d dropped %r version %d (grace over)", self.rank, record.name, record.version
            )
        return len(over)

    def forget(self, record: StoredVersion) -> None:
        """Undo the allocation of `record` (its shards could not be made): out of the table and the budget."""
        with self._lock:
            if self._versions.discard(record):
                self._memory.budget.release(record.nbytes)

    def make_room(self, nbytes: int) -> None:
        """(lock held) Let go of versions in their grace period (oldest first), then of recycled buffers, that
        a reservation of `nbytes` needs room for (limit or device capacity)."""
        budget = self._memory.budget
        if budget.room(nbytes) < 0:
            for record in sorted(self._graced.values(), key=lambda r: r.grace_until or 0.0):
                self._drop_locked(record)
                if budget.room(nbytes) >= 0:
                    break
        self._memory.trim_recycled(nbytes)

    def _gets_grace(self, record: StoredVersion) -> bool:
        """(lock held) Whether a drop of `record` starts a grace period: a newer version is served."""
        return bool(self.grace) and self._versions.replaced(record)

    def _drop_locked(self, record: StoredVersion) -> None:
        """(lock held) Drop `record` for good, freeing its memory unless a lease still holds it."""
        record.apply(VersionEvent.DROP)
        record.grace_until = None
        self._graced.pop(record.key, None)
        self._memory.shared.mark(record.shards.values(), served=False)
        if self._versions.free_if_unleased(record):
            self._memory.reclaim(record)
