"""The coordinator's tensor lifecycle: create/commit/abort/delete, and reconciling what ranks hold.

`Coordinator` assembles the coordinator process's parts (rank registry, name
locks, catalog, collective runner, reshard and checkpoint drivers) and holds
the lifecycle logic. Operations on one tensor name are serialized by its name
lock; different names proceed in parallel. A tensor becomes visible only when
every rank has promoted its shards and the catalog row turns READY in one
transaction.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc

from shardserve.core.metadata import ShardedTensorMetadata
from shardserve.core.wire import metadata_to_proto
from shardserve.protos import shardserve_pb2 as pb
from shardserve.server.common.access import caller
from shardserve.server.common.auth import Security
from shardserve.server.common.errors import (
    AlreadyExists,
    DataLoss,
    InvalidArgument,
    InvalidState,
    NotFound,
    ServiceError,
    StaleVersion,
    TensorBusy,
)
from shardserve.server.common.metrics import MetricsEndpoint
from shardserve.server.common.requests import (
    check_init,
    check_name,
    check_options,
    check_put_token,
    check_version,
    parse_metadata,
)
from shardserve.server.coordinator.catalog import Catalog, holding_ranks, ranks_of
from shardserve.server.coordinator.checkpoint import CheckpointDriver
from shardserve.server.coordinator.collectives import CollectiveRunner
from shardserve.server.coordinator.health import (
    boxes_without_copy,
    describe,
    shards_on,
    unavailable_shards,
    with_lost,
)
from shardserve.server.coordinator.locks import NameLocks
from shardserve.server.coordinator.quotas import ByteQuotas, held_bytes
from shardserve.server.coordinator.registry import RankRegistry, versions_by_rank
from shardserve.server.coordinator.repair import DEFAULT_REPAIR_AFTER_S, RepairDriver
from shardserve.server.coordinator.reshard import ReshardDriver
from shardserve.server.coordinator.snapshots import SnapshotDriver
from shardserve.server.coordinator.update_groups import UpdateGroups

log = logging.getLogger(__name__)

RECONCILE_ATTEMPTS = 4  # GetStats tries for a rank that is alive again
ABORTED_TOKENS_KEPT = (
    4096  # put tokens remembered as aborted, so their late CreateTensor is refused
)


class Coordinator:
    """Registry, catalog and the tensor lifecycle, talking to ranks over gRPC."""

    def __init__(
        self,
        catalog: Catalog,
        security: Security = Security(),
        heartbeat_interval: float = 1.0,
        dead_after: float | None = None,
        rpc_timeout: float = 60.0,
        pending_timeout: float = 600.0,
        store_port: int = 0,
        store_host: str = "0.0.0.0",
        repair_after: float = DEFAULT_REPAIR_AFTER_S,
    ) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self.catalog = catalog
        self.heartbeat_interval = heartbeat_interval
        self.pending_timeout = pending_timeout
        self.registry = RankRegistry(
            security, dead_after if dead_after is not None else 3 * heartbeat_interval, rpc_timeout
        )
        self.locks = NameLocks()
        self.update_groups = (
            UpdateGroups()
        )  # row updates of one table: grouped into versions, in one order
        self.collectives = CollectiveRunner(
            self.registry, catalog.next_version, store_port, store_host
        )
        self.reshards = ReshardDriver(catalog, self.registry, self.locks, self.collectives)
        self.quotas = ByteQuotas(catalog)
        self.checkpoints = CheckpointDriver(
            catalog, self.registry, self.locks, self.collectives, versions=self, quotas=self.quotas
        )
        self.repairs = RepairDriver(catalog, self.registry, self.reshards, repair_after)
        self.snapshots = SnapshotDriver(catalog, self.registry, self.locks, self, pending_timeout)
        self._aborted_tokens: OrderedDict[tuple[str, str], None] = (
            OrderedDict()
        )  # (name, put_token), newest last
        # background work that takes name locks gets its own pool, so it never starves the fan-out
        self._background = futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="coord-background"
        )
        self.metrics_endpoint: MetricsEndpoint | None = None  # set by whoever serves its metrics
        self.metrics_address = ""  # HOST:PORT of that endpoint as ListRanks tells clients
        self._stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._monitor_loop, name="coord-monitor", daemon=True
        )
        self._monitor.start()
        self.repairs.start()

    # ------------------------------------------------------------ ranks

    def register(self, info: pb.RankInfo, held: Iterable[pb.HeldVersion]) -> float:
        """Add (or replace) a rank; reconcile what it holds with the catalog; return the heartbeat interval."""
        held_pairs = self.registry.register(info, held)
        self._background.submit(self._reconcile, info.rank, held_pairs)
        self._background.submit(self.reshards.finish_promotions)
        return self.heartbeat_interval

    def heartbeat(self, rank: int, memory_used: int) -> None:
        """Record that `rank` is alive; one that had been reported dead is reconciled."""
        if self.registry.heartbeat(rank, memory_used):
            log.info("rank %d is alive again; reconciling what it holds", rank)
            self._background.submit(self._reconcile_from_stats, rank)

    # ------------------------------------------------------------ tensor lifecycle

    def create(self, request: pb.CreateTensorRequest) -> pb.TensorInfo:
        """Validate, record PENDING, allocate on every holding rank; with an init, commit too."""
        name = check_name(request.name)
        meta = parse_metadata(request.metadata)
        check_init(request.init, meta.dtype)
        check_options(request.options, meta)
        token = check_put_token(request.put_token)
        if request.init != pb.INIT_COPY:
            self.registry.check_placements(meta)
            return self._create(name, meta, token, request)
        if request.source_version:  # a copy of one given version: an update group of its own
            return self._make_update(name, meta, token, request)
        joined = self.update_groups.enter(name, token, self._abort_stale_update)
        if joined is None:
            return self._make_update(name, meta, token, request, claimed=True)
        version, order = joined
        info = self.catalog.get(name, version)
        if info is None:
            raise TensorBusy(
                f"update version {version} of tensor {name!r} was aborted while joining it; ask again"
            )
        answer = self.describe(info)
        answer.update_order = order
        return answer

    def _make_update(
        self,
        name: str,
        meta: ShardedTensorMetadata,
        token: str,
        request: pb.CreateTensorRequest,
        claimed: bool = False,
    ) -> pb.TensorInfo:
        """Make the pending INIT_COPY version of an update group (member 0), claiming the group unless
        `claimed`; later updates of the table join it (UpdateGroups)."""
        if not claimed:
            self.update_groups.enter(name, token, self._abort_stale_update, join=False)
        try:
            info = self._create(name, meta, token, request)
        except BaseException:
            self.update_groups.cancel(name)
            raise
        self.update_groups.bind(name, info.version)
        return info

    def _abort_stale_update(self, name: str, version: int) -> None:
        log.warning(
            "aborting update %r version %d: pending for more than the update timeout", name, version
        )
        try:
            self.abort(name, version)
        except ServiceError as err:
            log.info("aborting stale update %r version %d: %s", name, version, err.message)

    def _create(
        self, name: str, meta: ShardedTensorMetadata, token: str, request: pb.CreateTensorRequest
    ) -> pb.TensorInfo:
        with self.locks.hold(name):
            if token and (name, token) in self._aborted_tokens:
                raise TensorBusy(
                    f"put_token {token!r} of {name!r} was aborted (AbortTensor) before this "
                    f"CreateTensor ran"
                )
            options, missing, source_version = request.options, [], 0
            principal = caller()
            owner = principal.name if principal is not None else ""
            if request.init == pb.INIT_COPY:
                source = self._copy_source(name, meta, request)
                meta = parse_metadata(
                    source.metadata
                )  # source_version 0: the READY version's own layout
                options, missing, source_version = (
                    source.options,
                    self._missing_copies(source),
                    source.version,
                )
                self.registry.check_placements(meta, skip=set(missing))
                principal, owner = None, source.owner  # an update keeps the table's owner and size
            self.make_room(name, request.overwrite)
            info = pb.TensorInfo(
                name=name,
                version=self.catalog.next_version(),
                metadata=metadata_to_proto(meta),
                options=options,
                state=pb.PENDING,
                nbytes=meta.nbytes,
                created_unix=time.time(),
                put_token=token,
                lost_shards=missing,
                owner=owner,
            )
            with self.quotas.admit(principal, {name: held_bytes(info)}):
                self.catalog.add(info)
            allocate = pb.AllocateShardsRequest(
                name=name,
                version=info.version,
                metadata=info.metadata,
                init=request.init,
                seed=request.seed,
                options=options,
                source_version=source_version,
            )
            try:
                self.registry.allocate_on(
                    holding_ranks(info), allocate, f"allocate {name!r} version {info.version}"
                )
            except ServiceError:
                self.discard(info)
                raise
            log.info(
                "created %r version %d (%d bytes on ranks %s)",
                name,
                info.version,
                meta.nbytes,
                list(meta.ranks()),
            )
            if request.init in (pb.INIT_NONE, pb.INIT_COPY):
                return self.describe(info)
            return self._commit_locked(name, info.version)

    def commit(self, name: str, version: int) -> pb.TensorInfo:
        """Promote (name, version) on every holding rank, then mark it READY and drop older versions. An
        update group's version is promoted by its last member's commit (UpdateGroups.finish)."""
        check_name(name)
        check_version(version)
        return self.update_groups.finish(
            name, version, lambda: self._commit_named(name, version), self._abort_stale_update
        )

    def _commit_named(self, name: str, version: int) -> pb.TensorInfo:
        with self.locks.hold(name):
            return self._commit_locked(name, version)

    def abort(self, name: str, version: int) -> None:
        """Forget a PENDING version and drop its shards on the ranks."""
        check_name(name)
        check_version(version)
        with self.locks.hold(name):
            self._abort_locked(name, version)

    def abort_put(self, name: str, token: str) -> int:
        """Abort the PENDING version of `name` made with put_token `token`, if any (a client whose CreateTensor
        answer was lost does not know its version), and refuse that token from now on: the version aborted,
        or 0."""
        check_name(name)
        if not check_put_token(token):
            raise InvalidArgument("put_token is empty; give version or put_token")
        joined = self.update_groups.version_of_token(name, token)
        if joined:  # a member of an update group: its version holds the other members' rows too
            with contextlib.suppress(NotFound):
                self.abort(name, joined)
            return joined
        with self.locks.hold(name):
            self._aborted_tokens[(name, token)] = None
            while len(self._aborted_tokens) > ABORTED_TOKENS_KEPT:
                self._aborted_tokens.popitem(last=False)
            for info in self.catalog.versions(name):
                if info.put_token == token and info.state != pb.READY:
                    self._abort_locked(name, info.version)
                    return info.version
        return 0

    def _abort_locked(self, name: str, version: int) -> None:
        info = self.catalog.get(name, version)
        if info is None:
            raise NotFound(f"tensor {name!r} version {version} not found")
        if info.state == pb.READY:
            raise InvalidState(
                f"tensor {name!r} version {version} is committed; use DeleteTensor to remove it"
            )
        self.discard(info)
        log.info("aborted %r version %d", name, version)

    def get(self, name: str) -> pb.TensorInfo:
        """The READY version of `name`, with its health."""
        check_name(name)
        info = self.catalog.ready(name)
        if info is None:
            raise NotFound(f"tensor {name!r} not found")
        return self.describe(info)

    def list(self, include_pending: bool = False) -> list[pb.TensorInfo]:
        """Every READY version (and PENDING ones when asked), each with its health."""
        return [self.describe(info) for info in self.catalog.list(include_pending)]

    def describe(self, info: pb.TensorInfo) -> pb.TensorInfo:
        """A catalog row as answered: its unavailable shards (lost, on dead ranks, or on ranks still restoring:
        reads are admitted only once every shard is back), health, replicas, and the repair in flight."""
        out = describe(info, self.registry.rank_unreadable)
        repair = self.repairs.state(info.name)
        if repair is not None:
            out.repair.CopyFrom(repair)
        return out

    def delete(self, name: str) -> None:
        """Remove every version of `name` from the catalog, then free them on the ranks."""
        check_name(name)
        with self.locks.hold(name):
            if self.catalog.ready(name) is None:
                raise NotFound(f"tensor {name!r} not found")
            removed = self.catalog.remove(name)
            self.update_groups.end(name)
            ranks = sorted({r for info in removed for r in ranks_of(info)})
            self.registry.drop_quietly(name, 0, ranks)
            self.reshards.drop_replaced(
                name
            )  # a reshard's replaced version, if its promotion was unfinished
        log.info("deleted %r (versions %s)", name, [i.version for i in removed])

    # ------------------------------------------------------------ helpers

    def _commit_locked(self, name: str, version: int) -> pb.TensorInfo:
        info = self.catalog.get(name, version)
        if info is None:
            raise NotFound(
                f"tensor {name!r} version {version} not found (never created, aborted or replaced)"
            )
        if info.state == pb.READY:
            return info
        newer = [
            row.version
            for row in self.catalog.versions(name)
            if row.state == pb.READY and row.version > version
        ]
        if (
            newer
        ):  # committing below it would be acknowledged yet never served: the newer version wins
            self.discard(info)
            raise TensorBusy(
                f"tensor {name!r} version {version} was overtaken while pending: version {newer[-1]} "
                f"(a reshard or checkpoint load) was committed meanwhile; version {version} is aborted, "
                f"make the change again"
            )
        self.registry.promote_on(
            holding_ranks(info), name, version, f"commit {name!r} version {version}"
        )
        ready, older = self.catalog.commit(name, version)
        self.drop_rows(older)
        log.info(
            "committed %r version %d%s",
            name,
            version,
            f", replacing versions {[o.version for o in older]}" if older else "",
        )
        return self.describe(ready)

    def _copy_source(
        self, name: str, meta: ShardedTensorMetadata, request: pb.CreateTensorRequest
    ) -> pb.TensorInfo:
        """INIT_COPY: the READY version `source_version` of `name`, checked to have the same layout; with
        source_version 0, whatever version is READY now, in its own layout (the request's is not checked)."""
        source = self.catalog.ready(name)
        if source is None:
            raise NotFound(f"tensor {name!r} not found (init INIT_COPY copies a READY version)")
        if not request.source_version:
            if not request.overwrite:
                raise InvalidArgument(
                    "overwrite must be set with init INIT_COPY (the copy replaces the READY "
                    "version)"
                )
            return source
        if request.source_version != source.version:
            raise StaleVersion(
                f"source_version {request.source_version} of {name!r} is not the READY "
                f"version; the READY version is {source.version}"
            )
        if parse_metadata(source.metadata) != meta:
            raise InvalidArgument(
                f"metadata differs from the layout of {name!r} version {source.version}; "
                f"INIT_COPY keeps the layout"
            )
        if not request.overwrite:
            raise InvalidArgument(
                "overwrite must be set with init INIT_COPY (the copy replaces the READY version)"
            )
        return source

    def _missing_copies(self, source: pb.TensorInfo) -> list[int]:
        """The copies of `source` an INIT_COPY version starts without (lost, or on dead ranks: written to the live
        copies only, repaired later); DATA_LOSS when a box has no live copy to copy."""
        missing = unavailable_shards(source, self.registry.rank_unreadable)
        lost = boxes_without_copy(source, missing)
        if lost:
            raise DataLoss(
                f"tensor {source.name!r} has boxes with no live copy ({lost}); it cannot be updated: "
                f"delete it or put it again"
            )
        if missing:
            log.warning(
                "%r: the new version starts without copies %s (their ranks are down or lost them); the "
                "coordinator repairs them",
                source.name,
                missing,
            )
        return missing

    def make_room(self, name: str, overwrite: bool) -> None:
        """ALREADY_EXISTS unless `overwrite`; with it, abort any put of `name` still pending."""
        rows = self.catalog.versions(name)
        ready = [r.version for r in rows if r.state == pb.READY]
        pending = [r for r in rows if r.state != pb.READY]
        if ready and not overwrite:
            raise AlreadyExists(
                f"tensor {name!r} already exists (version {ready[-1]}); "
                f"pass overwrite=True to replace it"
            )
        if pending and not overwrite:
            raise AlreadyExists(
                f"tensor {name!r} has a put in progress (version {pending[-1].version}); "
                f"pass overwrite=True to abort it"
            )
        for info in pending:
            self.discard(info)

    def discard(self, info: pb.TensorInfo) -> None:
        """Remove a version from the catalog, then free it on its ranks (and its update slot, if an update's)."""
        self.discard_all([info])

    def discard_all(self, rows: list[pb.TensorInfo]) -> None:
        """discard() of several versions, freed on their ranks with one call per rank."""
        for info in rows:
            self.catalog.remove(info.name, info.version)
            self.update_groups.end(info.name, info.version)
        self.drop_rows(rows)

    def drop_rows(self, rows: Iterable[pb.TensorInfo]) -> None:
        """Free versions just removed from the catalog on their ranks (one DropMany per rank); for a reshard's
        version whose promotion was unfinished, also the version it replaced (only the promotion would have
        dropped that one)."""
        rows = list(rows)
        self.registry.drop_many_quietly(
            versions_by_rank(rows, ranks_of)
        )  # one call per rank, however many rows
        for row in rows:
            if row.promoting:
                self.reshards.drop_replaced(row.name)

    def _reconcile_from_stats(self, rank: int) -> None:
        """Reconcile a rank that was unreachable for a while: drops sent meanwhile were skipped. Its first answer
        after a cut link may fail (a connection reset), so GetStats is asked a few times."""
        for attempt in range(RECONCILE_ATTEMPTS):
            held = self.registry.held_by(rank)
            if held is not None:
                self._reconcile(rank, held)
                return
            if self._stop.wait(1.0 + attempt):
                return
        log.error(
            "rank %d could not be reconciled: GetStats failed %d times", rank, RECONCILE_ATTEMPTS
        )

    def _reconcile(self, rank: int, held: set[tuple[str, int]]) -> None:
        """After a (re)registration: mark the copies the rank lost, drop what the catalog does not know.

        `held` was taken before the catalog is listed here, so a version put on the rank in between is
        READY in the catalog yet not in `held`: a version looks lost only if the rank, asked again after
        the listing, still does not hold it. Each row is reconciled on its own (one failure is logged)."""
        try:
            known, missing = set(), []
            for info in self.catalog.list(include_pending=True):
                if rank not in ranks_of(info):
                    continue
                known.add((info.name, info.version))
                if (info.name, info.version) in held:
                    if info.state == pb.READY:
                        self._reconcile_step(
                            rank,
                            info,
                            "re-promote",
                            lambda i=info: self.registry.promote_on(
                                [rank], i.name, i.version, f"re-promote {i.name!r}"
                            ),
                        )
                elif info.state == pb.READY:
                    missing.append(info)
            held_now = (
                self.registry.held_by(rank) if missing else set()
            )  # None: cannot tell, nothing forgotten
            if held_now is not None:
                for info in missing:
                    if (info.name, info.version) not in held_now:
                        self._reconcile_step(
                            rank, info, "mark lost", lambda i=info: self._mark_lost(rank, i)
                        )
            for name, version in held - known:
                self.registry.drop_quietly(name, version, [rank])
        except Exception:  # noqa: BLE001 - a background task must log, not vanish
            log.exception("reconciling rank %d failed", rank)
        finally:
            self.registry.restore_done(
                rank
            )  # its restored versions are promoted (or reported lost)

    def _mark_lost(self, rank: int, info: pb.TensorInfo) -> None:
        """Record that `rank` lost its copies of a READY version (it came back without them), if it is still that
        row: the tensor stays in the catalog, its boxes read from other copies or reported lost."""
        with self.locks.hold(info.name):
            current = self.catalog.get(info.name, info.version)
            if current is None or current.state != pb.READY:
                return
            shards = shards_on(current, rank)
            if set(shards) <= set(current.lost_shards):
                return
            marked = with_lost(current, shards)
            self.catalog.update(marked)
            log.warning(
                "rank %d lost its copies of tensor %r version %d (restarted?): shards %s; the tensor is "
                "now %s",
                rank,
                info.name,
                info.version,
                shards,
                self.describe(marked).health,
            )

    def _reconcile_step(
        self, rank: int, info: pb.TensorInfo, what: str, step: Callable[[], object]
    ) -> None:
        try:
            step()
        except (ServiceError, grpc.RpcError) as err:
            log.warning(
                "reconciling rank %d: could not %s %r version %d: %s",
                rank,
                what,
                info.name,
                info.version,
                err,
            )

    def _monitor_loop(self) -> None:
        """Log ranks that stop heartbeating; every few seconds, start the chores (off this thread, which must
        not wait on a name lock or a rank)."""
        last_chores, chores = time.monotonic(), None
        while not self._stop.wait(min(self.heartbeat_interval, 1.0)):
            self.registry.report_dead()
            if time.monotonic() - last_chores >= min(5.0, self.pending_timeout) and (
                chores is None or chores.done()
            ):
                last_chores = time.monotonic()
                chores = self._background.submit(self._chores)

    def _chores(self) -> None:
        """Abort puts left PENDING past the timeout; finish reshard promotions left unfinished."""
        try:
            self._reap_pending()
        except Exception:  # noqa: BLE001 - a background task must log, not vanish
            log.exception("reaping pending versions failed")
        self.reshards.finish_promotions()

    def _reap_pending(self) -> None:
        cutoff = time.time() - self.pending_timeout
        for info in self.catalog.list(include_pending=True):
            if self.reshards.is_running(info.name):
                continue  # a reshard's own new version: its timeout bounds it
            if info.state != pb.READY and info.created_unix < cutoff:
                log.warning(
                    "aborting %r version %d: pending for more than %.0fs",
                    info.name,
                    info.version,
                    self.pending_timeout,
                )
                try:
                    self.abort(info.name, info.version)
                except ServiceError as err:
                    log.info("reaping %r version %d: %s", info.name, info.version, err.message)

    def stop_monitor(self) -> None:
        """Stop watching heartbeats and repairing (the cluster is shutting down on purpose)."""
        self._stop.set()
        self.repairs.stop()

    def close(self) -> None:
        """Stop the monitor and the registry's calls to ranks; close the catalog."""
        self._stop.set()
        self.repairs.stop()
        self._monitor.join(timeout=5)
        self._background.shutdown(wait=False, cancel_futures=True)
        self.registry.close()
        self.collectives.close()
        self.catalog.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
