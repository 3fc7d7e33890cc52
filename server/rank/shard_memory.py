"""Where a rank's shard bytes come from and go back to, and what they cost.

New shards are taken from shared memory (CPU shards, same-host data plane; server/rank/shared_memory.py), from
a freed version's buffer when one fits (server/rank/recycling.py), or from the device; a version made by a row
update shares its source's copy-on-write blocks (server/rank/blocks.py). Every byte is accounted in the
MemoryBudget (server/rank/memory_budget.py): a version's own bytes while it is held, shared blocks while any
version uses them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.server.rank.blocks import Blocks
from shardserve.server.rank.memory_budget import MemoryBudget
from shardserve.server.rank.shared_memory import SharedMemory
from shardserve.server.rank.version_table import StoredVersion


class ShardMemory:
    """Allocation, sharing and reclaiming of one rank's shard tensors, accounted in its budget."""

    def __init__(
        self, device: torch.device, budget: MemoryBudget, shared: SharedMemory, blocks: Blocks
    ) -> None:
        self.device = device
        self.budget = budget
        self.shared = shared
        self.blocks = blocks

    def empty(
        self, sizes: tuple[int, ...], dtype: torch.dtype, overwrite: bool = False
    ) -> torch.Tensor:
        """The one allocation of shard memory: zero-filled (unless the caller will `overwrite` every byte), in
        shared memory for CPU shards when enabled, from a freed version's buffer when one fits (on a GPU too: a
        weight sync's writer and readers then find the CUDA memory they opened for the version before last)."""
        if self.device.type == "cpu":
            return self.shared.empty(tuple(sizes), dtype, overwrite=overwrite)
        kept = self.shared.recycled_empty(tuple(sizes), dtype, device=self.device)
        if kept is not None:
            return kept if overwrite else kept.zero_()
        return torch.zeros(sizes, dtype=dtype, device=self.device)

    def renewed(self, shard: torch.Tensor) -> torch.Tensor | None:
        """Fresh shared memory in place of a pending CPU shard's sealed segment, which a same-host writer cannot
        map (it never mapped it before the seal); None when `shard` is not such a segment or none can be made.
        The caller puts the result in the shard's place; the sealed buffer goes back to the system when the
        shard lets go of it, not to the recycled ones (the next allocation would hand it to the same writer).
        The bytes are the same: the budget is unchanged."""
        found = self.shared.writable_segment(shard)
        if found is None or not found[1] or self.blocks.table(shard) is not None:
            return None
        return self.shared.fresh(tuple(shard.shape), shard.dtype)

    def recycled(self, meta: ShardedTensorMetadata, rank: int) -> dict[int, torch.Tensor]:
        """Freed buffers for the local shards of `meta` that a caller will overwrite whole (a reshard's
        destination): one per shard for which a buffer of its size is kept; the others are left out."""
        if self.device.type != "cpu":
            return {}
        out = {}
        for i in meta.shards_on(rank):
            tensor = self.shared.recycled_empty(meta.shards_metadata[i].shard_sizes, meta.dtype)
            if tensor is not None:
                out[i] = tensor
        return out

    def trim_recycled(self, nbytes: int) -> None:
        """Let go of kept buffers and block files that a reservation of `nbytes` needs the room of (block files
        first: a whole shard buffer serves the next put of the same layout)."""
        room = self.budget.room(nbytes)
        spare = self.blocks.spare
        if spare.nbytes + self.shared.recycled.nbytes > room:
            spare.trim(max(0, room - self.shared.recycled.nbytes))
        if self.shared.recycled.nbytes > room:
            self.shared.recycled.trim(room)

    def expire_kept(self) -> None:
        """Let go of kept buffers and block files past their max age (the rank calls this while idle too)."""
        self.shared.recycled.expire()
        self.blocks.spare.expire()

    def kept_bytes(self) -> int:
        """Freed memory kept for reuse: shard buffers and block files."""
        return self.shared.recycled.nbytes + self.blocks.spare.nbytes

    def reclaim(self, record: StoredVersion) -> None:
        """Give back the memory of a freed version: its bytes, the blocks no other version uses, and its whole
        buffers kept for reuse, except those still handed to a same-host writer that never said it filled
        them (an aborted or reaped reservation): that writer may still copy into its mapping, so the buffer
        goes back to the system instead of becoming another version's memory."""
        self.budget.release(record.nbytes)
        whole = []
        for index, shard in record.shards.items():
            freed = self.blocks.release(shard)
            if freed is not None:
                self.budget.release(freed)
            elif index not in record.progress.in_place:
                whole.append(shard)
        self.shared.recycle(whole)
        record.shards.clear()

    def release_blocks(self, tensors: Iterable[torch.Tensor]) -> None:
        """Let go of the blocks of tensors that never became a version."""
        self.budget.release(sum(self.blocks.release(t) or 0 for t in tensors))

    def share_blocks(self, source: StoredVersion) -> dict[int, torch.Tensor]:
        """New tensors over the same blocks as the leased source's shards, for those in shared memory. A shard
        cut into blocks for the first time moves its bytes from the source's account to its blocks'; blocks
        copied out of a half-unused segment are accounted as they are made."""
        if not self.shared.enabled:
            return {}
        out = {}
        for i, shard in source.shards.items():
            adopted = self.blocks.table(shard) is None
            shared = self.blocks.share(shard, self.shared.segment_of(shard))
            if shared is None:
                continue
            out[i], copied = shared
            self.budget.add(copied)  # blocks of a half-unused segment, copied to let it go
            if adopted:
                source.nbytes -= shard.numel() * shard.element_size()
        return out

    def own_rows(self, shard: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Copy the blocks of composed `shard` that `rows` (dim 0; all rows when None) lie in, so that they may
        be written, accounting their memory."""
        if rows is None:
            rows = torch.arange(shard.shape[0] if shard.dim() else 1)
        row_bytes = shard[0].numel() * shard.element_size() if shard.dim() else shard.element_size()
        starts = (rows.to(torch.int64).unique() * row_bytes).tolist()
        added, freed = self.blocks.make_own(shard, [(start, start + row_bytes) for start in starts])
        self.budget.add(added - freed)

    def own_bytes(self, shard: torch.Tensor, byte_ranges: list[tuple[int, int]]) -> None:
        """Copy the blocks of composed `shard` that `byte_ranges` [start, stop) touch, so that they may be
        written, accounting their memory."""
        added, freed = self.blocks.make_own(shard, byte_ranges)
        self.budget.add(added - freed)

    def stable_views(self, shard: torch.Tensor) -> list[torch.Tensor] | None:
        """A composed shard's bytes through mappings that outlive its version (Blocks.stable_views): what its
        promote hashes, without faulting in the version's own new range; None for any other shard."""
        return self.blocks.stable_views(shard)

    def promote(self, record: StoredVersion) -> None:
        """The memory's part of promoting a version: the bytes each shard of a copy still shares with other
        versions noted (`record.shared`), its shards made read-only, and same-host readers told it is served (each
        segment labelled with the shard it now holds)."""
        for index, shard in record.shards.items():
            shared = self.blocks.shared_bytes(shard)
            if shared:
                record.shared[index] = shared
            self.blocks.make_read_only(shard)
        self.shared.label(record.name, record.version, record.shards)
        self.shared.mark(record.shards.values(), served=True)
        for index, shard in record.shards.items():
            copied = self.blocks.whole_copy_of(shard)
            if copied is not None:
                self.shared.announce_copy(copied, shard, record.name, record.version, index)
