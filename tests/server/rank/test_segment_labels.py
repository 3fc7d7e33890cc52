"""Segment labels: when a rank promotes a version it labels the header of each shard's segment with the shard it
now serves, so a same-host reader that maps the segment already (recycled from an earlier version) finds the new
version's shard there without OpenShard. The contract's two halves (protos/same_host.py) are checked on plain
header words, a recycle racing a reader included; the rank's half on a real store's memfd segments."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from shardserve.core.metadata import make_metadata
from shardserve.core.wire import tensor_bytes
from shardserve.protos.same_host import (
    HEADER_WORDS,
    STATE_DROPPED,
    STATE_PENDING,
    STATE_REPLACED,
    STATE_SERVED,
    WORD_GENERATION,
    WORD_STATE,
    labelled_generation,
    read_label,
    write_label,
)
from shardserve.server.rank.store import ShardStore


def _words(state: int = STATE_SERVED, generation: int = 0) -> np.ndarray:
    words = np.zeros(HEADER_WORDS, dtype=np.int64)
    words[WORD_STATE], words[WORD_GENERATION] = state, generation
    return words


def test_a_fresh_header_names_no_shard() -> None:
    words = _words()
    assert read_label(words) is None
    assert labelled_generation(words, "t", 0, 0) is None


def test_a_label_names_its_shard_and_the_current_generation() -> None:
    words = _words(generation=7)
    write_label(words, "layer0.w", 42, 3)
    assert labelled_generation(words, "layer0.w", 42, 3) == 7
    assert read_label(words) is not None and read_label(words)[1:] == (42, 3, 7)
    assert labelled_generation(words, "layer1.w", 42, 3) is None
    assert labelled_generation(words, "layer0.w", 41, 3) is None
    assert labelled_generation(words, "layer0.w", 42, 2) is None


@pytest.mark.parametrize("state", [STATE_PENDING, STATE_REPLACED, STATE_DROPPED])
def test_a_segment_not_served_is_not_taken_by_its_label(state: int) -> None:
    words = _words(generation=2)
    write_label(words, "t", 5, 0)
    words[WORD_STATE] = (
        state  # replaced: new reads start at the newer version; dropped or pending: gone
    )
    assert read_label(words) is None
    assert labelled_generation(words, "t", 5, 0) is None


def test_a_recycled_segment_makes_its_old_label_stale() -> None:
    words = _words(generation=2)
    write_label(words, "t", 5, 0)
    words[WORD_STATE], words[WORD_GENERATION] = (
        STATE_PENDING,
        3,
    )  # the rank takes it for another version
    words[WORD_STATE] = STATE_SERVED  # even were it served again before its new label is written
    assert read_label(words) is None
    assert labelled_generation(words, "t", 5, 0) is None
    write_label(words, "t", 9, 0)
    assert labelled_generation(words, "t", 9, 0) == 3


class _RecycledWhileRead:
    """Header words that the rank recycles and labels anew (for version 9) right after a reader read the label's
    version word, as a rank on another core may: the reader must not take the segment for either version."""

    def __init__(self, words: np.ndarray) -> None:
        self.words = words

    def __getitem__(self, index: int) -> np.int64:
        value = self.words[index]
        if index == 6:  # WORD_LABEL_VERSION
            self.words[WORD_STATE], self.words[WORD_GENERATION] = STATE_PENDING, 3
            write_label(self.words, "t", 9, 0)
            self.words[WORD_STATE] = STATE_SERVED
        return value


def test_a_recycle_racing_the_reader_is_seen_by_its_second_look() -> None:
    words = _words(generation=2)
    write_label(words, "t", 5, 0)
    assert labelled_generation(_RecycledWhileRead(words), "t", 5, 0) is None  # type: ignore[arg-type]
    assert labelled_generation(words, "t", 9, 0) == 3


META = make_metadata((8, 4), [((0, 0), (4, 4), 0), ((4, 0), (4, 4), 0)])


@pytest.fixture
def store() -> ShardStore:
    store = ShardStore(rank=0, version_grace=0.0)
    if not store.memory.shared.enabled:
        pytest.skip("this host has no memfd shared memory")
    return store


def _header(store: ShardStore, name: str, version: int, index: int) -> np.ndarray:
    """The header words of a shard's segment, mapped read-only as a same-host reader maps them."""
    segment = store.memory.shared.segment_of(store.local_tensor(name, version, index))
    assert segment is not None
    fd = os.open(f"/proc/{segment.pid}/fd/{segment.fd}", os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, segment.data_offset, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.int64, count=HEADER_WORDS)


def _write(store: ShardStore, name: str, version: int) -> None:
    for index in (0, 1):
        data = tensor_bytes(torch.full((4, 4), float(version + index)))
        with store.leases.write(name, version, index, torch.float32, len(data)) as writer:
            writer.write(0, data)


def test_the_rank_labels_each_promoted_shard_and_a_recycled_segment_anew(store: ShardStore) -> None:
    store.allocate("w", 1, META)
    pending = _header(store, "w", 1, 1)
    assert labelled_generation(pending, "w", 1, 1) is None  # not served yet: no label
    _write(store, "w", 1)
    store.promote("w", 1)
    first = [_header(store, "w", 1, index) for index in (0, 1)]
    assert [labelled_generation(first[i], "w", 1, i) for i in (0, 1)] == [0, 0]
    store.drop("w", 1)  # its segments are kept for reuse
    store.allocate("w", 2, META)
    assert all(labelled_generation(words, "w", 1, i) is None for i, words in enumerate(first))
    _write(store, "w", 2)
    store.promote("w", 2)
    # the two segments now hold the shards of version 2, one each, labelled at the next generation
    taken = sorted(
        (index, labelled_generation(words, "w", 2, index))
        for words in first
        for index in (0, 1)
        if labelled_generation(words, "w", 2, index) is not None
    )
    assert taken == [(0, 1), (1, 1)]
    assert all(labelled_generation(first[i], "w", 1, i) is None for i in (0, 1))
