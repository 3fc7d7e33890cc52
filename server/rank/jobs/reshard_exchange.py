"""Executing a rank's rounds of a reshard: posting each round's sends and receives on the job's group,
waiting for them within the deadline, and unpacking what arrived (server/rank/jobs/reshard.py has the why).

At most `max_in_flight` rounds are posted at once; staging buffers come from a pool of one capacity, reused
round after round; every wait runs on a shared pool of waiter threads, so the first failing peer is the one
reported (ReshardError naming it).
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import functools
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve.core.executor import pack_bucket, unpack_bucket
from shardserve.core.planner import Bucket, ReshardPlan
from shardserve.server.rank.jobs.groups import P2P, PeerGroup
from shardserve.server.rank.jobs.reshard_rounds import (
    BucketOp,
    Role,
    direct_view,
    local_device,
)

_CUDA_POLL_S = 0.0005
_MAX_WAITERS = 256
_HUGE_PAGE = 2 << 20
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
    mapped_bytes: int = 0  # copied out of a same-host peer's memory (server/rank/jobs/same_host.py)
    mapped_buckets: int = 0
    rounds: int = 0
    new_shard_bytes: int = 0
    staging_bytes: int = 0
    peak_staging_bytes: int = 0


class StagingPool:
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


@dataclass(frozen=True)
class Wait:
    """A bounded wait on one posted operation."""

    future: cf.Future
    op: P2P


@dataclass
class Posted:
    """One posted round: its waits, the receives to unpack, the staging to give back."""

    round: int
    waits: list[Wait] = field(default_factory=list)
    receives: list[tuple[Bucket, torch.Tensor]] = field(default_factory=list)
    staged: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Exchange:
    """What every round of one run_reshard call works with: the plan, this rank's source and new shards,
    the group, the deadline, the staging pool and the stats."""

    plan: ReshardPlan
    src_shards: Mapping[int, torch.Tensor]
    out: dict[int, torch.Tensor]
    group: PeerGroup
    deadline: float
    stats: ReshardStats
    pool: StagingPool


def exchange(
    setup: Exchange,
    rounds: list[list[BucketOp]],
    *,
    max_in_flight: int,
    copy_local: Callable[[], None],
) -> None:
    """Post the rounds with at most max_in_flight outstanding; unpack each round once it is done.

    The local copies run once the first rounds are posted, while their bytes are on the wire.
    """
    posted: deque[Posted] = deque()
    try:
        for k, round_ in enumerate(rounds):
            if len(posted) == max_in_flight:
                if k == max_in_flight:
                    copy_local()
                _finish(setup, posted.popleft(), posted)
            posted.append(_post(setup, k, round_))
        if len(rounds) <= max_in_flight:
            copy_local()
        while posted:
            _finish(setup, posted.popleft(), posted)
    finally:
        for left in posted:
            for wait in left.waits:
                wait.future.cancel()
        setup.pool.close()


@functools.lru_cache(maxsize=1)
def _waiter_threads() -> cf.ThreadPoolExecutor:
    """Threads that block in Work.wait, shared by all reshards of this process and reused.

    Each wait ends by its call's deadline at the latest, so waits abandoned by
    a failed reshard free their thread in bounded time.
    """
    return cf.ThreadPoolExecutor(
        max_workers=_MAX_WAITERS, thread_name_prefix="shardserve-reshard-wait"
    )


def _post(setup: Exchange, k: int, round_: list[BucketOp]) -> Posted:
    """Post this round's receives, then pack and post its sends; start bounded waits on them all.

    Over gloo (host buffers) every operation is posted as soon as it is ready,
    so a packed bucket goes on the wire while the next one is packed. CUDA
    buckets go in one batch_isend_irecv (one NCCL group) after the packing:
    separate NCCL sends and receives between the same ranks could deadlock.
    """
    posted = Posted(k)
    cuda_batch: list[P2P] = []
    stats = setup.stats
    for op in sorted(round_, key=lambda op: op.role is Role.SOURCE):
        sending = op.role is Role.SOURCE
        bucket = op.bucket
        wire = direct_view(setup.plan, op, setup.src_shards if sending else setup.out)
        if wire is None:
            buffer, wire = setup.pool.take(bucket.nbytes, local_device(setup.plan, op))
            posted.staged.append(buffer)
            if sending:
                pack_bucket(bucket, setup.src_shards, out=wire)
            else:
                posted.receives.append((bucket, wire))
        else:
            stats.zero_copy_buckets += 1
        p2p = P2P(op.verb, wire, op.peer)
        if wire.device.type == "cuda":
            cuda_batch.append(p2p)
        else:
            _post_batch(setup, k, [p2p], posted)
        if sending:
            stats.sent_bytes += bucket.nbytes
            stats.buckets_sent += 1
        else:
            stats.received_bytes += bucket.nbytes
            stats.buckets_received += 1
    if cuda_batch:
        _post_batch(setup, k, cuda_batch, posted)
    return posted


def _post_batch(setup: Exchange, k: int, batch: list[P2P], posted: Posted) -> None:
    """Post the operations on the group (round k is the tag) and start a bounded wait on each."""
    try:
        works = setup.group.post(batch, k)
    except Exception as exc:
        peers = tuple(sorted({op.peer for op in batch}))
        raise ReshardError(
            f"posting round {k} with {_ranks_text(list(peers))} failed: {exc}", peers
        ) from exc
    waiters = _waiter_threads()
    for work, op in zip(works, batch):
        future = waiters.submit(_wait_work, work, op.tensor.device, setup.deadline)
        posted.waits.append(Wait(future, op))


def _finish(setup: Exchange, done: Posted, later: deque[Posted]) -> None:
    """Wait for one round (failing fast on any failed op of any posted round), then unpack it."""
    mine = {wait.future for wait in done.waits}
    watched = {wait.future: wait.op for posted in (done, *later) for wait in posted.waits}
    pending = set(watched)
    while mine & pending:
        finished, pending = cf.wait(
            pending,
            timeout=max(0.0, setup.deadline - time.monotonic()),
            return_when=cf.FIRST_COMPLETED,
        )
        for future in finished:
            error = future.exception()
            if error is not None:
                op = watched[future]
                raise ReshardError(
                    f"reshard failed to {op.verb.value} rank {op.peer}: {error}", (op.peer,)
                ) from error
        if not finished:
            late = sorted({watched[f].peer for f in mine & pending})
            raise ReshardError(
                f"reshard timed out waiting for {_ranks_text(late)} in round {done.round}",
                tuple(late),
            )
    for bucket, wire in done.receives:
        unpack_bucket(bucket, wire, setup.out)
    setup.pool.give_back(done.staged)


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
