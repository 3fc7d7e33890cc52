"""DeferredDrops: a snapshot commit's removed versions are freed after it answers, a prefix's next snapshot
waits for its drops and for no other prefix's, a failing drop is logged and later ones still run, and nothing
is kept of drops that are done."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from shardserve.core.metadata import make_metadata
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.drivers.deferred_drops import DeferredDrops

META = make_metadata((4,), [((0,), (4,), 0)], dtype=torch.float32)


def _records(*names: str) -> list[TensorRecord]:
    return [TensorRecord(name=name, version=1, metadata=META) for name in names]


class HeldRanks:
    """The ranks' side of drops: each drop of a tensor whose name starts with one of `held` waits until
    `release` is set (a rank that holds its calls); what was dropped, in order."""

    def __init__(self, *held: str) -> None:
        self.held, self.release, self.dropped = held, threading.Event(), []

    def drop_rows(self, records: list[TensorRecord]) -> None:
        if records[0].name.startswith(self.held):
            self.release.wait(10)
        self.dropped.extend(r.name for r in records)


def test_wait_returns_once_every_drop_of_the_prefix_is_done() -> None:
    ranks = HeldRanks("m@", "other@")
    drops = DeferredDrops(ranks.drop_rows)
    try:
        drops.submit("m", _records("m@1/a"))
        drops.submit("other", _records("other@1/a"))
        drops.submit("m", _records("m@2/a", "m@2/b"))
        drops.wait("m", timeout=0.2)  # still held: the wait gives up and says so
        assert ranks.dropped == []
        ranks.release.set()
        drops.wait("m")
        assert {"m@1/a", "m@2/a", "m@2/b"} <= set(ranks.dropped)
        drops.wait("never-submitted")  # nothing to wait for
    finally:
        ranks.release.set()
        drops.close()
    assert sorted(ranks.dropped) == ["m@1/a", "m@2/a", "m@2/b", "other@1/a"]


def test_a_drop_held_by_a_stopped_rank_holds_up_no_other_prefix() -> None:
    """A DropMany to a stopped rank waits for its deadline: the next snapshot of another prefix does not wait
    for it."""
    ranks = HeldRanks("stuck@")
    drops = DeferredDrops(ranks.drop_rows)
    try:
        drops.submit("stuck", _records("stuck@1/a"))
        drops.submit("free", _records("free@1/a"))
        drops.wait("free", timeout=5)
        assert ranks.dropped == ["free@1/a"]
    finally:
        ranks.release.set()
        drops.close()


def test_a_failed_drop_is_logged_and_the_next_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    dropped: list[str] = []

    def drop_rows(records: list[TensorRecord]) -> None:
        if records[0].name == "bad@1/a":
            raise RuntimeError("rank gone")
        dropped.extend(r.name for r in records)

    drops = DeferredDrops(drop_rows)
    with caplog.at_level(logging.ERROR):
        drops.submit("bad", _records("bad@1/a"))
        drops.submit("bad", _records("bad@2/a"))
        drops.submit("empty", [])  # nothing removed: nothing to run
        drops.wait("bad")
        drops.close()
    assert dropped == ["bad@2/a"]
    assert "dropping 1 versions a commit of 'bad' removed" in caplog.text
    assert "rank gone" in caplog.text


def test_nothing_is_kept_of_a_prefix_whose_drops_are_done() -> None:
    """Drops are kept by prefix only while they run: a coordinator that committed snapshots of many prefixes
    keeps no entry for any of them once their drops are done."""
    ranks = HeldRanks("held/")
    drops = DeferredDrops(ranks.drop_rows)
    try:
        for i in range(50):
            drops.submit(f"t{i}", _records(f"t{i}"))
        drops.submit("held/x", _records("held/x"))
        for i in range(50):
            drops.wait(f"t{i}")
        assert len(drops) == 1  # only the one still held
        ranks.release.set()
        drops.wait("held/x")
    finally:
        ranks.release.set()
        drops.close()
    assert len(drops) == 0
