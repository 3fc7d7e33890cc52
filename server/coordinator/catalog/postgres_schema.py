"""The catalog's PostgreSQL schema and its migrations: the tables of SCHEMA_VERSION, and the steps that bring a
database written by an earlier shardserve up to it when a coordinator opens it.

The schema's version is the one row of the `schema_version` table (no table: version 0, an empty database).
Its numbers are those of the SQLite schema (server/coordinator/catalog/sqlite_schema.py): a version stands for
one layout of the records' JSON documents (server/coordinator/catalog/documents.py), whichever store keeps
them, so the same documents move between the two (`shardserve catalog copy`). Each step runs inside the open
transaction the catalog hands it, under a transaction-level advisory lock, so coordinators that open one
database at once migrate it once, and a migration that fails changes nothing.

Names and prefixes are `COLLATE "C"`: rows list in the byte order of their UTF-8 names, as SQLite lists them.
Documents are `jsonb`: the catalog's queries read fields of them in the database (a snapshot's tensor names,
the rows being promoted) without fetching and decoding them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import psycopg

from shardserve.server.coordinator.catalog.sqlite_schema import SCHEMA_VERSION

log = logging.getLogger("shardserve.server.coordinator.catalog.postgres")

MIGRATION_LOCK = 0x5348_4152_4443_0001
"""The advisory lock key that serializes opening (and migrating) one database."""

_TABLES = (
    """CREATE TABLE tensors (
        name text COLLATE "C" NOT NULL,
        version bigint NOT NULL,
        state text NOT NULL,
        record jsonb NOT NULL,
        PRIMARY KEY (name, version)
    )""",
    "CREATE INDEX tensors_pending ON tensors (version) WHERE state = 'pending'",
    "CREATE INDEX tensors_promoting ON tensors (version) WHERE (record->>'promoting')::boolean",
    """CREATE TABLE snapshots (
        prefix text COLLATE "C" NOT NULL,
        number bigint NOT NULL,
        record jsonb NOT NULL,
        PRIMARY KEY (prefix, number)
    )""",
    "CREATE TABLE counters (name text PRIMARY KEY, value bigint NOT NULL)",
    "INSERT INTO counters (name, value) VALUES ('version', 0)",
    """CREATE TABLE leader (
        id integer PRIMARY KEY CHECK (id = 1),
        holder text NOT NULL,
        address text NOT NULL,
        term bigint NOT NULL,
        expires_at timestamptz NOT NULL
    )""",
)


def _create(db: psycopg.Connection) -> int:
    """An empty database (version 0) to the current schema: every table made."""
    for statement in _TABLES:
        db.execute(statement)
    return SCHEMA_VERSION


_STEPS: dict[int, Callable[[psycopg.Connection], int]] = {0: _create}
"""The step from each earlier version: it changes the tables and returns the version it brought them to."""


def upgrade(db: psycopg.Connection, where: str) -> None:
    """Within an open transaction: bring the tables of the database (named `where` in messages) to
    SCHEMA_VERSION; nothing to do when they are current. RuntimeError for a newer schema than this
    shardserve's."""
    db.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
    row = db.execute("SELECT version FROM schema_version").fetchone()
    found = int(row[0]) if row is not None else 0
    if found > SCHEMA_VERSION:
        raise RuntimeError(
            f"catalog {where} has schema version {found}, newer than this shardserve's "
            f"({SCHEMA_VERSION}): run the shardserve that wrote it"
        )
    if found == SCHEMA_VERSION:
        return
    start = found
    while found < SCHEMA_VERSION:
        found = _STEPS[found](db)
    db.execute("DELETE FROM schema_version")
    db.execute("INSERT INTO schema_version (version) VALUES (%s)", (found,))
    if start:
        log.warning("catalog %s migrated from schema version %d to %d", where, start, found)
    else:
        log.info("catalog %s: tables of schema version %d made", where, found)
