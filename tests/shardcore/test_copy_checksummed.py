"""copy_checksummed: a copy that hashes its bytes as they land, bit for bit the copy and exactly the xxh3-64 of
the bytes, whatever the length, the chunking and whether helpers on a pool take part (or never get to run)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from shardserve.core import checksums
from shardserve.core.checksums import copy_checksummed, tensor_checksum

CHUNK = 4096


def _run(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 7 * CHUNK + 13])
@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_the_copy_is_bit_for_bit_and_its_checksum_is_the_xxh3_of_its_bytes(
    monkeypatch: pytest.MonkeyPatch, length: int, helpers: int
) -> None:
    monkeypatch.setattr(checksums, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(checksums.os, "cpu_count", lambda: helpers + 1)
    source, target = _run(length, seed=length), torch.zeros(length, dtype=torch.uint8)
    with ThreadPoolExecutor(max_workers=max(1, helpers)) as pool:
        digest = copy_checksummed(target, source, pool=pool if helpers else None)
    assert torch.equal(target, source)
    assert digest == xxhash.xxh3_64_intdigest(source.numpy().tobytes()) == tensor_checksum(source)


def test_a_busy_pool_leaves_every_chunk_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Helpers queued behind other work never hold the copy up: the calling thread copies what they have not
    taken, and a helper that starts after the copy ended finds nothing left to write."""
    monkeypatch.setattr(checksums, "CHUNK_BYTES", CHUNK)
    release = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(release.wait)
        source, target = _run(5 * CHUNK, seed=1), torch.zeros(5 * CHUNK, dtype=torch.uint8)
        digest = copy_checksummed(target, source, pool=pool)
        assert torch.equal(target, source)
        target.zero_()  # a late helper must not write again
        release.set()
    assert not target.any()
    assert digest == tensor_checksum(source)


def test_a_changed_byte_changes_the_checksum() -> None:
    source = _run(3 * (2 << 20) + 5, seed=2)
    target = torch.empty_like(source)
    with ThreadPoolExecutor(max_workers=2) as pool:
        before = copy_checksummed(target, source, pool=pool)
        source[(2 << 20) + 7] ^= 1
        after = copy_checksummed(target, source, pool=pool)
    assert before != after == tensor_checksum(source)


def test_only_flat_uint8_runs_of_one_length_are_taken() -> None:
    with pytest.raises(ValueError):
        copy_checksummed(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError):
        copy_checksummed(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))
