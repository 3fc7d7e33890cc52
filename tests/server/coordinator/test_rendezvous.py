"""server.coordinator.rendezvous: the store the coordinator hosts and its epoch counter."""

from __future__ import annotations

import itertools
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from shardserve.server.coordinator.drivers.rendezvous import Epochs, RendezvousStore


def test_an_epoch_ends_once_however_many_jobs_of_it_fail():
    counter = itertools.count(1)
    epochs = Epochs(lambda: next(counter))
    first = epochs.current
    assert epochs.end(first, "a job failed") == first + 1
    assert epochs.end(first, "another job of it failed") == first + 1  # already over: no new epoch
    assert epochs.current == first + 1


def test_epochs_come_from_the_growing_counter():
    numbers = iter([40, 57, 90])
    epochs = Epochs(lambda: next(numbers))
    assert epochs.current == 40 and epochs.end(40, "x") == 57 and epochs.end(57, "y") == 90


def test_the_store_listens_and_clients_share_its_keys():
    rendezvous = RendezvousStore(0)
    assert rendezvous.port > 0
    client = dist.TCPStore(
        "127.0.0.1",
        rendezvous.port,
        is_master=False,
        timeout=timedelta(seconds=10),
        wait_for_workers=False,
    )
    client.set("k", "v")
    assert rendezvous.store.get("k") == b"v"


def test_a_bad_store_port_is_refused():
    with pytest.raises(ValueError, match="store port must be 0..65535"):
        RendezvousStore(70000)


def non_loopback_ipv4() -> str | None:
    """An address of this host other than loopback (the one its route out uses), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_store_listens_on_its_host_only():
    """TCPStore alone listens on every interface whatever host it is given; ours only on the coordinator's."""
    rendezvous = RendezvousStore(0, "127.0.0.1")
    client = dist.TCPStore(
        "127.0.0.1",
        rendezvous.port,
        is_master=False,
        timeout=timedelta(seconds=10),
        wait_for_workers=False,
    )
    client.set("k", "v")
    assert rendezvous.store.get("k") == b"v"
    outside = non_loopback_ipv4()
    if outside is None:
        pytest.skip("this host has no address but loopback")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((outside, rendezvous.port), timeout=10).close()
    everywhere = RendezvousStore(0, "0.0.0.0")
    socket.create_connection((outside, everywhere.port), timeout=10).close()
