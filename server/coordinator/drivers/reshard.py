"""Coordinated resharding, driven by the coordinator: PREPARE, COMMIT or ABORT of one tensor's new layout.

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

The collective job itself is numbered and run by coordinator/collectives.py,
in the current epoch; a failed job ends it, and the next reshard forms new
process groups over the live ranks.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.planner import DEFAULT_BUCKET_BYTES, ReshardPlan, plan_reshard_per_round
from shardserve.server.common.errors import (
    InvalidArgument,
    RankUnavailable,
    ServiceError,
    TensorBusy,
    TensorNotFound,
)
from shardserve.server.coordinator.catalog.records import TensorRecord
from shardserve.server.coordinator.drivers.collectives import CollectiveRunner, job_timeout
from shardserve.server.coordinator.drivers.context import DriverContext
from shardserve.server.coordinator.drivers.orders import ReshardOrder
from shardserve.server.coordinator.ranks.calls import Allocation
from shardserve.server.coordinator.ranks.health import check_copies, unavailable_shards
from shardserve.server.coordinator.ranks.jobs import JobReport, ReshardJob

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
# Test hook: the coordinator process exits right after a reshard's catalog commit.
EXIT_AFTER_COMMIT_ENV = "SHARDSERVE_DEBUG_EXIT_AFTER_RESHARD_COMMIT"
EXIT_AFTER_COMMIT_CODE = 17


class ReshardPhase(enum.Enum):
    """Where a reshard is: reserving memory, moving data, committing, or done."""

    PREPARING = "preparing"
    MOVING = "moving"
    COMMITTING = "committing"
    DONE = "done"


@dataclass(frozen=True)
class ReshardStep:
    """A reshard's progress: its phase, the new version, bytes moved of the total; once DONE, the READY
    record, the largest new shard and staging buffer on any rank, and the bytes moved without and over the
    network."""

    phase: ReshardPhase
    version: int
    bytes_done: int = 0
    bytes_total: int = 0
    tensor: TensorRecord | None = None
    max_new_shard_bytes: int = 0
    max_staging_bytes: int = 0
    mapped_bytes: int = 0  # copied out of same-host ranks' memory, all ranks together
    sent_bytes: int = 0  # sent over gloo / NCCL, all ranks together


@dataclass(frozen=True)
class _Move:
    """One reshard being run: the READY version `old`, its new version, the plan and its participants, and the
    copies of `old` it must not read."""

    old: TensorRecord
    new: TensorRecord
    plan: ReshardPlan
    participants: list[int]
    unavailable: frozenset[int]
    timeout_s: float

    @property
    def total(self) -> int:
        """The bytes of every shard of the new version: what the ranks move and stage in all."""
        return self.new.metadata.shards_nbytes()


class ReshardDriver:
    """The Reshard RPC's logic; one per coordinator."""

    def __init__(
        self,
        context: DriverContext,
        *,
        collectives: CollectiveRunner,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.catalog, self.registry, self.calls, self.locks = (
            context.catalog,
            context.registry,
            context.calls,
            context.locks,
        )
        self.collectives = collectives
        self.default_timeout_s = default_timeout_s
        self._running: set[str] = set()
        self._old_versions: dict[
            str, TensorRecord
        ] = {}  # committed, to drop once the new one is promoted
        self._running_lock = threading.Lock()

    @contextmanager
    def _claim(self, name: str) -> Iterator[None]:
        with self._running_lock:
            if name in self._running:
                raise TensorBusy(
                    f"reshard of {name!r} already in progress (a second reshard is refused, "
                    f"not queued: retry once it has finished)"
                )
            self._running.add(name)
        try:
            yield
        finally:
            with self._running_lock:
                self._running.discard(name)

    def reshard(self, order: ReshardOrder) -> Iterator[ReshardStep]:
        """Run one reshard, streaming its progress; the last step carries the new READY record."""
        timeout_s = job_timeout(order.timeout_s, self.default_timeout_s)
        with self._claim(order.name), self.locks.hold(order.name):
            record = self._current_version(order.name)
            unavailable = self._readable(record)
            yield from self._run(record, order.layout, unavailable, order.bucket_bytes, timeout_s)

    def repair(
        self,
        record: TensorRecord,
        dst: ShardedTensorMetadata,
        unavailable: frozenset[int],
        timeout_s: float,
    ) -> Iterator[ReshardStep]:
        """Turn the READY version `record` into the repaired layout `dst`, reading only copies outside
        `unavailable`, as a reshard does (new version, reads on the old one meanwhile, commit or abort).
        TensorBusy when a reshard of the name runs or its lock is held; nothing then happens."""
        with self._claim(record.name), self.locks.hold(record.name, wait_s=0.5):
            current = self._current_version(record.name)
            if current.version != record.version:
                raise TensorBusy(
                    f"tensor {record.name!r} changed (version {current.version}) before its repair began"
                )
            yield from self._run(current, dst, unavailable, DEFAULT_BUCKET_BYTES, timeout_s)

    def _readable(self, record: TensorRecord) -> frozenset[int]:
        """The shards of `record` a reshard must not read (lost, or on dead or restoring ranks);
        DATA_LOSS or UNAVAILABLE (health.check_copies) when a box has no copy left to read."""
        unavailable = frozenset(unavailable_shards(record, self.registry.rank_unreadable))
        check_copies(record, unavailable, doing="resharded")
        return unavailable

    def _run(
        self,
        old: TensorRecord,
        dst: ShardedTensorMetadata,
        unavailable: frozenset[int],
        bucket_bytes: int,
        timeout_s: float,
    ) -> Iterator[ReshardStep]:
        """(claim and name lock held) PREPARE, COMMIT or ABORT of `old` into layout `dst`."""
        plan = _plan(old.metadata, dst, bucket_bytes, unavailable)
        participants = list(plan.participants(dst))
        self._check_ranks(participants, dst.ranks())
        self.registry.check_placements(dst)
        new = TensorRecord(
            name=old.name,
            version=self.catalog.next_versions(1)[0],
            metadata=dst,
            options=old.options,
            created_unix=time.time(),
            promoting=True,
            owner=old.owner,
        )
        move = _Move(old, new, plan, participants, unavailable, timeout_s)
        total = move.total
        yield ReshardStep(ReshardPhase.PREPARING, new.version, bytes_total=total)
        self.catalog.add(new)
        try:
            finals = yield from self._prepare(move)
            yield ReshardStep(ReshardPhase.COMMITTING, new.version, total, total)
        except (
            BaseException
        ):  # failures, timeouts, and the client cancelling the stream (GeneratorExit)
            self._abort(new, participants)
            raise
        ready = self._commit(
            new, old
        )  # no yield from here to the promotion: a cancel cannot cut it
        ready = self._promote(ready) or ready
        yield ReshardStep(
            ReshardPhase.DONE,
            ready.version,
            total,
            total,
            tensor=ready,
            max_new_shard_bytes=max((f.new_shard_bytes for f in finals.values()), default=0),
            max_staging_bytes=max((f.peak_staging_bytes for f in finals.values()), default=0),
            mapped_bytes=sum(f.mapped_bytes for f in finals.values()),
            sent_bytes=sum(f.sent_bytes for f in finals.values()),
        )

    def _current_version(self, name: str) -> TensorRecord:
        """(name lock held) The READY version to reshard from, its last reshard's promotion finished first."""
        record = self.catalog.ready(name)
        if record is None:
            raise TensorNotFound(f"tensor {name!r} not found")
        if record.promoting:  # the last reshard's promotion failed on some rank: finish it first
            self._finish_one(record)
            current = self.catalog.ready(name)
            if current is None or current.promoting:
                raise TensorBusy(
                    f"tensor {name!r}: the promotion of version {current.version if current else '?'}"
                    f" is unfinished on some rank (see the coordinator's log); it is "
                    f"retried every few seconds, reshard once it is done"
                )
            record = current
        return record

    def _prepare(self, move: _Move) -> Generator[ReshardStep, None, dict[int, JobReport]]:
        """Reserve the new version's memory, then run the reshard job on every participant."""
        old, new, total = move.old, move.new, move.total
        self.calls.allocate(
            new.metadata.ranks(),
            new,
            Allocation(reserve_only=True),
            f"reserve {new.name!r} version {new.version}",
        )
        job = ReshardJob(
            old,
            new,
            bucket_bytes=move.plan.bucket_bytes,
            timeout_s=move.timeout_s,
            src_unavailable=tuple(sorted(move.unavailable)),
        )
        what = f"reshard of {new.name!r} (version {old.version} -> {new.version})"
        log.info(
            "%s: %d bytes over ranks %s, buckets of %d bytes",
            what,
            total,
            move.participants,
            move.plan.bucket_bytes,
        )
        runner = self.collectives.run(job, move.participants, what)
        try:
            while True:
                done, _ = next(runner)
                yield ReshardStep(ReshardPhase.MOVING, new.version, min(done, total), total)
        except StopIteration as stop:
            return stop.value

    def _abort(self, new: TensorRecord, participants: list[int]) -> None:
        """Forget the new version: catalog record removed, staged shards dropped on every participant."""
        self.catalog.remove(new.name, new.version)
        self.calls.drop_quietly(new.name, new.version, participants)
        log.warning("reshard of %r aborted; version %d dropped", new.name, new.version)

    def _commit(self, new: TensorRecord, old: TensorRecord) -> TensorRecord:
        """The catalog's one transaction: the new version READY (marker still set), older READY rows gone."""
        ready, _ = self.catalog.commit(new.name, new.version)
        log.info(
            "reshard of %r committed in the catalog: version %d replaces %d",
            new.name,
            new.version,
            old.version,
        )
        if os.environ.get(EXIT_AFTER_COMMIT_ENV):
            log.error("%s is set: exiting after the catalog commit", EXIT_AFTER_COMMIT_ENV)
            logging.shutdown()
            os._exit(EXIT_AFTER_COMMIT_CODE)
        self._old_versions[new.name] = old
        return ready

    def _promote(self, ready: TensorRecord) -> TensorRecord | None:
        """PromoteVersion on the new version's ranks, drop the old version, clear the marker: the promoted
        record, or None when a rank failed (retried later)."""
        ranks = ready.ranks()
        try:
            checksums = self.calls.promote(
                ranks, ready.name, ready.version, f"promote {ready.name!r} version {ready.version}"
            )
        except ServiceError as err:
            log.error(
                "promotion of %r version %d is unfinished (%s); the coordinator retries it every few seconds",
                ready.name,
                ready.version,
                err.message,
            )
            return None
        self.drop_replaced(ready.name)
        promoted = replace(ready, promoting=False).with_checksums(checksums)
        self.catalog.update(promoted)
        log.info("%r version %d promoted on ranks %s", ready.name, ready.version, ranks)
        return promoted

    def drop_replaced(self, name: str) -> None:
        """Drop the version a committed reshard of `name` replaced, on its ranks (name lock held): at the
        promotion, or when the reshard's own version leaves the catalog before its promotion finished."""
        old = self._old_versions.pop(name, None)
        if old is not None:
            self.calls.drop_quietly(name, old.version, old.ranks())

    def is_running(self, name: str) -> bool:
        """Whether a reshard of `name` runs now."""
        with self._running_lock:
            return name in self._running

    def finish_promotions(self) -> None:
        """Promote committed reshards whose promotion is unfinished (a coordinator restart, a rank that failed
        PromoteVersion), abort ones that never committed; run at registrations and every few seconds."""
        try:
            for record in self.catalog.promoting():
                if self.is_running(record.name):
                    continue
                try:
                    with self.locks.hold(record.name, wait_s=0.1):
                        self._finish_one(record)
                except TensorBusy:
                    continue  # busy: the next round finishes it
        except Exception:  # noqa: BLE001 - a background task must log, not vanish
            log.exception("finishing reshard promotions failed")

    def _finish_one(self, record: TensorRecord) -> None:
        current = self.catalog.get(record.name, record.version)
        if current is None or not current.promoting:
            return
        if not current.ready:
            log.warning(
                "reshard of %r to version %d never committed (coordinator restarted); aborting it",
                current.name,
                current.version,
            )
            self.catalog.remove(current.name, current.version)
            self.calls.drop_quietly(current.name, current.version, current.ranks())
            return
        if all(self.registry.rank_alive(r) for r in current.ranks()) and self._promote(current):
            log.info(
                "finished the promotion of %r version %d after a coordinator restart",
                current.name,
                current.version,
            )

    def _check_ranks(self, participants: Sequence[int], dst_ranks: Sequence[int]) -> None:
        """The first rank of the reshard that is not alive, named: a requested one that is not registered is
        INVALID_ARGUMENT (metadata), one holding the current version or down is UNAVAILABLE."""
        for rank in sorted(set(participants) | set(dst_ranks)):
            try:
                entry = self.registry.entry(rank)
            except RankUnavailable:
                if rank in dst_ranks:
                    raise InvalidArgument(
                        f"metadata: rank {rank} is not a registered rank"
                    ) from None
                raise RankUnavailable(
                    f"rank {rank}, which holds the current version, is not registered "
                    f"(it has not come back since the coordinator started)"
                ) from None
            if not self.registry.is_alive(entry):
                raise RankUnavailable(
                    f"rank {rank} is down; resharding onto/from it is impossible until it "
                    f"is back (restart that rank if it died: it rejoins under its rank number)"
                )


def _plan(
    src: ShardedTensorMetadata,
    dst: ShardedTensorMetadata,
    bucket_bytes: int,
    unavailable: frozenset[int],
) -> ReshardPlan:
    if src.size != dst.size:
        raise InvalidArgument(f"metadata.size {dst.size} differs from the tensor's size {src.size}")
    if src.dtype != dst.dtype:
        raise InvalidArgument(
            f"metadata.tensor_properties.dtype {dst.dtype} differs from the tensor's "
            f"dtype {src.dtype}"
        )
    try:
        return plan_reshard_per_round(src, dst, bucket_bytes, unavailable)
    except ValueError as err:
        raise InvalidArgument(f"metadata: {err}") from None
