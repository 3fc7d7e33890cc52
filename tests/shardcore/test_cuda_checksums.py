"""The checksum of a CUDA tensor, staged through pinned host memory run by run, is exactly the checksum of its
bytes on the host: every dtype, lengths around the run size, strided views, and bytes still being written on
the device's current stream when the hash begins."""

from __future__ import annotations

import pytest
import torch

from shardserve.core.checksums import (
    cuda_checksum,
    cuda_checksums,
    hashing_pool,
    shard_checksums,
    tensor_checksum,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.bool, torch.uint8, torch.int64, torch.bfloat16, torch.float32, torch.complex64]
STAGE = 4096  # small runs: many of them, and a last one cut short


def _host(dtype: torch.dtype, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(count)
    return torch.randint(
        0,
        256,
        (count * torch.empty(0, dtype=dtype).element_size(),),
        generator=generator,
        dtype=torch.uint8,
    ).view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 7, 4096, 4097, 3 * 4096 + 5])
def test_a_cuda_tensor_hashes_as_its_host_copy(dtype, count):
    host = _host(dtype, count)
    assert cuda_checksum(host.cuda(), stage_bytes=STAGE) == tensor_checksum(host)
    assert tensor_checksum(host.cuda()) == tensor_checksum(host)  # the default runs


def test_an_empty_and_a_strided_cuda_tensor():
    assert tensor_checksum(torch.empty(0, device="cuda")) == tensor_checksum(torch.empty(0))
    host = torch.randn(300, 70)
    view = host.cuda().t()[5:, 1::3]
    assert cuda_checksum(view, stage_bytes=STAGE) == tensor_checksum(
        host.t()[5:, 1::3].contiguous()
    )


def test_bytes_queued_on_the_current_stream_are_hashed_once_landed():
    host = _host(torch.uint8, 64 << 20).pin_memory()
    device = torch.zeros(host.shape, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(50_000_000)  # the copy below lands well after the hash could have started
    device.copy_(host, non_blocking=True)
    assert cuda_checksum(device) == tensor_checksum(host)


def test_shards_hashed_through_pinned_windows_match_their_host_copies():
    """Windows of several shards, a shard larger than a window (hashed alone), an empty shard, every dtype."""
    hosts = {i: _host(dtype, 1000 + 777 * i) for i, dtype in enumerate(DTYPES)}
    hosts[len(hosts)] = _host(torch.uint8, 3 * 4096)  # larger than the window below
    on_cuda = {i: t.cuda() for i, t in hosts.items()}
    found = cuda_checksums(on_cuda, hashing_pool(), window_bytes=2 * 4096)
    assert found == {i: tensor_checksum(t) for i, t in hosts.items()}


def test_shard_checksums_mixes_cpu_and_cuda_shards():
    hosts = {0: torch.randn(100, 3), 1: torch.randn(7), 2: torch.empty(0), 3: torch.randn(5, 5)}
    shards = {0: hosts[0], 1: hosts[1].cuda(), 2: hosts[2].cuda(), 3: hosts[3].cuda().t()}
    expected = {i: tensor_checksum(t) for i, t in hosts.items()}
    expected[3] = tensor_checksum(hosts[3].t().contiguous())
    assert shard_checksums(shards, hashing_pool()) == expected


def test_shards_of_many_versions_keyed_by_version_and_index_share_the_windows():
    """A promote of many one-shard versions hashes them in one call, keyed (version, shard index)."""
    hosts = {(version, 0): torch.randn(256 + version, 4) for version in range(9)}
    hosts[(9, 1)] = torch.randn(3)  # a CPU shard beside them
    shards = {key: t.cuda() if key != (9, 1) else t for key, t in hosts.items()}
    assert shard_checksums(shards, hashing_pool()) == {
        key: tensor_checksum(t) for key, t in hosts.items()
    }
