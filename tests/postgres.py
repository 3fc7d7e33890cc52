"""A real, throwaway PostgreSQL server for the tests of the PostgreSQL catalog, and its fixtures.

The server is Debian's (scripts/setup-postgres.sh installs it): initdb makes a cluster in a new directory
under the system's temp dir, pg_ctl starts it on a free loopback port (its unix socket in that directory),
with password authentication for TCP. PostgreSQL refuses to run as root: as root it runs as the `postgres`
user (the package's) with the directory given to it. One server per test process (`postgres_server`, session
scoped: start-up is paid once); each test gets a database of its own (`postgres_url`), dropped after it. Tests
that need it skip, saying why, only when the server's programs are not installed.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardserve.server.common.ports import free_port

USER = "shardserve"
"""The superuser the tests connect as (with a password: the URL carries it, as a user's may)."""

START_TIMEOUT_S = 60


def server_programs() -> Path | None:
    """The directory of initdb and pg_ctl (the newest Debian version, else the PATH's), or None."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _unprivileged_user() -> pwd.struct_passwd:
    """The user a root test process runs the server as: `postgres` (Debian's package makes it), else nobody."""
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return pwd.getpwnam("nobody")


class PostgresServer:
    """A PostgreSQL server of its own cluster directory on 127.0.0.1:`port`; `url(db)` names a database."""

    def __init__(self, programs: Path) -> None:
        self.programs = programs
        self.root = Path(tempfile.mkdtemp(prefix="shardserve-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.password = secrets.token_hex(12)
        self._as_user: list[str] = []
        self._names = itertools.count(1)
        if (
            os.geteuid() == 0
        ):  # the server refuses root: the package's own user runs it (else nobody)
            owner = _unprivileged_user()
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as_user = ["runuser", "-u", owner.pw_name, "--"]

    def _run(self, *args: str) -> None:
        subprocess.run(
            [*self._as_user, *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.root,
            timeout=START_TIMEOUT_S,
        )

    def init(self) -> PostgresServer:
        """Make the cluster: superuser USER with `password`, trusted only on its unix socket."""
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.password + "\n")
        if self._as_user:
            shutil.chown(pwfile, self._as_user[2])
        self._run(
            str(self.programs / "initdb"),
            "-D",
            str(self.data),
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--no-sync",
            "-E",
            "UTF8",
        )
        pwfile.unlink()
        return self

    def start(self) -> None:
        """Start the server; return once it accepts connections."""
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self.root} -c fsync=off -c max_connections=200"
        )
        log = str(self.root / "server.log")
        self._run(
            str(self.programs / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            log,
            "-o",
            options,
            "-w",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`mode` immediate: as if it crashed, recovering from its WAL when started)."""
        self._run(str(self.programs / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, database: str = "postgres", *, password: bool = True) -> str:
        """The libpq URL of `database` (with the password unless asked not to)."""
        secret = f":{self.password}" if password else ""
        return f"postgresql://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new, empty database's name."""
        import psycopg

        name = f"test_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return name

    def drop_database(self, name: str) -> None:
        """Drop database `name`, ending its connections."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def remove(self) -> None:
        """Stop the server (if running) and delete its directory."""
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """This test process's PostgreSQL server (skips when PostgreSQL's server programs are not installed)."""
    programs = server_programs()
    if programs is None:
        pytest.skip(
            "PostgreSQL's server (initdb, pg_ctl) is not installed: run scripts/setup-postgres.sh"
        )
    pytest.importorskip("psycopg", reason="psycopg is not installed: run scripts/setup-venv.sh")
    server = PostgresServer(programs)
    try:
        server.init().start()
    except subprocess.CalledProcessError as err:
        server.remove()
        raise RuntimeError(
            f"the test PostgreSQL server did not start: {err.stderr.decode()}"
        ) from err
    yield server
    server.remove()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a new, empty database of the test server, dropped after the test."""
    name = postgres_server.create_database()
    yield postgres_server.url(name)
    postgres_server.drop_database(name)
