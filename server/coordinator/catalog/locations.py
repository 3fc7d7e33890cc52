"""Where a catalog is kept, and opening it: the SQLite file under the state dir (the default), another SQLite
file, or a PostgreSQL database named by a libpq URL (postgresql://USER@HOST:PORT/DB).

`--catalog` of `coordinator` and `up`, and both ends of `shardserve catalog copy`, are such locations. A URL's
password (if it carries one) never shows in messages or logs: `redacted` drops it. The PostgreSQL store and
its client library are imported only when a URL asks for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from shardserve.server.coordinator.catalog.urls import is_postgres_url, redacted

if TYPE_CHECKING:  # the stores are imported when a catalog is opened: they pull in torch
    from shardserve.server.coordinator.catalog.interface import Catalog

CATALOG_FILE = "catalog.sqlite"
"""The SQLite catalog's file under the state dir (where a coordinator keeps its catalog by default)."""


def sqlite_path(location: str | None, state_dir: str | Path) -> Path:
    """The SQLite file of `location` (None: CATALOG_FILE under `state_dir`); ValueError for a URL of another
    kind than PostgreSQL's."""
    if not location:
        return Path(state_dir) / CATALOG_FILE
    if "://" in location:
        scheme = location.partition("://")[0]
        raise ValueError(
            f"catalog {redacted(location)!r}: {scheme}:// is not a catalog store "
            "(a postgresql://USER@HOST:PORT/DB URL or an SQLite file's path)"
        )
    return Path(location)


def check_location(location: str) -> str:
    """`location` when it can name a catalog (a PostgreSQL URL or a file path); ValueError else."""
    if not location:
        raise ValueError("the catalog's location is empty (a postgresql:// URL or an SQLite file)")
    if not is_postgres_url(location):
        sqlite_path(location, ".")
    return location


def open_catalog(location: str | None, state_dir: str | Path = ".shardserve") -> Catalog:
    """The catalog at `location`: None (or empty), the SQLite file under `state_dir`, as a coordinator keeps by
    default; a postgresql:// URL, that database (made ready on first open); else an SQLite file's path.
    RuntimeError when it cannot be opened (the database unreachable, a newer schema)."""
    if location and is_postgres_url(location):
        try:
            from shardserve.server.coordinator.catalog.postgres import PostgresCatalog
        except ImportError as err:
            raise RuntimeError(
                f"a PostgreSQL catalog needs psycopg and psycopg-pool ({err}): "
                "pip install 'shardserve[postgresql]'"
            ) from err
        return PostgresCatalog(location)
    from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog

    return SQLiteCatalog(sqlite_path(location, state_dir))
