"""The rank side of DCP checkpoint loads and saves: two collective job kinds (see server/rank/jobs/service.py),
registered by the rank's ShardServer servicer.

Both run in the coordinator's job order, over the job's participants (every
rank of the cluster) made c10d's default world for the job's duration (DCP
needs a registered group, see rank/jobs/groups.py), and go through
server/rank/jobs/checkpoint_io.py, so each rank reads or writes only its own
shards, straight from or to the checkpoint directory:

- "checkpoint_load": read this rank's shards of every listed tensor (DCP
  reshards from whatever layout was saved) and put them into the versions the
  coordinator reserved (AllocateShards reserve_only); they stay PENDING until
  the coordinator promotes them all.
- "checkpoint_save": lease the served versions (so they stay whole while
  DCP writes) and save every listed tensor as one checkpoint; replicas are
  written once.
Every rank gets the same job, so checks that fail, fail on every rank alike.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import TypeVar

import torch

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import ServiceError
from shardserve.server.common.requests import check_name, check_version, parse_metadata
from shardserve.server.rank.errors import InvalidArgument, RankError
from shardserve.server.rank.jobs.context import JobContext

log = logging.getLogger(__name__)
T = TypeVar("T")


def _job_tensors(spec: pb.CheckpointJob, kind: str) -> list[tuple[str, int, ShardedTensorMetadata]]:
    if not spec.path:
        raise InvalidArgument(f"{kind}.path is empty")
    if not spec.tensors:
        raise InvalidArgument(f"{kind}.tensors is empty")
    out = []
    for i, tensor in enumerate(spec.tensors):
        field = f"{kind}.tensors[{i}]"
        out.append(
            (
                check_name(tensor.name, f"{field}.name"),
                check_version(tensor.version, f"{field}.version"),
                parse_metadata(tensor.metadata, f"{field}.metadata"),
            )
        )
    return out


def _local_bytes(tensors: list[tuple[str, int, ShardedTensorMetadata]], rank: int) -> int:
    return sum(meta.shard_nbytes(i) for _, _, meta in tensors for i in meta.shards_on(rank))


def _destinations(ctx: JobContext, meta: ShardedTensorMetadata) -> dict[int, torch.Tensor]:
    """Buffers for this rank's shards of `meta`, each written whole by the load: freed versions' buffers of the
    right sizes first (no first-touch page faults), then new shard memory from the store, which for CPU shards
    is shared memory, so a same-host reader maps the loaded shard as it is rather than a copy made on its
    first read."""
    buffers = ctx.store.memory.recycled(meta, ctx.rank)
    for i in meta.shards_on(ctx.rank):
        shard = meta.shards_metadata[i]
        if i not in buffers and shard.device == ctx.store.device:
            buffers[i] = ctx.store.memory.empty(shard.shard_sizes, meta.dtype, overwrite=True)
    return buffers


def _noting(problems: list[str], make: Callable[[], T], instead: T) -> T:
    """`make()`, or `instead` with the failure noted in `problems`: a rank must not fail alone before DCP's
    collectives (the others would wait in them), so its failure is raised on every rank in DCP's planning."""
    try:
        return make()
    except (RankError, ServiceError, RuntimeError, ValueError) as err:
        problems.append(f"rank failed before the checkpoint's collectives: {err}")
        return instead


def run_checkpoint_load(job: pb.CollectiveJob, ctx: JobContext) -> None:
    """Read this rank's shards of the job's tensors from the checkpoint into their reserved versions."""
    from shardserve.server.rank.jobs.checkpoint_io import (
        load_tensors,  # DCP costs ~0.8 s to import: only ranks that load pay it
    )

    tensors = _job_tensors(job.checkpoint_load, "checkpoint_load")
    ctx.progress.bytes_total = _local_bytes(tensors, ctx.rank)
    problems: list[str] = []
    into = {
        name: _noting(
            problems, functools.partial(_destinations, ctx, meta), dict[int, torch.Tensor]()
        )
        for name, _, meta in tensors
    }
    with ctx.default_world() as group:
        shards = load_tensors(
            job.checkpoint_load.path,
            {name: meta for name, _, meta in tensors},
            ctx.rank,
            group,
            into=into,
            problems=problems,
        )
    for name, version, meta in tensors:
        if meta.shards_on(ctx.rank):
            ctx.store.fill_reserved(
                name, version, {i: t.contiguous() for i, t in shards[name].items()}
            )
    ctx.progress.bytes_done = ctx.progress.bytes_total
    log.info(
        "rank %d loaded %s from %s (%d bytes)",
        ctx.rank,
        [t[0] for t in tensors],
        job.checkpoint_load.path,
        ctx.progress.bytes_total,
    )


def run_checkpoint_save(job: pb.CollectiveJob, ctx: JobContext) -> None:
    """Write this rank's shards of the job's served versions into one DCP checkpoint."""
    from shardserve.server.rank.jobs.checkpoint_io import (
        save_tensors,  # DCP costs ~0.8 s to import: only ranks that save pay it
    )

    tensors = _job_tensors(job.checkpoint_save, "checkpoint_save")
    ctx.progress.bytes_total = _local_bytes(tensors, ctx.rank)
    problems: list[str] = []
    with ExitStack() as leases:
        state: dict[str, tuple[ShardedTensorMetadata, dict[int, torch.Tensor]]] = {}

        def lease_shards(
            name: str, version: int, meta: ShardedTensorMetadata
        ) -> dict[int, torch.Tensor]:
            local = meta.shards_on(ctx.rank)
            if not local:
                return {}
            entry = leases.enter_context(ctx.store.leases.lease(name, version))
            return {i: ctx.store.leases.shard_of(entry, i) for i in local}

        for name, version, meta in tensors:
            shards = _noting(
                problems,
                functools.partial(lease_shards, name, version, meta),
                dict[int, torch.Tensor](),
            )
            state[name] = (meta, shards)
        with ctx.default_world() as group:
            save_tensors(job.checkpoint_save.path, state, group, problems=problems)
    ctx.progress.bytes_done = ctx.progress.bytes_total
    log.info(
        "rank %d saved %s to %s (%d bytes)",
        ctx.rank,
        [t[0] for t in tensors],
        job.checkpoint_save.path,
        ctx.progress.bytes_total,
    )
