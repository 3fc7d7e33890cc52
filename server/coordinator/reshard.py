"""Coordinated resharding on the coordinator: job numbering, the collective fan-out, PREPARE/COMMIT/ABORT.

Collective jobs (generic; issue 5's DCP load/save uses the same path): the
`JobSequencer` gives each job a `seq` from the catalog's growing counter and,
per participant, `after_seq` (that rank's previous job), and `CollectiveRunner`
sends RunCollective to every participant in parallel, sums their progress and
fails the job as soon as one rank fails (after a short grace to hear the
others), naming the rank that is down or hung. See server/rank/jobs/service.py
for the rank side.

Reshard(name, new metadata):
1. PREPARE: validate (same size and dtype, placements on live ranks: a dead one
   is FAILED_PRECONDITION naming it), take the name (a second reshard of the
   same name while one runs is refused, not queued), record the new version
   PENDING with the `promoting` marker, reserve its memory on the destination
   ranks (AllocateShards reserve_only), then run a "reshard" collective job:
   each rank builds the same plan, moves the data and stages the new version
   beside the old one. Reads stay on the old version throughout.
2. COMMIT: the catalog turns the new version READY (old READY rows removed) in
   one transaction, the marker still set; the ranks promote it, the old
   version is dropped (freed once reads in flight end), the marker cleared. A
   coordinator restarted in between finishes this when the ranks re-register
   (`finish_promotions`), and aborts reshards that never reached COMMIT; a
   promotion that failed on a live rank is retried every few seconds, and a
   next reshard of the tensor waits for it.
3. ABORT on any failure, timeout or client cancel: the new version is dropped
   on every participant; the old one stays whole. A job that failed on one
   rank (or that one rank stopped answering) is also cancelled on the others
   (CancelCollective); a client that cancels leaves a started job to end on
   the ranks, then drops what it staged.

A job that fails with a dead or hung peer leaves the torch.distributed world
unusable for collectives (see collective_jobs); the coordinator then refuses
reshards with a message saying what the operator must do, also shown by
ListRanks (`shardserve status`).
"""
from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

import grpc

from protos import shardserve_pb2 as pb
from server.common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, ServiceError, Unavailable
from server.coordinator.catalog import ranks_of
from server.common.requests import check_name, parse_metadata
from shardcore.metadata import ShardedTensorMetadata
from shardcore.planner import DEFAULT_BUCKET_BYTES, ReshardPlan, plan_reshard_per_round
from shardcore.wire import metadata_from_proto, metadata_to_proto

if TYPE_CHECKING:
    from server.coordinator.lifecycle import Coordinator

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
MIN_JOB_TIMEOUT_S = 1.0
# Test hook: the coordinator process exits right after a reshard's catalog commit.
EXIT_AFTER_COMMIT_ENV = "SHARDSERVE_DEBUG_EXIT_AFTER_RESHARD_COMMIT"
EXIT_AFTER_COMMIT_CODE = 17
_FAILURE_GRACE_S = 2.0   # after one rank failed, how long to hear the others before naming the culprit
_RPC_SLACK_S = 15.0      # how long past the job's own timeout a started job's rank is waited for
_CONTROL_TIMEOUT_S = 10.0


class CollectiveJobError(ServiceError):
    """A collective job failed; `culprits` are the ranks that are down or hung (empty: a plain failure)."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, message: str, culprits: Sequence[int] = ()) -> None:
        super().__init__(message, grpc.StatusCode.UNAVAILABLE if culprits else None)
        self.culprits = tuple(culprits)


class JobSequencer:
    """Numbers collective jobs and remembers each rank's last job, so ranks chain them in one order."""

    def __init__(self, next_number: Callable[[], int]) -> None:
        self._next_number = next_number
        self._last: dict[int, int] = {}
        self._lock = threading.Lock()

    def assign(self, ranks: Sequence[int]) -> tuple[int, dict[int, int]]:
        """(seq of a new job over `ranks`, {rank: after_seq})."""
        with self._lock:
            seq = self._next_number()
            after = {r: self._last.get(r, 0) for r in ranks}
            self._last.update({r: seq for r in ranks})
        return seq, after


class CollectiveRunner:
    """Runs one collective job on its participants and reports their summed progress."""

    def __init__(self, coordinator: "Coordinator") -> None:
        self.coordinator = coordinator
        self.sequencer = JobSequencer(coordinator.catalog.next_version)
        self.broken: str | None = None

    def run(self, job: pb.CollectiveJob, ranks: Sequence[int], what: str
            ) -> Generator[tuple[int, int], None, dict[int, pb.CollectiveProgress]]:
        """Yield (bytes_done, bytes_total) while the job runs; return every rank's final message.

        Raises CollectiveJobError naming the ranks that are down or hung. `job.seq`
        is set here; on failure the job is cancelled on every participant.
        """
        ranks = sorted(set(ranks))
        if self.broken is not None:
            raise FailedPrecondition(self.broken)
        entries = {r: self.coordinator._entry(r) for r in ranks}
        seq, after = self.sequencer.assign(ranks)
        job.seq = seq
        del job.ranks[:]
        job.ranks.extend(ranks)
        events: "queue.Queue[tuple[int, object]]" = queue.Queue()
        calls = {}
        for rank, entry in entries.items():
            request = pb.CollectiveJob()
            request.CopyFrom(job)
            request.after_seq = after[rank]
            calls[rank] = entry.stub.RunCollective(request)  # bounded by the watch below, which cancels it
            threading.Thread(target=_pump, args=(rank, calls[rank], events), daemon=True,
                             name=f"collective-{seq}-rank-{rank}").start()
        latest = {r: pb.CollectiveProgress() for r in ranks}
        finals: dict[int, pb.CollectiveProgress] = {}
        failures: dict[int, object] = {}
        watch = _JobWatch(ranks, job.timeout_s + _RPC_SLACK_S)
        try:
            while len(finals) + len(failures) < len(ranks):
                try:
                    rank, item = events.get(timeout=watch.seconds_left(finals.keys() | failures.keys()))
                except queue.Empty:  # the wait ran to the first limit: that rank is given up
                    break
                watch.heard(rank, item)
                if isinstance(item, pb.CollectiveProgress) and not (item.done and item.error):
                    latest[rank] = item
                    if item.done:
                        finals[rank] = item
                    yield sum(p.bytes_done for p in latest.values()), sum(p.bytes_total for p in latest.values())
                    continue
                failures[rank] = item
                watch.failed()
        finally:
            for call in calls.values():
                call.cancel()
        missing = [r for r in ranks if r not in finals and r not in failures]
        if failures or missing:
            self._cancel(seq, ranks)
            raise self._failure(what, failures, missing)
        return finals

    def _cancel(self, seq: int, ranks: Sequence[int]) -> None:
        request = pb.CancelCollectiveRequest(seq=seq)
        for rank in ranks:
            try:
                self.coordinator._entry(rank).stub.CancelCollective(request, timeout=_CONTROL_TIMEOUT_S)
            except (grpc.RpcError, ServiceError):
                pass  # a dead rank runs nothing

    def _failure(self, what: str, failures: dict[int, object], missing: list[int]) -> CollectiveJobError:
        """The error naming the rank(s) that are down or hung, or else the ranks' own errors."""
        down = {r for r, f in failures.items()
                if isinstance(f, grpc.RpcError) and f.code() == grpc.StatusCode.UNAVAILABLE}
        down |= {r for r in set(failures) | set(missing) if not self.coordinator.rank_alive(r)}
        reporters = {r for r, f in failures.items() if isinstance(f, pb.CollectiveProgress) and f.failed_peers}
        named = {p for f in failures.values() if isinstance(f, pb.CollectiveProgress) for p in f.failed_peers}
        culprits = down | (named - reporters)
        if not culprits and (named or missing):
            culprits = named | set(missing)
        details = "; ".join(f"rank {r}: {_describe(f)}" for r, f in sorted(failures.items()))
        if not culprits:
            return CollectiveJobError(f"{what} failed: {details}")
        parts = [f"rank {r} is down" if r in down or not self.coordinator.rank_alive(r) else
                 f"rank {r} did not answer in time (hung?)" for r in sorted(culprits)]
        first = min(culprits)
        self.broken = (f"rank {first} is down or hung, so the torch.distributed world can run no more "
                       f"collectives: every reshard and checkpoint job is refused until the cluster is restarted "
                       f"(the world is not re-formed in place: stop and start `shardserve up`, or restart every "
                       f"torchrun worker). Reads and writes keep working on the live ranks.")
        log.error("%s failed: %s (%s)", what, ", ".join(parts), details)
        return CollectiveJobError(f"{what} failed: {', '.join(parts)}; the old version stays served. "
                                  f"{self.broken} Details: {details or 'no answer'}", sorted(culprits))


class _JobWatch:
    """When the coordinator stops waiting for a collective job's ranks.

    A rank's job may first wait behind that rank's earlier jobs (another
    tensor's reshard, say); meanwhile the rank streams progress every 0.2 s,
    and it is given up only once silent for SILENCE_S. From its `started`
    message on it has `run_s` (the job's timeout plus slack). After any rank
    failed, the others get _FAILURE_GRACE_S more, to name the culprit.
    """

    SILENCE_S = 30.0

    def __init__(self, ranks: Sequence[int], run_s: float) -> None:
        now = time.monotonic()
        self.run_s = run_s
        self.limits = {rank: now + self.SILENCE_S for rank in ranks}  # per rank: when it is given up
        self.running: set[int] = set()
        self.give_up = float("inf")

    def heard(self, rank: int, item: object) -> None:
        now = time.monotonic()
        if isinstance(item, pb.CollectiveProgress) and item.started and rank not in self.running:
            self.running.add(rank)
            self.limits[rank] = now + self.run_s
        elif rank not in self.running:
            self.limits[rank] = now + self.SILENCE_S

    def failed(self) -> None:
        self.give_up = min(self.give_up, time.monotonic() + _FAILURE_GRACE_S)

    def seconds_left(self, ended: set[int]) -> float:
        """Seconds until a rank that has not ended is given up (0: now)."""
        pending = [limit for rank, limit in self.limits.items() if rank not in ended]
        return max(0.0, min([self.give_up, *pending]) - time.monotonic())


def _pump(rank: int, call: grpc.Call, events: "queue.Queue[tuple[int, object]]") -> None:
    """Forward one rank's progress stream (or its RPC failure) into the runner's queue. A CANCELLED stream is
    forwarded too: the runner cancels only once it stopped reading, so this one was cut elsewhere (the rank
    re-registered and its channel was closed) and the job will not hear from that rank again."""
    try:
        for message in call:
            events.put((rank, message))
    except grpc.RpcError as err:
        events.put((rank, err))


def _describe(failure: object) -> str:
    if isinstance(failure, grpc.RpcError):
        return f"{failure.code().name}: {failure.details()}"
    assert isinstance(failure, pb.CollectiveProgress)
    return failure.error


class ReshardDriver:
    """The Reshard RPC's logic; one per coordinator."""

    def __init__(self, coordinator: "Coordinator", default_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.coordinator = coordinator
        self.catalog = coordinator.catalog
        self.jobs = CollectiveRunner(coordinator)
        self.default_timeout_s = default_timeout_s
        self._running: set[str] = set()
        self._old_versions: dict[str, pb.TensorInfo] = {}  # committed, to drop once the new one is promoted
        self._running_lock = threading.Lock()

    @property
    def collectives_error(self) -> str:
        return self.jobs.broken or ""

    @contextmanager
    def _claim(self, name: str) -> Iterator[None]:
        with self._running_lock:
            if name in self._running:
                raise FailedPrecondition(f"reshard of {name!r} already in progress (a second reshard is refused, "
                                         f"not queued: retry once it has finished)")
            self._running.add(name)
        try:
            yield
        finally:
            with self._running_lock:
                self._running.discard(name)

    def reshard(self, request: pb.ReshardRequest) -> Iterator[pb.ReshardProgress]:
        """Run one reshard, streaming its progress; the last message carries the new READY TensorInfo."""
        name = check_name(request.name)
        dst = parse_metadata(request.metadata)
        bucket_bytes = _bucket_bytes(request.bucket_bytes)
        timeout_s = job_timeout(request.timeout_s, self.default_timeout_s)
        if self.jobs.broken is not None:
            raise FailedPrecondition(self.jobs.broken)
        with self._claim(name), self.coordinator._name_lock(name):
            info = self.catalog.ready(name)
            if info is None:
                raise NotFound(f"tensor {name!r} not found")
            if info.promoting:  # the last reshard's promotion failed on some rank: finish it first
                self._finish_one(info)
                info = self.catalog.ready(name)
                if info is None or info.promoting:
                    raise FailedPrecondition(f"tensor {name!r}: the promotion of version {info.version if info else '?'}"
                                             f" is unfinished on some rank (see the coordinator's log); it is "
                                             f"retried every few seconds, reshard once it is done")
            src = metadata_from_proto(info.metadata)
            plan = _plan(src, dst, bucket_bytes)
            self._check_ranks(src.ranks(), dst.ranks())
            self.coordinator._check_placements(dst)
            new = pb.TensorInfo(name=name, version=self.catalog.next_version(), metadata=metadata_to_proto(dst),
                                options=info.options, state=pb.PENDING, nbytes=dst.nbytes,
                                created_unix=time.time(), promoting=True)
            total = dst.shards_nbytes()
            yield pb.ReshardProgress(phase=pb.RESHARD_PREPARING, bytes_total=total, version=new.version)
            self.catalog.add(new)
            participants = list(plan.participants(dst))
            try:
                finals = yield from self._prepare(info, new, src, dst, plan, participants, timeout_s, total)
                yield pb.ReshardProgress(phase=pb.RESHARD_COMMITTING, bytes_done=total, bytes_total=total,
                                         version=new.version)
            except BaseException:  # failures, timeouts, and the client cancelling the stream (GeneratorExit)
                self._abort(new, participants)
                raise
            ready = self._commit(new, info)  # no yield from here to the promotion: a cancel cannot cut it
            self._promote(ready)
            yield pb.ReshardProgress(
                phase=pb.RESHARD_DONE, bytes_done=total, bytes_total=total, version=ready.version, tensor=ready,
                max_new_shard_bytes=max((f.new_shard_bytes for f in finals.values()), default=0),
                max_staging_bytes=max((f.peak_staging_bytes for f in finals.values()), default=0))

    def _prepare(self, old: pb.TensorInfo, new: pb.TensorInfo, src: ShardedTensorMetadata,
                 dst: ShardedTensorMetadata, plan: ReshardPlan, participants: list[int], timeout_s: float,
                 total: int) -> Generator[pb.ReshardProgress, None, dict[int, pb.CollectiveProgress]]:
        """Reserve the new version's memory, then run the reshard job on every participant."""
        reserve = pb.AllocateShardsRequest(name=new.name, version=new.version, metadata=new.metadata,
                                           options=new.options, reserve_only=True)
        self.coordinator._fan_out(dst.ranks(), lambda stub: stub.AllocateShards(
            reserve, timeout=self.coordinator.rpc_timeout), f"reserve {new.name!r} version {new.version}")
        job = pb.CollectiveJob(timeout_s=timeout_s, reshard=pb.ReshardJob(
            name=new.name, src_version=old.version, src=old.metadata, dst_version=new.version, dst=new.metadata,
            bucket_bytes=plan.bucket_bytes))
        what = f"reshard of {new.name!r} (version {old.version} -> {new.version})"
        log.info("%s: %d bytes over ranks %s, buckets of %d bytes", what, total, participants, plan.bucket_bytes)
        runner = self.jobs.run(job, participants, what)
        try:
            while True:
                done, _ = next(runner)
                yield pb.ReshardProgress(phase=pb.RESHARD_MOVING, bytes_done=min(done, total), bytes_total=total,
                                         version=new.version)
        except StopIteration as stop:
            return stop.value

    def _abort(self, new: pb.TensorInfo, participants: list[int]) -> None:
        """Forget the new version: catalog row removed, staged shards dropped on every participant."""
        self.catalog.remove(new.name, new.version)
        request = pb.DropVersionRequest(name=new.name, version=new.version)
        for rank in participants:
            try:
                self.coordinator._entry(rank).stub.DropVersion(request, timeout=_CONTROL_TIMEOUT_S)
            except (grpc.RpcError, ServiceError) as err:
                log.warning("abort: could not drop %r version %d on rank %d: %s", new.name, new.version, rank, err)
        log.warning("reshard of %r aborted; version %d dropped", new.name, new.version)

    def _commit(self, new: pb.TensorInfo, old: pb.TensorInfo) -> pb.TensorInfo:
        """The catalog's one transaction: the new version READY (marker still set), older READY rows gone."""
        ready, _ = self.catalog.commit(new.name, new.version)
        log.info("reshard of %r committed in the catalog: version %d replaces %d", new.name, new.version, old.version)
        if os.environ.get(EXIT_AFTER_COMMIT_ENV):
            log.error("%s is set: exiting after the catalog commit", EXIT_AFTER_COMMIT_ENV)
            logging.shutdown()
            os._exit(EXIT_AFTER_COMMIT_CODE)
        self._old_versions[new.name] = old
        return ready

    def _promote(self, ready: pb.TensorInfo) -> bool:
        """PromoteVersion on the new version's ranks, drop the old version, clear the marker."""
        ranks = ranks_of(ready)
        try:
            self.coordinator.promote_on(ranks, ready.name, ready.version,
                                        f"promote {ready.name!r} version {ready.version}")
        except ServiceError as err:
            log.error("promotion of %r version %d is unfinished (%s); the coordinator retries it every few seconds",
                      ready.name, ready.version, err.message)
            return False
        self.drop_replaced(ready.name)
        ready.promoting = False
        self.catalog.update(ready)
        log.info("%r version %d promoted on ranks %s", ready.name, ready.version, ranks)
        return True

    def drop_replaced(self, name: str) -> None:
        """Drop the version a committed reshard of `name` replaced, on its ranks (name lock held): at the
        promotion, or when the reshard's own version leaves the catalog before its promotion finished."""
        old = self._old_versions.pop(name, None)
        if old is not None:
            self.coordinator._drop_quietly(name, old.version, ranks_of(old))

    def is_running(self, name: str) -> bool:
        """Whether a reshard of `name` runs now."""
        with self._running_lock:
            return name in self._running

    def finish_promotions(self) -> None:
        """Promote committed reshards whose promotion is unfinished (a coordinator restart, a rank that failed
        PromoteVersion), abort ones that never committed; run at registrations and every few seconds."""
        try:
            for info in self.catalog.list(include_pending=True):
                if not info.promoting or self.is_running(info.name):
                    continue
                try:
                    with self.coordinator._name_lock(info.name, wait_s=0.1):
                        self._finish_one(info)
                except Aborted:
                    continue  # busy: the next round finishes it
        except Exception:  # noqa: BLE001 - a background task must log, not vanish
            log.exception("finishing reshard promotions failed")

    def _finish_one(self, info: pb.TensorInfo) -> None:
        current = self.catalog.get(info.name, info.version)
        if current is None or not current.promoting:
            return
        if current.state != pb.READY:
            log.warning("reshard of %r to version %d never committed (coordinator restarted); aborting it",
                        current.name, current.version)
            self.catalog.remove(current.name, current.version)
            self.coordinator._drop_quietly(current.name, current.version,
                                           [r for r in ranks_of(current) if self.coordinator.rank_alive(r)])
            return
        if all(self.coordinator.rank_alive(r) for r in ranks_of(current)) and self._promote(current):
            log.info("finished the promotion of %r version %d after a coordinator restart",
                     current.name, current.version)

    def _check_ranks(self, src_ranks: Sequence[int], dst_ranks: Sequence[int]) -> None:
        """The first rank of the reshard that is not alive, named: a requested one that is not registered is
        INVALID_ARGUMENT (metadata), one holding the current version or down is FAILED_PRECONDITION."""
        for rank in sorted(set(src_ranks) | set(dst_ranks)):
            try:
                entry = self.coordinator._entry(rank)
            except Unavailable:
                if rank in dst_ranks:
                    raise InvalidArgument(f"metadata: rank {rank} is not a registered rank") from None
                raise FailedPrecondition(f"rank {rank}, which holds the current version, is not registered "
                                         f"(it has not come back since the coordinator started)") from None
            if not self.coordinator.is_alive(entry):
                raise FailedPrecondition(f"rank {rank} is down; resharding onto/from it is impossible until it "
                                         f"is back (restart the cluster if it died)")


def _plan(src: ShardedTensorMetadata, dst: ShardedTensorMetadata, bucket_bytes: int) -> ReshardPlan:
    if src.size != dst.size:
        raise InvalidArgument(f"metadata.size {dst.size} differs from the tensor's size {src.size}")
    if src.dtype != dst.dtype:
        raise InvalidArgument(f"metadata.tensor_properties.dtype {dst.dtype} differs from the tensor's "
                              f"dtype {src.dtype}")
    try:
        return plan_reshard_per_round(src, dst, bucket_bytes)
    except ValueError as err:
        raise InvalidArgument(f"metadata: {err}") from None


def _bucket_bytes(value: int) -> int:
    if value < 0:
        raise InvalidArgument(f"bucket_bytes {value} is negative (0 = default)")
    return value or DEFAULT_BUCKET_BYTES


def job_timeout(value: float, default: float) -> float:
    """A collective job's timeout_s: 0 for `default`, else at least MIN_JOB_TIMEOUT_S. A job that times out
    leaves the world unable to run collectives (its peers may be inside one), so a timeout too short for any
    job to finish would be a way to break the cluster with one request."""
    if not (value == 0 or MIN_JOB_TIMEOUT_S <= value < math.inf):  # NaN fails this too
        raise InvalidArgument(f"timeout_s {value} must be 0 (the default, {default:g} s) or a finite number of "
                              f"seconds >= {MIN_JOB_TIMEOUT_S:g}")
    return value or default


