"""The coordinator's rank registry: who is registered, who is alive, and who is restoring its persist dir.

Calls to the registered ranks go through server/coordinator/ranks/calls.py, which asks the registry for each
rank's stub and liveness.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, replace

import grpc

from shardserve.core.metadata import RemoteDevice, ShardedTensorMetadata
from shardserve.protos import shardserve_pb2_grpc as pb_grpc
from shardserve.server.common.auth import Security, make_channel
from shardserve.server.common.errors import (
    InvalidArgument,
    InvalidState,
    RankNotRegistered,
    RankUnavailable,
    ServiceError,
    WorldMismatch,
)
from shardserve.server.common.requests import check_name, check_version
from shardserve.server.coordinator.ranks.encoded import rank_stub
from shardserve.server.coordinator.ranks.heartbeats import HeartbeatPolicy
from shardserve.server.coordinator.ranks.info import RankInfo, RestoreProgress

log = logging.getLogger(__name__)


@dataclass
class RankEntry:
    """A registered rank: what it told us, when it last spoke (and what it said then: kept here, so that a
    heartbeat changes two fields and copies nothing), the interval it was told, and a stub to call it."""

    info: RankInfo
    last_heartbeat: float  # self._clock()
    channel: grpc.Channel
    stub: pb_grpc.ShardServerStub
    interval: float = 1.0  # the heartbeat interval it was last told
    dead_after: float = 2.0  # the silence that marks it dead, for that interval
    memory_used_bytes: int = 0
    last_heartbeat_unix: float = 0.0
    exited: bool = False
    reported_dead: bool = False
    missed: bool = False  # a call to it was skipped or failed while it was taken for dead
    exited_at: float = 0.0  # self._clock() when its process was known to end

    def tell(self, interval: float, policy: HeartbeatPolicy) -> float:
        """Record that the rank is told `interval` (and so when it is dead); `interval`."""
        self.interval, self.dead_after = interval, policy.dead_after_for(interval)
        return interval


class RankRegistry:
    """Registered ranks with their liveness and restore progress, and a channel to each."""

    def __init__(
        self,
        security: Security = Security(),
        dead_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stub_of: Callable[[grpc.Channel], pb_grpc.ShardServerStub] = rank_stub,
        *,
        heartbeats: HeartbeatPolicy = HeartbeatPolicy(),
    ) -> None:
        """`heartbeats`: the intervals ranks are told and when a silent one is dead (ranks/heartbeats.py);
        `dead_after`, when given, fixes the latter. `clock`: what liveness and settling are measured by
        (seconds, monotonic); `stub_of`: how a registered rank's channel is called. Tests pass a fake clock,
        or stand-in stubs."""
        self.security = security
        self.heartbeats = (
            heartbeats if dead_after is None else replace(heartbeats, dead_after=dead_after)
        )
        self._clock = clock
        self.stub_of = stub_of
        self._ranks: dict[int, RankEntry] = {}
        self._worlds: Counter[int] = Counter()  # registered entries by world size
        self._by_address: dict[str, int] = {}  # the rank that last registered each address
        self._ranks_changed = threading.Condition()
        self._started = self._clock()
        # the last registration, exit, return from the dead or restore
        self._changed_at = self._started
        self._restoring: dict[int, RestoreProgress] = {}  # rank -> its restore, until re-promoted

    # ------------------------------------------------------------ membership and liveness

    def register(self, info: RankInfo, held: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
        """Add (or replace) a rank; return the (name, version) pairs it says it holds."""
        _check_rank_info(info)
        held = list(held)
        for i, (name, version) in enumerate(
            held
        ):  # version 0 would make the reconcile drop every version of the name
            check_name(name, f"held[{i}].name")
            check_version(version, f"held[{i}].version")
        channel = make_channel(info.address, self.security)
        entry = RankEntry(
            info,
            self._clock(),
            channel,
            self.stub_of(channel),
            memory_used_bytes=info.memory_used_bytes,
            last_heartbeat_unix=info.last_heartbeat_unix,
        )
        try:
            with self._ranks_changed:
                self._check_fits_the_world(info)
                old = self._ranks.get(info.rank)
                entry.info = replace(info, restarts=_restarts_after(old, info))
                self._ranks[info.rank] = entry
                if old is not None:
                    self._worlds[old.info.world_size] -= 1
                    if not self._worlds[old.info.world_size]:
                        del self._worlds[old.info.world_size]
                self._worlds[info.world_size] += 1
                self._by_address[info.address] = info.rank
                entry.tell(
                    self.heartbeats.interval_for(_cluster_size(len(self._ranks), self._worlds)),
                    self.heartbeats,
                )
                self._changed_at = self._clock()
                self._ranks_changed.notify_all()
        except ServiceError:
            channel.close()
            raise
        if old is not None:
            old.channel.close()
        log.info(
            "rank %d registered: %s device %s pid %d on %s%s",
            info.rank,
            info.address,
            info.device,
            info.pid,
            info.hostname,
            f" (restart {entry.info.restarts})" if entry.info.restarts else "",
        )
        return set(held)

    def report_restore(self, progress: RestoreProgress) -> None:
        """Record a rank's restore of its persist dir (it registers once the files are read). FAILED_PRECONDITION
        while the rank's registered process is alive: its shards must never turn unavailable by a report."""
        _check_restore(progress)
        with self._ranks_changed:
            live = self._ranks.get(progress.rank)
            if live is not None and self.is_alive(
                live
            ):  # a serving process restores nothing; its successor
                raise InvalidState(
                    f"rank {progress.rank} is registered (pid {live.info.pid}) and alive; a "
                    f"restore is reported by its next process, once this one is dead"
                )
            first = progress.rank not in self._restoring
            self._restoring[progress.rank] = progress
        if first or progress.loaded:
            log.info(
                "rank %d (pid %d) %s its persist dir: %d of %d bytes, %d of %d tensors",
                progress.rank,
                progress.pid,
                "has read" if progress.loaded else "is restoring",
                progress.done_bytes,
                progress.total_bytes,
                progress.done_tensors,
                progress.total_tensors,
            )

    def restoring(self, rank: int) -> bool:
        """Whether `rank` is restoring: reading its persist dir, or registered and not yet re-promoted."""
        with self._ranks_changed:
            return rank in self._restoring

    def restore_done(self, rank: int) -> None:
        """`rank`'s restored versions are promoted again: its shards serve reads from now on."""
        with self._ranks_changed:
            done = self._restoring.pop(rank, None)
            self._changed_at = self._clock()
        if done is not None:
            log.info(
                "rank %d is restored: %d bytes, %d tensors",
                rank,
                done.total_bytes,
                done.total_tensors,
            )

    def _check_fits_the_world(self, info: RankInfo) -> None:
        """(lock held) A registration must agree with the live ranks: one world size, its own address, and not
        replace a live registration of the same rank from elsewhere (else a stray registration would take a rank
        over, or make the reconcile drop another rank's versions). A restarted rank whose old entry is still
        alive gets UNAVAILABLE, which its registration retries until that entry expires."""
        # registrations that agree with every registered rank, the usual case, are checked without a walk over
        # all of them: a thousand ranks registering at once would make a million checks
        if set(self._worlds) - {info.world_size}:
            for rank, entry in self._ranks.items():
                if rank == info.rank or not self.is_alive(entry):
                    continue
                if entry.info.world_size != info.world_size:
                    raise WorldMismatch(
                        f"rank.world_size {info.world_size} differs from the world size "
                        f"{entry.info.world_size} of registered rank {rank}",
                        metadata={"field": "rank.world_size", "rank": info.rank},
                    )
        holder = self._ranks.get(self._by_address.get(info.address, -1))
        if (
            holder is not None
            and holder.info.rank != info.rank
            and holder.info.address == info.address
            and self.is_alive(holder)
        ):
            raise InvalidState(
                f"rank.address {info.address} is registered by rank {holder.info.rank}, which is alive"
            )
        own = self._ranks.get(info.rank)
        if own is not None and self.is_alive(own) and own.info.address != info.address:
            raise RankUnavailable(
                f"rank {info.rank} is registered at {own.info.address} and alive; a registration "
                f"from rank.address {info.address} is taken once that one stops heartbeating",
                metadata={"rank": info.rank},
            )

    def heartbeat(self, rank: int, memory_used: int) -> tuple[bool, float]:
        """Record that `rank` is alive (RankNotRegistered tells an unknown rank to register again): whether it had
        been reported dead (what it holds must then be reconciled), and the interval to tell it."""
        if memory_used < 0:
            raise InvalidArgument(f"memory_used_bytes must be >= 0, got {memory_used}")
        with self._ranks_changed:
            entry = self._ranks.get(rank)
            if entry is None or entry.exited:
                raise RankNotRegistered(
                    f"rank {rank} is not registered; register again", metadata={"rank": rank}
                )
            was_dead = entry.reported_dead or not self.is_alive(entry)
            entry.last_heartbeat = self._clock()
            entry.memory_used_bytes, entry.last_heartbeat_unix = memory_used, time.time()
            if was_dead:
                entry.reported_dead = False
                self._changed_at = entry.last_heartbeat
            interval = entry.tell(
                self.heartbeats.interval_for(_cluster_size(len(self._ranks), self._worlds)),
                self.heartbeats,
            )
        return was_dead, interval

    def note_missed(self, rank: int) -> None:
        """A call to `rank` was skipped (it was not alive) or failed: what it holds may differ from the catalog
        (a drop it never got), so it is reconciled when it heartbeats again."""
        with self._ranks_changed:
            entry = self._ranks.get(rank)
            if entry is not None:
                entry.missed = True

    def take_missed(self, rank: int) -> bool:
        """Whether a call to `rank` was missed since this was last asked (and forget it)."""
        with self._ranks_changed:
            entry = self._ranks.get(rank)
            missed = entry is not None and entry.missed
            if missed:
                entry.missed = False  # type: ignore[union-attr]
        return missed

    def interval_of(self, rank: int) -> float:
        """The heartbeat interval `rank` was last told (RankUnavailable when it is not registered)."""
        return self.entry(rank).interval

    def mark_exited(self, rank: int, reason: str) -> None:
        """Mark a rank dead at once (its process is known to have ended; a restore it reported ends with it)."""
        with self._ranks_changed:
            self._restoring.pop(rank, None)
            entry = self._ranks.get(rank)
            if entry is None or entry.exited:
                return
            entry.exited = entry.reported_dead = True
            entry.exited_at = self._changed_at = self._clock()
        log.error("rank %d is dead: %s", rank, reason)

    def report_dead(self) -> None:
        """Log each rank that stopped heartbeating, once (a change of the ranks: changed_at)."""
        with self._ranks_changed:
            for entry in self._ranks.values():
                if not entry.reported_dead and not self.is_alive(entry):
                    entry.reported_dead = True
                    self._changed_at = self._clock()
                    log.error(
                        "rank %d (%s) missed heartbeats for %.1fs: marked dead",
                        entry.info.rank,
                        entry.info.address,
                        self._clock() - entry.last_heartbeat,
                    )

    def changed_at(self) -> float:
        """When (by the clock) a rank last registered, exited, was reported dead, came back from the dead or
        finished restoring."""
        with self._ranks_changed:
            return self._changed_at

    def is_alive(self, entry: RankEntry) -> bool:
        """Whether the registered `entry` is alive: its process has not ended and it heartbeats."""
        return not entry.exited and self._clock() - entry.last_heartbeat <= entry.dead_after

    def rank_alive(self, rank: int) -> bool:
        """Whether `rank` is registered and alive."""
        with self._ranks_changed:
            entry = self._ranks.get(rank)
        return entry is not None and self.is_alive(entry)

    def rank_dead(self, rank: int) -> bool:
        """Whether `rank` is known to be down: registered and not alive, or never registered past the
        unregistered grace (right after a coordinator restart a rank is not dead until it had time to register
        again)."""
        return self.dead_for(rank) is not None

    def rank_unreadable(self, rank: int) -> bool:
        """Whether `rank`'s copies cannot be read now: it is down (rank_dead), or restoring and not re-promoted."""
        return self.rank_dead(rank) or self.restoring(rank)

    def dead_for(self, rank: int) -> float | None:
        """Seconds `rank` has been dead (None while alive): since its process ended or its heartbeats stopped
        counting. A rank not registered counts as dead from the unregistered grace after the registry began
        (HeartbeatPolicy.unregistered_grace; a coordinator restarted while that rank was down never hears from
        it)."""
        now = self._clock()
        with self._ranks_changed:
            entry = self._ranks.get(rank)
            if entry is None:
                grace = self.heartbeats.unregistered_grace(max(self._worlds, default=0))
                waited = now - self._started - grace
                return waited if waited > 0 else None
            if self.is_alive(entry):
                return None
            dead_since = (
                entry.exited_at if entry.exited else entry.last_heartbeat + entry.dead_after
            )
            return max(0.0, now - dead_since)

    def ranks(self) -> list[RankInfo]:
        """Every registered rank with its liveness, by rank."""
        with self._ranks_changed:
            entries = sorted(self._ranks.values(), key=lambda e: e.info.rank)
            out = [
                replace(
                    entry.info,
                    alive=self.is_alive(entry),
                    restore=self._restoring.get(entry.info.rank),
                    memory_used_bytes=entry.memory_used_bytes,
                    last_heartbeat_unix=entry.last_heartbeat_unix,
                )
                for entry in entries
            ]
            for rank in sorted(
                set(self._restoring) - set(self._ranks)
            ):  # not registered yet (a cluster restart)
                progress = self._restoring[rank]
                out.append(
                    RankInfo(
                        rank=rank, pid=progress.pid, hostname=progress.hostname, restore=progress
                    )
                )
        return sorted(out, key=lambda info: info.rank)

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

    def entry(self, rank: int) -> RankEntry:
        """The registered `rank`; RankUnavailable when it is not registered."""
        with self._ranks_changed:
            entry = self._ranks.get(rank)
        if entry is None:
            raise RankUnavailable(f"rank {rank} is not registered")
        return entry

    def check_placements(self, meta: ShardedTensorMetadata, skip: Set[int] = frozenset()) -> None:
        """Every shard of `meta` (but those at indices `skip`) on a registered, live rank, on that rank's device."""
        with self._ranks_changed:
            entries = dict(self._ranks)
        # a layout names a few placements (a thousand shards, ten ranks): each is checked once
        checked: set[RemoteDevice | None] = set()
        for i, shard in enumerate(meta.shards_metadata):
            if i in skip or shard.placement in checked:
                continue
            entry = entries.get(shard.rank)
            field = f"metadata.shards_metadata[{i}].placement"
            if entry is None:
                raise self._unregistered(shard.rank, entries, f"{field} {shard.placement}")
            if not self.is_alive(entry):
                raise RankUnavailable(
                    f"{field} {shard.placement}: rank {shard.rank} is not alive",
                    metadata={"rank": shard.rank, "field": field},
                )
            if shard.device != RemoteDevice(f"rank:{shard.rank}/{entry.info.device}").device():
                raise InvalidArgument(
                    f"{field} {shard.placement}: rank {shard.rank}'s device is {entry.info.device}"
                )
            checked.add(shard.placement)

    def _unregistered(
        self, rank: int, entries: dict[int, RankEntry], where: str
    ) -> RankUnavailable | InvalidArgument:
        """The error of a placement on `rank`, which is not registered: RankUnavailable (retryable) while it may
        still come (this coordinator began less than the unregistered grace ago, a new leader or a restart, and
        the rank is inside the registered ranks' world), else InvalidArgument."""
        worlds = {entry.info.world_size for entry in entries.values()}
        inside = not worlds or rank < max(worlds)
        if inside and self.dead_for(rank) is None:
            return RankUnavailable(
                f"{where}: rank {rank} has not registered with this coordinator yet (it began "
                f"{self._clock() - self._started:.1f}s ago; ranks register again within a heartbeat): retry",
                metadata={"rank": rank},
            )
        return InvalidArgument(
            f"{where}: rank {rank} is not a registered rank (registered: {sorted(entries)})"
        )

    def close(self) -> None:
        """Close the rank channels."""
        with self._ranks_changed:
            for entry in self._ranks.values():
                entry.channel.close()


def _restarts_after(old: RankEntry | None, info: RankInfo) -> int:
    """The restart count of a registration: one more than the old entry's when a new process (another pid or
    host) registers the rank number; unchanged when the same process registers again."""
    if old is None:
        return 0
    same_process = old.info.pid == info.pid and old.info.hostname == info.hostname
    return old.info.restarts + (0 if same_process else 1)


def _check_restore(progress: RestoreProgress) -> None:
    """A restore report's counts: a rank number and done <= total, all non-negative."""
    if progress.rank < 0:
        raise InvalidArgument(f"rank must be >= 0, got {progress.rank}")
    for done, total in (("done_bytes", "total_bytes"), ("done_tensors", "total_tensors")):
        if not 0 <= getattr(progress, done) <= getattr(progress, total):
            raise InvalidArgument(
                f"{done} must be between 0 and {total} ({getattr(progress, total)}), got "
                f"{getattr(progress, done)}"
            )


def _cluster_size(registered: int, worlds: Counter[int]) -> int:
    """The ranks the heartbeat intervals are told for: the world the ranks declare (every one of them will
    register: the first are told the interval of all from the start, so that a thousand registering at once stay
    within the rate), or the registered ranks where there are more (dead ones of an older world)."""
    return max(registered, max(worlds, default=0))


def _check_rank_info(info: RankInfo) -> None:
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
