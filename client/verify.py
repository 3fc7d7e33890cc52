"""Verified reads: the bytes a read put in `out` checked against the checksums of the shards they came from.

After a read with verify=True, every part (a shard's share of the box) is hashed where it landed
(shardserve.core.checksums, xxh3-64) and compared with its shard's checksum from the tensor's metadata. A part
that is its whole shard, copied from mapped memory into a contiguous CPU region of its dtype, was hashed as it
was copied, chunk by chunk while in cache (client.paths.shm, the read's `landed` checksums); other whole-shard
parts (network paths, casts, strided or CUDA regions) are hashed after the copy, in parallel. A part that covers
only some of its shard cannot be hashed alone (a shard's checksum is over all its bytes): the whole shard is
read into a scratch tensor, hashed, and the part compared with its place in it. A part that does not match is read
again from another copy of its box (a replica on another rank) and checked against that copy's checksum; when
no copy matches, ChecksumMismatchError (DATA_LOSS, CHECKSUM_MISMATCH) names the tensor, the shard and the rank
of the first copy. Shards whose checksum is not known (versions made before checksums) are not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from shardserve.client.errors import ChecksumMismatchError
from shardserve.client.info import TensorSummary
from shardserve.core.checksums import UNKNOWN, checksum_text, hashing_pool, tensor_checksum
from shardserve.core.metadata import Box
from shardserve.core.regions import local_view

# read_part(shard index, part, part's box of `into`, into): read `part` of that shard's copy into `into`
ReadPart = Callable[[int, Box, Box, torch.Tensor], None]
OtherCopies = Callable[[int], list[int]]


def expected_checksum(summary: TensorSummary, index: int) -> int:
    """Shard `index`'s checksum in `summary` (UNKNOWN when the catalog has none)."""
    return summary.checksums[index] if index < len(summary.checksums) else UNKNOWN


def verify_parts(
    summary: TensorSummary,
    parts: Sequence[tuple[int, Box]],
    box: Box,
    out: torch.Tensor,
    *,
    read_part: ReadPart,
    other_copies: OtherCopies,
    landed: Mapping[int, int] | None = None,
) -> int:
    """Check every (shard index, part) that a read of `box` put in `out`; a part that does not match is read
    again from another copy (`other_copies(index)`, through `read_part`) and checked. `landed`: the checksums
    of whole shards already hashed as they landed in `out`, by shard index (not hashed again). Returns the parts
    checked; raises ChecksumMismatchError when a part's every copy fails."""
    landed = landed or {}
    checked = [
        (index, part) for index, part in parts if expected_checksum(summary, index) != UNKNOWN
    ]
    pool = hashing_pool()
    # whole shards are hashed on the pool; a part of a shard reads the rest on this thread (reads may use
    # the caller's pools, which a pool thread must not wait on)
    hashed = {
        index: pool.submit(tensor_checksum, local_view(out, box, part))
        for index, part in checked
        if part == summary.metadata.shards_metadata[index].box and index not in landed
    }
    for index, part in checked:
        if index in landed:
            good = landed[index] == expected_checksum(summary, index)
        elif index in hashed:
            good = hashed[index].result() == expected_checksum(summary, index)
        else:
            good = _matches(summary, index, part, box, out, read_part)
        if good:
            continue
        for other in other_copies(index):
            read_part(other, part, box, out)
            if _matches(summary, other, part, box, out, read_part):
                break
        else:
            raise _mismatch(summary, index)
    return len(checked)


def _matches(
    summary: TensorSummary, index: int, part: Box, box: Box, out: torch.Tensor, read_part: ReadPart
) -> bool:
    """Whether `part` of `out` holds what shard `index`'s checksum says."""
    shard_box = summary.metadata.shards_metadata[index].box
    landed = local_view(out, box, part)
    if part == shard_box:
        return tensor_checksum(landed) == expected_checksum(summary, index)
    whole = torch.empty(shard_box.sizes, dtype=summary.metadata.dtype)
    read_part(index, shard_box, shard_box, whole)
    if tensor_checksum(whole) != expected_checksum(summary, index):
        return False
    return torch.equal(local_view(whole, shard_box, part), landed.to("cpu"))


def _mismatch(summary: TensorSummary, index: int) -> ChecksumMismatchError:
    rank = summary.metadata.shards_metadata[index].rank
    return ChecksumMismatchError(
        f"tensor {summary.name!r} version {summary.version}: shard {index} read from rank {rank} does not "
        f"match its checksum {checksum_text(expected_checksum(summary, index))}, nor does any other copy of "
        f"its box",
        metadata={"tensor": summary.name, "shard": str(index), "rank": str(rank)},
    )
