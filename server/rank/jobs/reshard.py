"""The "reshard" collective job kind: this rank's part of a ReshardPlan, moved over torch.distributed.

- `run_reshard_job`: the job kind; stages the new version's shards in the store.
- `run_reshard`: peer-to-peer `batch_isend_irecv` of flat buckets and local
  copies, into newly allocated destination shards. The local copies need no
  peer, so they run right after the first rounds are posted, overlapping the
  wire (the order in which collectives are entered is unchanged by this).
  Its rounds are planned in reshard_rounds.py and run in reshard_exchange.py.

Deadlock-free ordering. The buckets of one (src_rank, dst_rank) pair keep the
plan's order; bucket k of every pair belongs to *round* k. Both ends of a
bucket compute the same round from the same plan. A rank walks its rounds in
increasing order and, per round, posts every send and receive of that round
(receives first; CUDA buckets in one `batch_isend_irecv`, i.e. one NCCL group;
gloo buckets each as soon as it is packed), using the round as the tag. It
keeps at most `max_in_flight` rounds posted: before posting round k it waits
for round k - max_in_flight. By induction on k every op of round k is posted by
both ends (posting never blocks, waiting only ever targets earlier rounds whose
ops are posted), so no cycle of waits can form. Only the two ends of a bucket
take part in it: ranks outside the plan run nothing, and there is no barrier or
all-ranks collective.

Memory. Besides the new shards, a rank holds staging buffers only for the
buckets in flight: at most `max_in_flight` (default 2) per peer and direction,
each the size of the rank's largest bucket (<= bucket_bytes), taken from a
pool and reused round after round (no fresh pages per round), all dropped when
the call returns. A bucket made of one box that is contiguous in its shard is
sent from, or received into, the shard itself without a staging buffer.
`ReshardStats` counts the bytes of the new shards and the peak staging bytes.

Bounded failure. Every wait is bounded by the call's deadline (`timeout_s`
from the start of the call). Waits run on a shared pool of waiter threads, all
at once, so the first failing peer is the one reported: a peer that died fails its pending ops at
once (gloo sees the closed connection), a hung one is named when the deadline
passes. Either way `run_reshard` raises `ReshardError` naming the peer ranks
and the caller's store is untouched: the new shards exist only in the returned
dict. After a ReshardError the process group may hold abandoned operations with
those peers; the caller must not use it again (the job service ends the
group's epoch, rank/jobs/groups.py).

The group. Data moves over a `PeerGroup`: the job's process group of its
epoch and participants, formed directly over the coordinator's store and
unknown to c10d, so operations are its own `send` / `recv` with the peer's
index in the group. In-process callers that made a default world pass none.

CUDA. Buckets whose both ends are CUDA shards travel as CUDA tensors, so the
group's NCCL backend moves them without host staging; a bucket
with a CPU end travels through host memory with gloo. A CUDA wait is bounded by
polling an event recorded after the NCCL work; the GPU side of a hung NCCL
operation is left to the process group's own timeout/watchdog, and the
communicator is aborted when the group's epoch ends.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from shardserve.core.executor import copy_box
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.planner import DEFAULT_BUCKET_BYTES, RankPlan, ReshardPlan, plan_reshard
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.requests import check_name, check_version, parse_metadata
from shardserve.server.rank.errors import InvalidArgument
from shardserve.server.rank.jobs.arguments import non_negative_int, positive_seconds
from shardserve.server.rank.jobs.context import JobContext
from shardserve.server.rank.jobs.groups import PeerGroup
from shardserve.server.rank.jobs.peer_memory import enabled_by_env as peer_memory_enabled
from shardserve.server.rank.jobs.peer_memory import local_export
from shardserve.server.rank.jobs.reshard_exchange import (
    Exchange,
    ReshardError,
    ReshardStats,
    StagingPool,
    exchange,
    fresh_empty,
)
from shardserve.server.rank.jobs.reshard_rounds import plan_rounds
from shardserve.server.rank.jobs.same_host import (
    PeerMemory,
    copy_mapped,
    settle,
    split_part,
    swap_cuda_handles,
    swap_exports,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 2
# Test hook: "RANK:SECONDS:NAME[,...]" makes RANK sleep SECONDS before moving data in a reshard of NAME.
STALL_ENV = "SHARDSERVE_DEBUG_RESHARD_STALL"
# Test hook, the same format: RANK sleeps once it has mapped its same-host sources, before it copies from them.
MAPPED_STALL_ENV = "SHARDSERVE_DEBUG_MAPPED_COPY_STALL"


# ---------------------------------------------------------------------------------------------
# One rank's part of a reshard
# ---------------------------------------------------------------------------------------------


def run_reshard(
    plan: ReshardPlan,
    rank: int,
    src_shards: Mapping[int, torch.Tensor],
    timeout_s: float,
    *,
    group: PeerGroup | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    stats: ReshardStats | None = None,
    out: Mapping[int, torch.Tensor] | None = None,
    peer_memory: PeerMemory | None = None,
) -> dict[int, torch.Tensor]:
    """Run `rank`'s part of `plan`: the new shards on this rank, by dst shard index.

    `src_shards` maps the source shard indices held by this rank
    (plan.src.shards_metadata order) to their tensors. Raises ReshardError naming
    the peers when a peer fails or does not answer within `timeout_s`. The new
    shards are allocated, except those given in `out` (by dst shard index), which
    are written in place: recycled buffers no reader can see (a failed reshard
    leaves them partly written) that share no memory with the source shards.
    `group` is the job's group of ranks (the default c10d world when None). With `peer_memory` (this rank's
    export of its source shards), buckets between ranks of one host are copied through each other's memory
    instead of the wire (server/rank/jobs/same_host.py).
    """
    if not isinstance(plan, ReshardPlan):
        raise TypeError(f"plan must be a ReshardPlan, got {type(plan).__name__}")
    rank = non_negative_int(rank, "rank")
    timeout_s = positive_seconds(timeout_s, "timeout_s")
    max_in_flight = non_negative_int(max_in_flight, "max_in_flight")
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be >= 1")
    stats = stats if stats is not None else ReshardStats()
    deadline = time.monotonic() + timeout_s
    part = plan.for_rank(rank)
    _check_src_shards(plan, part, src_shards)
    out = _destination(plan, rank, stats, out, src_shards)
    wire = partial(
        _exchange_wire,
        plan,
        src_shards=src_shards,
        out=out,
        deadline=deadline,
        stats=stats,
        max_in_flight=max_in_flight,
    )
    if peer_memory is None or not part.peers:
        return wire(part, group=group)
    group = group or _world_group()
    exports = swap_exports(group, part.peers, peer_memory.export, deadline)
    split = split_part(part, peer_memory.export, exports)
    copied = False
    try:
        handles = swap_cuda_handles(group, split, src_shards, deadline)
        wire(
            split.wire,
            group=group,
            also_local=lambda: copy_mapped(
                plan,
                split,
                exports,
                out,
                handles=handles,
                stats=stats,
                after_mapping=peer_memory.after_mapping,
            ),
        )
        copied = True
    finally:
        settle(group, split, copied=copied, deadline=deadline)
    return out


def _exchange_wire(  # noqa: PLR0913 - the parts of one rank's exchange, passed on as they are
    plan: ReshardPlan,
    part: RankPlan,
    *,
    src_shards: Mapping[int, torch.Tensor],
    out: dict[int, torch.Tensor],
    group: PeerGroup | None,
    deadline: float,
    stats: ReshardStats,
    max_in_flight: int,
    also_local: Callable[[], None] = lambda: None,
) -> dict[int, torch.Tensor]:
    """The local copies of `part` (and `also_local`, copies that need no wire either) and its buckets over
    the group's rounds."""
    src_boxes = [s.box for s in plan.src.shards_metadata]
    dst_boxes = [s.box for s in plan.dst.shards_metadata]

    def copy_local() -> None:
        also_local()
        for t in part.local:
            copy_box(
                src_shards[t.src_shard],
                src_boxes[t.src_shard],
                out[t.dst_shard],
                dst_boxes[t.dst_shard],
                t.box,
            )
            stats.local_bytes += t.nbytes

    rounds = plan_rounds(part.rank, part.sends, part.recvs)
    stats.rounds = len(rounds)
    if not rounds:
        copy_local()
        return out
    group = group or _world_group()
    pool = StagingPool(max(op.bucket.nbytes for round_ in rounds for op in round_), stats)
    setup = Exchange(plan, src_shards, out, group, deadline, stats, pool)
    exchange(setup, rounds, max_in_flight=max_in_flight, copy_local=copy_local)
    return out


def _world_group() -> PeerGroup:
    """The default c10d world, for in-process callers that give no group."""
    if not dist.is_initialized():
        raise ReshardError(
            "the plan moves data between ranks but no process group was given and "
            "torch.distributed is not initialized"
        )
    return PeerGroup.world()


def _check_src_shards(
    plan: ReshardPlan, part: RankPlan, src_shards: Mapping[int, torch.Tensor]
) -> None:
    if not isinstance(src_shards, Mapping):
        raise TypeError(
            f"src_shards must be a mapping of shard index to tensor, got {type(src_shards).__name__}"
        )
    needed = {t.src_shard for t in part.local}
    needed.update(t.src_shard for b in part.sends for t in b.transfers)
    for index in sorted(needed):
        tensor = src_shards.get(index)
        if tensor is None:
            raise ValueError(
                f"src_shards has no tensor for source shard {index}, which this rank must send"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"src_shards[{index}] is a {type(tensor).__name__}, not a torch.Tensor")
        expected = plan.src.shards_metadata[index].shard_sizes
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"src_shards[{index}] has shape {tuple(tensor.shape)} but shard {index} "
                f"has sizes {expected}"
            )
        if tensor.dtype != plan.src.dtype:
            raise ValueError(
                f"src_shards[{index}] has dtype {tensor.dtype} but the tensor's dtype is "
                f"{plan.src.dtype}"
            )


def _destination(
    plan: ReshardPlan,
    rank: int,
    stats: ReshardStats,
    given: Mapping[int, torch.Tensor] | None,
    src_shards: Mapping[int, torch.Tensor],
) -> dict[int, torch.Tensor]:
    """This rank's destination shard tensors: the given ones (checked), the others newly allocated."""
    if given is not None and not isinstance(given, Mapping):
        raise TypeError(
            f"out must be a mapping of shard index to tensor, got {type(given).__name__}"
        )
    given = given or {}
    mine = plan.dst.shards_on(rank)
    stray = sorted(set(given) - set(mine))
    if stray:
        raise ValueError(
            f"out has tensors for shards {stray}, which are not destination shards of rank {rank}"
        )
    source_storage = {
        t.untyped_storage().data_ptr() for t in src_shards.values() if isinstance(t, torch.Tensor)
    }
    out = {}
    for index in mine:
        shard = plan.dst.shards_metadata[index]
        device = shard.device
        if index in given:
            out[index] = _checked_out(
                index, given[index], shard.shard_sizes, plan.dst.dtype, device, source_storage
            )
            continue
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"dst.shards_metadata[{index}] is placed on {device} but CUDA is not available"
            )
        out[index] = fresh_empty(shard.shard_sizes, plan.dst.dtype, device)
        stats.new_shard_bytes += out[index].numel() * out[index].element_size()
    return out


def _checked_out(
    index: int,
    tensor: Any,
    sizes: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    source_storage: set[int],
) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"out[{index}] is a {type(tensor).__name__}, not a torch.Tensor")
    if tuple(tensor.shape) != sizes or tensor.dtype != dtype:
        raise ValueError(
            f"out[{index}] is {tuple(tensor.shape)} {tensor.dtype} but shard {index} is {sizes} {dtype}"
        )
    if tensor.device != device:
        raise ValueError(
            f"out[{index}] is on {tensor.device} but shard {index} is placed on {device}"
        )
    if tensor.untyped_storage().data_ptr() in source_storage:
        raise ValueError(f"out[{index}] shares memory with a source shard")
    return tensor


# ---------------------------------------------------------------------------------------------
# The job kind
# ---------------------------------------------------------------------------------------------


def run_reshard_job(job: pb.CollectiveJob, ctx: JobContext) -> None:
    """Stage this rank's new shards of a reshard as the reserved pending dst_version.

    Every rank builds the same plan (plan_reshard is deterministic), joins the
    job's process group (every participant does, so none waits for another),
    leases its source shards so they stay whole, runs run_reshard on the job's
    thread and installs the result; reads stay on the source version.
    """
    spec = job.reshard
    name = check_name(spec.name, "reshard.name")
    src_version = check_version(spec.src_version, "reshard.src_version")
    dst_version = check_version(spec.dst_version, "reshard.dst_version")
    src = parse_metadata(spec.src, "reshard.src")
    dst = parse_metadata(spec.dst, "reshard.dst")
    if spec.bucket_bytes < 0:
        raise InvalidArgument(f"reshard.bucket_bytes {spec.bucket_bytes} is negative")
    unavailable = _unavailable(spec, src)
    # the per-pair size the coordinator chose
    plan = plan_reshard(src, dst, spec.bucket_bytes or DEFAULT_BUCKET_BYTES, unavailable)
    outside = sorted(set(plan.participants(dst)) - set(job.ranks))
    if (
        outside
    ):  # they would never enter the exchange, and this rank would wait for them until its deadline
        raise InvalidArgument(
            f"ranks {list(job.ranks)} leaves out ranks {outside} that the reshard needs"
        )
    rank = ctx.rank
    if ctx.store.device.type == "cuda":
        torch.cuda.set_device(
            ctx.store.device
        )  # the current device is per thread; NCCL work goes to ours
    stats = ReshardStats()
    ctx.progress.bytes_total = sum(dst.shard_nbytes(i) for i in dst.shards_on(rank))
    ctx.live_bytes_done = lambda: stats.local_bytes + stats.received_bytes + stats.mapped_bytes
    group = ctx.peer_group()
    _debug_stall(STALL_ENV, rank, name)
    # freed versions' buffers of the right sizes (no first-touch page faults); not given back if this fails,
    # since a failed exchange may leave receives posted into them
    recycled = ctx.store.memory.recycled(dst, ctx.rank)
    given = _in_shard_memory(ctx, dst, recycled)
    src_local = [
        i for i in src.shards_on(rank) if i not in unavailable
    ]  # a restarted rank holds none
    with _leased_sources(ctx, name, src_version, src_local) as shards:
        lent = PeerMemory(
            local_export(shards, ctx.store.shared.segment_of),
            after_mapping=partial(_debug_stall, MAPPED_STALL_ENV, rank, name),
        )
        out = run_reshard(
            plan,
            rank,
            shards,
            ctx.time_left(),
            group=group,
            stats=stats,
            out=given,
            peer_memory=lent,
        )
    if dst.shards_on(rank):
        ctx.store.fill_reserved(name, dst_version, out)
    recycled_bytes = sum(dst.shard_nbytes(i) for i in recycled)
    ctx.progress.new_shard_bytes = stats.new_shard_bytes + sum(dst.shard_nbytes(i) for i in given)
    ctx.progress.peak_staging_bytes = stats.peak_staging_bytes
    ctx.progress.mapped_bytes = stats.mapped_bytes
    ctx.progress.sent_bytes = stats.sent_bytes
    log.info(
        "rank %d staged %r version %d: %d bytes local, %d copied from same-host ranks, %d received, "
        "%d sent, peak staging %d bytes, %d of %d new-shard bytes in recycled buffers",
        rank,
        name,
        dst_version,
        stats.local_bytes,
        stats.mapped_bytes,
        stats.received_bytes,
        stats.sent_bytes,
        stats.peak_staging_bytes,
        recycled_bytes,
        ctx.progress.new_shard_bytes,
    )


def _unavailable(spec: pb.ReshardJob, src: ShardedTensorMetadata) -> frozenset[int]:
    """reshard.src_unavailable checked against the source layout."""
    for i, index in enumerate(spec.src_unavailable):
        if not 0 <= index < len(src.shards_metadata):
            raise InvalidArgument(
                f"reshard.src_unavailable[{i}] {index} is not a shard index of reshard.src "
                f"({len(src.shards_metadata)} shards)"
            )
    return frozenset(spec.src_unavailable)


def _in_shard_memory(
    ctx: JobContext, dst: ShardedTensorMetadata, recycled: dict[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """This rank's new shards of `dst`, each written whole by the reshard: the recycled buffers, and the others
    from the rank's shard memory (shared memory for CPU shards), where same-host readers and the next job's
    peers map them as they are (a shard built in private memory is copied into a segment when first mapped)."""
    given = dict(recycled)
    for i in dst.shards_on(ctx.rank):
        shard = dst.shards_metadata[i]
        if i not in given and shard.device.type == "cpu":
            given[i] = ctx.store.memory.empty(shard.shard_sizes, dst.dtype, overwrite=True)
    return given


@contextmanager
def _leased_sources(
    ctx: JobContext, name: str, version: int, indices: list[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """This rank's source shards `indices` of (name, version), leased while the block runs so they stay whole
    (for same-host peers that map them too); a CPU shard built outside shared memory is moved into it first
    when same-host peers may map it (server/rank/leases.py shared_segment)."""
    if not indices:
        yield {}
        return
    leases = ctx.store.leases
    with leases.lease(name, version) as entry:
        if peer_memory_enabled():
            for i in indices:
                leases.shared_segment(entry, i)
        yield {i: leases.shard_of(entry, i) for i in indices}


def _debug_stall(env: str, rank: int, name: str) -> None:
    """Sleep when `env` (STALL_ENV, MAPPED_STALL_ENV) names this rank and tensor: tests make a window in a
    reshard to kill a rank in."""
    for entry in filter(None, os.environ.get(env, "").split(",")):
        stall_rank, seconds, stall_name = entry.split(":", 2)
        if int(stall_rank) == rank and stall_name == name:
            log.warning("rank %d stalls %ss in the reshard of %r (%s)", rank, seconds, name, env)
            time.sleep(float(seconds))
