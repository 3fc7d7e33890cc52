"""client.paths.batch without a cluster: pieces cut into per-rank batches, and each region's bytes copied into
its view of the output whatever its offset in the reply and the output's strides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.client.errors import InvalidArgumentError, RankUnavailableError
from shardserve.client.info import RankStatus, TensorSummary
from shardserve.client.paths.batch import (
    RegionRead,
    copy_region,
    filled_batches,
    read_batches,
    region_reads,
)
from shardserve.client.paths.kinds import PathKind
from shardserve.core.metadata import Box, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb


def read(rank: int, nbytes: int, piece: int = 0, name: str = "t") -> RegionRead:
    return RegionRead(
        rank,
        pb.ReadRegionRequest(name=name, version=1, offsets=[0], sizes=[nbytes]),
        torch.empty(nbytes, dtype=torch.uint8),
        piece,
        torch.uint8,
    )


def batches(reads, **limits):
    """Every batch filled_batches gives, rank by rank (each rank's in the order given)."""
    return sorted(filled_batches(reads, **limits), key=lambda batch: batch[0].rank)


def test_batches_are_per_rank_in_order_and_cut_by_answer_bytes_and_region_count():
    reads = [read(1, 400, 0), read(0, 300, 1), read(1, 400, 2), read(1, 400, 3), read(0, 10, 4)]
    cut = batches(reads, limit_bytes=1000, limit_regions=5)
    assert [[r.piece for r in batch] for batch in cut] == [[1, 4], [0, 2], [3]]
    cut = batches([read(0, 1, i) for i in range(7)], limit_bytes=1000, limit_regions=3)
    assert [len(batch) for batch in cut] == [3, 3, 1]


def test_batches_are_cut_by_request_bytes_too():
    long_name = "n" * 200
    cut = batches([read(0, 1, i, long_name) for i in range(10)], limit_bytes=1000)
    assert all(sum(r.request.ByteSize() for r in batch) <= 1000 for batch in cut) and len(cut) > 1
    assert [r.piece for batch in cut for r in batch] == list(range(10))


def test_a_piece_over_two_shards_reads_one_region_of_each():
    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]).build_metadata(
        (6, 3), TensorProperties()
    )
    summary = TensorSummary("t", 4, meta, "READY", 72, 0.0)
    out = torch.zeros(4, 3)
    parts = [(0, Box((1, 0), (2, 3))), (1, Box((3, 0), (2, 3)))]
    reads = region_reads(7, summary, parts, Box((1, 0), (4, 3)), out)
    assert [(r.rank, r.request.shard_index, list(r.request.offsets), r.piece) for r in reads] == [
        (0, 0, [1, 0], 7),
        (1, 1, [3, 0], 7),
    ]
    assert reads[1].dest.data_ptr() == out[2:].data_ptr() and reads[0].request.version == 4


def _reply(source: torch.Tensor) -> np.ndarray:
    """Three bytes, then `source`'s: a read-only view of a reply's bytes, as ReadRegions' answer gives them."""
    data = bytes(3) + source.view(-1).view(torch.uint8).numpy().tobytes()
    return np.frombuffer(data, dtype=np.uint8)


def test_bytes_at_any_offset_land_in_contiguous_and_strided_outputs():
    source = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    reply = _reply(source)
    raw = reply[3:]  # an offset no int64 view may start at
    contiguous, strided = (
        torch.zeros(3, 4, dtype=torch.int64),
        torch.zeros(4, 3, dtype=torch.int64).t(),
    )
    copy_region(contiguous, raw, torch.int64)
    copy_region(strided, raw, torch.int64)
    assert torch.equal(contiguous, source) and torch.equal(strided, source)


def test_a_region_of_another_floating_dtype_is_converted_as_copy_does():
    source = torch.randn(3, 4, dtype=torch.float32) * 1e3
    reply = _reply(source)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        contiguous, strided = torch.empty(3, 4, dtype=dtype), torch.empty(4, 3, dtype=dtype).t()
        copy_region(contiguous, reply[3:], torch.float32)
        copy_region(strided, reply[3:], torch.float32)
        expected = source.to(dtype)
        assert torch.equal(
            contiguous.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)
        )
        assert torch.equal(strided, expected)


def test_filled_batches_come_as_soon_as_they_are_full_then_the_rest_rank_by_rank():
    given: list[int] = []

    def reads():
        for i, rank in enumerate([1, 0, 1, 1, 0, 1]):
            given.append(i)
            yield read(rank, 400, i)

    cut = filled_batches(reads(), limit_bytes=1000)
    first = next(cut)
    assert [r.piece for r in first] == [0, 2] and given == [0, 1, 2, 3]  # full when piece 3 came
    assert [[r.piece for r in batch] for batch in cut] == [[1, 4], [3, 5]]


class FakePath:
    """A streamed path whose ReadRegions answers every region with 7s, or raises the error its rank fails with."""

    kind = PathKind.GRPC

    def __init__(self, failing: dict[str, Exception]) -> None:
        self.failing = failing

    def read_regions(self, address, request, reply_bytes):
        if address in self.failing:
            raise self.failing[address]
        sizes = [region.sizes[0] for region in request.regions]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return pb.ReadRegionsReply(data=bytes([7]) * sum(sizes), offsets=offsets)


class FakeSent:
    """Calls made when waited for, on the fake path, as SentCalls makes a streamed call."""

    def __init__(self, calls, path):
        self.calls, self.path, self.waited = calls, path, False
        self.paths = [PathKind.GRPC] * len(calls)

    def wait(self):
        self.waited = True
        errors = []
        for i, call in enumerate(self.calls):
            try:
                call.call(self.path, None)
            except Exception as err:  # noqa: BLE001 - raised below, as SentCalls.wait does
                self.paths[i] = None
                errors.append(err)
        if errors:
            raise errors[0]
        return self.paths


class FakePolicy:
    def __init__(self, failing: dict[str, Exception]) -> None:
        self.path, self.sent = FakePath(failing), []

    def sends_now(self, rank):
        return True

    def send_all(self, calls, submit):
        self.sent.append(FakeSent(calls, self.path))
        return self.sent[-1]


def _rank(rank: int) -> RankStatus:
    return RankStatus(rank, f"r{rank}", "cpu", "host", True, 0, 0, 0, 0.0)


def _read_all(policy, cut):
    return read_batches(policy, _rank, cut, submit=None)


def test_a_batch_whose_rank_is_unavailable_is_given_back_piece_by_piece():
    reads = [read(0, 4, 0), read(1, 4, 1), read(0, 4, 2)]
    alone = _read_all(
        FakePolicy({"r1": RankUnavailableError("rank at r1: connection refused")}),
        batches(reads),
    )
    assert alone == {1}
    assert all(bytes(r.dest.numpy()) == bytes([7]) * 4 for r in (reads[0], reads[2]))


def test_a_batch_refused_as_a_bad_request_fails_the_read():
    with pytest.raises(InvalidArgumentError, match="regions"):
        _read_all(
            FakePolicy({"r0": InvalidArgumentError("regions[0]: bad box")}),
            batches([read(0, 4, 0), read(1, 4, 1)]),
        )


def test_a_plan_that_fails_midway_raises_only_once_the_batches_out_are_answered():
    policy = FakePolicy({})

    def cut():
        yield [read(0, 4, 0)]
        raise InvalidArgumentError("out has shape (2,) but sizes are (4,)")

    with pytest.raises(InvalidArgumentError, match="out has shape"):
        _read_all(policy, cut())
    assert len(policy.sent) == 1 and policy.sent[0].waited
