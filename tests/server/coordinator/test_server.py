"""CoordinatorServer, the composition root: building the parts starts nothing; start() starts the monitor, the
repair loop and the rendezvous store; close() ends them."""

from __future__ import annotations

import threading

import pytest

from shardserve.server.coordinator.catalog.sqlite import SQLiteCatalog
from shardserve.server.coordinator.options import CoordinatorOptions
from shardserve.server.coordinator.server import CoordinatorServer


def _threads() -> set[threading.Thread]:
    """The live threads of this process (other coordinators' included: a shared cluster's runs here too)."""
    return {thread for thread in threading.enumerate() if thread.is_alive()}


def test_building_starts_no_thread_and_start_does(tmp_path):
    before = _threads()
    coordinator = CoordinatorServer(
        SQLiteCatalog(tmp_path / "catalog.sqlite"),
        options=CoordinatorOptions(heartbeat_interval=0.05),
    )
    try:
        assert _threads() - before == set()  # threads of earlier tests may end meanwhile
        with pytest.raises(RuntimeError, match="not started"):
            _ = coordinator.collectives.store_port  # the rendezvous store is not open yet
        coordinator.start()
        started = _threads() - before
        assert {"coord-monitor", "coord-repair"} <= {thread.name for thread in started}
        assert coordinator.collectives.store_port > 0
    finally:
        coordinator.close()
    monitor = [thread for thread in started if thread.name == "coord-monitor"]
    assert not any(thread.is_alive() for thread in monitor)


def test_a_bad_heartbeat_interval_is_refused_when_building(tmp_path):
    catalog = SQLiteCatalog(tmp_path / "catalog.sqlite")
    with pytest.raises(ValueError, match="heartbeat-interval must be > 0"):
        CoordinatorServer(catalog, options=CoordinatorOptions(heartbeat_interval=0))
    catalog.close()
