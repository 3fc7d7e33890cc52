"""A CUDA rank keeps a dropped version's buffers like a CPU rank (server/rank/recycling.py): the next version of
the same size reuses the memory and the header-only segment its same-host readers and writers check, with a
new generation before any byte changes; memory handed to a writer that never finished goes back to the device.
In-process, on a GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos.same_host import HEADER_MAGIC, STATE_DROPPED, STATE_PENDING, STATE_SERVED
from shardserve.server.rank import shared_memory
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
NBYTES = 64 * 8 * 4


def _meta(rows: int = 64, columns: int = 8) -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, ["rank:0/cuda:0"]).build_metadata(
        (rows, columns), TensorProperties()
    )


def _header(segment) -> list[int]:
    with open(f"/proc/{segment.pid}/fd/{segment.fd}", "rb") as f:
        return torch.frombuffer(bytearray(f.read(24)), dtype=torch.int64).tolist()


def _served_with_header(store: ShardStore, name: str, version: int):
    """Version `version` of `name` allocated (ones), served, and its state header made, as a reader's
    OpenShard makes it: (its shard's data_ptr, the header segment)."""
    store.allocate(name, version, _meta(), fill=InitFill.ONES)
    store.promote(name, version)
    with store.leases.lease(name, version) as entry:
        segment = store.leases.state_header(entry, 0)
        return store.local_tensor(name, version, 0).data_ptr(), segment


def test_a_cuda_rank_reuses_a_dropped_versions_buffer_and_its_header():
    store = ShardStore(0, device="cuda:0", version_grace=0)
    first, segment = _served_with_header(store, "t", 1)
    assert _header(segment) == [HEADER_MAGIC, STATE_SERVED, 0]
    store.drop("t", 1)
    assert _header(segment) == [HEADER_MAGIC, STATE_DROPPED, 0]
    assert store.memory.kept_bytes() == NBYTES

    store.allocate("t", 2, _meta())  # written whole before it counts: handed over as it is
    second = store.local_tensor("t", 2, 0)
    assert second.data_ptr() == first and bool((second == 1).all())
    assert _header(segment) == [HEADER_MAGIC, STATE_PENDING, 1]  # readers of version 1 see it went
    with store.leases.lease("t", 2, served=False) as entry:
        assert store.leases.state_header(entry, 0) == segment  # the same header for the same memory
    store.drop("t", 2)
    store.allocate("z", 1, _meta(32, 16), fill=InitFill.ZEROS)  # same bytes, other shape: zeroed
    zeros = store.local_tensor("z", 1, 0)
    assert zeros.data_ptr() == first and not zeros.any()
    assert _header(segment)[2] == 2


def test_a_cuda_buffer_of_another_size_is_not_taken():
    store = ShardStore(0, device="cuda:0", version_grace=0)
    first, _ = _served_with_header(store, "t", 1)
    store.drop("t", 1)
    store.allocate("u", 1, _meta(32), fill=InitFill.ONES)
    assert store.local_tensor("u", 1, 0).data_ptr() != first
    assert store.memory.kept_bytes() == NBYTES


def test_cuda_memory_handed_to_a_writer_that_never_finished_is_not_reused():
    store = ShardStore(0, device="cuda:0", version_grace=0)
    store.allocate("t", 1, _meta())
    handed = store.leases.open_in_place("t", 1, 0, torch.float32, NBYTES)
    assert handed is not None and handed.cuda is not None
    store.drop("t", 1)  # the reservation aborted while its writer holds the IPC handle
    assert store.memory.kept_bytes() == 0
    store.allocate("u", 1, _meta())
    assert store.local_tensor("u", 1, 0).data_ptr() != handed.cuda.data_ptr()


def test_a_cuda_buffer_reused_cuda_reuses_times_goes_back_to_the_device(monkeypatch):
    """torch keeps one more IPC record per handle handed out for as long as the storage lives: a buffer is
    reused a bounded number of times, then let go."""
    monkeypatch.setattr(shared_memory, "CUDA_REUSES", 2)
    store = ShardStore(0, device="cuda:0", version_grace=0)
    first, segment = _served_with_header(store, "t", 1)
    for version in (2, 3):
        store.drop("t", version - 1)
        assert store.memory.kept_bytes() == NBYTES
        reused, _ = _served_with_header(store, "t", version)
        assert reused == first
    assert _header(segment)[2] == 2
    store.drop("t", 3)
    assert store.memory.kept_bytes() == 0  # reused twice: not kept again
