"""A long-running server process's heap as the cyclic garbage collector sees it."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 100_000
"""Allocations between two collections of the youngest generation (CPython's default: 700). A snapshot commit
or a rank's batch of versions makes tens of thousands of objects that live for the request; at 700 they were
collected young many times over, promoted, and pushed the heap towards full collections. Measured with
`shardserve up --ranks 2` serving a loop of 512-tensor puts and gets, alternating runs: the process of `up`
48-50 -> 41-44 ms of CPU a round, each rank 39-42 -> 30-37 ms. Garbage in cycles waits for up to this many
allocations (a few MiB) before it is freed."""


def prepare_collector(process: str) -> int:
    """Move every object alive now out of the cyclic collector's reach (gc.freeze) and collect the youngest
    generation every YOUNG_THRESHOLD allocations; returns how many objects were frozen.

    A server process that imported torch holds ~200,000 objects that live as long as it does, and each full
    collection walked them all again: ~100 ms of a rank's CPU, every few thousand versions made and dropped,
    so that one step of a weight-sync loop in twenty took twice as long. Objects made later are collected as
    before. Called once, when the process (`process`, for the log) has started serving."""
    gc.collect()  # what is garbage already is freed, not kept for good
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
    frozen = gc.get_freeze_count()
    log.debug("%s: %d objects of its start-up moved out of the collector's reach", process, frozen)
    return frozen
