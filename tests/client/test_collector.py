"""The cyclic collector's pause (client/collector.py): off inside, back as it was after the last holder on any
thread, also when the block raises; a collector the caller had switched off stays off."""

from __future__ import annotations

import gc
import threading

import pytest

from shardserve.client.collector import CollectorPause, collector_paused


@pytest.fixture(autouse=True)
def collector_on():
    gc.enable()
    yield
    gc.enable()


def test_the_collector_is_off_inside_and_on_again_after():
    pause = CollectorPause()
    with pause.held():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), pause.held():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_switched_off_by_the_caller_stays_off():
    gc.disable()
    with CollectorPause().held():
        pass
    assert not gc.isenabled()


def test_holders_on_two_threads_pause_it_together_until_the_last_ends():
    pause = CollectorPause()
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with pause.held():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with pause.held():
        thread.start()
        assert entered.wait(10)
    assert not gc.isenabled()  # the other thread still holds it
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_paused_function_gets_its_arguments_and_returns_its_value():
    @collector_paused
    def add(a: int, *, b: int) -> tuple[int, bool]:
        return a + b, gc.isenabled()

    assert add(1, b=2) == (3, False) and gc.isenabled()
    assert add.__name__ == "add"
