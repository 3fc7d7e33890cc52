"""The lease of an SQLite catalog: one row of a `leader` table in the catalog's file, for coordinators that share
one host (and so one file); the clock is SQLite's `now`, the host's wall clock.

Every statement runs inside a transaction of the catalog (BEGIN IMMEDIATE: one writer at a time over the
file), so a takeover and a fenced write never interleave. The table is made when it is first needed: a
catalog that never has a lease keeps the schema it had.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager

from shardserve.server.coordinator.catalog.leadership import (
    LEASE_DURATION_S,
    Leadership,
    Lease,
    not_leader,
)

Transaction = Callable[[], AbstractContextManager[sqlite3.Connection]]

NOW = "((julianday('now') - 2440587.5) * 86400.0)"
"""SQLite's clock as Unix seconds (to the millisecond)."""

TABLE = (
    "CREATE TABLE IF NOT EXISTS leader (id INTEGER PRIMARY KEY CHECK (id = 1), holder TEXT NOT NULL, "
    "address TEXT NOT NULL, term INTEGER NOT NULL, expires_at REAL NOT NULL)"
)


class SQLiteLeadership(Leadership):
    """The lease row of one SQLite catalog; `transaction` opens one of the catalog's write transactions."""

    def __init__(self, transaction: Transaction, lease_duration: float = LEASE_DURATION_S) -> None:
        super().__init__(lease_duration)
        self._transaction = transaction

    def try_acquire(self, holder: str, address: str) -> int | None:
        with self._transaction() as db:
            row = db.execute(f"SELECT holder, term, expires_at > {NOW} FROM leader").fetchone()
            if row is not None and row[2] and row[0] != holder:
                return None
            term = (row[1] if row is not None else 0) + 1
            db.execute(
                f"INSERT OR REPLACE INTO leader (id, holder, address, term, expires_at) "
                f"VALUES (1, ?, ?, ?, {NOW} + ?)",
                (holder, address, term, self.lease_duration),
            )
            return int(term)

    def renew(self, term: int) -> bool:
        with self._transaction() as db:
            cursor = db.execute(
                f"UPDATE leader SET expires_at = {NOW} + ? WHERE term = ? AND expires_at > 0",
                (self.lease_duration, term),
            )
            return cursor.rowcount == 1

    def leader(self) -> Lease | None:
        with self._transaction() as db:
            row = db.execute(
                f"SELECT address, term FROM leader WHERE expires_at > {NOW}"
            ).fetchone()
        return Lease(row[0], int(row[1])) if row is not None else None

    def resign(self, term: int) -> None:
        with self._transaction() as db:  # 0: resigned (renew refuses it), and long run out
            db.execute("UPDATE leader SET expires_at = 0 WHERE term = ?", (term,))


def check_term(db: sqlite3.Connection, term: int) -> None:
    """Within an open write transaction: NotLeader unless the lease holds `term` and has not run out."""
    if db.execute(
        f"SELECT 1 FROM leader WHERE term = ? AND expires_at > {NOW}", (term,)
    ).fetchone():
        return
    row = db.execute(f"SELECT address, term FROM leader WHERE expires_at > {NOW}").fetchone()
    raise not_leader(term, Lease(row[0], int(row[1])) if row is not None else None)
