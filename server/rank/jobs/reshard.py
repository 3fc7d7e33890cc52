"""The "reshard" collective job kind: this rank's part of a ReshardPlan, moved over torch.distributed.

- `run_reshard_job`: the job kind; stages the new version's shards in the store.
- `run_reshard`: peer-to-peer `batch_isend_irecv` of flat buckets and local
  copies, into newly allocated destination shards. The local copies need no
  peer, so they run right after the first rounds are posted, overlapping the
  wire (the order in which collectives are entered is unchanged by this).

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

import concurrent.futures as cf
import ctypes
import functools
import itertools
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardserve.core.executor import copy_box, pack_bucket, unpack_bucket
from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.planner import DEFAULT_BUCKET_BYTES, Bucket, ReshardPlan, plan_reshard
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.errors import InvalidArgument
from shardserve.server.common.requests import check_name, check_version, parse_metadata
from shardserve.server.rank.jobs.arguments import non_negative_int, positive_seconds
from shardserve.server.rank.jobs.context import JobContext
from shardserve.server.rank.jobs.groups import P2P, PeerGroup

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_IN_FLIGHT = 2
_CUDA_POLL_S = 0.0005
_MAX_WAITERS = 256
_HUGE_PAGE = 2 << 20
# Test hook: "RANK:SECONDS:NAME[,...]" makes RANK sleep SECONDS before moving data in a reshard of NAME.
STALL_ENV = "SHARDSERVE_DEBUG_RESHARD_STALL"
_MADV_HUGEPAGE = 14


class ReshardError(RuntimeError):
    """A reshard failed on this rank; `peers` are the ranks that failed or did not answer in time."""

    def __init__(self, message: str, peers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.peers = tuple(peers)


@dataclass
class ReshardStats:
    """What one run_reshard call moved, and the staging memory it held at its peak."""

    local_bytes: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    buckets_sent: int = 0
    buckets_received: int = 0
    zero_copy_buckets: int = 0
    rounds: int = 0
    new_shard_bytes: int = 0
    staging_bytes: int = 0
    peak_staging_bytes: int = 0


class _StagingPool:
    """Staging buffers of one capacity, reused round after round so no round faults in fresh pages."""

    def __init__(self, capacity: int, stats: ReshardStats) -> None:
        self._capacity = capacity
        self._stats = stats
        self._free: dict[torch.device, list[torch.Tensor]] = {}

    def take(self, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pooled buffer, its first nbytes as the bucket's flat buffer)."""
        free = self._free.setdefault(device, [])
        if free:
            buffer = free.pop()
        else:
            buffer = fresh_empty((self._capacity,), torch.uint8, device)
            self._stats.staging_bytes += self._capacity
            self._stats.peak_staging_bytes = max(
                self._stats.peak_staging_bytes, self._stats.staging_bytes
            )
        return buffer, buffer[:nbytes]

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self._free[buffer.device].append(buffer)

    def close(self) -> None:
        """Drop every pooled buffer: run_reshard holds no staging memory once it returns."""
        self._stats.staging_bytes = 0
        self._free.clear()


# ---------------------------------------------------------------------------------------------
# One rank's part of a reshard
# ---------------------------------------------------------------------------------------------


@dataclass
class _Posted:
    """One posted round: its waits (future, peer, verb), the receives to unpack, the staging to give back."""

    round: int
    waits: list[tuple[cf.Future, int, str]]
    receives: list[tuple[Bucket, torch.Tensor]]
    staged: list[torch.Tensor]


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
) -> dict[int, torch.Tensor]:
    """Run `rank`'s part of `plan`: the new shards on this rank, by dst shard index.

    `src_shards` maps the source shard indices held by this rank
    (plan.src.shards_metadata order) to their tensors. Raises ReshardError naming
    the peers when a peer fails or does not answer within `timeout_s`. The new
    shards are allocated, except those given in `out` (by dst shard index), which
    are written in place: recycled buffers no reader can see (a failed reshard
    leaves them partly written) that share no memory with the source shards.
    `group` is the job's group of ranks (the default c10d world when None).
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
    src_boxes = [s.box for s in plan.src.shards_metadata]
    dst_boxes = [s.box for s in plan.dst.shards_metadata]

    def copy_local() -> None:
        for t in part.local:
            copy_box(
                src_shards[t.src_shard],
                src_boxes[t.src_shard],
                out[t.dst_shard],
                dst_boxes[t.dst_shard],
                t.box,
            )
            stats.local_bytes += t.nbytes

    rounds = _rounds(rank, part.sends, part.recvs)
    stats.rounds = len(rounds)
    if not rounds:
        copy_local()
        return out
    if group is None:
        if not dist.is_initialized():
            raise ReshardError(
                "the plan moves data between ranks but no process group was given and "
                "torch.distributed is not initialized"
            )
        group = PeerGroup.world()
    _exchange(plan, rounds, src_shards, out, group, max_in_flight, deadline, stats, copy_local)
    return out


def _check_src_shards(plan: ReshardPlan, part: Any, src_shards: Mapping[int, torch.Tensor]) -> None:
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


def fresh_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, with a large CPU tensor backed by transparent huge pages before its first touch.

    A reshard writes every byte of its new shards once; with 4 KiB pages the
    page faults cost several times the copy itself (copying 128 MiB: 83 ms into
    fresh 4 KiB pages, 23 ms into fresh 2 MiB pages, 16 ms into reused memory).
    Linux only, and only where THP is "madvise" or "always"; elsewhere this is
    plain torch.empty.
    """
    tensor = torch.empty(shape, dtype=dtype, device=device)
    nbytes = tensor.numel() * tensor.element_size()
    madvise = _libc_madvise()
    if madvise is not None and tensor.device.type == "cpu" and nbytes >= 2 * _HUGE_PAGE:
        start = (tensor.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        end = (tensor.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)
    return tensor


@functools.lru_cache(maxsize=1)
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _rounds(
    rank: int, sends: tuple[Bucket, ...], recvs: tuple[Bucket, ...]
) -> list[list[tuple[str, Bucket]]]:
    """Round k holds the k-th bucket of every peer pair this rank is an end of."""
    per_pair: dict[tuple[int, int], list[Bucket]] = {}
    for bucket in itertools.chain(sends, recvs):
        per_pair.setdefault((bucket.src_rank, bucket.dst_rank), []).append(bucket)
    rounds: list[list[tuple[str, Bucket]]] = []
    for _, buckets in sorted(per_pair.items()):
        for k, bucket in enumerate(buckets):
            while len(rounds) <= k:
                rounds.append([])
            rounds[k].append(("send" if bucket.src_rank == rank else "recv", bucket))
    return rounds


def _exchange(
    plan: ReshardPlan,
    rounds: list[list[tuple[str, Bucket]]],
    src_shards: Mapping[int, torch.Tensor],
    out: dict[int, torch.Tensor],
    group: PeerGroup,
    max_in_flight: int,
    deadline: float,
    stats: ReshardStats,
    copy_local: Callable[[], None],
) -> None:
    """Post the rounds with at most max_in_flight outstanding; unpack each round once it is done.

    The local copies run once the first rounds are posted, while their bytes are on the wire.
    """
    waiters = _waiter_threads()
    posted: deque[_Posted] = deque()
    pool = _StagingPool(max(bucket.nbytes for round_ in rounds for _, bucket in round_), stats)
    try:
        for k, round_ in enumerate(rounds):
            if len(posted) == max_in_flight:
                if k == max_in_flight:
                    copy_local()
                _finish(posted.popleft(), posted, out, deadline, pool)
            posted.append(
                _post(plan, k, round_, src_shards, out, group, waiters, deadline, stats, pool)
            )
        if len(rounds) <= max_in_flight:
            copy_local()
        while posted:
            _finish(posted.popleft(), posted, out, deadline, pool)
    finally:
        for left in posted:
            for future, _, _ in left.waits:
                future.cancel()
        pool.close()


@functools.lru_cache(maxsize=1)
def _waiter_threads() -> cf.ThreadPoolExecutor:
    """Threads that block in Work.wait, shared by all reshards of this process and reused.

    Each wait ends by its call's deadline at the latest, so waits abandoned by
    a failed reshard free their thread in bounded time.
    """
    return cf.ThreadPoolExecutor(
        max_workers=_MAX_WAITERS, thread_name_prefix="shardserve-reshard-wait"
    )


def _post(
    plan: ReshardPlan,
    k: int,
    round_: list[tuple[str, Bucket]],
    src_shards: Mapping[int, torch.Tensor],
    out: dict[int, torch.Tensor],
    group: PeerGroup,
    waiters: cf.ThreadPoolExecutor,
    deadline: float,
    stats: ReshardStats,
    pool: _StagingPool,
) -> _Posted:
    """Post this round's receives, then pack and post its sends; start bounded waits on them all.

    Over gloo (host buffers) every operation is posted as soon as it is ready,
    so a packed bucket goes on the wire while the next one is packed. CUDA
    buckets go in one batch_isend_irecv (one NCCL group) after the packing:
    separate NCCL sends and receives between the same ranks could deadlock.
    """
    posted = _Posted(k, [], [], [])
    cuda_batch: list[tuple[P2P, str]] = []

    def submit(op: P2P, what: str) -> None:
        if op[1].device.type == "cuda":
            cuda_batch.append((op, what))
        else:
            _post_batch(group, k, [(op, what)], waiters, deadline, posted)

    for kind, bucket in sorted(round_, key=lambda item: item[0] == "send"):
        side = "src" if kind == "send" else "dst"
        wire = _direct_view(plan, bucket, src_shards if kind == "send" else out, side)
        if wire is None:
            buffer, wire = pool.take(bucket.nbytes, _local_device(plan, bucket, side))
            posted.staged.append(buffer)
            if kind == "send":
                pack_bucket(bucket, src_shards, out=wire)
            else:
                posted.receives.append((bucket, wire))
        else:
            stats.zero_copy_buckets += 1
        if kind == "send":
            submit(("send", wire, bucket.dst_rank), "send to")
            stats.sent_bytes += bucket.nbytes
            stats.buckets_sent += 1
        else:
            submit(("recv", wire, bucket.src_rank), "receive from")
            stats.received_bytes += bucket.nbytes
            stats.buckets_received += 1
    if cuda_batch:
        _post_batch(group, k, cuda_batch, waiters, deadline, posted)
    return posted


def _post_batch(
    group: PeerGroup,
    k: int,
    batch: list[tuple[P2P, str]],
    waiters: cf.ThreadPoolExecutor,
    deadline: float,
    posted: _Posted,
) -> None:
    """Post the operations on the group (round k is the tag) and start a bounded wait on each."""
    try:
        works = group.post([op for op, _ in batch], k)
    except Exception as exc:
        peers = tuple(sorted({op[2] for op, _ in batch}))
        raise ReshardError(
            f"posting round {k} with {_ranks_text(list(peers))} failed: {exc}", peers
        ) from exc
    for work, ((_, tensor, peer), what) in zip(works, batch):
        posted.waits.append((waiters.submit(_wait_work, work, tensor.device, deadline), peer, what))


def _finish(
    done: _Posted,
    later: deque[_Posted],
    out: dict[int, torch.Tensor],
    deadline: float,
    pool: _StagingPool,
) -> None:
    """Wait for one round (failing fast on any failed op of any posted round), then unpack it."""
    mine = {future for future, _, _ in done.waits}
    watched = {future: (peer, what) for future, peer, what in done.waits}
    for posted in later:
        watched.update({future: (peer, what) for future, peer, what in posted.waits})
    pending = set(watched)
    while mine & pending:
        finished, pending = cf.wait(
            pending, timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED
        )
        for future in finished:
            if future.exception() is not None:
                peer, what = watched[future]
                raise ReshardError(
                    f"reshard failed to {what} rank {peer}: {future.exception()}", (peer,)
                ) from future.exception()
        if not finished:
            late = sorted({watched[f][0] for f in mine & pending})
            raise ReshardError(
                f"reshard timed out waiting for {_ranks_text(late)} in round {done.round}",
                tuple(late),
            )
    for bucket, wire in done.receives:
        unpack_bucket(bucket, wire, out)
    pool.give_back(done.staged)


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _wait_work(work: dist.Work, device: torch.device, deadline: float) -> None:
    """Block until `work` is done or the deadline passes (TimeoutError)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed before the operation was waited for")
    if device.type != "cuda":
        if not work.wait(timedelta(seconds=remaining)):
            raise TimeoutError(f"operation did not complete within {remaining:.1f}s")
        return
    work.wait()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError("CUDA operation did not complete before the deadline")
        time.sleep(_CUDA_POLL_S)


def _wire_device(plan: ReshardPlan, bucket: Bucket) -> str:
    """ "cuda" when both ends of every transfer in the bucket are CUDA shards, else "cpu"."""
    src, dst = plan.src.shards_metadata, plan.dst.shards_metadata
    both_cuda = all(
        src[t.src_shard].device.type == "cuda" and dst[t.dst_shard].device.type == "cuda"
        for t in bucket.transfers
    )
    return "cuda" if both_cuda else "cpu"


def _local_device(plan: ReshardPlan, bucket: Bucket, side: str) -> torch.device:
    """The device this end of a bucket stages it on: its first shard's device, or the CPU."""
    if _wire_device(plan, bucket) == "cpu":
        return torch.device("cpu")
    first = bucket.transfers[0]
    if side == "src":
        return plan.src.shards_metadata[first.src_shard].device
    return plan.dst.shards_metadata[first.dst_shard].device


def _direct_view(
    plan: ReshardPlan, bucket: Bucket, tensors: Mapping[int, torch.Tensor], side: str
) -> torch.Tensor | None:
    """The bucket's bytes as a flat view of a shard: one box, contiguous, on the wire's device type."""
    if len(bucket.transfers) != 1:
        return None
    t = bucket.transfers[0]
    index = t.src_shard if side == "src" else t.dst_shard
    tensor = tensors[index]
    offsets = t.src_local_offsets() if side == "src" else t.dst_local_offsets()
    view = tensor
    for d, (o, s) in enumerate(zip(offsets, t.sizes)):
        view = view.narrow(d, o, s)
    if not view.is_contiguous() or view.device.type != _wire_device(plan, bucket):
        return None
    return view.reshape(-1).view(torch.uint8)


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
    ctx.live_bytes_done = lambda: stats.local_bytes + stats.received_bytes
    group = ctx.peer_group()
    _debug_stall(rank, name)
    # freed versions' buffers of the right sizes (no first-touch page faults); not given back if this fails,
    # since a failed exchange may leave receives posted into them
    recycled = ctx.store.recycled_shards(dst)
    src_local = [
        i for i in src.shards_on(rank) if i not in unavailable
    ]  # a restarted rank holds none
    if src_local:
        with ctx.store.lease(name, src_version) as entry:
            shards = {i: ctx.store.shard_of(entry, i) for i in src_local}
            out = run_reshard(
                plan, rank, shards, ctx.time_left(), group=group, stats=stats, out=recycled
            )
    else:
        out = run_reshard(plan, rank, {}, ctx.time_left(), group=group, stats=stats, out=recycled)
    if dst.shards_on(rank):
        ctx.store.fill_reserved(name, dst_version, out)
    recycled_bytes = sum(dst.shard_nbytes(i) for i in recycled)
    ctx.progress.new_shard_bytes = stats.new_shard_bytes + recycled_bytes
    ctx.progress.peak_staging_bytes = stats.peak_staging_bytes
    log.info(
        "rank %d staged %r version %d: %d bytes local, %d received, %d sent, peak staging %d bytes, "
        "%d of %d new-shard bytes in recycled buffers",
        rank,
        name,
        dst_version,
        stats.local_bytes,
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


def _debug_stall(rank: int, name: str) -> None:
    """Sleep when STALL_ENV names this rank and tensor (tests make a reshard window to kill a rank in)."""
    for entry in filter(None, os.environ.get(STALL_ENV, "").split(",")):
        stall_rank, seconds, stall_name = entry.split(":", 2)
        if int(stall_rank) == rank and stall_name == name:
            log.warning(
                "rank %d stalls %ss in the reshard of %r (%s)", rank, seconds, name, STALL_ENV
            )
            time.sleep(float(seconds))
