"""The coordinator: rank registry with heartbeats, the tensor catalog, and create/commit/abort/delete.

`Coordinator` holds the logic and talks to the ranks' ShardServers (every call
with a deadline, fanned out in parallel); `CoordinatorServicer` is the thin
gRPC layer over it. Operations on one tensor name are serialized by a
per-name lock; different names proceed in parallel. A tensor becomes visible
only when every rank has promoted its shards and the catalog row turns READY
in one transaction.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

import grpc

from protos import shardserve_pb2 as pb
from protos import shardserve_pb2_grpc as pb_grpc
from server.common.auth import Security, make_channel
from server.coordinator.catalog import Catalog, ranks_of
from server.common.errors import (Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ServiceError,
                           Unavailable, rpc_errors)
from server.coordinator.checkpoint import CheckpointDriver, inspect as inspect_checkpoint
from server.coordinator.reshard import ReshardDriver
from server.common.requests import check_name, check_options, check_put_token, check_version, parse_metadata
from server.rank.store import check_init
from shardcore.metadata import RemoteDevice, ShardedTensorMetadata
from shardcore.wire import metadata_to_proto

log = logging.getLogger(__name__)

T = TypeVar("T")
ABORTED_TOKENS_KEPT = 4096  # put tokens remembered as aborted, so their late CreateTensor is refused
NAME_LOCK_WAIT_S = 10.0  # how long a change of a tensor waits for another one of it (under the clients' 30 s deadline)


@dataclass
class RankEntry:
    """A registered rank: what it told us, when it last spoke, and a stub to call it."""

    info: pb.RankInfo
    last_heartbeat: float  # time.monotonic()
    channel: grpc.Channel
    stub: pb_grpc.ShardServerStub
    exited: bool = False
    reported_dead: bool = False


class Coordinator:
    """Registry, catalog and the tensor lifecycle, talking to ranks over gRPC."""

    def __init__(self, catalog: Catalog, security: Security = Security(), heartbeat_interval: float = 1.0,
                 dead_after: float | None = None, rpc_timeout: float = 60.0,
                 pending_timeout: float = 600.0) -> None:
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval}")
        self.catalog = catalog
        self.security = security
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after if dead_after is not None else 3 * heartbeat_interval
        self.rpc_timeout = rpc_timeout
        self.pending_timeout = pending_timeout
        self._ranks: dict[int, RankEntry] = {}
        self._ranks_changed = threading.Condition()
        self._name_locks: dict[str, tuple[threading.Lock, int]] = {}  # name -> (its lock, callers using it)
        self._name_locks_guard = threading.Lock()
        self._aborted_tokens: OrderedDict[tuple[str, str], None] = OrderedDict()  # (name, put_token), newest last
        self._pool = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="coord-fanout")
        # background work that takes name locks gets its own pool, so it never starves the fan-out
        self._background = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="coord-background")
        self._stop = threading.Event()
        self.reshards = ReshardDriver(self)
        self.checkpoints = CheckpointDriver(self)
        self._monitor = threading.Thread(target=self._monitor_loop, name="coord-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------ registry

    def register(self, info: pb.RankInfo, held: Iterable[pb.HeldVersion]) -> float:
        """Add (or replace) a rank; reconcile what it holds with the catalog; return the heartbeat interval."""
        _check_rank_info(info)
        held = list(held)
        for i, version in enumerate(held):  # version 0 would make the reconcile drop every version of the name
            check_name(version.name, f"held[{i}].name")
            check_version(version.version, f"held[{i}].version")
        channel = make_channel(info.address, self.security)
        entry = RankEntry(pb.RankInfo(), time.monotonic(), channel, pb_grpc.ShardServerStub(channel))
        entry.info.CopyFrom(info)
        try:
            with self._ranks_changed:
                self._check_fits_the_world(info)
                old = self._ranks.get(info.rank)
                self._ranks[info.rank] = entry
                self._ranks_changed.notify_all()
        except ServiceError:
            channel.close()
            raise
        if old is not None:
            old.channel.close()
        log.info("rank %d registered: %s device %s pid %d on %s", info.rank, info.address, info.device,
                 info.pid, info.hostname)
        held_pairs = {(h.name, h.version) for h in held}
        self._background.submit(self._reconcile, info.rank, held_pairs)
        self._background.submit(self.reshards.finish_promotions)
        return self.heartbeat_interval

    def _check_fits_the_world(self, info: pb.RankInfo) -> None:
        """(lock held) A registration must agree with the live ranks: one world size, its own address, and not
        replace a live registration of the same rank from elsewhere (else a stray registration would take a rank
        over, or make the reconcile drop another rank's versions). A restarted rank whose old entry is still
        alive gets UNAVAILABLE, which its registration retries until that entry expires."""
        for rank, entry in self._ranks.items():
            if rank == info.rank or not self.is_alive(entry):
                continue
            if entry.info.world_size != info.world_size:
                raise FailedPrecondition(f"rank.world_size {info.world_size} differs from the world size "
                                         f"{entry.info.world_size} of registered rank {rank}")
            if entry.info.address == info.address:
                raise FailedPrecondition(f"rank.address {info.address} is registered by rank {rank}, which is "
                                         f"alive")
        own = self._ranks.get(info.rank)
        if own is not None and self.is_alive(own) and own.info.address != info.address:
            raise Unavailable(f"rank {info.rank} is registered at {own.info.address} and alive; a registration "
                              f"from rank.address {info.address} is taken once that one stops heartbeating")

    def heartbeat(self, rank: int, memory_used: int) -> None:
        """Record that `rank` is alive; NotFound tells an unknown rank to register again."""
        if memory_used < 0:
            raise InvalidArgument(f"memory_used_bytes must be >= 0, got {memory_used}")
        with self._ranks_changed:
            entry = self._ranks.get(rank)
            if entry is None or entry.exited:
                raise NotFound(f"rank {rank} is not registered; register again")
            was_dead = entry.reported_dead or not self.is_alive(entry)
            entry.last_heartbeat = time.monotonic()
            entry.info.memory_used_bytes = memory_used
            entry.info.last_heartbeat_unix = time.time()
            if was_dead:
                entry.reported_dead = False
                log.info("rank %d is alive again; reconciling what it holds", rank)
                self._background.submit(self._reconcile_from_stats, rank)

    def mark_exited(self, rank: int, reason: str) -> None:
        """Mark a rank dead at once (its process is known to have ended)."""
        with self._ranks_changed:
            entry = self._ranks.get(rank)
            if entry is None or entry.exited:
                return
            entry.exited = entry.reported_dead = True
        log.error("rank %d is dead: %s", rank, reason)

    def is_alive(self, entry: RankEntry) -> bool:
        return not entry.exited and time.monotonic() - entry.last_heartbeat <= self.dead_after

    def rank_alive(self, rank: int) -> bool:
        """Whether `rank` is registered and alive."""
        with self._ranks_changed:
            entry = self._ranks.get(rank)
        return entry is not None and self.is_alive(entry)

    def ranks(self) -> list[pb.RankInfo]:
        """Every registered rank with its liveness, by rank."""
        with self._ranks_changed:
            entries = sorted(self._ranks.values(), key=lambda e: e.info.rank)
            out = []
            for entry in entries:
                info = pb.RankInfo()
                info.CopyFrom(entry.info)
                info.alive = self.is_alive(entry)
                out.append(info)
        return out

    def wait_for_ranks(self, count: int, timeout: float) -> bool:
        """Block until `count` live ranks are registered, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._ranks_changed:
            while sum(self.is_alive(e) for e in self._ranks.values()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._ranks_changed.wait(min(left, 0.2))
        return True

    def _entry(self, rank: int) -> RankEntry:
        with self._ranks_changed:
            entry = self._ranks.get(rank)
        if entry is None:
            raise Unavailable(f"rank {rank} is not registered")
        return entry

    # ------------------------------------------------------------ tensor lifecycle

    def create(self, request: pb.CreateTensorRequest) -> pb.TensorInfo:
        """Validate, record PENDING, allocate on every holding rank; with an init, commit too."""
        name = check_name(request.name)
        meta = parse_metadata(request.metadata)
        check_init(request.init, meta.dtype)
        check_options(request.options, meta)
        token = check_put_token(request.put_token)
        self._check_placements(meta)
        with self._name_lock(name):
            if token and (name, token) in self._aborted_tokens:
                raise Aborted(f"put_token {token!r} of {name!r} was aborted (AbortTensor) before this "
                              f"CreateTensor ran")
            options = self._copy_source(name, meta, request).options if request.init == pb.INIT_COPY \
                else request.options
            self._make_room(name, request.overwrite)
            info = pb.TensorInfo(name=name, version=self.catalog.next_version(),
                                 metadata=metadata_to_proto(meta), options=options, state=pb.PENDING,
                                 nbytes=meta.nbytes, created_unix=time.time(), put_token=token)
            self.catalog.add(info)
            allocate = pb.AllocateShardsRequest(name=name, version=info.version, metadata=info.metadata,
                                                init=request.init, seed=request.seed, options=options,
                                                source_version=request.source_version)
            try:
                self._fan_out(meta.ranks(), lambda stub: stub.AllocateShards(allocate, timeout=self.rpc_timeout),
                              f"allocate {name!r} version {info.version}")
            except ServiceError:
                self._discard(info)
                raise
            log.info("created %r version %d (%d bytes on ranks %s)", name, info.version, meta.nbytes,
                     list(meta.ranks()))
            if request.init in (pb.INIT_NONE, pb.INIT_COPY):
                return info
            return self._commit_locked(name, info.version)

    def commit(self, name: str, version: int) -> pb.TensorInfo:
        """Promote (name, version) on every holding rank, then mark it READY and drop older versions."""
        check_name(name)
        check_version(version)
        with self._name_lock(name):
            return self._commit_locked(name, version)

    def abort(self, name: str, version: int) -> None:
        """Forget a PENDING version and drop its shards on the ranks."""
        check_name(name)
        check_version(version)
        with self._name_lock(name):
            self._abort_locked(name, version)

    def abort_put(self, name: str, token: str) -> int:
        """Abort the PENDING version of `name` made with put_token `token`, if any (a client whose CreateTensor
        answer was lost does not know its version), and refuse that token from now on: the version aborted,
        or 0."""
        check_name(name)
        if not check_put_token(token):
            raise InvalidArgument("put_token is empty; give version or put_token")
        with self._name_lock(name):
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
            raise FailedPrecondition(f"tensor {name!r} version {version} is committed; "
                                     f"use DeleteTensor to remove it")
        self._discard(info)
        log.info("aborted %r version %d", name, version)

    def get(self, name: str) -> pb.TensorInfo:
        """The READY version of `name`."""
        check_name(name)
        info = self.catalog.ready(name)
        if info is None:
            raise NotFound(f"tensor {name!r} not found")
        return info

    def list(self, include_pending: bool = False) -> list[pb.TensorInfo]:
        return self.catalog.list(include_pending)

    def delete(self, name: str) -> None:
        """Remove every version of `name` from the catalog, then free them on the ranks."""
        check_name(name)
        with self._name_lock(name):
            if self.catalog.ready(name) is None:
                raise NotFound(f"tensor {name!r} not found")
            removed = self.catalog.remove(name)
            ranks = sorted({r for info in removed for r in ranks_of(info)})
            self._drop_quietly(name, 0, ranks)
            self.reshards.drop_replaced(name)  # a reshard's replaced version, if its promotion was unfinished
        log.info("deleted %r (versions %s)", name, [i.version for i in removed])

    # ------------------------------------------------------------ helpers

    def _commit_locked(self, name: str, version: int) -> pb.TensorInfo:
        info = self.catalog.get(name, version)
        if info is None:
            raise NotFound(f"tensor {name!r} version {version} not found (never created, aborted or replaced)")
        if info.state == pb.READY:
            return info
        newer = [row.version for row in self.catalog.versions(name) if row.state == pb.READY and row.version > version]
        if newer:  # committing below it would be acknowledged yet never served: the newer version wins
            self._discard(info)
            raise Aborted(f"tensor {name!r} version {version} was overtaken while pending: version {newer[-1]} "
                          f"(a reshard or checkpoint load) was committed meanwhile; version {version} is aborted, "
                          f"make the change again")
        self.promote_on(ranks_of(info), name, version, f"commit {name!r} version {version}")
        ready, older = self.catalog.commit(name, version)
        self.drop_rows(older)
        log.info("committed %r version %d%s", name, version,
                 f", replacing versions {[o.version for o in older]}" if older else "")
        return ready

    def _copy_source(self, name: str, meta: ShardedTensorMetadata,
                     request: pb.CreateTensorRequest) -> pb.TensorInfo:
        """INIT_COPY: the READY version `source_version` of `name`, checked to have the same layout."""
        source = self.catalog.ready(name)
        if source is None:
            raise NotFound(f"tensor {name!r} not found (init INIT_COPY copies a READY version)")
        if request.source_version != source.version:
            raise FailedPrecondition(f"source_version {request.source_version} of {name!r} is not the READY "
                                     f"version; the READY version is {source.version}")
        if parse_metadata(source.metadata) != meta:
            raise InvalidArgument(f"metadata differs from the layout of {name!r} version {source.version}; "
                                  f"INIT_COPY keeps the layout")
        if not request.overwrite:
            raise InvalidArgument("overwrite must be set with init INIT_COPY (the copy replaces the READY version)")
        return source

    def _make_room(self, name: str, overwrite: bool) -> None:
        """ALREADY_EXISTS unless `overwrite`; with it, abort any put of `name` still pending."""
        rows = self.catalog.versions(name)
        ready = [r.version for r in rows if r.state == pb.READY]
        pending = [r for r in rows if r.state != pb.READY]
        if ready and not overwrite:
            raise AlreadyExists(f"tensor {name!r} already exists (version {ready[-1]}); "
                                f"pass overwrite=True to replace it")
        if pending and not overwrite:
            raise AlreadyExists(f"tensor {name!r} has a put in progress (version {pending[-1].version}); "
                                f"pass overwrite=True to abort it")
        for info in pending:
            self._discard(info)

    def _discard(self, info: pb.TensorInfo) -> None:
        self.catalog.remove(info.name, info.version)
        self.drop_rows([info])

    def drop_rows(self, rows: Iterable[pb.TensorInfo]) -> None:
        """Free versions just removed from the catalog on their ranks; for a reshard's version whose promotion
        was unfinished, also the version it replaced (only the promotion would have dropped that one)."""
        for row in rows:
            self._drop_quietly(row.name, row.version, ranks_of(row))
            if row.promoting:
                self.reshards.drop_replaced(row.name)

    def _check_placements(self, meta: ShardedTensorMetadata) -> None:
        with self._ranks_changed:
            entries = dict(self._ranks)
        for i, shard in enumerate(meta.shards_metadata):
            entry = entries.get(shard.rank)
            field = f"metadata.shards_metadata[{i}].placement"
            if entry is None:
                raise InvalidArgument(f"{field} {shard.placement}: rank {shard.rank} is not a registered rank "
                                      f"(registered: {sorted(entries)})")
            if not self.is_alive(entry):
                raise Unavailable(f"{field} {shard.placement}: rank {shard.rank} is not alive")
            if shard.device != RemoteDevice(f"rank:{shard.rank}/{entry.info.device}").device():
                raise InvalidArgument(f"{field} {shard.placement}: rank {shard.rank}'s device is "
                                      f"{entry.info.device}")

    @contextlib.contextmanager
    def _name_lock(self, name: str, wait_s: float | None = None) -> Iterator[None]:
        """Hold `name`'s lock (changes of one tensor take turns); ABORTED when another change keeps it longer
        than `wait_s` (default NAME_LOCK_WAIT_S): a reshard or checkpoint holds it for its whole run, and a
        gRPC worker must not wait on it without bound."""
        with self._name_locks_guard:
            lock, users = self._name_locks.get(name, (threading.Lock(), 0))
            self._name_locks[name] = (lock, users + 1)
        try:
            if not lock.acquire(timeout=NAME_LOCK_WAIT_S if wait_s is None else wait_s):
                raise Aborted(f"tensor {name!r} is busy: a reshard, checkpoint or other change of it is running; "
                              f"retry once it has ended")
            try:
                yield
            finally:
                lock.release()
        finally:
            with self._name_locks_guard:  # forgotten once unused: one lock per name ever asked about would grow
                lock, users = self._name_locks[name]
                if users == 1:
                    del self._name_locks[name]
                else:
                    self._name_locks[name] = (lock, users - 1)

    def promote_on(self, ranks: Iterable[int], name: str, version: int, what: str) -> None:
        """PromoteVersion of (name, version) on `ranks` at once; the first failure raised, naming the rank."""
        request = pb.PromoteVersionRequest(name=name, version=version)
        self._fan_out(ranks, lambda stub: stub.PromoteVersion(request, timeout=self.rpc_timeout), what)

    def _fan_out(self, ranks: Iterable[int], call: Callable[[pb_grpc.ShardServerStub], T], what: str) -> dict[int, T]:
        """Run `call` on every rank in parallel; raise the first failure as a ServiceError naming the rank."""
        entries = {r: self._entry(r) for r in ranks}
        results, failures = {}, []
        for rank, entry in entries.items():
            if not self.is_alive(entry):  # fail fast: a stopped rank would hold the call until its deadline
                failures.append(Unavailable(f"rank {rank} ({entry.info.address}) is not alive"))
        jobs = {r: self._pool.submit(call, e.stub) for r, e in entries.items() if self.is_alive(e)}
        deadline = time.monotonic() + self.rpc_timeout + 5.0  # the calls carry their own deadline too
        for rank, job in jobs.items():
            try:
                results[rank] = job.result(timeout=max(0.0, deadline - time.monotonic()))
            except grpc.RpcError as err:
                failures.append(_rank_error(rank, entries[rank].info.address, err))
            except futures.TimeoutError:
                failures.append(Unavailable(f"rank {rank} ({entries[rank].info.address}) did not answer "
                                            f"within {self.rpc_timeout:.0f}s"))
        if failures:
            log.warning("%s failed: %s", what, "; ".join(f.message for f in failures))
            raise failures[0]
        return results

    def _drop_quietly(self, name: str, version: int, ranks: Iterable[int]) -> None:
        """DropVersion on `ranks`, logging (not raising) failures: the catalog is already right."""
        request = pb.DropVersionRequest(name=name, version=version)
        try:
            self._fan_out(ranks, lambda stub: stub.DropVersion(request, timeout=self.rpc_timeout),
                          f"drop {name!r} version {version}")
        except ServiceError as err:
            log.warning("could not drop %r version %d everywhere: %s", name, version, err.message)

    def _reconcile_from_stats(self, rank: int) -> None:
        """Reconcile a rank that was unreachable for a while: drops sent meanwhile were skipped."""
        try:
            stats = self._entry(rank).stub.GetStats(pb.GetStatsRequest(), timeout=self.rpc_timeout)
        except (grpc.RpcError, ServiceError) as err:
            log.warning("could not reconcile rank %d: %s", rank, err)
            return
        self._reconcile(rank, {(h.name, h.version) for h in stats.held})

    def _reconcile(self, rank: int, held: set[tuple[str, int]]) -> None:
        """After a (re)registration: forget tensors the rank lost, drop what the catalog does not know.

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
                        self._reconcile_step(rank, info, "re-promote", lambda i=info: self.promote_on(
                            [rank], i.name, i.version, f"re-promote {i.name!r}"))
                elif info.state == pb.READY:
                    missing.append(info)
            held_now = self._held_by(rank) if missing else set()
            if held_now is not None:
                for info in missing:
                    if (info.name, info.version) not in held_now:
                        self._reconcile_step(rank, info, "forget", lambda i=info: self._forget_lost(rank, i))
            for name, version in held - known:
                self._drop_quietly(name, version, [rank])
        except Exception:  # noqa: BLE001 - a background task must log, not vanish
            log.exception("reconciling rank %d failed", rank)

    def _held_by(self, rank: int) -> set[tuple[str, int]] | None:
        """The (name, version) pairs `rank` holds now (GetStats); None, logged, when it cannot tell."""
        try:
            stats = self._entry(rank).stub.GetStats(pb.GetStatsRequest(), timeout=self.rpc_timeout)
        except (grpc.RpcError, ServiceError) as err:
            log.warning("reconciling rank %d: could not ask what it holds (%s); nothing forgotten", rank, err)
            return None
        return {(h.name, h.version) for h in stats.held}

    def _forget_lost(self, rank: int, info: pb.TensorInfo) -> None:
        """Remove a READY version the rank lost from the catalog, if it is still that row."""
        with self._name_lock(info.name):
            current = self.catalog.get(info.name, info.version)
            if current is None or current.state != pb.READY:
                return
            log.warning("rank %d lost tensor %r version %d (restarted?); removing it from the catalog",
                        rank, info.name, info.version)
            self._discard(current)

    def _reconcile_step(self, rank: int, info: pb.TensorInfo, what: str, step: Callable[[], object]) -> None:
        try:
            step()
        except (ServiceError, grpc.RpcError) as err:
            log.warning("reconciling rank %d: could not %s %r version %d: %s", rank, what, info.name,
                        info.version, err)

    def _monitor_loop(self) -> None:
        """Log ranks that stop heartbeating; every few seconds, start the chores (off this thread, which must
        not wait on a name lock or a rank)."""
        last_chores, chores = time.monotonic(), None
        while not self._stop.wait(min(self.heartbeat_interval, 1.0)):
            with self._ranks_changed:
                for entry in self._ranks.values():
                    if not entry.reported_dead and not self.is_alive(entry):
                        entry.reported_dead = True
                        log.error("rank %d (%s) missed heartbeats for %.1fs: marked dead", entry.info.rank,
                                  entry.info.address, time.monotonic() - entry.last_heartbeat)
            if time.monotonic() - last_chores >= min(5.0, self.pending_timeout) and (chores is None
                                                                                      or chores.done()):
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
                log.warning("aborting %r version %d: pending for more than %.0fs", info.name, info.version,
                            self.pending_timeout)
                try:
                    self.abort(info.name, info.version)
                except ServiceError as err:
                    log.info("reaping %r version %d: %s", info.name, info.version, err.message)

    def stop_monitor(self) -> None:
        """Stop watching heartbeats (the cluster is shutting down on purpose)."""
        self._stop.set()

    def close(self) -> None:
        """Stop the monitor, the fan-out pool and the rank channels; close the catalog."""
        self._stop.set()
        self._monitor.join(timeout=5)
        self._background.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._ranks_changed:
            for entry in self._ranks.values():
                entry.channel.close()
        self.catalog.close()


def _rank_error(rank: int, address: str, err: grpc.RpcError) -> ServiceError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"rank {rank} ({address}) is unavailable: {details}")
    return ServiceError(f"rank {rank}: {details}", code)


def _check_rank_info(info: pb.RankInfo) -> None:
    if info.rank < 0:
        raise InvalidArgument(f"rank.rank {info.rank} is negative")
    if info.world_size <= 0 or info.rank >= info.world_size:
        raise InvalidArgument(f"rank.world_size {info.world_size} must be > rank.rank {info.rank}")
    if not info.address or ":" not in info.address:
        raise InvalidArgument(f"rank.address {info.address!r} is not HOST:PORT")
    try:
        RemoteDevice(f"rank:{info.rank}/{info.device}")
    except ValueError:
        raise InvalidArgument(f"rank.device {info.device!r} is not 'cpu' or 'cuda:K'") from None
    if info.memory_limit_bytes < 0:
        raise InvalidArgument(f"rank.memory_limit_bytes {info.memory_limit_bytes} is negative")


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """The Coordinator gRPC service: a thin layer over `Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    @rpc_errors
    def RegisterRank(self, request: pb.RegisterRankRequest,
                     context: grpc.ServicerContext) -> pb.RegisterRankResponse:
        interval = self.coordinator.register(request.rank, request.held)
        return pb.RegisterRankResponse(heartbeat_interval_s=interval)

    @rpc_errors
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self.coordinator.heartbeat(request.rank, request.memory_used_bytes)
        return pb.HeartbeatResponse()

    @rpc_errors
    def ListRanks(self, request: pb.ListRanksRequest, context: grpc.ServicerContext) -> pb.ListRanksResponse:
        return pb.ListRanksResponse(ranks=self.coordinator.ranks(),
                                    collectives_error=self.coordinator.reshards.collectives_error)

    @rpc_errors
    def CreateTensor(self, request: pb.CreateTensorRequest, context: grpc.ServicerContext) -> pb.TensorInfo:
        return self.coordinator.create(request)

    @rpc_errors
    def CommitTensor(self, request: pb.CommitTensorRequest, context: grpc.ServicerContext) -> pb.TensorInfo:
        return self.coordinator.commit(request.name, request.version)

    @rpc_errors
    def AbortTensor(self, request: pb.AbortTensorRequest,
                    context: grpc.ServicerContext) -> pb.AbortTensorResponse:
        if request.put_token and request.version:
            raise InvalidArgument("give either version or put_token, not both")
        if request.put_token:
            return pb.AbortTensorResponse(version=self.coordinator.abort_put(request.name, request.put_token))
        self.coordinator.abort(request.name, request.version)
        return pb.AbortTensorResponse(version=request.version)

    @rpc_errors
    def GetTensor(self, request: pb.GetTensorRequest, context: grpc.ServicerContext) -> pb.TensorInfo:
        return self.coordinator.get(request.name)

    @rpc_errors
    def ListTensors(self, request: pb.ListTensorsRequest,
                    context: grpc.ServicerContext) -> pb.ListTensorsResponse:
        return pb.ListTensorsResponse(tensors=self.coordinator.list(request.include_pending))

    @rpc_errors
    def Reshard(self, request: pb.ReshardRequest, context: grpc.ServicerContext) -> Iterator[pb.ReshardProgress]:
        yield from self.coordinator.reshards.reshard(request)

    @rpc_errors
    def InspectCheckpoint(self, request: pb.InspectCheckpointRequest,
                          context: grpc.ServicerContext) -> pb.InspectCheckpointResponse:
        return inspect_checkpoint(request.path)

    @rpc_errors
    def LoadCheckpoint(self, request: pb.LoadCheckpointRequest,
                       context: grpc.ServicerContext) -> Iterator[pb.CheckpointProgress]:
        yield from self.coordinator.checkpoints.load(request)

    @rpc_errors
    def SaveCheckpoint(self, request: pb.SaveCheckpointRequest,
                       context: grpc.ServicerContext) -> Iterator[pb.CheckpointProgress]:
        yield from self.coordinator.checkpoints.save(request)

    @rpc_errors
    def DeleteTensor(self, request: pb.DeleteTensorRequest,
                     context: grpc.ServicerContext) -> pb.DeleteTensorResponse:
        self.coordinator.delete(request.name)
        return pb.DeleteTensorResponse()
