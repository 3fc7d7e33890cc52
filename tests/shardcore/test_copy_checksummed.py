"""copy_checksummed: a copy that hashes its bytes as they land, bit for bit the copy and exactly the xxh3-64 of
the bytes, whatever the length against the chunk size."""

from __future__ import annotations

import pytest
import torch
import xxhash

from shardserve.core import checksums
from shardserve.core.checksums import copy_checksummed, tensor_checksum

CHUNK = 4096


def _run(length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("length", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 7 * CHUNK + 13])
def test_the_copy_is_bit_for_bit_and_its_checksum_is_the_xxh3_of_its_bytes(
    monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    monkeypatch.setattr(checksums, "CHUNK_BYTES", CHUNK)
    source, target = _run(length, seed=length), torch.zeros(length, dtype=torch.uint8)
    digest = copy_checksummed(target, source)
    assert torch.equal(target, source)
    assert digest == xxhash.xxh3_64_intdigest(source.numpy().tobytes()) == tensor_checksum(source)


def test_a_changed_byte_changes_the_checksum() -> None:
    source = _run(3 * checksums.CHUNK_BYTES + 5, seed=2)
    target = torch.empty_like(source)
    before = copy_checksummed(target, source)
    source[checksums.CHUNK_BYTES + 7] ^= 1
    after = copy_checksummed(target, source)
    assert before != after == tensor_checksum(source) == tensor_checksum(target)


def test_only_flat_uint8_runs_of_one_length_are_taken() -> None:
    with pytest.raises(ValueError):
        copy_checksummed(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError):
        copy_checksummed(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))


def test_views_hash_as_the_concatenation_of_their_bytes() -> None:
    """A shard whose bytes lie in several mappings: its pieces in order hash as the whole would."""
    whole = torch.randint(0, 256, (3 * 100_003,), dtype=torch.uint8)
    pieces = [whole[:7], whole[7:7], whole[7:250_000], whole[250_000:]]
    assert checksums.views_checksum(pieces) == tensor_checksum(whole)
    assert checksums.views_checksum([]) == tensor_checksum(whole[:0])
    with pytest.raises(ValueError, match="flat uint8"):
        checksums.views_checksum([whole.view(3, -1)])
