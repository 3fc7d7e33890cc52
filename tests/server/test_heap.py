"""prepare_collector (server/common/heap.py): what lives at start-up leaves the collector's reach, what
comes later is collected as before, its youngest generation every YOUNG_THRESHOLD allocations."""

from __future__ import annotations

import gc
import weakref

import pytest

from shardserve.server.common.heap import YOUNG_THRESHOLD, prepare_collector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_start_up_objects_are_frozen_and_later_cycles_still_collected(unfrozen) -> None:
    kept = Node()
    _, middle, oldest = gc.get_threshold()
    frozen = prepare_collector("test")
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, oldest)
    assert frozen > 0 and gc.get_freeze_count() > 0  # (frozen objects freed later leave the count)
    assert not any(
        obj is kept for obj in gc.get_objects()
    )  # out of every generation the collector walks
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
