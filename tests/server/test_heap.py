"""freeze_startup_heap (server/common/heap.py): what lives at start-up leaves the collector's reach, what
comes later is collected as before."""

from __future__ import annotations

import gc
import weakref

import pytest

from shardserve.server.common.heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_start_up_objects_are_frozen_and_later_cycles_still_collected(unfrozen) -> None:
    kept = Node()
    frozen = freeze_startup_heap("test")
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
