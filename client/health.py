"""The client's side of rank and tensor health: which ranks, copies and paths are usable now, as leases.

The coordinator says which ranks are dead (ListRanks) and which copies of a tensor cannot be read (its info,
server/coordinator/ranks/health.py); this client adds what its own calls found: a rank that could not be reached or
did not answer in time (its copies are read last), and a fast path that failed for a rank (the next path serves
it). RankHealth holds every such conclusion as a lease with an expiry, never for the life of the client: the
coordinator's word is asked again once it is LEASE_S old while it names a dead rank (or a lease of this client
ran out), so a rank that comes back is read again within about LEASE_S + a heartbeat of the coordinator seeing
it alive, with no new connect(). A read or lookup touching a box the coordinator reports with no readable copy
raises before any rank is asked (`unreadable`): RankUnavailableError, retried until the call's deadline, while
its ranks may come back; ShardsLostError only once every copy is known gone. The rest of the tensor reads as
usual, from live copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence, Set
from typing import Generic, TypeVar

import grpc

from shardserve.client.errors import RankUnavailableError, ShardsLostError
from shardserve.client.info import TensorSummary
from shardserve.client.ranks import RankDirectory, RanksView
from shardserve.core.health import copies_by_box, lost_boxes_in, pick_copy, ranks_of_copies
from shardserve.core.metadata import Box, ShardedTensorMetadata

log = logging.getLogger(__name__)

BOXES_NAMED = 8  # an error names this many lost boxes, then counts the rest
LEASE_S = 1.0  # the coordinator's word (dead ranks, a tensor's unreadable copies) is asked again this often
UNREACHABLE_S = (
    2.0  # a rank that failed a call as unreachable (or lost a hedge): its copies are read last
)
RETRY_AFTER_S = 30.0  # a rank whose fast path failed is served by the next path this long


K = TypeVar("K", bound=Hashable)


class Leases(Generic[K]):
    """Conclusions that hold until their expiry: take(key, seconds), holds(key), live() drops the expired."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._until: dict[K, float] = {}
        self._lock = threading.Lock()

    def take(self, key: K, seconds: float) -> None:
        """Hold `key` for `seconds` from now (a later expiry of the same key wins)."""
        until = self._clock() + seconds
        with self._lock:
            self._until[key] = max(until, self._until.get(key, until))

    def holds(self, key: K) -> bool:
        with self._lock:
            return self._until.get(key, float("-inf")) > self._clock()

    def live(self) -> tuple[frozenset[K], int]:
        """(the keys held now, how many expired since the last call)."""
        if not self._until:
            return frozenset(), 0
        now = self._clock()
        with self._lock:
            expired = [key for key, until in self._until.items() if until <= now]
            for key in expired:
                del self._until[key]
            return frozenset(self._until), len(expired)


class RankHealth:
    """Which ranks, copies and paths this client may use now: the coordinator's word and its own failures, each
    a lease (module docstring)."""

    def __init__(
        self,
        ranks: RankDirectory,
        *,
        clock: Callable[[], float] = time.monotonic,
        lease_s: float = LEASE_S,
    ) -> None:
        self.ranks = ranks
        self.lease_s = lease_s
        self._clock = clock
        self._unreachable: Leases[int] = Leases(clock)  # rank -> its copies are read last
        self._backoff: Leases[tuple[str, str]] = Leases(
            clock
        )  # (path, address) -> the next path serves it
        self._recheck = (
            False  # a lease of this client ran out: ask the coordinator at the next question
        )
        self._asking = threading.Lock()

    # ------------------------------------------------------------ the coordinator's word

    def view(self, *, needed: bool = False) -> RanksView:
        """The latest ListRanks answer, asked again first when it is LEASE_S old and it names a dead rank,
        `needed` says so, or a lease of this client ran out (one thread asks; the others use its answer)."""
        view = self.ranks.view()
        stale = self._clock() - view.answered_at >= self.lease_s
        if not stale or not (needed or self._recheck or view.dead):
            return view
        with self._asking:
            view = self.ranks.view()
            if self._clock() - view.answered_at >= self.lease_s:
                try:
                    self.ranks.refresh()
                    self._recheck = False
                except Exception as err:  # noqa: BLE001 - the coordinator unreachable: keep its last word
                    log.debug("asking the coordinator for the ranks failed: %s", err)
            return self.ranks.view()

    def dead_ranks(self) -> frozenset[int]:
        """The ranks the coordinator reports dead (its answer at most LEASE_S old while it names one)."""
        return self.view().dead

    def rank_reported_dead(self, rank: int) -> RankUnavailableError | None:
        """The error to end a read waiting on `rank` with when the coordinator reports it dead, else None (asks
        ListRanks at most once per LEASE_S, however many reads wait)."""
        status = self.view(needed=True).statuses.get(rank)
        if status is None or status.alive:
            return None
        return RankUnavailableError(
            f"rank {rank} at {status.address} did not answer and the coordinator at "
            f"{self.ranks.where} reports it dead",
            grpc.StatusCode.UNAVAILABLE,
        )

    def summary_expired(self, summary: TensorSummary) -> bool:
        """Whether `summary` names unreadable copies and is LEASE_S old: the tensor's info is asked again."""
        return bool(summary.unavailable) and self._clock() - summary.answered_at >= self.lease_s

    def unavailable_shards(self, summary: TensorSummary) -> frozenset[int]:
        """The shards of `summary` with no readable copy as the coordinator says: lost, or on a rank reported
        dead (in the summary's answer, or at a ListRanks answered after it: a newer answer wins)."""
        view = self.view()
        if view.answered_at <= summary.answered_at or not view.dead:
            return summary.unavailable
        return summary.unavailable | _shards_on(summary, view.dead)

    # ------------------------------------------------------------ this client's conclusions

    def note_failure(self, rank: int, err: BaseException) -> None:
        """Read `rank`'s copies last for UNREACHABLE_S when `err` says it could not be reached."""
        if isinstance(err, RankUnavailableError) and not isinstance(err, ShardsLostError):
            self._unreachable.take(rank, UNREACHABLE_S)
            log.info(
                "rank %d could not be reached; its copies are read last for %.0f s: %s",
                rank,
                UNREACHABLE_S,
                err,
            )

    def note_slow(self, rank: int) -> None:
        """Read `rank`'s copies last for UNREACHABLE_S: a part of it lost to a hedge (it did not answer)."""
        self._unreachable.take(rank, UNREACHABLE_S)
        log.warning(
            "rank %d did not answer within the hedge delay and another copy did; its copies are read "
            "last for %.0f s",
            rank,
            UNREACHABLE_S,
        )

    def unreachable_ranks(self) -> frozenset[int]:
        """The ranks that failed a call as unreachable within their lease; an expired lease makes the next
        question ask the coordinator again."""
        held, expired = self._unreachable.live()
        if expired:
            self._recheck = True
        return held

    def suspect_shards(self, summary: TensorSummary) -> frozenset[int]:
        """The shards of `summary` on ranks that failed this client's calls lately (their copies are read last)."""
        unreachable = self.unreachable_ranks()
        return _shards_on(summary, unreachable) if unreachable else frozenset()

    def other_copies(self, summary: TensorSummary, index: int) -> list[int]:
        """The other readable copies of shard `index` of `summary` on other ranks, the best first (for a
        hedge: client.paths.hedging)."""
        return other_copies(
            summary.metadata, index, self.unavailable_shards(summary), self.suspect_shards(summary)
        )

    # ------------------------------------------------------------ paths

    def back_off(self, path: str, address: str, seconds: float = RETRY_AFTER_S) -> None:
        """Serve the rank at `address` by the next path for `seconds`: `path` failed for it."""
        self._backoff.take((str(path), address), seconds)

    def backing_off(self, path: str, address: str) -> bool:
        """Whether `path` is within a back-off lease for the rank at `address`."""
        return self._backoff.holds((str(path), address))


def other_copies(
    meta: ShardedTensorMetadata,
    index: int,
    unavailable: Set[int] = frozenset(),
    suspect: Set[int] = frozenset(),
) -> list[int]:
    """The other available copies of shard `index`'s box on other ranks, the best first (unsuspected ones, in
    layout order), for a hedge."""
    shard = meta.shards_metadata[index]
    copies = [
        i
        for i in copies_by_box(meta).get(shard.box, [])
        if i != index and i not in unavailable and meta.shards_metadata[i].rank != shard.rank
    ]
    ordered = []
    while copies:
        best = pick_copy(meta, copies, suspect=suspect)
        ordered.append(best)
        copies.remove(best)
    return ordered


def _shards_on(summary: TensorSummary, ranks: Set[int]) -> frozenset[int]:
    """The placed shards of `summary` on `ranks`."""
    return frozenset(
        i
        for i, shard in enumerate(summary.metadata.shards_metadata)
        if shard.placement and shard.rank in ranks
    )


def check_readable(summary: TensorSummary, box: Box, unavailable: Set[int]) -> None:
    """The error of `unreadable` when part of `box` lies in a box of `summary` with no readable copy."""
    without_copy = lost_boxes_in(summary.metadata, box, unavailable)
    if without_copy:
        raise unreadable(summary, without_copy)


def unreadable(summary: TensorSummary, boxes: Sequence[Box]) -> RankUnavailableError:
    """The error for a read that needs `boxes` of `summary`, which have no readable copy: ShardsLostError
    (DATA_LOSS) for those whose every copy is known gone, else RankUnavailableError (UNAVAILABLE: their ranks
    are down, hung, partitioned or restoring, and the read is retried until its deadline)."""
    gone = [b for b in boxes if b in lost_boxes_in(summary.metadata, b, summary.lost)]
    if gone:
        return shards_lost(summary, gone)
    ranks = ranks_of_copies(summary.metadata, boxes)
    return RankUnavailableError(
        f"tensor {summary.name!r} version {summary.version}: {len(boxes)} box(es) {_named(boxes)} have no "
        f"copy on a live rank ({_ranks(ranks)} holding them down, hung, partitioned or restoring)",
        grpc.StatusCode.UNAVAILABLE,
        metadata={"tensor": summary.name, "ranks": ",".join(map(str, ranks))},
    )


def shards_lost(summary: TensorSummary, boxes: Sequence[Box]) -> ShardsLostError:
    """The error for a read that needs `boxes` of `summary`, whose every copy is known gone."""
    ranks = ranks_of_copies(summary.metadata, boxes)
    return ShardsLostError(
        f"tensor {summary.name!r} version {summary.version}: {len(boxes)} box(es) {_named(boxes)} have no copy "
        f"left ({_ranks(ranks)} holding them restarted without them); the tensor's other boxes stay "
        f"readable, and a put with overwrite=True replaces the tensor",
        metadata={"tensor": summary.name, "ranks": ",".join(map(str, ranks))},
        boxes=tuple((b.offsets, b.sizes) for b in boxes),
        ranks=tuple(ranks),
    )


def _named(boxes: Sequence[Box]) -> str:
    named = ", ".join(f"(offsets={b.offsets}, sizes={b.sizes})" for b in boxes[:BOXES_NAMED])
    return named + (f" and {len(boxes) - BOXES_NAMED} more" if len(boxes) > BOXES_NAMED else "")


def _ranks(ranks: Sequence[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
