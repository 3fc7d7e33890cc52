"""Which coordinator leads a cluster: one lease, kept in the catalog's own database, and the terms that fence.

Several coordinators may run over one catalog; one of them leads. The lease is one row in the catalog's
database (holder, address, term, expires_at), and its expiry is read by the database's clock, never a
coordinator's: a coordinator that is paused, partitioned or slow cannot think its lease longer than the
database does. Each acquisition gives a new term, one more than any before it in that database; a catalog
fenced with a term (`Catalog.fence`) checks, in the same transaction as each write, that the lease still holds
that term and has not expired, and raises `NotLeader` (server/common/errors.py) otherwise, changing nothing:
a deposed leader can never write, whatever it believes.

How a coordinator uses it (server/coordinator/lease_keeper.py, timed by shardcore/lease_timing.py):
`try_acquire` every quarter lease while it stands by; once it has a term, it fences a catalog with it and
leads, calling `renew` every quarter lease. It counts its lease from the moment it sent the renew that
succeeded (by its own monotonic clock: that moment is no later than the database's `now()` of the renew),
and stops serving three quarters of a lease after it, before the database can let another take the lease.
`resign` hands the lease back at once (a coordinator that stops). Database errors (it is restarting,
unreachable) raise `CatalogUnavailable`.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

from shardserve.server.common.errors import NotLeader

LEASE_DURATION_S = 3.0
"""Seconds a lease lasts after it was acquired or last renewed, by the database's clock: a standby takes over
within about this long (plus a quarter of it, its next try) after its leader dies or loses the database."""


class Lease(NamedTuple):
    """The live lease: the leader's address (as it gave it to `try_acquire`) and its term."""

    address: str
    term: int


class Leadership(abc.ABC):
    """The lease of one catalog's database: who leads, with which term, until when (the database's clock)."""

    def __init__(self, lease_duration: float = LEASE_DURATION_S) -> None:
        if not lease_duration > 0:
            raise ValueError(f"lease_duration must be > 0 seconds, got {lease_duration}")
        self.lease_duration = lease_duration

    @abc.abstractmethod
    def try_acquire(self, holder: str, address: str) -> int | None:
        """Take the lease for `holder` (a name unique to this coordinator process) advertising `address`
        (HOST:PORT clients dial) when no one holds it (never held, expired, resigned) or `holder` itself
        holds it: the new term, greater than every term before it; None when another holder's lease is live."""

    @abc.abstractmethod
    def renew(self, term: int) -> bool:
        """Extend the lease of `term` by lease_duration from the database's now (also after it ran out, while
        no other holder took it); False when `term` no longer holds it (another holder took it over, or it was
        resigned: the caller is deposed)."""

    @abc.abstractmethod
    def leader(self) -> Lease | None:
        """The live lease (address, term), or None when no one holds one now."""

    @abc.abstractmethod
    def resign(self, term: int) -> None:
        """End the lease of `term` now, so that a standby takes over at its next attempt (nothing when `term`
        no longer holds it)."""


def not_leader(term: int, current: Lease | None) -> NotLeader:
    """The error of a write fenced with `term` when the lease is `current` (None: no one holds one now)."""
    if current is None:
        return NotLeader(f"the lease of term {term} ran out and no coordinator leads now")
    return NotLeader(
        f"the lease of term {term} passed to term {current.term}: the leader is {current.address}",
        metadata={"leader": current.address, "term": current.term},
    )
