"""A long-running server process's heap as the cyclic garbage collector sees it."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 100_000
"""Allocations between two collections of the youngest generation (CPython's default: 700). A snapshot commit
or a rank's batch of versions makes tens of thousands of objects that live for the request; at 700 they were
collected young many times over, promoted, and pushed the heap towards full collections. A steady commit of
100,000 shards at 1,000 simulated ranks made ~610 young, ~57 middle and 2 full collections in the coordinator
(0.2-1.1 s); at 100,000, 1-3 young ones and rarely a middle one (0.01-0.2 s). Garbage in cycles waits for up to
this many allocations (a few MiB) before it is freed."""


def freeze_heap() -> int:
    """Free what is garbage now, then move every object still alive out of the cyclic collector's reach
    (gc.freeze); returns how many objects are frozen in all."""
    gc.collect()  # what is garbage already is freed, not kept for good
    gc.freeze()
    return gc.get_freeze_count()


def prepare_collector(process: str) -> int:
    """Move every object alive now out of the cyclic collector's reach (gc.freeze) and collect the youngest
    generation every YOUNG_THRESHOLD allocations; returns how many objects were frozen.

    A server process that imported torch holds ~200,000 objects that live as long as it does, and each full
    collection walked them all again: ~100 ms of a rank's CPU, every few thousand versions made and dropped,
    so that one step of a weight-sync loop in twenty took twice as long. Objects made later are collected as
    before. Called once, when the process (`process`, for the log) has started serving."""
    frozen = freeze_heap()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
    log.debug("%s: %d objects of its start-up moved out of the collector's reach", process, frozen)
    return frozen
