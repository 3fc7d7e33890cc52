"""ShardStore alone (no network): versions, promotion, leases, memory accounting, install of built shards."""

from __future__ import annotations

import pytest
import torch

from shardserve.core.metadata import TensorProperties, make_metadata
from shardserve.core.specs import ChunkShardingSpec
from shardserve.server.rank.errors import (
    InvalidArgument,
    InvalidState,
    MemoryLimit,
    RequestTooLarge,
    StaleVersion,
    TensorBusy,
    TensorNotFound,
    WriteIncomplete,
)
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore

META = make_metadata(
    (6, 4), [((0, 0), (3, 4), 0), ((3, 0), (3, 4), 1), ((0, 0), (3, 4), 1)]
)  # shard 2: replica


def test_allocate_counts_only_local_shards_and_frees_on_drop():
    store = ShardStore(rank=1)
    assert store.allocate("t", 1, META, InitFill.ARANGE) == 2 * 3 * 4 * 4
    assert store.memory_used == 96 and sorted(store.local_shards("t", 1)) == [1, 2]
    assert torch.equal(
        store.local_tensor("t", 1, 1), torch.arange(12, 24, dtype=torch.float32).view(3, 4)
    )
    assert store.drop("t", 1) == 1 and store.memory_used == 0
    assert store.drop("t", 1) == 0  # idempotent


def test_normal_replicas_hold_the_same_numbers():
    store = ShardStore(rank=1)
    store.allocate("n", 1, META, InitFill.NORMAL, seed=3)
    replica = store.local_tensor("n", 1, 2)
    assert torch.equal(replica, torch.randn((3, 4), generator=torch.Generator().manual_seed(3)))


def test_read_needs_a_promoted_version_and_a_lease_delays_freeing():
    store = ShardStore(rank=0, max_request_bytes=48)
    store.allocate("t", 1, META, InitFill.ONES)
    with pytest.raises(StaleVersion, match="not served here; no version is served yet"):
        with store.leases.read("t", 1, 0, (0, 0), (1, 1)):
            pass
    store.promote("t", 1)
    with store.leases.read("t", 0, 0, (1, 0), (2, 4)) as view:  # version 0: the newest served
        assert store.drop("t") == 1
        assert store.memory_used == 48  # still leased
        assert torch.equal(view, torch.ones(2, 4))
    assert store.memory_used == 0
    with pytest.raises(TensorNotFound, match="'t' not found on rank 0"):
        with store.leases.read("t", 1, 0, (0, 0), (1, 1)):
            pass


def test_read_over_max_request_bytes_is_refused():
    store = ShardStore(rank=0, max_request_bytes=16)
    store.allocate("t", 1, META, InitFill.ONES)
    store.promote("t", 1)
    with pytest.raises(RequestTooLarge, match="max_request_bytes 16"):
        with store.leases.read("t", 1, 0, (0, 0), (2, 4)):
            pass


def test_memory_limit_counts_pending_versions():
    store = ShardStore(rank=0, memory_limit=60)
    store.allocate("a", 1, META)
    with pytest.raises(MemoryLimit, match="memory limit: 48 bytes requested, 12 of 60 free"):
        store.allocate("b", 2, META)
    store.drop("a")
    store.allocate("b", 2, META)


def test_write_in_order_then_promote():
    store = ShardStore(rank=0)
    store.allocate("w", 1, META)
    with pytest.raises(WriteIncomplete, match="not fully written"):
        store.promote("w", 1)
    data = torch.arange(12, dtype=torch.float32).view(3, 4)
    raw = data.numpy().tobytes()
    with store.leases.write("w", 1, 0, torch.float32, 48) as writer:
        writer.write(0, raw[:20])
        with pytest.raises(
            InvalidArgument, match="chunk.offset 0 is not where the stream is: expected 20"
        ):
            writer.write(0, raw[:4])
        writer.write(20, memoryview(raw)[20:])
    store.promote("w", 1)
    assert torch.equal(store.local_tensor("w", 1, 0), data)
    with pytest.raises(InvalidState, match="already committed"):
        with store.leases.write("w", 1, 0, torch.float32, 48):
            pass


def test_a_second_stream_of_a_shard_being_written_is_refused():
    """Two WriteShard streams of one shard would interleave their bytes, each then "complete": the second is
    ABORTED, and the shard is published only once the first completes it."""
    store = ShardStore(rank=0)
    store.allocate("race", 1, META)
    with store.leases.write("race", 1, 0, torch.float32, 48) as first:
        first.write(0, b"\xaa" * 8)
        with pytest.raises(
            TensorBusy,
            match="shard_index 0 of 'race' version 1 is being written by another stream",
        ):
            with store.leases.write("race", 1, 0, torch.float32, 48):
                pass
        with pytest.raises(WriteIncomplete, match=r"shards \[0\] on rank 0 are not fully written"):
            store.promote("race", 1)
        first.write(8, b"\xaa" * 40)
    store.promote("race", 1)
    assert store.local_tensor("race", 1, 0).view(torch.uint8).flatten().tolist() == [0xAA] * 48


def test_install_adds_a_complete_pending_version_checked_against_the_layout():
    store = ShardStore(rank=1)
    shards = {1: torch.full((3, 4), 2.0), 2: torch.full((3, 4), 3.0)}
    with pytest.raises(InvalidArgument, match=r"shards \[1\] given"):
        store.install("i", 5, META, {1: shards[1]})
    with pytest.raises(InvalidArgument, match="shard 2 of tensor 'i'"):
        store.install("i", 5, META, {1: shards[1], 2: torch.zeros(3, 4, dtype=torch.float64)})
    assert store.install("i", 5, META, shards) == 96
    store.promote("i", 5)
    with store.leases.read("i", 5, 2, (1, 1), (2, 2)) as view:
        assert torch.equal(view, torch.full((2, 2), 3.0))


def test_a_shard_being_rewritten_cannot_be_promoted():
    """WriteRows changes a pending copy in place; while it does, that shard counts as not fully written."""
    store = ShardStore(0)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (4, 2), TensorProperties(dtype=torch.float32)
    )
    store.install("t", 1, meta, {0: torch.zeros(4, 2)})
    with store.leases.rewrite("t", 1, 0) as shard:
        shard[1] = 5.0
        with pytest.raises(WriteIncomplete, match="not fully written"):
            store.promote("t", 1)
    store.promote("t", 1)
    with store.leases.read("t", 1, 0, (0, 0), (4, 2)) as view:
        assert view[1].tolist() == [5.0, 5.0]
    with pytest.raises(InvalidState, match="already committed"):
        with store.leases.rewrite("t", 1, 0):
            pass


def test_a_batch_of_reads_leases_each_version_once_until_it_ends():
    store = ShardStore(rank=0)
    store.allocate("t", 1, META, InitFill.ONES)
    store.promote("t", 1)
    with store.leases.reads() as batch:
        first = batch.box("t", 1, 0, (0, 0), (1, 4))
        whole = batch.box("t", 0, 0, (0, 0), (2, 4))  # version 0: the newest served, leased apart
        assert [r.version for r in batch.records()] == [1, 1]
        assert len(batch.records()) == 2 and batch.box("t", 1, 0, (1, 0), (1, 4)) is not None
        assert len(batch.records()) == 2  # a version named again is not leased again
        assert store.drop("t") == 1 and store.memory_used == 48  # held until the batch ends
        assert torch.equal(first, torch.ones(1, 4)) and torch.equal(whole, torch.ones(2, 4))
    assert store.memory_used == 0


def test_a_batch_of_reads_that_fails_ends_its_leases():
    store = ShardStore(rank=0)
    store.allocate("t", 1, META, InitFill.ONES)
    store.promote("t", 1)
    with pytest.raises(InvalidArgument, match="not inside the shard"):
        with store.leases.reads() as batch:
            batch.box("t", 1, 0, (0, 0), (1, 4))
            batch.box("t", 1, 0, (2, 0), (2, 4))
    assert store.drop("t") == 1 and store.memory_used == 0


def test_an_allocation_overtaken_by_its_drop_is_refused():
    """An abort's DropVersion can reach a rank before the AllocateShards it aborts; versions never come back,
    so the late allocation is refused instead of holding memory nobody will free."""
    store = ShardStore(0)
    meta = ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata(
        (4, 2), TensorProperties(dtype=torch.float32)
    )
    assert store.drop("t", 7) == 0  # nothing there yet
    with pytest.raises(TensorBusy, match="was dropped on rank 0 before this allocation arrived"):
        store.allocate("t", 7, meta)
    with pytest.raises(TensorBusy, match="was dropped"):
        store.reserve("t", 7, meta)
    assert store.memory_used == 0
    store.allocate("t", 8, meta)  # other versions are not affected
    assert store.memory_used == 32


def test_a_reserved_version_is_not_written_by_streams():
    """A reshard's or checkpoint load's reserved version gets its shards from the job: a WriteShard into it is
    FAILED_PRECONDITION saying so, not an INVALID_ARGUMENT claiming the rank holds no such shard."""
    store = ShardStore(rank=0)
    store.reserve("r", 1, META)
    with pytest.raises(InvalidState, match="shard_index 0 of tensor 'r' version 1 is reserved"):
        with store.leases.write("r", 1, 0, torch.float32, 48):
            pass
    with pytest.raises(InvalidArgument, match="shard_index 1 of tensor 'r' is not held by rank 0"):
        with store.leases.write("r", 1, 1, torch.float32, 48):
            pass


def test_a_shard_a_failed_change_left_half_written_is_not_published():
    """Another change completing the shard, before or after, does not make it whole: the shard stays torn until
    a change that starts with the shard idle completes it."""
    ones, twos = torch.full((12,), 1.0).numpy().tobytes(), torch.full((12,), 2.0).numpy().tobytes()
    store = ShardStore(rank=0)
    store.allocate("t", 1, META)
    failing = store.leases.write("t", 1, 0, torch.float32, 48)
    writer = failing.__enter__()
    writer.write(0, twos[:24])
    with store.leases.rewrite(
        "t", 1, 0
    ) as shard:  # a WriteRows batch of the same shard, done in full meanwhile
        shard.copy_(torch.ones(3, 4))
    with pytest.raises(InvalidArgument, match="ended after 24 of 48 bytes"):
        failing.__exit__(None, None, None)  # the stream ends early
    with pytest.raises(WriteIncomplete, match=r"shards \[0\] on rank 0 are not fully written"):
        store.promote("t", 1)
    with store.leases.write(
        "t", 1, 0, torch.float32, 48
    ) as again:  # a retry of the shard alone makes it whole
        again.write(0, ones)
    store.promote("t", 1)
    assert torch.equal(store.local_tensor("t", 1, 0), torch.ones(3, 4))


def test_a_failed_rewrite_is_not_published_and_a_write_waits_for_it():
    """A WriteRows batch that fails half way leaves its shard torn; a WriteShard of a shard being rewritten is
    refused rather than interleaved with it."""
    store = ShardStore(rank=0)
    store.allocate("u", 1, META, InitFill.ZEROS)
    with pytest.raises(RuntimeError, match="connection lost"):
        with store.leases.rewrite("u", 1, 0) as shard:
            shard[0] = 7.0
            with pytest.raises(TensorBusy, match="being written by another stream"):
                with store.leases.write("u", 1, 0, torch.float32, 48):
                    pass
            raise RuntimeError("connection lost")
    with pytest.raises(WriteIncomplete, match="not fully written"):
        store.promote("u", 1)


def test_a_request_stream_the_client_ended_is_cancelled_not_internal():
    """grpc raises a bare RpcError from the request iterator of a stream the client cancelled or let time out: it
    is the client's doing (CANCELLED, logged at INFO), not a server failure (INTERNAL with a traceback)."""
    import grpc

    from shardserve.server.common.errors import status_of

    status = status_of(grpc.RpcError())
    assert status.code == grpc.StatusCode.CANCELLED and "ended the request stream" in status.message
