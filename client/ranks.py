"""The ranks a client knows: the coordinator's latest ListRanks answer, kept with the time it came.

RankDirectory answers where a rank is (address, host, shared memory) without a call, asking the coordinator
when a rank is unknown or when asked to refresh; client.health.RankHealth decides when its answer is too old
to trust about dead ranks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from shardserve.client.errors import RankUnavailableError
from shardserve.client.info import RankStatus

RECENT_RANKS_S = 1.0
"""How old a rank list a steady put may place its layouts by (a rank dead since fails the put's create, or its
reserved version's writes, and the put tries again with the ranks listed now)."""


@dataclass(frozen=True)
class RanksView:
    """One ListRanks answer: every registered rank's status and the clock time it came (-inf: never asked)."""

    statuses: Mapping[int, RankStatus] = field(default_factory=dict)
    answered_at: float = float("-inf")

    @property
    def dead(self) -> frozenset[int]:
        """The ranks this answer reports dead."""
        return frozenset(rank for rank, status in self.statuses.items() if not status.alive)


class RankDirectory:
    """The registered ranks as the coordinator at `where` listed them last (`list_ranks` asks it)."""

    def __init__(
        self,
        list_ranks: Callable[[], Sequence[RankStatus]],
        where: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.where = where
        self._list_ranks = list_ranks
        self._clock = clock
        self._view = RanksView()
        self._lock = threading.Lock()

    def refresh(self) -> list[RankStatus]:
        """Every registered rank, asked of the coordinator now (and kept)."""
        ranks = list(self._list_ranks())
        view = RanksView({r.rank: r for r in ranks}, self._clock())
        with self._lock:
            self._view = view
        return ranks

    def recent(self, max_age_s: float) -> list[RankStatus]:
        """Every registered rank as answered at most `max_age_s` ago: the kept answer, else a new one."""
        view = self._view
        if self._clock() - view.answered_at <= max_age_s:
            return list(view.statuses.values())
        return self.refresh()

    def view(self) -> RanksView:
        """The latest answer (no call)."""
        return self._view

    def known(self) -> list[int]:
        """The ranks seen at the latest refresh, sorted (no call)."""
        return sorted(self._view.statuses)

    def status(self, rank: int) -> RankStatus:
        """The registered status of `rank` (address, host, shared memory), refreshed once if unknown."""
        status = self._view.statuses.get(rank)
        if status is None or not status.address:
            status = {r.rank: r for r in self.refresh()}.get(rank)
        if status is None or not status.address:
            raise RankUnavailableError(
                f"rank {rank} is not registered with the coordinator at {self.where}"
            )
        return status
