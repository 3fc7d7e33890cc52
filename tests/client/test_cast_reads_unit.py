"""Casts in flight without a cluster: which casts shardcore.casts allows, and a network part read into an
output of another dtype band by band through bounded staging buffers, bit for bit `src.to(dtype)`."""

from __future__ import annotations

import threading

import pytest
import torch

from shardserve.client.info import TensorSummary
from shardserve.client.paths.bands import staged_bands
from shardserve.client.paths.kinds import PartRead
from shardserve.client.paths.network import read_cast_part
from shardserve.core.casts import CastError, cast_target, read_cast_problem, stored_dtype
from shardserve.core.metadata import Box, TensorProperties
from shardserve.core.regions import local_view
from shardserve.core.specs import ChunkShardingSpec

FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def test_floating_dtypes_cast_and_integer_and_bool_tensors_keep_their_own() -> None:
    for source in FLOATING:
        for wanted in FLOATING:
            assert stored_dtype(source, wanted) == wanted
            assert read_cast_problem(source, wanted) == ""
    for kept in (torch.int64, torch.int8, torch.uint8, torch.bool):
        assert stored_dtype(kept, torch.bfloat16) == kept
        assert read_cast_problem(kept, torch.float32) != ""
        assert read_cast_problem(torch.float32, kept) != ""
    assert stored_dtype(torch.complex64, None) == torch.complex64
    with pytest.raises(CastError, match="complex64"):
        stored_dtype(torch.complex64, torch.float32)
    assert read_cast_problem(torch.complex64, torch.float32) != ""
    assert cast_target("bfloat16") == torch.bfloat16
    for refused in (torch.int32, torch.bool, torch.complex64, "float8", 3):
        with pytest.raises(CastError):
            cast_target(refused)


def test_staged_bands_are_bounded_and_cover_the_part_once() -> None:
    part = Box((10, 2), (37, 5))
    cut = staged_bands(part, 4, max_bytes=3 * 5 * 4)
    assert [b.sizes for b in cut] == [(3, 5)] * 12 + [(1, 5)]
    assert [b.offsets[0] for b in cut] == list(range(10, 47, 3))
    assert staged_bands(part, 4, max_bytes=1) == [Box((o, 2), (1, 5)) for o in range(10, 47)]
    assert staged_bands(Box((), ()), 4) == [Box((), ())]


@pytest.mark.parametrize("only_part", [True, False])
def test_a_part_read_into_another_dtype_lands_in_bounded_bands(only_part: bool) -> None:
    source = (torch.randn(64, 6, dtype=torch.float64) * 1e5).to(torch.float32)
    source[0, :4] = torch.tensor([float("inf"), -0.0, 1e-40, 7e4])
    meta = ChunkShardingSpec(0, ["rank:0/cpu", "rank:1/cpu"]).build_metadata(
        torch.Size([64, 6]), TensorProperties(dtype=torch.float32)
    )
    summary = TensorSummary("t", 3, meta, "READY", 64 * 6 * 4, 0.0)
    part = Box((2, 1), (29, 4))  # inside shard 0 (rows 0-31)
    largest, lock = [0], threading.Lock()

    def read_box(address: str, request, dest: torch.Tensor, cancel) -> None:  # noqa: ANN001
        box = Box(tuple(request.offsets), tuple(request.sizes))
        with lock:
            largest[0] = max(largest[0], dest.numel())
        dest.copy_(
            local_view(source, Box((0, 0), (64, 6)), box).contiguous().view(-1).view(torch.uint8)
        )

    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        out = torch.full((6, 64), -1.0, dtype=dtype).t()  # strided output, region of the part
        region = local_view(out, Box((0, 0), (64, 6)), part)
        read_cast_part(
            read_box, "rank0", PartRead(summary, 0, part, region, only_part), band_bytes=64
        )
        expected = local_view(source, Box((0, 0), (64, 6)), part).to(dtype)
        assert torch.equal(
            region.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
        )
        assert largest[0] <= 64  # no staging buffer beyond one band
        assert (out[:2] == -1).all() and (out[31:] == -1).all()
