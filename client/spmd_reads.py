"""How one rank of an SPMD job reads its pieces of a snapshot (spmd.get_state_dict): small pieces batched per
server rank (ReadRegions), larger ones by themselves through the client's read paths, several at once; an
output of another floating dtype than the stored one is converted while copying (client.casts)."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from shardserve.client import counters
from shardserve.client.casts import check_read_cast
from shardserve.client.cluster import Cluster
from shardserve.client.errors import InvalidArgumentError, RankUnavailableError
from shardserve.client.info import TensorSummary
from shardserve.client.ops.snapshots import SnapshotSummary
from shardserve.client.paths.batch import filled_batches, read_batches, region_reads
from shardserve.client.paths.copies import PARALLEL_COPY_BYTES
from shardserve.client.paths.kinds import PartRead, PathKind
from shardserve.client.paths.shm import SharedMemoryPath
from shardserve.client.spmd_pieces import Piece
from shardserve.client.tensor import RemoteShardedTensor
from shardserve.core.metadata import Box
from shardserve.core.regions import intersect, local_view

# a piece to read: its tensor, its global box, where it lands
Read = tuple[RemoteShardedTensor, Box, torch.Tensor]

SMALL_PIECE_BYTES = (
    64 << 10
)  # pieces up to this size are read in per-rank batches, larger ones by themselves


def read_pieces(
    cluster: Cluster,
    summary: SnapshotSummary,
    targets: Mapping[str, list[Piece]],
    *,
    verify: bool = False,
) -> int:
    """Read every local piece of `targets` from the snapshot; returns bytes read. Small ones are batched per rank;
    larger ones held by same-host ranks are copied out of their mapped memory one after another on this thread;
    the largest, those no mapping serves, and with `verify` all of them (each then checked by itself), are fetched
    on the read pool: several at once, and those copied out of same-host memory one per core at a time."""
    proxies = {}
    for key in targets:
        if key not in summary.tensors:
            raise InvalidArgumentError(
                f"{key!r} is not in snapshot {summary.number} of {summary.prefix!r} "
                f"(it holds {len(summary.tensors)} tensors)"
            )
        proxies[key] = RemoteShardedTensor(cluster.session, cluster.lookups, summary.tensors[key])
    reads = [(proxies[key], box, out) for key, pieces in targets.items() for box, out in pieces]
    for key, pieces_of_key in targets.items():
        for _, out in pieces_of_key:
            check_read_cast(proxies[key].dtype, out.dtype, key)
    on_host = _MappedParts(cluster)
    small: list[Read] = []  # in ReadRegions batches
    in_turn: list[Read] = []  # copied out of mappings on this thread, one after another
    copies: list[Read] = []  # on the read pool, copied out of same-host memory one per core
    fetches: list[Read] = []  # on the read pool, fetched from other hosts or devices
    for read in reads:
        if read[1].is_empty():
            continue
        nbytes = _nbytes(read[2])
        if nbytes <= SMALL_PIECE_BYTES and not verify:
            small.append(read)
        elif nbytes <= PARALLEL_COPY_BYTES and not verify:
            in_turn.append(read)
        else:
            (copies if on_host.holds(read[0].summary, read[2]) else fetches).append(read)
    # what is read through a path of its own, not in a ReadRegions batch (with transport="shm": everything)
    own_path = in_turn + copies + fetches
    if cluster.session.paths.forced is PathKind.SHARED_MEMORY:
        own_path += small
    _open_shared_memory(cluster, [(proxy.summary, box) for proxy, box, _ in own_path])
    pool = cluster.session.read_pool
    done: list[futures.Future[Any]] = [
        pool.submit(proxy.fetch, box.offsets, box.sizes, out, verify=verify)
        for proxy, box, out in fetches
    ]
    done += _fetch_in_lanes(pool, copies, verify=verify)
    alone = _read_mapped(cluster, in_turn)
    alone += _read_batched(cluster, small, pool)
    done += [pool.submit(proxy.fetch, box.offsets, box.sizes, out) for proxy, box, out in alone]
    futures.wait(done)  # every read ended before any failure is raised: none writes `into` after
    for future in done:
        future.result()
    return sum(_nbytes(out) for _, _, out in reads)


def _open_shared_memory(cluster: Cluster, reads: Sequence[tuple[TensorSummary, Box]]) -> None:
    """Open the shards these reads will map from same-host ranks in one OpenShards call per rank, all ranks at
    once: a snapshot read right after its put would otherwise call each rank once per shard, the round trips
    costing more than the copies (the segments are mostly ones this client maps already). One copy per box is
    opened; what is not (other copies, failures) each read opens by itself."""
    session = cluster.session
    shm = _shared_memory(cluster)
    if shm is None:
        return
    by_address: dict[str, list[tuple[TensorSummary, int]]] = defaultdict(list)
    chosen: set[tuple[str, Box]] = set()
    for summary, box in reads:
        for index, shard in enumerate(summary.metadata.shards_metadata):
            if (summary.name, shard.box) in chosen or index in summary.unavailable:
                continue
            if shard.placement is None or shard.box.is_empty() or intersect(shard.box, box) is None:
                continue
            status = session.rank_status(shard.placement.rank())
            if shm.supports(status):
                chosen.add((summary.name, shard.box))
                by_address[status.address].append((summary, index))
    jobs = [
        session.read_pool.submit(shm.open_all, address, shards)
        for address, shards in by_address.items()
        if len(shards) > 1
    ]
    futures.wait(jobs)


def _shared_memory(cluster: Cluster) -> SharedMemoryPath | None:
    """The client's same-host path, when reads may take it (transport "auto" or "shm")."""
    session = cluster.session
    if session.paths.forced not in (None, PathKind.SHARED_MEMORY):
        return None
    shm = session.paths.path(PathKind.SHARED_MEMORY)
    return shm if isinstance(shm, SharedMemoryPath) else None


def _read_mapped(cluster: Cluster, pieces: Sequence[Read]) -> list[Read]:
    """Read the pieces whose every part a same-host rank holds in host memory, rank after rank on this thread
    (SharedMemoryPath.read_many); returns the others and those whose mapped read failed, to read by themselves."""
    mapped = _MappedParts(cluster)
    rest: set[int] = set()
    for piece, summary, parts, box, out in _plans(pieces, rest):
        if not mapped.take(piece, summary, parts, box, out):
            rest.add(piece)
    rest |= mapped.read()
    return [pieces[piece] for piece in sorted(rest)]


def _plans(
    pieces: Sequence[Read], unplanned: set[int]
) -> Iterator[tuple[int, TensorSummary, list[tuple[int, Box]], Box, torch.Tensor]]:
    """Each piece's read plan: its position, the summary, the part of each chosen shard copy, its box and where
    it lands. The positions of pieces with none (their copies lost or unreachable) go into `unplanned`: read
    by themselves, fetch refreshes, waits and fails over."""
    for piece, (proxy, box, out) in enumerate(pieces):
        try:
            summary, parts = proxy.read_plan(box, out)
        except RankUnavailableError:
            unplanned.add(piece)
            continue
        yield piece, summary, parts, box, out


def _fetch_in_lanes(
    pool: ThreadPoolExecutor,
    pieces: Sequence[Read],
    *,
    verify: bool,
) -> list[futures.Future[None]]:
    """Fetch `pieces` (copies out of same-host memory, bound by the cores, not by round trips) on one pool thread
    per core, each fetching its share one after another: more copies at once than cores only make them wait for
    one (and for the GIL) and evict each other's cache lines, a verified read's hashing most."""
    lanes = min(os.cpu_count() or 1, len(pieces))
    return [pool.submit(_fetch_each, pieces[lane::lanes], verify) for lane in range(lanes)]


def _fetch_each(pieces: Sequence[Read], verify: bool) -> None:
    for proxy, box, out in pieces:
        proxy.fetch(box.offsets, box.sizes, out, verify=verify)


class _MappedParts:
    """The parts of pieces that same-host ranks hold in host memory, by rank address, read through the client's
    same-host path (none when reads may not take it)."""

    def __init__(self, cluster: Cluster) -> None:
        self._session = cluster.session
        self._shm = _shared_memory(cluster)
        self._parts: dict[str, list[tuple[int, PartRead]]] = defaultdict(list)

    def take(
        self,
        piece: int,
        summary: TensorSummary,
        parts: Sequence[tuple[int, Box]],
        box: Box,
        out: torch.Tensor,
    ) -> bool:
        """Keep every part of `piece` (global `box`, landing in `out`) when this path reads them all."""
        addresses = [self._address(summary, index, out) for index, _ in parts]
        if None in addresses:
            return False
        for address, (index, part) in zip(addresses, parts):
            if not part.is_empty():
                read = PartRead(summary, index, part, local_view(out, box, part))
                self._parts[str(address)].append((piece, read))
        return True

    def read(self) -> set[int]:
        """Read every kept part, rank after rank; returns the pieces a part of which was not read."""
        failed: set[int] = set()
        for address, parts in self._parts.items():
            assert self._shm is not None
            missed = self._shm.read_many(address, [read for _, read in parts])
            failed |= {parts[position][0] for position in missed}
            read_bytes = sum(
                read.nbytes for position, (_, read) in enumerate(parts) if position not in missed
            )
            counters.count_read(str(PathKind.SHARED_MEMORY), read_bytes)
        return failed

    def holds(self, summary: TensorSummary, out: torch.Tensor) -> bool:
        """Whether this path reads every shard of the tensor into `out`."""
        return all(
            self._address(summary, index, out) is not None
            for index in range(len(summary.metadata.shards_metadata))
        )

    def _address(self, summary: TensorSummary, index: int, out: torch.Tensor) -> str | None:
        """The address of the rank of shard `index` when this path reads it into `out`: a host shard of a
        same-host rank, into host memory."""
        if self._shm is None or out.device.type != "cpu":
            return None
        try:
            status = self._session.rank_status(summary.metadata.shards_metadata[index].rank)
        except RankUnavailableError:  # not registered now: its read by itself waits and fails over
            return None
        if status.device != "cpu" or not self._shm.supports(status):
            return None
        return status.address


def _nbytes(out: torch.Tensor) -> int:
    return out.numel() * out.element_size()


def _read_batched(
    cluster: Cluster,
    small: Sequence[Read],
    pool: ThreadPoolExecutor,
) -> list[Read]:
    """Read the small pieces as one ReadRegions call per rank and batch (client.paths.batch), every batch at once;
    returns the pieces to read by themselves (with fetch's fallbacks): those whose copies are lost or whose batch's
    rank failed. With transport="shm" they are copied out of their mappings instead (_read_mapped)."""
    session = cluster.session
    if session.paths.forced is PathKind.SHARED_MEMORY:
        return _read_mapped(cluster, small)  # shared memory only, as the caller asked
    alone: set[int] = set()
    regions = (
        region
        for piece, summary, parts, box, out in _plans(small, alone)
        for region in region_reads(piece, summary, parts, box, out)
    )
    # each batch sent as soon as it is full: the ranks answer while the rest is planned
    alone |= read_batches(session.paths, session.rank_status, filled_batches(regions), pool.submit)
    return [small[piece] for piece in sorted(alone)]
