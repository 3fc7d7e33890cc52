"""Reconciling what a rank holds with the catalog, after it (re)registers or comes back from the dead.

A version the rank no longer holds has lost its copies there: they are recorded in the catalog record
(`lost_shards`) and the tensor stays (read from other copies, repaired, or reported lost). A version the rank
holds that the catalog does not know is dropped; a READY one it holds but does not serve yet is promoted again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from shardserve.server.common.errors import ServiceError
from shardserve.server.coordinator.drivers.context import DriverContext
from shardserve.server.coordinator.ranks.health import health_of, unavailable_shards

log = logging.getLogger(__name__)

RECONCILE_ATTEMPTS = 4  # GetStats tries for a rank that is alive again


class Reconciler:
    """Compares a rank's versions with the catalog and acts on the difference."""

    def __init__(self, context: DriverContext) -> None:
        self.catalog, self.registry, self.calls, self.locks = (
            context.catalog,
            context.registry,
            context.calls,
            context.locks,
        )

    def reconcile_from_stats(self, rank: int, wait: Callable[[float], bool]) -> None:
        """Reconcile a rank that was unreachable for a while: drops sent meanwhile were skipped. Its first answer
        after a cut link may fail (a connection reset), so GetStats is asked a few times, `wait`ing between
        tries (it returns True when the coordinator stops)."""
        for attempt in range(RECONCILE_ATTEMPTS):
            holdings = self.calls.held_by(rank)
            if holdings is not None:
                self.reconcile(rank, holdings.held, served=holdings.served)
                return
            if wait(1.0 + attempt):
                return
        log.error(
            "rank %d could not be reconciled: GetStats failed %d times", rank, RECONCILE_ATTEMPTS
        )

    def reconcile(
        self,
        rank: int,
        held: set[tuple[str, int]],
        *,
        served: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        """After a (re)registration: mark the copies the rank lost, drop what the catalog does not know, promote
        again the READY versions it holds but does not serve (`served`: those it said it serves already; after a
        coordinator's restart, all of them).

        `held` was taken before the catalog is read here, so a version put on the rank in between is
        READY in the catalog yet not in `held`: a version looks lost only if the rank, asked again after
        the reading, still does not hold it. The catalog is read for this rank's versions only (an indexed
        query), the READY ones it holds unserved are promoted again in one call and the unknown ones dropped in one;
        each lost record is marked on its own (one failure is logged)."""
        try:
            known, missing, promote = set(), [], []
            for placed in self.catalog.placed_versions([rank]):
                known.add(placed.key)
                if placed.key in held:
                    if placed.ready and placed.key not in served:
                        promote.append(placed.key)
                elif placed.ready:
                    missing.append(placed.key)
            self._promote_all(rank, promote)
            # None: nothing missing, or the rank cannot tell: nothing marked lost
            now = self.calls.held_by(rank) if missing else None
            if now is not None:
                for key in missing:
                    if key not in now.held:
                        self._step(rank, key, "mark lost", self._mark_lost)
            unknown = sorted(held - known)
            if unknown:
                self.calls.drop_many_quietly({rank: unknown})
        except Exception:  # noqa: BLE001 - a background task must log, not vanish
            log.exception("reconciling rank %d failed", rank)
        finally:
            self.registry.restore_done(
                rank
            )  # its restored versions are promoted (or reported lost)

    def _promote_all(self, rank: int, keys: list[tuple[str, int]]) -> None:
        """Promote the versions `keys` on `rank` again with one PromoteMany; when the batch fails (one version the
        rank dropped meanwhile fails it whole), each on its own, so that one failure is logged and the others
        done."""
        if not keys:
            return
        try:
            self.calls.promote_many({rank: keys}, f"re-promote {len(keys)} versions")
        except ServiceError:
            for key in keys:
                self._step(rank, key, "re-promote", self._promote)

    def _promote(self, rank: int, key: tuple[str, int]) -> None:
        name, version = key
        self.calls.promote([rank], name, version, f"re-promote {name!r}")

    def _mark_lost(self, rank: int, key: tuple[str, int]) -> None:
        """Record that `rank` lost its copies of a READY version (it came back without them), if it is still that
        record: the tensor stays in the catalog, its boxes read from other copies or reported lost."""
        name, version = key
        with self.locks.hold(name):
            current = self.catalog.get(name, version)
            if current is None or not current.ready:
                return
            shards = current.metadata.shards_on(rank)
            if set(shards) <= set(current.lost_shards):
                return
            marked = current.with_lost(shards)
            self.catalog.update(marked)
            health = health_of(marked, unavailable_shards(marked, self.registry.rank_unreadable))
            log.warning(
                "rank %d lost its copies of tensor %r version %d (restarted?): shards %s; the tensor is "
                "now %s",
                rank,
                name,
                version,
                shards,
                health.state if health is not None else "",
            )

    def _step(
        self,
        rank: int,
        key: tuple[str, int],
        what: str,
        step: Callable[[int, tuple[str, int]], None],
    ) -> None:
        try:
            step(rank, key)
        except (ServiceError, grpc.RpcError) as err:
            log.warning(
                "reconciling rank %d: could not %s %r version %d: %s",
                rank,
                what,
                key[0],
                key[1],
                err,
            )
