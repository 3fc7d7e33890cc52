"""Checksums an in-place writer leaves beside the bytes it copied: the rank keeps them when the writer says the
shard is written (no hashing at the promote), and hashes the shard itself whenever that checksum cannot stand
for the bytes (none left, left before the shard was handed out again, or bytes sent since by another path). A
small shard sent as bytes is hashed by the rank as soon as it is whole, a large one by the promote.

The test plays the writer: it maps the rank's memfd segment as a same-host writer does (/proc/<pid>/fd/<fd>),
copies a tensor in with the client's own `fill`, and leaves a checksum with the contract's `leave_checksum`.
A deliberately wrong checksum shows which value the promote answers: the writer's, or a hash of the bytes."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from shardserve.client.paths.copies import synchronize
from shardserve.client.paths.in_place import fill
from shardserve.client.paths.writes import shard_write
from shardserve.core.checksums import tensor_checksum
from shardserve.core.metadata import make_metadata
from shardserve.protos.same_host import (
    HEADER_WORDS,
    WORD_CHECKSUM,
    WORD_CHECKSUM_TAG,
    WORD_GENERATION,
    generation_tag,
    leave_checksum,
    left_checksum,
)
from shardserve.server.rank.leases import HASHED_AS_WRITTEN_BYTES
from shardserve.server.rank.store import ShardStore

META = make_metadata((8, 4), [((0, 0), (4, 4), 0), ((4, 0), (4, 4), 0)])
WRONG = 0x0123456789ABCDEF  # no 4x4 float tensor below hashes to this


@pytest.fixture
def store():
    store = ShardStore(rank=0)
    if not store.memory.shared.enabled:
        pytest.skip("this host has no memfd shared memory")
    return store


def _map(segment) -> torch.Tensor:
    """The whole segment (header and bytes), mapped writable as the in-place writer maps it."""
    fd = os.open(f"/proc/{segment.pid}/fd/{segment.fd}", os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, segment.data_offset + segment.nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def _write_in_place(store, name: str, version: int, data: dict[int, torch.Tensor]) -> dict:
    """Open every shard for an in-place write, copy `data` in with the writer's `fill`; the header words."""
    opened = {index: seg for index, seg, _ in store.leases.open_allocated_in_place(name, version)}
    headers = {}
    for index, tensor in data.items():
        flat = _map(opened[index])
        segment = opened[index]
        target = flat[segment.data_offset : segment.data_offset + segment.nbytes]
        header = flat[: HEADER_WORDS * 8].view(torch.int64).numpy()
        write = shard_write(name, version, index, tensor)
        synchronize(fill([write], [target], [header]))
        headers[index] = header
    return headers


def _shards():
    return {0: torch.randn(4, 4), 1: torch.randn(4, 4)}


def test_the_promote_answers_the_checksums_the_writer_left_without_hashing(store):
    store.allocate("t", 1, META)
    data = _shards()
    headers = _write_in_place(store, "t", 1, data)
    leave_checksum(
        headers[1], WRONG
    )  # the writer's word is the one kept: the promote does not hash
    assert store.leases.finish_all_in_place("t", 1) == 2
    sums = store.promote("t", 1)
    assert sums == {0: tensor_checksum(data[0]), 1: WRONG}
    assert torch.equal(store.local_tensor("t", 1, 0), data[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_tensor_copied_down_leaves_the_checksum_of_what_landed(store):
    store.allocate("g", 1, META)
    data = {0: torch.randn(4, 4, device="cuda"), 1: torch.randn(4, 4, device="cuda").t()}
    headers = _write_in_place(store, "g", 1, data)
    assert left_checksum(headers[0]) == tensor_checksum(data[0])
    assert left_checksum(headers[1]) is None  # strided: copied by torch, hashed by the rank
    assert store.leases.finish_all_in_place("g", 1) == 2
    assert store.promote("g", 1) == {0: tensor_checksum(data[0]), 1: tensor_checksum(data[1])}
    assert torch.equal(store.local_tensor("g", 1, 1), data[1].cpu())


def test_a_cast_copy_leaves_no_checksum_and_the_promote_hashes_what_landed(store):
    store.allocate("c", 1, make_metadata((4, 4), [((0, 0), (4, 4), 0)], dtype=torch.bfloat16))
    opened = {index: seg for index, seg, _ in store.leases.open_allocated_in_place("c", 1)}
    flat = _map(opened[0])
    header = flat[: HEADER_WORDS * 8].view(torch.int64).numpy()
    source = torch.randn(4, 4)
    target = flat[opened[0].data_offset : opened[0].data_offset + opened[0].nbytes]
    fill([shard_write("c", 1, 0, source, dtype=torch.bfloat16)], [target], [header])
    store.leases.finish_all_in_place("c", 1)
    assert store.promote("c", 1) == {0: tensor_checksum(source.to(torch.bfloat16))}


def test_a_checksum_left_before_the_shard_was_handed_out_again_is_not_taken(store):
    store.allocate("r", 1, META)
    headers = _write_in_place(store, "r", 1, _shards())
    leave_checksum(headers[0], WRONG)
    store.leases.open_allocated_in_place(
        "r", 1
    )  # handed out anew: what was left before is forgotten
    store.leases.finish_all_in_place("r", 1)
    sums = store.promote("r", 1)
    assert sums[0] != WRONG
    assert sums[0] == tensor_checksum(store.local_tensor("r", 1, 0))


def test_bytes_sent_after_the_in_place_write_drop_its_checksum(store):
    store.allocate("s", 1, META)
    headers = _write_in_place(store, "s", 1, _shards())
    leave_checksum(headers[0], WRONG)
    store.leases.finish_all_in_place("s", 1)
    sent = torch.full((4, 4), 3.0)
    with store.leases.write("s", 1, 0, torch.float32, sent.numel() * 4) as writer:
        writer.write(0, sent.numpy().tobytes())
    assert store.promote("s", 1)[0] == tensor_checksum(sent)


def test_a_recycled_segment_ignores_the_checksum_its_last_writer_left(store):
    store.allocate("g", 1, META)
    headers = _write_in_place(store, "g", 1, _shards())  # the writer keeps these mappings
    store.leases.finish_all_in_place("g", 1)
    store.promote("g", 1)
    store.drop("g", 1)  # its memory is kept for reuse, header and all
    store.allocate("g", 2, META)
    store.leases.open_allocated_in_place("g", 2)
    reused = [header for header in headers.values() if int(header[WORD_GENERATION]) == 1]
    assert reused, "the second version reuses the first one's segments"
    for header in reused:  # a checksum left for the segment's previous use, tagged as such
        header[WORD_CHECKSUM] = WRONG
        header[WORD_CHECKSUM_TAG] = generation_tag(0)
    store.leases.finish_all_in_place("g", 2)
    sums = store.promote("g", 2)
    assert sums == {i: tensor_checksum(store.local_tensor("g", 2, i)) for i in (0, 1)}
    assert WRONG not in sums.values()


def _send(store, name: str, version: int, index: int, tensor: torch.Tensor) -> None:
    """Write shard `index` whole as bytes, as WriteShard and WriteShards do."""
    data = tensor.view(torch.uint8).numpy().tobytes()
    with store.leases.write(name, version, index, tensor.dtype, len(data)) as writer:
        writer.write(0, data)


@pytest.mark.parametrize("rows", [4, (HASHED_AS_WRITTEN_BYTES // 16) + 4], ids=["small", "large"])
def test_a_small_shard_sent_as_bytes_is_hashed_as_it_is_written_a_large_one_by_the_promote(
    store, rows
):
    meta = make_metadata((rows, 4), [((0, 0), (rows, 4), 0)])
    store.allocate("b", 1, meta)
    sent = torch.randn(rows, 4)
    _send(store, "b", 1, 0, sent)
    store.local_tensor("b", 1, 0).zero_()  # changed behind the rank's back, after the write
    small = rows * 16 <= HASHED_AS_WRITTEN_BYTES
    expected = sent if small else torch.zeros(rows, 4)  # hashed when whole, or at the promote
    assert store.promote("b", 1) == {0: tensor_checksum(expected)}


def test_a_shard_sent_as_bytes_then_filled_in_place_is_hashed_again(store):
    meta = make_metadata((4, 4), [((0, 0), (4, 4), 0)], dtype=torch.bfloat16)
    store.allocate("w", 1, meta)
    _send(store, "w", 1, 0, torch.zeros(4, 4, dtype=torch.bfloat16))  # hashed as written
    opened = {index: seg for index, seg, _ in store.leases.open_allocated_in_place("w", 1)}
    flat = _map(opened[0])
    header = flat[: HEADER_WORDS * 8].view(torch.int64).numpy()
    target = flat[opened[0].data_offset : opened[0].data_offset + opened[0].nbytes]
    source = torch.randn(4, 4)
    fill([shard_write("w", 1, 0, source, dtype=torch.bfloat16)], [target], [header])  # leaves none
    store.leases.finish_all_in_place("w", 1)
    assert store.promote("w", 1) == {0: tensor_checksum(source.to(torch.bfloat16))}
