"""WriteBytes on one rank (server/rank/writes/path.py): a delta put's changed byte ranges written into a version
that shares its blocks with the one before, sent inline or through the writer's same-host staging memfd.

A real ShardStore and the rank's write path called in-process: every byte compared with plain torch, the older
version left whole, a run of rewritten blocks kept in one file, and bad requests refused naming the field
before a byte is written."""

from __future__ import annotations

import pytest
import torch

from shardserve.client.paths.staging import StagingFile
from shardserve.core.metadata import ShardedTensorMetadata, TensorProperties
from shardserve.core.specs import ChunkShardingSpec
from shardserve.protos import shardserve_pb2 as pb
from shardserve.protos.same_host import host_id
from shardserve.server.rank.blocks import BLOCK_BYTES, RUN_BLOCKS
from shardserve.server.rank.errors import InvalidArgument, PathUnavailable
from shardserve.server.rank.shard_fill import InitFill
from shardserve.server.rank.store import ShardStore
from shardserve.server.rank.writes.path import WritePath

COLUMNS = 256  # 1 KiB rows of fp32
BLOCKS = 2 * RUN_BLOCKS + 4
ROWS = BLOCKS * BLOCK_BYTES // (COLUMNS * 4)


def _meta() -> ShardedTensorMetadata:
    return ChunkShardingSpec(0, ["rank:0/cpu"]).build_metadata((ROWS, COLUMNS), TensorProperties())


def _store(*, shared_memory: bool = True) -> ShardStore:
    """Version 1 of "t" served (0, 1, 2, ... as fp32), version 2 a pending copy sharing its blocks."""
    store = ShardStore(0, shared_memory=shared_memory, version_grace=60)
    store.allocate("t", 1, _meta(), fill=InitFill.ARANGE)
    store.promote("t", 1)
    store.allocate_copy("t", 2, _meta(), 1)
    return store


# a few bytes inside one block, a range across a block boundary, and a run of whole blocks with a partial
# block on either side: blocks wholly covered are not copied first, the others keep their unwritten bytes
RANGES = [
    (100, 164),
    (3 * BLOCK_BYTES - 10, 3 * BLOCK_BYTES + 30),
    (5 * BLOCK_BYTES + 7, (6 + RUN_BLOCKS) * BLOCK_BYTES + 5),
]


def _request(ranges: list[tuple[int, int]], version: int = 2) -> pb.WriteBytesRequest:
    return pb.WriteBytesRequest(
        name="t",
        version=version,
        shard_index=0,
        starts=[start for start, _ in ranges],
        lengths=[stop - start for start, stop in ranges],
    )


def _pieces(ranges: list[tuple[int, int]], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (stop - start,), dtype=torch.uint8, generator=generator)
        for start, stop in ranges
    ]


def _expected(before: torch.Tensor, ranges, pieces) -> torch.Tensor:
    flat = before.clone().view(-1).view(torch.uint8)
    for (start, stop), piece in zip(ranges, pieces):
        flat[start:stop] = piece
    return flat.view(torch.float32).view(before.shape)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (random bytes as fp32 may be NaNs, which never compare equal)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _inline(ranges, pieces) -> pb.WriteBytesRequest:
    request = _request(ranges)
    request.data = b"".join(piece.numpy().tobytes() for piece in pieces)
    return request


@pytest.mark.parametrize("source", ["inline", "shared"])
def test_byte_ranges_land_bit_for_bit_and_the_older_version_stays_whole(source: str) -> None:
    store = _store()
    before = store.local_tensor("t", 1, 0).clone()
    pieces = _pieces(RANGES)
    nbytes = sum(piece.numel() for piece in pieces)
    if source == "inline":
        written = WritePath(store).byte_ranges(_inline(RANGES, pieces))
    else:
        with StagingFile(nbytes + 4096) as staging:  # a kept file may be larger than the ranges
            staging.pack_bytes(pieces)
            request = _request(RANGES)
            request.shared.CopyFrom(staging.source(host_id()))
            written = WritePath(store).byte_ranges(request)
    assert written == nbytes
    store.promote("t", 2)
    assert torch.equal(
        _bytes(store.local_tensor("t", 2, 0)), _bytes(_expected(before, RANGES, pieces))
    )
    assert torch.equal(store.local_tensor("t", 1, 0), before)


def test_a_run_of_rewritten_blocks_lies_in_one_file() -> None:
    """Blocks rewritten together, back to back, share one new file (one mapping for a reader), while a lone
    block gets a file of its own and the untouched ones stay in the segment."""
    store = _store()
    ranges = [(0, 10), (4 * BLOCK_BYTES, (4 + RUN_BLOCKS) * BLOCK_BYTES)]
    WritePath(store).byte_ranges(_inline(ranges, _pieces(ranges)))
    store.promote("t", 2)
    extents = store.blocks.extents(store.local_tensor("t", 2, 0))
    sizes = [extent.nbytes for extent in extents]
    assert sizes == [
        BLOCK_BYTES,
        3 * BLOCK_BYTES,
        RUN_BLOCKS * BLOCK_BYTES,
        (BLOCKS - 4 - RUN_BLOCKS) * BLOCK_BYTES,
    ]
    assert len({extent.inode for extent in extents}) == 3  # the lone block, the run, the segment


def test_inline_bytes_and_a_shared_source_together_are_refused() -> None:
    store = _store()
    before = store.local_tensor("t", 1, 0).clone()
    pieces = _pieces(RANGES)
    with StagingFile(sum(piece.numel() for piece in pieces)) as staging:
        staging.pack_bytes(pieces)
        request = _inline(RANGES, pieces)
        request.shared.CopyFrom(staging.source(host_id()))
        with pytest.raises(InvalidArgument, match="data: bytes sent inline with a shared source"):
            WritePath(store).byte_ranges(request)
    store.promote("t", 2)  # nothing was written: the copy still reads as its source
    assert torch.equal(store.local_tensor("t", 2, 0), before)


def test_a_rank_without_shared_memory_refuses_a_staging_file_as_a_path_refusal() -> None:
    store = _store(shared_memory=False)
    pieces = _pieces(RANGES)
    with StagingFile(sum(piece.numel() for piece in pieces)) as staging:
        staging.pack_bytes(pieces)
        request = _request(RANGES)
        request.shared.CopyFrom(staging.source(host_id()))
        with pytest.raises(PathUnavailable, match="does not use shared memory"):
            WritePath(store).byte_ranges(request)


def test_a_staging_file_smaller_than_the_ranges_is_refused() -> None:
    store = _store()
    pieces = _pieces(RANGES)
    with StagingFile(sum(piece.numel() for piece in pieces) // 2) as staging:
        request = _request(RANGES)
        request.shared.CopyFrom(staging.source(host_id()))
        with pytest.raises(InvalidArgument, match="shared.nbytes"):
            WritePath(store).byte_ranges(request)


@pytest.mark.parametrize(
    "starts, lengths, field",
    [
        ([0, 8], [16], "starts"),  # as many starts as lengths
        ([0], [0], "lengths"),  # an empty range
        ([64, 0], [8, 8], "starts"),  # not sorted
        ([BLOCKS * BLOCK_BYTES - 4], [8], "lengths"),  # past the shard
    ],
)
def test_bad_ranges_are_refused_naming_the_field(starts, lengths, field) -> None:
    store = _store()
    request = pb.WriteBytesRequest(
        name="t", version=2, shard_index=0, starts=starts, lengths=lengths
    )
    request.data = bytes(sum(lengths))
    with pytest.raises(InvalidArgument) as caught:
        WritePath(store).byte_ranges(request)
    assert caught.value.metadata["field"] == field
