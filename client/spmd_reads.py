"""How one rank of an SPMD job reads its pieces of a snapshot (spmd.get_state_dict): small pieces batched per
server rank (ReadRegions), larger ones by themselves through the client's read paths, several at once; an
output of another floating dtype than the stored one is converted while copying (client.casts)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import torch

from shardserve.client.casts import check_read_cast
from shardserve.client.cluster import Cluster
from shardserve.client.errors import InvalidArgumentError, RankUnavailableError
from shardserve.client.info import TensorSummary
from shardserve.client.ops.snapshots import SnapshotSummary
from shardserve.client.paths.batch import batches, read_batch, region_reads
from shardserve.client.paths.kinds import PathKind
from shardserve.client.paths.shm import SharedMemoryPath
from shardserve.client.spmd_pieces import Piece
from shardserve.client.tensor import RemoteShardedTensor
from shardserve.core.metadata import Box
from shardserve.core.regions import intersect

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
    """Read every local piece of `targets` from the snapshot, small ones batched per rank (not with `verify`:
    each piece is then fetched and checked by itself), the others several at once; returns bytes read."""
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
    pieces = [read for read in reads if not read[1].is_empty()]
    small = [read for read in pieces if _nbytes(read[2]) <= SMALL_PIECE_BYTES and not verify]
    shm_only = cluster.session.paths.forced is PathKind.SHARED_MEMORY
    mapped = [  # what is read through a path of its own, not in a ReadRegions batch
        (summary.tensors[key], box)
        for key, pieces_of_key in targets.items()
        for box, out in pieces_of_key
        if not box.is_empty() and (shm_only or verify or _nbytes(out) > SMALL_PIECE_BYTES)
    ]
    _open_shared_memory(cluster, mapped)
    pool = cluster.session.read_pool
    done = [
        pool.submit(proxy.fetch, box.offsets, box.sizes, out, verify=verify)
        for proxy, box, out in pieces
        if _nbytes(out) > SMALL_PIECE_BYTES or verify
    ]
    alone = _read_batched(cluster, small, pool)
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
    if session.paths.forced not in (None, PathKind.SHARED_MEMORY):
        return
    shm = session.paths.path(PathKind.SHARED_MEMORY)
    if not isinstance(shm, SharedMemoryPath):
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


def _nbytes(out: torch.Tensor) -> int:
    return out.numel() * out.element_size()


def _read_batched(
    cluster: Cluster,
    small: Sequence[tuple[RemoteShardedTensor, Box, torch.Tensor]],
    pool: ThreadPoolExecutor,
) -> list[tuple[RemoteShardedTensor, Box, torch.Tensor]]:
    """Read the small pieces as one ReadRegions call per rank and batch (client.paths.batch), every batch at once;
    returns the pieces to read by themselves (with fetch's fallbacks): those whose copies are lost or whose batch's
    rank failed, or all of them with transport="shm"."""
    session = cluster.session
    if session.paths.forced is PathKind.SHARED_MEMORY:
        return list(small)  # shared memory only, as the caller asked: every piece by itself
    regions, alone = [], set()
    for piece, (proxy, box, out) in enumerate(small):
        try:
            summary, parts = proxy.read_plan(box, out)
        except (
            RankUnavailableError
        ):  # copies lost or unreachable: fetch refreshes, waits and fails over
            alone.add(piece)
            continue
        regions += region_reads(piece, summary, parts, box, out)
    jobs = [
        pool.submit(read_batch, session.paths, session.rank_status, batch)
        for batch in batches(regions)
    ]
    futures.wait(jobs)
    for job in jobs:
        alone |= job.result()
    return [small[piece] for piece in sorted(alone)]
