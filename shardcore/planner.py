"""plan_reshard: which boxes move from which source shard to which destination shard.

Planning apart from execution, as in torch.distributed.tensor._redistribute:
the plan is a pure value; server/ executes it with collectives and
shardcore.executor.apply_plan executes it in memory.

The planner is not quadratic in the number of shards: source boxes are indexed
(shardcore/source_index.py) so that the work follows the number of transfers
produced (n + m for chunks on the same dim, not n * m); layouts that truly
intersect pairwise (rows against columns) produce n * m transfers by nature.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import operator
from collections import defaultdict
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass
from typing import NamedTuple

from shardserve.core.metadata import Box, ShardedTensorMetadata
from shardserve.core.regions import intersection
from shardserve.core.source_index import SourceIndex
from shardserve.core.validation import VALID

DEFAULT_BUCKET_BYTES = 64 << 20


class Transfer(NamedTuple):
    """Move the global box (offsets, sizes) from a source shard to a destination shard (a tuple: a plan of a
    1,000-shard reshard makes a thousand, and a frozen dataclass costs three times as much to make)."""

    src_shard: int
    dst_shard: int
    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    src_shard_offsets: tuple[int, ...] | None = None
    dst_shard_offsets: tuple[int, ...] | None = None

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)

    def src_local_offsets(self) -> tuple[int, ...]:
        """Where the box starts inside the source shard's local tensor."""
        return _relative(self.offsets, self.src_shard_offsets, "src_shard_offsets")

    def dst_local_offsets(self) -> tuple[int, ...]:
        """Where the box starts inside the destination shard's local tensor."""
        return _relative(self.offsets, self.dst_shard_offsets, "dst_shard_offsets")

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


def _relative(
    offsets: tuple[int, ...], origin: tuple[int, ...] | None, name: str
) -> tuple[int, ...]:
    if origin is None:
        raise ValueError(f"transfer has no {name}; build transfers with plan_reshard")
    return tuple(o - b for o, b in zip(offsets, origin))


@dataclass(frozen=True)
class Bucket:
    """Transfers between one (src_rank, dst_rank) pair sent together, at most bucket_bytes."""

    src_rank: int
    dst_rank: int
    transfers: tuple[Transfer, ...]
    nbytes: int


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a plan: its local copies, the buckets it sends and receives."""

    rank: int
    local: tuple[Transfer, ...]
    sends: tuple[Bucket, ...]
    recvs: tuple[Bucket, ...]

    @property
    def peers(self) -> tuple[int, ...]:
        """Sorted ranks this rank exchanges buckets with."""
        return tuple(sorted({b.dst_rank for b in self.sends} | {b.src_rank for b in self.recvs}))

    @property
    def is_empty(self) -> bool:
        return not (self.local or self.sends or self.recvs)


@dataclass(frozen=True)
class ReshardPlan:
    """Transfers (local copies first, then peer pairs in sorted order) and the peer buckets.

    Local transfers (src_rank == dst_rank) are not bucketed: they need no
    communication. `buckets` hold every remote transfer exactly once, in
    transfer order.
    """

    src: ShardedTensorMetadata
    dst: ShardedTensorMetadata
    transfers: tuple[Transfer, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    @property
    def nbytes_local(self) -> int:
        """Bytes copied inside a rank."""
        return sum(t.nbytes for t in self.transfers if t.is_local)

    @property
    def nbytes_remote(self) -> int:
        """Bytes sent between ranks."""
        return sum(t.nbytes for t in self.transfers if not t.is_local)

    @property
    def local_transfers(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.is_local)

    @property
    def remote_transfers(self) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if not t.is_local)

    def ranks(self) -> tuple[int, ...]:
        """Sorted ranks that take part in the plan (send, receive or copy)."""
        return tuple(
            sorted({t.src_rank for t in self.transfers} | {t.dst_rank for t in self.transfers})
        )

    def participants(self, dst: ShardedTensorMetadata) -> tuple[int, ...]:
        """Sorted ranks that run the reshard job: every holder of a destination shard (even an empty one, which
        it installs) and every rank the plan reads from."""
        return tuple(sorted(set(dst.ranks()) | {t.src_rank for t in self.transfers}))

    def for_rank(self, rank: int) -> RankPlan:
        """What `rank` copies locally, sends and receives, each in global plan order."""
        rank = operator.index(rank)
        return self._by_rank.get(rank) or RankPlan(rank, (), (), ())

    def rank_plans(self) -> dict[int, RankPlan]:
        """for_rank of every rank taking part, computed in one pass over the plan."""
        return dict(self._by_rank)

    @functools.cached_property
    def _by_rank(self) -> dict[int, RankPlan]:
        local: dict[int, list[Transfer]] = defaultdict(list)
        sends: dict[int, list[Bucket]] = defaultdict(list)
        recvs: dict[int, list[Bucket]] = defaultdict(list)
        for t in self.transfers:
            if t.is_local:
                local[t.dst_rank].append(t)
        for b in self.buckets:
            sends[b.src_rank].append(b)
            recvs[b.dst_rank].append(b)
        return {
            r: RankPlan(r, tuple(local[r]), tuple(sends[r]), tuple(recvs[r]))
            for r in sorted(set(local) | set(sends) | set(recvs))
        }


def _check_inputs(
    src: ShardedTensorMetadata, dst: ShardedTensorMetadata, bucket_bytes: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate the arguments; the rank of every src and dst shard."""
    for name, meta in (("src", src), ("dst", dst)):
        if not isinstance(meta, ShardedTensorMetadata):
            raise TypeError(f"{name} must be a ShardedTensorMetadata, got {type(meta).__name__}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(f"bucket_bytes must be an int, got {type(bucket_bytes).__name__}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if src.size != dst.size:
        raise ValueError(f"size differs: src.size={src.size} but dst.size={dst.size}")
    if src.dtype != dst.dtype:
        raise ValueError(
            f"tensor_properties.dtype differs: src has {src.dtype} but dst has {dst.dtype}"
        )
    return _shards_checked(src, "src"), _shards_checked(dst, "dst")


def _shards_checked(meta: ShardedTensorMetadata, name: str) -> tuple[int, ...]:
    """The rank of every shard of `meta`, each shard checked to lie within the tensor, once per layout object
    (a layout validate_metadata passed is not checked again: a coordinator validates what it is asked for)."""
    if not meta.knows(VALID):
        meta.kept("within_bounds", lambda: _check_bounds(meta, name))
    try:
        return meta.shard_ranks()
    except ValueError as err:
        raise ValueError(f"{name}.{err}") from None


def _check_bounds(meta: ShardedTensorMetadata, name: str) -> bool:
    for i, shard in enumerate(meta.shards_metadata):
        if len(shard.shard_offsets) != meta.ndim:
            raise ValueError(
                f"{name}.shards_metadata[{i}].shard_offsets has {len(shard.shard_offsets)} dims "
                f"but the tensor has {meta.ndim}"
            )
        for d, (o, s, n) in enumerate(zip(shard.shard_offsets, shard.shard_sizes, meta.size)):
            if o < 0 or s < 0 or o + s > n:
                raise ValueError(
                    f"{name}.shards_metadata[{i}] is outside the tensor in dim {d}: "
                    f"offset {o}, size {s}, tensor size {n}"
                )
    return True


def split_box(
    offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int, limit: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut a box into C-order pieces of at most `limit` bytes each.

    Cuts the outermost dim whose inner slices fit into `limit`; the dims
    before it are taken one index at a time. Only a box with a single element
    larger than `limit` yields a piece over the limit.
    """
    if math.prod(sizes) * itemsize <= limit or not sizes:
        return [(offsets, sizes)]
    ndim = len(sizes)
    inner = [itemsize] * (ndim + 1)
    for d in range(ndim - 1, -1, -1):
        inner[d] = inner[d + 1] * sizes[d]
    cut = next((d for d in range(ndim) if inner[d + 1] <= limit), ndim - 1)
    step = max(1, limit // inner[cut + 1])
    pieces = []
    for outer in itertools.product(*(range(s) for s in sizes[:cut])):
        head_off = tuple(o + i for o, i in zip(offsets, outer))
        for start in range(0, sizes[cut], step):
            length = min(step, sizes[cut] - start)
            pieces.append(
                (
                    head_off + (offsets[cut] + start,) + offsets[cut + 1 :],
                    (1,) * cut + (length,) + sizes[cut + 1 :],
                )
            )
    return pieces


def _choose_holder(
    holders: list[tuple[int, int]], dst_rank: int, load: dict[int, int]
) -> tuple[int, int]:
    """The holder on dst_rank if any, else the least-loaded source rank (first listed on ties); one pass, as
    it runs once per destination shard."""
    if len(holders) == 1:
        return holders[0]
    chosen, lowest = holders[0], load.get(holders[0][1], 0)
    for holder in holders:
        rank = holder[1]
        if rank == dst_rank:
            return holder
        held = load.get(rank, 0)
        if held < lowest:
            chosen, lowest = holder, held
    return chosen


def _order_key(t: Transfer) -> tuple:
    """Local copies first (by rank), then peer pairs in sorted order; inside a pair by box."""
    return (not t.is_local, t.src_rank, t.dst_rank, t.dst_shard, t.src_shard, t.offsets)


def _bucketize(transfers: Sequence[Transfer], bucket_bytes: int) -> tuple[Bucket, ...]:
    buckets: list[Bucket] = []
    for (src_rank, dst_rank), group in itertools.groupby(
        (t for t in transfers if not t.is_local), key=lambda t: (t.src_rank, t.dst_rank)
    ):
        current: list[Transfer] = []
        size = 0
        for t in group:
            if current and size + t.nbytes > bucket_bytes:
                buckets.append(Bucket(src_rank, dst_rank, tuple(current), size))
                current, size = [], 0
            current.append(t)
            size += t.nbytes
        if current:
            buckets.append(Bucket(src_rank, dst_rank, tuple(current), size))
    return tuple(buckets)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Hold off the cyclic GC while building many small objects (it would rescan the heap)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def plan_reshard(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    unavailable: Set[int] = frozenset(),
) -> ReshardPlan:
    """The transfers that turn layout `src` into layout `dst`, grouped per peer pair and bucketed.

    Every non-empty destination shard is covered exactly once by its
    transfers. A destination rank that holds the source box itself copies
    locally; otherwise remote reads are spread over the source replicas by
    bytes already assigned to each source rank. Remote transfers larger than
    `bucket_bytes` are cut (see `split_box`) so that no bucket exceeds it,
    unless a single element does. `src` must be a valid layout (shards
    disjoint apart from exact replicas); a src that leaves part of a
    destination shard uncovered raises ValueError. The src shards at indices `unavailable` (copies on dead
    ranks, or lost) are never read: a repair or a reshard of a degraded tensor reads their boxes from the
    other copies.
    """
    src_ranks, dst_ranks = _check_inputs(src, dst, bucket_bytes)
    with _gc_paused():
        return _plan(src, dst, bucket_bytes, src_ranks, dst_ranks, frozenset(unavailable))


def plan_reshard_per_round(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    round_bytes: int = DEFAULT_BUCKET_BYTES,
    unavailable: Set[int] = frozenset(),
) -> ReshardPlan:
    """plan_reshard with buckets cut so that one round (one bucket per peer and direction) stays within
    `round_bytes` on every rank: the busiest rank's (peer, direction) pairs share it.

    An executor that keeps two rounds in flight then stages at most two times `round_bytes` per rank,
    however many peers a rank has. Every rank computes the same plan from the same inputs (it equals
    plan_reshard(src, dst, its bucket_bytes)). Which copy each piece is read from does not depend on the bucket
    size, so it is decided once; only the cutting into buckets is done for the round's size.
    """
    src_ranks, dst_ranks = _check_inputs(src, dst, round_bytes)
    with _gc_paused():
        pieces = _assign(src, dst, src_ranks, dst_ranks, frozenset(unavailable))
        peers: dict[int, set[tuple[int, bool]]] = defaultdict(set)
        for piece in pieces:
            if piece.src_rank != piece.dst_rank and piece.numel:
                peers[piece.src_rank].add((piece.dst_rank, True))
                peers[piece.dst_rank].add((piece.src_rank, False))
        pairs = max((len(p) for p in peers.values()), default=1)
        bucket_bytes = round_bytes if pairs <= 1 else max(1, round_bytes // pairs)
        return _cut(src, dst, pieces, bucket_bytes)


class _Piece(NamedTuple):
    """The part of a destination shard read from one source copy, before it is cut into buckets (a tuple:
    made once per destination shard and copy, it must be cheap to make)."""

    src_shard: int
    dst_shard: int
    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    numel: int
    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]


def _plan(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    bucket_bytes: int,
    src_ranks: Sequence[int],
    dst_ranks: Sequence[int],
    unavailable: frozenset[int],
) -> ReshardPlan:
    """plan_reshard after validation."""
    return _cut(src, dst, _assign(src, dst, src_ranks, dst_ranks, unavailable), bucket_bytes)


def _assign(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    src_ranks: Sequence[int],
    dst_ranks: Sequence[int],
    unavailable: frozenset[int],
) -> list[_Piece]:
    """The piece of each destination shard each source copy gives (which copy: _choose_holder)."""
    itemsize = src.tensor_properties.itemsize
    index = SourceIndex(src, src_ranks, unavailable)
    load: dict[int, int] = {}
    pieces: list[_Piece] = []
    for j, shard in enumerate(dst.shards_metadata):
        d_off, d_size = shard.shard_offsets, shard.shard_sizes
        if 0 in d_size:
            continue
        dst_rank = dst_ranks[j]
        same = index.same(d_off, d_size)
        if (
            same is not None
        ):  # a source box itself (a move of whole shards, every repair): one piece
            src_shard, src_rank = _choose_holder(index.holders[same], dst_rank, load)
            numel = math.prod(d_size)
            if src_rank != dst_rank:
                load[src_rank] = load.get(src_rank, 0) + numel * itemsize
            pieces.append(
                _Piece(src_shard, j, src_rank, dst_rank, d_off, d_size, numel, d_off, d_off)
            )
            continue
        covered = 0
        for g in index.candidates(d_off, d_size):
            s_off, s_size = index.boxes[g]
            common = intersection(s_off, s_size, d_off, d_size)
            if common is None:
                continue
            src_shard, src_rank = _choose_holder(index.holders[g], dst_rank, load)
            numel = math.prod(common[1])
            covered += numel
            if src_rank != dst_rank:
                load[src_rank] = load.get(src_rank, 0) + numel * itemsize
            pieces.append(
                _Piece(src_shard, j, src_rank, dst_rank, common[0], common[1], numel, s_off, d_off)
            )
        if covered != math.prod(d_size):
            raise ValueError(
                f"src shards do not cover dst.shards_metadata[{j}] (offsets {d_off}, sizes {d_size}) "
                f"exactly once: {covered} of {math.prod(d_size)} elements found; src has gaps or overlaps"
            )
    return pieces


def _cut(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    pieces: list[_Piece],
    bucket_bytes: int,
) -> ReshardPlan:
    """The plan of `pieces`: remote ones split to at most `bucket_bytes`, ordered, and bucketed."""
    itemsize = src.tensor_properties.itemsize
    transfers: list[Transfer] = []
    for p in pieces:
        nbytes = p.numel * itemsize
        if p.src_rank == p.dst_rank or nbytes <= bucket_bytes:  # whole: most pieces of most plans
            boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...], int]] = (
                (p.offsets, p.sizes, nbytes),
            )
        else:
            boxes = [
                (offsets, sizes, math.prod(sizes) * itemsize)
                for offsets, sizes in split_box(p.offsets, p.sizes, itemsize, bucket_bytes)
            ]
        for offsets, sizes, size in boxes:
            transfers.append(
                Transfer(
                    p.src_shard,
                    p.dst_shard,
                    p.src_rank,
                    p.dst_rank,
                    offsets,
                    sizes,
                    size,
                    p.src_offsets,
                    p.dst_offsets,
                )
            )
    transfers.sort(key=_order_key)
    return ReshardPlan(
        src, dst, tuple(transfers), _bucketize(transfers, bucket_bytes), bucket_bytes
    )
