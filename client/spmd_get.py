"""spmd.get_state_dict: every rank of a job fills its local shards of a state dict in place from one snapshot.

Each rank describes its pieces (the boxes of its DTensors, ShardedTensors and wrappers; plain tensors whole),
job rank 0 finds the snapshot and every rank reads that one (client.spmd_reads; packed keys cut from their
packs, client.spmd_packs); a snapshot dropped while it is read is read again at the newest.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from shardserve.client import arguments
from shardserve.client.cluster import Cluster
from shardserve.client.collector import collector_paused
from shardserve.client.errors import InvalidArgumentError
from shardserve.client.ops.snapshots import SnapshotSummary, get_snapshot
from shardserve.client.spmd_group import JobGroup, SpmdError
from shardserve.client.spmd_packs import packed_read
from shardserve.client.spmd_pieces import Piece, distributed_types, local_pieces, split_tensors
from shardserve.client.spmd_reads import read_pieces
from shardserve.core.metadata import Box
from shardserve.core.state_tree import fill_state_dict

GET_ATTEMPTS = 3  # a get of the newest snapshot whose tensors were dropped meanwhile starts again at the newest


@collector_paused
def get_state_dict(
    cluster: Cluster,
    prefix: str,
    into: Mapping[str, Any],
    snapshot: int | None = None,
    group: Any = None,
    *,
    verify: bool = False,
) -> int:
    """Collective: fill every tensor of `into` in place from one snapshot of `prefix`; returns its number.

    Each DTensor / ShardedTensor / LocalShardsWrapper gets exactly its local boxes, plain tensors the whole
    tensor, whatever layout the snapshot was put with. A floating tensor of `into` of another floating dtype
    than the stored one is converted while copying (bit for bit `stored.to(dtype)`); any other dtype
    mismatch is INVALID_ARGUMENT naming the key. `snapshot` pins one kept snapshot; without it the newest
    is read (and, if it is dropped while being read, the newest again, up to GET_ATTEMPTS times). `verify`
    checks every byte read against the shards' checksums (fetch's verify: another copy is read where one does
    not match; ChecksumMismatchError when none does). The process's cyclic garbage collector is paused during
    the call (client/collector.py).
    """
    verify = arguments.flag(verify, "verify")
    job = JobGroup(group)
    arguments.tensor_name(prefix, "prefix")
    pinned = None if snapshot is None else arguments.count(snapshot, "snapshot", minimum=1)
    if not isinstance(into, Mapping):
        raise InvalidArgumentError(f"into must be a dict, got {type(into).__name__}")
    targets: dict[str, list[Piece]] = {}

    def describe() -> None:
        distributed = distributed_types()
        for key, value in split_tensors(into).tensors.items():
            targets[key] = (
                local_pieces(value, key, 0, 0)[1]
                if not isinstance(value, torch.Tensor) or isinstance(value, distributed)
                else [(Box.of_ints((0,) * value.dim(), tuple(value.shape)), value)]
            )

    job.all_done(describe, "describing the state dict")
    found: dict[int, SnapshotSummary] = {}  # job rank 0's answer, read again by no one there

    def find() -> int:
        summary = get_snapshot(cluster.session, prefix, pinned)
        found[summary.number] = summary
        return summary.number

    for attempt in range(1, GET_ATTEMPTS + 1):
        number = job.count_from_rank0(find, "finding the snapshot")

        def read() -> None:
            summary = (found.pop(number) if number in found else None) or get_snapshot(
                cluster.session, prefix, number
            )
            packed = packed_read(cluster.session, prefix, summary.skeleton, targets)
            try:
                read_pieces(cluster, summary, packed.plain, verify=verify)
                packed.unpack()
            finally:
                packed.done()
            if summary.skeleton and isinstance(into, MutableMapping):
                fill_state_dict(into, summary.skeleton)

        try:
            job.all_done(read, f"reading snapshot {number}")
            return number
        except SpmdError:
            if pinned is not None or attempt == GET_ATTEMPTS:
                raise
    raise AssertionError("unreachable")
