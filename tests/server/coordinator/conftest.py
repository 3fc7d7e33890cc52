"""The catalog's stores for its tests: each test of the `store` fixture runs once over an SQLite file and once
over a database of the test PostgreSQL server (tests/postgres.py), with the same assertions."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardserve.server.coordinator.catalog.interface import Catalog
from shardserve.server.coordinator.catalog.locations import open_catalog


@dataclass(frozen=True)
class Store:
    """Where a test's catalog is kept: `open()` opens it (again: a reopen finds what was written before)."""

    kind: str
    location: str

    def open(self) -> Catalog:
        return open_catalog(self.location)

    @property
    def duplicate_error(self) -> type[Exception]:
        """What adding a (name, version) row that exists raises (each database's own integrity error)."""
        if self.kind == "sqlite":
            return sqlite3.IntegrityError
        import psycopg

        return psycopg.IntegrityError


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """An empty catalog store of each kind (the PostgreSQL one skips where PostgreSQL is not installed)."""
    if request.param == "sqlite":
        return Store("sqlite", str(tmp_path / "catalog.sqlite"))
    return Store("postgresql", request.getfixturevalue("postgres_url"))
