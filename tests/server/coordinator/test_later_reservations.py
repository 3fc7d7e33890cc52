"""LaterReservations: a reservation made on a thread of its own after the commit answered, taken once.

take() waits for one still being made, answers None for one never asked for, taken already, failed, or past
its wait, and forget_older() lets go of those never taken; a clock is injected where time must pass.
"""

from __future__ import annotations

import threading

import pytest

from shardserve.server.coordinator.drivers.later_reservations import LaterReservations


@pytest.fixture
def later():
    reservations: LaterReservations[str] = LaterReservations(threads=2)
    yield reservations
    reservations.close()


def test_take_waits_for_a_reservation_still_being_made_and_answers_it_once(later):
    release, started = threading.Event(), threading.Event()

    def reserve() -> str:
        started.set()
        assert release.wait(30)
        return "snapshot 8"

    later.start("p", 7, reserve)
    assert started.wait(30)
    taken: list[str | None] = []
    taker = threading.Thread(target=lambda: taken.append(later.take("p", 7)))
    taker.start()
    taker.join(0.05)
    assert taker.is_alive() and not taken  # still being made: the taker waits
    release.set()
    taker.join(30)
    assert taken == ["snapshot 8"]
    assert later.take("p", 7) is None  # taken already
    assert len(later) == 0


def test_none_for_one_never_asked_for_one_not_made_and_one_that_failed(later):
    later.start("p", 1, lambda: None)  # the ranks could not allocate it: the driver answers None

    def broken() -> str:
        raise RuntimeError("a bug in the reservation")

    later.start("p", 2, broken)
    assert later.take("p", 1) is None
    assert later.take("p", 2) is None  # logged, and the writer creates its next snapshot instead
    assert later.take("other", 1) is None
    assert later.take("p", 3) is None


def test_take_gives_up_after_its_wait(later):
    release = threading.Event()
    later.start("p", 1, lambda: "made" if release.wait(30) else None)
    assert later.take("p", 1, timeout=0.01) is None
    release.set()


def test_reservations_never_taken_are_forgotten_after_their_age():
    now = [100.0]
    later: LaterReservations[str] = LaterReservations(threads=1, clock=lambda: now[0])
    try:
        later.start("p", 1, lambda: "one")
        now[0] = 150.0
        later.start("p", 2, lambda: "two")
        now[0] = 200.0
        assert later.forget_older(60.0) == 1  # the first, started 100 s ago
        assert later.take("p", 1) is None
        assert later.take("p", 2) == "two"
    finally:
        later.close()
