"""copy_tensor: the same-host paths' copy, bit for bit for every dtype, length and alignment, on the single
memcpy path and on torch's copy of whole words; copy_checked, the verified read's copy, bit for bit with the
xxh3-64 of what landed."""

from __future__ import annotations

import pytest
import torch

from shardserve.client.paths import copies
from shardserve.client.paths.copies import (
    copy_checked,
    copy_checked_all,
    copy_down_checked_all,
    copy_tensor,
    device_source,
    plain_source,
)
from shardserve.core.checksums import STAGE_BYTES, tensor_checksum
from shardserve.core.wire import byte_view, word_views

DTYPES = [torch.bool, torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.complex128]


@pytest.mark.parametrize("words", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 7, 4099])
def test_copies_every_dtype_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, words: bool, dtype: torch.dtype, count: int
) -> None:
    monkeypatch.setattr(copies, "PARALLEL_COPY_BYTES", 0 if words else 1 << 30)
    source = torch.randint(0, 255, (count * dtype.itemsize,), dtype=torch.uint8).view(dtype)
    target = torch.zeros_like(source)
    copy_tensor(target, source)
    assert torch.equal(byte_view(target), byte_view(source))


def test_word_views_take_the_widest_words_both_runs_allow() -> None:
    run = torch.zeros(64, dtype=torch.uint8)
    assert word_views(run[:16], run[16:32])[0].dtype == torch.int64
    assert word_views(run[:12], run[16:28])[0].dtype == torch.int32
    assert word_views(run[2:8], run[16:22])[0].dtype == torch.int16
    odd, other = word_views(run[1:8], run[16:23])
    assert odd.dtype == other.dtype == torch.uint8


def test_strided_and_differently_typed_sources_are_copied_by_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(copies, "PARALLEL_COPY_BYTES", 0)
    source = torch.arange(24, dtype=torch.float32).view(4, 6)
    target = torch.zeros(6, 4, dtype=torch.float64)
    copy_tensor(target, source.t())
    assert torch.equal(target, source.t().double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_checked_copy_is_bit_for_bit_and_returns_the_checksum_of_what_landed(
    dtype: torch.dtype,
) -> None:
    source = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)[
        : (3 << 20) // dtype.itemsize * dtype.itemsize
    ]
    source = source.view(dtype).view(-1, 1)
    target = torch.zeros_like(source)
    assert copy_checked(target, source) == tensor_checksum(source)
    assert torch.equal(byte_view(target), byte_view(source))


def test_a_checked_copy_leaves_casts_and_strided_regions_to_the_caller() -> None:
    source = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert copy_checked(torch.zeros(4, 6, dtype=torch.float64), source) is None
    strided = torch.zeros(6, 4).t()
    assert copy_checked(strided, source) is None
    assert not strided.any()  # nothing copied: the caller copies and hashes apart


def test_copy_checked_all_copies_and_hashes_every_run_across_the_pool():
    sizes = [
        1 << 20,
        3 << 20,
        5,
        0,
        2 << 20,
        6 << 20,
        17,
    ]  # groups of several runs, one run, odd lengths
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    sums = copy_checked_all(list(zip(targets, sources)))
    assert sums == [tensor_checksum(source) for source in sources]
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


def test_plain_source_is_only_a_cpu_run_of_the_stored_dtype():
    data = torch.randn(4, 6)
    assert torch.equal(plain_source(data, torch.float32), data.view(-1).view(torch.uint8))
    assert plain_source(data, torch.bfloat16) is None  # a cast
    assert plain_source(data.t(), torch.float32) is None  # strided


def test_device_source_is_only_a_cuda_run_of_the_stored_dtype():
    assert device_source(torch.randn(4, 6), torch.float32) is None  # CPU bytes: plain_source's
    if torch.cuda.is_available():
        data = torch.randn(4, 6, device="cuda")
        assert torch.equal(device_source(data, torch.float32), data.view(-1).view(torch.uint8))
        assert device_source(data, torch.bfloat16) is None  # a cast
        assert device_source(data.t(), torch.float32) is None  # strided


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pinned", [True, False])
def test_copy_down_checked_all_lands_every_byte_and_hashes_it(pinned):
    """Runs of several stages, one stage, odd lengths and none, into pinned and pageable host memory, from
    sources written on the current stream just before (the side stream must wait for them)."""
    sizes = [2 * STAGE_BYTES + 13, STAGE_BYTES, 5, 0, 3 << 20]
    expected = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    sources = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    for source, host in zip(sources, expected):
        source.copy_(host.pin_memory(), non_blocking=True)
    targets = [torch.zeros(n, dtype=torch.uint8, pin_memory=pinned) for n in sizes]
    sums = copy_down_checked_all(list(zip(targets, sources)))
    assert sums == [tensor_checksum(host) for host in expected]
    assert all(torch.equal(t, e) for t, e in zip(targets, expected))
