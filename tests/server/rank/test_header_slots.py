"""Header slots: the state words of versions made of shared blocks, many to a header file (server/rank/
header_slots.py), as the rank hands them out (OpenShard with header_slots) and as a same-host reader maps them
(client/paths/segments.py HeaderFiles): one mapping per file, a slot taken again seen as another generation."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from server_helpers import Aborted, ServicerContext

from shardserve.client.paths import segments
from shardserve.client.paths.mapping_cache import MappingCache
from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.errors import Reason
from shardserve.protos.same_host import HEADER_MAGIC, STATE_DROPPED, STATE_SERVED, name_hash
from shardserve.server.rank.header_slots import SLOT_BYTES, HeaderSlots
from shardserve.server.rank.reads.shm import SharedMemoryService
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore


def _files() -> tuple[HeaderSlots, list[torch.Tensor]]:
    """HeaderSlots over plain tensors standing for files (their Segment: the file's index)."""
    made: list[torch.Tensor] = []

    def new_file(nbytes: int) -> tuple[torch.Tensor, int]:
        made.append(torch.full((nbytes,), 0xFF, dtype=torch.uint8))  # garbage until written
        return made[-1], len(made) - 1

    return HeaderSlots(new_file, slots_per_file=4), made


def test_slots_are_headers_at_their_offsets_and_slot_zero_is_never_handed_out() -> None:
    slots, files = _files()
    taken = [slots.take(STATE_SERVED) for _ in range(3)]
    assert [(s.file, s.offset) for s in taken] == [
        (0, SLOT_BYTES),
        (0, 2 * SLOT_BYTES),
        (0, 3 * SLOT_BYTES),
    ]
    words = files[0].view(torch.int64).numpy()
    for slot in taken:
        assert np.shares_memory(slot.words, words)
        assert list(slot.words[:4]) == [HEADER_MAGIC, STATE_SERVED, 1, 0]
    first = words[: SLOT_BYTES // 8]
    assert (first[0], first[1]) == (HEADER_MAGIC, STATE_DROPPED)  # where a slot-blind reader looks
    fourth = slots.take(STATE_SERVED)  # the first file is full: another one
    assert (fourth.file, fourth.offset, slots.files) == (1, SLOT_BYTES, 2)


def test_a_slot_given_back_says_dropped_and_is_taken_again_at_a_new_generation() -> None:
    slots, _ = _files()
    slot = slots.take(STATE_SERVED)
    slot.words[5] = 1234  # a word of the old version
    slots.give_back(slot)
    assert slot.words[1] == STATE_DROPPED
    again = slots.take(STATE_SERVED)
    assert again is slot and list(again.words[1:6]) == [STATE_SERVED, 2, 0, 0, 0]


def _composed_store(*, changed: bool = False) -> ShardStore:
    """A rank serving version 1 of "t" and version 2 made as its copy (shared blocks), of 4 MiB; with
    `changed`, its first bytes written (a block of its own) before it is served."""
    store = ShardStore(0, shared_memory=True, version_grace=0)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (1 << 20,), TensorProperties(dtype=torch.float32)
    )
    store.allocate("t", 1, meta, fill=InitFill.ARANGE)
    store.promote("t", 1)
    store.allocate_copy("t", 2, meta, 1)
    if changed:
        with store.leases.rewrite("t", 2, 0, byte_ranges=[(0, 8)]) as shard:
            shard[:2] = -1.0
    store.promote("t", 2)
    return store


def _open(service: SharedMemoryService, version: int, *, slots: bool) -> pb.OpenShardResponse:
    request = pb.OpenShardRequest(name="t", version=version, shard_index=0, header_slots=slots)
    return service.OpenShard(request, ServicerContext())


def test_a_composed_shard_is_answered_with_a_slot_and_a_slot_blind_reader_is_sent_elsewhere() -> (
    None
):
    store = _composed_store()
    service = SharedMemoryService(store)
    reply = _open(service, 2, slots=True)
    assert reply.extents and reply.header_offset >= SLOT_BYTES and reply.data_offset == 0
    again = _open(service, 2, slots=True)
    assert (again.inode, again.header_offset) == (reply.inode, reply.header_offset)
    with pytest.raises(Aborted) as refused:
        _open(service, 2, slots=False)
    assert (refused.value.code.name, refused.value.reason) == (
        "UNIMPLEMENTED",
        Reason.PATH_UNAVAILABLE,
    )
    assert "header_slots" in refused.value.details


def test_a_composed_shard_first_opened_without_slots_keeps_its_own_header_segment() -> None:
    store = _composed_store(changed=True)  # not a whole copy: no header until it is opened
    service = SharedMemoryService(store)
    plain = _open(service, 2, slots=False)
    assert plain.extents and plain.header_offset == 0
    assert _open(service, 2, slots=True).inode == plain.inode  # one header per version


def test_a_reader_maps_a_header_file_once_and_sees_a_slot_taken_again(monkeypatch) -> None:
    """Two versions' headers in one file: mapped once; the first version dropped and its tensor gone, its slot
    taken by a new version: the reader's header of the first no longer serves (another generation)."""
    store = _composed_store()
    meta = store.local_shards("t", 1)[0]
    service = SharedMemoryService(store)
    maps = []
    real = segments._map_file
    monkeypatch.setattr(segments, "_map_file", lambda *a, **k: maps.append(a) or real(*a, **k))
    store.allocate_copy("t", 3, store.versions.get("t", 1).metadata, 2)
    store.promote("t", 3)
    two, three = _open(service, 2, slots=True), _open(service, 3, slots=True)
    words_two = segments.map_state_header(two)
    words_three = segments.map_state_header(three)
    assert len(maps) == 1 and two.inode == three.inode and two.header_offset != three.header_offset
    mapping = segments.SegmentMapping(
        segments.RankProcess(os.getpid()),
        two.inode,
        two.device_id,
        meta,
        words_two,
        generation=int(words_two[2]),
    )
    assert mapping.serves() and int(words_three[1]) == STATE_SERVED
    service.ReleaseShard(
        pb.ReleaseShardRequest(lease_ids=[two.lease_id, three.lease_id]), ServicerContext()
    )
    store.drop("t", 2)
    gc.collect()  # version 2's tensor gone: its slot free
    store.allocate_copy("t", 4, store.versions.get("t", 1).metadata, 3)
    store.promote("t", 4)
    four = _open(service, 4, slots=True)
    assert four.header_offset == two.header_offset  # the freed slot, taken again
    assert (
        not mapping.serves() and int(words_two[1]) == STATE_SERVED
    )  # served, at a newer generation
    assert len(maps) == 1


def _served_mapping(service: SharedMemoryService, version: int) -> segments.SegmentMapping:
    """What a same-host reader keeps for shard 0 of version `version` of "t": its bytes mapped and its header."""
    reply = _open(service, version, slots=True)
    flat, words = segments.map_segment(reply)
    assert words is not None
    return segments.SegmentMapping(
        segments.RankProcess(reply.pid),
        reply.inode,
        reply.device_id,
        flat,
        words,
        reply.fd,
        generation=int(words[2]),
        data_offset=-1 if reply.extents else reply.data_offset,
    )


def test_a_whole_copy_is_announced_in_the_header_of_the_version_it_copies() -> None:
    """A version whose every block is its source's is announced, when served, in the source's header (a reader
    maps it): the copy's label and the place of its own header words; one with a block of its own is not."""
    store = _composed_store()
    service = SharedMemoryService(store)
    two = _served_mapping(service, 2)  # a reader maps version 2: it has header words now
    meta = store.versions.get("t", 1).metadata
    store.allocate_copy("t", 3, meta, 2)
    store.promote("t", 3)
    announced = two.copy()
    assert announced is not None and announced[0] == (name_hash("t"), 3, 0)
    offset, inode, generation = announced[1]
    three = _open(service, 3, slots=True)  # what OpenShard would answer: the same words
    assert (three.header_offset, three.inode) == (offset, inode)
    assert int(segments.map_state_header(three)[2]) == generation
    store.allocate_copy("t", 4, meta, 3)
    with store.leases.rewrite("t", 4, 0, byte_ranges=[(0, 8)]) as shard:
        shard[:2] = -1.0
    store.promote("t", 4)
    three_mapping = _served_mapping(service, 3)
    assert three_mapping.copy() is None  # version 4 has a block of its own


def test_a_reader_takes_a_whole_copy_through_the_mapping_it_holds() -> None:
    """The reader's half: the announced copy is kept under its key over the same pages with its own header
    words (no OpenShard), reads the copy's bytes, and stops serving once the copy is dropped."""
    store = _composed_store()
    service = SharedMemoryService(store)
    cache = MappingCache()
    address = "127.0.0.1:1"
    two = _served_mapping(service, 2)
    cache.remember((address, "t", 2, 0), two)
    meta = store.versions.get("t", 1).metadata
    store.allocate_copy("t", 3, meta, 2)
    store.promote("t", 3)
    _open(
        service, 3, slots=True
    )  # the header file mapped here (a reader read another version of it)

    def words(earlier: segments.SegmentMapping, slot: tuple[int, int, int]):
        return segments.HEADER_FILES.kept_words(
            earlier.process.pid, slot[1], earlier.device_id, slot[0]
        )

    key = (address, "t", 3, 0)
    found = cache.take_copies(address, [(key, two.flat.numel())], words)
    assert list(found) == [key] and cache.get(key) is found[key]
    assert torch.equal(found[key].flat, store.local_tensor("t", 3, 0).view(-1).view(torch.uint8))
    assert found[key].serves() and two.serves()
    store.drop("t", 3)
    assert not found[key].serves()  # its own words say dropped
    other = (address, "t", 9, 0)
    assert cache.take_copies(address, [(other, two.flat.numel())], words) == {}


def test_a_mapping_whose_slot_another_version_took_announces_nothing() -> None:
    """A reader's mapping of a dropped version whose header slot a newer version took: the words now announce
    the newer version's copy, whose bytes the old pages need not hold; the mapping reads no announcement."""
    store = _composed_store()
    service = SharedMemoryService(store)
    meta = store.versions.get("t", 1).metadata
    two = _served_mapping(service, 2)
    service.leases.release(service.leases.held_ids())
    store.drop("t", 2)
    gc.collect()  # version 2's tensor gone: its slot free
    store.allocate_copy("t", 3, meta, 1)
    store.promote("t", 3)  # announced in version 1's header: takes the freed slot
    store.allocate_copy("t", 4, meta, 3)
    store.promote("t", 4)  # announced in version 3's words, the slot the reader maps as version 2's
    reopened = _served_mapping(service, 3)
    assert two.state is not None and reopened.state is not None
    assert two.state.data_ptr() == reopened.state.data_ptr()  # the same slot's words
    assert reopened.copy() is not None and reopened.copy()[0] == (name_hash("t"), 4, 0)
    assert two.copy() is None
