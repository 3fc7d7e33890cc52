"""The cyclic garbage collector paused while a state dict moves through this process.

A put or get of a state dict makes and drops tens of thousands of short-lived objects (its plans, requests and
answers, per tensor). With the collector on, those alive at a young collection are promoted, and enough of
them trigger a full collection, which walks the whole heap of the caller's process: ~180,000 objects once
torch is imported, many more in a trainer. In a loop of 512-tensor puts and gets against `shardserve up`, full
collections cost the client 12-14 ms of CPU per put and get (one every ten puts, 0.14-0.17 s each); with the
collector paused for the call, about 1 ms. Nothing the call makes outlives it except what it returns, so
pausing it frees the same objects by reference counting and leaves no garbage behind that a collection would
have found.

The pause is process-wide (the collector has one switch): calls on several threads pause it together, and it
is switched back on when the last of them ends, if it was on when the first began.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class CollectorPause:
    """Holds of the cyclic collector's pause, counted across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._resume = False  # whether the collector was on when the first holder paused it

    @contextmanager
    def held(self) -> Iterator[None]:
        """The collector paused for the block (and for any other holder's), as it was after the last one."""
        with self._lock:
            if self._holders == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._resume:
                    gc.enable()


PAUSE = CollectorPause()


def collector_paused(function: Callable[P, R]) -> Callable[P, R]:
    """`function` run with the cyclic collector paused (PAUSE held)."""

    @functools.wraps(function)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        with PAUSE.held():
            return function(*args, **kwargs)

    return paused
