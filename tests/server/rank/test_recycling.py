"""Recycling of freed versions' memory (server/rank/recycling.py): the pool's bounds, shared-memory segments handed
over with a new generation, and the store keeping only what no lease holds. In-process, no cluster."""

from __future__ import annotations

import os

import pytest
import torch
from fake_clock import FakeClock

from shardserve.core.metadata import TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import HEADER_MAGIC, STATE_DROPPED, STATE_PENDING, STATE_SERVED
from shardserve.server.rank.errors import TensorBusy
from shardserve.server.rank.recycling import Buffer, RecycledBuffers
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.shared_memory import Segment, SharedMemory
from shardserve.server.rank.store import ShardStore


def _bytes(n: int) -> Buffer:
    return Buffer(torch.zeros(n, dtype=torch.uint8))


def test_take_gives_a_kept_buffer_of_exactly_the_size_once():
    pool = RecycledBuffers(max_bytes=1000)
    kept = _bytes(100)
    pool.keep(kept)
    assert pool.take(99) is None and pool.take(101) is None
    assert pool.take(100) is kept and pool.take(100) is None
    assert pool.nbytes == 0 and pool.reused == 1


def test_bounds_drop_the_oldest_and_the_too_old():
    clock = FakeClock()
    pool = RecycledBuffers(max_bytes=250, max_age_s=10, clock=clock)
    first, second, third = _bytes(100), _bytes(100), _bytes(100)
    for buffer in (first, second, third):
        pool.keep(buffer)
        clock.now += 1
    assert pool.nbytes == 200  # the oldest went
    pool.keep(_bytes(300))  # bigger than the whole pool: not kept
    assert pool.nbytes == 200
    assert pool.trim(100) == 100 and pool.take(100) is third
    pool.keep(first)
    clock.now += 11
    assert pool.take(100) is None and pool.nbytes == 0
    pool.keep(second)
    clock.now += 5
    assert pool.expire() == 0 and pool.nbytes == 100  # young enough
    clock.now += 6
    assert pool.expire() == 100 and pool.nbytes == 0  # past max_age_s with nothing else happening


def test_shared_buffers_are_preferred_and_can_be_asked_for():
    pool = RecycledBuffers()
    private, shared = _bytes(64), Buffer(torch.zeros(64, dtype=torch.uint8), segment=object())
    pool.keep(private)
    pool.keep(shared)
    assert pool.take(64, shared=False) is private
    pool.keep(private)
    assert pool.take(64) is shared and pool.take(64, shared=True) is None


def test_a_buffer_is_taken_only_for_its_own_device():
    pool = RecycledBuffers()
    kept = _bytes(64)
    pool.keep(kept)
    assert pool.take(64, device=torch.device("cuda", 0)) is None
    assert pool.take(64, device=torch.device("cpu")) is kept


@pytest.mark.parametrize("bad", [{"max_bytes": -1}, {"max_age_s": 0}])
def test_bad_bounds_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RecycledBuffers(**bad)


def _header(segment) -> list[int]:
    with open(f"/proc/{segment.pid}/fd/{segment.fd}", "rb") as f:
        return torch.frombuffer(bytearray(f.read(24)), dtype=torch.int64).tolist()


def test_a_recycled_segment_gets_a_new_generation_and_keeps_its_fd():
    shared = SharedMemory()
    old = shared.empty((32, 8), torch.float32)
    old.fill_(7)
    segment = shared.segment_of(old)
    shared.mark([old], served=True)
    assert _header(segment) == [HEADER_MAGIC, STATE_SERVED, 0]
    shared.recycle([old])
    del old
    assert _header(segment) == [
        HEADER_MAGIC,
        STATE_DROPPED,
        0,
    ]  # the fd outlives the first tensor over it
    kept = shared.empty((16, 16), torch.float32, overwrite=True)
    assert shared.segment_of(kept) == segment and bool(
        (kept == 7).all()
    )  # not zeroed: the caller overwrites
    assert _header(segment) == [HEADER_MAGIC, STATE_PENDING, 1]
    shared.recycle([kept])
    zeroed = shared.empty((256,), torch.int32)
    assert shared.segment_of(zeroed) == segment and not zeroed.any()
    assert _header(segment)[2] == 2


def test_a_segment_taken_back_in_its_own_shape_is_the_tensor_kept_and_stays_tracked():
    """The next version of a tensor put every step takes back its shape: the kept tensor itself (no new views),
    its segment still found and its generation moved; another shape of the same bytes gets a view of them."""
    shared = SharedMemory()
    first = shared.empty((32, 8), torch.float32)
    segment = shared.segment_of(first)
    shared.recycle([first])
    again = shared.empty((32, 8), torch.float32, overwrite=True)
    assert again is first and shared.segment_of(again) == segment
    assert _header(segment) == [HEADER_MAGIC, STATE_PENDING, 1]
    shared.recycle([again])
    del first, again
    other = shared.empty((8, 32), torch.float32, overwrite=True)
    assert tuple(other.shape) == (8, 32) and shared.segment_of(other) == segment
    assert _header(segment) == [HEADER_MAGIC, STATE_PENDING, 2]


def test_views_and_plain_tensors():
    shared = SharedMemory(enabled=False)
    whole = torch.ones(100)
    shared.recycle(
        [whole[:50], whole.view(10, 10).t()]
    )  # a part of a bigger buffer, a non-contiguous one
    assert shared.recycled.nbytes == 0
    shared.recycle([whole])
    reused = shared.recycled_empty((50,), torch.float64)
    assert reused is not None and reused.data_ptr() == whole.data_ptr()


def _meta(rows: int, cols: int = 8):
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((rows, cols), TensorProperties())


def test_store_recycles_a_dropped_version_once_no_lease_holds_it():
    store = ShardStore(0, shared_memory=True)
    store.allocate("t", 1, _meta(64), fill=InitFill.ARANGE)
    store.promote("t", 1)
    with store.leases.lease("t", 1) as entry:
        shard = store.leases.shard_of(entry, 0)
        store.drop("t", 1)
        assert store.shared.recycled.nbytes == 0  # a reader still holds it
        assert torch.equal(shard[3], torch.arange(24.0, 32.0))
    assert store.shared.recycled.nbytes == 64 * 8 * 4
    assert set(store.memory.recycled(_meta(32, 16), 0)) == {0}  # same bytes, other shape
    assert store.memory.recycled(_meta(64), 0) == {} and store.shared.recycled.reused == 1


def test_a_store_without_shared_memory_reuses_a_dropped_versions_private_buffer():
    store = ShardStore(0, shared_memory=False)
    store.allocate("t", 1, _meta(64), fill=InitFill.ONES)
    first = store.local_tensor("t", 1, 0).data_ptr()
    store.promote("t", 1)
    store.drop("t", 1)
    store.allocate("t", 2, _meta(64))  # written whole before it counts: handed over as it is
    assert store.local_tensor("t", 2, 0).data_ptr() == first
    store.drop("t", 2)
    store.allocate("z", 1, _meta(64), fill=InitFill.ZEROS)
    zeros = store.local_tensor("z", 1, 0)
    assert zeros.data_ptr() == first and not zeros.any()
    assert store.shared.recycled.reused == 2


def test_store_lets_recycled_memory_go_when_a_reservation_needs_it():
    store = ShardStore(0, shared_memory=True, memory_limit=64 * 8 * 4 + 100)
    store.allocate("t", 1, _meta(64), fill=InitFill.ONES)
    store.promote("t", 1)
    store.drop("t", 1)
    assert store.shared.recycled.nbytes == 64 * 8 * 4
    store.allocate("u", 1, _meta(60))  # fits the limit only without the kept buffer
    assert store.shared.recycled.nbytes == 0 and store.memory_used == 60 * 8 * 4
    assert not store.local_tensor("u", 1, 0).any()


def test_memory_handed_to_a_writer_that_never_finished_is_not_given_to_another_version():
    """A reservation handed to a same-host writer and aborted (or reaped) before that writer said it filled it:
    the writer may still copy into its mapping, so the memory goes back to the system, never to the next
    allocation; memory of a version its writer finished is reused as before."""
    store = ShardStore(0, shared_memory=True)
    store.allocate("t", 1, _meta(64))
    [(_, handed, _)] = store.leases.open_allocated_in_place("t", 1)
    store.drop("t", 1)  # the reservation aborted while its writer holds the segment
    assert store.shared.recycled.nbytes == 0
    store.allocate("u", 1, _meta(64))
    assert store.shared.segment_of(store.local_tensor("u", 1, 0)).inode != handed.inode

    store.leases.open_allocated_in_place("u", 1)
    store.local_tensor("u", 1, 0).fill_(3.0)  # what the writer copies in
    assert store.leases.finish_all_in_place("u", 1) == 1
    store.promote("u", 1)
    store.drop("u", 1)
    assert store.shared.recycled.nbytes == 64 * 8 * 4  # finished and served: kept for reuse


def _served_then_reused(store: ShardStore) -> Segment:
    """Version 1 of "t" served (its segment sealed) and dropped, version 2 allocated in its memory: that
    segment."""
    store.allocate("t", 1, _meta(64), fill=InitFill.ONES)
    store.promote("t", 1)
    store.drop("t", 1)
    store.allocate("t", 2, _meta(64))
    segment = store.shared.segment_of(store.local_tensor("t", 2, 0))
    assert segment is not None and store.shared.recycled.reused == 1
    return segment


def _open(store: ShardStore, *, fresh: bool) -> tuple[Segment, bool]:
    found = store.leases.open_in_place("t", 2, 0, torch.float32, 64 * 8 * 4, fresh=fresh)
    assert found is not None
    return found.segment, found.sealed


def test_a_writer_that_cannot_map_reused_memory_gets_the_shard_in_fresh_memory():
    """Sealed memory of a served version, reused: opened `fresh`, the shard moves into a new segment a writer can
    map, that is the version's shard from then on, and the sealed memory is let go, not kept for reuse."""
    store = ShardStore(0, shared_memory=True)
    reused = _served_then_reused(store)
    assert _open(store, fresh=False) == (reused, True)
    renewed, sealed = _open(store, fresh=True)
    assert not sealed and renewed.inode != reused.inode
    shard = store.local_tensor("t", 2, 0)
    assert store.shared.segment_of(shard) == renewed and not shard.any()
    shard.fill_(7.0)  # what the writer copies in
    assert store.leases.finish_all_in_place("t", 2) == 1
    store.promote("t", 2)
    assert torch.equal(store.local_tensor("t", 2, 0), torch.full((64, 8), 7.0))
    assert store.shared.recycled.nbytes == 0  # the sealed memory went
    store.drop("t", 2)  # the fresh memory is kept for the next version, which the writer has mapped
    store.allocate("t", 3, _meta(64))
    assert store.shared.segment_of(store.local_tensor("t", 3, 0)) == renewed


def test_fresh_leaves_unsealed_memory_and_a_shard_being_written_as_they_are():
    store = ShardStore(0, shared_memory=True)
    store.allocate("t", 2, _meta(64))
    new = store.shared.segment_of(store.local_tensor("t", 2, 0))
    assert _open(store, fresh=True) == (new, False)  # never served: mappable already
    busy = ShardStore(0, shared_memory=True)
    reused = _served_then_reused(busy)
    with busy.leases.write("t", 2, 0, torch.float32, 64 * 8 * 4) as writer:
        with pytest.raises(TensorBusy):
            _open(busy, fresh=True)
        writer.fill(lambda view: None)
    assert busy.shared.segment_of(busy.local_tensor("t", 2, 0)) == reused


def test_update_copies_share_blocks_instead_of_copying():
    """A row update's version shares its source's blocks (server/rank/blocks.py): nothing is copied or recycled,
    and the dropped versions' blocks stay alive for the newest one."""
    store = ShardStore(0, shared_memory=True, version_grace=0)
    store.allocate("t", 1, _meta(64), fill=InitFill.ARANGE)
    store.promote("t", 1)
    for version in (2, 3):
        assert store.allocate_copy("t", version, _meta(64), version - 1) == 0  # no bytes copied
        store.promote("t", version)
        store.drop("t", version - 1)
    assert store.shared.recycled.reused == 0
    assert torch.equal(
        store.local_tensor("t", 3, 0), torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    )
    assert store.memory_used == 64 * 8 * 4


def test_checkpoint_loads_land_in_shared_memory_and_reuse_the_replaced_version(tmp_path):
    """A load writes straight into segments (a same-host reader maps them as they are, no copy on first read),
    and into a dropped version's buffers when one is kept."""
    import time

    from shardserve.core.wire import metadata_to_proto
    from shardserve.server.rank.jobs.checkpoint import run_checkpoint_load
    from shardserve.server.rank.jobs.checkpoint_io import save_tensors
    from shardserve.server.rank.jobs.context import JobContext

    meta = _meta(64)
    table = torch.randn(64, 8)
    save_tensors(str(tmp_path / "ckpt"), {"t": (meta, {0: table})})
    store = ShardStore(
        0, shared_memory=True, version_grace=0
    )  # no grace: version 1 is freed when 2 replaces it
    for version in (1, 2, 3):
        store.reserve("t", version, meta)
        job = pb.CollectiveJob(
            checkpoint_load=pb.CheckpointJob(
                path=str(tmp_path / "ckpt"),
                tensors=[
                    pb.CheckpointTensor(name="t", version=version, metadata=metadata_to_proto(meta))
                ],
            )
        )
        run_checkpoint_load(job, JobContext(store, 0, job, time.monotonic() + 60))
        store.promote("t", version)
        if version > 1:
            store.drop("t", version - 1)
        loaded = store.local_tensor("t", version, 0)
        assert torch.equal(loaded, table) and store.shared.segment_of(loaded) is not None
    assert (
        store.shared.recycled.reused == 1
    )  # version 3 went into version 1's segment (1 was served during 2)


def test_shards_past_the_open_file_budget_go_to_private_memory():
    """Thousands of tiny shards must not take the fds a rank's sockets need: past its budget, `empty` hands
    out plain memory (read over the network instead of mapped)."""
    from shardserve.server.rank.shared_memory import _segment_budget

    assert (
        _segment_budget(20000) == (20000 - 4096) // 2
        and _segment_budget(1024) == 256
        and _segment_budget(1) == 0
    )
    shared = SharedMemory()
    shared.max_segments = 3
    tensors = [shared.empty((4,), torch.float32) for _ in range(5)]
    assert [shared.segment_of(t) is not None for t in tensors] == [True, True, True, False, False]
    assert all(not t.any() for t in tensors)
    del tensors[0]
    assert (
        shared.segment_of(shared.empty((4,), torch.float32)) is not None
    )  # room again once one is freed


def test_segments_are_sealed_against_other_writers_once_served():
    """A reader maps /proc/PID/fd/N; a same-user process that opened it for writing could change a served
    version or truncate the segment (SIGBUS in the rank). Resizes always fail; a pending segment takes writes
    (an in-place writer fills it), a served one no write and no new writable mapping through any new handle,
    while the rank's own mapping stays writable."""
    import errno
    import mmap

    shared = SharedMemory()
    tensor = shared.empty((4,), torch.float32)
    tensor.fill_(1.0)
    segment = shared.segment_of(tensor)
    assert shared.writable_segment(tensor) == (segment, False)
    fd = os.open(f"/proc/{segment.pid}/fd/{segment.fd}", os.O_RDWR)
    try:
        with pytest.raises(OSError) as resize:
            os.ftruncate(fd, 0)
        assert resize.value.errno == errno.EPERM
        os.pwrite(fd, b"\x00" * 16, segment.data_offset)  # pending: an in-place writer's copy
        assert torch.equal(tensor, torch.zeros(4))
        shared.mark([tensor], served=True)
        assert shared.writable_segment(tensor) == (segment, True)
        with pytest.raises(OSError) as write:
            os.pwrite(fd, b"\x07" * 16, segment.data_offset)
        assert write.value.errno == errno.EPERM
        with pytest.raises(OSError) as mapping:
            mmap.mmap(fd, segment.data_offset + 16, mmap.MAP_SHARED, mmap.PROT_WRITE)
        assert mapping.value.errno == errno.EPERM
        shared.mark([tensor], served=True)  # sealing again is a no-op
    finally:
        os.close(fd)
    tensor.fill_(2.0)  # the rank still writes through its own mapping
    assert torch.equal(tensor, torch.full((4,), 2.0))


def test_a_new_segment_on_the_fd_of_a_closed_sealed_one_is_not_taken_for_sealed():
    """The rank remembers which of its segments it sealed (seals are final) until the segment's fd closes: a
    new segment that gets the same fd number is pending, and offered writable."""
    import gc

    shared = SharedMemory(recycled=RecycledBuffers(max_bytes=0))
    served = shared.empty((4,), torch.float32)
    fd = shared.segment_of(served).fd
    shared.mark([served], served=True)
    assert shared.writable_segment(served)[1] is True
    gc.collect()  # the files of earlier garbage closed first, not while this segment goes
    # a new file takes the lowest free fd number: fill the free ones below this segment's
    placeholders = [os.open(os.devnull, os.O_RDONLY) for _ in range(_free_fds_below(fd))]
    try:
        del served
        gc.collect()
        fresh = shared.empty((4,), torch.float32)
    finally:
        for placeholder in placeholders:
            os.close(placeholder)
    assert shared.segment_of(fresh).fd == fd, (
        "the new segment did not get the closed one's fd number"
    )
    assert shared.writable_segment(fresh)[1] is False


def _free_fds_below(limit: int) -> int:
    free = 0
    for number in range(limit):
        try:
            os.fstat(number)
        except OSError:
            free += 1
    return free
