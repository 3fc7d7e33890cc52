"""Copy-on-write blocks: CPU shard versions in shared memory that share the blocks an update did not change.

A shard's bytes are cut into fixed-size blocks of BLOCK_BYTES. A version made
by a row update (CreateTensor INIT_COPY) does not copy its source: its shard is
a new range of this process's address space onto which every block of the
source is mapped (MAP_FIXED, read-only) from the memfd that holds it, once a
block of it is first written: until then (a delta snapshot's unchanged tensors,
always) its tensor lies over its source's memory. WriteRows then gives each
block it touches a fresh copy in a memfd of its own, mapped writable in place of
the shared one, and writes the rows there; the other blocks stay shared. So an
update costs the rows and blocks it touches, plus one mmap per run of blocks,
not a copy of the table. A served version's range is made read-only: a block
buffer is never written once a version that uses it is promoted. Same-host
clients map a version's blocks the same way (OpenShardResponse.extents,
client/paths/composed.py).

Every memfd is sealed against writes by other processes (F_SEAL_FUTURE_WRITE:
readers open them by /proc/PID/fd/N), which forbids punching holes, so memory
goes back a whole memfd at a time: a copied block, alone in its memfd, when no
version uses it; a shard's segment when none of its blocks is used. Once half a
segment is unused, the next version copies its remaining blocks out
(`Blocks.share`), so that it goes with the versions still sharing it. A memfd
no version uses is first kept a while for the next copies of its size
(`Blocks.spare`): the rank writes it again through the writable mapping it made
before the seal, moved into the new version's range (AddressRange.move_in).

Why 256 KiB: an update of k random rows copies at most k blocks (64 rows: 16
MiB at most, ~3 ms), while a version of a 1 GiB shard is 4096 blocks, so mapping
a fresh version (on the rank and in each same-host reader) costs at most 4096
mmap calls (a few ms); smaller blocks copy less but map more, larger ones the
reverse. A multiple of the page size, as mmap needs.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field

import torch

from shardserve.core.address_space import PAGE, AddressRange, round_up
from shardserve.server.rank.block_files import (
    BLOCK_BYTES,
    Block,
    BlockFile,
    copy_block,
    segment_writer,
)
from shardserve.server.rank.recycling import Buffer, RecycledBuffers
from shardserve.server.rank.shared_memory import HEADER_BYTES, Segment

RUN_BLOCKS = 8  # back-to-back blocks copied at once that share one file (2 MiB and more)


@dataclass
class BlockTable:
    """The blocks of one shard tensor, in order; `space` is None for a segment adopted as it is, and for a whole
    copy not mapped yet (`lazy`)."""

    blocks: list[Block]
    space: AddressRange | None = None
    owned: set[int] = field(
        default_factory=set
    )  # blocks written by this pending version (mapped writable)
    # the tensor this one is a whole copy of (every block its), until a block is copied for a write
    copy_of: weakref.ref[torch.Tensor] | None = None
    # a whole copy whose tensor still lies over its source's memory: it gets a range of its own (`space`) when a
    # block is first copied for a write
    lazy: bool = False

    @property
    def composed(self) -> bool:
        """Whether the table is a version's own (a range over shared blocks, or a whole copy not mapped yet)."""
        return self.space is not None or self.lazy


@dataclass(frozen=True)
class Extent:
    """A run of a composed shard's bytes: `nbytes` of file (fd, inode, device_id) from `offset`."""

    fd: int
    inode: int
    device_id: int
    offset: int
    nbytes: int


class Blocks:
    """The block tables of this rank's shard tensors (by id of the tensor, while it lives). Copied blocks get a
    memfd each while fewer than `max_files` are open; past that, the blocks copied at once share one memfd (freed
    when none of them is used), so that block files never take the fds the rank's sockets need.

    A file of copies no version uses any more is kept in `spare` (bounded in bytes and age, as freed shard
    buffers are: server/rank/recycling.py) and taken again for copies of the same size: first-touching fresh
    pages costs several times the copy (a delta put's changed 16 MiB: ~60 ms into a fresh memfd on a VM, ~3 ms
    into a kept one). Same-host readers of the versions that used it check those versions' state words, set
    DROPPED before the file is let go of, around every read (server/rank/shared_memory.py)."""

    def __init__(self, max_files: int = 1 << 20, spare: RecycledBuffers | None = None) -> None:
        self._tables: dict[int, BlockTable] = {}
        self._lock = threading.RLock()
        self.max_files = max_files
        self.open_files = 0
        self.spare = spare if spare is not None else RecycledBuffers()

    def _copy(
        self,
        blocks: list[Block],
        flat: torch.Tensor,
        indexes: list[int],
        *,
        overwritten: frozenset[int] = frozenset(),
    ) -> list[Block]:
        """Copies of `blocks` (at block `indexes` of `flat`, their mapped bytes), not sealed yet, each used by one
        version: a run of at least RUN_BLOCKS back-to-back blocks in one new memfd (mapped with one call, freed
        whole), every other block in a memfd of its own, and all of them in one when the rank has `max_files`
        open already. Blocks at `overwritten` indexes are not copied (the caller writes every byte of them)."""
        slots = [round_up(b.nbytes, PAGE) for b in blocks]
        out: list[Block] = []
        for group in self._file_groups(indexes):
            nbytes = sum(slots[i] for i in group)
            file = self._new_file(nbytes)
            # its pages mapped now: they move into the version with the window
            if file.writer is not None:
                file.writer.populate(file.start, nbytes)
            at = file.start
            for i in group:
                block, k = blocks[i], indexes[i]
                if k not in overwritten:
                    copy_block(
                        block, file, at, flat[k * BLOCK_BYTES : k * BLOCK_BYTES + block.nbytes]
                    )
                file.refs[at] = 1
                out.append(Block(file, at, block.nbytes))
                at += slots[i]
        return out

    def _file_groups(self, indexes: list[int]) -> list[list[int]]:
        """Positions in `indexes` (ascending block indexes) cut into the groups that share one new file; spare
        files are let go of first when their fds are what the budget lacks."""
        if self.open_files + len(indexes) > self.max_files:
            self.spare.trim(0)
        if self.open_files + len(indexes) > self.max_files:
            return [list(range(len(indexes)))] if indexes else []
        groups: list[list[int]] = []
        for i, k in enumerate(indexes):
            if groups and indexes[groups[-1][-1]] == k - 1:
                groups[-1].append(i)
            else:
                groups.append([i])
        return [
            piece
            for group in groups
            for piece in ([group] if len(group) >= RUN_BLOCKS else [[i] for i in group])
        ]

    def _new_file(self, nbytes: int) -> BlockFile:
        """A file of `nbytes` for new copies: a spare one of that size, else a new memfd."""
        kept = self.spare.take(nbytes)
        if kept is not None:
            file: BlockFile = kept.segment
            file.reset()
            return file
        file = BlockFile.create(nbytes, on_close=self._closed)
        self.open_files += 1
        return file

    def _unref(self, block: Block) -> int:
        """One version less uses `block`; the bytes no version uses any more. A file none of whose blocks is used
        is kept as a spare when it can be written again, else closed."""
        file = block.file
        freed = file.unref(block.offset, block.nbytes)
        if freed:
            if file.writer is not None:  # it can be written again although its writes are sealed
                blocks = file.writer.tensor()[file.start : file.start + file.nbytes]
                self.spare.keep(Buffer(blocks, segment=file))
            else:
                file.close()
        return freed

    def _closed(self) -> None:
        self.open_files -= 1

    def table(self, tensor: torch.Tensor) -> BlockTable | None:
        with self._lock:
            return self._tables.get(id(tensor))

    def is_composed(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a composed version (its own address range over shared blocks, or a whole copy that
        will get one when first written)."""
        table = self.table(tensor)
        return table is not None and table.composed

    def share(
        self, source: torch.Tensor, segment: Segment | None
    ) -> tuple[torch.Tensor, int] | None:
        """A new tensor over the same blocks as `source` (a composed tensor, or a shard segment, which is adopted:
        cut into blocks; over `source`'s own memory while every block is shared, else a read-only range of its
        own) and the bytes it copied, or None when `source` is neither (the caller
        copies). Blocks of a segment half unused are copied into files of their own instead, so that the segment
        can go once the versions still sharing it do (its pages cannot be given back one block at a time): each
        block of it is copied at most once, after at least as many of its bytes were replaced by updates."""
        nbytes = source.numel() * source.element_size()
        if nbytes == 0:
            return None
        with self._lock:
            table = self._tables.get(id(source)) or self._adopt(source, segment)
            if table is None:
                return None
            files = {id(b.file): b.file for b in table.blocks}  # a few: runs of blocks share a file
            wasteful = {key for key, file in files.items() if file.wasteful()}
            moved = (
                [k for k, b in enumerate(table.blocks) if id(b.file) in wasteful]
                if wasteful
                else []
            )
            if not moved:
                return self._whole_copy(source, table), 0
            blocks = list(table.blocks)
            copies = self._copy(
                [blocks[k] for k in moved], source.view(-1).view(torch.uint8), moved
            )
            for k, copy in zip(moved, copies):
                blocks[k] = copy
            for block, old in zip(blocks, table.blocks):
                if block is old:
                    block.file.refs[block.offset] += 1
            for file in {id(c.file): c.file for c in copies}.values():
                file.seal_writes()
            space = _mapped(blocks, nbytes)
            tensor = space.tensor(nbytes).view(source.dtype).view(source.shape)
            self._track(tensor, BlockTable(blocks, space))
        return tensor, sum(b.nbytes for b, old in zip(blocks, table.blocks) if b is not old)

    def _whole_copy(self, source: torch.Tensor, table: BlockTable) -> torch.Tensor:
        """A copy sharing every block of `source` (whose `table` is known): a new tensor over the source's own
        memory, mapped into a range of its own only if a block of it is copied for a write (`make_own`). Most
        tensors of a delta snapshot never change: mapping each block run of each of them costs the rank more
        than the rest of the copy (address space reserved, one mmap per run, then an mprotect and an munmap)."""
        for block in table.blocks:
            block.file.refs[block.offset] += 1
        tensor = torch.empty(0, dtype=source.dtype).set_(
            source.untyped_storage(), source.storage_offset(), source.shape, source.stride()
        )
        self._track(tensor, BlockTable(list(table.blocks), copy_of=weakref.ref(source), lazy=True))
        return tensor

    def _adopt(self, source: torch.Tensor, segment: Segment | None) -> BlockTable | None:
        if segment is None or segment.data_offset != HEADER_BYTES:
            return None
        nbytes = segment.nbytes
        file = BlockFile(
            segment.fd, keep=source, nbytes=nbytes, writer=segment_writer(source, nbytes)
        )
        file.start = HEADER_BYTES
        blocks = [
            Block(file, HEADER_BYTES + start, min(BLOCK_BYTES, nbytes - start))
            for start in range(0, nbytes, BLOCK_BYTES)
        ]
        file.refs = {b.offset: 1 for b in blocks}
        table = BlockTable(blocks)
        self._track(source, table)
        return table

    def _track(self, tensor: torch.Tensor, table: BlockTable) -> None:
        self._tables[id(tensor)] = table
        weakref.finalize(tensor, self._untrack, id(tensor), table)

    def _untrack(self, key: int, table: BlockTable) -> None:
        with self._lock:
            if self._tables.get(key) is table:
                del self._tables[key]

    def make_own(self, tensor: torch.Tensor, byte_ranges: list[tuple[int, int]]) -> tuple[int, int]:
        """Give every block of composed `tensor` that byte ranges [start, stop) touch a copy of its own (mapped
        writable), so that the caller may write those bytes; returns (bytes of blocks newly copied, bytes of
        replaced blocks that no version uses any more)."""
        with self._lock:
            table = self._tables[id(tensor)]
            assert table.composed, "only composed tensors are written block by block"
            wanted = sorted(
                {
                    k
                    for start, stop in byte_ranges
                    if stop > start
                    for k in range(start // BLOCK_BYTES, (stop - 1) // BLOCK_BYTES + 1)
                }
                - table.owned
            )
            if not wanted:
                return 0, 0
            space = table.space or _take_own_range(tensor, table)
            table.copy_of = None
            copies = self._copy(
                [table.blocks[k] for k in wanted],
                tensor.view(-1).view(torch.uint8),
                wanted,
                overwritten=_covered(byte_ranges, table.blocks),
            )
            freed = 0
            for k, block in zip(wanted, copies):
                old = table.blocks[k]
                freed += self._unref(old)
                table.blocks[k] = block
                table.owned.add(k)
            for start, first, run_bytes in _spans(table.blocks, among=set(wanted)):
                _map_writable(space, start * BLOCK_BYTES, run_bytes, first)
            for file in {id(c.file): c.file for c in copies}.values():
                file.seal_writes()  # the rank writes the rows through the mappings just made
            return sum(b.nbytes for b in copies), freed

    def whole_copy_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor whose every block composed `tensor` shares (its bytes those bytes), while both live and no
        block of `tensor` was copied for a write; else None."""
        with self._lock:
            table = self._tables.get(id(tensor))
            return table.copy_of() if table is not None and table.copy_of is not None else None

    def shared_bytes(self, tensor: torch.Tensor) -> int:
        """The bytes of composed `tensor`'s blocks that other versions use too (0 for any other tensor)."""
        with self._lock:
            table = self._tables.get(id(tensor))
            if table is None or not table.composed:
                return 0
            return sum(b.nbytes for b in table.blocks if b.file.refs.get(b.offset, 0) > 1)

    def stable_views(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Composed `tensor`'s bytes in order, as flat uint8 views through the long-lived mappings of its block
        files (a segment's own mapping, a file of copies' writable one), or None when `tensor` is not composed
        or a file has no such mapping. Reading a version once through its own new range faults in every page
        of it afresh; these mappings keep their pages from one version to the next (512 MiB hashed: 60-100 ms
        through a new mapping, 20 ms through one faulted in before, on a 2-core VM)."""
        with self._lock:
            table = self._tables.get(id(tensor))
            if table is None or not table.composed:
                return None
            views = []
            for _, first, run_bytes in _spans(table.blocks):  # a run's blocks lie in one file
                writer = first.file.writer
                if writer is None:
                    return None
                views.append(writer.tensor()[first.offset : first.offset + run_bytes])
            return views

    def make_read_only(self, tensor: torch.Tensor) -> None:
        """Make a composed tensor read-only: it is served now and never written again."""
        with self._lock:
            table = self._tables.get(id(tensor))
            if table is not None and table.space is not None:
                table.space.protect_read_only()
                table.owned.clear()

    def release(self, tensor: torch.Tensor) -> int | None:
        """Let go of the blocks of a freed version's tensor: bytes freed (blocks no other version uses), or None
        when `tensor` has no block table (the caller frees or recycles it as a whole)."""
        with self._lock:
            table = self._tables.pop(id(tensor), None)
            if table is None:
                return None
            return sum(self._unref(b) for b in table.blocks)

    def resident_bytes(self) -> int:
        """Memory the block files of live tables hold now (their allocated pages, headers included)."""
        with self._lock:
            files = {
                id(b.file): b.file
                for t in self._tables.values()
                for b in t.blocks
                if b.file.fd >= 0
            }
            return sum(os.fstat(f.fd).st_blocks * 512 for f in files.values())

    def extents(self, tensor: torch.Tensor) -> list[Extent]:
        """The runs of files a composed tensor's bytes come from, in order (what a same-host client maps)."""
        with self._lock:
            table = self._tables[id(tensor)]
            return [
                Extent(
                    first.file.fd, first.file.inode, first.file.device_id, first.offset, run_bytes
                )
                for _, first, run_bytes in _spans(table.blocks)
            ]


def _mapped(blocks: list[Block], nbytes: int) -> AddressRange:
    """A new range of `nbytes` with every run of `blocks` mapped read-only in order."""
    space = AddressRange(nbytes)
    for start, first, run_bytes in _spans(blocks):
        space.place(start * BLOCK_BYTES, run_bytes, first.file.fd, first.offset, writable=False)
    return space


def _take_own_range(tensor: torch.Tensor, table: BlockTable) -> AddressRange:
    """Give a whole copy not mapped yet (`table.lazy`) a range of its own over its blocks, and move `tensor` onto
    it (the same tensor object: the version holds it, and its table is found by it); the range."""
    nbytes = tensor.numel() * tensor.element_size()
    space = table.space = _mapped(table.blocks, nbytes)
    table.lazy = False
    flat = space.tensor(nbytes).view(tensor.dtype)
    tensor.set_(flat.untyped_storage(), 0, tensor.shape, tensor.stride())
    return space


def _map_writable(space: AddressRange, offset: int, nbytes: int, first: Block) -> None:
    """Map `nbytes` of the file of block `first` (from its offset) writable at `offset` of `space`: a window of the
    file's own writable mapping moved in, as a spare file's writes are sealed; a new mapping where the kernel
    cannot move one (the file is then always a new one). No page is populated: the caller's writes fault in only
    what they touch."""
    file = first.file
    if file.writer is not None:
        space.move_in(offset, nbytes, file.writer, first.offset)
    else:
        space.place(offset, nbytes, file.fd, first.offset, writable=True)


def _runs(blocks: list[Block], among: set[int] | None = None) -> list[tuple[int, int]]:
    """[start, stop) index runs of blocks that lie back to back in one file (mapped with one call); only of the
    blocks at indexes `among`, when given."""
    runs: list[tuple[int, int]] = []
    start = None
    for k in range(len(blocks) + 1):
        inside = k < len(blocks) and (among is None or k in among)
        joins = (
            inside
            and start is not None
            and blocks[k].file is blocks[k - 1].file
            and blocks[k].offset == blocks[k - 1].offset + BLOCK_BYTES
            and blocks[k - 1].nbytes == BLOCK_BYTES
        )
        if start is not None and not joins:
            runs.append((start, k))
            start = None
        if inside and start is None:
            start = k
    return runs


def _spans(blocks: list[Block], among: set[int] | None = None) -> list[tuple[int, Block, int]]:
    """The runs of `_runs` as (index of the first block, that block, bytes of the run): where each run is mapped
    from (its blocks lie back to back in the first one's file)."""
    return [
        (start, blocks[start], sum(b.nbytes for b in blocks[start:stop]))
        for start, stop in _runs(blocks, among)
    ]


def _covered(byte_ranges: list[tuple[int, int]], blocks: list[Block]) -> frozenset[int]:
    """Indexes of the blocks whose every byte the (possibly overlapping) `byte_ranges` cover."""
    unions: list[list[int]] = []
    for start, stop in sorted(r for r in byte_ranges if r[1] > r[0]):
        if unions and start <= unions[-1][1]:
            unions[-1][1] = max(unions[-1][1], stop)
        else:
            unions.append([start, stop])
    covered: set[int] = set()
    for start, stop in unions:
        k = -(-start // BLOCK_BYTES)
        while k < len(blocks) and k * BLOCK_BYTES + blocks[k].nbytes <= stop:
            covered.add(k)
            k += 1
    return frozenset(covered)
