"""The `Leadership` interface: the lease that makes one coordinator of several over one catalog the leader.

Several coordinators may share one catalog; the one holding the lease leads (serves every call and writes the
catalog), the others stand by. The lease lives in the catalog's own database, so whoever can write the catalog
can also see who leads: a row whose holder renews it before it expires (the SQLite store:
server/coordinator/catalog/sqlite_leadership.py). Each acquisition starts a new term, a number that only grows;
the catalog's writes of a leader check its term in the same transaction (fencing), so a leader that lost the
lease while paused or cut off can never write again. The timing (when to renew, when to stop serving) is the
caller's: server/coordinator/lease_keeper.py.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True)
class Leader:
    """The coordinator that holds the lease: the HOST:PORT clients and ranks reach it at, and its term."""

    address: str
    term: int


class Leadership(abc.ABC):
    """The lease of the leader over one catalog, `lease_duration` seconds from its last renewal."""

    lease_duration: float

    @abc.abstractmethod
    def try_acquire(self, holder: str, address: str) -> int | None:
        """Take the lease for `holder` (one coordinator process, serving at `address`) if no one holds it or
        its lease lapsed: the new term (greater than every earlier one), else None."""

    @abc.abstractmethod
    def renew(self, term: int) -> bool:
        """Extend the lease of `term` to lease_duration from now; False when `term` no longer holds it (another
        coordinator took over). A database that cannot be reached raises."""

    @abc.abstractmethod
    def leader(self) -> Leader | None:
        """The holder of the lease while it has not lapsed, else None."""

    @abc.abstractmethod
    def resign(self, term: int) -> None:
        """Give up the lease of `term` now, so a standby need not wait for it to lapse (nothing when `term`
        does not hold it)."""

    def close(self) -> None:
        """Release the connection to the database."""
