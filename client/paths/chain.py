"""An ordered fallback chain of data paths: try each path that may serve a rank, in order, until one does.

A path that fails with a reason saying it cannot serve us (PATH_UNAVAILABLE: no shared memory or bulk port,
a refused mapping or ticket, a broken bulk connection; client.paths.kinds.path_refused) hands the call to
the next path, and that rank is served by the next one for RETRY_AFTER_S (a lease in client.health) before the
fast path is tried again; the fallback is logged once per (path, rank) and lease. Any other error (a bad
request, a stale version, a rank that cannot be reached) is raised: the next path would fail alike. A forced
chain (transport="shm" | "bulk") raises instead of falling back, and a cancelled call is never tried again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from shardserve.client.errors import ShardServeError
from shardserve.client.health import RETRY_AFTER_S, RankHealth
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.hedging import Cancellation
from shardserve.client.paths.kinds import DataPath, PathKind, path_refused

log = logging.getLogger(__name__)
T = TypeVar("T")

_FAILED_NAMES = {
    PathKind.SHARED_MEMORY: "shared-memory",
    PathKind.BULK: "bulk TCP",
    PathKind.GRPC: "gRPC",
}
_INSTEAD_NAMES = {
    PathKind.SHARED_MEMORY: "shared memory",
    PathKind.BULK: "the bulk port",
    PathKind.GRPC: "gRPC",
}
_FALL_BACK_WORDS = {"read": ("read from", "reading it"), "write": ("write to", "writing to it")}


class FallbackChain:
    """`paths` tried in order for each rank (module docstring); `forced`: one path, its failures raised."""

    def __init__(
        self, paths: Sequence[DataPath], health: RankHealth, *, forced: bool = False
    ) -> None:
        if not paths:
            raise ValueError("a fallback chain needs at least one path")
        self.paths = tuple(paths)
        self.health = health
        self.forced = forced

    @property
    def kinds(self) -> tuple[PathKind, ...]:
        return tuple(path.kind for path in self.paths)

    def first(self, rank: RankStatus, summary: TensorSummary | None = None) -> DataPath | None:
        """The path a call to `rank` tries first now (None: none may serve it); no error, no log."""
        return next(iter(self._usable(rank, summary)), None)

    def paths_for(self, rank: RankStatus, summary: TensorSummary | None = None) -> list[DataPath]:
        """The paths a call to `rank` tries now, in order; a forced chain whose path cannot serve `rank` raises
        that path's refusal."""
        usable = self._usable(rank, summary)
        if not usable and self.forced:
            raise self.paths[0].refusal(rank)
        return usable

    def run(
        self,
        rank: RankStatus,
        attempt: Callable[[DataPath], T],
        *,
        doing: str = "read",
        cancel: Cancellation | None = None,
    ) -> tuple[T, PathKind]:
        """`attempt(path)` on each usable path in turn until one serves; returns its result and its kind."""
        paths = self.paths_for(rank)
        for position, path in enumerate(paths):
            try:
                return attempt(path), path.kind
            except ShardServeError as err:
                last = position == len(paths) - 1
                if last or not self.falls_back(path, rank, err, doing=doing, cancel=cancel):
                    raise
        raise self.paths[-1].refusal(rank)

    def falls_back(
        self,
        path: DataPath,
        rank: RankStatus,
        err: BaseException,
        *,
        doing: str = "read",
        cancel: Cancellation | None = None,
    ) -> bool:
        """Whether a call that `path` failed with `err` goes on to the next path; if so `rank` backs off `path`
        for RETRY_AFTER_S (logged)."""
        if self.forced or not path_refused(err) or (cancel is not None and cancel.cancelled):
            return False
        self.health.back_off(path.kind, rank.address, RETRY_AFTER_S)
        failed, again = _FALL_BACK_WORDS[doing]
        rest = self.paths[self.paths.index(path) + 1 :]
        log.warning(
            "%s %s rank %d failed; %s over %s for %.0f s: %s",
            _FAILED_NAMES[path.kind],
            failed,
            rank.rank,
            again,
            " or ".join(_INSTEAD_NAMES[later.kind] for later in rest),
            RETRY_AFTER_S,
            err,
        )
        return True

    def without(self, kind: PathKind) -> FallbackChain:
        """This chain less the path of `kind` (forced no more when nothing forced is left)."""
        rest = [path for path in self.paths if path.kind != kind]
        return FallbackChain(rest, self.health, forced=self.forced and len(rest) == len(self.paths))

    def _usable(self, rank: RankStatus, summary: TensorSummary | None) -> list[DataPath]:
        """The paths that may serve `rank` now: supporting it and, unless forced, not backing off."""
        return [
            path
            for path in self.paths
            if path.supports(rank, summary)
            and (self.forced or not self.health.backing_off(path.kind, rank.address))
        ]
