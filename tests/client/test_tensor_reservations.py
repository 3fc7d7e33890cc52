"""TensorReservations: a name put again with the same basis is reserved, a put takes its name's reservation once
(waiting for one being made), a replaced reservation is handed back to abort, and close aborts what is held."""

from __future__ import annotations

import threading

from shardserve.client.tensor_reservations import TensorReservations
from shardserve.protos import shardserve_pb2 as pb


def info(version: int) -> pb.TensorInfo:
    return pb.TensorInfo(name="w", version=version)


def test_a_name_repeats_only_when_its_last_put_had_the_same_basis() -> None:
    reservations = TensorReservations()
    assert not reservations.repeats("w", ("layout", 1))
    assert reservations.repeats("w", ("layout", 1))
    assert not reservations.repeats("w", ("layout", 2))
    assert not reservations.repeats("v", ("layout", 2))  # another name's basis is its own
    assert reservations.repeats("w", ("layout", 2))


def test_only_the_newest_names_are_remembered() -> None:
    reservations = TensorReservations(remembered=2)
    for name in ("a", "b", "c"):
        reservations.repeats(name, 1)
    assert not reservations.repeats("a", 1)  # forgotten: the oldest of three
    assert reservations.repeats("c", 1)


def test_a_put_takes_its_names_reservation_once_waiting_for_it_to_be_made() -> None:
    reservations = TensorReservations()
    made = threading.Event()

    def make() -> pb.TensorInfo:
        made.wait(10)
        return info(7)

    assert reservations.keep_later("w", "basis", make) is None
    assert reservations.take("v") is None
    threading.Timer(0.05, made.set).start()
    taken = reservations.take("w")
    assert taken is not None and taken.basis == "basis" and taken.info.version == 7
    assert reservations.take("w") is None
    reservations.release_all(lambda name, version: None)


def test_a_reservation_not_made_is_none_and_a_replaced_one_is_handed_back() -> None:
    reservations = TensorReservations()
    reservations.keep_later("w", "basis", lambda: None)
    assert reservations.take("w") is None
    reservations.keep_later("w", "old", lambda: info(3))
    replaced = reservations.keep_later("w", "new", lambda: info(4))
    assert replaced is not None and replaced.info.version == 3
    taken = reservations.take("w")
    assert taken is not None and taken.info.version == 4
    reservations.release_all(lambda name, version: None)


def test_release_all_aborts_every_reservation_made_and_forgets_them() -> None:
    reservations = TensorReservations()
    reservations.keep_later("w", "b", lambda: info(5))
    reservations.keep_later("v", "b", lambda: None)
    aborted: list[tuple[str, int]] = []
    reservations.release_all(lambda name, version: aborted.append((name, version)))
    assert aborted == [("w", 5)]
    assert reservations.take("w") is None
