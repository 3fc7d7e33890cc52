"""How a rank serves its pending versions: every local shard fully written, hashed where the writer left no
checksum, persisted where the version is durable, then served (SERVED, its segments sealed and marked).

A weight sync's versions come with their writers' checksums and are not durable: such a batch is checked and
served under one hold of the store's lock. Otherwise each pending version is leased while its shards are hashed
(server/rank/hashing.py) and the durable ones persisted in one sync round (server/rank/persistence.py), outside
the lock, then all are served. Kept apart from ShardStore (server/rank/store.py), which composes one and shares
its lock, version table, memory and leases with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext

from shardserve.server.common.log_phrases import versions_phrase
from shardserve.server.rank.hashing import missing_checksums
from shardserve.server.rank.leases import VersionLeases
from shardserve.server.rank.persistence import Persistence, PromoteItem
from shardserve.server.rank.shard_memory import ShardMemory
from shardserve.server.rank.version_table import (
    StoredVersion,
    VersionEvent,
    VersionTable,
)

log = logging.getLogger(__name__)

ItemErrors = Callable[[int], AbstractContextManager[None]]


class VersionPromotion:
    """Promotions of one rank's pending versions, in batches; thread-safe."""

    def __init__(
        self,
        lock: threading.Lock,
        versions: VersionTable,
        memory: ShardMemory,
        leases: VersionLeases,
        *,
        persistence: Persistence | None = None,
    ) -> None:
        self.rank = versions.rank
        self.persistence = persistence
        self._lock = lock
        self._versions = versions
        self._memory = memory
        self._leases = leases

    def promote_many(
        self,
        versions: Sequence[tuple[str, int]],
        *,
        item_errors: ItemErrors | None = None,
    ) -> dict[tuple[str, int], dict[int, int]]:
        """Promote every (name, version), hashing the shards of the pending ones and persisting the batch first
        with one sync round; a version that is not promotable fails the batch before any is served, inside
        `item_errors(its index)` when given. Returns each version's local shard checksums."""
        errors = item_errors or (lambda index: nullcontext())
        with self._lock:
            records = self._promotable(versions, errors)
            # every checksum known (the writers left them) and nothing to persist: served at once
            served = (
                None
                if any(self._work_before_serving(record) for record in records)
                else self._serve(records, errors)
            )
        out = served if served is not None else self._hash_persist_and_serve(versions, errors)
        log.info("rank %d serves %s", self.rank, versions_phrase(versions))
        return out

    def _promotable(
        self,
        versions: Sequence[tuple[str, int]],
        errors: ItemErrors,
    ) -> list[StoredVersion]:
        """(lock held) The record of every (name, version), each checked promotable."""
        records = []
        for index, (name, version) in enumerate(versions):
            with errors(index):
                records.append(self._versions.promotable(name, version))
        return records

    def _work_before_serving(self, record: StoredVersion) -> bool:
        """Whether pending `record` has shards to hash or is to be persisted before it is served."""
        if not record.state.is_pending:
            return False
        durable = record.options.durable and self.persistence is not None
        return durable or any(index not in record.checksums for index in record.shards)

    def _serve(
        self,
        records: Sequence[StoredVersion],
        errors: ItemErrors,
    ) -> dict[tuple[str, int], dict[int, int]]:
        """(lock held) Serve every promotable record; each one's local shard checksums."""
        out: dict[tuple[str, int], dict[int, int]] = {}
        for index, record in enumerate(records):
            with errors(index):
                record.apply(VersionEvent.PROMOTE)
                self._memory.promote(record)
                out[record.key] = dict(record.checksums)
        return out

    def _hash_persist_and_serve(
        self,
        versions: Sequence[tuple[str, int]],
        errors: ItemErrors,
    ) -> dict[tuple[str, int], dict[int, int]]:
        """Hash the pending versions' unhashed shards (all of them together) and persist the durable ones outside
        the lock (each version leased meanwhile), then serve them all."""
        leased: list[StoredVersion] = []
        with ExitStack() as leases:
            for index, (name, version) in enumerate(versions):
                with errors(index), self._lock:
                    record = self._versions.promotable(name, version)
                    if not record.state.is_pending:
                        continue
                with errors(index):
                    leased.append(
                        leases.enter_context(self._leases.lease(name, version, served=False))
                    )
            hashed = missing_checksums(
                [(r.shards, r.checksums) for r in leased], stable_views=self._memory.stable_views
            )
            pending = [(r, {**r.checksums, **found}) for r, found in zip(leased, hashed)]
            persist = [  # what outlives a restart (persistence writes nothing of the others)
                PromoteItem(r.name, r.version, r.metadata, r.options, dict(r.shards), sums)
                for r, sums in pending
                if r.options.durable and self.persistence is not None
            ]
            if persist and self.persistence is not None:
                self.persistence.promote_many(persist)
        computed = {record.key: sums for record, sums in pending}
        with self._lock:
            records = self._promotable(versions, errors)
            for record in records:
                if record.key in computed:
                    record.checksums = computed[record.key]
            out = self._serve(records, errors)
        if self.persistence is not None:
            for item in persist:
                self.persistence.served(item.name, item.version, item.meta)
        return out
