"""Collective jobs on a rank: one thread, the coordinator's order, and the job kinds that run there.

The protocol (issue 4; issue 5's DCP load/save reuses it):

- The coordinator numbers every collective job with `seq`, drawn from the
  catalog's growing counter (unique across coordinator restarts), and tells
  each participant `after_seq`: the seq of that rank's previous job (0 when it
  knows none, e.g. after a restart). See server/reshard_driver.JobSequencer.
- Each rank chains its jobs: a job runs on the rank's one CollectiveExecutor
  thread right after its `after_seq` job, so every participant enters the
  collectives of two jobs in the same relative order, and a rank never waits
  for a job it is not part of. A job whose predecessor never arrives (lost or
  aborted) waits at most its `timeout_s`, then fails and releases its
  successors; CancelCollective(seq) does the same for a job that has not
  started. A caller that cancels the stream does not cancel the job (its
  peers may already be in its collectives): the coordinator sends
  CancelCollective to every participant once the job failed on one of them
  or one went silent or overran.
- `ShardServer.RunCollective(CollectiveJob)` streams CollectiveProgress
  (bytes_done/bytes_total, every 0.2 s, `started` once the job left the
  queue behind the rank's earlier jobs; its `timeout_s` counts from then)
  until a message with done=true; `error` empty means success,
  `failed_peers` names the ranks that failed or did not answer.
- A job kind is the name of a field of the CollectiveJob `kind` oneof;
  `register_job_kind(kind, fn)` binds it to `fn(job, context)`, run on the
  collective thread with a JobContext (store, rank, deadline, progress).
  The built-in kind "reshard" stages a new version: see `run_reshard_job`.
- A job that fails with a dead or hung peer (ReshardError) leaves gloo
  operations with that peer abandoned in the world's process group; later
  jobs would match them (tags repeat). So the rank refuses every later
  collective job ("collectives are unusable ... restart the cluster"); reads
  and writes keep working. Re-forming the world in place is not attempted.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
import torch

from protos import shardserve_pb2 as pb
from server.common.errors import InvalidArgument, rpc_errors
from server.common.requests import check_name, check_version, parse_metadata
from server.rank.jobs.reshard import (
    CollectiveExecutor,
    ReshardError,
    ReshardStats,
    run_reshard,
)
from server.rank.store import ShardStore
from shardcore.planner import DEFAULT_BUCKET_BYTES, plan_reshard

log = logging.getLogger(__name__)

# Test hook: "RANK:SECONDS:NAME[,...]" makes RANK sleep SECONDS before moving data in a reshard of NAME.
STALL_ENV = "SHARDSERVE_DEBUG_RESHARD_STALL"
_POLL_S = 0.2
_NEVER_S = 10 * 365 * 86400.0


class JobCancelled(RuntimeError):
    """The job was cancelled, or timed out waiting for its predecessor, before it started."""


@dataclass
class JobContext:
    """What a job kind gets: the store, this rank, the deadline, and a place to report progress."""

    store: ShardStore
    rank: int
    job: pb.CollectiveJob
    deadline: float
    progress: pb.CollectiveProgress = field(default_factory=pb.CollectiveProgress)
    live_bytes_done: Callable[[], int] | None = None

    def time_left(self) -> float:
        return max(1e-3, self.deadline - time.monotonic())

    def snapshot(self) -> pb.CollectiveProgress:
        out = pb.CollectiveProgress()
        out.CopyFrom(self.progress)
        if self.live_bytes_done is not None:
            out.bytes_done = self.live_bytes_done()
        return out


JobFn = Callable[[pb.CollectiveJob, JobContext], None]
_KINDS: dict[str, JobFn] = {}


def register_job_kind(kind: str, fn: JobFn) -> None:
    """Run `fn(job, context)` for CollectiveJobs whose `kind` oneof field is `kind`."""
    if kind not in {f.name for f in pb.CollectiveJob.DESCRIPTOR.oneofs_by_name["kind"].fields}:
        raise ValueError(f"kind {kind!r} is not a field of CollectiveJob.kind in the proto")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _KINDS[kind] = fn


class JobChain:
    """Orders jobs by (seq, after_seq) onto one CollectiveExecutor thread.

    Local executor numbers are handed out in chain order: a job gets the next
    one once its predecessor has one (or is 0), so the executor never waits
    for a number that will not come.
    """

    def __init__(self, executor: CollectiveExecutor | None = None) -> None:
        self._executor = executor or CollectiveExecutor(0, name="shardserve-collective-jobs")
        self._lock = threading.Lock()
        self._local: dict[int, int] = {}
        self._next_local = self._executor.next_seq
        self._parked: dict[int, list[tuple[int, Callable[[], Any], cf.Future, threading.Timer]]] = {}
        self._cancelled: set[int] = set()

    def submit(self, seq: int, after_seq: int, fn: Callable[[], Any], timeout_s: float) -> cf.Future:
        """Run `fn` after job `after_seq`; the future holds its result or exception."""
        future: cf.Future = cf.Future()
        with self._lock:
            if seq in self._local:
                future.set_exception(JobCancelled(f"job {seq} was cancelled or already submitted"))
                return future
            if after_seq == 0 or after_seq in self._local:
                self._assign(seq, fn, future)
            else:
                timer = threading.Timer(timeout_s, self._expire, (seq, after_seq))
                timer.daemon = True
                self._parked.setdefault(after_seq, []).append((seq, fn, future, timer))
                timer.start()
        return future

    def cancel(self, seq: int) -> None:
        """Make a job that has not started fail with JobCancelled; its successors go on."""
        with self._lock:
            self._cancelled.add(seq)
            for after, waiting in list(self._parked.items()):
                for item in waiting:
                    if item[0] == seq:
                        waiting.remove(item)
                        item[3].cancel()
                        self._assign(seq, item[1], item[2])
                        return
            if seq not in self._local:
                self._assign(seq, lambda: None, cf.Future())

    def _expire(self, seq: int, after_seq: int) -> None:
        with self._lock:
            for item in self._parked.get(after_seq, []):
                if item[0] == seq:
                    self._parked[after_seq].remove(item)
                    item[2].set_exception(JobCancelled(
                        f"job {seq} timed out waiting for job {after_seq} to arrive"))
                    self._cancelled.add(seq)
                    self._assign(seq, lambda: None, cf.Future())
                    return

    def _assign(self, seq: int, fn: Callable[[], Any], future: cf.Future) -> None:
        """Give `seq` the next executor number and release the jobs parked behind it (lock held)."""
        local = self._next_local
        self._next_local += 1
        self._local[seq] = local

        def run() -> Any:
            if seq in self._cancelled:
                raise JobCancelled(f"job {seq} was cancelled before it started")
            return fn()

        inner = self._executor.submit(local, run, wait_timeout_s=_NEVER_S)
        inner.add_done_callback(lambda f: _copy_outcome(f, future))
        for next_seq, next_fn, next_future, timer in self._parked.pop(seq, []):
            timer.cancel()
            self._assign(next_seq, next_fn, next_future)

    def close(self) -> None:
        self._executor.close()


def _copy_outcome(source: cf.Future, target: cf.Future) -> None:
    if target.done():
        return
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


class CollectiveJobs:
    """The rank's RunCollective / CancelCollective: validation, ordering, progress, the broken flag."""

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.chain = JobChain()
        self.broken: str | None = None

    def _check(self, job: pb.CollectiveJob) -> str:
        if job.seq == 0:
            raise InvalidArgument("seq must be > 0")
        if job.after_seq >= job.seq:
            raise InvalidArgument(f"after_seq {job.after_seq} must be < seq {job.seq}")
        if self.store.rank not in job.ranks:
            raise InvalidArgument(f"ranks {list(job.ranks)} does not include this rank ({self.store.rank})")
        if not 0 < job.timeout_s < math.inf:  # NaN fails this too
            raise InvalidArgument(f"timeout_s must be a finite number > 0, got {job.timeout_s}")
        kind = job.WhichOneof("kind")
        if kind is None or kind not in _KINDS:
            raise InvalidArgument(f"kind {kind!r} is not a registered collective job kind "
                                  f"(known: {sorted(_KINDS)})")
        return kind

    @rpc_errors
    def RunCollective(self, job: pb.CollectiveJob, context: grpc.ServicerContext) -> Iterator[pb.CollectiveProgress]:
        kind = self._check(job)
        ctx = JobContext(self.store, self.store.rank, job, deadline=0.0)

        def execute() -> None:
            if self.broken is not None:
                raise RuntimeError(self.broken)
            ctx.deadline = time.monotonic() + job.timeout_s  # timeout_s is the job's own run, not its queueing
            ctx.progress.started = True
            _KINDS[kind](job, ctx)

        # A caller that stops listening does not cancel the job: its peers may already be in its
        # collectives, and they would hang until their deadline. Only CancelCollective cancels.
        future = self.chain.submit(job.seq, job.after_seq, execute, job.timeout_s)
        while True:
            try:
                future.result(timeout=_POLL_S)
                break
            except cf.TimeoutError:
                yield ctx.snapshot()
            except Exception:  # noqa: BLE001 - reported in the final message below
                break
        yield self._final(job, ctx, future)

    def _final(self, job: pb.CollectiveJob, ctx: JobContext, future: cf.Future) -> pb.CollectiveProgress:
        final = ctx.snapshot()
        final.done = True
        err = future.exception()
        if err is None:
            return final
        final.error = str(err) or type(err).__name__
        if isinstance(err, ReshardError) and err.peers:
            final.failed_peers.extend(err.peers)
            peers = ", ".join(map(str, err.peers))
            self.broken = (f"collectives are unusable on rank {self.store.rank} since job {job.seq} failed "
                           f"with rank(s) {peers} ({final.error}); restart the cluster to reshard again")
            log.error("%s", self.broken)
        else:
            log.warning("collective job %d failed on rank %d: %s", job.seq, self.store.rank, final.error)
        return final

    @rpc_errors
    def CancelCollective(self, request: pb.CancelCollectiveRequest,
                         context: grpc.ServicerContext) -> pb.CancelCollectiveResponse:
        if request.seq == 0:
            raise InvalidArgument("seq must be > 0")
        self.chain.cancel(request.seq)
        return pb.CancelCollectiveResponse()


def handlers(jobs: CollectiveJobs) -> dict[str, grpc.RpcMethodHandler]:
    """The ShardServer method handlers of the collective-job RPCs."""
    return {
        "RunCollective": grpc.unary_stream_rpc_method_handler(
            jobs.RunCollective, request_deserializer=pb.CollectiveJob.FromString,
            response_serializer=pb.CollectiveProgress.SerializeToString),
        "CancelCollective": grpc.unary_unary_rpc_method_handler(
            jobs.CancelCollective, request_deserializer=pb.CancelCollectiveRequest.FromString,
            response_serializer=pb.CancelCollectiveResponse.SerializeToString),
    }


# ---------------------------------------------------------------- the "reshard" kind

def run_reshard_job(job: pb.CollectiveJob, ctx: JobContext) -> None:
    """Stage this rank's new shards of a reshard as the reserved pending dst_version.

    Every rank builds the same plan (plan_reshard is deterministic), leases its
    source shards so they stay whole, runs run_reshard on this (the collective)
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
    plan = plan_reshard(src, dst, spec.bucket_bytes or DEFAULT_BUCKET_BYTES)  # the per-pair size the coordinator chose
    outside = sorted(set(plan.participants(dst)) - set(job.ranks))
    if outside:  # they would never enter the exchange, and this rank would wait for them until its deadline
        raise InvalidArgument(f"ranks {list(job.ranks)} leaves out ranks {outside} that the reshard needs")
    rank = ctx.rank
    if ctx.store.device.type == "cuda":
        torch.cuda.set_device(ctx.store.device)  # the current device is per thread; NCCL work goes to ours
    stats = ReshardStats()
    ctx.progress.bytes_total = sum(dst.shard_nbytes(i) for i in dst.shards_on(rank))
    ctx.live_bytes_done = lambda: stats.local_bytes + stats.received_bytes
    _debug_stall(rank, name)
    # freed versions' buffers of the right sizes (no first-touch page faults); not given back if this fails,
    # since a failed exchange may leave receives posted into them
    recycled = ctx.store.recycled_shards(dst)
    src_local = src.shards_on(rank)
    if src_local:
        with ctx.store.lease(name, src_version) as entry:
            shards = {i: ctx.store.shard_of(entry, i) for i in src_local}
            out = run_reshard(plan, rank, shards, ctx.time_left(), stats=stats, out=recycled)
    else:
        out = run_reshard(plan, rank, {}, ctx.time_left(), stats=stats, out=recycled)
    if dst.shards_on(rank):
        ctx.store.fill_reserved(name, dst_version, out)
    recycled_bytes = sum(dst.shard_nbytes(i) for i in recycled)
    ctx.progress.new_shard_bytes = stats.new_shard_bytes + recycled_bytes
    ctx.progress.peak_staging_bytes = stats.peak_staging_bytes
    log.info("rank %d staged %r version %d: %d bytes local, %d received, %d sent, peak staging %d bytes, "
             "%d of %d new-shard bytes in recycled buffers", rank, name, dst_version, stats.local_bytes,
             stats.received_bytes, stats.sent_bytes, stats.peak_staging_bytes, recycled_bytes,
             ctx.progress.new_shard_bytes)


def _debug_stall(rank: int, name: str) -> None:
    """Sleep when STALL_ENV names this rank and tensor (tests make a reshard window to kill a rank in)."""
    for entry in filter(None, os.environ.get(STALL_ENV, "").split(",")):
        stall_rank, seconds, stall_name = entry.split(":", 2)
        if int(stall_rank) == rank and stall_name == name:
            log.warning("rank %d stalls %ss in the reshard of %r (%s)", rank, seconds, name, STALL_ENV)
            time.sleep(float(seconds))


register_job_kind("reshard", run_reshard_job)
