"""The lease of a PostgreSQL catalog: the one row of its `leader` table, timed by the database's clock.

Each call is one statement in a transaction of its own, so PostgreSQL's row lock orders acquisitions: of two
standbys that try at once, the second sees the first's fresh lease and gets nothing. A fenced write reads the
row `FOR SHARE` in its own transaction (`check_term`): an acquisition waits for the write to end, and a write
that starts after it sees the new term and is refused. Times are `clock_timestamp()`, the database's clock
when the statement runs (not when its transaction began).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import psycopg

from shardserve.server.coordinator.catalog.leadership import (
    LEASE_DURATION_S,
    Leadership,
    Lease,
    not_leader,
)

Connection = Callable[[], AbstractContextManager[psycopg.Connection]]

_ACQUIRE = """
INSERT INTO leader (id, holder, address, term, expires_at)
VALUES (1, %(holder)s, %(address)s, 1, clock_timestamp() + make_interval(secs => %(duration)s))
ON CONFLICT (id) DO UPDATE SET holder = EXCLUDED.holder, address = EXCLUDED.address,
    term = leader.term + 1, expires_at = EXCLUDED.expires_at
WHERE leader.expires_at <= clock_timestamp() OR leader.holder = EXCLUDED.holder
RETURNING term
"""

_LIVE = "SELECT address, term FROM leader WHERE expires_at > clock_timestamp()"


class PostgresLeadership(Leadership):
    """The lease row of one PostgreSQL catalog; `connection` lends one of its connections (autocommit: each
    statement its own transaction)."""

    def __init__(self, connection: Connection, lease_duration: float = LEASE_DURATION_S) -> None:
        super().__init__(lease_duration)
        self._connection = connection

    def try_acquire(self, holder: str, address: str) -> int | None:
        arguments = {"holder": holder, "address": address, "duration": self.lease_duration}
        with self._connection() as db:
            row = db.execute(_ACQUIRE, arguments).fetchone()
        return int(row[0]) if row is not None else None

    def renew(self, term: int) -> bool:
        with self._connection() as db:  # -infinity: resigned, never renewed
            cursor = db.execute(
                "UPDATE leader SET expires_at = clock_timestamp() + make_interval(secs => %s) "
                "WHERE term = %s AND expires_at > '-infinity'",
                (self.lease_duration, term),
            )
            return cursor.rowcount == 1

    def leader(self) -> Lease | None:
        with self._connection() as db:
            row = db.execute(_LIVE).fetchone()
        return Lease(row[0], int(row[1])) if row is not None else None

    def resign(self, term: int) -> None:
        with self._connection() as db:
            db.execute("UPDATE leader SET expires_at = '-infinity' WHERE term = %s", (term,))


def check_term(db: psycopg.Connection, term: int) -> None:
    """Within an open write transaction: the lease row locked FOR SHARE until the transaction ends, and
    NotLeader unless it holds `term` and has not run out."""
    held = db.execute(
        "SELECT term FROM leader WHERE term = %s AND expires_at > clock_timestamp() FOR SHARE",
        (term,),
    ).fetchone()
    if held is not None:
        return
    row = db.execute(_LIVE).fetchone()
    raise not_leader(term, Lease(row[0], int(row[1])) if row is not None else None)
