"""client.paths.batch without a cluster: pieces cut into per-rank batches, and each region's bytes copied into
its view of the output whatever its offset in the reply and the output's strides."""

from __future__ import annotations

import numpy as np
import torch

from shardserve.client.info import TensorSummary
from shardserve.client.paths.batch import RegionRead, batches, copy_region, region_reads
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
