"""The networked catalog: `Catalog` (server/coordinator/catalog/interface.py) kept in a PostgreSQL database.

For a coordinator that outlives its host: the database's own replication (streaming replicas, a managed
service) keeps the catalog, and several coordinators share it, one leading (server/coordinator/catalog/
leadership.py). The rows are those of the SQLite store (server/coordinator/catalog/sqlite.py), each record one
JSON document (server/coordinator/catalog/documents.py) beside the columns it is looked up by, and every
method behaves as SQLite's does: one transaction per change, all or nothing, writes one at a time (a
transaction-level advisory lock stands for SQLite's one writer), the same version counter handed out in
blocks. The tables and their migrations: server/coordinator/catalog/postgres_schema.py.

Connections come from a pool (psycopg_pool), each checked before it is lent, so the coordinator's threads
share a few and a restarted database is reconnected to on the next call. A call that cannot reach the
database raises CatalogUnavailable (UNAVAILABLE, retryable); `durable` False commits without waiting for the
WAL flush (`synchronous_commit = off`).

A fenced write holds the lease row `FOR SHARE` until its transaction ends, so a standby's acquisition waits for
it. A leader frozen inside such a transaction (SIGSTOP, a VM paused, a hung host) would hold that lock, and
with it every takeover, for as long as its connection lives: each fenced write therefore runs with
`idle_in_transaction_session_timeout` of one lease, and the database ends the session of a leader that stalls
that long between two statements (its locks released, its write rolled back; the leader, if it resumes, finds
the connection gone and the call fails as CatalogUnavailable). A write transaction that idle could not have
kept the lease anyway: the leader's own renewal waits for the same row lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from shardserve.server.common.errors import CatalogUnavailable
from shardserve.server.coordinator.catalog.documents import (
    RemovedRows,
    dumps,
    snapshot_json,
    snapshot_of,
    tensor_json,
    tensor_of,
)
from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.leadership import LEASE_DURATION_S, Leadership
from shardserve.server.coordinator.catalog.postgres_leadership import PostgresLeadership, check_term
from shardserve.server.coordinator.catalog.postgres_schema import ON_RANKS, upgrade
from shardserve.server.coordinator.catalog.records import (
    CatalogContents,
    PlacedVersion,
    ShardChecksums,
    SnapshotRecord,
    TensorRecord,
    TensorState,
    state_of,
)
from shardserve.server.coordinator.catalog.sqlite import VERSION_BLOCK, not_empty
from shardserve.server.coordinator.catalog.urls import redacted

log = logging.getLogger(__name__)

POOL_SIZE = 8
"""Connections the pool keeps at most: catalog calls are short, and writes go one at a time anyway."""

CONNECT_TIMEOUT_S = 5.0
"""Seconds a call waits for a working connection (the database restarting, unreachable) before it fails with
CatalogUnavailable; also how long opening the catalog waits for the first one."""

WRITE_LOCK = 0x5348_4152_4443_0002
"""The advisory lock key each write transaction takes first: writes go one at a time, as in SQLite."""

_READY, _PENDING = TensorState.READY.value, TensorState.PENDING.value


class PostgresCatalog(Catalog):
    """The catalog in the PostgreSQL database of libpq URL `url` (postgresql://USER@HOST:PORT/DB; a password
    may come from the URL, PGPASSWORD or ~/.pgpass, and never shows in messages). `connect_timeout`: seconds a
    call waits for a working connection before CatalogUnavailable; libpq's `connect_timeout` in the URL
    (?connect_timeout=S) sets it instead."""

    def __init__(
        self, url: str, *, pool_size: int = POOL_SIZE, connect_timeout: float = CONNECT_TIMEOUT_S
    ) -> None:
        self.location = redacted(url)
        try:
            connect_timeout = url_connect_timeout(url, connect_timeout)
        except ValueError as err:
            raise RuntimeError(f"catalog {self.location} cannot be opened: {err}") from None
        self._connect_timeout = connect_timeout
        self._term: int | None = None  # the lease term every write checks (fence), None: none
        # a fenced write's idle limit: the lease, as leadership() was last given it
        self._lease_duration = LEASE_DURATION_S
        self._block_lock = threading.Lock()  # the reserved block of version numbers: [next, end)
        self._block_next = self._block_end = 0
        self._pool = psycopg_pool.ConnectionPool(
            connection_string(url, connect_timeout),
            min_size=1,
            max_size=pool_size,
            kwargs={"autocommit": True},
            check=psycopg_pool.ConnectionPool.check_connection,
            timeout=connect_timeout,
            name="shardserve-catalog",
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
            with self._transaction(fenced=False) as db:
                upgrade(db, self.location)
        except (psycopg.Error, CatalogUnavailable) as err:
            self._pool.close()
            raise RuntimeError(f"catalog {self.location} cannot be opened: {err}") from err
        except BaseException:
            self._pool.close()
            raise
        log.info(
            "catalog %s: %d tensor versions", self.location, len(self.list(include_pending=True))
        )

    @contextmanager
    def _connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection]:
        """A pooled connection, waited for up to `timeout` seconds (None: the pool's); a database that cannot
        be reached raises CatalogUnavailable."""
        try:
            with self._pool.connection(timeout=timeout) as db:
                yield db
        except psycopg.OperationalError as err:  # the pool's PoolTimeout is one too
            raise CatalogUnavailable(f"catalog {self.location} unavailable: {err}") from err

    @contextmanager
    def _transaction(
        self, durable: bool = True, *, fenced: bool = True
    ) -> Iterator[psycopg.Connection]:
        """One write transaction, after every other one (WRITE_LOCK); `durable` False commits without waiting
        for the WAL flush; `fenced`: first check the lease term the catalog was fenced with (NotLeader)."""
        with self._connection() as db, db.transaction():
            if not durable:
                db.execute("SET LOCAL synchronous_commit = off")
            term = self._term if fenced else None
            if term is None:
                db.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
            else:  # see the module docstring: a leader stalled mid-write must not hold off a takeover
                db.execute(
                    "SELECT pg_advisory_xact_lock(%s), "
                    "set_config('idle_in_transaction_session_timeout', %s, true)",
                    (WRITE_LOCK, str(max(1, round(self._lease_duration * 1000)))),
                )
                check_term(db, term)
            yield db

    def next_versions(self, count: int) -> list[int]:
        """`count` new version numbers, from a block reserved in one transaction per VERSION_BLOCK numbers (a
        restart skips the rest of a block: numbers only grow, never repeat)."""
        with self._block_lock:
            if self._block_next + count > self._block_end:
                reserve = max(count, VERSION_BLOCK)
                with self._transaction() as db:
                    row = db.execute(
                        "UPDATE counters SET value = value + %s WHERE name = 'version' "
                        "RETURNING value",
                        (reserve,),
                    ).fetchone()
                assert row is not None  # the counter's row is made with the tables
                end = int(row[0])
                self._block_next, self._block_end = end - reserve + 1, end + 1
            first = self._block_next
            self._block_next += count
        return list(range(first, first + count))

    def add_all(self, records: list[TensorRecord], *, durable: bool = True) -> None:
        with self._transaction(durable) as db:
            db.cursor().executemany(
                "INSERT INTO tensors (name, version, state, record) VALUES (%s, %s, %s, %s::jsonb)",
                [(r.name, r.version, r.state.value, tensor_json(r)) for r in records],
            )

    def commit_all(
        self,
        versions: list[tuple[str, int]],
        *,
        durable: bool = True,
        checksums: ShardChecksums | None = None,
    ) -> list[tuple[TensorRecord, list[TensorRecord]]]:
        sums = checksums or {}
        with self._transaction(durable) as db:
            return [
                _commit_in(db, name, version, sums.get((name, version), {}))
                for name, version in versions
            ]

    def commit_snapshot(
        self,
        snapshot: SnapshotRecord,
        *,
        durable: bool = True,
        checksums: ShardChecksums | None = None,
    ) -> tuple[SnapshotRecord, Sequence[TensorRecord]]:
        committed = snapshot.committed(checksums or {})
        with self._transaction(durable) as db:
            _mark_ready(db, committed.tensors())
            db.execute(
                "INSERT INTO snapshots (prefix, number, record) VALUES (%s, %s, %s::jsonb)",
                (committed.prefix, committed.number, snapshot_json(committed)),
            )
            removed = _drop_old_snapshots(db, committed.prefix, max(1, committed.keep))
        return committed, removed

    def snapshots(self, prefix: str) -> list[SnapshotRecord]:
        rows = _read(
            self._connection,
            "SELECT record::text FROM snapshots WHERE prefix = %s ORDER BY number",
            (prefix,),
        )
        return [snapshot_of(r[0]) for r in rows]

    def snapshot(self, prefix: str, number: int = 0) -> SnapshotRecord | None:
        query = "SELECT record::text FROM snapshots WHERE prefix = %s "
        query += "ORDER BY number DESC LIMIT 1" if number == 0 else "AND number = %s"
        rows = _read(self._connection, query, (prefix,) if number == 0 else (prefix, number))
        return snapshot_of(rows[0][0]) if rows else None

    def update(self, record: TensorRecord) -> None:
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE tensors SET state = %s, record = %s::jsonb WHERE name = %s AND version = %s",
                (record.state.value, tensor_json(record), record.name, record.version),
            )
            if cursor.rowcount != 1:
                raise KeyError(
                    f"tensor {record.name!r} version {record.version} is not in the catalog"
                )

    def remove(self, name: str, version: int = 0) -> list[TensorRecord]:
        where, args = (
            ("name = %s", (name,))
            if version == 0
            else ("name = %s AND version = %s", (name, version))
        )
        with self._transaction() as db:
            return _deleted(db, f"DELETE FROM tensors WHERE {where}", args)

    def get(self, name: str, version: int) -> TensorRecord | None:
        found = _records_where(self._connection, "name = %s AND version = %s", (name, version))
        return found[0] if found else None

    def versions(self, name: str) -> list[TensorRecord]:
        return _records_where(self._connection, "name = %s", (name,))

    def pending(self, created_before: float | None = None) -> list[TensorRecord]:
        if created_before is None:
            return _records_where(self._connection, "state = %s", (_PENDING,))
        return _records_where(
            self._connection,
            "state = %s AND (record->>'created_unix')::float8 < %s",
            (_PENDING, created_before),
        )

    def promoting(self) -> list[TensorRecord]:
        return _records_where(self._connection, "(record->>'promoting')::boolean", ())

    def holding(self, ranks: Iterable[int]) -> list[TensorRecord]:
        return _records_where(self._connection, ON_RANKS, (sorted(set(ranks)),))

    def placed_versions(self, ranks: Iterable[int]) -> list[PlacedVersion]:
        rows = _read(
            self._connection,
            f"SELECT name, version, state FROM tensors WHERE {ON_RANKS} ORDER BY version",
            (sorted(set(ranks)),),
        )
        return [PlacedVersion(name, version, state_of(state)) for name, version, state in rows]

    def placed_ranks(self) -> set[int]:
        return {r[0] for r in _read(self._connection, "SELECT DISTINCT unnest(ranks) FROM tensors")}

    def with_lost_copies(self) -> list[TensorRecord]:
        return _records_where(
            self._connection,  # the partial index tensors_lost: only rows with lost copies are read
            "jsonb_array_length(record->'lost_shards') > 0 AND state = %s",
            (_READY,),
        )

    def contents(self) -> CatalogContents:
        with (
            self._connection() as db,
            db.transaction(),
        ):  # one snapshot of the database for all three
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            tensors = db.execute(
                "SELECT record::text FROM tensors ORDER BY name, version"
            ).fetchall()
            snapshots = db.execute(
                "SELECT record::text FROM snapshots ORDER BY prefix, number"
            ).fetchall()
            counter = db.execute("SELECT value FROM counters WHERE name = 'version'").fetchone()
        assert counter is not None  # the counter's row is made with the tables
        return CatalogContents(
            tuple(tensor_of(r[0]) for r in tensors),
            tuple(snapshot_of(r[0]) for r in snapshots),
            int(counter[0]),
        )

    def restore(self, contents: CatalogContents, *, replace: bool = False) -> None:
        with self._transaction() as db:
            counts = db.execute(
                "SELECT (SELECT count(*) FROM tensors), (SELECT count(*) FROM snapshots)"
            ).fetchone()
            assert counts is not None
            if any(counts) and not replace:
                raise ValueError(not_empty(self.location, int(counts[0]), int(counts[1])))
            db.execute("DELETE FROM tensors")
            db.execute("DELETE FROM snapshots")
            cursor = db.cursor()
            cursor.executemany(
                "INSERT INTO tensors (name, version, state, record) VALUES (%s, %s, %s, %s::jsonb)",
                [(r.name, r.version, r.state.value, tensor_json(r)) for r in contents.tensors],
            )
            cursor.executemany(
                "INSERT INTO snapshots (prefix, number, record) VALUES (%s, %s, %s::jsonb)",
                [(s.prefix, s.number, snapshot_json(s)) for s in contents.snapshots],
            )
            db.execute(
                "UPDATE counters SET value = GREATEST(value, %s) WHERE name = 'version'",
                (contents.version_counter,),
            )

    def leadership(self, lease_duration: float = LEASE_DURATION_S) -> Leadership:
        self._lease_duration = lease_duration
        # a renewal waits for a connection at most a third of the lease: two more may follow before it ends
        wait = min(lease_duration / 3, self._connect_timeout)
        return PostgresLeadership(lambda: self._connection(timeout=wait), lease_duration)

    def fence(self, term: int | None) -> None:
        self._term = term

    def close(self) -> None:
        self._pool.close()

    # defined last: below it, `list` in this class body would name the method, not the builtin
    def list(self, include_pending: bool = False) -> list[TensorRecord]:
        where, args = ("true", ()) if include_pending else ("state = %s", (_READY,))
        rows = _read(
            self._connection,
            f"SELECT record::text FROM tensors WHERE {where} ORDER BY name, version",
            args,
        )
        return [tensor_of(r[0]) for r in rows]


def url_connect_timeout(url: str, default: float) -> float:
    """The seconds of libpq's `connect_timeout` in `url` (2 at least, as libpq counts them), else `default`;
    ValueError naming the parameter when it is not a whole number of seconds."""
    given = conninfo_to_dict(url).get("connect_timeout")
    if given is None:
        return default
    try:
        seconds = int(str(given))
    except ValueError:
        raise ValueError(
            f"catalog URL parameter connect_timeout={given!r} is not a whole number of seconds"
        ) from None
    return float(max(2, seconds))


def connection_string(url: str, connect_timeout: float = CONNECT_TIMEOUT_S) -> str:
    """libpq's connection string of `url`, with the settings the catalog relies on where the URL has none:
    connecting gives up after `connect_timeout` (libpq counts whole seconds, 2 at least), and TCP keepalives
    find a database that went away while a connection waited (the PG* environment variables and ~/.pgpass
    still apply: libpq reads them)."""
    params: dict[str, Any] = conninfo_to_dict(url)
    defaults = {
        "connect_timeout": max(2, round(connect_timeout)),
        "application_name": "shardserve-coordinator",
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
    }
    for key, value in defaults.items():
        params.setdefault(key, value)
    return make_conninfo("", **params)


# ---------------------------------------------------------------- rows within a transaction


def _deleted(db: psycopg.Connection, delete: str, args: tuple[Any, ...]) -> list[TensorRecord]:
    """The rows a DELETE ... (without RETURNING) removed, oldest version first."""
    rows = db.execute(f"{delete} RETURNING version, record::text", args).fetchall()
    return [tensor_of(text) for _, text in sorted(rows, key=lambda row: int(row[0]))]


def _commit_in(
    db: psycopg.Connection, name: str, version: int, checksums: dict[int, int]
) -> tuple[TensorRecord, list[TensorRecord]]:
    """Within an open transaction: (name, version) READY with `checksums`, older READY rows of `name` removed."""
    found = db.execute(
        "SELECT record::text FROM tensors WHERE name = %s AND version = %s", (name, version)
    ).fetchone()
    if found is None:
        raise KeyError(f"tensor {name!r} version {version} is not in the catalog")
    ready = replace(tensor_of(found[0]), state=TensorState.READY).with_checksums(checksums)
    older = _deleted(
        db,
        "DELETE FROM tensors WHERE name = %s AND version < %s AND state = %s",
        (name, version, _READY),
    )
    db.execute(
        "UPDATE tensors SET state = %s, record = %s::jsonb WHERE name = %s AND version = %s",
        (_READY, tensor_json(ready), name, version),
    )
    return ready, older


def _mark_ready(db: psycopg.Connection, records: Sequence[TensorRecord]) -> None:
    """Within an open transaction: the PENDING rows of `records` READY with their checksums, their documents
    changed in place by the database, in one statement (a snapshot's names are its own, so no older READY row
    of them exists); KeyError if one is gone."""
    cursor = db.execute(
        "UPDATE tensors AS t SET state = %s, record = jsonb_set(jsonb_set(t.record, '{state}', "
        "to_jsonb(%s::text)), '{checksums}', v.checksums::jsonb) "
        "FROM unnest(%s::text[], %s::bigint[], %s::text[]) AS v(name, version, checksums) "
        "WHERE t.name = v.name AND t.version = v.version AND t.state = %s",
        (
            _READY,
            _READY,
            [r.name for r in records],
            [r.version for r in records],
            [dumps([f"{c:016x}" for c in r.checksums]) for r in records],
            _PENDING,
        ),
    )
    if cursor.rowcount != len(records):
        present = {
            (name, int(version))
            for name, version in db.execute(
                "SELECT name, version FROM tensors WHERE name = ANY(%s)",
                ([r.name for r in records],),
            )
        }
        missing = [r.key for r in records if r.key not in present]
        versions = [r.key for r in records]
        raise KeyError(f"tensor versions {missing or versions} are not pending in the catalog")


def _drop_old_snapshots(db: psycopg.Connection, prefix: str, keep: int) -> RemovedRows:
    """Within an open transaction: remove the snapshots of `prefix` beyond the newest `keep` and their tensor
    rows (named by the database from the snapshots' documents); return the rows removed (not decoded yet)."""
    old = [
        int(row[0])
        for row in db.execute(
            "SELECT number FROM snapshots WHERE prefix = %s ORDER BY number DESC OFFSET %s",
            (prefix, keep),
        )
    ]
    if not old:
        return RemovedRows([])
    rows = db.execute(
        "DELETE FROM tensors WHERE name IN (SELECT e->'tensor'->>'name' FROM snapshots AS s, "
        "jsonb_array_elements(s.record->'entries') AS e WHERE s.prefix = %s AND s.number = ANY(%s)) "
        "RETURNING record::text",
        (prefix, old),
    ).fetchall()
    db.execute("DELETE FROM snapshots WHERE prefix = %s AND number = ANY(%s)", (prefix, old))
    return RemovedRows([row[0] for row in rows])


Connect = Callable[[], AbstractContextManager[psycopg.Connection]]
"""A catalog's pooled connection (PostgresCatalog._connection, bound)."""


def _read(connection: Connect, query: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The rows of one read (outside any transaction: it sees what was committed)."""
    with connection() as db:
        return db.execute(query, args).fetchall()


def _records_where(connection: Connect, where: str, args: tuple[Any, ...]) -> list[TensorRecord]:
    """The records of the rows `where` selects, oldest version first."""
    rows = _read(
        connection, f"SELECT record::text FROM tensors WHERE {where} ORDER BY version", args
    )
    return [tensor_of(r[0]) for r in rows]
