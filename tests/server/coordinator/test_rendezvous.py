"""server.coordinator.rendezvous: the store the coordinator hosts and its epoch counter."""
from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch.distributed as dist

from server.coordinator.rendezvous import Epochs, RendezvousStore


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
    client = dist.TCPStore("127.0.0.1", rendezvous.port, is_master=False, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    client.set("k", "v")
    assert rendezvous.store.get("k") == b"v"


def test_a_bad_store_port_is_refused():
    with pytest.raises(ValueError, match="store port must be 0..65535"):
        RendezvousStore(70000)
