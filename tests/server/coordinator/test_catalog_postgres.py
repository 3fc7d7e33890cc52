"""What only the PostgreSQL catalog has to show: the database restarted under an open catalog (calls fail with
CatalogUnavailable, UNAVAILABLE and retryable, and succeed once it is back, nothing lost), a leader frozen inside
a write holding off no takeover, credentials from the environment, passwords never in messages, a database that
cannot be reached refused at open."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from waiting import eventually, wait_until

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.protos.errors import Reason
from shardserve.server.common.errors import CatalogUnavailable
from shardserve.server.coordinator.catalog.locations import open_catalog
from shardserve.server.coordinator.catalog.records import TensorRecord, TensorState
from shardserve.server.coordinator.catalog.urls import is_postgres_url, redacted

pytest.importorskip("psycopg")

import shardserve.server.coordinator.catalog.postgres as postgres_catalog  # noqa: E402
from shardserve.server.coordinator.catalog.postgres import (  # noqa: E402
    PostgresCatalog,
    url_connect_timeout,
)

BACK_WITHIN_S = 60.0


def row(name: str, version: int) -> TensorRecord:
    return TensorRecord(name=name, version=version, metadata=ShardedTensorMetadata(size=(3,)))


def test_a_restarted_database_fails_calls_as_unavailable_then_serves_them_with_nothing_lost(
    postgres_server, postgres_url
):
    catalog = PostgresCatalog(postgres_url, connect_timeout=1.0)
    lease = catalog.leadership(lease_duration=60.0)  # outlasts the restart: no one else takes it
    term = lease.try_acquire("a", "a:1")
    catalog.fence(term)
    catalog.add_all([row("t", 1), row("u", 2)])
    catalog.commit("t", 1)
    before = catalog.contents()
    postgres_server.stop("immediate")  # as if it crashed: it recovers from its WAL when started
    try:
        for call in (
            lambda: catalog.get("t", 1),
            lambda: catalog.add(row("v", 3)),
            lambda: catalog.commit("u", 2),
            lambda: lease.renew(term),
        ):
            with pytest.raises(CatalogUnavailable, match="unavailable") as failed:
                call()
            assert failed.value.code is grpc.StatusCode.UNAVAILABLE
            assert failed.value.reason is Reason.CATALOG_UNAVAILABLE
            assert postgres_server.password not in failed.value.message
    finally:
        postgres_server.start()
    back = eventually(
        catalog.contents, BACK_WITHIN_S, "the catalog back", ignoring=(CatalogUnavailable,)
    )
    assert back == before
    assert lease.renew(term)  # no one took the lease meanwhile
    catalog.commit("u", 2)  # writes go on, fenced as before
    catalog.add(row("v", 3))
    assert [(r.name, r.state) for r in catalog.list(include_pending=True)] == [
        ("t", TensorState.READY),
        ("u", TensorState.READY),
        ("v", TensorState.PENDING),
    ]
    catalog.close()


def test_a_leader_frozen_inside_a_write_past_its_lease_holds_off_no_takeover(
    postgres_url, monkeypatch
):
    """A fenced write holds the lease row FOR SHARE, and a standby's acquisition waits for that lock: a leader
    frozen mid-write (SIGSTOP, a paused VM) held every takeover off for as long as it stayed frozen. The
    database now ends such a session one lease after its last statement: the standby takes over within a few
    leases, and the frozen write, once the leader runs again, fails as CatalogUnavailable and left nothing."""
    lease_s = 1.0
    leader, standby = open_catalog(postgres_url), open_catalog(postgres_url)
    frozen, thawed, took = threading.Event(), threading.Event(), threading.Event()
    check_term = postgres_catalog.check_term

    def check_then_freeze(db, term: int) -> None:
        check_term(db, term)  # the lease row is locked FOR SHARE from here to the transaction's end
        frozen.set()
        thawed.wait(60)

    outcome: dict[str, object] = {}

    def write() -> None:
        try:
            leader.add(row("frozen", 1))
        except CatalogUnavailable as err:
            outcome["error"] = err

    def take_over() -> None:
        lease, terms = standby.leadership(lease_duration=lease_s), []
        wait_until(
            lambda: terms.append(lease.try_acquire("b", "b:1")) or terms[-1] is not None,
            60,
            "the standby to take the lease",
        )
        outcome["term"], outcome["after_s"] = terms[-1], time.monotonic() - started
        took.set()

    writer = threading.Thread(target=write)
    try:
        leader.fence(leader.leadership(lease_duration=lease_s).try_acquire("a", "a:1"))
        monkeypatch.setattr(postgres_catalog, "check_term", check_then_freeze)
        writer.start()
        assert frozen.wait(30)
        monkeypatch.setattr(postgres_catalog, "check_term", check_term)
        started = time.monotonic()
        threading.Thread(target=take_over, daemon=True).start()
        assert took.wait(5 * lease_s), (
            "the standby could not take over from a leader frozen mid-write"
        )
        assert outcome["term"] == 2 and outcome["after_s"] < 5 * lease_s
        thawed.set()
        writer.join(30)
        assert isinstance(outcome.get("error"), CatalogUnavailable)
        assert standby.get("frozen", 1) is None  # the frozen write was rolled back
    finally:
        thawed.set()
        if writer.is_alive():
            writer.join(30)
        leader.close()
        standby.close()


def test_the_password_may_come_from_the_environment(postgres_server, postgres_url, monkeypatch):
    monkeypatch.setenv("PGPASSWORD", postgres_server.password)
    bare = postgres_url.replace(f":{postgres_server.password}@", "@")
    assert postgres_server.password not in bare
    catalog = open_catalog(bare)
    catalog.add(row("t", 1))
    assert catalog.get("t", 1) == row("t", 1)
    catalog.close()


def test_a_database_that_cannot_be_reached_is_refused_at_open_without_its_password(
    postgres_server,
):
    url = postgres_server.url("postgres").replace(f":{postgres_server.port}/", ":1/")
    with pytest.raises(RuntimeError, match="cannot be opened") as refused:
        PostgresCatalog(url, connect_timeout=1.0)
    assert postgres_server.password not in str(refused.value)
    assert "postgresql://shardserve@127.0.0.1:1/postgres" in str(refused.value)


def test_a_wrong_password_is_refused_at_open_without_showing_it(postgres_server):
    url = postgres_server.url("postgres").replace(postgres_server.password, "not-the-password")
    with pytest.raises(RuntimeError, match="cannot be opened") as refused:
        PostgresCatalog(url, connect_timeout=1.0)
    assert "not-the-password" not in str(refused.value)


def test_urls_print_without_their_password():
    assert is_postgres_url("postgresql://u@h/db") and is_postgres_url("POSTGRES://h")
    assert not is_postgres_url("/tmp/catalog.sqlite") and not is_postgres_url("mysql://h/db")
    assert redacted("postgresql://u:s3cret@h:5432/db") == "postgresql://u@h:5432/db"
    assert redacted("postgresql://u:s3cret@h1:5432,h2:5433/db?sslmode=require&password=s3cret") == (
        "postgresql://u@h1:5432,h2:5433/db?sslmode=require"
    )
    assert (
        redacted("postgresql:///db?host=/run/postgresql") == "postgresql:///db?host=/run/postgresql"
    )
    assert redacted("state/catalog.sqlite") == "state/catalog.sqlite"


def test_the_urls_connect_timeout_is_how_long_a_call_waits_for_the_database():
    """libpq's own URL parameter sets the wait (2 s at least, as libpq counts); one that is not a number of
    seconds is refused naming it."""
    base = "postgresql://u@127.0.0.1:5432/db"
    assert url_connect_timeout(base, 5.0) == 5.0
    assert url_connect_timeout(f"{base}?connect_timeout=7", 5.0) == 7.0
    assert url_connect_timeout(f"{base}?application_name=x&connect_timeout=1", 5.0) == 2.0
    with pytest.raises(ValueError, match="connect_timeout='soon' is not a whole number"):
        url_connect_timeout(f"{base}?connect_timeout=soon", 5.0)
    with pytest.raises(RuntimeError, match="cannot be opened: .*connect_timeout"):
        PostgresCatalog(f"{base}?connect_timeout=soon")
