"""The leader's lease in the SQLite catalog file: one row of its `leadership` table, for coordinators on one host.

Several coordinator processes on one host may share one state dir (one catalog file, WAL mode): the row names
the holder, the address it serves at, its term and when its lease expires (seconds of the host's wall clock,
the one clock every process on the host shares). Taking a lapsed lease and renewing one are transactions of the
file's own (BEGIN IMMEDIATE: one writer at a time), so two processes never both take it. `check_term` is the
fencing of the catalog's writes (server/coordinator/catalog/sqlite.py): inside the write transaction, the
writer's term must still be the row's.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shardserve.server.common.errors import NotLeader
from shardserve.server.coordinator.catalog.leadership import Leader, Leadership

TABLE = (
    "CREATE TABLE IF NOT EXISTS leadership (id INTEGER PRIMARY KEY CHECK (id = 1), holder TEXT NOT NULL, "
    "address TEXT NOT NULL, term INTEGER NOT NULL, expires_at REAL NOT NULL)"
)


class SQLiteLeadership(Leadership):
    """The lease row in the SQLite file at `path`; `clock`: the host's wall clock (seconds)."""

    def __init__(
        self,
        path: str | Path,
        *,
        lease_duration: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not lease_duration > 0:
            raise ValueError("--lease-duration must be > 0 seconds")
        self.lease_duration = lease_duration
        self._clock = clock
        self._lock = threading.Lock()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # a busy file waits at most a quarter lease: a renewal stuck behind another writer must fail in time
        self._db = sqlite3.connect(
            str(path), isolation_level=None, check_same_thread=False, timeout=lease_duration / 4
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        with self._transaction() as db:
            db.execute(TABLE)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def try_acquire(self, holder: str, address: str) -> int | None:
        if (
            self.leader() is not None
        ):  # read without the write lock: a standby's polls never block writers
            return None
        with self._transaction() as db:
            row = db.execute("SELECT term, expires_at FROM leadership WHERE id = 1").fetchone()
            now = self._clock()
            if row is not None and row[1] > now:
                return None  # taken meanwhile
            term = (row[0] if row is not None else 0) + 1
            db.execute(
                "INSERT OR REPLACE INTO leadership (id, holder, address, term, expires_at) "
                "VALUES (1, ?, ?, ?, ?)",
                (holder, address, term, now + self.lease_duration),
            )
        return term

    def renew(self, term: int) -> bool:
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE leadership SET expires_at = ? WHERE id = 1 AND term = ?",
                (self._clock() + self.lease_duration, term),
            )
            return cursor.rowcount == 1

    def leader(self) -> Leader | None:
        with self._lock:
            row = self._db.execute(
                "SELECT address, term FROM leadership WHERE id = 1 AND expires_at > ?",
                (self._clock(),),
            ).fetchone()
        return Leader(row[0], row[1]) if row is not None else None

    def resign(self, term: int) -> None:
        with self._transaction() as db:
            db.execute("UPDATE leadership SET expires_at = 0 WHERE id = 1 AND term = ?", (term,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def check_term(db: sqlite3.Connection, term: int) -> None:
    """Within a write transaction of the catalog: NotLeader unless `term` still holds the lease row (a newer
    term took over, naming its address), so a deposed leader's write is rolled back."""
    row = db.execute("SELECT term, address FROM leadership WHERE id = 1").fetchone()
    if row is None or row[0] != term:
        leader = row[1] if row is not None else ""
        newer = row[0] if row is not None else 0
        raise NotLeader(
            f"this coordinator's term {term} no longer leads (term {newer} at {leader or 'none'}): "
            "nothing was written",
            leader=leader,
            term=newer,
        )
